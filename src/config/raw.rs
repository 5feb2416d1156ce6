//! The configuration's wire shape: what serde reads, with defaults, before
//! [`super::validate`] checks it. Unknown fields are refused everywhere, so
//! a typo (`"burts"`) is an error naming the field, not a silent default.

use meshlimit_protocol::Algorithm;
use serde::Deserialize;

use super::{FailureMode, HeaderStyle, LogLevel, MissingAttribute, Scope, WhenMissing};
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) service: RawService,
    #[serde(default)]
    pub(super) client_id: RawClientId,
    pub(super) rules: Option<Vec<RawRule>>,
    #[serde(default = "default_failure_mode")]
    pub(super) failure_mode: FailureMode,
    #[serde(default)]
    pub(super) response: RawResponse,
    #[serde(default)]
    pub(super) local: RawLocal,
    #[serde(default)]
    pub(super) breaker: RawBreaker,
    #[serde(default)]
    pub(super) deny_cache: RawDenyCache,
    #[serde(default)]
    pub(super) group_commit: RawGroupCommit,
    #[serde(default)]
    pub(super) leases: RawLeases,
    #[serde(default)]
    pub(super) jwt: RawJwt,
    #[serde(default)]
    pub(super) allow_on_headers_stop_iteration: bool,
    #[serde(default)]
    pub(super) decision_log: RawDecisionLog,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawDecisionLog {
    pub(super) sample: f64,
    pub(super) denied_only: bool,
    pub(super) level: LogLevel,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawLeases {
    pub(super) enabled: bool,
    pub(super) max_units: u64,
    pub(super) interval: String,
    pub(super) slots: u32,
}

impl Default for RawLeases {
    fn default() -> Self {
        RawLeases {
            // On: a busy client's requests are decided without a call,
            // and every unit was charged in Redis before it was used.
            enabled: true,
            max_units: 10_000,
            interval: "2s".into(),
            slots: 4096,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawJwt {
    pub(super) filter: String,
    pub(super) payload_in_metadata: String,
}

impl Default for RawJwt {
    fn default() -> Self {
        RawJwt {
            filter: "envoy.filters.http.jwt_authn".into(),
            payload_in_metadata: "jwt_payload".into(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawGroupCommit {
    pub(super) enabled: bool,
    pub(super) max_batch: usize,
    pub(super) max_queue_age: String,
    pub(super) max_queued: usize,
    pub(super) max_calls_in_flight: usize,
}

impl Default for RawGroupCommit {
    fn default() -> Self {
        RawGroupCommit {
            // On: no slower when idle (a free call slot sends at once),
            // far fewer calls and more throughput under load.
            enabled: true,
            max_batch: 64,
            // Queue only while every call slot is busy: measured faster at
            // saturation than waiting for the call in flight (see
            // docs/benchmarks.md), and no slower when idle.
            max_queue_age: "0ms".into(),
            max_queued: 1024,
            max_calls_in_flight: 4,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawBreaker {
    pub(super) failures: u32,
    pub(super) open: String,
    pub(super) max_open: String,
}

impl Default for RawBreaker {
    fn default() -> Self {
        RawBreaker {
            failures: 5,
            open: "250ms".into(),
            max_open: "2s".into(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawDenyCache {
    pub(super) slots: u32,
}

impl Default for RawDenyCache {
    fn default() -> Self {
        RawDenyCache { slots: 4096 }
    }
}

pub(super) fn default_failure_mode() -> FailureMode {
    FailureMode::Local
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawService {
    pub(super) cluster: String,
    pub(super) authority: String,
    pub(super) timeout: String,
    pub(super) auth_token: Option<String>,
}

impl Default for RawService {
    fn default() -> Self {
        RawService {
            cluster: "meshlimit".into(),
            authority: "meshlimitd".into(),
            timeout: "20ms".into(),
            auth_token: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawClientId {
    pub(super) headers: Vec<String>,
    pub(super) query_params: Vec<String>,
    pub(super) when_missing: WhenMissing,
    pub(super) trusted_hops: u32,
    pub(super) reject_status: u32,
    pub(super) ipv6_prefix: u8,
}

impl Default for RawClientId {
    fn default() -> Self {
        RawClientId {
            headers: Vec::new(),
            query_params: Vec::new(),
            when_missing: WhenMissing::ClientAddress,
            trusted_hops: 0,
            reject_status: 401,
            ipv6_prefix: 64,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    pub(super) name: String,
    #[serde(default, rename = "match")]
    pub(super) matcher: RawMatch,
    #[serde(default)]
    pub(super) limits: Vec<RawLimit>,
    /// A number, a header (`RawCostHeader`) or a token cost
    /// (`RawTokenCost`, told apart by its `response`); read in
    /// [`super::validate`] so that each shape's errors name their field.
    pub(super) cost: Option<serde_json::Value>,
    #[serde(default)]
    pub(super) shadow: bool,
    #[serde(default = "default_scope")]
    pub(super) scope: Scope,
    pub(super) fallback_share: Option<f64>,
}

pub(super) fn default_scope() -> Scope {
    Scope::Global
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCostHeader {
    pub(super) header: String,
    #[serde(default = "one")]
    pub(super) default: u64,
    pub(super) max: u64,
}

/// A token budget's cost: reserved before the request, settled from the
/// response.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTokenCost {
    pub(super) response: RawUsage,
    #[serde(default)]
    pub(super) reserve: Option<RawReserve>,
    #[serde(default)]
    pub(super) mode: super::TokenMode,
    #[serde(default = "default_max_body_bytes")]
    pub(super) max_body_bytes: u64,
    #[serde(default = "yes")]
    pub(super) refund_on_error: bool,
}

fn default_max_body_bytes() -> u64 {
    1 << 20
}

fn yes() -> bool {
    true
}

/// Where a response reports its usage (at least one).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUsage {
    pub(super) json: Option<RawUsagePaths>,
    pub(super) sse_json: Option<RawUsagePaths>,
    pub(super) header: Option<String>,
    pub(super) provider: Option<crate::tokens::usage::Provider>,
}

/// One dotted path, or a sum of paths, each with a weight or not.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum RawUsagePaths {
    One(String),
    Sum(Vec<RawTerm>),
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum RawTerm {
    Path(String),
    Weighted(RawWeighted),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWeighted {
    pub(super) path: String,
    #[serde(default = "one")]
    pub(super) weight: u64,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum RawReserve {
    Fixed(u64),
    Request(RawReserveRequest),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReserveRequest {
    pub(super) request_json: String,
    pub(super) default: u64,
    pub(super) max: u64,
    #[serde(default = "four")]
    pub(super) prompt_bytes_per_token: u64,
    /// Default: on for `response.provider: openai`, off otherwise.
    #[serde(default)]
    pub(super) ask_stream_usage: Option<bool>,
}

fn four() -> u64 {
    4
}

pub(super) fn one() -> u64 {
    1
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawMatch {
    pub(super) path_prefix: Option<String>,
    pub(super) path: Option<RawPath>,
    pub(super) methods: Vec<String>,
    pub(super) hosts: Vec<String>,
    pub(super) headers: Vec<RawHeaderMatch>,
    pub(super) claims: Vec<RawHeaderMatch>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPath {
    pub(super) exact: Option<String>,
    pub(super) prefix: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHeaderMatch {
    pub(super) name: String,
    pub(super) exact: Option<String>,
    pub(super) prefix: Option<String>,
    #[serde(rename = "in")]
    pub(super) one_of: Option<Vec<String>>,
    pub(super) present: Option<bool>,
    pub(super) absent: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimit {
    pub(super) name: String,
    pub(super) requests: u64,
    pub(super) window: Option<String>,
    #[serde(default = "default_algorithm")]
    pub(super) algorithm: Algorithm,
    pub(super) burst: Option<u64>,
    pub(super) by: Option<Vec<String>>,
    #[serde(default)]
    pub(super) missing: MissingAttribute,
    #[serde(default)]
    pub(super) overrides: Vec<RawOverride>,
    pub(super) calendar: Option<meshlimit_protocol::CalendarUnit>,
    pub(super) utc_offset: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOverride {
    pub(super) subjects: Vec<String>,
    pub(super) requests: u64,
}

pub(super) fn default_algorithm() -> Algorithm {
    Algorithm::FixedWindow
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawResponse {
    pub(super) status: u32,
    pub(super) body: String,
    pub(super) headers: HeaderStyle,
    pub(super) grpc_status: u32,
}

impl Default for RawResponse {
    fn default() -> Self {
        RawResponse {
            status: 429,
            body: "rate limit exceeded\n".into(),
            headers: HeaderStyle::Draft,
            // RESOURCE_EXHAUSTED: what gRPC clients read as "slow down",
            // where the HTTP 429's mapping (UNAVAILABLE) makes them retry.
            grpc_status: 8,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawLocal {
    pub(super) slots: u32,
    /// Envoys expected to share a global limit; the default fallback share
    /// is one over this.
    pub(super) expected_replicas: u32,
}

impl Default for RawLocal {
    fn default() -> Self {
        RawLocal {
            slots: 4096,
            expected_replicas: 1,
        }
    }
}
