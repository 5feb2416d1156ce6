//! HTTP API: `POST /v1/check`, `GET /healthz`, `GET /readyz`, `GET /metrics`,
//! and the admin API of [`crate::admin`].
//!
//! Status codes are a contract with the filter: 200 is a decision, 400 and
//! 413 are the caller's mistake (with a reason), 503 means "Redis cannot
//! decide now, fall back". Nothing else is 5xx.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use meshlimit_protocol::bounds::{self, LimitField};
use meshlimit_protocol::{
    Check, CheckFailure, CheckOutcome, CheckRequest, CheckResponse, CheckResult, ErrorBody,
    FailureKind, Limit, SettleOutcome, Settlement, CHECK_PATH, TIMEOUT_HEADER,
};
use std::time::Duration;
use tracing::{debug, warn};

use crate::limiter::{Limiter, LimiterError};
use crate::metrics::Metrics;

/// Bounds on one call, so one caller cannot make a script or a reply huge.
pub const MAX_CHECKS: usize = 1024;
pub const MAX_LIMITS_PER_CHECK: usize = 32;
pub const MAX_SUBJECT_BYTES: usize = 64 * 1024;

#[derive(Clone)]
pub struct AppState {
    pub limiter: Limiter,
    pub metrics: Metrics,
    pub limits: Limits,
    /// Checks being decided now; waiting for a permit is the queue.
    pub in_flight: std::sync::Arc<tokio::sync::Semaphore>,
    pub error_log: std::sync::Arc<LogEvery>,
    /// `Bearer <secret>` every check must carry, when configured.
    pub authorization: Option<std::sync::Arc<[u8]>>,
    /// `Bearer <admin secret>` of the admin API; `None`: the API is off.
    pub admin_authorization: Option<std::sync::Arc<[u8]>>,
}

/// Bounds on work in progress.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Requests decided at once; more wait up to `queue_timeout`.
    pub max_in_flight: usize,
    pub queue_timeout: std::time::Duration,
    /// Deadline for a whole request, queueing included.
    pub request_timeout: std::time::Duration,
}

impl AppState {
    pub fn new(limiter: Limiter, metrics: Metrics, limits: Limits) -> Self {
        AppState {
            limiter,
            metrics,
            limits,
            in_flight: std::sync::Arc::new(tokio::sync::Semaphore::new(
                limits.max_in_flight.max(1),
            )),
            error_log: std::sync::Arc::new(LogEvery::default()),
            authorization: None,
            admin_authorization: None,
        }
    }

    /// Turns the admin API (live overrides) on, behind `token`; the
    /// limiter then reads overrides in every decision.
    pub fn with_admin_token(mut self, token: Option<String>) -> Self {
        self.limiter = self.limiter.clone().with_overrides(token.is_some());
        self.admin_authorization = token.map(|t| format!("Bearer {t}").into_bytes().into());
        self
    }

    /// Requires checks to carry `authorization: Bearer <token>`.
    pub fn with_auth_token(mut self, token: Option<String>) -> Self {
        self.authorization = token.map(|t| format!("Bearer {t}").into_bytes().into());
        self
    }
}

/// The shared secret from the file's bytes: one line of 16 to 256 visible
/// ASCII characters (surrounding white space ignored).
pub fn auth_token(bytes: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "the token is not text".to_string())?;
    let token = text.trim();
    if !(16..=256).contains(&token.len()) || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the token must be 16 to 256 visible ASCII characters".into());
    }
    Ok(token.to_string())
}

/// Whether `presented` equals `expected`, in time that does not depend on
/// where they differ.
pub(crate) fn same_secret(presented: &[u8], expected: &[u8]) -> bool {
    presented.len() == expected.len()
        && presented
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Lets one log line through per second: an outage must not flood the log
/// with one line per request.
#[derive(Default)]
pub struct LogEvery {
    last_s: std::sync::atomic::AtomicU64,
    suppressed: std::sync::atomic::AtomicU64,
}

impl LogEvery {
    /// `Some(n)` when a line may be written now, `n` lines having been held back.
    pub fn allow(&self) -> Option<u64> {
        use std::sync::atomic::Ordering;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.last_s.load(Ordering::Relaxed);
        if now > last
            && self
                .last_s
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    Router::new()
        .route(CHECK_PATH, post(check))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .merge(crate::admin::routes())
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(ErrorBody {
            error: message.into(),
        }),
    )
        .into_response()
}

async fn check(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    // The body is read in full before anything is answered: Envoy only
    // reuses the upstream connection of a call whose request was consumed.
    if let Some(expected) = &state.authorization {
        let presented = headers
            .get(header::AUTHORIZATION)
            .map_or(&b""[..], |v| v.as_bytes());
        if !same_secret(presented, expected) {
            state.metrics.unauthorized();
            state.metrics.response(401);
            return error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong authorization: checks must carry the shared token",
            );
        }
    }
    let budget = caller_budget(&headers, state.limits.request_timeout);
    let response = match tokio::time::timeout(budget, guarded(&state, &body)).await {
        Ok(response) => response,
        Err(_) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not decided within {budget:?}"),
        ),
    };
    state.metrics.response(response.status().as_u16());
    response
}

/// How long this call may take: the caller's own timeout when it sent one
/// ([`TIMEOUT_HEADER`]), never more than `request_timeout`. Work the
/// caller will not wait for is not started: it would be charged in Redis
/// while the caller decides (and charges) the request locally. A script
/// that already reached Redis when the budget ends still runs to the end:
/// that much is the window in which one request can be counted twice.
fn caller_budget(headers: &HeaderMap, request_timeout: Duration) -> Duration {
    headers
        .get(TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        // A little before the caller gives up: an answer (even "not
        // decided") keeps the connection, a timeout makes Envoy reset it.
        .map_or(request_timeout, |ms| {
            (Duration::from_millis(ms) * 9 / 10).min(request_timeout)
        })
}

/// Decides with a permit: at most `max_in_flight` at once, and a caller
/// waits at most `queue_timeout` for one (then 503: the filter falls back,
/// which beats queueing behind a backlog it would time out on anyway).
async fn guarded(state: &AppState, body: &[u8]) -> Response {
    match permit(state).await {
        Some(_permit) => decide(state, body).await,
        None => error(StatusCode::SERVICE_UNAVAILABLE, OVERLOADED),
    }
}

/// Why a call got no permit.
pub(crate) const OVERLOADED: &str = "overloaded: too many checks in flight";

/// A permit to decide (of `max_in_flight`), waited for at most
/// `queue_timeout`; `None`, counted as overloaded, when none came. The
/// HTTP API and the rate limit service share them.
pub(crate) async fn permit(state: &AppState) -> Option<tokio::sync::OwnedSemaphorePermit> {
    let permit = tokio::time::timeout(
        state.limits.queue_timeout,
        state.in_flight.clone().acquire_owned(),
    )
    .await;
    match permit {
        Ok(Ok(permit)) => Some(permit),
        _ => {
            state.metrics.overloaded();
            None
        }
    }
}

async fn decide(state: &AppState, body: &[u8]) -> Response {
    let request: CheckRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("malformed check request: {e}"),
            )
        }
    };
    if let Err(reason) = validate_batch(&request) {
        return error(StatusCode::BAD_REQUEST, reason);
    }
    if request.settlements.is_empty() {
        return match decide_checks(state, &request.checks).await {
            Answer::Decided(results) => Json(CheckResponse {
                results,
                settled: Vec::new(),
            })
            .into_response(),
            Answer::Refused(reason) => error(StatusCode::BAD_REQUEST, reason),
            Answer::Unavailable(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
        };
    }
    // With settlements, the call is answered whatever became of its
    // checks: a settlement applied must be reported, so checks that could
    // not be decided get their own errors instead of failing the call.
    let (checks, settled) = tokio::join!(
        async {
            if request.checks.is_empty() {
                return Answer::Decided(Vec::new());
            }
            decide_checks(state, &request.checks).await
        },
        settle_all(state, &request.settlements)
    );
    let failed = |error: String, kind: FailureKind| {
        request
            .checks
            .iter()
            .map(|_| {
                CheckOutcome::Failed(CheckFailure {
                    error: error.clone(),
                    kind,
                })
            })
            .collect()
    };
    let results = match checks {
        Answer::Decided(results) => results,
        Answer::Refused(reason) => failed(reason, FailureKind::Invalid),
        Answer::Unavailable(e) => failed(e, FailureKind::Unavailable),
    };
    Json(CheckResponse { results, settled }).into_response()
}

/// What became of a call's checks.
enum Answer {
    Decided(Vec<CheckOutcome>),
    /// No check was valid: the caller's mistake (400).
    Refused(String),
    /// Redis could decide none of them (503: the caller falls back).
    Unavailable(String),
}

/// Applies each settlement on its own (an invalid one, or one whose Redis
/// node fails, gets its own error).
async fn settle_all(state: &AppState, settlements: &[Settlement]) -> Vec<SettleOutcome> {
    futures_util::future::join_all(settlements.iter().enumerate().map(|(i, s)| async move {
        if let Err(reason) = validate_settlement(i, s) {
            state.metrics.check_failure("invalid");
            return SettleOutcome::Failed(CheckFailure {
                error: reason,
                kind: FailureKind::Invalid,
            });
        }
        match state.limiter.settle(s).await {
            Ok(remaining) => SettleOutcome::Settled { remaining },
            Err(e) => {
                state.metrics.check_failure("unavailable");
                SettleOutcome::Failed(CheckFailure {
                    error: e.to_string(),
                    kind: FailureKind::Unavailable,
                })
            }
        }
    }))
    .await
}

async fn decide_checks(state: &AppState, checks: &[Check]) -> Answer {
    // One check's bad input must not cost the others their decision: an
    // invalid check gets its own error in the answer. Only a call with no
    // valid check at all is the caller's mistake as a whole.
    let checked: Vec<Result<&Check, String>> = checks
        .iter()
        .enumerate()
        .map(|(i, check)| validate_check(i, check).map(|()| check))
        .collect();
    // Usually every check is valid: decide them as they came, uncopied.
    let some_invalid: Vec<Check>;
    let valid: &[Check] = if checked.iter().all(Result::is_ok) {
        checks
    } else {
        some_invalid = checked
            .iter()
            .filter_map(|c| c.as_ref().ok().map(|c| (*c).clone()))
            .collect();
        &some_invalid
    };
    if valid.is_empty() {
        let first = checked
            .into_iter()
            .find_map(Result::err)
            .unwrap_or_default();
        return Answer::Refused(first);
    }
    // Each check is decided on its own and atomically; a batch's checks
    // share script runs (one per Redis node), pipelined.
    let decided: Vec<Result<CheckResult, LimiterError>> = if let [one] = valid {
        vec![state.limiter.check(one).await]
    } else {
        state.limiter.prepare_batch().await;
        state.limiter.check_batch(valid).await
    };
    if decided.iter().all(Result::is_err) {
        // Redis cannot decide anything now: the caller falls back (and its
        // breaker learns that meshlimitd is of no use for the moment).
        let e = decided
            .into_iter()
            .find_map(Result::err)
            .map_or_else(|| "not decided".to_string(), |e| e.to_string());
        if let Some(suppressed) = state.error_log.allow() {
            warn!(error = %e, suppressed, "cannot decide: answering 503 so the caller falls back");
        }
        return Answer::Unavailable(e);
    }
    let mut decided = decided.into_iter();
    let mut results = Vec::with_capacity(checked.len());
    for check in checked {
        let outcome = match check {
            Err(reason) => {
                state.metrics.check_failure("invalid");
                if let Some(suppressed) = state.error_log.allow() {
                    warn!(%reason, suppressed, "refused one check of a batch; the others are decided");
                }
                CheckOutcome::Failed(CheckFailure {
                    error: reason,
                    kind: FailureKind::Invalid,
                })
            }
            Ok(_) => match decided.next() {
                Some(Ok(result)) => {
                    state.metrics.decision(result.allowed);
                    CheckOutcome::Decided(result)
                }
                Some(Err(e)) => {
                    // Its Redis node failed; the others were decided.
                    state.metrics.check_failure("unavailable");
                    if let Some(suppressed) = state.error_log.allow() {
                        warn!(error = %e, suppressed, "cannot decide some checks of a batch: answering an error for them alone");
                    }
                    CheckOutcome::Failed(CheckFailure {
                        error: e.to_string(),
                        kind: FailureKind::Unavailable,
                    })
                }
                None => CheckOutcome::Failed(CheckFailure {
                    error: "not decided".into(),
                    kind: FailureKind::Unavailable,
                }),
            },
        };
        results.push(outcome);
    }
    debug!(checks = results.len(), "decided");
    Answer::Decided(results)
}

/// Checks what serde cannot, for a whole call and each of its checks: the
/// first problem, or none.
pub fn validate(request: &CheckRequest) -> Result<(), String> {
    validate_batch(request)?;
    for (i, check) in request.checks.iter().enumerate() {
        validate_check(i, check)?;
    }
    Ok(())
}

/// The bounds of a call as a whole.
fn validate_batch(request: &CheckRequest) -> Result<(), String> {
    if request.checks.is_empty() && request.settlements.is_empty() {
        return Err("checks: must contain at least one check (or settlement)".into());
    }
    if request.checks.len() > MAX_CHECKS {
        return Err(format!("checks: at most {MAX_CHECKS} per call"));
    }
    if request.settlements.len() > MAX_CHECKS {
        return Err(format!("settlements: at most {MAX_CHECKS} per call"));
    }
    Ok(())
}

/// What makes one settlement applicable; `i` is its place in the call.
fn validate_settlement(i: usize, s: &Settlement) -> Result<(), String> {
    let at = format!("settlements[{i}]");
    validate_limits(&at, &s.subject, &s.limits, 1)?;
    if s.actual.len() != s.limits.len() || s.receipts.len() != s.limits.len() {
        return Err(format!(
            "{at}: one `actual` and one `receipts` entry per limit"
        ));
    }
    for (j, (limit, actual)) in s.limits.iter().zip(&s.actual).enumerate() {
        let most = if limit.algorithm == meshlimit_protocol::Algorithm::SlidingWindowLog {
            bounds::MAX_SLIDING_LOG_REQUESTS
        } else {
            bounds::MAX_COST
        };
        if *actual > most {
            return Err(format!("{at}.actual[{j}]: at most {most}"));
        }
    }
    for (j, r) in s.receipts.iter().enumerate() {
        if r.nonce.is_empty() || r.nonce.len() > 64 || r.place == 0 {
            return Err(format!("{at}.receipts[{j}]: not a receipt meshlimitd gave"));
        }
    }
    Ok(())
}

/// What makes one check decidable; `i` is its place in the call.
fn validate_check(i: usize, check: &Check) -> Result<(), String> {
    // A check that only renews a lease (the filter asks before a lease
    // runs out, for no request) costs 0.
    let min_cost = if check.lease.is_some_and(|l| l.units > 0) {
        0
    } else {
        1
    };
    validate_limits(
        &format!("checks[{i}]"),
        &check.subject,
        &check.limits,
        min_cost,
    )?;
    if let Some(ask) = check.lease {
        if ask.units > bounds::MAX_LEASE_UNITS {
            return Err(format!(
                "checks[{i}].lease.units: at most {}",
                bounds::MAX_LEASE_UNITS
            ));
        }
        if ask.share == 0 || ask.share > bounds::MAX_LEASE_SHARE {
            return Err(format!(
                "checks[{i}].lease.share: must be between 1 and {}",
                bounds::MAX_LEASE_SHARE
            ));
        }
    }
    Ok(())
}

/// A subject and its limits, of the check or settlement at `at`; costs of
/// at least `min_cost`.
fn validate_limits(at: &str, subject: &str, limits: &[Limit], min_cost: u64) -> Result<(), String> {
    if subject.is_empty() {
        return Err(format!("{at}.subject: must not be empty"));
    }
    if subject.len() > MAX_SUBJECT_BYTES {
        return Err(format!("{at}.subject: at most {MAX_SUBJECT_BYTES} bytes"));
    }
    if limits.is_empty() || limits.len() > MAX_LIMITS_PER_CHECK {
        return Err(format!(
            "{at}.limits: must hold 1 to {MAX_LIMITS_PER_CHECK} limits"
        ));
    }
    let outer = at;
    for (j, limit) in limits.iter().enumerate() {
        let at = format!("{outer}.limits[{j}]");
        if !bounds::is_limit_name(&limit.name) {
            return Err(format!(
                "{at}.name: 1 to {} of letters, digits, '-', '_', '.', '/'",
                bounds::MAX_LIMIT_NAME_LEN
            ));
        }
        if let Err(e) = bounds::check_limit(
            limit.requests,
            limit.window_ms,
            limit.algorithm,
            limit.burst,
        ) {
            let field = match e.field {
                LimitField::Requests => "requests",
                LimitField::Window => "window_ms",
                LimitField::Burst => "burst",
            };
            return Err(format!("{at}.{field}: {}", e.problem));
        }
        if let Some(subject) = &limit.subject {
            if subject.is_empty() || subject.len() > MAX_SUBJECT_BYTES {
                return Err(format!("{at}.subject: 1 to {MAX_SUBJECT_BYTES} bytes"));
            }
        }
        if let Some(calendar) = &limit.calendar {
            if limit.algorithm != meshlimit_protocol::Algorithm::FixedWindow {
                return Err(format!("{at}.calendar: only a fixed_window has one"));
            }
            calendar
                .check()
                .map_err(|e| format!("{at}.calendar: {e}"))?;
        }
        if limit.cost < min_cost || limit.cost > bounds::MAX_COST {
            return Err(format!(
                "{at}.cost: must be between {min_cost} and {}",
                bounds::MAX_COST
            ));
        }
    }
    Ok(())
}

async fn ready(State(state): State<AppState>) -> Response {
    match state.limiter.ping().await {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, format!("redis: {e}")),
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshlimit_protocol::{Algorithm, Limit};

    fn request(algorithm: Algorithm, subject: &str, requests: u64) -> CheckRequest {
        CheckRequest {
            checks: vec![Check {
                subject: subject.into(),
                limits: vec![Limit {
                    name: "api/m".into(),
                    requests,
                    window_ms: 1000,
                    algorithm,
                    cost: 1,
                    burst: None,
                    shadow: false,
                    subject: None,
                    calendar: None,
                }],
                receipt: false,
                lease: None,
            }],
            settlements: Vec::new(),
        }
    }

    #[test]
    fn valid_requests_pass() {
        assert!(validate(&request(Algorithm::FixedWindow, "s", 1)).is_ok());
    }

    #[test]
    fn bad_values_are_named() {
        let e = validate(&request(Algorithm::FixedWindow, "s", 0)).unwrap_err();
        assert_eq!(e, "checks[0].limits[0].requests: must be at least 1");
        let e = validate(&request(Algorithm::FixedWindow, "", 1)).unwrap_err();
        assert!(e.starts_with("checks[0].subject"));
        let mut burst = request(Algorithm::FixedWindow, "s", 1);
        burst.checks[0].limits[0].burst = Some(3);
        let e = validate(&burst).unwrap_err();
        assert!(e.contains("only token_bucket has a burst"), "{e}");
        assert!(validate(&request(Algorithm::TokenBucket, "s", 1)).is_ok());
        assert!(validate(&CheckRequest {
            checks: vec![],
            settlements: Vec::new(),
        })
        .is_err());
    }
}
