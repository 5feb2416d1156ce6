//! A response the filter sends itself instead of forwarding the request: a
//! deny, a rejection, the configured `failure_mode: deny` answer.

use crate::headers::Headers;

/// A local reply: status, headers and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenyResponse {
    pub status: u32,
    pub headers: Headers,
    pub body: String,
}
