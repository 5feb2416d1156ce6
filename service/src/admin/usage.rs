//! A subject's usage of a limit: `GET /v1/usage/{rule}/{limit}?subject=`,
//! read with a check of cost 0 (it charges nothing) against the limit as
//! its checks last described it to this instance (`app::seen`). A query
//! may name the definition itself instead: `requests`, `window_ms`,
//! `algorithm`, `burst`.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshlimit_protocol::{Algorithm, Check, Limit};

use super::*;

/// What the answer shows.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct UsageView {
    pub limit: String,
    pub subject: String,
    /// The quota the subject is held to now (a live override's, if any).
    pub requests: u64,
    pub window_ms: u64,
    pub algorithm: Algorithm,
    pub used: u64,
    pub remaining: u64,
    pub reset_after_ms: u64,
    /// The live override in force, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub r#override: Option<OverrideView>,
}

pub(super) async fn get_usage(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((rule, limit)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, Refusal> {
    let (name, subject) = addressed(&state, &headers, &rule, &limit, &query)?;
    let limit = definition(&state, &name, &query)?;
    let check = Check {
        subject: subject.clone(),
        limits: vec![limit.clone()],
        receipt: false,
        lease: None,
        trace: None,
        id: 0,
    };
    // Validated as a request's check would be (cost 1); read at cost 0,
    // which only lease renewals may send.
    let mut as_request = check.clone();
    for l in &mut as_request.limits {
        l.cost = 1;
    }
    if let Err(reason) = crate::app::validate::validate_check(0, &as_request) {
        return Err(refuse(StatusCode::BAD_REQUEST, reason));
    }
    let result = state.limiter.check(&check).await?;
    let Some(status) = result.limits.first() else {
        return Err(refuse(StatusCode::SERVICE_UNAVAILABLE, "redis: no status"));
    };
    let live = state.limiter.get_override(&name, &subject).await?;
    Ok(Json(UsageView {
        limit: name.clone(),
        subject: subject.clone(),
        requests: status.limit,
        window_ms: limit.window_ms,
        algorithm: limit.algorithm,
        used: status.limit.saturating_sub(status.remaining),
        remaining: status.remaining,
        reset_after_ms: status.reset_after_ms,
        r#override: live.map(|o| OverrideView::new(name, subject, o)),
    })
    .into_response())
}

/// The limit `name` as the query describes it, else as last seen.
fn definition(
    state: &AppState,
    name: &str,
    query: &HashMap<String, String>,
) -> Result<Limit, Refusal> {
    let number = |key: &str| -> Result<Option<u64>, Refusal> {
        query
            .get(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| refuse(StatusCode::BAD_REQUEST, format!("{key}: a whole number")))
            })
            .transpose()
    };
    let mut limit = match state.seen.get(name) {
        Some(limit) => limit,
        None => {
            let (Some(requests), Some(window_ms)) = (number("requests")?, number("window_ms")?)
            else {
                return Err(refuse(
                    StatusCode::NOT_FOUND,
                    format!("{name}: this meshlimitd has decided no check of this limit yet; give requests and window_ms (and algorithm, burst) in the query"),
                ));
            };
            Limit {
                name: name.to_string(),
                requests,
                window_ms,
                algorithm: Algorithm::FixedWindow,
                cost: 0,
                burst: None,
                shadow: false,
                subject: None,
                calendar: None,
            }
        }
    };
    if let Some(requests) = number("requests")? {
        limit.requests = requests;
    }
    if let Some(window_ms) = number("window_ms")? {
        limit.window_ms = window_ms;
    }
    if let Some(burst) = number("burst")? {
        limit.burst = Some(burst);
    }
    if let Some(algorithm) = query.get("algorithm") {
        limit.algorithm = serde_json::from_value(serde_json::Value::String(algorithm.clone()))
            .map_err(|_| {
                refuse(
                    StatusCode::BAD_REQUEST,
                    "algorithm: fixed_window, sliding_window_log, sliding_window_counter or token_bucket",
                )
            })?;
    }
    Ok(limit)
}
