//! [`Host`] on proxy-wasm: each method is one hostcall, every status is a
//! `Result` or an `Option`, never a panic.

use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, GrpcStatusCode, MapType, MetricType, Status};

use super::abi;
use super::timers::{timed, Site};
use crate::host::{Call, HeaderMap, Host, SharedStore, StoreError};
use crate::reply::DenyResponse;
use crate::stats::MetricKind;

/// The Envoy this VM runs in, as the current context sees it.
pub(super) struct WasmHost;

/// proxy-wasm shared data (one per VM id, shared by all workers).
impl SharedStore for WasmHost {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        timed(Site::SharedGet, || hostcalls::get_shared_data(key)).map_err(|_| StoreError::Failed)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        // Envoy writes unconditionally with a token of 0 (the SDK's
        // `None`), and creates a missing key whatever the token. A write
        // over a key read missing passes a token no live key holds, so
        // that a key another worker created since is a mismatch, not
        // overwritten.
        set_shared(key, value, Some(cas.unwrap_or(CREATE_CAS)))
    }

    fn overwrite(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        set_shared(key, value, None)
    }
}

/// The token of a write over a key read missing: Envoy's tokens count up
/// from 1 over every write of the process, so a live key holds this one
/// only if its last write was the 4,294,967,295th, modulo 2^32, and that
/// other worker's creation raced ours.
const CREATE_CAS: u32 = u32::MAX;

fn set_shared(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
    timed(Site::SharedSet, || {
        hostcalls::set_shared_data(key, Some(value), cas)
    })
    .map_err(|e| match e {
        Status::CasMismatch => StoreError::CasMismatch,
        _ => StoreError::Failed,
    })
}

impl Host for WasmHost {
    fn request_headers(&self) -> HeaderMap {
        timed(Site::ReadHeaders, abi::request_headers).unwrap_or_default()
    }

    fn source_address(&self) -> Option<String> {
        hostcalls::get_property(vec!["source", "address"])
            .ok()
            .flatten()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec())
            .ok()
            .flatten()
            .filter(|v| !v.is_empty())
    }

    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64)
    }

    fn random_seed(&self) -> (u64, u64) {
        use std::hash::BuildHasher;
        // RandomState draws its keys from WASI random_get.
        let state = std::collections::hash_map::RandomState::new();
        (
            state.hash_one(0x6d65_7368_u64),
            state.hash_one(0x6c69_6d69_u64),
        )
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
        };
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment_metric(&self, id: u32, delta: u64) {
        let _ = hostcalls::increment_metric(id, i64::try_from(delta).unwrap_or(i64::MAX));
    }

    fn record_metric(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }

    fn set_tick_period(&self, ms: u32) -> bool {
        hostcalls::set_tick_period(std::time::Duration::from_millis(u64::from(ms))).is_ok()
    }

    fn done(&self) -> bool {
        hostcalls::done().is_ok()
    }

    fn register_queue(&self, name: &str) -> Option<u32> {
        hostcalls::register_shared_queue(name).ok()
    }

    fn enqueue(&self, queue: u32) -> bool {
        hostcalls::enqueue_shared_queue(queue, Some(b"w")).is_ok()
    }

    fn dispatch(&self, call: &Call<'_>) -> Result<u32, String> {
        let timeout = call.timeout_ms.to_string();
        let mut headers = vec![
            (":method", "POST"),
            (":path", call.path),
            (":authority", call.authority),
            ("content-type", "application/json"),
            // meshlimitd starts no work this call will not wait for.
            (meshlimit_protocol::TIMEOUT_HEADER, timeout.as_str()),
        ];
        if let Some(authorization) = call.authorization {
            headers.push(("authorization", authorization));
        }
        if let Some(trace) = call.trace {
            headers.extend(trace.headers());
        }
        timed(Site::Dispatch, || {
            hostcalls::dispatch_http_call(
                call.cluster,
                headers,
                Some(call.body),
                vec![],
                Duration::from_millis(call.timeout_ms),
            )
        })
        .map_err(|e| format!("{e:?}"))
    }

    fn call_response_header(&self, name: &str) -> Option<Vec<u8>> {
        abi::call_response_header(name)
    }

    fn call_response_body(&self, max: usize) -> Option<Vec<u8>> {
        timed(Site::ReadAnswer, || abi::call_response_body(max))
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        hostcalls::set_effective_context(context_id).is_ok()
    }

    fn resume_request(&self) -> bool {
        timed(Site::Resume, hostcalls::resume_http_request).is_ok()
    }

    fn send_reply(&self, reply: &DenyResponse) -> bool {
        let headers: Vec<(&str, &str)> = reply
            .headers
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .collect();
        hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes())).is_ok()
    }

    fn send_grpc_reply(&self, reply: &DenyResponse) -> bool {
        let metadata: Vec<(&str, &[u8])> = reply
            .headers
            .iter()
            .filter(|(k, _)| *k != "content-type")
            .map(|(k, v)| (*k, v.as_bytes()))
            .collect();
        hostcalls::send_grpc_response(
            grpc_code(reply.grpc_status),
            Some(reply.body.trim_end()),
            metadata,
        )
        .is_ok()
    }

    fn add_response_header(&self, name: &str, value: &str) {
        let _ = timed(Site::AddHeader, || {
            hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value)
        });
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
            .ok()
            .flatten()
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
            .ok()
            .flatten()
    }

    fn remove_request_header(&self, name: &str) -> bool {
        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, None).is_ok()
    }

    fn remove_response_header(&self, name: &str) -> bool {
        hostcalls::set_map_value(MapType::HttpResponseHeaders, name, None).is_ok()
    }

    fn replace_request_body(&self, size: usize, bytes: &[u8]) -> bool {
        hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, bytes).is_ok()
    }

    fn replace_response_body(&self, size: usize, bytes: &[u8]) -> bool {
        hostcalls::set_buffer(BufferType::HttpResponseBody, 0, size, bytes).is_ok()
    }

    fn append_response_body(&self, bytes: &[u8]) -> bool {
        // Envoy appends when the start is at or past the buffer's end.
        hostcalls::set_buffer(BufferType::HttpResponseBody, usize::MAX >> 1, 0, bytes).is_ok()
    }

    fn resume_response(&self) -> bool {
        hostcalls::resume_http_response().is_ok()
    }
}

/// The SDK's code for a gRPC status number (validated 1 to 16).
fn grpc_code(status: u32) -> GrpcStatusCode {
    match status {
        1 => GrpcStatusCode::Cancelled,
        2 => GrpcStatusCode::Unknown,
        3 => GrpcStatusCode::InvalidArgument,
        4 => GrpcStatusCode::DeadlineExceeded,
        5 => GrpcStatusCode::NotFound,
        6 => GrpcStatusCode::AlreadyExists,
        7 => GrpcStatusCode::PermissionDenied,
        9 => GrpcStatusCode::FailedPrecondition,
        10 => GrpcStatusCode::Aborted,
        11 => GrpcStatusCode::OutOfRange,
        12 => GrpcStatusCode::Unimplemented,
        13 => GrpcStatusCode::Internal,
        14 => GrpcStatusCode::Unavailable,
        15 => GrpcStatusCode::DataLoss,
        16 => GrpcStatusCode::Unauthenticated,
        _ => GrpcStatusCode::ResourceExhausted,
    }
}
