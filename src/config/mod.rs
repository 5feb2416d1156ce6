//! Plugin configuration: the JSON in Envoy's `configuration` (or Istio's
//! `pluginConfig`), parsed and validated once in `on_configure`.
//!
//! Every problem is reported as a [`ConfigError`] naming the field by its
//! path (`rules[0].limits[1].window`), because the operator only sees one
//! log line and must be able to fix the config from it alone.

use std::fmt;
use std::rc::Rc;

use meshlimit_protocol::{bounds, Algorithm};
use serde::Deserialize;

pub(crate) mod duration;
mod ranges;
mod raw;
/// The reference of every field: docs/configuration.md and the JSON
/// Schema are generated from it (native builds only).
#[cfg(not(target_arch = "wasm32"))]
pub mod reference;
#[cfg(test)]
mod tests;
mod validate;

/// A configuration the filter refuses to run with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the offending field, e.g. `rules[0].limits[0].requests`.
    pub field: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() || self.field == "." {
            write!(f, "invalid meshlimit configuration: {}", self.problem)
        } else {
            write!(
                f,
                "invalid meshlimit configuration: field `{}`: {}",
                self.field, self.problem
            )
        }
    }
}

fn err(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// The validated configuration the filter runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub service: ServiceConfig,
    pub client_id: ClientIdConfig,
    pub rules: Vec<Rule>,
    pub failure_mode: FailureMode,
    pub response: ResponseConfig,
    pub local: LocalConfig,
    pub breaker: BreakerConfig,
    /// Deny-cache slots; 0 turns the cache off.
    pub deny_cache_slots: u32,
    /// Coalescing concurrent checks into one call; `None` when off.
    pub group_commit: Option<crate::batch::BatchConfig>,
    /// Quota leases for busy clients; `None` when off.
    pub leases: Option<LeaseConfig>,
    /// Where `jwt:CLAIM` attributes are read.
    pub jwt: JwtSource,
    /// Envoy's Wasm `PluginConfig` sets `allow_on_headers_stop_iteration`
    /// (Envoy 1.35 and later): a request whose reservation is in its body
    /// holds its headers until it is decided, so a denied one never
    /// reaches the upstream.
    pub allow_on_headers_stop_iteration: bool,
    /// Why was a request decided so: a sampled log line per decision;
    /// `None` when off (the default).
    pub decision_log: Option<DecisionLogConfig>,
}

/// The decision log (`decision_log`): which decisions get a line, at
/// which level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecisionLogConfig {
    /// Decisions logged, per million (from `sample`, 0 to 1).
    pub sample_ppm: u32,
    /// Only denials (shadow denials included).
    pub denied_only: bool,
    pub level: LogLevel,
}

/// The level of the decision log's lines: `debug` shows only where the
/// proxy's wasm log level is debug (`/logging?wasm=debug` on Envoy's
/// admin port), `info` everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogLevel {
    #[default]
    Debug,
    Info,
}

/// The verified JWT payload in the request's dynamic metadata, as Envoy's
/// `jwt_authn` filter writes it with `payload_in_metadata` (Istio's
/// `RequestAuthentication` writes it as `payload` in current releases, as
/// the token's issuer in older ones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtSource {
    /// The metadata namespace: the filter's name.
    pub filter: String,
    /// The filter's `payload_in_metadata`.
    pub payload_in_metadata: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceConfig {
    /// Envoy cluster of `meshlimitd` instances.
    pub cluster: String,
    /// `:authority` of the check call.
    pub authority: String,
    pub timeout_ms: u64,
    /// `Bearer <service.auth_token>`, sent with every call when configured
    /// (meshlimitd's `--auth-token-file`).
    pub authorization: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdConfig {
    /// Request headers tried in order; the first present and non-empty wins.
    pub headers: Vec<String>,
    /// Query parameters tried in order after the headers (decoded names).
    pub query_params: Vec<String>,
    pub when_missing: WhenMissing,
    /// Proxies in front of this Envoy that append to `x-forwarded-for`.
    pub trusted_hops: u32,
    /// Status sent with `when_missing: reject`.
    pub reject_status: u32,
    /// IPv6 clients are counted per network of this many bits (64: one
    /// site), since one client holds many addresses.
    pub ipv6_prefix: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenMissing {
    /// Refuse the request with `reject_status`.
    Reject,
    /// Count it in one bucket shared by every anonymous request.
    Anonymous,
    /// Use the client's address (`source.address` or `x-forwarded-for`).
    ClientAddress,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    /// Which requests the rule applies to (every condition must hold).
    pub matcher: Match,
    /// Shared with the checks that apply them (no copy per request).
    pub limits: Vec<Rc<LimitConfig>>,
    pub cost: Cost,
    /// Decide and count, but never deny.
    pub shadow: bool,
    pub scope: Scope,
}

/// A rule's conditions on a request; all of them must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// The request's host (`:authority`, lower-case, without port); empty:
    /// any host.
    pub hosts: Vec<HostPattern>,
    /// On the normalised path (see [`crate::rules::normalize`]).
    pub path: PathMatch,
    /// Upper-case methods; empty means any.
    pub methods: Vec<String>,
    pub headers: Vec<HeaderCondition>,
    /// Conditions on claims of the verified JWT (see [`JwtSource`]): a
    /// plan chosen by a claim the client cannot forge.
    pub claims: Vec<HeaderCondition>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    Exact(String),
    /// `*.example.com`: any subdomain (kept as `.example.com`), not the
    /// domain itself.
    Subdomains(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Prefix(String),
    Exact(String),
}

/// A condition on one request header (lower-case name), or on one claim
/// of the verified JWT. A header sent more than once counts as absent: an
/// upstream may read either copy, so no copy may select a rule (a client
/// sending `x-plan: free` and `x-plan: pro` gets the rules for no plan).
/// An empty one counts as absent too, as a limit's `by` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderCondition {
    pub name: String,
    pub test: HeaderTest,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderTest {
    Exact(String),
    Prefix(String),
    In(Vec<String>),
    Present,
    Absent,
}

/// Where a rule's limits are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// In meshlimitd (Redis): one count for every Envoy.
    Global,
    /// In this Envoy's shared data only, with no call: for traffic that only
    /// ever reaches one proxy, where a round trip buys nothing.
    Local,
}

/// How many units a request takes from the rule's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    Fixed(u64),
    /// From a request header: a whole number from 1 to `max`; `default`
    /// when the header is absent.
    Header {
        name: String,
        default: u64,
        max: u64,
    },
    /// A token budget: the cost is known from the response only (see
    /// [`TokenCost`]); the request reserves an estimate first.
    Tokens(Rc<TokenCost>),
}

/// How a token-priced rule reserves, reads the usage and settles (see
/// `docs/tokens.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenCost {
    pub reserve: Reserve,
    pub usage: UsageSource,
    pub mode: TokenMode,
    /// The most bytes of a request or response body read; above it, the
    /// reservation stands.
    pub max_body_bytes: usize,
    /// An upstream 5xx, or no response, gives the reservation back.
    pub refund_on_error: bool,
}

impl TokenCost {
    /// Whether a streamed request is made to ask for its usage (see
    /// [`Reserve::RequestJson`]'s `ask_stream_usage`).
    pub fn asks_stream_usage(&self) -> bool {
        matches!(
            self.reserve,
            Reserve::RequestJson {
                ask_stream_usage: true,
                ..
            }
        )
    }
}

/// What a request reserves before it is forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserve {
    Fixed(u64),
    /// A number in the request's JSON body (`max_tokens`), from 1 to
    /// `max` (clamped); `default` when absent or unreadable.
    RequestJson {
        path: Vec<String>,
        default: u64,
        max: u64,
        /// The prompt is reserved too: a token for this many bytes of the
        /// request body (an upper bound: a token is about four bytes of
        /// English, fewer of JSON's quoting, more of other scripts); 0
        /// leaves the prompt out.
        prompt_bytes_per_token: u64,
        /// A streamed request that does not ask for its usage
        /// (`stream_options.include_usage: true`, OpenAI's chat
        /// completions) has it added to its body: without it the model
        /// reports none, and the stream would be charged an estimate.
        ask_stream_usage: bool,
    },
}

/// Where a response reports the units it used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageSource {
    /// Where a JSON body reports it (`usage.total_tokens`, or a sum).
    pub json: Option<crate::tokens::usage::UsageExpr>,
    /// The same in a server-sent-events stream: the last value each of its
    /// paths had in an event.
    pub sse_json: Option<crate::tokens::usage::UsageExpr>,
    /// A response header (lower-case), preferred when present.
    pub header: Option<String>,
}

/// When a token-priced request is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenMode {
    /// Reserve the estimate before, settle after: never over budget.
    #[default]
    Reserve,
    /// Admit while anything remains (one unit is held), charge the usage
    /// after: what other gateways do; over budget by up to the usage of
    /// the requests in flight.
    After,
}

/// A request attribute a limit counts by (its `by`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Attribute {
    /// The client id (`client_id`).
    Client,
    /// A request header sent once (lower-case name).
    Header(String),
    /// A query parameter sent once (decoded name).
    Query(String),
    /// `:authority`, lower-case, without port.
    Host,
    /// The normalised path, without query.
    Path,
    Method,
    /// The URI SAN of the downstream peer's certificate (mTLS).
    PeerIdentity,
    /// A claim of the payload verified by `jwt_authn`.
    Jwt(String),
    /// A field of the request's JSON body (`json:model`; dotted path),
    /// read when the body is (a rule whose cost reserves from the body).
    Json(String),
}

/// What a limit does with a request that lacks one of its attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingAttribute {
    /// The request is not counted on this limit (stat
    /// `skipped_missing_attribute`).
    #[default]
    Skip,
    /// The request is refused with 403 (stat `rejected_missing_attribute`).
    Reject,
}

/// Static override: `requests` instead of the limit's own for these
/// subjects.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StaticOverride {
    /// Subjects as the filter spells them, or, for a limit counted by one
    /// attribute, that attribute's value.
    pub subjects: Vec<String>,
    pub requests: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LimitConfig {
    pub name: String,
    /// `rule/limit`: the limit's identity in keys, headers and logs.
    pub qualified_name: String,
    pub requests: u64,
    pub window_ms: u64,
    pub algorithm: Algorithm,
    /// `token_bucket` only: units that may be spent at once.
    pub burst: Option<u64>,
    /// What the counter's subject is made of; `[Client]` by default, `[]`
    /// for one counter for everyone the rule matches.
    pub by: Vec<Attribute>,
    pub missing: MissingAttribute,
    pub overrides: Vec<StaticOverride>,
    /// `fixed_window` only: calendar-aligned windows (`window_ms` is then
    /// the unit's longest window).
    pub calendar: Option<meshlimit_protocol::Calendar>,
    /// The rule's `fallback_share` in parts per million (see
    /// [`LimitConfig::fallback_requests`]).
    pub share_ppm: u64,
    /// Where the limit's own stats are (`crate::flow::rule_stats`).
    pub stats: StatSlot,
}

/// A limit's position among every configured limit, where its stats are.
/// Not part of its identity: equality and fingerprints ignore it, so a
/// rule moved within the configuration keeps its counters and leases.
#[derive(Debug, Clone, Copy, Default)]
pub struct StatSlot(pub usize);

impl PartialEq for StatSlot {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for StatSlot {}

impl std::hash::Hash for StatSlot {
    fn hash<H: std::hash::Hasher>(&self, _: &mut H) {}
}

impl LimitConfig {
    /// This Envoy's share of the limit while it decides alone (a fallback):
    /// `requests * fallback_share`, rounded up, from 1 to `requests`.
    pub fn fallback_requests(&self) -> u64 {
        (((self.requests as u128 * u128::from(self.share_ppm)) as f64 / 1_000_000.0).ceil() as u64)
            .clamp(1, self.requests.max(1))
    }

    /// The limit as enforced by one Envoy during a fallback.
    pub fn for_fallback(&self) -> LimitConfig {
        let fallback_requests = self.fallback_requests();
        let share = fallback_requests as f64 / self.requests.max(1) as f64;
        LimitConfig {
            requests: fallback_requests,
            burst: self
                .burst
                .map(|b| ((b as f64 * share).ceil() as u64).max(1)),
            ..self.clone()
        }
    }

    /// The most units one request can ever take from this limit.
    pub fn capacity(&self) -> u64 {
        bounds::capacity(self.algorithm, self.requests, self.burst)
    }

    /// The `requests` of a static override for `subject` (the encoded
    /// subject, or `plain`, the value of a one-attribute `by`), if any.
    pub fn override_for(&self, subject: &str, plain: Option<&str>) -> Option<u64> {
        self.overrides
            .iter()
            .find(|o| {
                o.subjects
                    .iter()
                    .any(|s| s == subject || Some(s.as_str()) == plain)
            })
            .map(|o| o.requests)
    }

    /// The same limit with `requests` replaced (a static override); its
    /// fallback share and a burst that was the default follow.
    pub fn with_requests(&self, requests: u64) -> LimitConfig {
        LimitConfig {
            requests,
            ..self.clone()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Enforce the same limits per Envoy from shared data.
    Local,
    /// Let the request through.
    Allow,
    /// Refuse the request with the configured deny response.
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit` per the IETF httpapi draft.
    Draft,
    /// The draft's `RateLimit` alone (`r` and `t`): one header, and one
    /// hostcall, fewer a response, for operators who would rather not
    /// repeat a policy their clients know (docs/behaviour.md).
    #[serde(rename = "ratelimit")]
    RateLimitOnly,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    XRatelimit,
    None,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseConfig {
    pub status: u32,
    pub body: String,
    pub headers: HeaderStyle,
    /// The gRPC status a denied gRPC request gets (its `grpc-status`).
    pub grpc_status: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Shared-data slots for leases (one check's lease each).
    pub slots: u32,
    /// Most units one lease asks for.
    pub max_units: u64,
    /// How long a client's rate is observed to size its next lease; a
    /// token bucket's lease lives this long, and any lease unused for this
    /// long is given back.
    pub interval_ms: u64,
    /// What remains is divided by this to bound a lease:
    /// `2 * local.expected_replicas`.
    pub share: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalConfig {
    /// Shared-data slots for fallback counters (each holds a few clients).
    pub slots: u32,
}

pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(err(
            "",
            "the configuration is empty; at least `rules` is required",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let raw: raw::RawConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        // serde_json appends "at line L column C"; the field path says more.
        let mut problem = inner.to_string();
        if let Some(pos) = problem.rfind(" at line ") {
            problem.truncate(pos);
        }
        err(field, problem)
    })?;
    validate::config(raw)
}

/// The circuit breaker around calls to meshlimitd (see
/// `crate::shared::breaker`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failed calls that open the breaker.
    pub failures: u32,
    /// First open interval.
    pub open_ms: u64,
    /// Longest open interval.
    pub max_open_ms: u64,
}
