//! Admin API: live overrides of a limit for one subject.
//!
//! ```text
//! PUT    /v1/overrides/{rule}/{limit}   {"subject": "...", "requests": 40, "ttl_seconds": 3600}
//! GET    /v1/overrides/{rule}/{limit}?subject=...
//! DELETE /v1/overrides/{rule}/{limit}?subject=...
//! ```
//!
//! Off unless meshlimitd runs with `--admin-token-file`; every call must
//! then carry `authorization: Bearer <admin token>` (a secret of its own,
//! not the proxies' check token), or gets 401 and changes nothing. An
//! override is stored in Redis beside the subject's counters (same hash
//! slot) and read by the script that decides each check, so it applies at
//! once on every replica, atomically with the decision. The subject is
//! spelled as the filter sends it (`hdr:x-api-key:partner-a`, see
//! docs/policies.md). Every change is logged.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use meshlimit_protocol::bounds;
use serde::{Deserialize, Serialize};
use tracing::info;

use crate::api::error;
use crate::app::{AppState, Caller, Denied, MAX_SUBJECT_BYTES};
use crate::limiter::LimiterError;
use crate::limiter::Override;

/// Where the override routes live.
pub const OVERRIDES_PATH: &str = "/v1/overrides/{rule}/{limit}";
/// The largest override: far beyond any real plan, small enough that no
/// arithmetic in the script loses precision.
pub const MAX_OVERRIDE_REQUESTS: u64 = 1_000_000_000_000;
/// The longest an override may last before it must be set again (a year).
pub const MAX_TTL_SECONDS: u64 = 366 * 86_400;

pub fn routes() -> Router<AppState> {
    Router::new().route(
        OVERRIDES_PATH,
        get(get_override).put(put_override).delete(delete_override),
    )
}

/// Body of a `PUT`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutOverride {
    pub subject: String,
    pub requests: u64,
    /// The override ends by itself after this long; absent: until deleted.
    pub ttl_seconds: Option<u64>,
}

/// An override as the API shows it.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct OverrideView {
    pub limit: String,
    pub subject: String,
    pub requests: u64,
    /// Unix milliseconds; absent: until deleted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
}

impl OverrideView {
    fn new(limit: String, subject: String, o: Override) -> Self {
        OverrideView {
            limit,
            subject,
            requests: o.requests,
            expires_at_ms: o.expires_at_ms,
        }
    }
}

/// Why an admin call is refused: its status and what to fix.
#[derive(Debug)]
struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        error(self.0, self.1)
    }
}

fn refuse(status: StatusCode, why: impl Into<String>) -> Refusal {
    Refusal(status, why.into())
}

impl From<Denied> for Refusal {
    fn from(denied: Denied) -> Self {
        let status = match denied {
            Denied::AdminOff => StatusCode::NOT_FOUND,
            Denied::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        };
        refuse(status, denied.to_string())
    }
}

impl From<LimiterError> for Refusal {
    fn from(e: LimiterError) -> Self {
        refuse(StatusCode::SERVICE_UNAVAILABLE, format!("redis: {e}"))
    }
}

/// Refuses a call without the admin token (or when the API is off).
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), Refusal> {
    let presented = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    Ok(state.authorize(Caller::Admin, presented)?)
}

/// `rule/limit`, if both are valid names.
fn limit_name(rule: &str, limit: &str) -> Result<String, Refusal> {
    let name = format!("{rule}/{limit}");
    if rule.contains('/') || limit.contains('/') || !bounds::is_limit_name(&name) {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            "rule and limit: names of letters, digits, '-', '_', '.'",
        ));
    }
    Ok(name)
}

fn subject_of(subject: Option<&String>) -> Result<String, Refusal> {
    match subject {
        Some(s) if !s.is_empty() && s.len() <= MAX_SUBJECT_BYTES => Ok(s.clone()),
        _ => Err(refuse(
            StatusCode::BAD_REQUEST,
            format!("subject: 1 to {MAX_SUBJECT_BYTES} bytes, as the filter sends it"),
        )),
    }
}

/// The override a `GET` or `DELETE` addresses (`rule/limit`, and the
/// `subject` query parameter), once the caller is authorized.
fn addressed(
    state: &AppState,
    headers: &HeaderMap,
    rule: &str,
    limit: &str,
    query: &HashMap<String, String>,
) -> Result<(String, String), Refusal> {
    authorize(state, headers)?;
    Ok((limit_name(rule, limit)?, subject_of(query.get("subject"))?))
}

async fn get_override(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((rule, limit)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, Refusal> {
    let (name, subject) = addressed(&state, &headers, &rule, &limit, &query)?;
    match state.limiter.get_override(&name, &subject).await? {
        Some(o) => Ok(Json(OverrideView::new(name, subject, o)).into_response()),
        None => Err(refuse(
            StatusCode::NOT_FOUND,
            "no override for this subject",
        )),
    }
}

async fn put_override(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((rule, limit)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, Refusal> {
    authorize(&state, &headers)?;
    let name = limit_name(&rule, &limit)?;
    let put: PutOverride = serde_json::from_slice(&body)
        .map_err(|e| refuse(StatusCode::BAD_REQUEST, format!("malformed override: {e}")))?;
    let subject = subject_of(Some(&put.subject))?;
    if put.requests == 0 || put.requests > MAX_OVERRIDE_REQUESTS {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            format!("requests: from 1 to {MAX_OVERRIDE_REQUESTS}"),
        ));
    }
    let expires_at_ms = match put.ttl_seconds {
        None => None,
        Some(ttl) if (1..=MAX_TTL_SECONDS).contains(&ttl) => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            Some(now + ttl * 1000)
        }
        Some(_) => {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                format!("ttl_seconds: from 1 to {MAX_TTL_SECONDS}"),
            ))
        }
    };
    let stored = state
        .limiter
        .set_override(&name, &subject, put.requests, expires_at_ms)
        .await?;
    let Some(o) = stored else {
        return Err(refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "redis: the override was not stored",
        ));
    };
    info!(limit = %name, subject = %subject, requests = o.requests, expires_at_ms = ?o.expires_at_ms, "override set");
    Ok(Json(OverrideView::new(name, subject, o)).into_response())
}

async fn delete_override(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((rule, limit)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, Refusal> {
    let (name, subject) = addressed(&state, &headers, &rule, &limit, &query)?;
    if !state.limiter.delete_override(&name, &subject).await? {
        return Err(refuse(
            StatusCode::NOT_FOUND,
            "no override for this subject",
        ));
    }
    info!(limit = %name, subject = %subject, "override deleted");
    Ok((StatusCode::NO_CONTENT, "").into_response())
}
