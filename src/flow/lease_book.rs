//! The lease book: what one worker keeps of quota leases in its own
//! memory: the leases it installed (until their units are spent or given
//! back), the ids it gives out, its observer of how busy each check is,
//! the hits not yet added to their stat, and whether the root's tick runs.
//! What lives in shared data is `crate::shared::lease`; what the worker
//! does with both is `leases`.

use std::cell::{Cell, RefCell};

use log::warn;

use meshlimit_protocol::LostAsk;

use super::leases::LeaseRecord;
use super::observer::Observer;
use crate::config::LeaseConfig;
use crate::host::Host;

pub(super) struct LeaseBook {
    /// Leases this worker installed, until their units are spent or back.
    pub(super) records: RefCell<Vec<LeaseRecord>>,
    /// The last lease id this worker gave out (ids start at a random
    /// point, so two workers' ids do not meet).
    ids: Cell<u64>,
    /// Lease hits not yet added to their stat.
    hits: super::bulk::BulkCount,
    /// Units the lease slots dropped as this worker wrote them (see
    /// `Slot::dropped_units`), not yet added to their stat (the tick adds
    /// them).
    pub(super) dropped: Cell<u64>,
    /// How busy each check is, as this worker sees it (sizes leases).
    pub(super) observer: RefCell<Observer>,
    /// The root's tick runs (leases on, and the host took the period):
    /// renewals with time to spare may wait for it.
    pub(super) ticking: bool,
    /// Asks shrink after lost answers (see `ask_backoff`).
    pub(super) asks: super::ask_backoff::AskBackoff,
    /// Asks whose answers were lost, with when: named in a call once one
    /// succeeds (see `LeaseAsk::id`; never a call of their own while
    /// meshlimitd fails), until meshlimitd's record of them is gone.
    lost: RefCell<std::collections::VecDeque<(u64, LostAsk)>>,
    /// Returns not yet confirmed: waiting to go, out, or to go again.
    pub(super) returns: super::returns::ReturnQueue,
    /// Leases ended early, as this worker heard of them.
    pub(super) ends: super::lease_ends::LeaseEnds,
}

/// Lost asks kept at most (the oldest go first).
const MAX_LOST: usize = 256;
/// How long meshlimitd keeps a grant's record: a lost ask older than this
/// has nothing left to name.
const LOST_FOR_MS: u64 = meshlimit_protocol::bounds::GRANT_RECORD_MS;

impl LeaseBook {
    /// The book of a worker with `leases` (off: `None`); asks the host for
    /// the root's tick, every `tick_ms` (see [`tick_ms`]).
    pub(super) fn new(
        host: &impl Host,
        leases: Option<LeaseConfig>,
        tick_ms: Option<u32>,
        ends_key: &str,
    ) -> LeaseBook {
        // The busy-check table: as many entries as lease slots.
        let observed = leases.map_or(1, |l| l.slots);
        let ticking = match tick_ms {
            Some(ms) if host.set_tick_period(ms) => true,
            Some(_) => {
                warn!("cannot set a tick period; leased units are not given back before their window ends");
                false
            }
            None => false,
        };
        LeaseBook {
            records: RefCell::new(Vec::new()),
            ids: Cell::new(host.random_seed().1),
            hits: super::bulk::BulkCount::default(),
            dropped: Cell::new(0),
            observer: RefCell::new(Observer::new(observed)),
            ticking,
            asks: super::ask_backoff::AskBackoff::default(),
            lost: RefCell::new(std::collections::VecDeque::new()),
            returns: super::returns::ReturnQueue::new(observed),
            ends: super::lease_ends::LeaseEnds::new(ends_key),
        }
    }

    /// Keeps `asks`, lost at `now`, to be named in a call.
    pub(super) fn note_lost(&self, asks: impl IntoIterator<Item = LostAsk>, now: u64) {
        let mut lost = self.lost.borrow_mut();
        for ask in asks {
            if lost.len() >= MAX_LOST {
                lost.pop_front();
            }
            lost.push_back((now, ask));
        }
    }

    /// When the oldest ask kept was lost, if any.
    pub(super) fn oldest_lost_ms(&self) -> Option<u64> {
        self.lost.borrow().front().map(|(at, _)| *at)
    }

    /// The lost asks still worth naming at `now`, taken.
    pub(super) fn take_lost(&self, now: u64) -> Vec<LostAsk> {
        self.lost
            .borrow_mut()
            .drain(..)
            .filter(|(at, _)| now.saturating_sub(*at) < LOST_FOR_MS)
            .map(|(_, ask)| ask)
            .collect()
    }

    /// A new lease id (never 0).
    pub(super) fn next_lease_id(&self) -> u64 {
        let next = self.ids.get().wrapping_add(1).max(1);
        self.ids.set(next);
        next
    }

    /// Counts a hit; the hits to add to their stat now, if any (in bulk:
    /// a hostcall per request is a tenth of what a hit costs).
    pub(super) fn count_hit(&self) -> Option<u64> {
        self.hits.count()
    }

    /// The hits not yet added to their stat (the tick adds them).
    pub(super) fn take_hits(&self) -> u64 {
        self.hits.take()
    }
}

/// The tick period that reclaims leases: a quarter of the interval (25 ms
/// to 250 ms), so an idle lease goes back soon after it idles.
pub(super) fn tick_ms(leases: Option<LeaseConfig>) -> Option<u32> {
    let interval = leases?.interval_ms;
    Some((interval / 4).clamp(25, 250) as u32)
}
