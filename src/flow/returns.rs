//! Lease returns: the units a lease left unused, given back to meshlimitd,
//! confirmed, or sent again.
//!
//! A return is a settlement at 0 of the units left (`Check::lease_return`)
//! with an id of its own: meshlimitd applies an id once
//! (`Settlement::id`). Returns wait in a [`ReturnQueue`] and go out
//! [`RETURNS_PER_CALL`] a call, one return call at a time: meshlimitd runs
//! each return as a script of its own, and the 1,024 a call could carry
//! (1,000 leases idle on one tick), on a loaded machine, outlasted its
//! Redis timeout and tripped its Redis health check, which then fails
//! every script fast for a while ("retrying shortly"): the call's other
//! returns, and every other caller's checks. The next return call goes
//! when the last one is answered, or on the tick.
//!
//! A return whose call failed (a timeout, a 503, a failed connection), or
//! that meshlimitd could not apply (`unavailable`: Redis did not answer),
//! may have been applied or lost on the way; it stays queued and is sent
//! again with the id it had, once a call succeeds (or on the tick after
//! one did), for up to [`bounds::RESEND_RETURN_MS`]. Only then, or when
//! meshlimitd refuses it as invalid, or when the worker goes away first,
//! are its units counted `lease_returns_unconfirmed`: they stay charged
//! until their window ends (fewer admitted, never more).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use log::warn;
use meshlimit_protocol::{bounds, FailureKind, Receipt, SettleOutcome, Settlement};

use super::{Job, Worker};
use crate::check::Check;
use crate::decision::ServiceError;
use crate::host::Host;
use crate::shared::lease::{Leases, Reclaim};
use crate::stats::Stat;

/// Returns one call carries at most: a sixteenth of the 1,024
/// settlements meshlimitd takes in a call, so that a return call, or a
/// batch of checks it rides with, is answered within the call's timeout
/// on a busy machine too.
pub(super) const RETURNS_PER_CALL: usize = 64;
/// A return call still unanswered this long after its own timeout is
/// taken as failed (its answer went with the stream whose callback sent
/// it), so that the returns it carried go out again.
const ANSWER_LOST_AFTER_MS: u64 = 1_000;
/// The fewest returns kept. The queue keeps twice the lease slots: each
/// lease a worker installs gives one return, a worker holds at most one
/// lease a slot, and twice that leaves room for a second round while the
/// first waits to go again.
const MIN_KEPT: usize = 256;

/// Which of a worker's leases give their units back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Due {
    /// Those expired, or idle an interval (the root's tick).
    Idle,
    /// Every one with no draw out, however recent its last hit (the
    /// worker is going away).
    Now,
}

/// A return waiting to be confirmed.
struct Pending {
    settlement: Settlement,
    /// When it went out in the call still out, if it is out.
    sent_ms: Option<u64>,
    /// When a call first failed to apply it, if one did.
    failed_ms: Option<u64>,
}

/// What became of a return call's returns.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Answered {
    /// Units meshlimitd gave back.
    pub(super) confirmed: u64,
    /// Units meshlimitd refused to give back, and why (not sent again).
    pub(super) refused: Vec<(String, u64)>,
}

/// A worker's returns not yet confirmed: waiting to go, out in a call, or
/// failed and waiting to go again.
pub(super) struct ReturnQueue {
    pending: RefCell<VecDeque<Pending>>,
    /// A call succeeded since a return call last failed: failed returns
    /// may go again (never a call of their own while meshlimitd fails).
    reachable: Cell<bool>,
    kept_at_most: usize,
}

impl ReturnQueue {
    /// The queue of a worker with `slots` lease slots.
    pub(super) fn new(slots: u32) -> ReturnQueue {
        ReturnQueue {
            pending: RefCell::new(VecDeque::new()),
            reachable: Cell::new(true),
            kept_at_most: (2 * slots as usize).max(MIN_KEPT),
        }
    }

    /// Queues `returns`; the units of those there was no room for (the
    /// oldest give up first), given up.
    pub(super) fn add(&self, returns: Vec<Settlement>) -> u64 {
        let mut pending = self.pending.borrow_mut();
        let mut dropped = 0;
        for settlement in returns {
            if pending.len() >= self.kept_at_most {
                dropped += pending
                    .pop_front()
                    .map_or(0, |p| returned_units(std::slice::from_ref(&p.settlement)));
            }
            pending.push_back(Pending {
                settlement,
                sent_ms: None,
                failed_ms: None,
            });
        }
        dropped
    }

    /// The returns of the next call at `now`, marked out, if no return
    /// call is out (one unanswered `lost_after_ms` is taken as failed):
    /// those never sent first, then, with `with_failed`, those that
    /// failed. Also the units of returns given up: failing for
    /// [`bounds::RESEND_RETURN_MS`], or failed with no id to send them
    /// again safely.
    pub(super) fn next_call(
        &self,
        now: u64,
        with_failed: bool,
        lost_after_ms: u64,
    ) -> (Vec<Settlement>, u64) {
        let mut pending = self.pending.borrow_mut();
        for p in pending.iter_mut() {
            if let Some(sent) = p.sent_ms {
                if now.saturating_sub(sent) >= lost_after_ms {
                    p.sent_ms = None;
                    p.failed_ms.get_or_insert(sent);
                }
            }
        }
        let mut given_up = 0;
        pending.retain(|p| {
            let stale = p.failed_ms.is_some_and(|at| {
                p.settlement.id == 0 || now.saturating_sub(at) >= bounds::RESEND_RETURN_MS
            });
            if stale {
                given_up += returned_units(std::slice::from_ref(&p.settlement));
            }
            !stale
        });
        if pending.iter().any(|p| p.sent_ms.is_some()) {
            return (Vec::new(), given_up);
        }
        let with_failed = with_failed && self.reachable.get();
        let at = |failed: bool| {
            pending
                .iter()
                .enumerate()
                .filter(move |(_, p)| p.failed_ms.is_some() == failed)
                .map(|(i, _)| i)
        };
        let chosen: Vec<usize> = at(false)
            .chain(at(true).filter(|_| with_failed))
            .take(RETURNS_PER_CALL)
            .collect();
        let mut call = Vec::with_capacity(chosen.len());
        for i in chosen {
            if let Some(p) = pending.get_mut(i) {
                p.sent_ms = Some(now);
                call.push(p.settlement.clone());
            }
        }
        (call, given_up)
    }

    /// The answer to a return call that carried `sent` (each found by its
    /// id): confirmed ones leave, refused ones leave and are reported,
    /// those meshlimitd could not apply, or all when the call failed, wait
    /// to go again.
    pub(super) fn answered(
        &self,
        sent: &[Settlement],
        outcomes: Result<&[SettleOutcome], &ServiceError>,
        now: u64,
    ) -> Answered {
        let mut answered = Answered::default();
        let mut pending = self.pending.borrow_mut();
        for (i, settlement) in sent.iter().enumerate() {
            let units = returned_units(std::slice::from_ref(settlement));
            let outcome = outcomes.map(|o| o.get(i));
            let Some(at) = pending
                .iter()
                .position(|p| p.sent_ms.is_some() && p.settlement.id == settlement.id)
            else {
                // Given up meanwhile (no room): counted then.
                continue;
            };
            match outcome {
                Ok(Some(SettleOutcome::Settled { .. })) => {
                    answered.confirmed += units;
                    pending.remove(at);
                }
                Ok(Some(SettleOutcome::Failed(f))) if f.kind == FailureKind::Invalid => {
                    answered.refused.push((f.error.clone(), units));
                    pending.remove(at);
                }
                // Redis did not answer, or no outcome came for it: its
                // call got through, so it may go again soon.
                Ok(_) => {
                    if let Some(p) = pending.get_mut(at) {
                        p.sent_ms = None;
                        p.failed_ms.get_or_insert(now);
                    }
                }
                Err(_) => {
                    self.reachable.set(false);
                    if let Some(p) = pending.get_mut(at) {
                        p.sent_ms = None;
                        p.failed_ms.get_or_insert(now);
                    }
                }
            }
        }
        answered
    }

    /// A call to meshlimitd succeeded: failed returns may go again.
    pub(super) fn heard_success(&self) {
        self.reachable.set(true);
    }

    /// No return waits for confirmation.
    pub(super) fn is_empty(&self) -> bool {
        self.pending.borrow().is_empty()
    }

    /// Every return still waiting, given up: their units.
    fn give_up_all(&self) -> u64 {
        self.pending
            .borrow_mut()
            .drain(..)
            .map(|p| returned_units(std::slice::from_ref(&p.settlement)))
            .sum()
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
                    if !(expired && record.expiry_ends_every_window) {
                        returns.push(self.lease_return(&record.check, units, &record.receipts));
                    }
                    false
                }
            }
        });
        returns
    }

    /// Queues returns, and sends the next return call if none is out;
    /// `context_id` is the context current now (it is current again
    /// after).
    pub(super) fn send_returns(&self, host: &impl Host, context_id: u32, returns: Vec<Settlement>) {
        self.queue_returns(host, returns);
        self.pump_returns(host, context_id, false);
    }

    /// Queues returns for the next return calls.
    pub(super) fn queue_returns(&self, host: &impl Host, returns: Vec<Settlement>) {
        let dropped = self.lease_book.returns.add(returns);
        self.return_failed(host, "no room to keep them", dropped);
    }

    /// Sends the next return call, if none is out: returns never sent
    /// first, then, with `with_failed` and a call heard since they failed,
    /// those to send again.
    pub(super) fn pump_returns(&self, host: &impl Host, context_id: u32, with_failed: bool) {
        let queue = &self.lease_book.returns;
        if queue.is_empty() {
            return;
        }
        let now = host.now_ms();
        let lost_after = self.config.service.timeout_ms + ANSWER_LOST_AFTER_MS;
        let (call, stale) = queue.next_call(now, with_failed, lost_after);
        self.return_failed(host, "their calls kept failing", stale);
        if call.is_empty() {
            return;
        }
        let sent = call.clone();
        if let Err(e) = self.send_job(host, context_id, Job::Return { settlements: call }) {
            // Kept, to go again (the queue was full, or no call could go).
            let _ = queue.answered(&sent, Err(&e), now);
        }
    }

    /// The worker goes away with returns still unconfirmed: their units
    /// are counted as given up.
    pub(super) fn give_up_unconfirmed(&self, host: &impl Host) {
        let units = self.lease_book.returns.give_up_all();
        self.return_failed(
            host,
            "the worker went away before meshlimitd confirmed them",
            units,
        );
    }

    /// A call succeeded: the returns whose calls failed go out again.
    pub(super) fn resend_returns(&self, host: &impl Host, context_id: u32) {
        self.lease_book.returns.heard_success();
        self.pump_returns(host, context_id, true);
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

    /// meshlimitd answered a return call, or it failed: confirmed units
    /// counted, refused ones reported, the rest kept to go again.
    pub(super) fn on_returned(
        &self,
        host: &impl Host,
        settlements: &[Settlement],
        outcomes: Result<Vec<SettleOutcome>, ServiceError>,
    ) {
        let answered =
            self.lease_book
                .returns
                .answered(settlements, outcomes.as_deref(), host.now_ms());
        if answered.confirmed > 0 {
            self.metrics
                .add(host, Stat::LeaseReturns, answered.confirmed as usize);
        }
        for (why, units) in answered.refused {
            self.return_failed(host, &why, units);
        }
    }
}

/// The units lease returns give back (each limit of one is given back the
/// same units: its first's).
fn returned_units(settlements: &[Settlement]) -> u64 {
    settlements
        .iter()
        .map(|s| s.limits.first().map_or(0, |l| l.cost))
        .sum()
}

#[cfg(test)]
mod tests {
    use meshlimit_protocol::CheckFailure;

    use super::*;

    /// A return of `units` with id `id`.
    fn back(id: u64, units: u64) -> Settlement {
        serde_json::from_value(serde_json::json!({
            "subject": "s", "id": id, "actual": [0], "receipts": [],
            "limits": [{"name": "r/l", "requests": 1000, "window_ms": 60000,
                        "algorithm": "fixed_window", "cost": units}],
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn settled(n: usize) -> Vec<SettleOutcome> {
        vec![SettleOutcome::Settled { remaining: vec![1] }; n]
    }

    fn failed(kind: FailureKind) -> SettleOutcome {
        SettleOutcome::Failed(CheckFailure {
            error: "redis is unhealthy".into(),
            kind,
        })
    }

    fn ids(call: &[Settlement]) -> Vec<u64> {
        call.iter().map(|s| s.id).collect()
    }

    const LOST_AFTER: u64 = 1_020;

    #[test]
    fn returns_go_a_bounded_number_a_call_and_one_call_at_a_time() {
        let queue = ReturnQueue::new(4096);
        assert_eq!(queue.add((1..=150).map(|id| back(id, 2)).collect()), 0);
        let (first, _) = queue.next_call(0, true, LOST_AFTER);
        assert_eq!(ids(&first), (1..=64).collect::<Vec<_>>());
        assert_eq!(
            queue.next_call(5, true, LOST_AFTER),
            (Vec::new(), 0),
            "one call out at a time"
        );
        let answered = queue.answered(&first, Ok(&settled(64)), 5);
        assert_eq!(answered.confirmed, 128);
        let (second, _) = queue.next_call(5, true, LOST_AFTER);
        assert_eq!(ids(&second), (65..=128).collect::<Vec<_>>());
        queue.answered(&second, Ok(&settled(64)), 6);
        let (third, _) = queue.next_call(6, true, LOST_AFTER);
        assert_eq!(third.len(), 22);
        queue.answered(&third, Ok(&settled(22)), 7);
        assert!(queue.is_empty());
    }

    /// "redis is unhealthy" is no refusal: the return goes again (with
    /// its id), after the returns never sent, and only when asked to;
    /// an invalid one is refused for good.
    #[test]
    fn a_return_meshlimitd_could_not_apply_goes_again_and_an_invalid_one_is_refused() {
        let queue = ReturnQueue::new(16);
        queue.add(vec![back(1, 3), back(2, 4)]);
        let (call, _) = queue.next_call(0, true, LOST_AFTER);
        let outcomes = [
            failed(FailureKind::Unavailable),
            failed(FailureKind::Invalid),
        ];
        let answered = queue.answered(&call, Ok(&outcomes), 1);
        assert_eq!(answered.confirmed, 0);
        assert_eq!(
            answered.refused,
            vec![("redis is unhealthy".to_string(), 4)]
        );
        queue.add(vec![back(3, 5)]);
        let (fresh, _) = queue.next_call(2, false, LOST_AFTER);
        assert_eq!(ids(&fresh), [3], "not sent again unless asked");
        queue.answered(&fresh, Ok(&settled(1)), 3);
        let (again, _) = queue.next_call(4, true, LOST_AFTER);
        assert_eq!(ids(&again), [1]);
    }

    /// A call that failed says nothing of whether meshlimitd is back: its
    /// returns wait for a call that succeeds.
    #[test]
    fn a_failed_call_waits_for_one_that_succeeds() {
        let queue = ReturnQueue::new(16);
        queue.add(vec![back(1, 3)]);
        let (call, _) = queue.next_call(0, true, LOST_AFTER);
        queue.answered(&call, Err(&ServiceError::Timeout), 20);
        assert!(queue.next_call(300, true, LOST_AFTER).0.is_empty());
        queue.heard_success();
        assert_eq!(ids(&queue.next_call(301, true, LOST_AFTER).0), [1]);
    }

    /// A call whose answer never comes (it went with the stream that sent
    /// it) does not hold the returns back for good.
    #[test]
    fn an_unanswered_call_is_taken_as_failed() {
        let queue = ReturnQueue::new(16);
        queue.add(vec![back(1, 3)]);
        queue.next_call(0, true, LOST_AFTER);
        assert!(queue
            .next_call(LOST_AFTER - 1, true, LOST_AFTER)
            .0
            .is_empty());
        assert_eq!(ids(&queue.next_call(LOST_AFTER, true, LOST_AFTER).0), [1]);
    }

    #[test]
    fn returns_failing_too_long_or_without_room_are_given_up_and_counted() {
        let queue = ReturnQueue::new(16);
        queue.add(vec![back(1, 3)]);
        let (call, _) = queue.next_call(0, true, LOST_AFTER);
        queue.answered(&call, Ok(&[failed(FailureKind::Unavailable)]), 10);
        let late = 10 + bounds::RESEND_RETURN_MS;
        assert_eq!(queue.next_call(late, true, LOST_AFTER), (Vec::new(), 3));
        assert!(queue.is_empty());
        // Room for twice the slots, 256 at least.
        assert_eq!(queue.add((1..=256).map(|id| back(id, 1)).collect()), 0);
        assert_eq!(queue.add(vec![back(300, 1)]), 1);
        assert_eq!(queue.give_up_all(), 256);
    }
}
