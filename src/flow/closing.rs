//! A worker going away. Envoy calls its root's `on_done` when the plugin
//! configuration it was made for is replaced (a push, once the old
//! listener has drained: `--drain-time-s`) or removed, with its event loop
//! still running, and deletes the root once the root says it is done.
//! Leases this worker installed are given back by no one else: they used
//! to stay charged until their window ended whenever the old listener
//! drained faster than they idled. So before it goes, what it holds goes
//! back:
//!
//! - its draws, to their slots (`scope: local` draws to their counters);
//! - the units of every lease it installed, to meshlimitd, however recent
//!   their last hit (a lease another worker still has a draw from waits
//!   for that draw, and is looked at again on each tick);
//! - returns not yet confirmed, and lost asks, named again;
//! - whatever else waits in the outbox (settlements, renewals).
//!
//! `on_done` says the root is not done while a call is out or a lease
//! waits, and the root calls `proxy_done` once neither is left, or after
//! [`MAX_WAIT_MS`] (a lease the new configuration's workers keep drawing
//! from is theirs to spend). Envoy calls `on_done` as it exits too, but
//! sends nothing more by then (seen with Envoy 1.40: the calls dispatched
//! are accepted and never leave): an Envoy that exits gives back only what
//! idled before, on its ticks (docs/leases.md, "An Envoy that exits").

use std::cell::Cell;

use log::{info, warn};

use super::returns::Due;
use super::Worker;
use crate::host::Host;

/// The longest a worker going away waits for draws and answers.
pub(super) const MAX_WAIT_MS: u64 = 2_000;

/// Whether, and since when, the worker is going away.
#[derive(Default)]
pub(super) struct Closing {
    since_ms: Cell<Option<u64>>,
    finished: Cell<bool>,
}

impl Closing {
    pub(super) fn started(&self) -> bool {
        self.since_ms.get().is_some()
    }
}

impl Worker {
    /// The root's `on_done`: gives back what the worker holds. True when
    /// nothing is left to wait for (the root may go at once); else the
    /// root calls `proxy_done` itself later (see [`Worker::finish_closing`]).
    pub fn on_done(&self, host: &impl Host) -> bool {
        let now = host.now_ms();
        self.closing.since_ms.set(Some(now));
        let leases = self.lease_book.records.borrow().len();
        if leases > 0 {
            info!("going away (configuration replaced or removed, or Envoy exiting): giving back the units of {leases} leases");
        }
        self.give_back_before_going(host, now);
        let done = self.nothing_left();
        self.closing.finished.set(done);
        done
    }

    /// The root's tick or a call's answer while going away: what waited
    /// goes back, and `proxy_done` is called once nothing is left or the
    /// wait is over.
    pub(super) fn finish_closing(&self, host: &impl Host, from_tick: bool) {
        let Some(since) = self.closing.since_ms.get() else {
            return;
        };
        if self.closing.finished.get() {
            return;
        }
        let now = host.now_ms();
        if from_tick {
            self.give_back_before_going(host, now);
        }
        let waited = now.saturating_sub(since) >= MAX_WAIT_MS;
        if !self.nothing_left() && !waited {
            return;
        }
        if !self.nothing_left() {
            warn!(
                "going away after {MAX_WAIT_MS} ms with {} leases still drawn from, or returns unconfirmed",
                self.lease_book.records.borrow().len()
            );
            self.give_up_unconfirmed(host);
        }
        self.closing.finished.set(true);
        host.set_effective_context(self.root_context_id);
        if !host.done() {
            warn!("the host was not waiting for this worker to finish going away");
        }
    }

    /// Draws back, every lease with none out returned, and every call due
    /// sent as the root.
    fn give_back_before_going(&self, host: &impl Host, now: u64) {
        host.set_effective_context(self.root_context_id);
        self.rule_stats.flush(host);
        self.give_back_every_local_draw(host);
        if let Some(leases) = self.leases(host, now) {
            let draws = self.lease_book.observer.borrow_mut().due_draws(now, 0);
            self.put_back_draws(&leases, draws);
            let returns = self.reclaim_records(&leases, now, Due::Now);
            self.queue_returns(host, returns);
        }
        self.add_lease_counts(host);
        // Failed ones too, on every tick while it waits: no other call
        // may come to say meshlimitd is back.
        self.resend_returns(host, self.root_context_id);
        self.send_lost(host, self.root_context_id, now);
        self.flush_deferred(host, now);
    }

    /// No lease left to give back, no return unconfirmed, and no call
    /// out or waiting.
    fn nothing_left(&self) -> bool {
        self.lease_book.records.borrow().is_empty()
            && self.lease_book.returns.is_empty()
            && self.outbox.is_idle()
    }
}
