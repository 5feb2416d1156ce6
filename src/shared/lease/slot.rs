//! One slot of shared data: the check it is for, its ask, up to three
//! leases and the units of ended ones owed to their owners, with the rules
//! for drawing, installing and reclaiming units.

use super::store::{le_word, le_words};
use super::*;

/// One lease in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Lease {
    /// Chosen by the worker that installed it (0: none).
    pub(super) lease_id: u64,
    /// Units left in the slot.
    pub(super) units: u64,
    /// Units granted (a renewal is asked once half of them is left: time
    /// for it to wait for the tick, and for its call).
    pub(super) granted: u64,
    /// Units workers drew and have not accounted for yet (spent, or put
    /// back): the lease is not given back while any are out.
    pub(super) lent: u64,
    /// After this the lease admits nothing (the end of its window, or of
    /// a token bucket's interval).
    pub(super) expires_ms: u64,
    /// When the most constraining limit's window is whole again (headers).
    pub(super) reset_at_ms: u64,
    /// The last draw from the lease (idle leases go back).
    pub(super) last_hit_ms: u64,
    /// What meshlimitd had left on the check's tightest limit once it
    /// granted this lease: the client's beyond every lease charged until
    /// then (`RateLimit` on a hit counts it; see [`Slot::rest`]).
    pub(super) beyond: u64,
    /// Its units still count in a window once it has expired (a longer
    /// limit's, a sliding window's, a token bucket's), so that units the
    /// slot drops before its owner gives them back stay charged there
    /// (see [`Slot::dropped_units`]). A lease whose expiry ends every
    /// window it was charged in owes nothing once expired.
    pub(super) outlives_expiry: bool,
}

/// One slot's state: the check it is for, up to three leases, and ended
/// ones whose units their owners have yet to take out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Slot {
    /// Whose slot it is (0: free).
    pub(super) fingerprint: u64,
    /// A lease ask is out until then: other workers call without asking.
    pub(super) asking_until_ms: u64,
    /// The lease workers draw from.
    pub(super) current: Lease,
    /// The lease a grant replaced while workers still held draws of it:
    /// nobody draws from it; it waits for those draws to be accounted for,
    /// then its owner gives back whatever they left.
    pub(super) previous: Lease,
    /// A renewal's lease, granted while the current one still had units:
    /// it becomes current once they are spent.
    pub(super) next: Lease,
    /// Ended leases that gave `previous` to a newer one while they still
    /// held units (left unused, or drawn and not put back yet): nobody
    /// draws from them; draws put back late land here, and each owner's
    /// tick takes its lease's units out, to give back to the windows that
    /// still count them (see [`Slot::set_current_aside`]). Only a lease's
    /// id, units, lent units, expiry and whether its units outlive it are
    /// kept (see [`OWED_WORDS`]).
    pub(super) owed: [Lease; OWED],
    /// Not in shared data: the units of leases that outlive their expiry
    /// which the operations on this value since it was read had to drop
    /// (an ended
    /// lease giving way while both owed places hold units, one abandoned
    /// past [`ABANDONED_AFTER_MS`], a draw put back with its lease gone).
    /// They stay charged in the windows that count them until those end:
    /// fewer admitted, never more. The store helper adds them to the
    /// worker's `lease_units_dropped` once the slot is written.
    pub(super) dropped_units: u64,
}

/// The units lost when `lease` is overwritten: any it still holds, when a
/// window still counts them (see [`Lease::outlives_expiry`]). A lease
/// that holds units is overwritten only once it has ended and no place
/// is left for it, or it was abandoned.
fn units_lost(lease: &Lease) -> u64 {
    if lease.lease_id != 0 && lease.outlives_expiry {
        lease.units
    } else {
        0
    }
}

/// Writes `with` over the lease in `place`; the units that loses.
fn overwrite(place: &mut Lease, with: Lease) -> u64 {
    let lost = units_lost(place);
    *place = with;
    lost
}

impl Lease {
    /// Whether meshlimitd had plenty left beyond this lease when it
    /// granted it ([`plenty_beyond`]): workers draw half of it to its last
    /// units, as a worker refused for what another holds would still be
    /// admitted.
    pub(super) fn plenty(&self) -> bool {
        plenty_beyond(self.granted, self.beyond)
    }

    /// Whether it holds units someone may still use or give back. A lease
    /// expired for [`ABANDONED_AFTER_MS`] whose units nobody took back has
    /// lost its owner (the worker was replaced by a configuration push).
    pub(super) fn holds_units(&self, now: u64) -> bool {
        self.lease_id != 0
            && (self.units > 0 || self.lent > 0)
            && now < self.expires_ms.saturating_add(ABANDONED_AFTER_MS)
    }

    /// Whether it may admit at `now`: not expired, and the clock has not
    /// stepped back past its last use.
    pub(super) fn usable(&self, now: u64) -> bool {
        self.lease_id != 0 && live(now, self.expires_ms, self.last_hit_ms)
    }

    /// Accounts for a worker's draw of this lease: its unused units are
    /// the lease's again. False when the draw is of another lease.
    pub(super) fn settle(&mut self, draw: &Draw) -> bool {
        if draw.lease_id == 0 || draw.lease_id != self.lease_id {
            return false;
        }
        self.units = self.units.saturating_add(draw.left);
        self.lent = self.lent.saturating_sub(draw.drawn);
        // Its hits were uses of the lease: it was not idle meanwhile.
        self.last_hit_ms = self.last_hit_ms.max(draw.last_hit_ms);
        true
    }

    /// Whether its owner gives it back at `now`: expired, idle for
    /// `idle_ms` (or replaced: `draining`) with no draw out, or expired
    /// for [`DRAWS_BACK_WITHIN_MS`] with draws still out.
    pub(super) fn due(&self, now: u64, idle_ms: u64, draining: bool) -> bool {
        let expired = !self.usable(now);
        if self.lent > 0 {
            expired && now >= self.expires_ms.saturating_add(DRAWS_BACK_WITHIN_MS)
        } else {
            expired || draining || now.saturating_sub(self.last_hit_ms) >= idle_ms
        }
    }

    /// The earliest time after `now` that [`Lease::due`] can hold: its
    /// expiry, or an interval after its last hit, whichever comes first (a
    /// draw put back may move the last hit later, never earlier). With
    /// draws out, the slot's last hit is often long past (workers hit from
    /// their draws), but a draw still out was hit within about two ticks
    /// (its worker puts it back on the first tick a tick after its last
    /// hit): idle no sooner than half an interval from now either. A lease waiting aside for its draws is due once they
    /// are back, whenever that is: now.
    pub(super) fn due_from(&self, now: u64, idle_ms: u64, draining: bool) -> u64 {
        if draining {
            return now;
        }
        let mut idle_at = self.last_hit_ms.saturating_add(idle_ms);
        if self.lent > 0 {
            idle_at = idle_at.max(now.saturating_add(idle_ms / 2));
        }
        self.expires_ms.min(idle_at)
    }
}

impl Slot {
    pub(super) fn holds_units(&self, now: u64) -> bool {
        [&self.current, &self.previous, &self.next]
            .into_iter()
            .chain(&self.owed)
            .any(|l| l.holds_units(now))
    }

    /// Makes the next lease current, once the current one can serve no
    /// more (spent, expired, or too little for `cost`). False when there is
    /// no next lease, or the current one must wait aside for its draws
    /// while an older one still does.
    pub(super) fn promote(&mut self, cost: u64, now: u64) -> bool {
        let current_serves = self.current.usable(now) && self.current.units >= cost;
        if current_serves || self.next.lease_id == 0 || !self.next.usable(now) {
            return false;
        }
        if !self.set_current_aside(now) {
            return false;
        }
        let lost = overwrite(&mut self.current, self.next);
        self.add_dropped(lost);
        self.next = Lease::default();
        true
    }

    /// Frees `current` for a new lease: one that still holds units (draws
    /// out, or units its owner has not taken back) waits aside in
    /// `previous` for them. False when that place is taken by a lease
    /// that is still live.
    ///
    /// A lease in `previous` that has ended gives way, and waits among
    /// the [`Slot::owed`] for its owner. Leases of a fixed window all end
    /// with it, a busy client's two often together (the one in use and
    /// the spent one whose draws are out), and their owners take them out
    /// only on their next tick: if they kept the place, every grant until
    /// then would go back (charged and refunded for nothing) and the
    /// client would call per request. Yet what an ended lease holds may
    /// still count in a window: a longer limit's, a sliding window's (the
    /// next window weighs this one), a token bucket's.
    /// Once set aside, `current` is empty; when it holds no units it is
    /// left for the caller to overwrite.
    pub(super) fn set_current_aside(&mut self, now: u64) -> bool {
        if !self.current.holds_units(now) {
            return true;
        }
        if self.previous.holds_units(now) {
            if self.previous.usable(now) {
                return false;
            }
            let ended = std::mem::take(&mut self.previous);
            self.owe(ended, now);
        }
        let aside = std::mem::take(&mut self.current);
        let lost = overwrite(&mut self.previous, aside);
        self.add_dropped(lost);
        true
    }

    /// Keeps the ended `lease` for its owner, in a place that holds no
    /// units, or else the one that ended first: that lease's units are
    /// lost to the windows still counting them (fewer admitted, never
    /// more). About one lease gives way at each of a busy client's
    /// boundaries, so [`OWED`] places cover owners' ticks that many
    /// boundaries late.
    fn owe(&mut self, lease: Lease, now: u64) {
        let free = self.owed.iter().position(|l| !l.holds_units(now));
        let place = free.unwrap_or_else(|| {
            self.owed
                .iter()
                .enumerate()
                .min_by_key(|(_, l)| l.expires_ms)
                .map_or(0, |(i, _)| i)
        });
        if let Some(place) = self.owed.get_mut(place) {
            let lost = overwrite(place, lease);
            self.add_dropped(lost);
        }
    }

    /// A fresh slot for check `fingerprint` in place of this one, which
    /// holds no units anyone will take out (free, or its leases spent or
    /// abandoned: those units are dropped).
    fn fresh_for(&self, fingerprint: u64) -> Slot {
        let all = [&self.current, &self.previous, &self.next]
            .into_iter()
            .chain(&self.owed);
        Slot {
            fingerprint,
            dropped_units: all
                .map(units_lost)
                .fold(self.dropped_units, u64::saturating_add),
            ..Slot::default()
        }
    }

    /// Accounts for `draw` whose lease is no longer here: its units left
    /// are dropped. True when that loses units a window still counts.
    fn drop_draw(&mut self, draw: &Draw) -> bool {
        let lost = if draw.outlives_expiry { draw.left } else { 0 };
        self.add_dropped(lost);
        lost > 0
    }

    fn add_dropped(&mut self, units: u64) {
        self.dropped_units = self.dropped_units.saturating_add(units);
    }

    /// Accounts for `draw` in whichever lease it came from. A draw of a
    /// lease no longer here has nowhere to go (see [`Slot::drop_draw`]).
    /// True when the slot changed.
    pub(super) fn settle(&mut self, draw: &Draw) -> bool {
        [&mut self.current, &mut self.previous]
            .into_iter()
            .chain(&mut self.owed)
            .any(|l| l.settle(draw))
    }

    /// What the client has left beyond the draws out, as this slot knows
    /// it at `now`: the units of its usable current and next leases, and
    /// what meshlimitd had beyond them at the latest of their grants (the
    /// next lease's, granted after the current one was charged). Through
    /// one worker that is exactly what the client can still do; what other
    /// workers or replicas admitted since that grant it does not see, nor
    /// what they hold (see docs/leases.md, "Headers").
    pub(super) fn rest(&self, now: u64) -> u64 {
        let current = Some(&self.current).filter(|l| l.usable(now));
        let next = Some(&self.next).filter(|l| l.usable(now));
        let beyond = next.or(current).map_or(0, |l| l.beyond);
        [current, next]
            .into_iter()
            .flatten()
            .fold(beyond, |sum, l| sum.saturating_add(l.units))
    }

    /// The units this slot's usable leases of check `fingerprint` hold,
    /// once a later answer of meshlimitd says it had `fresh` left beyond
    /// every lease then: the leases' "beyond" is lowered to it (never
    /// raised: an answer older than a grant says more). A request whose
    /// call a renewal's grant preceded in the same batch (the renewal's
    /// script ran first, before the request's own unit) counts these
    /// units, and the hits after it count the lowered "beyond" (see
    /// [`Slot::rest`]). `None` when the slot holds no usable lease of the
    /// check; the slot, when it changed.
    pub(crate) fn heard(
        mut self,
        fingerprint: u64,
        fresh: u64,
        now: u64,
    ) -> (Option<Slot>, Option<u64>) {
        if self.fingerprint != fingerprint {
            return (None, None);
        }
        let mut changed = false;
        for lease in [&mut self.current, &mut self.next] {
            if lease.usable(now) && fresh < lease.beyond {
                lease.beyond = fresh;
                changed = true;
            }
        }
        let usable = [self.current, self.next].map(|l| l.usable(now).then_some(l.units));
        if usable == [None, None] {
            return (None, None);
        }
        let held = usable.into_iter().flatten().sum();
        (changed.then_some(self), Some(held))
    }

    /// The slot after a worker puts back `draw`; `None`: nothing to write.
    /// A draw whose lease is gone is dropped, and the slot written for
    /// its count (see [`Slot::dropped_units`]).
    pub(crate) fn put_back(mut self, draw: &Draw) -> Option<Slot> {
        (self.settle(draw) || self.drop_draw(draw)).then_some(self)
    }

    /// The slot after a busy check's request of `cost` from the worker
    /// that holds `previous` (its draw of this check, spent or too small:
    /// accounted for first), and what the request gets: a draw of half
    /// the current lease's units (at least `cost`; `cost` alone from a small
    /// lease), or a miss that asks for `want` units (0: none). `None` for
    /// the slot: nothing to write.
    pub(crate) fn take(
        mut self,
        place: Place,
        cost: u64,
        now: u64,
        want: u64,
        ask_for: AskFor,
        previous: Option<&Draw>,
    ) -> (Option<Slot>, Take) {
        if self.fingerprint != place.fingerprint {
            if self.holds_units(now) {
                // Another check's units: its owner gives them back first.
                return (None, Take::Occupied);
            }
            self = self.fresh_for(place.fingerprint);
        }
        // The draw brought goes back to its lease, or is counted dropped
        // when its lease is gone (the slot is then written for the count).
        let settled = previous.is_some_and(|d| self.settle(d));
        if let Some(draw) = previous.filter(|_| !settled) {
            self.drop_draw(draw);
        }
        let promoted = self.promote(cost, now);
        let lease = &mut self.current;
        if lease.usable(now) && lease.units >= cost {
            let low = lease.units.saturating_mul(2) <= lease.granted;
            // At least the request's cost: `left` is what is drawn beyond it.
            let drawn = if lease.plenty() {
                lease.units.div_ceil(2).max(cost)
            } else if lease.units >= cost.saturating_mul(DRAW_HALF_FROM) {
                // No more than this worker spends in a while at its own
                // pace: a worker that sees few of the client's requests
                // must not sit on half the lease while the others, out of
                // units, refuse the client.
                lease
                    .units
                    .div_ceil(2)
                    .min(want.div_ceil(DRAWS_PER_ASK))
                    .max(cost)
            } else {
                cost
            };
            lease.units -= drawn;
            lease.lent = lease.lent.saturating_add(drawn);
            lease.last_hit_ms = now;
            let mut draw = Draw {
                slot: place.slot,
                lease_id: lease.lease_id,
                drawn,
                left: drawn - cost,
                rest: 0,
                expires_ms: lease.expires_ms,
                reset_at_ms: lease.reset_at_ms,
                last_hit_ms: now,
                outlives_expiry: lease.outlives_expiry,
            };
            draw.rest = self.rest(now);
            let next_due = self.next.lease_id == 0 || !self.next.holds_units(now);
            if low && next_due && want > 0 && now >= self.asking_until_ms {
                let held = draw.left.saturating_add(self.current.units);
                let units = ask_for.renewal_units(want, draw.expires_ms, held, now);
                // None needed: no ask goes out, and none is counted as out
                // (a miss after the window turns asks at once).
                if units > 0 {
                    self.asking_until_ms = now + ask_for.renewal_ms;
                    return (Some(self), Take::Renew { draw, units, held });
                }
            }
            return (Some(self), Take::Hit(draw));
        }
        let written = (settled || promoted || self.dropped_units > 0).then_some(self);
        if want == 0 || now < self.asking_until_ms {
            // One ask at a time.
            return (written, Take::Miss { want: 0 });
        }
        self.asking_until_ms = now + ask_for.miss_ms;
        (Some(self), Take::Miss { want })
    }

    /// The slot with `grant` installed, or `None` when the current lease
    /// is live with units in the slot (a renewal then waits as the next
    /// one, unless one already does), or must wait aside while a live
    /// older lease still does (see [`Slot::set_current_aside`]); the grant
    /// must then go back at once.
    /// Units are never merged across leases, so each goes back in the
    /// counter and window it was charged to.
    pub(crate) fn install(mut self, fingerprint: u64, grant: Grant, now: u64) -> Option<Slot> {
        if self.fingerprint != fingerprint {
            if self.holds_units(now) {
                return None;
            }
            self = self.fresh_for(fingerprint);
        }
        let lease = Lease {
            lease_id: grant.lease_id,
            units: grant.units,
            granted: grant.units,
            beyond: grant.beyond,
            lent: 0,
            expires_ms: grant.expires_ms,
            reset_at_ms: grant.reset_at_ms,
            last_hit_ms: now,
            outlives_expiry: grant.outlives_expiry,
        };
        if self.current.usable(now) && self.current.units > 0 {
            // A renewal waits its turn (one at a time); anything else
            // finds units and goes back.
            if !grant.renewal || self.next.holds_units(now) {
                return None;
            }
            let lost = overwrite(&mut self.next, lease);
            self.add_dropped(lost);
            self.asking_until_ms = 0;
            return Some(self);
        }
        // Spent but for draws still out, or ended with units its owner
        // has yet to take out: it waits aside.
        if !self.set_current_aside(now) {
            return None;
        }
        let lost = overwrite(&mut self.current, lease);
        self.add_dropped(lost);
        self.asking_until_ms = 0;
        Some(self)
    }

    /// The slot with its current lease ended (meshlimitd refused a renewal
    /// of it: the client is over a limit lowered since the grant): nobody
    /// draws from it again, and it waits aside for the draws out, then its
    /// owner gives back what is left (see [`Slot::set_current_aside`]).
    /// `None`: nothing to write (another check's slot, no lease with units,
    /// or the place aside taken by a live lease: it then runs out as before).
    pub(crate) fn revoke(mut self, fingerprint: u64, now: u64) -> Option<Slot> {
        if self.fingerprint != fingerprint || !self.current.holds_units(now) {
            return None;
        }
        if !self.set_current_aside(now) {
            return None;
        }
        let lost = overwrite(&mut self.current, Lease::default());
        self.add_dropped(lost);
        Some(self)
    }

    /// What becomes of lease `lease_id` at `now` (see [`Lease::due`]): when
    /// due, its units are taken out (the slot to write is returned).
    pub(crate) fn reclaim(
        mut self,
        lease_id: u64,
        now: u64,
        idle_ms: u64,
    ) -> (Option<Slot>, Reclaim) {
        let (lease, draining) = if lease_id != 0 && self.current.lease_id == lease_id {
            (&mut self.current, false)
        } else if lease_id != 0 && self.previous.lease_id == lease_id {
            (&mut self.previous, true)
        } else if lease_id != 0 && self.next.lease_id == lease_id {
            // Not drawn from yet: idle since it was granted.
            (&mut self.next, false)
        } else if let Some(owed) = self
            .owed
            .iter_mut()
            .find(|l| lease_id != 0 && l.lease_id == lease_id)
        {
            (owed, true)
        } else {
            return (None, Reclaim::Gone);
        };
        if lease.units == 0 && lease.lent == 0 {
            return (None, Reclaim::Gone);
        }
        if !lease.due(now, idle_ms, draining) {
            let until_ms = lease.due_from(now, idle_ms, draining);
            return (None, Reclaim::Keep { until_ms });
        }
        let expired = !lease.usable(now);
        let units = lease.units;
        *lease = Lease::default();
        if units == 0 {
            return (Some(self), Reclaim::Gone);
        }
        (Some(self), Reclaim::Back { units, expired })
    }

    pub(super) fn decode(bytes: Option<&[u8]>) -> Slot {
        // Another layout's slot (a build before an upgrade) is not read.
        let Some(bytes) = bytes.filter(|b| b.len() == WORDS * 8) else {
            return Slot::default();
        };
        let w = |i| le_word(bytes, i).unwrap_or(0);
        let lease = |at: usize| Lease {
            lease_id: w(at),
            units: w(at + 1),
            lent: w(at + 2),
            expires_ms: w(at + 3),
            outlives_expiry: w(at + 4) != 0,
            reset_at_ms: w(at + 5),
            last_hit_ms: w(at + 6),
            granted: w(at + 7),
            beyond: w(at + 8),
        };
        // The first words of a lease's layout.
        let owed = |at: usize| Lease {
            lease_id: w(at),
            units: w(at + 1),
            lent: w(at + 2),
            expires_ms: w(at + 3),
            outlives_expiry: w(at + 4) != 0,
            ..Lease::default()
        };
        let owed_at = 2 + 3 * LEASE_WORDS;
        Slot {
            fingerprint: w(0),
            asking_until_ms: w(1),
            current: lease(2),
            previous: lease(2 + LEASE_WORDS),
            next: lease(2 + 2 * LEASE_WORDS),
            owed: std::array::from_fn(|i| owed(owed_at + i * OWED_WORDS)),
            dropped_units: 0,
        }
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        // The owed layout is the first OWED_WORDS of these: keep it so.
        let lease = |l: &Lease| {
            [
                l.lease_id,
                l.units,
                l.lent,
                l.expires_ms,
                u64::from(l.outlives_expiry),
                l.reset_at_ms,
                l.last_hit_ms,
                l.granted,
                l.beyond,
            ]
        };
        let mut words = [0u64; WORDS];
        let all = [self.fingerprint, self.asking_until_ms]
            .into_iter()
            .chain(lease(&self.current))
            .chain(lease(&self.previous))
            .chain(lease(&self.next))
            .chain(
                self.owed
                    .iter()
                    .flat_map(|l| lease(l).into_iter().take(OWED_WORDS)),
            );
        for (word, value) in words.iter_mut().zip(all) {
            *word = value;
        }
        le_words(&words)
    }
}
