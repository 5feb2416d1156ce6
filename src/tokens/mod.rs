//! Token budgets: a request's cost is known only from its response (an
//! LLM's `usage`), so the request reserves an estimate before it is
//! forwarded and settles the difference once the response says what it
//! used (see `docs/tokens.md`).
//!
//! Pure parts only: [`json`] reads a number at a dotted path, [`usage`]
//! what a response used in each provider's shape, [`sse`]
//! passes a server-sent-events stream event by event within a budget, and
//! [`budget`] holds one request's reservations and splits its usage into
//! settlements. [`crate::flow::tokens`] drives them from the callbacks.

pub mod budget;
pub mod json;
pub mod sse;
pub mod usage;
