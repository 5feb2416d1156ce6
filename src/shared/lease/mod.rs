//! Quota leases in shared data: units meshlimitd charged in Redis ahead of
//! time, for this Envoy to admit a busy client's requests without a call.
//!
//! A lease belongs to one check (a subject and the limits its requests
//! match) and lives in one of a fixed set of slots, found by a keyed
//! fingerprint as the fallback counters are, and shared by every worker.
//! Each worker also observes, in its own memory (`crate::flow::observer`), how many
//! units each check asked for in the last interval: that rate sizes the
//! next lease, so a cold client (one request per interval) never asks for
//! one (it still draws from a lease another worker got), and a busy one
//! gets about an interval's worth. The slot's life:
//!
//! - [`Slot::take`] when a worker has no units of its own for a busy
//!   check's request: a live lease with room gives the worker a draw, half
//!   of what is left (the request's cost alone from a lease's last
//!   [`DRAW_HALF_FROM`] requests' worth), which admits the
//!   request and the worker's next ones with no hostcall at all
//!   (`Observer::spend`); otherwise the request calls, asking for a
//!   lease when no other ask is out. The slot counts the units drawn and
//!   not yet accounted for (`lent`); a worker accounts for its draw when it
//!   draws again, or on its tick once the draw idles or expires
//!   ([`Slot::put_back`], unused units back in the slot).
//! - [`Slot::install`] when an answer grants units: only over a lease
//!   with no units left in the slot, so units are never merged across
//!   leases or lost. A replaced lease whose draws are still out waits
//!   aside (`previous`) for them to be accounted for; an ended one that
//!   gives that place to a newer one, with units still charged in a
//!   window that has not ended, is kept owed to its owner (`owed`).
//! - [`Slot::reclaim`] on the granting worker's tick: a lease that expired
//!   or went idle, with no draw out, gives its units back (the worker sends
//!   them to meshlimitd as a settlement at 0, in the very counter and
//!   window they came from).
//!
//! Every unit was charged in Redis before any request used it, so leases
//! never admit more than the limit; what they can cost is admitting less
//! for a while (units held here while another replica is refused), at most
//! the units outstanding, which returns and the lease's bound (half of what
//! is left over `local.expected_replicas`) keep small.
//!
//! Files: this one has the store helper ([`Leases`]) and the types a
//! worker sees; `slot.rs` the slot's layout and rules.

mod slot;
#[cfg(test)]
mod tests;

use std::cell::Cell;

use super::keys::Keys;
use super::store::{self, retry_on_conflict, Purpose, SharedStore, StoreError};
use crate::config::LeaseConfig;
pub(crate) use slot::Slot;

/// Words per lease, and per slot (the check, its ask, three leases, and
/// the ended leases owed to their owners).
const LEASE_WORDS: usize = 9;
const WORDS: usize = 2 + 3 * LEASE_WORDS + OWED * OWED_WORDS;
/// Ended leases a slot keeps for their owners ([`Slot::owed`]).
const OWED: usize = 2;
/// Words kept of an owed lease: its id, units, lent units, expiry and
/// whether its units outlive it (nothing draws from it; the rest of a
/// lease's words serve draws).
const OWED_WORDS: usize = 5;
/// An owner takes an expired lease's units back on its next tick (250 ms
/// at most); units still there this long after the expiry have none.
const ABANDONED_AFTER_MS: u64 = 2_000;
/// A clock this far behind a lease's last use stepped back: the lease is
/// treated as expired (its window can no longer be told from the clock).
const CLOCK_SLACK_MS: u64 = 100;
/// An expired lease waits this long for the workers' draws to come back
/// (each worker puts back an expired draw on its next tick, 250 ms at
/// most) before its owner takes back what is in the slot.
const DRAWS_BACK_WITHIN_MS: u64 = 600;
/// A worker draws half of what is left only from a lease holding this many
/// times the request's cost; from a smaller one, the request's cost alone,
/// so the last units of a lease are never held by one worker while the
/// client's next requests land on another and are refused. (Unless the
/// lease is [`plenty_beyond`] what meshlimitd has left: that other worker
/// would be admitted by a call.)
const DRAW_HALF_FROM: u64 = 16;

/// From a lease without [`plenty_beyond`] it, a worker draws at most this
/// fraction of what it would ask for (about an interval's worth of its
/// own pace): what it spends in a quarter of an interval, the root's tick.
const DRAWS_PER_ASK: u64 = 4;

/// Whether meshlimitd, with `remaining` left on the tightest limit once it
/// granted `units`, has plenty beyond them: [`DRAW_HALF_FROM`] leases' worth.
/// Half of such a lease may sit in one worker's draw to its last units.
pub(crate) fn plenty_beyond(units: u64, remaining: u64) -> bool {
    remaining >= units.saturating_mul(DRAW_HALF_FROM)
}

/// Units of a lease one worker drew from its slot: spent with no hostcall
/// until they run out, idle or expire, then accounted for in the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Draw {
    pub slot: u64,
    pub lease_id: u64,
    /// Units drawn (the slot's `lent` holds them until put back).
    pub drawn: u64,
    /// Units of the draw not spent yet.
    pub left: u64,
    /// What the client had left beyond this draw when it was drawn
    /// ([`Slot::rest`]): each request spending the draw reports `left`
    /// and this as its `RateLimit` remaining.
    pub rest: u64,
    pub expires_ms: u64,
    pub reset_at_ms: u64,
    pub last_hit_ms: u64,
    /// Its lease's units still count once it has expired (see
    /// [`Slot::dropped_units`]): put back with its lease gone, its units
    /// left are counted dropped.
    pub outlives_expiry: bool,
}

impl Draw {
    /// Whether it may admit at `now` (see [`Slot::usable`]).
    pub(crate) fn usable(&self, now: u64) -> bool {
        live(now, self.expires_ms, self.last_hit_ms)
    }

    /// What a request that spent from it reports as remaining: the draw's
    /// units left and what the client had beyond it when it was drawn.
    pub(crate) fn remaining(&self) -> u64 {
        self.left.saturating_add(self.rest)
    }
}

/// Whether units expiring at `expires_ms` and last used at `last_hit_ms`
/// may admit at `now`: not expired, and the clock has not stepped back
/// past their last use (a lease's and a draw's rule alike).
fn live(now: u64, expires_ms: u64, last_hit_ms: u64) -> bool {
    now < expires_ms && now.saturating_add(CLOCK_SLACK_MS) >= last_hit_ms
}

/// How long an ask for units is out, during which other requests of the
/// check call without asking (one ask at a time): a request's own ask is
/// answered within the call's timeout; a renewal may first wait for the
/// root's tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AskFor {
    pub miss_ms: u64,
    pub renewal_ms: u64,
    /// The interval a check's pace is counted over, when its lease ends
    /// with its window (fixed windows and sliding counters; `None` for a
    /// token bucket, whose lease lasts an interval from its grant): a
    /// renewal near that end asks for less (see [`AskFor::renewal_units`]).
    pub window_bound_interval_ms: Option<u64>,
}

impl AskFor {
    /// What a renewal of a lease expiring at `expires_ms` asks for, `pace`
    /// being the check's units per interval and `held` the units known to
    /// be left (the draw's and the slot's). A renewal granted in the
    /// window of a lease that ends with it ends there too: near that end
    /// it asks only for what the pace spends before it, beyond `held`,
    /// and for nothing when `held` lasts until then. Units asked beyond
    /// would be charged to the ending window and expire unused, while
    /// another replica is refused them. (One answered after the window
    /// turned is a small lease in the next one; spending it asks for the
    /// whole pace again.)
    pub(crate) fn renewal_units(&self, pace: u64, expires_ms: u64, held: u64, now: u64) -> u64 {
        let Some(interval_ms) = self.window_bound_interval_ms else {
            return pace;
        };
        let time_left = expires_ms.saturating_sub(now);
        if time_left >= interval_ms {
            return pace;
        }
        // interval_ms > time_left >= 0: no division by zero.
        let spent_before_end =
            (u128::from(pace) * u128::from(time_left)).div_ceil(u128::from(interval_ms));
        u64::try_from(spent_before_end.saturating_sub(u128::from(held)))
            .map_or(pace, |u| u.min(pace))
    }
}

/// What a request gets from its check's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    /// Admitted from the lease, with a draw for this worker (its `left`
    /// units remain after the request).
    Hit(Draw),
    /// A hit that found its lease running low (half of it left in
    /// the slot): the worker asks for the next one now, for `units`, so
    /// that the check's requests never wait for it; `held` is what the
    /// lease still has, the draw's units and the slot's (how long they
    /// last at the check's pace says when the renewal must go).
    Renew { draw: Draw, units: u64, held: u64 },
    /// No usable lease: call, asking for `want` more units (0: none).
    Miss { want: u64 },
    /// The slot holds another check's units: try the check's other slot.
    Occupied,
}

/// A lease as granted, to install.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub lease_id: u64,
    pub units: u64,
    pub expires_ms: u64,
    pub reset_at_ms: u64,
    /// A renewal's: it may replace a lease that still has units (they go
    /// back with the replaced lease, by its owner).
    pub renewal: bool,
    /// What meshlimitd had left on the tightest limit once it granted
    /// the units (see [`plenty_beyond`] and [`Slot::rest`]).
    pub beyond: u64,
    /// Its units still count in a window once it has expired (a longer
    /// limit's, a sliding window's, a token bucket's): dropped from the
    /// slot before its owner gives them back, they are counted.
    pub outlives_expiry: bool,
}

/// What the granting worker's tick found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reclaim {
    /// The lease is live and in use: it cannot be due before `until_ms`
    /// (a hit only puts that later) unless it is replaced first (see
    /// [`Lease::due_from`]); look again then.
    Keep { until_ms: u64 },
    /// The lease is spent or replaced: nothing to give back.
    Gone,
    /// Expired or idle: these units are taken out of the slot and go back.
    Back { units: u64, expired: bool },
}

/// What a worker gets from its check's slots: what the request gets, the
/// draw the worker still holds (the one it brought, when the store failed:
/// it is put back later), and the slot it was decided in (where a grant
/// for an ask goes).
pub(crate) type Taken = (Take, Option<Draw>, Place);

/// The lease slots of one Envoy, through a shared store.
pub(crate) struct Leases<'s, S: SharedStore> {
    pub config: LeaseConfig,
    pub seed: (u64, u64),
    pub store: &'s S,
    pub keys: &'s Keys,
    /// The worker's count of units dropped (see [`Slot::dropped_units`]),
    /// added to as each slot that dropped some is written.
    pub dropped: &'s Cell<u64>,
}

/// Where a check's lease lives: its fingerprint, its slot, and the slot
/// it uses when another check's units hold the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub fingerprint: u64,
    pub slot: u64,
    pub alternate: u64,
}

impl<S: SharedStore> Leases<'_, S> {
    /// The place of the check made of `limits` (each limit's whole
    /// definition, subject and shadow flag) for `subject`.
    pub fn place(&self, limits: &impl std::hash::Hash, subject: &str) -> Place {
        let fingerprint = store::fingerprint(self.seed, Purpose::Lease, limits, subject);
        let slot = store::slot(fingerprint, self.config.slots);
        // Another part of the fingerprint; never the first slot (with two
        // slots or more).
        let slots = u64::from(self.config.slots.max(1));
        let step =
            1 + store::slot(fingerprint.rotate_left(32), self.config.slots) % (slots - 1).max(1);
        Place {
            fingerprint,
            slot,
            alternate: (slot + step) % slots,
        }
    }

    /// A request of `cost` on the busy check at `place`, which would ask
    /// for `want` units, from a worker that brings `previous` (its last
    /// draw of the check). The check's slot is tried first (the draw's
    /// own, when there is one), then its alternate when another check's
    /// units hold the first: two choices keep checks whose slots collide
    /// from refusing each other leases. A store that fails or stays
    /// contended gives a miss without an ask (the request calls), and
    /// `previous` back.
    pub fn take(
        &self,
        place: Place,
        cost: u64,
        now: u64,
        want: u64,
        ask_for: AskFor,
        previous: Option<Draw>,
    ) -> Taken {
        let mut order = [place.slot, place.alternate];
        if previous.is_some_and(|d| d.slot == place.alternate) {
            order.reverse();
        }
        let mut carried = previous;
        for slot in order {
            let at = Place { slot, ..place };
            let here = carried.filter(|d| d.slot == slot);
            match self.take_at(at, cost, now, want, ask_for, here.as_ref()) {
                Err(_) => return (Take::Miss { want: 0 }, carried, place),
                // The draw's lease is no longer in its slot: nowhere to go.
                Ok(Take::Occupied) if here.is_some() => {
                    let lost = here.filter(|d| d.outlives_expiry).map_or(0, |d| d.left);
                    self.note_dropped(lost);
                    carried = None;
                }
                Ok(Take::Occupied) => {}
                Ok(take) => {
                    let kept = carried.filter(|d| d.slot != slot);
                    return (take, kept, at);
                }
            }
        }
        (Take::Miss { want: 0 }, carried, place)
    }

    /// Writes `slot` at `key` (compare-and-swap with `cas`), counting what
    /// the operation that made it dropped once it is written.
    fn write(&self, key: &str, slot: &Slot, cas: Option<u32>) -> Result<(), StoreError> {
        self.store.set(key, &slot.encode(), cas)?;
        self.note_dropped(slot.dropped_units);
        Ok(())
    }

    fn note_dropped(&self, units: u64) {
        self.dropped.set(self.dropped.get().saturating_add(units));
    }

    /// [`Leases::take`] in one slot.
    fn take_at(
        &self,
        at: Place,
        cost: u64,
        now: u64,
        want: u64,
        ask_for: AskFor,
        previous: Option<&Draw>,
    ) -> Result<Take, StoreError> {
        let key = self.keys.lease_slot(at.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            let (slot, take) =
                Slot::decode(bytes.as_deref()).take(at, cost, now, want, ask_for, previous);
            if let Some(slot) = slot {
                self.write(&key, &slot, cas)?;
            }
            Ok(take)
        })
    }

    /// Accounts for a worker's draw in its slot.
    pub fn put_back(&self, draw: &Draw) -> Result<(), StoreError> {
        let key = self.keys.lease_slot(draw.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            match Slot::decode(bytes.as_deref()).put_back(draw) {
                Some(slot) => self.write(&key, &slot, cas),
                None => Ok(()),
            }
        })
    }

    /// The units the slot of `place` holds for its check, after a later
    /// answer said meshlimitd had `fresh` left beyond the leases (see
    /// [`Slot::heard`]); `None` when it holds no usable lease of the
    /// check, or the store failed.
    pub fn heard(&self, place: Place, fresh: u64, now: u64) -> Option<u64> {
        let key = self.keys.lease_slot(place.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            let (slot, held) = Slot::decode(bytes.as_deref()).heard(place.fingerprint, fresh, now);
            if let Some(slot) = slot {
                self.write(&key, &slot, cas)?;
            }
            Ok(held)
        })
        .ok()
        .flatten()
    }

    /// Installs a grant; false when it must go back at once.
    pub fn install(&self, place: Place, grant: Grant, now: u64) -> bool {
        let key = self.keys.lease_slot(place.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            match Slot::decode(bytes.as_deref()).install(place.fingerprint, grant, now) {
                Some(slot) => self.write(&key, &slot, cas).map(|()| true),
                None => Ok(false),
            }
        })
        .unwrap_or(false)
    }

    /// Ends the current lease at `place` (see [`Slot::revoke`]); false
    /// when there was none to end, or the store failed.
    pub fn revoke(&self, place: Place, now: u64) -> bool {
        let key = self.keys.lease_slot(place.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            match Slot::decode(bytes.as_deref()).revoke(place.fingerprint, now) {
                Some(slot) => self.write(&key, &slot, cas).map(|()| true),
                None => Ok(false),
            }
        })
        .unwrap_or(false)
    }

    /// Takes an expired or idle lease's units out of its slot.
    pub fn reclaim(&self, slot: u64, lease_id: u64, now: u64) -> Result<Reclaim, StoreError> {
        self.reclaim_idle_for(slot, lease_id, now, self.config.interval_ms)
    }

    /// As [`Leases::reclaim`] for an owner going away: a lease with no
    /// draw out is due however recent its last hit (one with draws out
    /// still waits for them).
    pub fn reclaim_now(&self, slot: u64, lease_id: u64, now: u64) -> Result<Reclaim, StoreError> {
        self.reclaim_idle_for(slot, lease_id, now, 0)
    }

    fn reclaim_idle_for(
        &self,
        slot: u64,
        lease_id: u64,
        now: u64,
        idle_ms: u64,
    ) -> Result<Reclaim, StoreError> {
        let key = self.keys.lease_slot(slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            let (slot, reclaim) = Slot::decode(bytes.as_deref()).reclaim(lease_id, now, idle_ms);
            if let Some(slot) = slot {
                self.write(&key, &slot, cas)?;
            }
            Ok(reclaim)
        })
    }
}
