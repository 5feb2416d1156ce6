//! HTTP API: `POST /v1/check`, `GET /healthz`, `GET /readyz`, `GET /metrics`.
//!
//! Status codes are a contract with the filter: 200 is a decision, 400 and
//! 413 are the caller's mistake (with a reason), 503 means "Redis cannot
//! decide now, fall back". Nothing else is 5xx.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use meshlimit_protocol::bounds::{self, LimitField};
use meshlimit_protocol::{CheckRequest, CheckResponse, ErrorBody, CHECK_PATH};
use tracing::{debug, warn};

use crate::limiter::Limiter;
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
        }
    }
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
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(ErrorBody {
            error: message.into(),
        }),
    )
        .into_response()
}

async fn check(State(state): State<AppState>, body: Bytes) -> Response {
    // The body is read in full before anything is answered: Envoy only
    // reuses the upstream connection of a call whose request was consumed.
    let limits = state.limits;
    let response = match tokio::time::timeout(limits.request_timeout, guarded(&state, &body)).await
    {
        Ok(response) => response,
        Err(_) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not decided within {:?}", limits.request_timeout),
        ),
    };
    state.metrics.response(response.status().as_u16());
    response
}

/// Decides with a permit: at most `max_in_flight` at once, and a caller
/// waits at most `queue_timeout` for one (then 503: the filter falls back,
/// which beats queueing behind a backlog it would time out on anyway).
async fn guarded(state: &AppState, body: &[u8]) -> Response {
    let permit = tokio::time::timeout(
        state.limits.queue_timeout,
        state.in_flight.clone().acquire_owned(),
    )
    .await;
    match permit {
        Ok(Ok(_permit)) => decide(state, body).await,
        _ => {
            state.metrics.overloaded();
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded: too many checks in flight",
            )
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
    if let Err(reason) = validate(&request) {
        return error(StatusCode::BAD_REQUEST, reason);
    }
    // Each check is decided on its own and atomically; a batch's checks
    // share script runs (one per Redis node), pipelined.
    let decided = if let [one] = request.checks.as_slice() {
        state.limiter.check(one).await.map(|r| vec![r])
    } else {
        state.limiter.prepare_batch().await;
        state.limiter.check_batch(&request.checks).await
    };
    let results = match decided {
        Ok(results) => results,
        Err(e) => {
            if let Some(suppressed) = state.error_log.allow() {
                warn!(error = %e, suppressed, "cannot decide: answering 503 so the caller falls back");
            }
            return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
        }
    };
    for result in &results {
        state.metrics.decision(result.allowed);
    }
    debug!(checks = results.len(), "decided");
    Json(CheckResponse { results }).into_response()
}

/// Checks what serde cannot: bounds and values.
pub fn validate(request: &CheckRequest) -> Result<(), String> {
    if request.checks.is_empty() {
        return Err("checks: must contain at least one check".into());
    }
    if request.checks.len() > MAX_CHECKS {
        return Err(format!("checks: at most {MAX_CHECKS} per call"));
    }
    for (i, check) in request.checks.iter().enumerate() {
        if check.subject.is_empty() {
            return Err(format!("checks[{i}].subject: must not be empty"));
        }
        if check.subject.len() > MAX_SUBJECT_BYTES {
            return Err(format!(
                "checks[{i}].subject: at most {MAX_SUBJECT_BYTES} bytes"
            ));
        }
        if check.limits.is_empty() || check.limits.len() > MAX_LIMITS_PER_CHECK {
            return Err(format!(
                "checks[{i}].limits: must hold 1 to {MAX_LIMITS_PER_CHECK} limits"
            ));
        }
        for (j, limit) in check.limits.iter().enumerate() {
            let at = format!("checks[{i}].limits[{j}]");
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
            if limit.cost == 0 {
                return Err(format!("{at}.cost: must be at least 1"));
            }
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
    use meshlimit_protocol::{Algorithm, Check, Limit};

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
                }],
            }],
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
        assert!(validate(&CheckRequest { checks: vec![] }).is_err());
    }
}
