//! Names of the Envoy stats the filter defines. Envoy shows them under
//! `wasmcustom.` in its stats (e.g. `wasmcustom.meshlimit.requests_denied`).

/// Decisions made from meshlimitd's answer.
pub const REQUESTS_ALLOWED: &str = "meshlimit.requests_allowed";
pub const REQUESTS_DENIED: &str = "meshlimit.requests_denied";
/// Decisions of `scope: local` rules (never a call).
pub const LOCAL_ALLOWED: &str = "meshlimit.local_allowed";
pub const LOCAL_DENIED: &str = "meshlimit.local_denied";
/// Decisions made without meshlimitd (`failure_mode` at work).
pub const FALLBACK_ALLOWED: &str = "meshlimit.fallback_allowed";
pub const FALLBACK_DENIED: &str = "meshlimit.fallback_denied";
/// Local fallback decisions admitted uncounted because shared data failed.
pub const FALLBACK_UNCOUNTED: &str = "meshlimit.fallback_uncounted";
/// Requests a shadow rule would have denied (they were not denied).
pub const SHADOW_DENIED: &str = "meshlimit.shadow_denied";
/// Requests denied by the deny cache without calling meshlimitd.
pub const DENY_CACHE_HITS: &str = "meshlimit.deny_cache_hits";
/// Deny-cache entries of one client overwritten by another's while still
/// live: the cache is too small for the abusers at hand.
pub const DENY_CACHE_EVICTIONS: &str = "meshlimit.deny_cache_evictions";
/// Times the circuit breaker opened.
pub const BREAKER_OPENED: &str = "meshlimit.breaker_opened";
/// Gauge: 1 while the breaker is open, 0 once it closed again.
pub const BREAKER_OPEN: &str = "meshlimit.breaker_open";
/// Group commit: calls that carried a batch, and the checks they carried.
pub const BATCHES: &str = "meshlimit.batches";
pub const BATCHED_CHECKS: &str = "meshlimit.batched_checks";
/// Group commit: checks refused because the queue was full (decided by
/// failure_mode).
pub const BATCH_OVERFLOW: &str = "meshlimit.batch_overflow";
/// Requests refused before any check: no client id, an invalid cost
/// header, a cost above a limit's capacity.
pub const REJECTED_NO_CLIENT_ID: &str = "meshlimit.rejected_no_client_id";
pub const REJECTED_INVALID_COST: &str = "meshlimit.rejected_invalid_cost";
pub const REJECTED_COST_ABOVE_CAPACITY: &str = "meshlimit.rejected_cost_above_capacity";
/// Failed calls to meshlimitd, one stat per [`crate::decision::ServiceError`] kind.
pub const SERVICE_ERROR_KINDS: [&str; 5] = [
    "timeout",
    "connection",
    "unavailable",
    "bad_status",
    "bad_body",
];

pub fn service_error(kind: &str) -> String {
    format!("meshlimit.service_errors.{kind}")
}
