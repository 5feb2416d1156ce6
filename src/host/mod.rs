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
use crate::trace_context::TraceContext;

#[cfg(test)]
pub mod fake;
pub mod pairs;

pub use pairs::HeaderMap;

/// A request header, as the decision logic must tell its cases apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderValue {
    Absent,
    /// Sent once: this value.
    Once(Vec<u8>),
    /// Sent more than once: ambiguous, since an upstream may read another
    /// copy than the one counted (`x-api-key: victim`, `x-api-key: mine`).
    Repeated,
}

/// Read access to the request being decided.
pub trait RequestView {
    /// Every value of a request header (lower-case name), in order. Bytes,
    /// not a `String`: Envoy passes obs-text through, and a UTF-8
    /// conversion that fails must never be able to trap the VM.
    fn header_values(&self, name: &str) -> Vec<Vec<u8>>;
    /// Envoy's `source.address` property (`ip:port`).
    fn source_address(&self) -> Option<String>;
    /// An Envoy property (`connection.uri_san_peer_certificate`, a path
    /// into the dynamic metadata); `None` when absent or empty.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;

    /// Whether header `name` has exactly `values`, in order (none:
    /// absent); a `None` among them never matches.
    fn has_values_in(&self, name: &str, values: &mut dyn Iterator<Item = Option<&[u8]>>) -> bool {
        let have = self.header_values(name);
        same_values(have.iter().map(Vec::as_slice), values)
    }

    /// Hands every value of header `name` to `each`, in order; without a
    /// copy where the request holds its bytes.
    fn each_value(&self, name: &str, each: &mut dyn FnMut(&[u8])) {
        for value in self.header_values(name) {
            each(&value);
        }
    }

    /// A header that must be sent once to mean anything.
    fn header(&self, name: &str) -> HeaderValue {
        let mut values = self.header_values(name);
        match values.len() {
            0 => HeaderValue::Absent,
            1 => values.pop().map_or(HeaderValue::Absent, HeaderValue::Once),
            _ => HeaderValue::Repeated,
        }
    }
}

/// Whether `have` yields exactly `want`, in order (a `None` in `want`
/// never matches).
fn same_values<'a>(
    mut have: impl Iterator<Item = &'a [u8]>,
    want: &mut dyn Iterator<Item = Option<&[u8]>>,
) -> bool {
    for w in want {
        if w.is_none() || have.next() != w {
            return false;
        }
    }
    have.next().is_none()
}

/// Every value of header `name` in a header map, in order.
pub fn values_of(headers: &[(String, Vec<u8>)], name: &str) -> Vec<Vec<u8>> {
    headers
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
        .collect()
}

/// The request being decided: its headers, read from the host in one
/// hostcall, and the host for what is read only when needed.
pub struct Request<'h, H: Host> {
    headers: HeaderMap,
    host: &'h H,
}

impl<'h, H: Host> Request<'h, H> {
    pub fn read(host: &'h H) -> Self {
        Request {
            headers: host.request_headers(),
            host,
        }
    }

    /// Every header of the request.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// A header as text (lossy: only compared with configured text), empty
    /// when absent; the first when repeated (pseudo-headers are unique).
    pub fn text(&self, name: &str) -> std::borrow::Cow<'_, str> {
        self.headers
            .first(name)
            .map_or(std::borrow::Cow::Borrowed(""), String::from_utf8_lossy)
    }
}

impl<H: Host> RequestView for Request<'_, H> {
    fn header_values(&self, name: &str) -> Vec<Vec<u8>> {
        self.headers.values(name).map(<[u8]>::to_vec).collect()
    }

    fn has_values_in(&self, name: &str, values: &mut dyn Iterator<Item = Option<&[u8]>>) -> bool {
        // Compared in place: no copy of the request's values.
        same_values(self.headers.values(name), values)
    }

    fn header(&self, name: &str) -> HeaderValue {
        // As the default, copying only the one value that is used.
        let mut values = self.headers.values(name);
        match (values.next(), values.next()) {
            (None, _) => HeaderValue::Absent,
            (Some(value), None) => HeaderValue::Once(value.to_vec()),
            (Some(_), Some(_)) => HeaderValue::Repeated,
        }
    }

    fn each_value(&self, name: &str, each: &mut dyn FnMut(&[u8])) {
        for value in self.headers.values(name) {
            each(value);
        }
    }

    fn source_address(&self) -> Option<String> {
        self.host.source_address()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.host.property(path)
    }
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
    /// The trace context of the request the call is for (of the first
    /// such request of a batch), forwarded as headers.
    pub trace: Option<&'a TraceContext>,
}

/// Everything the request flow does to its host. The request, the call
/// response and the stream operations act on the host's current (effective)
/// context.
pub trait Host: SharedStore {
    /// Every header of the current request, in order (one hostcall; the
    /// flow reads them all at once rather than one crossing per header).
    fn request_headers(&self) -> HeaderMap;
    /// Envoy's `source.address` property (`ip:port`) of the current request.
    fn source_address(&self) -> Option<String>;
    /// A property of the current request (see [`RequestView::property`]).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;

    /// Milliseconds since the Unix epoch, as the host's clock says.
    fn now_ms(&self) -> u64;
    /// Fresh random words (fingerprint seeds, queue names).
    fn random_seed(&self) -> (u64, u64);

    /// Defines a stat; its id, or `None` when the host refused it.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32>;
    fn increment_metric(&self, id: u32, delta: u64);
    fn record_metric(&self, id: u32, value: u64);

    /// Calls the root's `on_tick` every `ms` milliseconds (from the root
    /// context); false if the host refused.
    fn set_tick_period(&self, ms: u32) -> bool;
    /// Tells the host that the root, whose `on_done` said it still had
    /// work, has finished it and may be deleted (`proxy_done`); false when
    /// the host was not waiting for it.
    fn done(&self) -> bool;

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
    /// Answers the current (gRPC) request locally with `reply.grpc_status`,
    /// its body as the message and its headers as metadata.
    fn send_grpc_reply(&self, reply: &DenyResponse) -> bool;
    /// Adds a header to the current stream's response.
    fn add_response_header(&self, name: &str, value: &str);

    /// A header of the current stream's response (`:status` included).
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// The first `size` bytes of the request body Envoy holds for the
    /// current stream (in a body callback: the chunk, or what is buffered).
    fn request_body(&self, size: usize) -> Option<Vec<u8>>;
    /// The same for the response body.
    fn response_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Removes a header of the current request (before it goes upstream:
    /// in its headers callback).
    fn remove_request_header(&self, name: &str) -> bool;
    /// Removes a header of the current response (in its headers callback,
    /// before it goes to the client).
    fn remove_response_header(&self, name: &str) -> bool;
    /// Replaces the first `size` bytes of the request body Envoy holds
    /// with `bytes` (in a body callback, the body buffered whole).
    fn replace_request_body(&self, size: usize, bytes: &[u8]) -> bool;
    /// Replaces the first `size` bytes of the response body with `bytes`.
    fn replace_response_body(&self, size: usize, bytes: &[u8]) -> bool;
    /// Adds `bytes` after the response body Envoy holds (buffered).
    fn append_response_body(&self, bytes: &[u8]) -> bool;
    /// Lets the current stream's paused response continue.
    fn resume_response(&self) -> bool;
}
