//! What the filter needs from its host, as traits, so that all of it, the
//! request flow included, runs (and is unit-tested) natively without Envoy.
//!
//! [`Host`] is everything [`crate::flow`] does to the outside world; the
//! proxy-wasm implementation (`crate::wasm::host`) is the only code that
//! touches `proxy_wasm`, and [`fake::FakeHost`] records what the flow did,
//! for tests. Each method is one hostcall, so a test can count them.

use crate::reply::DenyResponse;
pub use crate::shared::{SharedStore, StoreError};
use crate::stats::MetricKind;

#[cfg(test)]
pub mod fake;

/// Read access to the request being decided.
pub trait RequestView {
    /// Raw bytes of a request header (lower-case name). Bytes, not a
    /// `String`: Envoy passes obs-text through, and a UTF-8 conversion that
    /// fails must never be able to trap the VM.
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// Envoy's `source.address` property (`ip:port`).
    fn source_address(&self) -> Option<String>;
}

/// A check call to meshlimitd.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The Envoy cluster of meshlimitd instances.
    pub cluster: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
    pub body: &'a [u8],
    pub timeout_ms: u64,
    /// The `authorization` header meshlimitd asks for, if any.
    pub authorization: Option<&'a str>,
}

/// Everything the request flow does to its host. The request, the call
/// response and the stream operations act on the host's current (effective)
/// context.
pub trait Host: RequestView + SharedStore {
    /// Milliseconds since the Unix epoch, as the host's clock says.
    fn now_ms(&self) -> u64;
    /// Fresh random words (fingerprint seeds, queue names).
    fn random_seed(&self) -> (u64, u64);

    /// Defines a stat; its id, or `None` when the host refused it.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32>;
    fn increment_metric(&self, id: u32, delta: u64);
    fn record_metric(&self, id: u32, value: u64);

    /// Registers this worker's wake-up queue; its id.
    fn register_queue(&self, name: &str) -> Option<u32>;
    /// Puts a wake-up on `queue` (the root is called back); false if not.
    fn enqueue(&self, queue: u32) -> bool;

    /// Sends a call from the current context; its token.
    fn dispatch(&self, call: &Call<'_>) -> Result<u32, String>;
    /// A header of the answered call's response. Only asked when the host
    /// reported headers: after a timeout or reset there are none to read.
    fn call_response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// Up to `max` bytes of the answered call's response body.
    fn call_response_body(&self, max: usize) -> Option<Vec<u8>>;

    /// Makes `context_id` the current context (to act for a paused stream,
    /// or to make calls belong to the root again); false when it is gone.
    fn set_effective_context(&self, context_id: u32) -> bool;
    /// Lets the current (paused) request continue upstream.
    fn resume_request(&self) -> bool;
    /// Answers the current request locally.
    fn send_reply(&self, reply: &DenyResponse) -> bool;
    /// Adds a header to the current stream's response.
    fn add_response_header(&self, name: &str, value: &str);
}
