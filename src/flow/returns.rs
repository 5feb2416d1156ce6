//! Lease returns: the units a lease left unused, given back to meshlimitd,
//! confirmed, or sent again.
//!
//! A return is a settlement at 0 of the units left (`Check::lease_return`)
//! with an id of its own: meshlimitd applies an id once
//! (`Settlement::id`). A return whose call failed (a timeout, a 503, a
//! failed connection) may have been applied or lost on the way; it is
//! kept, and sent again with the id it had, once a call succeeds, for up to
//! [`bounds::RESEND_RETURN_MS`]. Only then, or when meshlimitd refuses it,
//! are its units counted `lease_returns_unconfirmed`: they stay charged
//! until their window ends (fewer admitted, never more).

use std::cell::RefCell;
use std::collections::VecDeque;

use log::warn;
use meshlimit_protocol::{bounds, Receipt, SettleOutcome, Settlement};

use super::{Job, Worker};
use crate::check::Check;
use crate::decision::ServiceError;
use crate::host::Host;
use crate::shared::lease::{Leases, Reclaim};
use crate::stats::Stat;

/// Returns per job: a batch of 64 jobs stays within meshlimitd's 1024
/// settlements per call.
const RETURNS_PER_JOB: usize = 16;
/// Returns kept to be sent again at most (the oldest give up first).
const MAX_KEPT: usize = 256;

/// Which of a worker's leases give their units back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Due {
    /// Those expired, or idle an interval (the root's tick).
    Idle,
    /// Every one with no draw out, however recent its last hit (the
    /// worker is going away).
    Now,
}

/// Returns whose calls failed, with when they first failed.
#[derive(Default)]
pub(super) struct Unconfirmed {
    kept: RefCell<VecDeque<(u64, Settlement)>>,
}

impl Unconfirmed {
    /// Keeps `returns`, whose call failed at `now`; the units of those it
    /// had no room for (given up).
    fn keep(&self, returns: &[Settlement], now: u64) -> u64 {
        let mut kept = self.kept.borrow_mut();
        let mut dropped = 0;
        for settlement in returns.iter().filter(|s| s.id != 0) {
            if kept.len() >= MAX_KEPT {
                dropped += kept.pop_front().map_or(0, |(_, s)| returned_units(&[s]));
            }
            kept.push_back((now, settlement.clone()));
        }
        // Without an id a return cannot be sent again safely.
        dropped + returned_units_where(returns, |s| s.id == 0)
    }

    /// The returns still worth sending again at `now`, taken; and the
    /// units of those too old to (given up).
    fn take(&self, now: u64) -> (Vec<Settlement>, u64) {
        let (mut fresh, mut stale) = (Vec::new(), 0);
        for (at, settlement) in self.kept.borrow_mut().drain(..) {
            if now.saturating_sub(at) < bounds::RESEND_RETURN_MS {
                fresh.push(settlement);
            } else {
                stale += returned_units(std::slice::from_ref(&settlement));
            }
        }
        (fresh, stale)
    }

    /// Whether returns wait to be sent again.
    pub(super) fn is_empty(&self) -> bool {
        self.kept.borrow().is_empty()
    }
}

impl Worker {
    /// The return of `units` leased units of `check` left unused, charged
    /// where `receipts` say, with an id of its own.
    pub(super) fn lease_return(
        &self,
        check: &Check,
        units: u64,
        receipts: &[Receipt],
    ) -> Settlement {
        Settlement {
            id: self.lease_book.next_lease_id(),
            ..check.lease_return(units, receipts)
        }
    }

    /// Takes the units of the leases this worker installed that are `due`
    /// at `now` out of their slots: the returns to send. A lease whose
    /// slot cannot be read or written, or that still waits (for its idle
    /// time, or for draws out), stays in the book for a later look.
    pub(super) fn reclaim_records<H: Host>(
        &self,
        leases: &Leases<'_, H>,
        now: u64,
        due: Due,
    ) -> Vec<Settlement> {
        let mut returns = Vec::new();
        let interval_ms = leases.config.interval_ms;
        self.lease_book.records.borrow_mut().retain_mut(|record| {
            // Not due yet (unless the clock stepped back past an interval).
            let waits = now < record.look_at_ms && record.look_at_ms - now <= interval_ms;
            let reclaimed = match due {
                Due::Idle if waits => return true,
                Due::Idle => leases.reclaim(record.slot, record.lease_id, now),
                Due::Now => leases.reclaim_now(record.slot, record.lease_id, now),
            };
            match reclaimed {
                Ok(Reclaim::Keep { until_ms }) => {
                    record.look_at_ms = until_ms;
                    true
                }
                // A store that fails is asked again next time.
                Err(_) => true,
                Ok(Reclaim::Gone) => false,
                Ok(Reclaim::Back { units, expired }) => {
                    if !(expired && record.fixed_only) {
                        returns.push(self.lease_return(&record.check, units, &record.receipts));
                    }
                    false
                }
            }
        });
        returns
    }

    /// Sends returns in the worker's next batches (or calls of their own),
    /// [`RETURNS_PER_JOB`] a job; `context_id` is the context current now
    /// (it is current again after).
    pub(super) fn send_returns(
        &self,
        host: &impl Host,
        context_id: u32,
        mut returns: Vec<Settlement>,
    ) {
        while !returns.is_empty() {
            let rest = returns.split_off(returns.len().min(RETURNS_PER_JOB));
            let units = returned_units(&returns);
            if let Err(e) = self.send_job(
                host,
                context_id,
                Job::Return {
                    settlements: returns,
                },
            ) {
                self.return_failed(host, &e.to_string(), units);
            }
            returns = rest;
        }
    }

    /// The worker goes away with returns still unconfirmed: their units
    /// are counted as given up.
    pub(super) fn give_up_unconfirmed(&self, host: &impl Host) {
        let (returns, stale) = self.lease_book.unconfirmed.take(0);
        let units = stale + returned_units(&returns);
        self.return_failed(
            host,
            "the worker went away before meshlimitd confirmed them",
            units,
        );
    }

    /// A call succeeded: the returns whose calls failed go out again.
    pub(super) fn resend_returns(&self, host: &impl Host, context_id: u32, now: u64) {
        if self.lease_book.unconfirmed.is_empty() {
            return;
        }
        let (returns, stale) = self.lease_book.unconfirmed.take(now);
        if stale > 0 {
            self.return_failed(host, "their calls kept failing", stale);
        }
        self.send_returns(host, context_id, returns);
    }

    /// Returns of `units` that meshlimitd did not confirm and that are not
    /// sent again (refused, or their calls kept failing), counted.
    fn return_failed(&self, host: &impl Host, why: &str, units: u64) {
        if units == 0 {
            return;
        }
        self.metrics
            .add(host, Stat::LeaseReturnsUnconfirmed, units as usize);
        if let Some(skipped) = self.error_log.allow(host.now_ms()) {
            warn!(
                "cannot give leased units back ({why}); they stay charged until their window ends ({skipped} similar lines suppressed)"
            );
        }
    }

    /// meshlimitd answered returns, or their call failed: kept, to be
    /// sent again once a call succeeds.
    pub(super) fn on_returned(
        &self,
        host: &impl Host,
        settlements: &[Settlement],
        outcomes: Result<Vec<SettleOutcome>, ServiceError>,
    ) {
        let outcomes = match outcomes {
            Ok(outcomes) => outcomes,
            Err(_) => {
                let dropped = self.lease_book.unconfirmed.keep(settlements, host.now_ms());
                return self.return_failed(host, "no room to send them again", dropped);
            }
        };
        for (settlement, outcome) in settlements.iter().zip(outcomes) {
            let units = returned_units(std::slice::from_ref(settlement));
            match outcome {
                SettleOutcome::Settled { .. } => {
                    self.metrics.add(host, Stat::LeaseReturns, units as usize);
                }
                SettleOutcome::Failed(f) => self.return_failed(host, &f.error, units),
            }
        }
    }
}

/// The units lease returns give back (each limit of one is given back the
/// same units: its first's).
fn returned_units(settlements: &[Settlement]) -> u64 {
    returned_units_where(settlements, |_| true)
}

fn returned_units_where(settlements: &[Settlement], keep: impl Fn(&Settlement) -> bool) -> u64 {
    settlements
        .iter()
        .filter(|s| keep(s))
        .map(|s| s.limits.first().map_or(0, |l| l.cost))
        .sum()
}
