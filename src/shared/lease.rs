//! Quota leases in shared data: units meshlimitd charged in Redis ahead of
//! time, for this Envoy to admit a busy client's requests without a call.
//!
//! A lease belongs to one check (a subject and the limits its requests
//! match) and lives in one of a fixed set of slots, found by a keyed
//! fingerprint as the fallback counters are, and shared by every worker.
//! Each worker also observes, in its own memory ([`Observer`]), how many
//! units each check asked for in the last interval: that rate sizes the
//! next lease, so a cold client (one request per interval) never gets one,
//! and costs no shared-data access at all, and a busy one gets about an
//! interval's worth. The slot's life:
//!
//! - [`Slot::take`] on each request: a live lease with room admits it (a
//!   hit: no pause, no call); otherwise the request calls, asking for a
//!   lease when its check is busy and no other ask is out.
//! - [`Slot::install`] when an answer grants units: only into a slot that
//!   holds no units, so units are never merged across windows or lost.
//! - [`Slot::reclaim`] on the granting worker's tick: a lease that expired
//!   or went idle gives its units back (the worker sends them to meshlimitd
//!   as a settlement at 0, in the very counter and window they came from).
//!
//! Every unit was charged in Redis before any request used it, so leases
//! never admit more than the limit; what they can cost is admitting less
//! for a while (units held here while another replica is refused), at most
//! the units outstanding, which returns and the lease's bound (half of what
//! is left over `local.expected_replicas`) keep small.

use super::keys;
use super::store::{self, le_word, le_words, retry_on_conflict, Purpose, SharedStore, StoreError};
use crate::config::LeaseConfig;

/// Words per slot.
const WORDS: usize = 7;
/// An owner takes an expired lease's units back on its next tick (250 ms
/// at most); units still there this long after the expiry have none.
const ABANDONED_AFTER_MS: u64 = 2_000;
/// A clock this far behind a lease's last use stepped back: the lease is
/// treated as expired (its window can no longer be told from the clock).
const CLOCK_SLACK_MS: u64 = 100;

/// One slot's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Slot {
    /// Whose slot it is (0: free).
    fingerprint: u64,
    /// The lease in it, chosen by the worker that installed it (0: none).
    lease_id: u64,
    /// Units left.
    units: u64,
    /// After this the lease admits nothing (the end of its window, or of
    /// a token bucket's interval).
    expires_ms: u64,
    /// When the most constraining limit's window is whole again (headers).
    reset_at_ms: u64,
    /// The last request admitted from the lease (idle leases go back).
    last_hit_ms: u64,
    /// A lease ask is out until then: other workers call without asking.
    asking_until_ms: u64,
}

/// What one worker saw of one check: units asked in the current
/// observation interval and in the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Seen {
    fingerprint: u64,
    interval_start_ms: u64,
    seen: u64,
    seen_before: u64,
}

/// A worker's view of how busy each check is: a direct-mapped table in
/// the worker's own memory (a check whose entry another one took starts
/// over, as a cold check), so watching every request costs no hostcall.
pub(crate) struct Observer {
    entries: Vec<Seen>,
}

impl Observer {
    pub(crate) fn new(entries: u32) -> Observer {
        Observer {
            entries: vec![Seen::default(); entries.max(1) as usize],
        }
    }

    /// Counts a request of `cost` units of the check `fingerprint`; the
    /// units to ask for when the check is busy (another request in this
    /// interval or the last one, two units or more in one of them: about
    /// one interval's worth), else 0.
    pub(crate) fn observe(
        &mut self,
        fingerprint: u64,
        cost: u64,
        now: u64,
        config: &LeaseConfig,
    ) -> u64 {
        let len = self.entries.len() as u64;
        let Some(e) = self.entries.get_mut((fingerprint % len.max(1)) as usize) else {
            return 0;
        };
        if e.fingerprint != fingerprint {
            *e = Seen {
                fingerprint,
                interval_start_ms: now,
                ..Seen::default()
            };
        }
        let since = now.saturating_sub(e.interval_start_ms);
        if since >= config.interval_ms {
            e.seen_before = if since < 2 * config.interval_ms {
                e.seen
            } else {
                0
            };
            e.seen = 0;
            e.interval_start_ms = now;
        }
        e.seen = e.seen.saturating_add(cost);
        let rate = e.seen.max(e.seen_before);
        let busy = (e.seen > cost || e.seen_before > 0) && rate >= 2;
        if busy {
            rate.min(config.max_units)
        } else {
            0
        }
    }
}

/// What a request gets from its check's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    /// Admitted from the lease: `left` units remain in it, and the window
    /// is whole again at `reset_at_ms`.
    Hit { left: u64, reset_at_ms: u64 },
    /// No usable lease: call, asking for `want` more units (0: none).
    Miss { want: u64 },
}

/// A lease as granted, to install.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub lease_id: u64,
    pub units: u64,
    pub expires_ms: u64,
    pub reset_at_ms: u64,
}

/// What the granting worker's tick found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reclaim {
    /// The lease is live and in use: look again later.
    Keep,
    /// The lease is spent or replaced: nothing to give back.
    Gone,
    /// Expired or idle: these units are taken out of the slot and go back.
    Back { units: u64, expired: bool },
}

impl Slot {
    /// Whether units are in the slot that someone may still use or give
    /// back. A lease expired for [`ABANDONED_AFTER_MS`] whose units nobody
    /// took back has lost its owner (the worker was replaced by a
    /// configuration push): its slot is free again.
    fn holds_units(&self, now: u64) -> bool {
        self.lease_id != 0
            && self.units > 0
            && now < self.expires_ms.saturating_add(ABANDONED_AFTER_MS)
    }

    /// Whether the lease may admit at `now`: not expired, and the clock
    /// has not stepped back past its last use.
    fn usable(&self, now: u64) -> bool {
        self.lease_id != 0
            && now < self.expires_ms
            && now.saturating_add(CLOCK_SLACK_MS) >= self.last_hit_ms
    }

    /// The slot after a busy check's request of `cost` (`want`: the units
    /// it would ask for), and what the request gets. `None` for the slot:
    /// nothing to write.
    pub(crate) fn take(
        mut self,
        fingerprint: u64,
        cost: u64,
        now: u64,
        want: u64,
        ask_for_ms: u64,
    ) -> (Option<Slot>, Take) {
        if self.fingerprint != fingerprint {
            if self.holds_units(now) {
                // Another check's units: its owner gives them back first.
                return (None, Take::Miss { want: 0 });
            }
            self = Slot {
                fingerprint,
                ..Slot::default()
            };
        }
        if self.usable(now) && self.units >= cost {
            self.units -= cost;
            self.last_hit_ms = now;
            let take = Take::Hit {
                left: self.units,
                reset_at_ms: self.reset_at_ms,
            };
            return (Some(self), take);
        }
        if want == 0 || now < self.asking_until_ms {
            // One ask at a time.
            return (None, Take::Miss { want: 0 });
        }
        self.asking_until_ms = now + ask_for_ms;
        (Some(self), Take::Miss { want })
    }

    /// The slot with `grant` installed, or `None` when it still holds
    /// units (another worker's lease, or this check's, not yet given
    /// back): the grant must then go back at once.
    pub(crate) fn install(mut self, fingerprint: u64, grant: Grant, now: u64) -> Option<Slot> {
        if self.holds_units(now) {
            return None;
        }
        if self.fingerprint != fingerprint {
            self = Slot {
                fingerprint,
                ..Slot::default()
            };
        }
        self.lease_id = grant.lease_id;
        self.units = grant.units;
        self.expires_ms = grant.expires_ms;
        self.reset_at_ms = grant.reset_at_ms;
        self.last_hit_ms = now;
        self.asking_until_ms = 0;
        Some(self)
    }

    /// What becomes of lease `lease_id` at `now`: expired, or unused for
    /// `idle_ms`, its units are taken out (the slot to write is returned).
    pub(crate) fn reclaim(
        mut self,
        lease_id: u64,
        now: u64,
        idle_ms: u64,
    ) -> (Option<Slot>, Reclaim) {
        if self.lease_id != lease_id || self.units == 0 {
            return (None, Reclaim::Gone);
        }
        let expired = !self.usable(now);
        if !expired && now.saturating_sub(self.last_hit_ms) < idle_ms {
            return (None, Reclaim::Keep);
        }
        let units = self.units;
        self.units = 0;
        self.lease_id = 0;
        (Some(self), Reclaim::Back { units, expired })
    }

    fn decode(bytes: Option<&[u8]>) -> Slot {
        let Some(bytes) = bytes else {
            return Slot::default();
        };
        let w = |i| le_word(bytes, i).unwrap_or(0);
        Slot {
            fingerprint: w(0),
            lease_id: w(1),
            units: w(2),
            expires_ms: w(3),
            reset_at_ms: w(4),
            last_hit_ms: w(5),
            asking_until_ms: w(6),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let words: [u64; WORDS] = [
            self.fingerprint,
            self.lease_id,
            self.units,
            self.expires_ms,
            self.reset_at_ms,
            self.last_hit_ms,
            self.asking_until_ms,
        ];
        le_words(&words)
    }
}

/// The lease slots of one Envoy, through a shared store.
pub(crate) struct Leases<'s, S: SharedStore> {
    pub config: LeaseConfig,
    pub seed: (u64, u64),
    pub store: &'s S,
}

/// Where a check's lease lives: its fingerprint and slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub fingerprint: u64,
    pub slot: u64,
}

impl<S: SharedStore> Leases<'_, S> {
    /// The place of the check made of `limits` (each limit's whole
    /// definition, subject and shadow flag) for `subject`.
    pub fn place(&self, limits: &impl std::hash::Hash, subject: &str) -> Place {
        let fingerprint = store::fingerprint(self.seed, Purpose::Lease, limits, subject);
        Place {
            fingerprint,
            slot: store::slot(fingerprint, self.config.slots),
        }
    }

    /// A request of `cost` on the busy check at `place`, which would ask
    /// for `want` units. A store that fails or stays contended gives a miss
    /// without an ask: the request calls.
    pub fn take(&self, place: Place, cost: u64, now: u64, want: u64, ask_for_ms: u64) -> Take {
        let key = keys::lease_slot(place.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            let (slot, take) =
                Slot::decode(bytes.as_deref()).take(place.fingerprint, cost, now, want, ask_for_ms);
            if let Some(slot) = slot {
                self.store.set(&key, &slot.encode(), cas)?;
            }
            Ok(take)
        })
        .unwrap_or(Take::Miss { want: 0 })
    }

    /// Installs a grant; false when it must go back at once.
    pub fn install(&self, place: Place, grant: Grant, now: u64) -> bool {
        let key = keys::lease_slot(place.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            match Slot::decode(bytes.as_deref()).install(place.fingerprint, grant, now) {
                Some(slot) => self.store.set(&key, &slot.encode(), cas).map(|()| true),
                None => Ok(false),
            }
        })
        .unwrap_or(false)
    }

    /// Takes an expired or idle lease's units out of its slot.
    pub fn reclaim(&self, slot: u64, lease_id: u64, now: u64) -> Result<Reclaim, StoreError> {
        let key = keys::lease_slot(slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            let (slot, reclaim) =
                Slot::decode(bytes.as_deref()).reclaim(lease_id, now, self.config.interval_ms);
            if let Some(slot) = slot {
                self.store.set(&key, &slot.encode(), cas)?;
            }
            Ok(reclaim)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: LeaseConfig = LeaseConfig {
        slots: 16,
        max_units: 1000,
        interval_ms: 1000,
        share: 2,
    };

    fn take(slot: Slot, fp: u64, now: u64) -> (Slot, Take) {
        let (next, take) = slot.take(fp, 1, now, 8, 100);
        (next.unwrap_or(slot), take)
    }

    fn grant(units: u64, expires_ms: u64) -> Grant {
        Grant {
            lease_id: 7,
            units,
            expires_ms,
            reset_at_ms: expires_ms,
        }
    }

    #[test]
    fn a_cold_check_asks_for_nothing_and_a_busy_one_for_its_rate() {
        let mut seen = Observer::new(64);
        assert_eq!(seen.observe(1, 1, 10, &CONFIG), 0);
        assert_eq!(seen.observe(1, 1, 20, &CONFIG), 2);
        assert_eq!(seen.observe(1, 1, 30, &CONFIG), 3);
        // The next interval asks for the last one's count until it is
        // busier itself.
        assert_eq!(seen.observe(1, 1, 1_020, &CONFIG), 3);
        // One request is never busy, whatever its cost.
        assert_eq!(seen.observe(2, 50, 10, &CONFIG), 0);
        // A check seen once an interval stays cold.
        for i in 0..5 {
            assert_eq!(seen.observe(3, 1, 10 + i * 1500, &CONFIG), 0);
        }
        // Asks are bounded.
        assert_eq!(seen.observe(2, 5_000, 20, &CONFIG), 1000);
    }

    #[test]
    fn one_ask_at_a_time_per_slot() {
        let (slot, t) = take(Slot::default(), 1, 20);
        assert_eq!(t, Take::Miss { want: 8 });
        let (slot, t) = take(slot, 1, 30);
        assert_eq!(t, Take::Miss { want: 0 });
        // The ask expired unanswered: ask again.
        let (_, t) = take(slot, 1, 200);
        assert_eq!(t, Take::Miss { want: 8 });
        // Not busy: nothing to write.
        assert_eq!(
            Slot::default().take(1, 1, 20, 0, 100),
            (None, Take::Miss { want: 0 })
        );
    }

    #[test]
    fn a_lease_admits_until_it_is_empty_or_expired() {
        let slot = Slot::default().install(1, grant(2, 500), 10).unwrap();
        let (slot, t) = take(slot, 1, 20);
        assert_eq!(
            t,
            Take::Hit {
                left: 1,
                reset_at_ms: 500
            }
        );
        let (slot, t) = take(slot, 1, 30);
        assert!(matches!(t, Take::Hit { left: 0, .. }));
        let (slot, t) = take(slot, 1, 40);
        assert!(matches!(t, Take::Miss { want } if want > 0));
        let full = Slot::default().install(1, grant(5, 500), 10).unwrap();
        let (_, t) = take(full, 1, 500);
        assert!(matches!(t, Take::Miss { .. }), "expired at 500");
        // A cost above what is left calls.
        let (_, t) = full.take(1, 6, 20, 8, 100);
        assert!(matches!(t, Take::Miss { .. }));
        assert_eq!(slot.units, 0);
    }

    #[test]
    fn units_are_never_overwritten_by_another_check_or_another_grant() {
        let slot = Slot::default().install(1, grant(5, 500), 10).unwrap();
        let (next, t) = slot.take(2, 1, 20, 8, 100);
        assert_eq!((next, t), (None, Take::Miss { want: 0 }));
        assert_eq!(slot.install(2, grant(3, 500), 20), None);
        assert_eq!(slot.install(1, grant(3, 500), 20), None);
        // Spent, the slot takes a new grant (for any check).
        let spent = Slot { units: 0, ..slot };
        let next = spent.install(2, grant(3, 900), 20).unwrap();
        assert_eq!((next.fingerprint, next.units), (2, 3));
    }

    #[test]
    fn expired_or_idle_leases_give_their_units_back_once() {
        let slot = Slot::default().install(1, grant(5, 5000), 10).unwrap();
        assert_eq!(slot.reclaim(7, 500, 1000), (None, Reclaim::Keep));
        assert_eq!(slot.reclaim(8, 500, 1000), (None, Reclaim::Gone));
        let (next, r) = slot.reclaim(7, 1010, 1000);
        assert_eq!(
            r,
            Reclaim::Back {
                units: 5,
                expired: false
            }
        );
        let next = next.unwrap();
        assert_eq!(next.reclaim(7, 1020, 1000).1, Reclaim::Gone);
        let (_, r) = slot.reclaim(7, 5000, 1000);
        assert_eq!(
            r,
            Reclaim::Back {
                units: 5,
                expired: true
            }
        );
        // A hit keeps it from going idle.
        let (hit, _) = take(slot, 1, 900);
        assert_eq!(hit.reclaim(7, 1500, 1000).1, Reclaim::Keep);
    }

    #[test]
    fn units_whose_owner_is_gone_free_their_slot_after_expiry() {
        let slot = Slot::default().install(1, grant(5, 500), 10).unwrap();
        assert_eq!(
            slot.install(1, grant(3, 900), 600),
            None,
            "its owner may still return them"
        );
        let next = slot.install(1, grant(3, 5_000), 2_500).unwrap();
        assert_eq!(next.units, 3);
        let (next, _) = slot.take(2, 1, 2_500, 8, 100);
        assert!(next.is_some(), "another check may take the slot");
    }

    #[test]
    fn a_clock_stepping_back_ends_a_lease() {
        let slot = Slot::default()
            .install(1, grant(5, 60_000), 10_000)
            .unwrap();
        let (_, t) = take(slot, 1, 9_950);
        assert!(matches!(t, Take::Hit { .. }), "a little skew is fine");
        let (_, t) = take(slot, 1, 5_000);
        assert!(matches!(t, Take::Miss { .. }));
        let (_, r) = slot.reclaim(7, 5_000, 1000);
        assert_eq!(
            r,
            Reclaim::Back {
                units: 5,
                expired: true
            }
        );
    }

    #[test]
    fn slots_round_trip_and_short_values_read_as_zero() {
        let slot = Slot::default().install(3, grant(9, 800), 10).unwrap();
        assert_eq!(Slot::decode(Some(&slot.encode())), slot);
        assert_eq!(Slot::decode(Some(&[1, 2, 3])), Slot::default());
    }
}
