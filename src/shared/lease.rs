//! Quota leases in shared data: units meshlimitd charged in Redis ahead of
//! time, for this Envoy to admit a busy client's requests without a call.
//!
//! A lease belongs to one check (a subject and the limits its requests
//! match) and lives in one of a fixed set of slots, found by a keyed
//! fingerprint as the fallback counters are, and shared by every worker.
//! Each worker also observes, in its own memory ([`Observer`]), how many
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
//!   ([`Observer::spend`]); otherwise the request calls, asking for a
//!   lease when no other ask is out. The slot counts the units drawn and
//!   not yet accounted for (`lent`); a worker accounts for its draw when it
//!   draws again, or on its tick once the draw idles or expires
//!   ([`Slot::put_back`], unused units back in the slot).
//! - [`Slot::install`] when an answer grants units: only over a lease
//!   with no units left in the slot, so units are never merged across
//!   leases or lost. A replaced lease whose draws are still out waits
//!   aside (`previous`) for them to be accounted for.
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

use super::keys;
use super::store::{self, le_word, le_words, retry_on_conflict, Purpose, SharedStore, StoreError};
use crate::config::LeaseConfig;

/// Words per lease, and per slot (the check, its ask, three leases).
const LEASE_WORDS: usize = 8;
const WORDS: usize = 2 + 3 * LEASE_WORDS;
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

/// One lease in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Lease {
    /// Chosen by the worker that installed it (0: none).
    lease_id: u64,
    /// Units left in the slot.
    units: u64,
    /// Units granted (a renewal is asked once half of them is left: time
    /// for it to wait for the tick, and for its call).
    granted: u64,
    /// Units workers drew and have not accounted for yet (spent, or put
    /// back): the lease is not given back while any are out.
    lent: u64,
    /// After this the lease admits nothing (the end of its window, or of
    /// a token bucket's interval).
    expires_ms: u64,
    /// When the most constraining limit's window is whole again (headers).
    reset_at_ms: u64,
    /// The last draw from the lease (idle leases go back).
    last_hit_ms: u64,
    /// meshlimitd had plenty left beyond this lease when it granted it
    /// ([`plenty_beyond`]): workers draw half of it to its last units, as
    /// a worker refused for what another holds would still be admitted.
    plenty: bool,
}

/// One slot's state: the check it is for, and up to two leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Slot {
    /// Whose slot it is (0: free).
    fingerprint: u64,
    /// A lease ask is out until then: other workers call without asking.
    asking_until_ms: u64,
    /// The lease workers draw from.
    current: Lease,
    /// The lease a grant replaced while workers still held draws of it:
    /// nobody draws from it; it waits for those draws to be accounted for,
    /// then its owner gives back whatever they left.
    previous: Lease,
    /// A renewal's lease, granted while the current one still had units:
    /// it becomes current once they are spent.
    next: Lease,
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
    /// Units the lease still had in the slot once this was drawn: the
    /// drawing request's `RateLimit` counts them with `left` (they are this
    /// client's too); the requests spending the draw later know `left` only.
    pub in_slot: u64,
    pub expires_ms: u64,
    pub reset_at_ms: u64,
    pub last_hit_ms: u64,
}

impl Draw {
    /// Whether it may admit at `now` (see [`Slot::usable`]).
    fn usable(&self, now: u64) -> bool {
        live(now, self.expires_ms, self.last_hit_ms)
    }
}

/// Whether units expiring at `expires_ms` and last used at `last_hit_ms`
/// may admit at `now`: not expired, and the clock has not stepped back
/// past their last use (a lease's and a draw's rule alike).
fn live(now: u64, expires_ms: u64, last_hit_ms: u64) -> bool {
    now < expires_ms && now.saturating_add(CLOCK_SLACK_MS) >= last_hit_ms
}

/// A check new to a worker asks for at most this many times the units it
/// asked so far in its first interval (what it would ask over the whole
/// interval at that pace, the pace read over at least an eighth of it).
const RAMP_AT_MOST: u64 = 8;

/// The units a check asks over an interval of `interval_ms` at the pace of
/// `before` units in the `elapsed_ms` since its first request (that
/// request's units included, the current one's not: they span the gaps).
/// Without it a new client's leases grow by its count each renewal (2, 4,
/// 8 units...), a call each, all through its first interval.
fn projected(before: u64, elapsed_ms: u64, interval_ms: u64) -> u64 {
    let over = elapsed_ms.max(interval_ms / RAMP_AT_MOST).max(1);
    let pace = u128::from(before) * u128::from(interval_ms) / u128::from(over);
    u64::try_from(pace).unwrap_or(u64::MAX)
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

/// What one worker saw of one check: units asked in the current
/// observation interval and in the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Seen {
    fingerprint: u64,
    interval_start_ms: u64,
    seen: u64,
    seen_before: u64,
    /// The units this worker drew for the check.
    draw: Option<Draw>,
}

/// A worker's view of how busy each check is, and the units it drew for
/// it: a direct-mapped table in the worker's own memory (a check whose
/// entry another one took starts over, as a cold check, and its draw goes
/// back), so watching every request costs no hostcall.
pub(crate) struct Observer {
    entries: Vec<Seen>,
}

impl Observer {
    pub(crate) fn new(entries: u32) -> Observer {
        Observer {
            entries: vec![Seen::default(); entries.max(1) as usize],
        }
    }

    /// The two entries a check may use (two-way: checks whose first
    /// entries collide both stay busy).
    fn ways(&self, fingerprint: u64) -> [usize; 2] {
        let len = self.entries.len().max(1);
        let first = (fingerprint % len as u64) as usize;
        let second = first ^ 1;
        [first, if second < len { second } else { first }]
    }

    /// The check's entry, if it has one.
    fn entry(&mut self, fingerprint: u64) -> Option<&mut Seen> {
        let way = self.ways(fingerprint).into_iter().find(|&i| {
            self.entries
                .get(i)
                .is_some_and(|e| e.fingerprint == fingerprint)
        })?;
        self.entries.get_mut(way)
    }

    /// Counts a request of `cost` units of the check `fingerprint`; the
    /// units to ask for when the check is busy (another request in this
    /// interval or the last one, two units or more in one of them: about
    /// one interval's worth), else 0. Also the draw of the check whose
    /// entry this one took, which must go back to its slot.
    pub(crate) fn observe(
        &mut self,
        fingerprint: u64,
        cost: u64,
        now: u64,
        config: &LeaseConfig,
    ) -> (u64, Option<Draw>) {
        let ways = self.ways(fingerprint);
        let found = ways.into_iter().find(|&i| {
            self.entries
                .get(i)
                .is_some_and(|e| e.fingerprint == fingerprint)
        });
        // Else the way that matters least: one holding no draw, then the
        // one seen longest ago.
        let way = found.or_else(|| {
            ways.into_iter().min_by_key(|&i| {
                self.entries
                    .get(i)
                    .map(|e| (e.draw.is_some(), e.interval_start_ms))
            })
        });
        let Some(e) = way.and_then(|i| self.entries.get_mut(i)) else {
            return (0, None);
        };
        let mut evicted = None;
        if e.fingerprint != fingerprint {
            evicted = e.draw;
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
        let rate = if e.seen_before > 0 {
            e.seen.max(e.seen_before)
        } else {
            // A check new to this worker: its first interval is not over,
            // so project what it has asked so far over the whole of it.
            let elapsed = now.saturating_sub(e.interval_start_ms);
            e.seen
                .max(projected(e.seen - cost, elapsed, config.interval_ms))
        };
        let busy = (e.seen > cost || e.seen_before > 0) && rate >= 2;
        let want = if busy { rate.min(config.max_units) } else { 0 };
        (want, evicted)
    }

    /// Whether [`Observer::spend`] would admit a request of `cost` at
    /// `now`, and at `until` too (nothing changes).
    pub(crate) fn can_spend(&self, fingerprint: u64, cost: u64, now: u64, until: u64) -> bool {
        let ways = self.ways(fingerprint);
        ways.into_iter().any(|i| {
            self.entries.get(i).is_some_and(|e| {
                e.fingerprint == fingerprint
                    && e.draw
                        .is_some_and(|d| d.left >= cost && d.usable(now) && d.usable(until))
            })
        })
    }

    /// Admits a request of `cost` from this worker's draw for the check,
    /// if it has the units and they are live: the draw after it.
    pub(crate) fn spend(&mut self, fingerprint: u64, cost: u64, now: u64) -> Option<Draw> {
        let draw = self.entry(fingerprint)?.draw.as_mut()?;
        if !draw.usable(now) || draw.left < cost {
            return None;
        }
        draw.left -= cost;
        draw.last_hit_ms = now;
        Some(*draw)
    }

    /// Takes the check's draw out, to account for it in its slot.
    pub(crate) fn take_draw(&mut self, fingerprint: u64) -> Option<Draw> {
        self.entry(fingerprint)?.draw.take()
    }

    /// Keeps a draw for the check (its entry is the check's: `observe`
    /// came first).
    pub(crate) fn keep_draw(&mut self, fingerprint: u64, draw: Draw) {
        if let Some(e) = self.entry(fingerprint) {
            e.draw = Some(draw);
        }
    }

    /// Takes out the draws to account for on this tick: those with no hit
    /// for `idle_ms`, and those expired (or whose clock stepped back).
    pub(crate) fn due_draws(&mut self, now: u64, idle_ms: u64) -> Vec<(u64, Draw)> {
        let mut due = Vec::new();
        for e in &mut self.entries {
            let Some(draw) = e.draw else { continue };
            if !draw.usable(now) || now.saturating_sub(draw.last_hit_ms) >= idle_ms {
                due.push((e.fingerprint, draw));
                e.draw = None;
            }
        }
        due
    }
}

/// What a request gets from its check's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    /// Admitted from the lease, with a draw for this worker (its `left`
    /// units remain after the request).
    Hit(Draw),
    /// A hit that found its lease running low (half of it left in
    /// the slot): the worker asks for the next one now, for `want` units,
    /// so that the check's requests never wait for it.
    Renew(Draw, u64),
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
    /// See [`plenty_beyond`].
    pub plenty: bool,
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

impl Lease {
    /// Whether it holds units someone may still use or give back. A lease
    /// expired for [`ABANDONED_AFTER_MS`] whose units nobody took back has
    /// lost its owner (the worker was replaced by a configuration push).
    fn holds_units(&self, now: u64) -> bool {
        self.lease_id != 0
            && (self.units > 0 || self.lent > 0)
            && now < self.expires_ms.saturating_add(ABANDONED_AFTER_MS)
    }

    /// Whether it may admit at `now`: not expired, and the clock has not
    /// stepped back past its last use.
    fn usable(&self, now: u64) -> bool {
        self.lease_id != 0 && live(now, self.expires_ms, self.last_hit_ms)
    }

    /// Accounts for a worker's draw of this lease: its unused units are
    /// the lease's again. False when the draw is of another lease.
    fn settle(&mut self, draw: &Draw) -> bool {
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
    fn due(&self, now: u64, idle_ms: u64, draining: bool) -> bool {
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
    fn due_from(&self, now: u64, idle_ms: u64, draining: bool) -> u64 {
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
    fn holds_units(&self, now: u64) -> bool {
        self.current.holds_units(now)
            || self.previous.holds_units(now)
            || self.next.holds_units(now)
    }

    /// Makes the next lease current, once the current one can serve no
    /// more (spent, expired, or too little for `cost`). False when there is
    /// no next lease, or the current one must wait aside for its draws
    /// while an older one still does.
    fn promote(&mut self, cost: u64, now: u64) -> bool {
        let current_serves = self.current.usable(now) && self.current.units >= cost;
        if current_serves || self.next.lease_id == 0 || !self.next.usable(now) {
            return false;
        }
        if !self.set_current_aside(now) {
            return false;
        }
        self.current = self.next;
        self.next = Lease::default();
        true
    }

    /// Frees `current` for a new lease: one that still holds units (draws
    /// out, or units its owner has not taken back) waits aside in
    /// `previous` for them. False when that place is taken by a lease
    /// that is still live.
    ///
    /// A lease in `previous` that has ended gives way. Leases of a fixed
    /// window all end with it, a busy client's two often together (the
    /// one in use and the spent one whose draws are out), and their owners
    /// take them out only on their next tick: if they kept the place, every
    /// grant until then would go back (charged and refunded for nothing)
    /// and the client would call per request. What the ended lease held is
    /// lost to its window, which is over for a fixed window's lease; for a
    /// token bucket's (one interval, renewed before it ends while the
    /// client is busy) it is at most one lease not refunded: fewer
    /// admitted, never more.
    fn set_current_aside(&mut self, now: u64) -> bool {
        if !self.current.holds_units(now) {
            return true;
        }
        if self.previous.holds_units(now) && self.previous.usable(now) {
            return false;
        }
        self.previous = self.current;
        true
    }

    /// Accounts for `draw` in whichever lease it came from. A draw of a
    /// lease no longer here has nowhere to go (its units are lost to this
    /// window: fewer admitted, never more). True when the slot changed.
    fn settle(&mut self, draw: &Draw) -> bool {
        self.current.settle(draw) || self.previous.settle(draw)
    }

    /// The slot after a worker puts back `draw`; `None`: nothing to write.
    pub(crate) fn put_back(mut self, draw: &Draw) -> Option<Slot> {
        self.settle(draw).then_some(self)
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
            self = Slot {
                fingerprint: place.fingerprint,
                ..Slot::default()
            };
        }
        let settled = previous.is_some_and(|d| self.settle(d));
        let promoted = self.promote(cost, now);
        let lease = &mut self.current;
        if lease.usable(now) && lease.units >= cost {
            let low = lease.units.saturating_mul(2) <= lease.granted;
            // At least the request's cost: `left` is what is drawn beyond it.
            let drawn = if lease.plenty {
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
            let draw = Draw {
                slot: place.slot,
                lease_id: lease.lease_id,
                drawn,
                left: drawn - cost,
                in_slot: lease.units,
                expires_ms: lease.expires_ms,
                reset_at_ms: lease.reset_at_ms,
                last_hit_ms: now,
            };
            let next_due = self.next.lease_id == 0 || !self.next.holds_units(now);
            if low && next_due && want > 0 && now >= self.asking_until_ms {
                let held = draw.left.saturating_add(draw.in_slot);
                let units = ask_for.renewal_units(want, draw.expires_ms, held, now);
                // None needed: no ask goes out, and none is counted as out
                // (a miss after the window turns asks at once).
                if units > 0 {
                    self.asking_until_ms = now + ask_for.renewal_ms;
                    return (Some(self), Take::Renew(draw, units));
                }
            }
            return (Some(self), Take::Hit(draw));
        }
        let written = (settled || promoted).then_some(self);
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
            self = Slot {
                fingerprint,
                ..Slot::default()
            };
        }
        let lease = Lease {
            lease_id: grant.lease_id,
            units: grant.units,
            granted: grant.units,
            plenty: grant.plenty,
            lent: 0,
            expires_ms: grant.expires_ms,
            reset_at_ms: grant.reset_at_ms,
            last_hit_ms: now,
        };
        if self.current.usable(now) && self.current.units > 0 {
            // A renewal waits its turn (one at a time); anything else
            // finds units and goes back.
            if !grant.renewal || self.next.holds_units(now) {
                return None;
            }
            self.next = lease;
            self.asking_until_ms = 0;
            return Some(self);
        }
        // Spent but for draws still out, or ended with units its owner
        // has yet to take out: it waits aside.
        if !self.set_current_aside(now) {
            return None;
        }
        self.current = lease;
        self.asking_until_ms = 0;
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

    fn decode(bytes: Option<&[u8]>) -> Slot {
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
            reset_at_ms: w(at + 4),
            last_hit_ms: w(at + 5),
            granted: w(at + 6),
            plenty: w(at + 7) != 0,
        };
        Slot {
            fingerprint: w(0),
            asking_until_ms: w(1),
            current: lease(2),
            previous: lease(2 + LEASE_WORDS),
            next: lease(2 + 2 * LEASE_WORDS),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let lease = |l: &Lease| {
            [
                l.lease_id,
                l.units,
                l.lent,
                l.expires_ms,
                l.reset_at_ms,
                l.last_hit_ms,
                l.granted,
                u64::from(l.plenty),
            ]
        };
        let mut words = [0u64; WORDS];
        let all = [self.fingerprint, self.asking_until_ms]
            .into_iter()
            .chain(lease(&self.current))
            .chain(lease(&self.previous))
            .chain(lease(&self.next));
        for (word, value) in words.iter_mut().zip(all) {
            *word = value;
        }
        le_words(&words)
    }
}

/// The lease slots of one Envoy, through a shared store.
pub(crate) struct Leases<'s, S: SharedStore> {
    pub config: LeaseConfig,
    pub seed: (u64, u64),
    pub store: &'s S,
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
                Ok(Take::Occupied) if here.is_some() => carried = None,
                Ok(Take::Occupied) => {}
                Ok(take) => {
                    let kept = carried.filter(|d| d.slot != slot);
                    return (take, kept, at);
                }
            }
        }
        (Take::Miss { want: 0 }, carried, place)
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
        let key = keys::lease_slot(at.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            let (slot, take) =
                Slot::decode(bytes.as_deref()).take(at, cost, now, want, ask_for, previous);
            if let Some(slot) = slot {
                self.store.set(&key, &slot.encode(), cas)?;
            }
            Ok(take)
        })
    }

    /// Accounts for a worker's draw in its slot.
    pub fn put_back(&self, draw: &Draw) -> Result<(), StoreError> {
        let key = keys::lease_slot(draw.slot);
        retry_on_conflict(|| {
            let (bytes, cas) = self.store.get(&key)?;
            match Slot::decode(bytes.as_deref()).put_back(draw) {
                Some(slot) => self.store.set(&key, &slot.encode(), cas),
                None => Ok(()),
            }
        })
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

    /// What a worker busy with the client asks for: enough that its own
    /// pace does not bound its draws (see the test of that bound).
    const BUSY: u64 = 1_000;

    const ASK: AskFor = AskFor {
        miss_ms: 100,
        renewal_ms: 100,
        window_bound_interval_ms: None,
    };

    const CONFIG: LeaseConfig = LeaseConfig {
        slots: 16,
        max_units: 1000,
        interval_ms: 1000,
        share: 2,
    };

    fn keep(until_ms: u64) -> Reclaim {
        Reclaim::Keep { until_ms }
    }

    fn at(fingerprint: u64) -> Place {
        Place {
            fingerprint,
            slot: 3,
            alternate: 4,
        }
    }

    /// A request of cost 1 from a worker with no draw.
    fn take(slot: Slot, fp: u64, now: u64) -> (Slot, Take) {
        let (next, take) = slot.take(at(fp), 1, now, BUSY, ASK, None);
        (next.unwrap_or(slot), take)
    }

    /// A reclaim that gives units back.
    fn gives_back(units: u64, expired: bool) -> Reclaim {
        Reclaim::Back { units, expired }
    }

    /// The draw a hit gave.
    fn drawn(take: Take) -> Draw {
        match take {
            Take::Hit(draw) | Take::Renew(draw, _) => draw,
            Take::Miss { .. } | Take::Occupied => panic!("no draw: {take:?}"),
        }
    }

    fn grant(units: u64, expires_ms: u64) -> Grant {
        Grant {
            lease_id: 7,
            units,
            expires_ms,
            reset_at_ms: expires_ms,
            renewal: false,
            plenty: false,
        }
    }

    #[test]
    fn a_cold_check_asks_for_nothing_and_a_busy_one_for_its_rate() {
        let mut seen = Observer::new(64);
        assert_eq!(seen.observe(1, 1, 10, &CONFIG).0, 0);
        // In its first interval a check asks for its pace so far over the
        // whole interval, read over an eighth of it at least: one unit in
        // the 10 ms before, then two in 20.
        assert_eq!(seen.observe(1, 1, 20, &CONFIG).0, 8);
        assert_eq!(seen.observe(1, 1, 30, &CONFIG).0, 16);
        // Three units in 500 ms: 6 over the interval.
        assert_eq!(seen.observe(1, 1, 510, &CONFIG).0, 6);
        // Never less than it asked so far.
        assert_eq!(seen.observe(1, 5, 990, &CONFIG).0, 9);
        // The next interval asks for the last one's count until it is
        // busier itself.
        assert_eq!(seen.observe(1, 1, 1_020, &CONFIG).0, 9);
        // One request is never busy, whatever its cost.
        assert_eq!(seen.observe(2, 50, 10, &CONFIG).0, 0);
        // A check seen once an interval stays cold.
        for i in 0..5 {
            assert_eq!(seen.observe(3, 1, 10 + i * 1500, &CONFIG).0, 0);
        }
        // Asks are bounded.
        assert_eq!(seen.observe(2, 5_000, 20, &CONFIG).0, 1000);
    }

    #[test]
    fn one_ask_at_a_time_per_slot() {
        let (slot, t) = take(Slot::default(), 1, 20);
        assert_eq!(t, Take::Miss { want: BUSY });
        let (slot, t) = take(slot, 1, 30);
        assert_eq!(t, Take::Miss { want: 0 });
        // The ask expired unanswered: ask again.
        let (_, t) = take(slot, 1, 200);
        assert_eq!(t, Take::Miss { want: BUSY });
        // Not busy: nothing to write.
        assert_eq!(
            Slot::default().take(at(1), 1, 20, 0, ASK, None),
            (None, Take::Miss { want: 0 })
        );
    }

    #[test]
    fn a_lease_admits_until_it_is_empty_or_expired() {
        let slot = Slot::default().install(1, grant(2, 500), 10).unwrap();
        let (slot, t) = take(slot, 1, 20);
        let first = drawn(t);
        assert_eq!(
            (first.drawn, first.left, first.reset_at_ms, first.slot),
            (1, 0, 500, 3)
        );
        // The worker comes back with its draw spent: accounted, and another.
        let (next, t) = slot.take(at(1), 1, 30, BUSY, ASK, Some(&first));
        let (slot, second) = (next.unwrap(), drawn(t));
        assert_eq!(
            (second.left, slot.current.units, slot.current.lent),
            (0, 0, 1)
        );
        // Spent; the renewal the first draw asked for (half the lease
        // was left) is still out: the request calls without asking.
        let (next, t) = slot.take(at(1), 1, 40, BUSY, ASK, Some(&second));
        assert_eq!(t, Take::Miss { want: 0 });
        let slot = next.unwrap();
        assert_eq!(
            (slot.current.units, slot.current.lent),
            (0, 0),
            "every draw accounted for"
        );
        let full = Slot::default().install(1, grant(5, 500), 10).unwrap();
        let (_, t) = take(full, 1, 500);
        assert!(matches!(t, Take::Miss { .. }), "expired at 500");
        // A cost above what is left calls.
        let (_, t) = full.take(at(1), 6, 20, BUSY, ASK, None);
        assert!(matches!(t, Take::Miss { .. }));
    }

    #[test]
    fn the_last_units_of_a_lease_are_drawn_one_request_at_a_time() {
        // A small lease (the last units of a window): a worker that drew
        // more than its request would hold units while the client's next
        // requests land on another worker and are refused.
        let mut slot = Slot::default()
            .install(1, grant(DRAW_HALF_FROM - 1, 5_000), 10)
            .unwrap();
        for n in 0..DRAW_HALF_FROM - 1 {
            let (next, t) = take(slot, 1, 20 + n);
            let d = drawn(t);
            assert_eq!((d.drawn, d.left), (1, 0), "draw {n}");
            slot = next;
        }
        // A heavier request draws its cost, no more.
        let slot = Slot::default()
            .install(1, grant(3 * DRAW_HALF_FROM - 1, 5_000), 10)
            .unwrap();
        let (next, t) = slot.take(at(1), 3, 20, BUSY, ASK, None);
        assert_eq!(drawn(t).drawn, 3);
        // From a large one, half (of the 44 left).
        assert_eq!(drawn(take(next.unwrap(), 1, 21).1).drawn, 22);
        // From a small one granted with plenty left beyond it, half too,
        // to its last units: a worker refused for what another holds would
        // be admitted by its call.
        assert!(plenty_beyond(5, 80) && !plenty_beyond(5, 79));
        let plenty = Grant {
            plenty: true,
            ..grant(5, 5_000)
        };
        let mut slot = Slot::default().install(1, plenty, 10).unwrap();
        for (n, half) in [3, 1, 1].into_iter().enumerate() {
            let (next, t) = take(slot, 1, 20 + n as u64);
            assert_eq!(drawn(t).drawn, half, "draw {n}");
            slot = next;
        }
        assert_eq!(Slot::decode(Some(&slot.encode())), slot);
        // A request heavier than half of such a lease draws its cost.
        let slot = Slot::default().install(1, plenty, 10).unwrap();
        let (_, t) = slot.take(at(1), 4, 20, BUSY, ASK, None);
        assert_eq!((drawn(t).drawn, drawn(t).left), (4, 0));
    }

    /// A worker that sees few of the client's requests (one of a
    /// replica's workers with few of its connections) drew half the lease
    /// on its first request and sat on it, while the workers the client's
    /// requests did reach ran out and refused them: units stranded to the
    /// end of a burst (the two-replica test admitted 1971 of 2000 once).
    /// From a lease without plenty beyond it, a worker draws at most a
    /// quarter of what it asks for, about what it spends in a tick.
    #[test]
    fn a_worker_draws_no_more_than_its_own_pace_spends_in_a_tick() {
        let slot = Slot::default().install(1, grant(200, 5_000), 10).unwrap();
        // Not busy on this worker: it asks for nothing, and draws its
        // request's cost alone.
        let (next, t) = slot.take(at(1), 1, 20, 0, ASK, None);
        assert_eq!((drawn(t).drawn, drawn(t).left), (1, 0));
        // Busy at 40 units an interval: 10, not 100.
        let (next, t) = next.unwrap().take(at(1), 1, 21, 40, ASK, None);
        assert_eq!((drawn(t).drawn, next.unwrap().current.units), (10, 189));
        // Never less than the request's cost.
        let (_, t) = slot.take(at(1), 3, 21, 4, ASK, None);
        assert_eq!(drawn(t).drawn, 3);
        // Far from the limit, the worker's pace does not matter: a worker
        // refused for what another holds would be admitted by its call.
        let plenty = Grant {
            plenty: true,
            ..grant(200, 5_000)
        };
        let slot = Slot::default().install(1, plenty, 10).unwrap();
        let (_, t) = slot.take(at(1), 1, 20, 0, ASK, None);
        assert_eq!(drawn(t).drawn, 100);
    }

    #[test]
    fn workers_draw_half_of_what_is_left_and_put_back_what_they_leave() {
        let slot = Slot::default().install(1, grant(40, 5_000), 10).unwrap();
        let (slot, t) = take(slot, 1, 20);
        let a = drawn(t);
        assert_eq!(
            (a.drawn, a.left, slot.current.units, slot.current.lent),
            (20, 19, 20, 20)
        );
        // A heavier request, for which what is left is small, draws its
        // cost.
        let (next, t) = slot.take(at(1), 4, 21, BUSY, ASK, None);
        let (slot, b) = (next.unwrap(), drawn(t));
        assert_eq!(
            (b.drawn, b.left, slot.current.units, slot.current.lent),
            (4, 0, 16, 24)
        );
        // `a` idles with 19 left: back in the slot.
        let slot = slot.put_back(&a).unwrap();
        assert_eq!((slot.current.units, slot.current.lent), (35, 4));
        // A draw of another lease has nowhere to go.
        let stale = Draw { lease_id: 99, ..b };
        assert_eq!(slot.put_back(&stale), None);
    }

    #[test]
    fn draws_out_keep_a_lease_from_going_back_until_they_are_accounted_for() {
        let slot = Slot::default().install(1, grant(40, 5_000), 10).unwrap();
        let (slot, t) = take(slot, 1, 20);
        let a = drawn(t);
        // Idle in the slot, but `a` still holds units: not yet, nor before
        // half an interval (a draw still out was hit within two ticks).
        assert_eq!(slot.reclaim(7, 1_500, 1000), (None, keep(2_000)));
        assert_eq!(slot.install(1, grant(3, 9_000), 1_500), None);
        let back = slot.put_back(&a).unwrap();
        let (next, r) = back.reclaim(7, 1_500, 1000);
        assert_eq!(r, gives_back(39, false));
        assert_eq!(
            next.unwrap()
                .install(1, grant(3, 9_000), 1_500)
                .map(|s| s.current.units),
            Some(3)
        );
        // Expired: the draws get a little time to come back, then the slot
        // goes back without them.
        assert_eq!(slot.reclaim(7, 5_100, 1000), (None, keep(5_000)));
        let (_, r) = slot.reclaim(7, 5_000 + DRAWS_BACK_WITHIN_MS, 1000);
        assert_eq!(r, gives_back(20, true));
        // Spent in draws and accounted for: nothing to give back.
        let spent = Slot {
            current: Lease {
                units: 0,
                lent: 0,
                ..slot.current
            },
            ..slot
        };
        assert_eq!(spent.reclaim(7, 5_100, 1000), (None, Reclaim::Gone));
    }

    #[test]
    fn a_grant_replaces_a_spent_lease_whose_draws_are_out_and_each_goes_back_on_its_own() {
        let slot = Slot::default().install(1, grant(16, 5_000), 10).unwrap();
        let (slot, t) = take(slot, 1, 20);
        let a = drawn(t); // 8 of 16, 7 left in it
        let (next, t) = slot.take(at(1), 8, 21, BUSY, ASK, None);
        let slot = next.unwrap();
        let b = drawn(t); // the last 8, all spent
        assert_eq!((slot.current.units, slot.current.lent), (0, 16));
        // Spent in the slot, draws out: a new lease goes in, the old aside.
        let newer = Grant {
            lease_id: 8,
            ..grant(6, 5_000)
        };
        let slot = slot.install(1, newer, 30).unwrap();
        assert_eq!((slot.current.lease_id, slot.current.units), (8, 6));
        assert_eq!((slot.previous.lease_id, slot.previous.lent), (7, 16));
        // Draws come from the new lease; old draws go back to the old one.
        let (slot, t) = take(slot, 1, 31);
        assert_eq!(drawn(t).lease_id, 8);
        let slot = slot.put_back(&a).unwrap();
        assert_eq!((slot.previous.units, slot.previous.lent), (7, 8));
        // Still a draw out of the old lease: it waits, and so does a third.
        assert_eq!(slot.reclaim(7, 40, 1000), (None, keep(40)));
        let third = Grant {
            lease_id: 9,
            ..grant(6, 5_000)
        };
        let spent_new = Slot {
            current: Lease {
                units: 0,
                ..slot.current
            },
            ..slot
        };
        assert_eq!(spent_new.install(1, third, 40), None);
        // Accounted for: its owner takes back what the draws left, at once.
        let slot = slot.put_back(&b).unwrap();
        let (next, r) = slot.reclaim(7, 41, 1000);
        assert_eq!(r, gives_back(7, false));
        let slot = next.unwrap();
        assert_eq!(slot.previous, Lease::default());
        assert_eq!(slot.reclaim(8, 41, 1000), (None, keep(1_031)));
    }

    #[test]
    fn checks_whose_entries_collide_are_both_watched() {
        let mut seen = Observer::new(64);
        // 5 and 69 share their first entry; the second way keeps both.
        for now in [10, 20, 30] {
            seen.observe(5, 1, now, &CONFIG);
            seen.observe(69, 1, now, &CONFIG);
        }
        // Each asks for its pace (3 units in 30 ms, read over 125).
        assert_eq!(seen.observe(5, 1, 40, &CONFIG).0, 24);
        assert_eq!(seen.observe(69, 1, 40, &CONFIG).0, 24);
        // A third takes the way seen longest ago, and holding no draw.
        seen.keep_draw(5, test_draw(5));
        let (want, evicted) = seen.observe(133, 1, 50, &CONFIG);
        assert_eq!((want, evicted), (0, None));
        assert_eq!(seen.spend(5, 1, 50).map(|d| d.left), Some(2), "kept");
        assert_eq!(seen.observe(69, 1, 60, &CONFIG).0, 0, "69 starts over");
    }

    fn test_draw(slot: u64) -> Draw {
        Draw {
            slot,
            lease_id: 7,
            drawn: 3,
            left: 3,
            in_slot: 0,
            expires_ms: 1_000,
            reset_at_ms: 1_000,
            last_hit_ms: 10,
        }
    }

    #[test]
    fn a_check_whose_slot_another_holds_takes_its_alternate() {
        use crate::host::fake::FakeStore;
        let store = FakeStore::default();
        let leases = Leases {
            config: CONFIG,
            seed: (1, 2),
            store: &store,
        };
        let a = leases.place(&"limits", "a");
        assert_ne!(a.slot, a.alternate);
        // Another check's lease in a's slot.
        let other = Place {
            fingerprint: a.fingerprint ^ 1,
            ..a
        };
        let (_, _, at) = leases.take(other, 1, 10, BUSY, ASK, None);
        assert_eq!(at.slot, a.slot);
        assert!(leases.install(other, grant(5, 5_000), 10));
        // a asks in its alternate; its grant goes there and serves it.
        let (take, kept, at) = leases.take(a, 1, 20, BUSY, ASK, None);
        assert_eq!(
            (take, kept, at.slot),
            (Take::Miss { want: BUSY }, None, a.alternate)
        );
        assert!(leases.install(
            at,
            Grant {
                lease_id: 9,
                ..grant(4, 5_000)
            },
            20
        ));
        let (take, _, at) = leases.take(a, 1, 30, BUSY, ASK, None);
        let draw = drawn(take);
        assert_eq!(
            (draw.lease_id, draw.slot, at.slot),
            (9, a.alternate, a.alternate)
        );
        // Spent, the draw is accounted for in the slot it came from.
        let (take, kept, _) = leases.take(a, 1, 40, BUSY, ASK, Some(Draw { left: 0, ..draw }));
        assert_eq!((drawn(take).drawn, kept), (1, None));
    }

    #[test]
    fn a_lease_down_to_half_asks_once_for_the_next_which_replaces_it() {
        let slot = Slot::default().install(1, grant(64, 5_000), 10).unwrap();
        let (slot, t) = take(slot, 1, 20);
        assert!(matches!(t, Take::Hit(_)), "64 left: {t:?}");
        let (slot, t) = take(slot, 1, 21);
        assert!(matches!(t, Take::Renew(_, BUSY)), "32 left: {t:?}");
        let (slot, t) = take(slot, 1, 22);
        assert!(matches!(t, Take::Hit(_)), "one ask at a time: {t:?}");
        let (slot, t) = take(slot, 1, 23);
        assert!(matches!(t, Take::Hit(_)), "8 left: {t:?}");
        // A grant that is no renewal finds units and goes back; a renewal
        // waits its turn, and takes over once the lease is spent.
        let newer = Grant {
            lease_id: 8,
            ..grant(6, 5_000)
        };
        assert_eq!(slot.install(1, newer, 30), None);
        let renewed = Grant {
            renewal: true,
            ..newer
        };
        let slot = slot.install(1, renewed, 30).unwrap();
        assert_eq!((slot.current.lease_id, slot.current.units), (7, 7));
        assert_eq!((slot.next.lease_id, slot.next.units), (8, 6));
        assert_eq!(slot.install(1, renewed, 30), None, "one waits at a time");
        let (next, t) = slot.take(at(1), 7, 31, BUSY, ASK, None);
        let slot = next.unwrap();
        assert_eq!(drawn(t).lease_id, 7, "the last units of the first");
        let (slot, t) = take(slot, 1, 32);
        assert_eq!(drawn(t).lease_id, 8);
        assert_eq!((slot.previous.lease_id, slot.next.lease_id), (7, 0));
        // Not drawn from, a waiting lease goes back when idle.
        let waiting = Slot {
            next: Lease {
                lease_id: 9,
                units: 4,
                lent: 0,
                last_hit_ms: 40,
                ..slot.current
            },
            ..slot
        };
        assert_eq!(waiting.reclaim(9, 1_040, 1000).1, gives_back(4, false));
    }

    #[test]
    fn a_worker_spends_its_draw_with_no_store_and_gives_it_back_when_idle() {
        let mut seen = Observer::new(64);
        assert_eq!(seen.observe(1, 1, 10, &CONFIG), (0, None));
        let draw = test_draw(3);
        assert_eq!(seen.spend(1, 1, 20), None, "no draw yet");
        seen.keep_draw(1, draw);
        assert_eq!(seen.spend(1, 2, 20).map(|d| d.left), Some(1));
        assert_eq!(seen.spend(1, 2, 30), None, "too little left");
        assert_eq!(seen.spend(1, 1, 30).map(|d| d.left), Some(0));
        assert_eq!(seen.spend(2, 1, 30), None, "another check's");
        // Busy within the idle time: kept.
        assert!(seen.due_draws(200, 250).is_empty());
        let due = seen.due_draws(280, 250);
        assert_eq!(due.len(), 1);
        assert_eq!((due[0].0, due[0].1.left, due[0].1.drawn), (1, 0, 3));
        assert_eq!(seen.take_draw(1), None, "taken out");
        // Expired draws are due at once, and admit nothing.
        seen.keep_draw(
            1,
            Draw {
                last_hit_ms: 990,
                ..draw
            },
        );
        assert_eq!(seen.spend(1, 1, 1_000), None);
        assert_eq!(seen.due_draws(1_000, 250).len(), 1);
        // A check taking an entry hands back the draw it held (both ways
        // holding draws: the one seen longest ago goes).
        seen.keep_draw(1, draw);
        seen.observe(1 + 64, 1, 40, &CONFIG);
        seen.keep_draw(1 + 64, draw);
        let (_, evicted) = seen.observe(1 + 128, 1, 50, &CONFIG);
        assert_eq!(evicted, Some(draw));
        assert_eq!(seen.spend(1, 1, 50), None, "1 was seen first");
        assert!(seen.spend(1 + 64, 1, 50).is_some());
    }

    #[test]
    fn units_are_never_overwritten_by_another_check_or_another_grant() {
        let slot = Slot::default().install(1, grant(5, 500), 10).unwrap();
        let (next, t) = slot.take(at(2), 1, 20, BUSY, ASK, None);
        assert_eq!((next, t), (None, Take::Occupied));
        assert_eq!(slot.install(2, grant(3, 500), 20), None);
        assert_eq!(slot.install(1, grant(3, 500), 20), None);
        // Spent, the slot takes a new grant (for any check).
        let spent = Slot {
            current: Lease {
                units: 0,
                ..slot.current
            },
            ..slot
        };
        let next = spent.install(2, grant(3, 900), 20).unwrap();
        assert_eq!((next.fingerprint, next.current.units), (2, 3));
    }

    #[test]
    fn expired_or_idle_leases_give_their_units_back_once() {
        let slot = Slot::default().install(1, grant(5, 5000), 10).unwrap();
        // Not due before an interval after it was granted: no look needed
        // until then, and it goes back then.
        assert_eq!(slot.reclaim(7, 500, 1000), (None, keep(1_010)));
        assert_eq!(slot.reclaim(7, 1_009, 1000), (None, keep(1_010)));
        assert_eq!(slot.reclaim(8, 500, 1000), (None, Reclaim::Gone));
        let (next, r) = slot.reclaim(7, 1010, 1000);
        assert_eq!(r, gives_back(5, false));
        let next = next.unwrap();
        assert_eq!(next.reclaim(7, 1020, 1000).1, Reclaim::Gone);
        let (_, r) = slot.reclaim(7, 5000, 1000);
        assert_eq!(r, gives_back(5, true));
        // A hit keeps it from going idle.
        let (hit, _) = take(slot, 1, 900);
        assert_eq!(hit.reclaim(7, 1500, 1000).1, keep(2_000));
        // An expiry before that comes first.
        let (soon, _) = take(
            Slot::default().install(1, grant(5, 1_200), 10).unwrap(),
            1,
            900,
        );
        assert_eq!(soon.reclaim(7, 1_000, 1000).1, keep(1_200));
    }

    #[test]
    fn units_whose_owner_is_gone_free_their_slot_after_expiry() {
        let slot = Slot::default().install(1, grant(5, 500), 10).unwrap();
        let newer = Grant {
            lease_id: 8,
            ..grant(3, 900)
        };
        let aside = slot.install(1, newer, 600).unwrap();
        assert_eq!((aside.current.lease_id, aside.current.units), (8, 3));
        assert_eq!(
            aside.reclaim(7, 600, 1000).1,
            gives_back(5, true),
            "its owner may still take them out"
        );
        let next = slot.install(1, grant(3, 5_000), 2_500).unwrap();
        assert_eq!(next.current.units, 3);
        let (next, _) = slot.take(at(2), 1, 2_500, BUSY, ASK, None);
        assert!(next.is_some(), "another check may take the slot");
    }

    #[test]
    fn ended_leases_give_way_to_a_grant_and_a_live_one_waiting_aside_does_not() {
        // The spent lease (draws out) waits aside; the one in use ends
        // with its window; so does the aside one.
        let spent = Slot::default().install(1, grant(1, 1_000), 10).unwrap();
        let (spent, taken) = take(spent, 1, 20);
        assert!(matches!(taken, Take::Hit(_)));
        assert_eq!(spent.current.lent, 1);
        let in_use = Grant {
            lease_id: 8,
            ..grant(5, 1_000)
        };
        let both = spent.install(1, in_use, 30).unwrap();
        assert_eq!((both.previous.lease_id, both.current.lease_id), (7, 8));
        // The next window's grant goes in: the ended one in use waits
        // aside, the older ended one gives way.
        let next_window = Grant {
            lease_id: 9,
            ..grant(4, 61_000)
        };
        let installed = both.install(1, next_window, 1_000).unwrap();
        assert_eq!(
            (installed.previous.lease_id, installed.current.lease_id),
            (8, 9)
        );
        // While the aside lease is live, an ended current one cannot
        // take its place.
        let live_aside = Slot {
            previous: Lease {
                expires_ms: 5_000,
                ..both.previous
            },
            ..both
        };
        assert_eq!(live_aside.install(1, next_window, 1_000), None);
    }

    #[test]
    fn a_clock_stepping_back_ends_a_lease() {
        let slot = Slot::default()
            .install(1, grant(5, 60_000), 10_000)
            .unwrap();
        let (_, t) = take(slot, 1, 9_950);
        assert!(matches!(t, Take::Hit(_)), "a little skew is fine");
        let (_, t) = take(slot, 1, 5_000);
        assert!(matches!(t, Take::Miss { .. }));
        let (_, r) = slot.reclaim(7, 5_000, 1000);
        assert_eq!(r, gives_back(5, true));
    }

    #[test]
    fn slots_round_trip_and_short_values_read_as_zero() {
        let slot = Slot::default().install(3, grant(9, 800), 10).unwrap();
        assert_eq!(Slot::decode(Some(&slot.encode())), slot);
        let (slot, _) = take(slot, 3, 20);
        let aside = Slot {
            previous: slot.current,
            asking_until_ms: 77,
            ..slot
        };
        assert_eq!(Slot::decode(Some(&aside.encode())), aside);
        assert_eq!(aside.encode().len(), WORDS * 8);
        // The sizes README.md and docs/leases.md give for `leases.slots`.
        assert_eq!((WORDS * 8, std::mem::size_of::<Seen>()), (208, 104));
        assert_eq!(Slot::decode(Some(&[1, 2, 3])), Slot::default());
    }

    /// Shared data outlives a filter upgrade (same `vm_id`): a slot a
    /// build with another layout wrote must not be read as leases (a
    /// timestamp read as units would admit what nobody charged). It reads
    /// as empty: its units are lost to their window, fewer admitted.
    #[test]
    fn a_slot_of_another_layout_reads_as_empty() {
        for words in [WORDS - 3, WORDS - 1, WORDS + 1, WORDS + 3] {
            let bytes = le_words(&vec![1_700_000_000_000u64; words]);
            assert_eq!(Slot::decode(Some(&bytes)), Slot::default(), "{words} words");
        }
    }

    #[test]
    fn a_renewal_near_its_windows_end_asks_for_what_the_pace_spends_before_it() {
        let window_bound = AskFor {
            window_bound_interval_ms: Some(1_000),
            ..ASK
        };
        // A token bucket's lease, or a window an interval or more from its
        // end: the whole pace.
        assert_eq!(ASK.renewal_units(100, 1_250, 10, 1_000), 100);
        assert_eq!(window_bound.renewal_units(100, 2_000, 10, 1_000), 100);
        // 250 ms left: a quarter of the pace, beyond the 10 units held.
        assert_eq!(window_bound.renewal_units(100, 1_250, 10, 1_000), 15);
        // What is held lasts until the end, or the end has passed.
        assert_eq!(window_bound.renewal_units(100, 1_250, 25, 1_000), 0);
        assert_eq!(window_bound.renewal_units(100, 900, 0, 1_000), 0);
        // Rounded up: 1 ms of a slow pace still asks for a unit.
        assert_eq!(window_bound.renewal_units(3, 1_001, 0, 1_000), 1);
    }
}
