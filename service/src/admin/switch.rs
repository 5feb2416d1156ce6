//! The fleet-wide enforcement switch (see [`crate::fleet`]): read and set.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshlimit_protocol::Enforcement;
use tracing::{info, warn};

use super::*;

/// Body of a `PUT`, and what a `GET` shows.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SwitchView {
    pub enforcement: Enforcement,
    /// With `shadow`: it ends by itself after this long (absent: until
    /// switched back). Only in a `PUT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// Unix milliseconds; absent: until switched back. Only in answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
}

pub(super) async fn get_switch(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    authorize(&state, &headers)?;
    let stored = state.limiter.read_switch().await?;
    Ok(Json(SwitchView {
        enforcement: stored.enforcement,
        ttl_seconds: None,
        expires_at_ms: stored.expires_at_ms,
    })
    .into_response())
}

pub(super) async fn put_switch(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Refusal> {
    let by = authorize(&state, &headers)?;
    let put: SwitchView = serde_json::from_slice(&body).map_err(|e| {
        refuse(
            StatusCode::BAD_REQUEST,
            format!("malformed switch: {e} (expected {{\"enforcement\": \"shadow\" or \"enforce\", \"ttl_seconds\": optional}})"),
        )
    })?;
    if put.expires_at_ms.is_some() {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            "expires_at_ms is answered, not set: use ttl_seconds",
        ));
    }
    let expires_at_ms = match put.enforcement {
        Enforcement::Shadow => expiry(put.ttl_seconds)?,
        Enforcement::Enforce if put.ttl_seconds.is_none() => None,
        Enforcement::Enforce => {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "ttl_seconds: only with shadow (enforce lasts)",
            ))
        }
        Enforcement::Unknown => {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "enforcement: \"shadow\" or \"enforce\"",
            ))
        }
    };
    state
        .limiter
        .write_switch(put.enforcement, expires_at_ms)
        .await?;
    // This instance at once; the others within `fleet::REFRESH`.
    state.fleet.set(put.enforcement, &state.metrics);
    if put.enforcement == Enforcement::Shadow {
        warn!(expires_at_ms = ?expires_at_ms, by = %by, "enforcement switched to shadow fleet-wide: nothing is refused until it is switched back");
    } else {
        info!(by = %by, "enforcement switched back on fleet-wide");
    }
    Ok(Json(SwitchView {
        enforcement: put.enforcement,
        ttl_seconds: None,
        expires_at_ms,
    })
    .into_response())
}
