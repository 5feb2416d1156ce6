//! From a request to a verdict, without the host.
//!
//! [`plan`] says what a request needs (nothing, a rejection, or a
//! [`Check`]); [`read_answer`] and [`read_batch_answer`] turn meshlimitd's
//! answer, or the lack of one, into [`CheckResult`]s or a [`ServiceError`];
//! and [`verdict`] turns a result into what the client sees. The order in
//! which these run is [`crate::flow`]'s business.
//!
//! One file a phase: [`plan`] (`plan.rs`), the answer's reading
//! (`answer.rs`), the verdict (`verdict.rs`).

mod answer;
mod plan;
#[cfg(test)]
mod tests;
mod verdict;

pub use crate::reply::DenyResponse;
pub use answer::{
    read_answer, read_answer_heard, read_batch_answer, BatchAnswer, ServiceError, MAX_ANSWER_BYTES,
};
pub use plan::{plan, reserve_from_body, Plan, RejectReason};
pub use verdict::{
    cached_deny, combine, failure_deny, remember_denials, shadow_denials, verdict, Verdict,
};
