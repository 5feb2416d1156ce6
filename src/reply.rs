//! A response the filter sends itself instead of forwarding the request: a
//! deny, a rejection, the configured `failure_mode: deny` answer.

use crate::headers::Headers;

/// A local reply: status, headers and body, and the gRPC status a gRPC
/// request gets instead (`grpc-status`, the body as `grpc-message`, the
/// headers as metadata).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenyResponse {
    pub status: u32,
    pub headers: Headers,
    pub body: String,
    pub grpc_status: u32,
}

/// The gRPC status of a rejection by its HTTP status, as gRPC's own
/// mapping reads it (a limit's deny has a configured one instead).
pub fn grpc_status_of(http_status: u32) -> u32 {
    match http_status {
        400 => 3,  // INVALID_ARGUMENT
        401 => 16, // UNAUTHENTICATED
        403 => 7,  // PERMISSION_DENIED
        429 => 8,  // RESOURCE_EXHAUSTED
        503 => 14, // UNAVAILABLE
        _ => 2,    // UNKNOWN
    }
}

/// Whether a request is gRPC (`content-type: application/grpc`, with or
/// without a `+proto` suffix): its denials are answered as gRPC.
pub fn is_grpc(content_type: Option<&[u8]>) -> bool {
    content_type.is_some_and(|v| v.starts_with(b"application/grpc"))
}
