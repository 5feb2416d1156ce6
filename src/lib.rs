//! meshlimit: global per-client rate limiting as a proxy-wasm HTTP filter.
//!
//! Everything that decides is plain Rust, unit-tested natively:
//! - [`config`]: the plugin configuration, parsed and validated once.
//! - What a request needs: [`rules`] (which rules match), [`client_id`]
//!   (who the client is), [`subject`] (whose counter each limit spends,
//!   from its `by` attributes), [`check`] (its limits, split into local and
//!   global parts once), built by [`decision::plan`].
//! - [`decision`]: meshlimitd's answer to a result, a result to a verdict;
//!   [`headers`] renders the RateLimit headers, [`reply`] holds a local reply.
//! - [`flow`]: the order of it all, per callback, over the [`host::Host`]
//!   trait: local rules, deny cache, breaker, group commit or a call of its
//!   own, answers, fallback.
//! - [`shared`]: state in proxy-wasm shared data (fallback counters,
//!   breaker, deny cache); [`batch`]: group commit's queue policy;
//!   [`algorithms`]: the four counting algorithms for local decisions.
//! - [`stats`]: every stat, declared once; [`throttle`]: bounded logging.
//!
//! Only `wasm` (compiled for wasm only) touches proxy-wasm: it reads each
//! callback, calls the flow, and carries out the step it returns.

// Tests may unwrap and index: a failing test should panic loudly.
#![cfg_attr(
    test,
    allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]
// The flow is driven by the wasm glue, which a native build leaves out;
// dead code is caught by the wasm build's lints instead.
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

pub(crate) mod algorithms;
pub(crate) mod batch;
pub(crate) mod check;
pub(crate) mod client_id;
pub mod config;
pub(crate) mod context_map;
pub mod decision;
pub(crate) mod flow;
pub(crate) mod headers;
pub mod host;
pub(crate) mod percent;
pub(crate) mod plan_memo;
pub(crate) mod reply;
pub(crate) mod rules;
pub mod shared;
pub(crate) mod stats;
pub(crate) mod subject;
#[cfg(test)]
mod testing;
pub(crate) mod throttle;
pub mod tokens;
pub(crate) mod trace_context;

#[cfg(target_arch = "wasm32")]
mod wasm;
