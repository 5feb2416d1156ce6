//! The last phase: a decided result turned into what the client sees (a
//! [`Verdict`]), and the deny cache read and fed from results.

use meshlimit_protocol::CheckResult;

use crate::check::{Applied, Check};
use crate::config::Config;
use crate::headers::{self, Headers};
use crate::reply::DenyResponse;
use crate::shared::deny_cache::DenyCache;
use crate::shared::SharedStore;

/// What the client sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Forward the request; add these headers to the upstream's response.
    Allow {
        headers: Headers,
    },
    Deny(DenyResponse),
}

/// What the client sees for a decided check.
pub fn verdict(cfg: &Config, limits: &[Applied], result: &CheckResult) -> Verdict {
    let mut hdrs = headers::rate_limit_headers(cfg.response.headers, limits, result);
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
/// exhausted for `subject`. Only cost-1 limits are cached (a retry time
/// computed for a heavier request would over-deny a lighter one), and
/// token budgets found at 0 (no reservation fits), whatever the request
/// would reserve: a spent budget is refused before its body is read.
pub fn cached_deny<'c, S: SharedStore>(
    cfg: &Config,
    check: &'c Check,
    cache: &DenyCache<'_, S>,
    now_ms: u64,
) -> Option<(Verdict, &'c Applied)> {
    let mut candidates = check
        .global
        .iter()
        .filter(|a| !a.shadow && (a.cost == 1 || a.tokens));
    // Several limits: one read says whether any deny is recent enough to
    // be trusted, instead of one read per limit on every request.
    if candidates.clone().nth(1).is_some() && cache.quiet(now_ms) {
        return None;
    }
    candidates.find_map(|a| {
        let deny = cache.denied_until(&a.subject, &a.limit, now_ms)?;
        let wait = deny.until - now_ms;
        let result = CheckResult {
            allowed: false,
            limits: vec![meshlimit_protocol::LimitStatus {
                allowed: false,
                limit: deny.quota,
                remaining: 0,
                reset_after_ms: wait,
                retry_after_ms: wait,
                shadow: false,
                reason: None,
            }],
            receipts: None,
            leased: 0,
        };
        Some((verdict(cfg, std::slice::from_ref(a), &result), a))
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
        // A shadow status is no deny: its limit is shadow, or the whole
        // fleet is (the enforcement switch).
        if !a.shadow
            && !status.shadow
            && (a.cost == 1 || a.tokens)
            && !status.allowed
            && status.remaining == 0
            && status.reason.is_none()
            && status.retry_after_ms > 0
        {
            evicted += usize::from(cache.remember(
                &a.subject,
                &a.limit,
                (now_ms + status.retry_after_ms, status.limit),
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
        grpc_status: cfg.response.grpc_status,
    }
}
