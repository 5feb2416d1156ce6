//! Live overrides of a limit for one subject: stored in Redis beside the
//! subject's counters (same hash slot) and read by the script that decides
//! each check, so one applies at once on every replica, atomically with
//! the decision. Each is also named in an index, so that they can be
//! listed without a scan of the keyspace.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use tracing::info;

use super::*;

pub(super) async fn get_override(
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

pub(super) async fn put_override(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((rule, limit)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, Refusal> {
    let by = authorize(&state, &headers)?;
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
    let expires_at_ms = expiry(put.ttl_seconds)?;
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
    state.limiter.index_override(&name, &subject, true).await?;
    info!(limit = %name, subject = %subject, requests = o.requests, expires_at_ms = ?o.expires_at_ms, by = %by, "override set");
    Ok(Json(OverrideView::new(name, subject, o)).into_response())
}

pub(super) async fn delete_override(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((rule, limit)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, Refusal> {
    let by = authorize(&state, &headers)?;
    let (name, subject) = addressed(&state, &headers, &rule, &limit, &query)?;
    state.limiter.index_override(&name, &subject, false).await?;
    if !state.limiter.delete_override(&name, &subject).await? {
        return Err(refuse(
            StatusCode::NOT_FOUND,
            "no override for this subject",
        ));
    }
    info!(limit = %name, subject = %subject, by = %by, "override deleted");
    Ok((StatusCode::NO_CONTENT, "").into_response())
}

/// Every live override, as the index names them (an override that ended
/// by itself leaves the index as it is found gone).
pub(super) async fn list_overrides(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    authorize(&state, &headers)?;
    let mut live = Vec::new();
    for (name, subject) in state.limiter.indexed_overrides().await? {
        match state.limiter.get_override(&name, &subject).await? {
            Some(o) => live.push(OverrideView::new(name, subject, o)),
            None => state.limiter.index_override(&name, &subject, false).await?,
        }
    }
    live.sort_by(|a, b| (&a.limit, &a.subject).cmp(&(&b.limit, &b.subject)));
    Ok(Json(live).into_response())
}
