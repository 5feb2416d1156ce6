//! Admin API: live overrides, the fleet-wide enforcement switch, and a
//! subject's usage, for operators in an incident.
//!
//! ```text
//! PUT    /v1/overrides/{rule}/{limit}   {"subject": "...", "requests": 40, "ttl_seconds": 3600}
//! GET    /v1/overrides/{rule}/{limit}?subject=...
//! DELETE /v1/overrides/{rule}/{limit}?subject=...
//! GET    /v1/overrides                  every live override
//! GET    /v1/enforcement                the switch
//! PUT    /v1/enforcement                {"enforcement": "shadow", "ttl_seconds": 3600}
//! GET    /v1/usage/{rule}/{limit}?subject=...
//! ```
//!
//! Off unless meshlimitd runs with `--admin-token-file`; every call must
//! then carry `authorization: Bearer <secret>` of one of its credentials
//! (secrets of their own, not the proxies' check token), or gets 401 and
//! changes nothing. Every change is logged with the id of the credential
//! that made it. The subject is spelled as the filter sends it
//! (`hdr:x-api-key:partner-a`, see docs/policies.md).

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use meshlimit_protocol::bounds;
use serde::{Deserialize, Serialize};

use crate::api::error;
use crate::app::{AppState, Denied, MAX_SUBJECT_BYTES};
use crate::limiter::LimiterError;
use crate::limiter::Override;

mod overrides;
mod switch;
mod usage;

/// Where the override routes live.
pub const OVERRIDES_PATH: &str = "/v1/overrides/{rule}/{limit}";
/// The largest override: far beyond any real plan, small enough that no
/// arithmetic in the script loses precision.
pub const MAX_OVERRIDE_REQUESTS: u64 = 1_000_000_000_000;
/// The longest an override may last before it must be set again (a year).
pub const MAX_TTL_SECONDS: u64 = 366 * 86_400;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route(
            OVERRIDES_PATH,
            get(overrides::get_override)
                .put(overrides::put_override)
                .delete(overrides::delete_override),
        )
        .route("/v1/overrides", get(overrides::list_overrides))
        .route(
            "/v1/enforcement",
            get(switch::get_switch).put(switch::put_switch),
        )
        .route(USAGE_PATH, get(usage::get_usage))
}

/// Where a subject's usage of a limit is read.
pub const USAGE_PATH: &str = "/v1/usage/{rule}/{limit}";

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

/// The id of the admin credential a call carries; refuses a call without
/// one (or when the API is off).
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<String, Refusal> {
    let presented = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    Ok(state.authorize_admin(presented)?.to_string())
}

/// Unix milliseconds, `ttl_seconds` from now (checked: 1 s to a year).
fn expiry(ttl_seconds: Option<u64>) -> Result<Option<u64>, Refusal> {
    match ttl_seconds {
        None => Ok(None),
        Some(ttl) if (1..=MAX_TTL_SECONDS).contains(&ttl) => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            Ok(Some(now + ttl * 1000))
        }
        Some(_) => Err(refuse(
            StatusCode::BAD_REQUEST,
            format!("ttl_seconds: from 1 to {MAX_TTL_SECONDS}"),
        )),
    }
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
