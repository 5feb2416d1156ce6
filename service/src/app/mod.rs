//! meshlimitd's application core, apart from its fronts (the HTTP API in
//! `api`, the admin API in `admin`, the gRPC rate limit service in `rls`):
//! the shared state, admission (a bounded number of decisions at once),
//! who may call ([`auth`]), what a call may hold ([`validate`]), and how a
//! call's checks and settlements are decided ([`decide`]). A new front
//! uses these; it decides nothing itself.

pub mod auth;
pub mod decide;
pub mod give_back;
pub mod receipts;
pub mod seen;
pub mod validate;

pub use auth::{admin_tokens, auth_token, AdminToken, Caller, Denied};
pub use validate::{validate, MAX_CHECKS, MAX_LIMITS_PER_CHECK, MAX_SUBJECT_BYTES};

use crate::limiter::Limiter;
use crate::metrics::Metrics;

/// What every front shares: the limiter, the metrics, the bounds on work
/// in progress, and the secrets callers must present.
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
    /// Signs receipts and verifies settlements' (derived from the token).
    pub receipt_key: Option<receipts::ReceiptKey>,
    /// The admin API's credentials; `None`: the API is off.
    pub admin_tokens: Option<std::sync::Arc<[AdminToken]>>,
    /// Spans for decisions, when `--otlp-endpoint` is set.
    pub traces: Option<crate::traces::Traces>,
    /// The fleet-wide enforcement switch (with the admin API on).
    pub fleet: crate::fleet::FleetSwitch,
    /// The limits decided, by name (for `GET /v1/usage`).
    pub seen: seen::LimitsSeen,
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
            receipt_key: None,
            admin_tokens: None,
            traces: None,
            fleet: crate::fleet::FleetSwitch::new(false),
            seen: seen::LimitsSeen::default(),
        }
    }

    /// Records a span for every check decided (see [`crate::traces`]).
    pub fn with_traces(mut self, traces: Option<crate::traces::Traces>) -> Self {
        self.traces = traces;
        self
    }

    /// Turns the admin API (live overrides) on, behind `token`; the
    /// limiter then reads overrides in every decision.
    pub fn with_admin_tokens(mut self, tokens: Option<Vec<AdminToken>>) -> Self {
        self.limiter = self.limiter.clone().with_overrides(tokens.is_some());
        self.fleet = crate::fleet::FleetSwitch::new(tokens.is_some());
        self.admin_tokens = tokens.map(Into::into);
        self
    }

    /// Requires checks to carry `authorization: Bearer <token>`, and
    /// signs receipts with a key derived from it (see [`receipts`]).
    pub fn with_auth_token(mut self, token: Option<String>) -> Self {
        self.receipt_key = token
            .as_deref()
            .and_then(|t| receipts::ReceiptKey::from_token(t).ok());
        self.authorization = token.map(|t| format!("Bearer {t}").into_bytes().into());
        self
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

/// Why a call got no permit.
pub const OVERLOADED: &str = "overloaded: too many checks in flight";

/// A permit to decide (of `max_in_flight`), waited for at most
/// `queue_timeout`; `None`, counted as overloaded, when none came. The
/// HTTP API and the rate limit service share them.
pub async fn permit(state: &AppState) -> Option<tokio::sync::OwnedSemaphorePermit> {
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
