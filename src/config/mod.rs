//! Plugin configuration: the JSON in Envoy's `configuration` (or Istio's
//! `pluginConfig`), parsed and validated once in `on_configure`.
//!
//! Every problem is reported as a [`ConfigError`] naming the field by its
//! path (`rules[0].limits[1].window`), because the operator only sees one
//! log line and must be able to fix the config from it alone.

use std::collections::HashSet;
use std::fmt;

use meshlimit_protocol::Algorithm;
use serde::Deserialize;

pub use crate::breaker::BreakerConfig;
use crate::duration;

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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceConfig {
    /// Envoy cluster of `meshlimitd` instances.
    pub cluster: String,
    /// `:authority` of the check call.
    pub authority: String,
    pub timeout_ms: u64,
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
    pub path_prefix: String,
    /// Upper-case methods; empty means any.
    pub methods: Vec<String>,
    pub limits: Vec<LimitConfig>,
    pub cost: Cost,
    /// Decide and count, but never deny.
    pub shadow: bool,
    pub scope: Scope,
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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitConfig {
    pub name: String,
    /// `rule/limit`: the limit's identity in keys, headers and logs.
    pub qualified_name: String,
    pub requests: u64,
    pub window_ms: u64,
    pub algorithm: Algorithm,
    /// `token_bucket` only: units that may be spent at once.
    pub burst: Option<u64>,
    /// This Envoy's share of the limit while it decides alone (a fallback):
    /// `requests * fallback_share`, rounded up, at least 1.
    pub fallback_requests: u64,
}

impl LimitConfig {
    /// The limit as enforced by one Envoy during a fallback.
    pub fn for_fallback(&self) -> LimitConfig {
        let share = self.fallback_requests as f64 / self.requests.max(1) as f64;
        LimitConfig {
            requests: self.fallback_requests,
            burst: self
                .burst
                .map(|b| ((b as f64 * share).ceil() as u64).max(1)),
            ..self.clone()
        }
    }

    /// The most units one request can ever take from this limit.
    pub fn capacity(&self) -> u64 {
        match self.algorithm {
            Algorithm::TokenBucket => self.burst.unwrap_or(self.requests),
            _ => self.requests,
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
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    XRatelimit,
    None,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseConfig {
    pub status: u32,
    pub body: String,
    pub headers: HeaderStyle,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalConfig {
    /// Shared-data slots for fallback counters (each holds a few clients).
    pub slots: u32,
}

/// Parts per million, so the config stays `Eq`.
const PPM: f64 = 1_000_000.0;

/// Bounds that keep a typo from becoming an outage.
const MAX_WINDOW_MS: u64 = 31 * 86_400_000;
const MAX_TIMEOUT_MS: u64 = 60_000;
const MIN_SLOTS: u32 = 16;
const MAX_SLOTS: u32 = 1 << 20;
const MAX_NAME_LEN: usize = 64;
const MAX_COST: u64 = 1_000_000;

// ---- wire shape (what serde reads) ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    service: RawService,
    #[serde(default)]
    client_id: RawClientId,
    rules: Option<Vec<RawRule>>,
    #[serde(default = "default_failure_mode")]
    failure_mode: FailureMode,
    #[serde(default)]
    response: RawResponse,
    #[serde(default)]
    local: RawLocal,
    #[serde(default)]
    breaker: RawBreaker,
    #[serde(default)]
    deny_cache: RawDenyCache,
    #[serde(default)]
    group_commit: RawGroupCommit,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawGroupCommit {
    enabled: bool,
    max_batch: usize,
    max_queue_age: String,
    max_queued: usize,
    max_calls_in_flight: usize,
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
struct RawBreaker {
    failures: u32,
    open: String,
    max_open: String,
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
struct RawDenyCache {
    slots: u32,
}

impl Default for RawDenyCache {
    fn default() -> Self {
        RawDenyCache { slots: 4096 }
    }
}

fn default_failure_mode() -> FailureMode {
    FailureMode::Local
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawService {
    cluster: String,
    authority: String,
    timeout: String,
}

impl Default for RawService {
    fn default() -> Self {
        RawService {
            cluster: "meshlimit".into(),
            authority: "meshlimitd".into(),
            timeout: "20ms".into(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawClientId {
    headers: Vec<String>,
    query_params: Vec<String>,
    when_missing: WhenMissing,
    trusted_hops: u32,
    reject_status: u32,
}

impl Default for RawClientId {
    fn default() -> Self {
        RawClientId {
            headers: Vec::new(),
            query_params: Vec::new(),
            when_missing: WhenMissing::ClientAddress,
            trusted_hops: 0,
            reject_status: 401,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    #[serde(default, rename = "match")]
    matcher: RawMatch,
    #[serde(default)]
    limits: Vec<RawLimit>,
    cost: Option<RawCost>,
    #[serde(default)]
    shadow: bool,
    #[serde(default = "default_scope")]
    scope: Scope,
    fallback_share: Option<f64>,
}

fn default_scope() -> Scope {
    Scope::Global
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawCost {
    Fixed(u64),
    Header(RawCostHeader),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCostHeader {
    header: String,
    #[serde(default = "one")]
    default: u64,
    max: u64,
}

fn one() -> u64 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawMatch {
    path_prefix: String,
    methods: Vec<String>,
}

impl Default for RawMatch {
    fn default() -> Self {
        RawMatch {
            path_prefix: "/".into(),
            methods: Vec::new(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    name: String,
    requests: u64,
    window: String,
    #[serde(default = "default_algorithm")]
    algorithm: Algorithm,
    burst: Option<u64>,
}

fn default_algorithm() -> Algorithm {
    Algorithm::FixedWindow
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawResponse {
    status: u32,
    body: String,
    headers: HeaderStyle,
}

impl Default for RawResponse {
    fn default() -> Self {
        RawResponse {
            status: 429,
            body: "rate limit exceeded\n".into(),
            headers: HeaderStyle::Draft,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawLocal {
    slots: u32,
    /// Envoys expected to share a global limit; the default fallback share
    /// is one over this.
    expected_replicas: u32,
}

impl Default for RawLocal {
    fn default() -> Self {
        RawLocal {
            slots: 4096,
            expected_replicas: 1,
        }
    }
}

/// Parses and validates the plugin configuration.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(err(
            "",
            "the configuration is empty; at least `rules` is required",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let raw: RawConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        // serde_json appends "at line L column C"; the field path says more.
        let mut problem = inner.to_string();
        if let Some(pos) = problem.rfind(" at line ") {
            problem.truncate(pos);
        }
        err(field, problem)
    })?;
    validate(raw)
}

fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
    let service = validate_service(raw.service)?;
    let client_id = validate_client_id(raw.client_id)?;
    let raw_rules = raw
        .rules
        .ok_or_else(|| err("rules", "missing: at least one rule is required"))?;
    if raw_rules.is_empty() {
        return Err(err("rules", "must contain at least one rule"));
    }
    if raw.local.expected_replicas == 0 || raw.local.expected_replicas > 10_000 {
        return Err(err(
            "local.expected_replicas",
            "must be between 1 and 10000",
        ));
    }
    let default_share_ppm = (PPM / f64::from(raw.local.expected_replicas)).ceil() as u64;
    let mut rule_names = HashSet::new();
    let mut rules = Vec::with_capacity(raw_rules.len());
    for (i, raw_rule) in raw_rules.into_iter().enumerate() {
        let rule = validate_rule(i, raw_rule, default_share_ppm)?;
        if !rule_names.insert(rule.name.clone()) {
            return Err(err(
                format!("rules[{i}].name"),
                format!("duplicate rule name \"{}\"", rule.name),
            ));
        }
        rules.push(rule);
    }
    let response = validate_response(raw.response)?;
    if !(MIN_SLOTS..=MAX_SLOTS).contains(&raw.local.slots) {
        return Err(err(
            "local.slots",
            format!("must be between {MIN_SLOTS} and {MAX_SLOTS}"),
        ));
    }
    let breaker = validate_breaker(raw.breaker)?;
    if raw.deny_cache.slots > MAX_SLOTS {
        return Err(err(
            "deny_cache.slots",
            format!("must be at most {MAX_SLOTS} (0 turns the cache off)"),
        ));
    }
    Ok(Config {
        service,
        client_id,
        rules,
        failure_mode: raw.failure_mode,
        response,
        local: LocalConfig {
            slots: raw.local.slots,
        },
        breaker,
        deny_cache_slots: raw.deny_cache.slots,
        group_commit: validate_group_commit(raw.group_commit)?,
    })
}

fn validate_group_commit(
    raw: RawGroupCommit,
) -> Result<Option<crate::batch::BatchConfig>, ConfigError> {
    if !(1..=1024).contains(&raw.max_batch) {
        return Err(err("group_commit.max_batch", "must be between 1 and 1024"));
    }
    if !(1..=100_000).contains(&raw.max_queued) {
        return Err(err(
            "group_commit.max_queued",
            "must be between 1 and 100000",
        ));
    }
    if !(1..=64).contains(&raw.max_calls_in_flight) {
        return Err(err(
            "group_commit.max_calls_in_flight",
            "must be between 1 and 64",
        ));
    }
    let max_age_ms = duration::parse_millis(&raw.max_queue_age)
        .map_err(|e| err("group_commit.max_queue_age", e.to_string()))?;
    if max_age_ms > 1_000 {
        return Err(err("group_commit.max_queue_age", "must be at most 1s"));
    }
    Ok(raw.enabled.then_some(crate::batch::BatchConfig {
        max_batch: raw.max_batch,
        max_age_ms,
        max_queued: raw.max_queued,
        max_in_flight: raw.max_calls_in_flight,
    }))
}

fn validate_breaker(raw: RawBreaker) -> Result<BreakerConfig, ConfigError> {
    if raw.failures == 0 || raw.failures > 1000 {
        return Err(err("breaker.failures", "must be between 1 and 1000"));
    }
    let open_ms =
        duration::parse_millis(&raw.open).map_err(|e| err("breaker.open", e.to_string()))?;
    let max_open_ms = duration::parse_millis(&raw.max_open)
        .map_err(|e| err("breaker.max_open", e.to_string()))?;
    if open_ms == 0 || open_ms > 600_000 {
        return Err(err("breaker.open", "must be between 1ms and 10m"));
    }
    if max_open_ms < open_ms || max_open_ms > 600_000 {
        return Err(err(
            "breaker.max_open",
            "must be at least breaker.open and at most 10m",
        ));
    }
    Ok(BreakerConfig {
        failures: raw.failures,
        open_ms,
        max_open_ms,
    })
}

fn validate_service(raw: RawService) -> Result<ServiceConfig, ConfigError> {
    if raw.cluster.trim().is_empty() {
        return Err(err("service.cluster", "must not be empty"));
    }
    if raw.authority.trim().is_empty() {
        return Err(err("service.authority", "must not be empty"));
    }
    let timeout_ms =
        duration::parse_millis(&raw.timeout).map_err(|e| err("service.timeout", e.to_string()))?;
    if timeout_ms == 0 || timeout_ms > MAX_TIMEOUT_MS {
        return Err(err(
            "service.timeout",
            format!("must be between 1ms and {}s", MAX_TIMEOUT_MS / 1000),
        ));
    }
    Ok(ServiceConfig {
        cluster: raw.cluster,
        authority: raw.authority,
        timeout_ms,
    })
}

fn validate_client_id(raw: RawClientId) -> Result<ClientIdConfig, ConfigError> {
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (i, h) in raw.headers.iter().enumerate() {
        let lower = h.trim().to_ascii_lowercase();
        if lower.is_empty() || !lower.bytes().all(is_header_name_byte) {
            return Err(err(
                format!("client_id.headers[{i}]"),
                format!("\"{h}\" is not a valid header name"),
            ));
        }
        headers.push(lower);
    }
    for (i, name) in raw.query_params.iter().enumerate() {
        // Names are compared after decoding, so most text will do; not
        // what could never appear as a name, nor the ':' that ends the name
        // in a subject (`qry:<name>:<value>` must stay one-to-one).
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains(['&', '=', '#', ':']) {
            return Err(err(
                format!("client_id.query_params[{i}]"),
                format!(
                    "\"{name}\" is not a usable parameter name (1 to {MAX_NAME_LEN} characters, none of '&', '=', '#', ':')"
                ),
            ));
        }
    }
    if !(400..=499).contains(&raw.reject_status) {
        return Err(err(
            "client_id.reject_status",
            "must be a 4xx status (e.g. 400 or 401)",
        ));
    }
    if raw.trusted_hops > 16 {
        return Err(err("client_id.trusted_hops", "must be at most 16"));
    }
    Ok(ClientIdConfig {
        headers,
        query_params: raw.query_params,
        when_missing: raw.when_missing,
        trusted_hops: raw.trusted_hops,
        reject_status: raw.reject_status,
    })
}

fn is_header_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Names become part of Redis keys and header values: keep them plain.
fn check_name(field: String, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(err(
            field,
            format!("must be 1 to {MAX_NAME_LEN} characters long"),
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return Err(err(
            field,
            format!("\"{name}\" may only contain letters, digits, '-', '_' and '.'"),
        ));
    }
    Ok(())
}

fn validate_rule(i: usize, raw: RawRule, default_share_ppm: u64) -> Result<Rule, ConfigError> {
    check_name(format!("rules[{i}].name"), &raw.name)?;
    let share_ppm = match raw.fallback_share {
        None => default_share_ppm,
        Some(_) if raw.scope == Scope::Local => {
            return Err(err(
                format!("rules[{i}].fallback_share"),
                "a local rule never falls back; fallback_share only applies to global rules",
            ));
        }
        Some(share) if share > 0.0 && share <= 1.0 => (share * PPM).round() as u64,
        Some(_) => {
            return Err(err(
                format!("rules[{i}].fallback_share"),
                "must be greater than 0 and at most 1",
            ));
        }
    };
    if !raw.matcher.path_prefix.starts_with('/') {
        return Err(err(
            format!("rules[{i}].match.path_prefix"),
            "must start with '/'",
        ));
    }
    let mut methods = Vec::with_capacity(raw.matcher.methods.len());
    for (j, m) in raw.matcher.methods.iter().enumerate() {
        let upper = m.trim().to_ascii_uppercase();
        if upper.is_empty() || !upper.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(err(
                format!("rules[{i}].match.methods[{j}]"),
                format!("\"{m}\" is not an HTTP method"),
            ));
        }
        methods.push(upper);
    }
    if raw.limits.is_empty() {
        return Err(err(
            format!("rules[{i}].limits"),
            "a rule needs at least one limit",
        ));
    }
    let mut limit_names = HashSet::new();
    let mut limits = Vec::with_capacity(raw.limits.len());
    for (j, l) in raw.limits.into_iter().enumerate() {
        let field = |f: &str| format!("rules[{i}].limits[{j}].{f}");
        check_name(field("name"), &l.name)?;
        if !limit_names.insert(l.name.clone()) {
            return Err(err(
                field("name"),
                format!(
                    "duplicate limit name \"{}\" in rule \"{}\"",
                    l.name, raw.name
                ),
            ));
        }
        if l.requests == 0 {
            return Err(err(field("requests"), "must be at least 1"));
        }
        let window_ms =
            duration::parse_millis(&l.window).map_err(|e| err(field("window"), e.to_string()))?;
        if window_ms == 0 || window_ms > MAX_WINDOW_MS {
            return Err(err(field("window"), "must be between 1ms and 31d"));
        }
        match (l.algorithm, l.burst) {
            (Algorithm::TokenBucket, Some(0)) => {
                return Err(err(field("burst"), "must be at least 1"));
            }
            (Algorithm::TokenBucket, _) | (_, None) => {}
            (other, Some(_)) => {
                return Err(err(
                    field("burst"),
                    format!("only token_bucket has a burst, not {}", other.as_str()),
                ));
            }
        }
        limits.push(LimitConfig {
            qualified_name: format!("{}/{}", raw.name, l.name),
            name: l.name,
            requests: l.requests,
            window_ms,
            algorithm: l.algorithm,
            burst: l.burst,
            fallback_requests: (((l.requests as u128 * u128::from(share_ppm)) as f64 / PPM).ceil()
                as u64)
                .clamp(1, l.requests),
        });
    }
    let cost = match raw.cost {
        None => Cost::Fixed(1),
        Some(RawCost::Fixed(0)) => {
            return Err(err(format!("rules[{i}].cost"), "must be at least 1"));
        }
        Some(RawCost::Fixed(n)) if n > MAX_COST => {
            return Err(err(
                format!("rules[{i}].cost"),
                format!("must be at most {MAX_COST}"),
            ));
        }
        Some(RawCost::Fixed(n)) => Cost::Fixed(n),
        Some(RawCost::Header(h)) => {
            let name = h.header.trim().to_ascii_lowercase();
            if name.is_empty() || !name.bytes().all(is_header_name_byte) {
                return Err(err(
                    format!("rules[{i}].cost.header"),
                    format!("\"{}\" is not a valid header name", h.header),
                ));
            }
            if h.max == 0 || h.max > MAX_COST {
                return Err(err(
                    format!("rules[{i}].cost.max"),
                    format!("must be between 1 and {MAX_COST}"),
                ));
            }
            if h.default == 0 || h.default > h.max {
                return Err(err(
                    format!("rules[{i}].cost.default"),
                    "must be between 1 and max",
                ));
            }
            Cost::Header {
                name,
                default: h.default,
                max: h.max,
            }
        }
    };
    Ok(Rule {
        name: raw.name,
        path_prefix: raw.matcher.path_prefix,
        methods,
        limits,
        cost,
        shadow: raw.shadow,
        scope: raw.scope,
    })
}

fn validate_response(raw: RawResponse) -> Result<ResponseConfig, ConfigError> {
    if !(400..=599).contains(&raw.status) {
        return Err(err(
            "response.status",
            "must be a 4xx or 5xx status (429 is the standard one)",
        ));
    }
    if raw.body.len() > 64 * 1024 {
        return Err(err("response.body", "must be at most 64 KiB"));
    }
    Ok(ResponseConfig {
        status: raw.status,
        body: raw.body,
        headers: raw.headers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"{"rules":[{"name":"api","limits":[{"name":"per-minute","requests":100,"window":"60s"}]}]}"#;

    fn parse_str(s: &str) -> Result<Config, ConfigError> {
        parse(s.as_bytes())
    }

    fn rejects(json: &str, field: &str, problem_part: &str) {
        let e = parse_str(json).expect_err("config should be rejected");
        assert_eq!(e.field, field, "wrong field in {e}");
        assert!(
            e.problem.contains(problem_part),
            "problem {:?} should mention {:?}",
            e.problem,
            problem_part
        );
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = parse_str(MINIMAL).unwrap();
        assert_eq!(c.service.cluster, "meshlimit");
        assert_eq!(c.service.authority, "meshlimitd");
        assert_eq!(c.service.timeout_ms, 20);
        assert_eq!(c.client_id.when_missing, WhenMissing::ClientAddress);
        assert!(c.client_id.headers.is_empty());
        assert_eq!(c.failure_mode, FailureMode::Local);
        assert_eq!(c.response.status, 429);
        assert_eq!(c.response.headers, HeaderStyle::Draft);
        assert_eq!(c.local.slots, 4096);
        assert_eq!(
            c.breaker,
            BreakerConfig {
                failures: 5,
                open_ms: 250,
                max_open_ms: 2_000
            }
        );
        assert_eq!(c.deny_cache_slots, 4096);
        let off = parse_str(
            r#"{"group_commit":{"enabled":false},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        )
        .unwrap();
        assert_eq!(off.group_commit, None, "one call per request");
        assert_eq!(
            c.group_commit,
            Some(crate::batch::BatchConfig {
                max_batch: 64,
                max_age_ms: 0,
                max_queued: 1024,
                max_in_flight: 4
            })
        );
        rejects(
            r#"{"group_commit":{"enabled":true,"max_batch":0},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "group_commit.max_batch",
            "between 1",
        );
        let rule = &c.rules[0];
        assert_eq!(rule.path_prefix, "/");
        assert!(rule.methods.is_empty());
        assert_eq!(rule.limits[0].window_ms, 60_000);
        assert_eq!(rule.limits[0].qualified_name, "api/per-minute");
        assert_eq!(rule.limits[0].algorithm, Algorithm::FixedWindow);
    }

    #[test]
    fn full_design_example_parses() {
        let json = r#"{
          "service": {"cluster": "meshlimit", "authority": "meshlimitd", "timeout": "25ms"},
          "client_id": {"headers": ["X-Api-Key", "x-client-id"], "when_missing": "reject"},
          "rules": [
            {"name": "api", "match": {"path_prefix": "/api/", "methods": ["get", "POST"]},
             "limits": [{"name": "per-minute", "requests": 100, "window": "60s", "algorithm": "fixed_window"}]}
          ],
          "failure_mode": "deny",
          "response": {"status": 429, "body": "slow down\n", "headers": "x-ratelimit"},
          "local": {"slots": 64}
        }"#;
        let c = parse_str(json).unwrap();
        assert_eq!(c.client_id.headers, vec!["x-api-key", "x-client-id"]);
        assert_eq!(c.rules[0].methods, vec!["GET", "POST"]);
        assert_eq!(c.failure_mode, FailureMode::Deny);
        assert_eq!(c.response.headers, HeaderStyle::XRatelimit);
        assert_eq!(c.service.timeout_ms, 25);
    }

    #[test]
    fn empty_config_is_rejected() {
        assert!(parse(b"").unwrap_err().problem.contains("empty"));
        assert!(parse(b"  \n").unwrap_err().problem.contains("empty"));
        rejects("{}", "rules", "required");
        rejects(r#"{"rules":[]}"#, "rules", "at least one");
    }

    #[test]
    fn unknown_fields_are_named_with_their_path() {
        rejects(
            r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":1,"window":"1s","burts":3}]}]}"#,
            "rules[0].limits[0].burts",
            "unknown field `burts`",
        );
        rejects(
            r#"{"servce":{},"rules":[]}"#,
            "servce",
            "unknown field `servce`",
        );
        rejects(
            r#"{"service":{"timeout_ms":20},"rules":[]}"#,
            "service.timeout_ms",
            "unknown field `timeout_ms`",
        );
    }

    #[test]
    fn zero_and_negative_limits_are_rejected() {
        rejects(
            r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":0,"window":"1s"}]}]}"#,
            "rules[0].limits[0].requests",
            "at least 1",
        );
        rejects(
            r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":-5,"window":"1s"}]}]}"#,
            "rules[0].limits[0].requests",
            "invalid value",
        );
    }

    #[test]
    fn bad_durations_are_rejected() {
        rejects(
            r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":1,"window":"60"}]}]}"#,
            "rules[0].limits[0].window",
            "no unit",
        );
        rejects(
            r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":1,"window":"0s"}]}]}"#,
            "rules[0].limits[0].window",
            "between",
        );
        rejects(
            r#"{"service":{"timeout":"fast"},"rules":[{"name":"api","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "service.timeout",
            "must start with",
        );
    }

    #[test]
    fn rules_without_limits_and_duplicates_are_rejected() {
        rejects(
            r#"{"rules":[{"name":"api"}]}"#,
            "rules[0].limits",
            "at least one limit",
        );
        rejects(
            r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]},{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "rules[1].name",
            "duplicate rule name",
        );
        rejects(
            r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"},{"name":"m","requests":2,"window":"1h"}]}]}"#,
            "rules[0].limits[1].name",
            "duplicate limit name",
        );
    }

    #[test]
    fn names_that_could_move_a_hash_slot_are_rejected() {
        rejects(
            r#"{"rules":[{"name":"a{b}","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "rules[0].name",
            "may only contain",
        );
    }

    #[test]
    fn every_algorithm_parses_and_burst_is_token_bucket_only() {
        let c = parse_str(
            r#"{"rules":[{"name":"a","limits":[
              {"name":"fw","requests":1,"window":"1s","algorithm":"fixed_window"},
              {"name":"swl","requests":1,"window":"1s","algorithm":"sliding_window_log"},
              {"name":"swc","requests":1,"window":"1s","algorithm":"sliding_window_counter"},
              {"name":"tb","requests":10,"window":"1s","algorithm":"token_bucket","burst":3}]}]}"#,
        )
        .unwrap();
        assert_eq!(c.rules[0].limits[3].capacity(), 3);
        assert_eq!(c.rules[0].limits[0].capacity(), 1);
        rejects(
            r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s","burst":2}]}]}"#,
            "rules[0].limits[0].burst",
            "only token_bucket",
        );
        rejects(
            r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s","algorithm":"token_bucket","burst":0}]}]}"#,
            "rules[0].limits[0].burst",
            "at least 1",
        );
    }

    #[test]
    fn cost_is_fixed_or_from_a_bounded_header() {
        let c = parse_str(
            r#"{"rules":[
              {"name":"a","cost":5,"limits":[{"name":"m","requests":10,"window":"1s"}]},
              {"name":"b","cost":{"header":"X-Cost","max":100},"shadow":true,"limits":[{"name":"m","requests":10,"window":"1s"}]}]}"#,
        )
        .unwrap();
        assert_eq!(c.rules[0].cost, Cost::Fixed(5));
        assert!(!c.rules[0].shadow);
        assert_eq!(
            c.rules[1].cost,
            Cost::Header {
                name: "x-cost".into(),
                default: 1,
                max: 100
            }
        );
        assert!(c.rules[1].shadow);
        rejects(
            r#"{"rules":[{"name":"a","cost":0,"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "rules[0].cost",
            "at least 1",
        );
        rejects(
            r#"{"rules":[{"name":"a","cost":{"header":"x-cost","max":10,"default":11},"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "rules[0].cost.default",
            "between 1 and max",
        );
    }

    #[test]
    fn unknown_algorithms_are_named() {
        rejects(
            r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s","algorithm":"leaky"}]}]}"#,
            "rules[0].limits[0].algorithm",
            "unknown variant `leaky`",
        );
    }

    #[test]
    fn enum_fields_name_their_choices() {
        rejects(
            r#"{"failure_mode":"open","rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "failure_mode",
            "expected one of `local`, `allow`, `deny`",
        );
        rejects(
            r#"{"response":{"headers":"ietf"},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "response.headers",
            "`draft`",
        );
    }

    #[test]
    fn statuses_and_headers_are_checked() {
        rejects(
            r#"{"response":{"status":200},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "response.status",
            "4xx or 5xx",
        );
        rejects(
            r#"{"client_id":{"reject_status":302},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "client_id.reject_status",
            "4xx",
        );
        rejects(
            r#"{"client_id":{"headers":["x api"]},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "client_id.headers[0]",
            "not a valid header name",
        );
        rejects(
            r#"{"client_id":{"query_params":["key","a=b"]},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "client_id.query_params[1]",
            "not a usable parameter name",
        );
        rejects(
            r#"{"rules":[{"name":"a","match":{"path_prefix":"api"},"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "rules[0].match.path_prefix",
            "start with",
        );
    }

    #[test]
    fn fallback_share_comes_from_the_rule_or_the_replica_count() {
        let c = parse_str(
            r#"{"local":{"expected_replicas":4},"rules":[
              {"name":"a","limits":[{"name":"m","requests":20,"window":"1s"}]},
              {"name":"b","fallback_share":0.5,"limits":[{"name":"m","requests":21,"window":"1s","algorithm":"token_bucket","burst":9}]},
              {"name":"c","scope":"local","limits":[{"name":"m","requests":3,"window":"1s"}]}]}"#,
        )
        .unwrap();
        assert_eq!(c.rules[0].limits[0].fallback_requests, 5);
        assert_eq!(c.rules[1].limits[0].fallback_requests, 11);
        assert_eq!(c.rules[1].limits[0].for_fallback().burst, Some(5));
        assert_eq!(c.rules[2].scope, Scope::Local);
        assert_eq!(c.rules[0].scope, Scope::Global);
        let minimal = parse_str(MINIMAL).unwrap();
        assert_eq!(
            minimal.rules[0].limits[0].fallback_requests, 100,
            "default share is 1"
        );
        rejects(
            r#"{"rules":[{"name":"a","fallback_share":1.5,"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "rules[0].fallback_share",
            "at most 1",
        );
        rejects(
            r#"{"rules":[{"name":"a","scope":"local","fallback_share":0.5,"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "rules[0].fallback_share",
            "never falls back",
        );
        rejects(
            r#"{"rules":[{"name":"a","scope":"everywhere","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "rules[0].scope",
            "expected `global` or `local`",
        );
    }

    #[test]
    fn breaker_settings_are_checked() {
        rejects(
            r#"{"breaker":{"failures":0},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "breaker.failures",
            "between 1",
        );
        rejects(
            r#"{"breaker":{"open":"5s","max_open":"1s"},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
            "breaker.max_open",
            "at least breaker.open",
        );
        let c = parse_str(
            r#"{"deny_cache":{"slots":0},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        )
        .unwrap();
        assert_eq!(c.deny_cache_slots, 0);
    }

    #[test]
    fn malformed_json_is_reported_without_panicking() {
        let e = parse(b"{\"rules\": [").unwrap_err();
        assert!(e.to_string().starts_with("invalid meshlimit configuration"));
        assert!(parse(&[0xff, 0xfe, 0x00]).is_err());
    }

    #[test]
    fn error_line_names_the_field() {
        let e = parse_str(
            r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":0,"window":"1s"}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid meshlimit configuration: field `rules[0].limits[0].requests`: must be at least 1"
        );
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    /// Arbitrary JSON values, nested a few levels.
    fn json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            "\\PC{0,12}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                prop::collection::btree_map(
                    prop::sample::select(vec![
                        "rules",
                        "name",
                        "limits",
                        "requests",
                        "window",
                        "algorithm",
                        "service",
                        "timeout",
                        "cost",
                        "shadow",
                        "burst",
                        "match",
                        "client_id",
                        "x"
                    ])
                    .prop_map(String::from),
                    inner,
                    0..4
                )
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_are_parsed_or_refused_with_a_message(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            if let Err(e) = parse(&bytes) {
                prop_assert!(!e.to_string().is_empty());
            }
        }

        #[test]
        fn arbitrary_json_is_parsed_or_refused_never_a_panic(value in json()) {
            let bytes = serde_json::to_vec(&value).unwrap();
            let _ = parse(&bytes);
        }

        #[test]
        fn valid_limits_keep_their_values(
            name in "[a-z][a-z0-9_.-]{0,20}",
            requests in 1u64..1_000_000,
            secs in 1u64..86_400,
            algorithm in prop::sample::select(vec!["fixed_window", "sliding_window_log", "sliding_window_counter", "token_bucket"]),
        ) {
            let json = format!(r#"{{"rules":[{{"name":"{name}","limits":[{{"name":"l","requests":{requests},"window":"{secs}s","algorithm":"{algorithm}"}}]}}]}}"#);
            let c = parse(json.as_bytes()).unwrap();
            let l = &c.rules[0].limits[0];
            prop_assert_eq!(l.requests, requests);
            prop_assert_eq!(l.window_ms, secs * 1000);
            prop_assert_eq!(l.algorithm.as_str(), algorithm);
            prop_assert_eq!(&l.qualified_name, &format!("{name}/l"));
        }
    }
}
