//! meshlimitd on one Redis, as the flow's tests need it: fixed-window
//! counters per subject, limit and window, charged for every check whether
//! or not its answer is delivered (a lost answer's scripts ran).
//!
//! - A check is admitted when its cost fits every limit; it is charged its
//!   cost and the lease it is granted (decide.lua's rule: what fits after
//!   the request, divided by `share`, none under [`MIN_LEASE_SHARE`],
//!   never more than asked).
//! - A settlement charges or gives back the difference between what it
//!   reserved and what was used; one with an id is applied once.
//! - A lease ask or reservation with an id is recorded; named in a later
//!   call's `lost`, what it was granted goes back, once.
//!
//! Beside the counters it keeps what a client was charged and given back
//! in all (the lease or reservation's units, counted once per check, not
//! per limit), for tests that hold the filter to them.

use std::collections::{HashMap, HashSet};

use meshlimit_protocol::{
    Check, CheckOutcome, CheckRequest, CheckResponse, CheckResult, LimitStatus, Receipt,
    SettleOutcome,
};

/// decide.lua's MIN_LEASE_SHARE.
const MIN_LEASE_SHARE: u64 = 8;

/// A grant's units, and the limits and windows they were charged in.
type Grant = (u64, Vec<(String, u64)>);

#[derive(Default)]
pub(super) struct FakeMeshlimitd {
    /// Units charged, by subject, limit name and window.
    used: HashMap<(String, String, u64), u64>,
    /// Units charged per subject in all (costs and leases).
    pub(super) charged: HashMap<String, u64>,
    /// Units given back per subject (returns, settlements below their
    /// reservation, grants of asks lost).
    pub(super) returned: HashMap<String, u64>,
    /// What each lease ask or reservation with an id was granted, by
    /// subject and id, until it goes back: its units, and the limits and
    /// windows they were charged in.
    grants: HashMap<(String, u64), Grant>,
    /// Settlements applied, by subject and id.
    settled: HashSet<(String, u64)>,
    nonce: u64,
}

impl FakeMeshlimitd {
    /// Decides a call's body at `now` (ms) and charges it; the answer's
    /// body.
    pub(super) fn answer(&mut self, body: &[u8], now: u64) -> String {
        let request: CheckRequest = serde_json::from_slice(body).unwrap();
        let results = request
            .checks
            .iter()
            .map(|check| CheckOutcome::Decided(self.decide(check, now)))
            .collect();
        let settled = request
            .settlements
            .iter()
            .map(|s| {
                let first_time = s.id == 0 || self.settled.insert((s.subject.clone(), s.id));
                let remaining = s
                    .limits
                    .iter()
                    .zip(&s.actual)
                    .enumerate()
                    .map(|(i, (limit, actual))| {
                        let window = now / limit.window_ms.max(1);
                        if first_time {
                            let delta = i64::try_from(*actual).unwrap_or(i64::MAX)
                                - i64::try_from(limit.cost).unwrap_or(i64::MAX);
                            self.add(&s.subject, &limit.name, window, delta);
                            if i == 0 && delta < 0 {
                                *self.returned.entry(s.subject.clone()).or_default() +=
                                    delta.unsigned_abs();
                            }
                        }
                        limit
                            .requests
                            .saturating_sub(self.used_by(&s.subject, &limit.name, window))
                    })
                    .collect();
                SettleOutcome::Settled { remaining }
            })
            .collect();
        // What the scripts of asks whose answers were lost granted goes
        // back, once, in the window it was charged in.
        for lost in &request.lost {
            if let Some((units, charged)) = self.grants.remove(&(lost.subject.clone(), lost.id)) {
                for (limit, window) in charged {
                    self.add(
                        &lost.subject,
                        &limit,
                        window,
                        -i64::try_from(units).unwrap(),
                    );
                }
                *self.returned.entry(lost.subject.clone()).or_default() += units;
            }
        }
        serde_json::to_string(&CheckResponse {
            results,
            settled,
            enforcement: None,
        })
        .unwrap()
    }

    fn decide(&mut self, check: &Check, now: u64) -> CheckResult {
        let windows: Vec<u64> = check
            .limits
            .iter()
            .map(|l| now / l.window_ms.max(1))
            .collect();
        let used: Vec<u64> = check
            .limits
            .iter()
            .zip(&windows)
            .map(|(l, w)| self.used_by(&check.subject, &l.name, *w))
            .collect();
        let allowed = check
            .limits
            .iter()
            .zip(&used)
            .all(|(l, u)| u + l.cost <= l.requests);
        let leased = match check.lease {
            Some(ask) if allowed => check
                .limits
                .iter()
                .zip(&used)
                .map(|(l, u)| {
                    let share = (l.requests - u - l.cost) / ask.share.max(1);
                    if share < MIN_LEASE_SHARE {
                        0
                    } else {
                        share
                    }
                })
                .fold(ask.units, u64::min),
            _ => 0,
        };
        self.nonce += 1;
        let cost = check.limits.first().map_or(0, |l| l.cost);
        if allowed {
            *self.charged.entry(check.subject.clone()).or_default() += cost + leased;
            let charged_in: Vec<(String, u64)> = check
                .limits
                .iter()
                .zip(&windows)
                .map(|(l, w)| (l.name.clone(), *w))
                .collect();
            if let Some(ask) = check.lease.filter(|a| a.id != 0 && leased > 0) {
                self.grants.insert(
                    (check.subject.clone(), ask.id),
                    (leased, charged_in.clone()),
                );
            }
            if check.receipt && check.id != 0 {
                self.grants
                    .insert((check.subject.clone(), check.id), (cost, charged_in));
            }
        }
        let mut limits = Vec::new();
        for ((l, u), window) in check.limits.iter().zip(&used).zip(&windows) {
            let charged = if allowed { l.cost + leased } else { 0 };
            self.add(
                &check.subject,
                &l.name,
                *window,
                i64::try_from(charged).unwrap(),
            );
            let reset_after_ms = (window + 1) * l.window_ms - now;
            limits.push(LimitStatus {
                allowed: u + l.cost <= l.requests,
                limit: l.requests,
                remaining: l.requests.saturating_sub(u + charged),
                reset_after_ms,
                retry_after_ms: if allowed { 0 } else { reset_after_ms },
                shadow: false,
                reason: None,
            });
        }
        let receipts = (allowed && (check.receipt || leased > 0)).then(|| {
            (0..check.limits.len())
                .map(|place| Receipt {
                    clock_us: now * 1000,
                    nonce: format!("n.{}", self.nonce),
                    place: place as u32,
                    epoch: 0,
                    units: cost + leased,
                    mac: String::new(),
                })
                .collect()
        });
        CheckResult {
            allowed,
            limits,
            receipts,
            leased,
        }
    }

    /// Units charged on a subject's limit, in every window.
    pub(super) fn used(&self, subject: &str, limit: &str) -> u64 {
        self.used
            .iter()
            .filter(|((s, l, _), _)| s == subject && l == limit)
            .map(|(_, n)| n)
            .sum()
    }

    /// Units charged on a subject's limit in a window.
    fn used_by(&self, subject: &str, limit: &str, window: u64) -> u64 {
        self.used
            .get(&(subject.to_string(), limit.to_string(), window))
            .copied()
            .unwrap_or(0)
    }

    fn add(&mut self, subject: &str, limit: &str, window: u64, delta: i64) {
        let used = self
            .used
            .entry((subject.to_string(), limit.to_string(), window))
            .or_default();
        *used = used.saturating_add_signed(delta);
    }
}
