//! State in proxy-wasm shared data: one byte string per key, shared by every
//! worker of an Envoy (per `vm_id`), with compare-and-swap and no expiry.
//!
//! - [`store`]: the [`SharedStore`] trait and what every user of it needs:
//!   one CAS-retry helper, one keyed fingerprint, one word codec.
//! - [`keys`]: every key name the filter uses.
//! - [`fallback`]: per-Envoy counters for when meshlimitd cannot be asked.
//! - [`breaker`]: the circuit breaker around calls to meshlimitd.
//! - [`deny_cache`]: subjects known to be out of quota, denied without a call.
//! - [`lease`]: quota leased from meshlimitd, spent without a call.
//!
//! Shared data never expires, so every user keeps to a fixed set of keys:
//! memory is bounded by configuration, never by the number of clients.

pub(crate) mod breaker;
pub(crate) mod deny_cache;
pub(crate) mod fallback;
pub(crate) mod keys;
pub(crate) mod lease;
pub mod store;

pub use store::{SharedStore, StoreError};
