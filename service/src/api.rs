//! The HTTP front: `POST /v1/check`, `GET /healthz`, `GET /readyz`,
//! `GET /metrics`, and the admin API of [`crate::admin`]. What a call
//! means is decided in [`crate::app`]; this maps it onto HTTP.
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
use meshlimit_protocol::{CheckRequest, ErrorBody, CHECK_PATH, TIMEOUT_HEADER};
use std::time::{Duration, Instant};
use tracing::debug;

use crate::app::decide::{decide_call, Decided};
use crate::app::give_back::{self, give_back, withhold_leases};
use crate::app::{permit, AppState, Caller, OVERLOADED};

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
    let presented = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    if let Err(denied) = state.authorize(Caller::Proxy, presented) {
        state.metrics.response(401);
        return error(StatusCode::UNAUTHORIZED, denied.to_string());
    }
    let budget = caller_budget(&headers, state.limits.request_timeout);
    let mut request: CheckRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            state.metrics.response(400);
            return error(
                StatusCode::BAD_REQUEST,
                format!("malformed check request: {e}"),
            );
        }
    };
    if state.traces.is_some() {
        // A caller that traces its call, not each check: its checks are
        // children of the call's context.
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        if let Some(context) = crate::traces::context_from_headers(get) {
            for check in request.checks.iter_mut().filter(|c| c.trace.is_none()) {
                check.trace = Some(context.clone());
            }
        }
    }
    let response = decide_within(&state, request, budget).await;
    state.metrics.response(response.status().as_u16());
    response
}

/// How long this call may take: the caller's own timeout when it sent one
/// ([`TIMEOUT_HEADER`]), never more than `request_timeout`. Work the
/// caller will not wait for is not started: it would be charged in Redis
/// while the caller decides (and charges) the request locally. A script
/// that already reached Redis when the budget ends still runs to the end;
/// what it leased or reserved is then given back (`give_back`), and a
/// plain check's cost is the window in which one request can be counted
/// twice.
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

/// Decides a call within `budget`, with a permit: at most
/// `max_in_flight` at once, and a caller waits at most `queue_timeout` for
/// one (then 503: the filter falls back, which beats queueing behind a
/// backlog it would time out on anyway). The decision runs on its own:
/// when the deadline passes first, the caller gets its 503 (it decides
/// without us) and the permit is free again, as if the work had stopped;
/// the scripts already sent end in Redis anyway, and what they leased or
/// reserved goes back then (`give_back`). Nothing is started once the
/// deadline has passed.
async fn decide_within(state: &AppState, request: CheckRequest, budget: Duration) -> Response {
    let deadline = Instant::now() + budget;
    let Ok(permit) = tokio::time::timeout(budget, permit(state)).await else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not decided within {budget:?}"),
        );
    };
    let Some(_permit) = permit else {
        return error(StatusCode::SERVICE_UNAVAILABLE, OVERLOADED);
    };
    let request = std::sync::Arc::new(request);
    let mut work = {
        let (state, request) = (state.clone(), std::sync::Arc::clone(&request));
        tokio::spawn(async move { decide_call(&state, &request).await })
    };
    let left = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(left, &mut work).await {
        Ok(Ok(mut decided)) => {
            let spent = budget.saturating_sub(deadline.saturating_duration_since(Instant::now()));
            if spent > budget / 2 {
                // Decided late: its leases are given back, not sent (see
                // `withhold_leases`).
                let returns = withhold_leases(&request, &mut decided);
                if !returns.is_empty() {
                    let state = state.clone();
                    tokio::spawn(async move {
                        let units = give_back::apply(&state, &returns).await;
                        state.metrics.late_leases_withheld(units);
                    });
                }
            }
            answer(&request, decided)
        }
        Ok(Err(_)) => error(StatusCode::SERVICE_UNAVAILABLE, "not decided"),
        Err(_) => {
            let state = state.clone();
            tokio::spawn(async move {
                if let Ok(decided) = work.await {
                    let units = give_back(&state, &request, &decided).await;
                    if units > 0 {
                        debug!(units, "gave back what a decision its caller gave up on had leased or reserved");
                    }
                }
            });
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not decided within {budget:?}"),
            )
        }
    }
}

/// A decided call as HTTP, with the receipts its caller asked for.
fn answer(request: &CheckRequest, decided: Decided) -> Response {
    match decided {
        Decided::Answered(mut response) => {
            crate::app::receipts::keep_the_callers(request, &mut response);
            Json(response).into_response()
        }
        Decided::Refused(reason) => error(StatusCode::BAD_REQUEST, reason),
        Decided::Unavailable(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
    }
}

async fn ready(State(state): State<AppState>) -> Response {
    match state.limiter.ping().await {
        Ok(()) => {
            // Ready all the same (the cluster answers), but at risk: say so.
            let requiring = state.limiter.full_coverage_required().await;
            if requiring.is_empty() {
                return (StatusCode::OK, "ready\n").into_response();
            }
            (
                StatusCode::OK,
                format!("ready\nwarning: {}\n", coverage_warning(&requiring)),
            )
                .into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, format!("redis: {e}")),
    }
}

/// What an operator should know of masters that require full coverage.
pub fn coverage_warning(requiring: &[String]) -> String {
    format!(
        "Redis Cluster masters {} run with cluster-require-full-coverage yes: while any master is down they refuse every command, and every check falls back; set it to no (docs/operators.md)",
        requiring.join(", ")
    )
}

async fn metrics(State(state): State<AppState>) -> Response {
    state.metrics.redis_healthy(state.limiter.redis_healthy());
    if let Some(memory) = state.limiter.redis_memory().await {
        state.metrics.redis_memory(&memory);
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}
