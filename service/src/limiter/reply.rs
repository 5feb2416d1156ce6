//! A check run's arguments and reply: what a check asks of its run (a
//! lease, receipts), and the reply read back into a decision.

use meshlimit_protocol::{Check, CheckResult, Limit, LimitStatus};

use super::LimiterError;
use crate::script;

/// A check script's reply: the run's clock (its last value) and the rest.
pub(super) fn split_clock(values: &[i64]) -> Result<(i64, &[i64]), LimiterError> {
    values
        .split_last()
        .map(|(clock, rest)| (*clock, rest))
        .ok_or_else(|| LimiterError::Reply("empty reply".into()))
}

/// The keys that follow `check`'s counters in its run: its grant record
/// (`grant`), and epoch keys when its receipts may come back: it asks
/// for them (a reservation) or for a lease.
pub(super) fn follow(check: &Check, grant: bool) -> script::Follow {
    let epochs = if check.receipt {
        script::Epochs::Receipts
    } else if lease_args(check).0 > 0 {
        script::Epochs::IfLeased
    } else {
        script::Epochs::None
    };
    script::Follow { grant, epochs }
}

/// The epoch each limit's reply carries (0: none), in order.
pub(super) fn epochs(check: &Check, values: &[i64]) -> Vec<u64> {
    values
        .get(script::REPLY_HEAD..)
        .unwrap_or_default()
        .chunks_exact(script::REPLY_PER_LIMIT)
        .take(check.limits.len())
        .map(|v| {
            let [.., epoch] = per_limit(v);
            epoch.max(0) as u64
        })
        .collect()
}

/// Whether a result carries receipts: its check asked for them (a
/// reservation), or it was admitted (a lease's unused units are given
/// back by them, and so is everything an admitted check was charged when
/// its caller gave up on the answer). The API sends the caller only
/// those it asked for or needs (`app::receipts::for_the_caller`).
pub(super) fn wants_receipts(check: &Check, result: &CheckResult) -> bool {
    check.receipt || result.allowed
}

/// The lease a check asks for, as the scripts take it: units wanted and
/// their share; `(0, 1)` for none. (The API has checked the bounds.)
pub(super) fn lease_args(check: &Check) -> (u64, u64) {
    check.lease.map_or((0, 1), |ask| {
        (
            ask.units.min(meshlimit_protocol::bounds::MAX_LEASE_UNITS),
            ask.share
                .clamp(1, meshlimit_protocol::bounds::MAX_LEASE_SHARE),
        )
    })
}

/// Why `limit` can never admit a request of its cost, if it cannot;
/// `effective` is its number of requests after any live override.
fn impossible(limit: &Limit, effective: u64) -> Option<String> {
    let capacity = meshlimit_protocol::bounds::capacity(limit.algorithm, effective, limit.burst);
    (limit.cost > capacity).then(|| {
        format!(
            "cost {} exceeds the capacity {capacity} of limit {}",
            limit.cost, limit.name
        )
    })
}

/// One limit's reply values (`REPLY_PER_LIMIT` of them, in decide.lua's
/// order): fits, remaining, reset, retry, effective limit. The chunks
/// are that long; a shorter one would read as zeros, never out of bounds.
fn per_limit(v: &[i64]) -> [i64; script::REPLY_PER_LIMIT] {
    let mut out = [0; script::REPLY_PER_LIMIT];
    for (o, value) in out.iter_mut().zip(v) {
        *o = *value;
    }
    out
}

pub(super) fn parse_reply(check: &Check, values: &[i64]) -> Result<CheckResult, LimiterError> {
    let per = script::REPLY_PER_LIMIT;
    let expected = script::REPLY_HEAD + per * check.limits.len();
    if values.len() != expected {
        return Err(LimiterError::Reply(format!(
            "{} values, expected {expected}",
            values.len()
        )));
    }
    let allowed = values.first() == Some(&1);
    // Never more than was asked, whatever the reply says.
    let asked = check.lease.map_or(0, |ask| ask.units);
    let leased = values.get(1).map_or(0, |&v| v.max(0) as u64).min(asked);
    let limits = check
        .limits
        .iter()
        .zip(
            values
                .get(script::REPLY_HEAD..)
                .unwrap_or_default()
                .chunks_exact(per),
        )
        .map(|(limit, v)| {
            let [fits, remaining, reset, retry, effective, _epoch] = per_limit(v);
            let effective = effective.max(1) as u64;
            let reason = impossible(limit, effective);
            let ok = fits == 1 && reason.is_none();
            LimitStatus {
                allowed: ok,
                limit: effective,
                remaining: remaining.max(0) as u64,
                reset_after_ms: reset.max(0) as u64,
                // Waiting never helps a request that can never fit.
                retry_after_ms: if ok || reason.is_some() {
                    0
                } else {
                    retry.max(0) as u64
                },
                shadow: limit.shadow,
                reason,
            }
        })
        .collect();
    Ok(CheckResult {
        allowed,
        limits,
        receipts: None,
        leased: if allowed { leased } else { 0 },
    })
}
