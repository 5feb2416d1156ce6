//! From a request to a verdict, without the host.
//!
//! [`plan`] says what a request needs (nothing, a rejection, or a
//! [`Check`]); [`read_answer`] and [`read_batch_answer`] turn meshlimitd's
//! answer, or the lack of one, into [`CheckResult`]s or a [`ServiceError`];
//! and [`verdict`] turns a result into what the client sees. The order in
//! which these run is [`crate::flow`]'s business.

use meshlimit_protocol::{CheckOutcome, CheckResponse, CheckResult, ErrorBody, FailureKind};

use crate::check::{Applied, Check};
use std::rc::Rc;

use crate::client_id::Identity;
use crate::config::{Config, Cost, MissingAttribute, Reserve, Rule, Scope, TokenCost, TokenMode};
use crate::headers::{self, Headers};
use crate::host::{HeaderValue, RequestView};
pub use crate::reply::DenyResponse;
use crate::rules;
use crate::shared::deny_cache::DenyCache;
use crate::shared::SharedStore;
use crate::subject::{self, Facts, Missing};
use crate::tokens;

/// What a request needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// No rule matches, or every matching limit lacks an attribute it
    /// counts by (`skipped` of them): the filter stays out of the way.
    Pass { skipped: u32 },
    /// Refused before any check, for the reason given.
    Reject(DenyResponse, RejectReason),
    /// Decide these limits for this subject. Shared: a busy client's
    /// requests reuse one plan (`crate::plan_memo`) without copying it.
    Check(Rc<Check>),
}

/// Why a request was refused without a check (each has its own stat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// No client id and `when_missing: reject`.
    NoClientId,
    /// The cost header is not a whole number within bounds.
    InvalidCost,
    /// The request's cost exceeds a limit's capacity: it could never fit.
    CostAboveCapacity,
    /// A limit with `missing: reject` lacks an attribute it counts by.
    MissingAttribute,
}

/// What the client sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Forward the request; add these headers to the upstream's response.
    Allow {
        headers: Headers,
    },
    Deny(DenyResponse),
}

pub fn plan(cfg: &Config, req: &impl RequestView, method: &str, path: &str) -> Plan {
    let normalised = rules::request_path(path);
    let matched = rules::matching_path(&cfg.rules, &cfg.jwt, req, method, &normalised);
    if matched.is_empty() {
        return Plan::Pass { skipped: 0 };
    }
    let facts = Facts::new(cfg, req, method, path, &normalised);
    let (mut local, mut global) = (Vec::new(), Vec::new());
    let mut skipped = 0;
    let mut tokens = None;
    for rule in matched {
        if let Cost::Tokens(t) = &rule.cost {
            tokens.get_or_insert_with(|| t.clone());
        }
        let cost = match request_cost(rule, req) {
            Ok(cost) => cost,
            Err(body) => return Plan::Reject(plain(400, body), RejectReason::InvalidCost),
        };
        for limit in &rule.limits {
            let subject = match facts.subject_for(limit) {
                Ok(subject) => subject,
                Err(Missing::ClientId) => {
                    return Plan::Reject(
                        plain(
                            cfg.client_id.reject_status,
                            missing_client_id(&cfg.client_id),
                        ),
                        RejectReason::NoClientId,
                    )
                }
                Err(Missing::Attribute(_)) if limit.missing == MissingAttribute::Skip => {
                    skipped += 1;
                    continue;
                }
                Err(Missing::Attribute(attribute)) => {
                    let body = format!(
                        "missing {} for limit {}\n",
                        subject::attribute_name(&attribute),
                        limit.qualified_name
                    );
                    return Plan::Reject(plain(403, body), RejectReason::MissingAttribute);
                }
            };
            let limit = match limit.override_for(&subject.encoded, subject.plain()) {
                Some(requests) => Rc::new(limit.with_requests(requests)),
                None => limit.clone(),
            };
            let applied = Applied {
                limit,
                cost,
                shadow: rule.shadow,
                subject: subject.encoded,
                tokens: matches!(rule.cost, Cost::Tokens(_)),
            };
            if let Some(deny) = above_capacity(cfg, &applied) {
                return Plan::Reject(deny, RejectReason::CostAboveCapacity);
            }
            match rule.scope {
                Scope::Local => local.push(applied),
                Scope::Global => global.push(applied),
            }
        }
    }
    let Some(first) = local.first().or(global.first()) else {
        // Every limit lacked an attribute it counts by.
        return Plan::Pass { skipped };
    };
    let subject = match facts.known_client() {
        Some(Identity::Subject(client)) => client.clone(),
        _ => first.subject.clone(),
    };
    Plan::Check(Rc::new(Check {
        subject,
        local,
        global,
        skipped,
        tokens,
        lease: None,
        place: Default::default(),
        hit_policy: Default::default(),
    }))
}

/// The deny for a request whose cost exceeds an enforced limit's
/// capacity: waiting would never help, so it says why instead of a retry
/// time.
fn above_capacity(cfg: &Config, a: &Applied) -> Option<DenyResponse> {
    let limit = &a.limit;
    if a.cost <= limit.capacity() || a.shadow {
        return None;
    }
    let mut deny = plain(
        cfg.response.status,
        format!(
            "request cost {} exceeds the capacity {} of limit {}\n",
            a.cost,
            limit.capacity(),
            limit.qualified_name
        ),
    );
    deny.headers.push((
        "retry-after",
        headers::retry_after_secs(limit.window_ms).to_string(),
    ));
    Some(deny)
}

/// Prices `check`'s token-priced limits from the request's body (the
/// client's `max_tokens`, bounded by the configuration); `body` is `None`
/// when the request has none, or more than `max_body_bytes` of it. The
/// deny when the reservation can never fit.
pub fn reserve_from_body(
    cfg: &Config,
    check: &mut Check,
    body: Option<&[u8]>,
) -> Result<(), DenyResponse> {
    let Some(TokenCost {
        reserve: Reserve::RequestJson { path, default, max },
        ..
    }) = check.reserves_from_body()
    else {
        return Ok(());
    };
    let units = body
        .and_then(|b| tokens::json::body_number(b, path))
        .map_or(*default, |n| n.clamp(1, *max));
    check.reserve(units);
    match check.token_limits().find_map(|a| above_capacity(cfg, a)) {
        Some(deny) => Err(deny),
        None => Ok(()),
    }
}

/// The body of a `when_missing: reject` deny: where to put the id.
fn missing_client_id(cfg: &crate::config::ClientIdConfig) -> String {
    let mut ways = Vec::new();
    if !cfg.headers.is_empty() {
        ways.push(format!("one of these headers: {}", cfg.headers.join(", ")));
    }
    if !cfg.query_params.is_empty() {
        ways.push(format!(
            "one of these query parameters (once): {}",
            cfg.query_params.join(", ")
        ));
    }
    format!("missing client id: send {}\n", ways.join(", or "))
}

fn plain(status: u32, body: String) -> DenyResponse {
    DenyResponse {
        status,
        headers: vec![("content-type", "text/plain".into())],
        body,
    }
}

/// The rule's cost for this request, or the reason the cost header is
/// unusable.
fn request_cost(rule: &Rule, req: &impl RequestView) -> Result<u64, String> {
    match &rule.cost {
        Cost::Fixed(n) => Ok(*n),
        Cost::Header { name, default, max } => {
            let invalid =
                || format!("invalid {name} header: must be a whole number from 1 to {max}\n");
            match req.header(name) {
                HeaderValue::Absent => Ok(*default),
                // Two costs: which one would the client want counted?
                HeaderValue::Repeated => Err(invalid()),
                HeaderValue::Once(raw) => std::str::from_utf8(&raw)
                    .ok()
                    .and_then(|t| t.trim().parse::<u64>().ok())
                    .filter(|n| (1..=*max).contains(n))
                    .ok_or_else(invalid),
            }
        }
        // What is reserved before the response says what was used.
        Cost::Tokens(t) => Ok(match (t.mode, &t.reserve) {
            (TokenMode::After, _) => 1,
            (TokenMode::Reserve, Reserve::Fixed(n)) => *n,
            (TokenMode::Reserve, Reserve::RequestJson { default, .. }) => *default,
        }),
    }
}

/// Why the service's answer could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceError {
    /// No answer within the configured timeout.
    Timeout,
    /// No connection to any meshlimitd (refused, reset, no healthy host).
    Connection,
    /// meshlimitd answered 503: it cannot reach Redis.
    Unavailable,
    /// Any other non-200 status.
    BadStatus(u32),
    /// 200 with a body that is not a valid answer to our check.
    BadBody(String),
    /// meshlimitd decided the batch but refused this one check (it broke
    /// a rule of the API); the batch's other checks were decided.
    Refused(String),
}

impl ServiceError {
    /// Suffix of the stat counting this kind of error.
    pub fn kind(&self) -> &'static str {
        match self {
            ServiceError::Timeout => "timeout",
            ServiceError::Connection => "connection",
            ServiceError::Unavailable => "unavailable",
            ServiceError::BadStatus(_) => "bad_status",
            ServiceError::BadBody(_) => "bad_body",
            ServiceError::Refused(_) => "invalid_check",
        }
    }
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceError::Timeout => f.write_str("meshlimitd did not answer in time"),
            ServiceError::Connection => f.write_str("could not connect to meshlimitd"),
            ServiceError::Unavailable => f.write_str("meshlimitd cannot reach Redis (503)"),
            ServiceError::BadStatus(s) => write!(f, "meshlimitd answered status {s}"),
            ServiceError::BadBody(why) => write!(f, "meshlimitd sent an unusable body: {why}"),
            ServiceError::Refused(why) => write!(f, "meshlimitd refused the check: {why}"),
        }
    }
}

/// Largest answer body we will parse; anything bigger is not ours.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Reads meshlimitd's answer to a one-check call with `expected_limits`
/// limits. `status` is `None` when Envoy gave no response at all (it calls
/// back with no headers on timeout and reset); `timed_out` tells the two
/// apart from the elapsed time.
pub fn read_answer(
    status: Option<u32>,
    body: Option<&[u8]>,
    expected_limits: usize,
    timed_out: bool,
) -> Result<CheckResult, ServiceError> {
    let (mut results, _) = read_batch_answer(status, body, &[expected_limits], 0, timed_out)?;
    results
        .pop()
        .ok_or_else(|| ServiceError::BadBody("expected exactly one result".into()))?
}

/// The answer to each check of a batch call, and to each settlement.
pub type BatchAnswer = (
    Vec<Result<CheckResult, ServiceError>>,
    Vec<meshlimit_protocol::SettleOutcome>,
);

/// Reads the answer to a batch call: one outcome per check, in order, the
/// i-th decided with `expected_limits[i]` limit statuses, or refused on its
/// own. A failed call, or an answer that does not fit the batch (too few or
/// too many results, a result of the wrong shape), fails every check: its
/// results cannot be matched to checks.
pub fn read_batch_answer(
    status: Option<u32>,
    body: Option<&[u8]>,
    expected_limits: &[usize],
    expected_settlements: usize,
    timed_out: bool,
) -> Result<BatchAnswer, ServiceError> {
    let body = body.unwrap_or_default();
    match status {
        None if timed_out => return Err(ServiceError::Timeout),
        None => return Err(ServiceError::Connection),
        Some(200) => {}
        Some(504) => return Err(ServiceError::Timeout),
        Some(503) => {
            // meshlimitd's own 503 carries a JSON error; Envoy's local reply
            // for a failed connection does not.
            return Err(if serde_json::from_slice::<ErrorBody>(body).is_ok() {
                ServiceError::Unavailable
            } else {
                ServiceError::Connection
            });
        }
        Some(other) => return Err(ServiceError::BadStatus(other)),
    }
    if body.is_empty() {
        return Err(ServiceError::BadBody("empty body".into()));
    }
    let max =
        MAX_ANSWER_BYTES.saturating_mul((expected_limits.len() + expected_settlements).max(1));
    if body.len() > max {
        return Err(ServiceError::BadBody(format!("{} bytes", body.len())));
    }
    let answer: CheckResponse =
        serde_json::from_slice(body).map_err(|e| ServiceError::BadBody(e.to_string()))?;
    if answer.results.len() != expected_limits.len() {
        return Err(ServiceError::BadBody(format!(
            "expected {} result(s), got {}",
            expected_limits.len(),
            answer.results.len()
        )));
    }
    // A meshlimitd that predates settlements answers the checks and
    // leaves them out: the checks' decisions stand, the settlements failed
    // (their reservations stand: over-counted, never over budget).
    let settled = if answer.settled.len() == expected_settlements {
        answer.settled
    } else {
        let failure = meshlimit_protocol::CheckFailure {
            error: format!(
                "expected {expected_settlements} settlement outcome(s), got {}",
                answer.settled.len()
            ),
            kind: FailureKind::Invalid,
        };
        vec![meshlimit_protocol::SettleOutcome::Failed(failure); expected_settlements]
    };
    let mut results = Vec::with_capacity(answer.results.len());
    for (outcome, expected) in answer.results.into_iter().zip(expected_limits) {
        let result = match outcome {
            CheckOutcome::Decided(result) => result,
            CheckOutcome::Failed(failure) => {
                results.push(Err(match failure.kind {
                    FailureKind::Invalid => ServiceError::Refused(failure.error),
                    FailureKind::Unavailable => ServiceError::Unavailable,
                }));
                continue;
            }
        };
        if result.limits.len() != *expected {
            return Err(ServiceError::BadBody(format!(
                "expected {expected} limit statuses, got {}",
                result.limits.len()
            )));
        }
        let enforced_allow = result
            .limits
            .iter()
            .filter(|l| !l.shadow)
            .all(|l| l.allowed);
        if result.allowed != enforced_allow {
            return Err(ServiceError::BadBody(
                "overall decision contradicts the limits".into(),
            ));
        }
        results.push(Ok(result));
    }
    Ok((results, settled))
}

/// What the client sees for a decided check.
pub fn verdict(cfg: &Config, limits: &[Applied], result: &CheckResult) -> Verdict {
    let mut hdrs = if crate::flow::profile::SKIP_HEADERS {
        Vec::new()
    } else {
        headers::rate_limit_headers(cfg.response.headers, limits, result)
    };
    if result.allowed {
        return Verdict::Allow { headers: hdrs };
    }
    let retry_ms = result
        .most_constraining()
        .map_or(1000, |s| s.retry_after_ms);
    hdrs.push((
        "retry-after",
        headers::retry_after_secs(retry_ms).to_string(),
    ));
    let mut deny = deny_response(cfg, hdrs);
    if let Some(reason) = result
        .limits
        .iter()
        .filter(|s| !s.shadow)
        .find_map(|s| s.reason.as_deref())
    {
        deny.body = format!("{reason}\n");
    }
    Verdict::Deny(deny)
}

/// A deny from the deny cache, if one of `global_limits` is known to be
/// exhausted for `subject`. Only cost-1 limits are cached: a retry time
/// computed for a heavier request would over-deny a lighter one.
pub fn cached_deny<S: SharedStore>(
    cfg: &Config,
    check: &Check,
    cache: &DenyCache<'_, S>,
    now_ms: u64,
) -> Option<Verdict> {
    let mut candidates = check.global.iter().filter(|a| !a.shadow && a.cost == 1);
    // Several limits: one read says whether any deny is recent enough to
    // be trusted, instead of one read per limit on every request.
    if candidates.clone().nth(1).is_some() && cache.quiet(now_ms) {
        return None;
    }
    candidates.find_map(|a| {
        let until = cache.denied_until(&a.subject, &a.limit, now_ms)?;
        let wait = until - now_ms;
        let result = CheckResult {
            allowed: false,
            limits: vec![meshlimit_protocol::LimitStatus {
                allowed: false,
                limit: a.limit.requests,
                remaining: 0,
                reset_after_ms: wait,
                retry_after_ms: wait,
                shadow: false,
                reason: None,
            }],
            receipts: None,
            leased: 0,
        };
        Some(verdict(cfg, std::slice::from_ref(a), &result))
    })
}

/// Remembers in the deny cache every enforced cost-1 global limit that
/// `result` (meshlimitd's answer for `check`) reports exhausted, until it
/// may admit again. Returns how many live entries of other subjects that
/// evicted.
pub fn remember_denials<S: SharedStore>(
    check: &Check,
    result: &CheckResult,
    cache: &DenyCache<'_, S>,
    now_ms: u64,
) -> usize {
    let mut evicted = 0;
    for (a, status) in check.global.iter().zip(&result.limits) {
        if !a.shadow
            && a.cost == 1
            && !status.allowed
            && status.remaining == 0
            && status.reason.is_none()
            && status.retry_after_ms > 0
        {
            evicted += usize::from(cache.remember(
                &a.subject,
                &a.limit,
                now_ms + status.retry_after_ms,
                now_ms,
            ));
        }
    }
    evicted
}

/// One result for a request decided partly locally (`scope: local` rules)
/// and partly globally, in the order `local` then `global`.
pub fn combine(
    local: (&[Applied], &CheckResult),
    global: (&[Applied], &CheckResult),
) -> (Vec<Applied>, CheckResult) {
    let applied = local.0.iter().chain(global.0).cloned().collect();
    let result = CheckResult {
        allowed: local.1.allowed && global.1.allowed,
        limits: local
            .1
            .limits
            .iter()
            .chain(&global.1.limits)
            .cloned()
            .collect(),
        receipts: None,
        leased: 0,
    };
    (applied, result)
}

/// How many shadow limits of `result` would have denied the request.
pub fn shadow_denials(result: &CheckResult) -> usize {
    result
        .limits
        .iter()
        .filter(|s| s.shadow && !s.allowed)
        .count()
}

/// The configured deny, for `failure_mode: deny` (nothing is known about the
/// quota, so only a short `Retry-After`).
pub fn failure_deny(cfg: &Config) -> Verdict {
    Verdict::Deny(deny_response(cfg, vec![("retry-after", "1".into())]))
}

fn deny_response(cfg: &Config, mut hdrs: Headers) -> DenyResponse {
    hdrs.push(("content-type", "text/plain".into()));
    DenyResponse {
        status: cfg.response.status,
        headers: hdrs,
        body: cfg.response.body.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::host::fake::FakeRequest;
    use crate::testing;
    use meshlimit_protocol::LimitStatus;

    fn cfg(extra: &str) -> Config {
        config::parse(
            format!(
                r#"{{{extra}"rules":[
                {{"name":"api","match":{{"path_prefix":"/api/","methods":["GET"]}},
                  "limits":[{{"name":"per-minute","requests":20,"window":"60s"}},{{"name":"per-hour","requests":100,"window":"1h"}}]}},
                {{"name":"all","limits":[{{"name":"burst","requests":50,"window":"1s"}}]}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn keyed() -> Config {
        cfg(r#""client_id":{"headers":["x-api-key"],"when_missing":"reject"},"#)
    }

    #[test]
    fn every_limit_of_every_matching_rule_is_in_one_check() {
        let c = keyed();
        let req = FakeRequest::default().with_header("x-api-key", b"A");
        let Plan::Check(p) = plan(&c, &req, "GET", "/api/items") else {
            panic!("expected a check")
        };
        let refs: Vec<_> = p
            .global
            .iter()
            .map(|a| (a.limit.qualified_name.as_str(), a.cost))
            .collect();
        assert_eq!(
            refs,
            vec![("api/per-minute", 1), ("api/per-hour", 1), ("all/burst", 1)]
        );
        let body = p.to_request();
        assert_eq!(body.checks.len(), 1);
        let names: Vec<_> = body.checks[0]
            .limits
            .iter()
            .map(|l| l.name.as_str())
            .collect();
        assert_eq!(names, ["api/per-minute", "api/per-hour", "all/burst"]);
        assert_eq!(body.checks[0].subject, "hdr:x-api-key:A");
        assert_eq!(body.checks[0].limits[0].window_ms, 60_000);
    }

    #[test]
    fn unmatched_requests_pass_and_missing_ids_are_rejected() {
        let c = cfg(r#""client_id":{"headers":["x-api-key"],"when_missing":"reject"},"#);
        let only_api = config::parse(
            br#"{"client_id":{"headers":["x-api-key"],"when_missing":"reject"},"rules":[{"name":"api","match":{"path_prefix":"/api/"},"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            plan(&only_api, &FakeRequest::default(), "GET", "/health"),
            Plan::Pass { skipped: 0 }
        );
        let Plan::Reject(r, RejectReason::NoClientId) =
            plan(&c, &FakeRequest::default(), "GET", "/api/x")
        else {
            panic!("expected a rejection")
        };
        assert_eq!(r.status, 401);
        assert!(r.body.contains("x-api-key"));
    }

    fn status(allowed: bool, limit: u64, remaining: u64, reset: u64) -> LimitStatus {
        testing::status(
            allowed,
            limit,
            remaining,
            reset,
            if allowed { 0 } else { reset },
        )
    }

    fn applied(c: &Config, refs: &[(usize, usize)]) -> Vec<Applied> {
        refs.iter()
            .map(|&(r, l)| testing::applied(&c.rules[r].limits[l]))
            .collect()
    }

    fn body(results: &str) -> Vec<u8> {
        format!(r#"{{"results":[{results}]}}"#).into_bytes()
    }

    #[test]
    fn answers_are_read_and_checked() {
        let ok = body(
            r#"{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":500,"retry_after_ms":0}]}"#,
        );
        let r = read_answer(Some(200), Some(&ok), 1, false).unwrap();
        assert!(r.allowed);
        assert_eq!(r.limits[0].remaining, 19);
        assert!(matches!(
            read_answer(Some(200), Some(&ok), 2, false),
            Err(ServiceError::BadBody(_))
        ));
    }

    #[test]
    fn every_kind_of_failure_is_classified() {
        use ServiceError::*;
        assert_eq!(read_answer(None, None, 1, true), Err(Timeout));
        assert_eq!(read_answer(None, None, 1, false), Err(Connection));
        assert_eq!(read_answer(Some(504), None, 1, false), Err(Timeout));
        assert_eq!(
            read_answer(
                Some(503),
                Some(b"upstream connect error or disconnect/reset before headers"),
                1,
                false
            ),
            Err(Connection)
        );
        assert_eq!(
            read_answer(Some(503), Some(br#"{"error":"redis down"}"#), 1, false),
            Err(Unavailable)
        );
        assert_eq!(
            read_answer(Some(400), Some(b"{}"), 1, false),
            Err(BadStatus(400))
        );
        for bad in [
            &b""[..],
            b"not json",
            b"{\"results\":[]}",
            b"[1,2]",
            &[0xff; 10],
        ] {
            assert!(
                matches!(read_answer(Some(200), Some(bad), 1, false), Err(BadBody(_))),
                "{bad:?}"
            );
        }
        let huge = vec![b' '; MAX_ANSWER_BYTES + 1];
        assert!(matches!(
            read_answer(Some(200), Some(&huge), 1, false),
            Err(BadBody(_))
        ));
        let contradiction = body(
            r#"{"allowed":true,"limits":[{"allowed":false,"limit":1,"remaining":0,"reset_after_ms":1,"retry_after_ms":1}]}"#,
        );
        assert!(matches!(
            read_answer(Some(200), Some(&contradiction), 1, false),
            Err(BadBody(_))
        ));
    }

    /// Rolling upgrades: a newer meshlimitd may add optional fields; an
    /// older filter reads the answer as before (it used to refuse it, and
    /// every check fell back until the filter was upgraded too).
    #[test]
    fn answers_from_a_newer_meshlimitd_are_read() {
        let newer = r#"{"results":[{"allowed":true,"lease":{"units":5},"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":500,"retry_after_ms":0,"tokens_left":3}]}],"served_by":"meshlimitd-2"}"#;
        let r = read_answer(Some(200), Some(newer.as_bytes()), 1, false).unwrap();
        assert!(r.allowed);
        assert_eq!(r.limits[0].remaining, 19);
    }

    #[test]
    fn batch_answers_are_read_in_order_and_checked_whole() {
        let one = r#"{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":500,"retry_after_ms":0}]}"#;
        let denied = r#"{"allowed":false,"limits":[{"allowed":false,"limit":20,"remaining":0,"reset_after_ms":500,"retry_after_ms":500}]}"#;
        let b = body(&format!("{one},{denied}"));
        let (results, _) = read_batch_answer(Some(200), Some(&b), &[1, 1], 0, false).unwrap();
        assert!(results[0].as_ref().unwrap().allowed && !results[1].as_ref().unwrap().allowed);
        assert!(matches!(
            read_batch_answer(Some(200), Some(&b), &[1, 1, 1], 0, false),
            Err(ServiceError::BadBody(_))
        ));
        assert!(matches!(
            read_batch_answer(Some(200), Some(&b), &[1, 2], 0, false),
            Err(ServiceError::BadBody(_))
        ));
        assert_eq!(
            read_batch_answer(None, None, &[1, 1], 0, true),
            Err(ServiceError::Timeout)
        );
    }

    /// An older meshlimitd leaves settlements unanswered: its checks'
    /// decisions stand, only the settlements failed.
    #[test]
    fn settlements_left_unanswered_fail_alone() {
        let one = r#"{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":500,"retry_after_ms":0}]}"#;
        let (results, settled) =
            read_batch_answer(Some(200), Some(&body(one)), &[1], 2, false).unwrap();
        assert!(results[0].as_ref().unwrap().allowed);
        assert_eq!(settled.len(), 2);
        assert!(settled
            .iter()
            .all(|s| matches!(s, meshlimit_protocol::SettleOutcome::Failed(_))));
    }

    #[test]
    fn deny_carries_status_retry_after_and_headers() {
        let c = keyed();
        let limits = applied(&c, &[(0, 0)]);
        let result = CheckResult {
            allowed: false,
            limits: vec![status(false, 20, 0, 41_200)],
            receipts: None,
            leased: 0,
        };
        let Verdict::Deny(d) = verdict(&c, &limits, &result) else {
            panic!("expected deny")
        };
        assert_eq!(d.status, 429);
        assert_eq!(d.body, "rate limit exceeded\n");
        let get = |n: &str| {
            d.headers
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(get("retry-after").as_deref(), Some("42"));
        assert_eq!(
            get("ratelimit").as_deref(),
            Some("\"api/per-minute\";r=0;t=42")
        );
        assert_eq!(
            get("ratelimit-policy").as_deref(),
            Some("\"api/per-minute\";q=20;w=60")
        );
    }

    #[test]
    fn allow_carries_headers_for_the_response() {
        let c = keyed();
        let limits = applied(&c, &[(0, 0), (0, 1)]);
        let result = CheckResult {
            allowed: true,
            limits: vec![status(true, 20, 5, 1000), status(true, 100, 2, 2000)],
            receipts: None,
            leased: 0,
        };
        let Verdict::Allow { headers } = verdict(&c, &limits, &result) else {
            panic!("expected allow")
        };
        assert!(headers.contains(&("ratelimit", "\"api/per-hour\";r=2;t=2".into())));
    }

    fn cost_cfg(cost: &str, shadow: bool) -> Config {
        config::parse(
            format!(
                r#"{{"client_id":{{"headers":["x-api-key"]}},"rules":[{{"name":"api","cost":{cost},"shadow":{shadow},
                  "limits":[{{"name":"m","requests":10,"window":"60s"}}]}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn cost_comes_from_the_rule_or_a_bounded_header() {
        let req = FakeRequest::default().with_header("x-api-key", b"A");
        let Plan::Check(p) = plan(&cost_cfg("5", false), &req, "GET", "/") else {
            panic!("expected a check")
        };
        assert_eq!(p.global[0].cost, 5);
        assert_eq!(p.to_request().checks[0].limits[0].cost, 5);
        let header = cost_cfg(r#"{"header":"x-cost","max":10,"default":2}"#, false);
        let cost_of = |v: Option<&[u8]>| {
            let mut r = FakeRequest::default().with_header("x-api-key", b"A");
            if let Some(v) = v {
                r = r.with_header("x-cost", v);
            }
            plan(&header, &r, "GET", "/")
        };
        assert!(matches!(cost_of(None), Plan::Check(p) if p.global[0].cost == 2));
        assert!(matches!(cost_of(Some(b" 7 ")), Plan::Check(p) if p.global[0].cost == 7));
        for bad in [&b"0"[..], b"11", b"-1", b"x", b"1.5", &[0xff]] {
            let Plan::Reject(d, RejectReason::InvalidCost) = cost_of(Some(bad)) else {
                panic!("{bad:?} should be refused")
            };
            assert_eq!(d.status, 400);
            assert!(d.body.contains("from 1 to 10"), "{}", d.body);
        }
    }

    #[test]
    fn a_cost_above_capacity_is_denied_with_the_reason() {
        let req = FakeRequest::default().with_header("x-api-key", b"A");
        let Plan::Reject(d, RejectReason::CostAboveCapacity) =
            plan(&cost_cfg("11", false), &req, "GET", "/")
        else {
            panic!("expected a rejection")
        };
        assert_eq!(d.status, 429);
        assert_eq!(
            d.body,
            "request cost 11 exceeds the capacity 10 of limit api/m\n"
        );
        assert!(d.headers.contains(&("retry-after", "60".into())));
        // In shadow mode it is only observed.
        assert!(matches!(
            plan(&cost_cfg("11", true), &req, "GET", "/"),
            Plan::Check(_)
        ));
    }

    #[test]
    fn shadow_denials_do_not_deny() {
        let c = cost_cfg("1", true);
        let req = FakeRequest::default().with_header("x-api-key", b"A");
        let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
            panic!("expected a check")
        };
        let limits = p.all();
        assert!(limits[0].shadow);
        let body = body(
            r#"{"allowed":true,"limits":[{"allowed":false,"limit":10,"remaining":0,"reset_after_ms":5,"retry_after_ms":5,"shadow":true}]}"#,
        );
        let result = read_answer(Some(200), Some(&body), 1, false).unwrap();
        assert!(
            matches!(verdict(&c, &limits, &result), Verdict::Allow { headers } if headers.is_empty())
        );
    }

    #[test]
    fn denials_are_cached_until_retry_and_answered_locally() {
        use crate::host::fake::FakeStore;
        use crate::shared::deny_cache::DenyCache;
        let c = keyed();
        let store = FakeStore::default();
        let cache = DenyCache {
            slots: 64,
            seed: (1, 2),
            store: &store,
        };
        let req = FakeRequest::default().with_header("x-api-key", b"A");
        let Plan::Check(p) = plan(&c, &req, "GET", "/api/x") else {
            panic!("expected a check")
        };
        assert!(cached_deny(&c, &p, &cache, 1_000).is_none());
        let result = CheckResult {
            allowed: false,
            limits: vec![
                status(false, 20, 0, 30_000),
                status(true, 100, 50, 1000),
                status(true, 50, 3, 10),
            ],
            receipts: None,
            leased: 0,
        };
        remember_denials(&p, &result, &cache, 1_000);
        let Some(Verdict::Deny(d)) = cached_deny(&c, &p, &cache, 1_500) else {
            panic!("expected a cached deny")
        };
        assert!(d.headers.contains(&("retry-after", "30".into())));
        assert!(d
            .headers
            .contains(&("ratelimit", "\"api/per-minute\";r=0;t=30".into())));
        assert!(
            cached_deny(&c, &p, &cache, 2_000).is_none(),
            "trusted for a second, then asked again"
        );
        // Another client is not affected.
        let other = FakeRequest::default().with_header("x-api-key", b"B");
        let Plan::Check(q) = plan(&c, &other, "GET", "/api/x") else {
            panic!("expected a check")
        };
        assert!(cached_deny(&c, &q, &cache, 1_500).is_none());
    }

    #[test]
    fn local_rules_stay_out_of_the_call_and_results_combine() {
        let c = config::parse(
            br#"{"client_id":{"headers":["x-api-key"]},"rules":[
              {"name":"edge","scope":"local","limits":[{"name":"s","requests":5,"window":"1s"}]},
              {"name":"api","limits":[{"name":"m","requests":100,"window":"60s"}]}]}"#,
        )
        .unwrap();
        let req = FakeRequest::default().with_header("x-api-key", b"A");
        let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
            panic!("expected a check")
        };
        let (local, global) = (&p.local, &p.global);
        assert_eq!((local.len(), global.len()), (1, 1));
        let body = p.to_request();
        assert_eq!(body.checks[0].limits.len(), 1);
        assert_eq!(body.checks[0].limits[0].name, "api/m");
        let l = CheckResult {
            allowed: true,
            limits: vec![status(true, 5, 1, 300)],
            receipts: None,
            leased: 0,
        };
        let g = CheckResult {
            allowed: true,
            limits: vec![status(true, 100, 40, 9000)],
            receipts: None,
            leased: 0,
        };
        let (applied, result) = combine((local, &l), (global, &g));
        let Verdict::Allow { headers } = verdict(&c, &applied, &result) else {
            panic!("expected allow")
        };
        assert!(headers.contains(&("ratelimit", "\"edge/s\";r=1;t=1".into())));
        let denied = CheckResult {
            allowed: false,
            limits: vec![status(false, 100, 0, 9000)],
            receipts: None,
            leased: 0,
        };
        let (_, result) = combine((local, &l), (global, &denied));
        assert!(!result.allowed);
    }

    #[test]
    fn failure_deny_uses_the_configured_response() {
        let c = cfg(r#""response":{"status":503,"body":"busy\n"},"#);
        let Verdict::Deny(d) = failure_deny(&c) else {
            panic!("expected deny")
        };
        assert_eq!((d.status, d.body.as_str()), (503, "busy\n"));
        assert!(d.headers.contains(&("retry-after", "1".into())));
    }

    /// Rules with limits counted by other attributes than the client.
    fn by_cfg() -> Config {
        config::parse(
            br#"{"client_id":{"headers":["x-api-key"],"when_missing":"reject"},"rules":[
              {"name":"route","limits":[{"name":"cap","requests":100,"window":"1s","by":[]}]},
              {"name":"tenant","limits":[
                {"name":"m","requests":10,"window":"60s","by":["header:x-tenant"],
                 "overrides":[{"subjects":["big"],"requests":1000}]},
                {"name":"strict","requests":5,"window":"60s","by":["header:x-region"],"missing":"reject"}]}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn each_limit_carries_its_own_subject_and_the_wire_names_only_the_others() {
        let c = by_cfg();
        let req = FakeRequest::default()
            .with_header("x-tenant", b"big")
            .with_header("x-region", b"eu");
        let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
            panic!("expected a check")
        };
        let subjects: Vec<&str> = p.global.iter().map(|a| a.subject.as_str()).collect();
        assert_eq!(subjects, ["*", "hdr:x-tenant:big", "hdr:x-region:eu"]);
        // No limit counts by the client: no client id was needed (and
        // `when_missing: reject` did not refuse the request).
        assert_eq!(p.subject, "*");
        let wire = p.to_request();
        let limits = &wire.checks[0].limits;
        assert_eq!(wire.checks[0].subject, "*");
        assert_eq!(limits[0].subject, None, "the check's own subject");
        assert_eq!(limits[1].subject.as_deref(), Some("hdr:x-tenant:big"));
        assert_eq!(limits[1].requests, 1000, "the static override, by value");
        assert_eq!(limits[2].requests, 5);
    }

    #[test]
    fn a_missing_attribute_skips_or_refuses_as_configured() {
        let c = by_cfg();
        // No tenant: `m` is skipped; the region limit still applies.
        let req = FakeRequest::default().with_header("x-region", b"eu");
        let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
            panic!("expected a check")
        };
        assert_eq!(p.skipped, 1);
        assert_eq!(p.global.len(), 2);
        // No region: refused, naming the attribute and the limit.
        let req = FakeRequest::default().with_header("x-tenant", b"t");
        let Plan::Reject(d, RejectReason::MissingAttribute) = plan(&c, &req, "GET", "/") else {
            panic!("expected a refusal")
        };
        assert_eq!(d.status, 403);
        assert_eq!(d.body, "missing header:x-region for limit tenant/strict\n");
        // A header sent twice is no value at all.
        let twice = FakeRequest::default()
            .with_header("x-region", b"eu")
            .with_header("x-region", b"us");
        assert!(matches!(
            plan(&c, &twice, "GET", "/"),
            Plan::Reject(_, RejectReason::MissingAttribute)
        ));
    }

    #[test]
    fn every_limit_skipped_means_nothing_to_check() {
        let c = config::parse(
            br#"{"rules":[{"name":"t","limits":[{"name":"m","requests":1,"window":"1s","by":["jwt:sub"]}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            plan(&c, &FakeRequest::default(), "GET", "/"),
            Plan::Pass { skipped: 1 }
        );
    }

    #[test]
    fn the_client_id_is_the_checks_subject_when_a_limit_counts_by_it() {
        let c = config::parse(
            br#"{"client_id":{"headers":["x-api-key"]},"rules":[
              {"name":"route","limits":[{"name":"cap","requests":100,"window":"1s","by":[]}]},
              {"name":"api","limits":[{"name":"m","requests":10,"window":"60s",
                "overrides":[{"subjects":["vip"],"requests":99}]}]}]}"#,
        )
        .unwrap();
        let req = FakeRequest::default().with_header("x-api-key", b"vip");
        let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
            panic!("expected a check")
        };
        assert_eq!(p.subject, "hdr:x-api-key:vip");
        let wire = p.to_request();
        assert_eq!(wire.checks[0].limits[0].subject.as_deref(), Some("*"));
        assert_eq!(wire.checks[0].limits[1].subject, None);
        assert_eq!(
            wire.checks[0].limits[1].requests, 99,
            "an override by the id's value"
        );
    }
}
