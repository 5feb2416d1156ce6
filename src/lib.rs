//! meshlimit: global per-client rate limiting as a proxy-wasm HTTP filter.
//!
//! The decision logic (configuration, rule matching, client identity, local
//! fallback counting, header rendering) is plain Rust behind the small
//! traits in [`host`], unit-tested natively. Only [`filter`] talks to the
//! proxy-wasm host, and it is compiled for wasm only.

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

pub mod algorithms;
pub mod batch;
pub mod breaker;
pub mod client_id;
pub mod config;
pub mod decision;
pub mod deny_cache;
pub mod duration;
pub mod headers;
pub mod host;
pub mod local;
pub mod rules;
pub mod stats;
pub mod throttle;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod filter;
