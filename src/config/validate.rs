//! Checks the wire shape and builds the [`Config`] the filter runs with.
//! Every refusal names the field by its path.

use std::collections::HashSet;
use std::rc::Rc;

use meshlimit_protocol::bounds::{self, LimitField};

use super::duration;
use super::raw::*;
use super::{
    err, Attribute, BreakerConfig, ClientIdConfig, Config, ConfigError, Cost, HeaderCondition,
    HeaderTest, HostPattern, JwtSource, LeaseConfig, LimitConfig, LocalConfig, Match, PathMatch,
    Reserve, ResponseConfig, Rule, Scope, ServiceConfig, StaticOverride, TokenCost, TokenMode,
    UsageSource,
};

/// Parts per million, so the config stays `Eq`.
const PPM: f64 = 1_000_000.0;

/// Bounds that keep a typo from becoming an outage.
const MAX_TIMEOUT_MS: u64 = 60_000;
const MIN_SLOTS: u32 = 16;
const MAX_SLOTS: u32 = 1 << 20;
const MAX_NAME_LEN: usize = bounds::MAX_NAME_LEN;
const MAX_COST: u64 = bounds::MAX_COST;

pub(super) fn config(raw: RawConfig) -> Result<Config, ConfigError> {
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
        leases: validate_leases(raw.leases, raw.local.expected_replicas)?,
        jwt: validate_jwt(raw.jwt)?,
    })
}

/// Longest `by` list: each attribute is a part of every key.
const MAX_BY: usize = 8;

/// A limit's `by`: attribute names, each once.
fn validate_by(
    field: &dyn Fn(&str) -> String,
    list: &[String],
) -> Result<Vec<Attribute>, ConfigError> {
    if list.len() > MAX_BY {
        return Err(err(field("by"), format!("at most {MAX_BY} attributes")));
    }
    let mut out = Vec::with_capacity(list.len());
    for (k, name) in list.iter().enumerate() {
        let at = || field(&format!("by[{k}]"));
        let named = |prefix: &str| name.strip_prefix(prefix).map(str::trim);
        let attribute = match name.as_str() {
            "client" => Attribute::Client,
            "host" => Attribute::Host,
            "path" => Attribute::Path,
            "method" => Attribute::Method,
            "peer_identity" => Attribute::PeerIdentity,
            _ => {
                if let Some(h) = named("header:") {
                    let h = h.to_ascii_lowercase();
                    if h.is_empty() || !h.bytes().all(is_header_name_byte) {
                        return Err(err(at(), format!("\"{name}\": not a valid header name")));
                    }
                    Attribute::Header(h)
                } else if let Some(q) = named("query:").filter(|q| !q.is_empty()) {
                    Attribute::Query(q.to_string())
                } else if let Some(c) = named("jwt:").filter(|c| !c.is_empty() && c.len() <= 256) {
                    Attribute::Jwt(c.to_string())
                } else {
                    return Err(err(
                        at(),
                        format!("unknown attribute \"{name}\": one of client, header:NAME, query:NAME, host, path, method, peer_identity, jwt:CLAIM"),
                    ));
                }
            }
        };
        if out.contains(&attribute) {
            return Err(err(at(), format!("\"{name}\" is listed twice")));
        }
        out.push(attribute);
    }
    Ok(out)
}

/// A limit's `calendar` and `utc_offset` (`+02:00`, `-05:30`, `Z`).
fn validate_calendar(
    field: &dyn Fn(&str) -> String,
    l: &RawLimit,
) -> Result<Option<meshlimit_protocol::Calendar>, ConfigError> {
    let Some(unit) = l.calendar else {
        if l.utc_offset.is_some() {
            return Err(err(field("utc_offset"), "only a calendar limit has one"));
        }
        return Ok(None);
    };
    if l.algorithm != meshlimit_protocol::Algorithm::FixedWindow {
        return Err(err(
            field("calendar"),
            format!(
                "calendar windows are fixed windows, not {}",
                l.algorithm.as_str()
            ),
        ));
    }
    let minutes = match l.utc_offset.as_deref() {
        None | Some("Z") | Some("z") => 0,
        Some(text) => parse_utc_offset(text).ok_or_else(|| {
            err(
                field("utc_offset"),
                format!("\"{text}\": write +HH:MM or -HH:MM, from -14:00 to +14:00"),
            )
        })?,
    };
    Ok(Some(meshlimit_protocol::Calendar {
        unit,
        utc_offset_minutes: minutes,
    }))
}

/// `+02:00` as 120 minutes; `None` unless `±HH:MM` within ±14:00.
fn parse_utc_offset(text: &str) -> Option<i32> {
    let (sign, rest) = match text.as_bytes().first()? {
        b'+' => (1, text.get(1..)?),
        b'-' => (-1, text.get(1..)?),
        _ => return None,
    };
    let (h, m) = rest.split_once(':')?;
    if h.len() != 2 || m.len() != 2 {
        return None;
    }
    let (h, m): (i32, i32) = (h.parse().ok()?, m.parse().ok()?);
    let minutes = sign * (h * 60 + m);
    (m < 60 && minutes.abs() <= meshlimit_protocol::calendar::MAX_OFFSET_MINUTES).then_some(minutes)
}

fn validate_jwt(raw: RawJwt) -> Result<JwtSource, ConfigError> {
    for (f, v) in [
        ("jwt.filter", &raw.filter),
        ("jwt.payload_in_metadata", &raw.payload_in_metadata),
    ] {
        if v.is_empty() || v.len() > 256 {
            return Err(err(f, "must be 1 to 256 characters"));
        }
    }
    Ok(JwtSource {
        filter: raw.filter,
        payload_in_metadata: raw.payload_in_metadata,
    })
}

/// Quota leases: `None` when off. A lease takes at most half of what is
/// left divided by `local.expected_replicas`, so every replica can still
/// get its share and the last units are decided one by one.
fn validate_leases(
    raw: RawLeases,
    expected_replicas: u32,
) -> Result<Option<LeaseConfig>, ConfigError> {
    if !(1..=bounds::MAX_LEASE_UNITS).contains(&raw.max_units) {
        return Err(err(
            "leases.max_units",
            format!("must be between 1 and {}", bounds::MAX_LEASE_UNITS),
        ));
    }
    let interval_ms =
        duration::parse_millis(&raw.interval).map_err(|e| err("leases.interval", e.to_string()))?;
    if !(100..=60_000).contains(&interval_ms) {
        return Err(err("leases.interval", "must be between 100ms and 60s"));
    }
    if !(MIN_SLOTS..=MAX_SLOTS).contains(&raw.slots) {
        return Err(err(
            "leases.slots",
            format!("must be between {MIN_SLOTS} and {MAX_SLOTS}"),
        ));
    }
    Ok(raw.enabled.then_some(LeaseConfig {
        slots: raw.slots,
        max_units: raw.max_units,
        interval_ms,
        share: 2 * u64::from(expected_replicas),
    }))
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
    let authorization = match raw.auth_token {
        None => None,
        Some(token)
            if (16..=256).contains(&token.len()) && token.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Some(format!("Bearer {token}"))
        }
        Some(_) => {
            return Err(err(
                "service.auth_token",
                "must be 16 to 256 visible ASCII characters (the secret in meshlimitd's --auth-token-file)",
            ));
        }
    };
    Ok(ServiceConfig {
        cluster: raw.cluster,
        authority: raw.authority,
        timeout_ms,
        authorization,
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
    if !(1..=128).contains(&raw.ipv6_prefix) {
        return Err(err(
            "client_id.ipv6_prefix",
            "must be between 1 and 128 (bits of an IPv6 address that name one client; 64 is one site)",
        ));
    }
    Ok(ClientIdConfig {
        headers,
        query_params: raw.query_params,
        when_missing: raw.when_missing,
        trusted_hops: raw.trusted_hops,
        ipv6_prefix: raw.ipv6_prefix,
        reject_status: raw.reject_status,
    })
}

fn is_header_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Names become part of Redis keys and header values: keep them plain.
fn check_name(field: String, name: &str) -> Result<(), ConfigError> {
    if bounds::is_plain_name(name) {
        return Ok(());
    }
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(err(
            field,
            format!("must be 1 to {MAX_NAME_LEN} characters long"),
        ));
    }
    Err(err(
        field,
        format!("\"{name}\" may only contain letters, digits, '-', '_' and '.'"),
    ))
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
    let matcher = validate_match(i, raw.matcher)?;
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
        let calendar = validate_calendar(&field, &l)?;
        let window_ms = match (&l.window, calendar) {
            (Some(_), Some(_)) => {
                return Err(err(
                    field("window"),
                    "a calendar limit's window is its calendar unit; remove `window`",
                ))
            }
            (None, Some(c)) => c.unit.max_len_ms(),
            (Some(w), None) => {
                duration::parse_millis(w).map_err(|e| err(field("window"), e.to_string()))?
            }
            (None, None) => {
                return Err(err(
                    field("window"),
                    "missing: every limit needs a `window` (or a `calendar`)",
                ))
            }
        };
        let check_numbers = |requests: u64, at: &str| {
            bounds::check_limit(requests, window_ms, l.algorithm, l.burst).map_err(|e| {
                let name = match e.field {
                    LimitField::Requests => at,
                    LimitField::Window => "window",
                    LimitField::Burst => "burst",
                };
                err(field(name), e.problem)
            })
        };
        check_numbers(l.requests, "requests")?;
        let by = match &l.by {
            None => vec![Attribute::Client],
            Some(list) => validate_by(&field, list)?,
        };
        let mut overrides = Vec::with_capacity(l.overrides.len());
        for (k, o) in l.overrides.iter().enumerate() {
            check_numbers(o.requests, &format!("overrides[{k}].requests"))?;
            if o.subjects.is_empty() || o.subjects.iter().any(String::is_empty) {
                return Err(err(
                    field(&format!("overrides[{k}].subjects")),
                    "list at least one subject, none empty",
                ));
            }
            overrides.push(StaticOverride {
                subjects: o.subjects.clone(),
                requests: o.requests,
            });
        }
        limits.push(Rc::new(LimitConfig {
            qualified_name: format!("{}/{}", raw.name, l.name),
            name: l.name,
            requests: l.requests,
            window_ms,
            algorithm: l.algorithm,
            burst: l.burst,
            by,
            missing: l.missing,
            overrides,
            calendar,
            share_ppm,
        }));
    }
    let cost = validate_cost(i, raw.cost)?;
    if matches!(cost, Cost::Tokens(_)) && raw.scope == Scope::Local {
        return Err(err(
            format!("rules[{i}].scope"),
            "a token-priced rule must be global: its settlement is a call",
        ));
    }
    Ok(Rule {
        name: raw.name,
        matcher,
        limits,
        cost,
        shadow: raw.shadow,
        scope: raw.scope,
    })
}

/// The most a token cost may reserve per request (a bound on what one
/// request can hold of a budget).
const MAX_RESERVE: u64 = MAX_COST;

fn validate_cost(i: usize, raw: Option<serde_json::Value>) -> Result<Cost, ConfigError> {
    let at = |f: &str| {
        if f.is_empty() {
            format!("rules[{i}].cost")
        } else {
            format!("rules[{i}].cost.{f}")
        }
    };
    /// Reads one shape of the cost, naming the field a problem is in.
    fn read<T: serde::de::DeserializeOwned>(
        value: serde_json::Value,
        at: &dyn Fn(&str) -> String,
    ) -> Result<T, ConfigError> {
        serde_path_to_error::deserialize(value).map_err(|e| {
            let field = e.path().to_string();
            let field = if field == "." { String::new() } else { field };
            err(at(&field), e.into_inner().to_string())
        })
    }
    let Some(value) = raw else {
        return Ok(Cost::Fixed(1));
    };
    if !value.is_object() {
        let n = value.as_u64().ok_or_else(|| {
            err(
                at(""),
                "a whole number, {\"header\": ...} or {\"response\": ...}",
            )
        })?;
        return match n {
            0 => Err(err(at(""), "must be at least 1")),
            n if n > MAX_COST => Err(err(at(""), format!("must be at most {MAX_COST}"))),
            n => Ok(Cost::Fixed(n)),
        };
    }
    if value.get("response").is_some() {
        return validate_token_cost(read::<RawTokenCost>(value, &at)?, &at);
    }
    let h: RawCostHeader = read(value, &at)?;
    let name = h.header.trim().to_ascii_lowercase();
    if name.is_empty() || !name.bytes().all(is_header_name_byte) {
        return Err(err(
            at("header"),
            format!("\"{}\" is not a valid header name", h.header),
        ));
    }
    if h.max == 0 || h.max > MAX_COST {
        return Err(err(at("max"), format!("must be between 1 and {MAX_COST}")));
    }
    if h.default == 0 || h.default > h.max {
        return Err(err(at("default"), "must be between 1 and max"));
    }
    Ok(Cost::Header {
        name,
        default: h.default,
        max: h.max,
    })
}

fn validate_token_cost(
    raw: RawTokenCost,
    at: &dyn Fn(&str) -> String,
) -> Result<Cost, ConfigError> {
    let path = |field: &str, p: &str| -> Result<Vec<String>, ConfigError> {
        let parts: Vec<String> = p.split('.').map(str::to_string).collect();
        if p.len() > 256 || parts.iter().any(String::is_empty) || parts.len() > 8 {
            return Err(err(
                at(field),
                format!("\"{p}\" is not a dotted JSON path (like usage.total_tokens)"),
            ));
        }
        Ok(parts)
    };
    let usage = UsageSource {
        json: raw
            .response
            .json
            .as_deref()
            .map(|p| path("response.json", p))
            .transpose()?,
        sse_json: raw
            .response
            .sse_json
            .as_deref()
            .map(|p| path("response.sse_json", p))
            .transpose()?,
        header: match raw.response.header {
            None => None,
            Some(h) => {
                let name = h.trim().to_ascii_lowercase();
                if name.is_empty() || !name.bytes().all(is_header_name_byte) {
                    return Err(err(
                        at("response.header"),
                        format!("\"{h}\" is not a valid header name"),
                    ));
                }
                Some(name)
            }
        },
    };
    if usage.json.is_none() && usage.sse_json.is_none() && usage.header.is_none() {
        return Err(err(
            at("response"),
            "name where the usage is: json, sse_json or header",
        ));
    }
    match (raw.mode, raw.reserve.is_some()) {
        // Reserving one unit and settling after is mode "after".
        (TokenMode::Reserve, false) => {
            return Err(err(
                at("reserve"),
                "mode \"reserve\" needs a reservation: a number, or {\"request_json\": ..., \"default\": ..., \"max\": ...}",
            ))
        }
        (TokenMode::After, true) => {
            return Err(err(
                at("reserve"),
                "mode \"after\" holds one unit per request and reserves nothing: remove reserve",
            ))
        }
        _ => {}
    }
    let reserve = match raw.reserve {
        None => Reserve::Fixed(1),
        Some(RawReserve::Fixed(n)) if (1..=MAX_RESERVE).contains(&n) => Reserve::Fixed(n),
        Some(RawReserve::Fixed(_)) => {
            return Err(err(
                at("reserve"),
                format!("must be between 1 and {MAX_RESERVE}"),
            ))
        }
        Some(RawReserve::Request(r)) => {
            if r.max == 0 || r.max > MAX_RESERVE {
                return Err(err(
                    at("reserve.max"),
                    format!("must be between 1 and {MAX_RESERVE}"),
                ));
            }
            if r.default == 0 || r.default > r.max {
                return Err(err(at("reserve.default"), "must be between 1 and max"));
            }
            Reserve::RequestJson {
                path: path("reserve.request_json", &r.request_json)?,
                default: r.default,
                max: r.max,
            }
        }
    };
    if !(1024..=16 << 20).contains(&raw.max_body_bytes) {
        return Err(err(
            at("max_body_bytes"),
            "must be between 1024 and 16777216",
        ));
    }
    Ok(Cost::Tokens(Rc::new(TokenCost {
        reserve,
        usage,
        mode: raw.mode,
        max_body_bytes: raw.max_body_bytes as usize,
        refund_on_error: raw.refund_on_error,
    })))
}

fn validate_match(i: usize, raw: RawMatch) -> Result<Match, ConfigError> {
    let at = |f: &str| format!("rules[{i}].match.{f}");
    let slash = |field: String, p: String| {
        if p.starts_with('/') {
            Ok(p)
        } else {
            Err(err(field, "must start with '/'"))
        }
    };
    let path = match (raw.path_prefix, raw.path) {
        (Some(_), Some(_)) => {
            return Err(err(at("path"), "give either path_prefix or path, not both"));
        }
        (Some(prefix), None) => PathMatch::Prefix(slash(at("path_prefix"), prefix)?),
        (None, None) => PathMatch::Prefix("/".into()),
        (
            None,
            Some(RawPath {
                exact: Some(e),
                prefix: None,
            }),
        ) => PathMatch::Exact(slash(at("path.exact"), e)?),
        (
            None,
            Some(RawPath {
                exact: None,
                prefix: Some(p),
            }),
        ) => PathMatch::Prefix(slash(at("path.prefix"), p)?),
        (None, Some(_)) => {
            return Err(err(at("path"), "needs exactly one of exact or prefix"));
        }
    };
    let mut methods = Vec::with_capacity(raw.methods.len());
    for (j, m) in raw.methods.iter().enumerate() {
        let upper = m.trim().to_ascii_uppercase();
        if upper.is_empty() || !upper.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(err(
                at(&format!("methods[{j}]")),
                format!("\"{m}\" is not an HTTP method"),
            ));
        }
        methods.push(upper);
    }
    let mut hosts = Vec::with_capacity(raw.hosts.len());
    for (j, h) in raw.hosts.iter().enumerate() {
        let lower = h.trim().to_ascii_lowercase();
        let (pattern, name) = match lower.strip_prefix("*.") {
            Some(rest) => (
                HostPattern::Subdomains(format!(".{rest}")),
                rest.to_string(),
            ),
            None => (HostPattern::Exact(lower.clone()), lower.clone()),
        };
        let valid = !name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
        if !valid {
            return Err(err(
                at(&format!("hosts[{j}]")),
                format!("\"{h}\" is not a host name (or *.domain for its subdomains)"),
            ));
        }
        hosts.push(pattern);
    }
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (j, h) in raw.headers.into_iter().enumerate() {
        let name = h.name.trim().to_ascii_lowercase();
        if name.is_empty() || !name.bytes().all(is_header_name_byte) {
            return Err(err(
                at(&format!("headers[{j}].name")),
                format!("\"{}\" is not a valid header name", h.name),
            ));
        }
        let test = condition_test(&at(&format!("headers[{j}]")), h)?;
        headers.push(HeaderCondition { name, test });
    }
    let mut claims = Vec::with_capacity(raw.claims.len());
    for (j, c) in raw.claims.into_iter().enumerate() {
        let name = c.name.trim().to_string();
        if name.is_empty() || name.len() > 256 {
            return Err(err(
                at(&format!("claims[{j}].name")),
                "a claim name of 1 to 256 characters",
            ));
        }
        let test = condition_test(&at(&format!("claims[{j}]")), c)?;
        claims.push(HeaderCondition { name, test });
    }
    Ok(Match {
        hosts,
        path,
        methods,
        headers,
        claims,
    })
}

/// The one test of a header or claim condition at `at`.
fn condition_test(at: &str, c: RawHeaderMatch) -> Result<HeaderTest, ConfigError> {
    Ok(match (c.exact, c.prefix, c.one_of, c.present, c.absent) {
        (Some(v), None, None, None, None) => HeaderTest::Exact(v),
        (None, Some(v), None, None, None) => HeaderTest::Prefix(v),
        (None, None, Some(vs), None, None) if !vs.is_empty() => HeaderTest::In(vs),
        (None, None, Some(_), None, None) => {
            return Err(err(format!("{at}.in"), "must list at least one value"));
        }
        (None, None, None, Some(true), None) => HeaderTest::Present,
        (None, None, None, None, Some(true)) => HeaderTest::Absent,
        (None, None, None, Some(false), None) | (None, None, None, None, Some(false)) => {
            return Err(err(
                at,
                "present and absent take true (use the other one for false)",
            ));
        }
        _ => {
            return Err(err(
                at,
                "needs exactly one of exact, prefix, in, present, absent",
            ));
        }
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
