//! The model meshlimitd the interleavings are answered by: exact
//! fixed-window counters, leases granted from them, returns and
//! settlements applied once by id, and what lost asks were granted given
//! back once named.

use std::collections::{HashMap, HashSet};

use meshlimit_protocol::{
    CheckOutcome, CheckRequest, CheckResponse, CheckResult, LimitStatus, Receipt, SettleOutcome,
};

use super::WINDOW_MS;

/// meshlimitd with exact fixed-window counters, one per subject.
#[derive(Default)]
pub(super) struct Model {
    /// Units charged per subject in the current window.
    used: HashMap<String, u64>,
    window: u64,
    /// Units charged per subject over the whole run (costs and leases).
    pub(super) charged: HashMap<String, u64>,
    /// Units given back per subject (lease returns, settlements below
    /// their reservation, grants of answers lost).
    pub(super) returned: HashMap<String, u64>,
    /// What each lease ask or reservation with an id was granted, by
    /// subject and id, while not given back (meshlimitd's records).
    grants: HashMap<(String, u64), u64>,
    /// Settlements applied, by subject and id: an id is applied once.
    settled_ids: HashSet<(String, u64)>,
}

impl Model {
    fn give_back(&mut self, subject: &str, units: u64) {
        *self.returned.entry(subject.to_string()).or_default() += units;
        let used = self.used.entry(subject.to_string()).or_default();
        *used = used.saturating_sub(units);
    }

    pub(super) fn answer(&mut self, body: &[u8], now: u64) -> String {
        let window = now / WINDOW_MS;
        if window != self.window {
            self.window = window;
            self.used.clear();
        }
        let reset_after_ms = (window + 1) * WINDOW_MS - now;
        let request: CheckRequest = serde_json::from_slice(body).unwrap();
        let results = request
            .checks
            .iter()
            .map(|check| {
                let limit = check.limits.iter().map(|l| l.requests).min().unwrap_or(0);
                let ask_id = check.lease.map_or(0, |a| a.id);
                let cost = check.limits.first().map_or(1, |l| l.cost);
                let used = self.used.entry(check.subject.clone()).or_default();
                let allowed = *used + cost <= limit;
                let mut leased = 0;
                if allowed {
                    *used += cost;
                    if let Some(ask) = check.lease {
                        leased = ask.units.min((limit - *used) / ask.share.max(1));
                        *used += leased;
                    }
                    *self.charged.entry(check.subject.clone()).or_default() += cost + leased;
                    if ask_id != 0 && leased > 0 {
                        self.grants.insert((check.subject.clone(), ask_id), leased);
                    }
                    if check.id != 0 {
                        self.grants.insert((check.subject.clone(), check.id), cost);
                    }
                }
                let remaining = limit - *used;
                CheckOutcome::Decided(CheckResult {
                    allowed,
                    limits: check
                        .limits
                        .iter()
                        .map(|l| LimitStatus {
                            allowed,
                            limit: l.requests,
                            remaining,
                            reset_after_ms,
                            retry_after_ms: if allowed { 0 } else { reset_after_ms },
                            shadow: false,
                            reason: None,
                        })
                        .collect(),
                    receipts: (allowed && (leased > 0 || check.receipt)).then(|| {
                        check
                            .limits
                            .iter()
                            .map(|_| Receipt {
                                clock_us: now * 1000,
                                nonce: format!("n.{now}"),
                                place: 1,
                                epoch: 0,
                                units: cost + leased,
                                mac: String::new(),
                            })
                            .collect()
                    }),
                    leased,
                })
            })
            .collect();
        // A return is a settlement at 0 of the units left: what the first
        // limit reserved beyond what was used goes back.
        let settled = request
            .settlements
            .iter()
            .map(|s| {
                if s.id == 0 || self.settled_ids.insert((s.subject.clone(), s.id)) {
                    let reserved = s.limits.first().map_or(0, |l| l.cost);
                    let used = s.actual.first().copied().unwrap_or(0);
                    self.give_back(&s.subject, reserved.saturating_sub(used));
                }
                SettleOutcome::Settled {
                    remaining: vec![0; s.limits.len()],
                }
            })
            .collect();
        // What the scripts of asks whose answers were lost granted goes
        // back, once.
        for lost in &request.lost {
            if let Some(units) = self.grants.remove(&(lost.subject.clone(), lost.id)) {
                self.give_back(&lost.subject, units);
            }
        }
        serde_json::to_string(&CheckResponse {
            results,
            settled,
            enforcement: None,
        })
        .unwrap()
    }
}
