//! Quota leases on the request path: a busy check's requests are admitted
//! from units meshlimitd already charged (no pause, no call), and units
//! left unused go back.
//!
//! - Before calling, [`Worker::lease_hit`] looks in the check's slot
//!   (`crate::shared::lease`): a hit is the verdict; a miss may put a
//!   lease ask on the check's call.
//! - When an answer grants units, [`Worker::install_lease`] puts them in
//!   the slot and keeps what a return needs (the check, its receipts).
//! - The root's tick ([`Worker::on_tick`]) takes back the units of leases
//!   this worker installed that expired or went idle, and sends them to
//!   meshlimitd as settlements at 0.

use std::rc::Rc;

use log::warn;
use meshlimit_protocol::{CheckResult, LeaseLife, Receipt};

use super::clock::NEAR_EXPIRY_MS;
use super::decision_log::Source;
use super::hit::{HitHeaders, Scope};
use super::observer::Observer;
use super::returns::Due;
use super::{Job, Queued, Step, Stream, Worker};
use crate::check::{Check, LeaseIdentity, LeaseTicket};
use crate::host::Host;
use crate::shared::lease::{AskFor, Draw, Grant, Leases, Place, Take};
use crate::stats::Stat;

/// What a request's check found in its lease slot.
pub(super) enum Lookup {
    /// Admitted from the lease, with this many units left for the client
    /// (as its draw knows it: `Draw::remaining`) and the window whole
    /// again this much later (see [`hit_result`]).
    Hit { remaining: u64, reset_after_ms: u64 },
    /// No units for it: its call asks for this lease, if any.
    Miss(Option<LeaseTicket>),
    /// Decided on a reused clock read, the request's worker has no draw
    /// it may spend then and for [`super::clock::NEAR_EXPIRY_MS`] after:
    /// ask again on a fresh one. Nothing was counted.
    NeedsClock,
}

/// The next lease a draw found due: its ticket, and how long until the
/// check's request that would find no units ([`time_to_miss_ms`]; a
/// renewal with time to spare waits for the next batch or the tick).
pub(super) struct Renewal {
    ticket: LeaseTicket,
    runway_ms: u64,
}

/// How long, at a check's pace of `want` units an interval, until its
/// request that would find no units: the `held` units serve the requests
/// before it, and it comes one request (`cost`) after them. A renewal
/// that arrives by then keeps every request from pausing; a tail client
/// with the last of a small lease in hand still has a request's time.
pub(super) fn time_to_miss_ms(held: u64, cost: u64, interval_ms: u64, want: u64) -> u64 {
    held.saturating_add(cost).saturating_mul(interval_ms) / want.max(1)
}

/// A lease this worker installed: what giving its units back needs.
pub(super) struct LeaseRecord {
    /// The lease slot it was installed in.
    pub(super) slot: u64,
    pub(super) lease_id: u64,
    pub(super) check: Check,
    pub(super) receipts: Vec<Receipt>,
    /// Every limit it was charged on is a fixed window that ends when it
    /// expires: once expired, those windows are gone, and so is any point
    /// in giving units back. A lease that also holds units of a longer
    /// window (a limit per second and one per minute) gives them back when
    /// it expires: the longer window still counts them.
    pub(super) expiry_ends_every_window: bool,
    /// The tick looks at the slot again from then (see
    /// [`Reclaim::Keep`]): a live lease costs a shared-data read every half
    /// interval or less often, not one a tick.
    pub(super) look_at_ms: u64,
}

impl Worker {
    /// The lease slots, when leases are on.
    pub(super) fn leases<'a, H: Host>(&'a self, host: &'a H, now: u64) -> Option<Leases<'a, H>> {
        Some(Leases {
            config: self.config.leases?,
            seed: self.guard.seed(host, now),
            store: host,
            keys: self.guard.keys(),
            dropped: &self.lease_book.dropped,
        })
    }

    /// The tick period that reclaims leases (see `lease_book::tick_ms`).
    pub(super) fn lease_tick_ms(&self) -> Option<u32> {
        super::lease_book::tick_ms(self.config.leases)
    }

    /// A request's check, before any call: admitted from its lease (the
    /// result to decide by), or a miss with the lease its call asks for
    /// when busy.
    /// Most hits spend this worker's draw and cross into Envoy for nothing;
    /// a draw spent goes to the slot for the next one (half of what is
    /// left there).
    /// `context_id`: the stream's (a renewal is sent from it). `reused`:
    /// `now` is the worker's last clock read, reused (see `clock`).
    pub(super) fn lease_hit(
        &self,
        host: &impl Host,
        now: u64,
        reused: bool,
        context_id: u32,
        check: &Check,
    ) -> Lookup {
        let Some(cost) = check.lease_cost() else {
            return Lookup::Miss(None);
        };
        let Some(leases) = self.leases(host, now) else {
            return Lookup::Miss(None);
        };
        let place = check.lease_place(leases.seed, || {
            leases.place(&LeaseIdentity(&check.global), &check.subject)
        });
        if self.lease_book.ends.heard(host, now) {
            self.put_back_every_draw(&leases);
        }
        let mut observer = self.lease_book.observer.borrow_mut();
        let until = now.saturating_add(NEAR_EXPIRY_MS);
        if reused && !observer.can_spend(place.fingerprint, cost, now, until) {
            return Lookup::NeedsClock;
        }
        // Only checks busy on this worker ask for a lease; any check draws
        // from one its Envoy holds (another worker's ask may have got it,
        // and meshlimitd would refuse the units it holds). A cold check
        // pays one shared-data read for that, on its way to a call.
        let (want, evicted) = observer.observe(place.fingerprint, cost, now, &leases.config);
        if let Some(draw) = evicted {
            // Rare (two busy checks in one entry): its slot gets it back now.
            let _ = leases.put_back(&draw);
        }
        let draw = match observer.spend(place.fingerprint, cost, now) {
            Some(draw) => draw,
            None => {
                let (draw, renewal) =
                    match self.draw(&leases, &mut observer, place, want, check, now) {
                        Ok(drawn) => drawn,
                        Err(ask) => return Lookup::Miss(ask),
                    };
                drop(observer);
                if let Some(Renewal { ticket, runway_ms }) = renewal {
                    self.renew(host, context_id, check, ticket, runway_ms);
                }
                draw
            }
        };
        let remaining = draw.remaining();
        // Counted in bulk: a hostcall per request is a tenth of what a hit
        // costs.
        if let Some(hits) = self.lease_book.count_hit() {
            self.metrics.add(host, Stat::LeaseHits, hits as usize);
        }
        for applied in &check.global {
            self.rule_stats.admitted(host, applied, remaining);
        }
        self.decision_log
            .admitted(now, Source::Lease, &check.global, remaining);
        Lookup::Hit {
            remaining,
            reset_after_ms: draw.reset_at_ms.saturating_sub(now),
        }
    }

    /// Admits a request from a lease with `remaining` units left, its
    /// window whole again in `reset_after_ms`; `local`: its `scope: local`
    /// rules' admitted decision, if any.
    pub(super) fn lease_admit(
        &self,
        stream: &mut Stream,
        check: Rc<Check>,
        local: Option<&CheckResult>,
        remaining: u64,
        reset_after_ms: u64,
    ) -> Step {
        if local.is_some() {
            stream.hit = true;
            let result = hit_result(&check, remaining, reset_after_ms);
            return stream.apply(super::with_local(&self.config, &check, local, &result));
        }
        // The usual hit: its headers are made when they are added, from
        // the check it shares with the plan memo (nothing is allocated).
        let top = crate::headers::first_enforced(&check.global).unwrap_or(0);
        self.admit_hit(
            stream,
            HitHeaders {
                check,
                scope: Scope::Global,
                top,
                remaining,
                reset_after_ms,
            },
        )
    }

    /// A new draw from the check's slot for a request of the check's cost,
    /// the worker's last draw accounted for first, and the ticket of a
    /// renewal to ask for when the lease runs low (with how long what is
    /// left lasts at the check's pace); or, with no lease to
    /// draw from, `None`, and the request's call asks for one when `want`
    /// is not 0 and no other ask is out (the ask, in `Err`).
    #[inline(never)]
    fn draw<H: Host>(
        &self,
        leases: &Leases<'_, H>,
        observer: &mut Observer,
        place: Place,
        want: u64,
        check: &Check,
        now: u64,
    ) -> Result<(Draw, Option<Renewal>), Option<LeaseTicket>> {
        let Some(cost) = check.lease_cost() else {
            return Err(None);
        };
        let previous = observer.take_draw(place.fingerprint);
        // An ask is out until its answer may have come: a renewal may wait
        // for the tick first.
        let timeout = self.config.service.timeout_ms;
        let interval = leases.config.interval_ms;
        let ask_for = AskFor {
            miss_ms: timeout,
            renewal_ms: timeout.saturating_add(self.deferral_ms()),
            window_bound_interval_ms: lease_ends_with_window(check).then_some(interval),
        };
        let (take, kept, decided_at) = leases.take(place, cost, now, want, ask_for, previous);
        // Smaller after lost answers (see `ask_backoff`).
        let ticket = |want| LeaseTicket {
            place: decided_at,
            want: self.lease_book.asks.size(want),
            share: leases.config.share,
            asked_ms: now,
            renewal: false,
            id: self.lease_book.next_lease_id(),
        };
        if let Take::Hit(draw) | Take::Renew { draw, .. } = take {
            if let Some(other) = kept {
                let _ = leases.put_back(&other);
            }
            observer.keep_draw(place.fingerprint, draw);
            let renewal = match take {
                Take::Renew { units, held, .. } => {
                    // Timed at the check's pace, not by the units asked
                    // (a renewal near its window's end asks for less).
                    let runway_ms = time_to_miss_ms(held, cost, interval, want);
                    let ticket = LeaseTicket {
                        renewal: true,
                        ..ticket(units)
                    };
                    (ticket.want > 0).then_some(Renewal { ticket, runway_ms })
                }
                _ => None,
            };
            return Ok((draw, renewal));
        }
        if let Some(draw) = kept {
            observer.keep_draw(place.fingerprint, draw);
        }
        match take {
            Take::Miss { want } if want > 0 => Err(Some(ticket(want)).filter(|t| t.want > 0)),
            _ => Err(None),
        }
    }

    /// How long a renewal may wait for the root's tick: a tick period when
    /// the tick runs and group commit is on, else 0.
    fn deferral_ms(&self) -> u64 {
        match (self.lease_book.ticking, self.lease_tick_ms()) {
            (true, Some(tick)) => u64::from(tick),
            _ => 0,
        }
    }

    /// Asks for the next lease of a check whose lease runs low: a check of
    /// cost 0 (no request rides on it) that only asks for units. Its grant
    /// replaces the lease (see `Slot::install`); if it fails, the ask
    /// expires and the next request that finds the lease spent asks again.
    /// When the request that would miss is `runway_ms` away, half as long
    /// again as the wait or more, it waits for the next batch or the tick,
    /// with other checks' renewals (a call for many instead of one each);
    /// else it goes in the next batch.
    #[cold]
    #[inline(never)]
    fn renew(
        &self,
        host: &impl Host,
        context_id: u32,
        check: &Check,
        ticket: LeaseTicket,
        runway_ms: u64,
    ) {
        let mut renewal = check.clone();
        for applied in &mut renewal.global {
            applied.cost = 0;
        }
        renewal.local.clear();
        renewal.lease = Some(ticket);
        self.metrics.bump(host, Stat::LeaseRenewals);
        let mut job = Job::Renew { check: renewal };
        let wait = self.deferral_ms();
        if wait > 0 && runway_ms >= wait.saturating_mul(3) / 2 {
            let deferred = Queued {
                context_id: self.root_context_id,
                job,
            };
            match self.outbox.defer(deferred) {
                None => return,
                // Too many wait already: this one goes now.
                Some(back) => job = back.job,
            }
        }
        if let Err(e) = self.send_job(host, context_id, job) {
            if let Some(skipped) = self.error_log.allow(host.now_ms()) {
                warn!("cannot renew a lease ({e}); the next request asks ({skipped} similar lines suppressed)");
            }
        }
    }

    /// An admitted answer granted a lease: its units go in the check's
    /// slot (or straight back when the slot still holds units).
    /// `context_id` is the current stream's (the context to return to).
    pub(super) fn install_lease(
        &self,
        host: &impl Host,
        now: u64,
        context_id: u32,
        check: &Check,
        result: &mut CheckResult,
    ) {
        // Never more than was asked, whatever the answer says.
        let Some(ticket) = check.lease else {
            return;
        };
        let units = result.leased.min(ticket.want);
        if units == 0 || !result.allowed {
            return;
        }
        let left_beyond = result.limits.iter().map(|s| s.remaining).min();
        let Some(receipts) = result.receipts.clone() else {
            // Not from this meshlimitd's script: nothing to return them by.
            return;
        };
        let Some(leases) = self.leases(host, now) else {
            return;
        };
        let lifetime = lease_lifetime(check, result, &receipts, leases.config.interval_ms);
        let reset = result.limits.iter().map(|s| s.reset_after_ms).max();
        let lease_id = self.lease_book.next_lease_id();
        let outlives_expiry = !expiry_ends_every_window(check, result);
        let grant = Grant {
            renewal: ticket.renewal,
            lease_id,
            units,
            expires_ms: ticket.asked_ms.saturating_add(lifetime.unwrap_or(0)),
            reset_at_ms: ticket.asked_ms.saturating_add(reset.unwrap_or(0)),
            beyond: left_beyond.unwrap_or(0),
            outlives_expiry,
        };
        let room = self.lease_book.records.borrow().len() < leases.config.slots as usize;
        if room && lifetime.is_some() && leases.install(ticket.place, grant, now) {
            self.metrics.bump(host, Stat::LeaseGrants);
            self.metrics.add(host, Stat::LeaseUnits, units as usize);
            let mut records = self.lease_book.records.borrow_mut();
            // A grant may replace a lease this worker installed there:
            // look at that one on the next tick, not when it was due.
            look_at_next_tick(&mut records, ticket.place.slot);
            records.push(LeaseRecord {
                slot: ticket.place.slot,
                lease_id,
                check: check.clone(),
                receipts,
                expiry_ends_every_window: !outlives_expiry,
                look_at_ms: 0,
            });
            return;
        }
        // The slot still holds units (another worker's lease came first):
        // these go back at once.
        let settlement = self.lease_return(check, units, &receipts);
        self.send_returns(host, context_id, vec![settlement]);
    }

    /// Puts `draws` (each with its check's fingerprint) back in their
    /// slots; one whose slot cannot be written is kept, to go back on a
    /// later tick.
    pub(super) fn put_back_draws<H: Host>(&self, leases: &Leases<'_, H>, draws: Vec<(u64, Draw)>) {
        for (fingerprint, draw) in draws {
            if leases.put_back(&draw).is_err() {
                self.lease_book
                    .observer
                    .borrow_mut()
                    .keep_draw(fingerprint, draw);
            }
        }
    }

    /// The root's tick: this worker's draws that idled (no hit since the
    /// last tick) or expired go back to their slots, then leases this
    /// worker installed that expired or went idle give their units back.
    pub(super) fn lease_tick(&self, host: &impl Host) {
        // Also the clock the next hits reuse.
        let now = self.hits.clock.read(host);
        let (Some(leases), Some(tick_ms)) = (self.leases(host, now), self.lease_tick_ms()) else {
            return;
        };
        let due = self
            .lease_book
            .observer
            .borrow_mut()
            .due_draws(now, u64::from(tick_ms));
        self.put_back_draws(&leases, due);
        let returns = self.reclaim_records(&leases, now, Due::Idle);
        self.queue_returns(host, returns);
        self.add_lease_counts(host);
        // Failed returns too, once a call got through since they failed.
        self.pump_returns(host, self.root_context_id, true);
        // The tick runs as the root: send the returns now rather than at
        // the wake-up, and the renewals that waited for the tick.
        self.flush_deferred(host, now);
    }

    /// The lease hits counted in bulk since the last time, and the units
    /// the lease slots dropped as this worker wrote them, added to their
    /// stats; a drop is logged too (rate-limited).
    pub(super) fn add_lease_counts(&self, host: &impl Host) {
        let hits = self.lease_book.take_hits();
        if hits > 0 {
            self.metrics.add(host, Stat::LeaseHits, hits as usize);
        }
        let dropped = self.lease_book.dropped.take();
        if dropped == 0 {
            return;
        }
        self.metrics
            .add(host, Stat::LeaseUnitsDropped, dropped as usize);
        if let Some(skipped) = self.error_log.allow(host.now_ms()) {
            warn!(
                "{dropped} leased units dropped before their owners gave them back (their ticks came late); they stay charged until their windows end ({skipped} similar lines suppressed)"
            );
        }
    }

    /// A lease ask or a reservation whose answer was lost (a timeout, a
    /// 503, a failed connection: its script may have run): kept, and
    /// named in a call once one succeeds, so that what it was charged goes
    /// back (see `LeaseAsk::id`, `Check::id`: the request was decided
    /// without meshlimitd).
    pub(super) fn ask_lost(&self, host: &impl Host, check: &Check, now: u64) {
        let wire = check.to_wire();
        let (id, stat) = match wire.lease.map(|a| a.id).filter(|id| *id != 0) {
            Some(id) => (id, Stat::LeaseAsksLost),
            None if wire.id != 0 => (wire.id, Stat::ReservationsLost),
            None => return,
        };
        let lost = meshlimit_protocol::LostAsk {
            subject: wire.subject,
            limits: wire.limits,
            id,
        };
        self.metrics.bump(host, stat);
        self.lease_book.note_lost([lost], now);
    }

    /// A call succeeded: the lost asks kept are named in the worker's next
    /// call. `context_id` is the context whose callback runs now.
    pub(super) fn send_lost(&self, host: &impl Host, context_id: u32, now: u64) {
        let asks = self.lease_book.take_lost(now);
        if asks.is_empty() {
            return;
        }
        if let Err(Refused(asks)) = self.send_lost_job(host, context_id, asks) {
            self.lease_book.note_lost(asks, now);
        }
    }

    /// The root's tick: asks lost at least [`NAME_ON_TICK_AFTER_MS`] ago
    /// that no call of this worker has named since (its traffic may have
    /// gone to its Envoy's other workers, or stopped) go in a call of
    /// their own, once the breaker says meshlimitd answers again.
    pub(super) fn name_lost_on_tick(&self, host: &impl Host) {
        let Some(lost_at) = self.lease_book.oldest_lost_ms() else {
            return;
        };
        let now = host.now_ms();
        let waited = now.saturating_sub(lost_at) >= NAME_ON_TICK_AFTER_MS;
        // Read only: `gate` would make the tick a half-open breaker's one
        // probe, and no request could probe while asks wait (a Redis
        // outage's recovery then waited for them to expire).
        if waited && self.guard.breaker_closed(host) {
            self.send_lost(host, self.root_context_id, now);
        }
    }

    fn send_lost_job(
        &self,
        host: &impl Host,
        context_id: u32,
        asks: Vec<meshlimit_protocol::LostAsk>,
    ) -> Result<(), Refused> {
        let kept = asks.clone();
        self.send_job(host, context_id, Job::Lost { asks })
            .map_err(|_| Refused(kept))
    }
}

/// A lost ask waits this long for a call of its worker's traffic to name
/// it before the tick sends it alone (a call that fails keeps it).
const NAME_ON_TICK_AFTER_MS: u64 = 500;

/// Lost asks whose job could not be queued, kept for the next call.
struct Refused(Vec<meshlimit_protocol::LostAsk>);

/// The leases this worker installed in `slot` are looked at on its next
/// tick, whenever they were due.
pub(super) fn look_at_next_tick(records: &mut [LeaseRecord], slot: u64) {
    for record in records.iter_mut().filter(|r| r.slot == slot) {
        record.look_at_ms = 0;
    }
}

/// The result of a request admitted from a lease: `left` units remain
/// for the client (see [`Lookup::Hit`]), on every limit.
pub(super) fn hit_result(check: &Check, left: u64, reset_after_ms: u64) -> CheckResult {
    CheckResult {
        allowed: true,
        limits: check
            .global
            .iter()
            .map(|a| a.admitted(left, reset_after_ms))
            .collect(),
        receipts: None,
        leased: 0,
    }
}

/// Whether a lease of `check` ends with the window it was charged to (see
/// [`lease_lifetime`]): every limit's units belong to a window. A token
/// bucket's lease lasts an interval from its grant.
fn lease_ends_with_window(check: &Check) -> bool {
    check.global.iter().all(|a| {
        matches!(
            a.limit.algorithm.lease_life(),
            LeaseLife::UntilReset | LeaseLife::UntilWindowEnd
        )
    })
}

/// Whether a lease granted with `result` expires when every window it was
/// charged in ends: every limit is a fixed window, and all reset together
/// (see [`LeaseRecord::expiry_ends_every_window`]).
fn expiry_ends_every_window(check: &Check, result: &CheckResult) -> bool {
    let first_reset = result.limits.first().map(|s| s.reset_after_ms);
    check
        .global
        .iter()
        .all(|a| a.limit.algorithm.lease_life() == LeaseLife::UntilReset)
        && result
            .limits
            .iter()
            .all(|s| Some(s.reset_after_ms) == first_reset)
}

/// How long a lease may be used, from when it was asked: as long as each
/// limit's algorithm lets its units be spent ([`LeaseLife`]), the shortest
/// of the check's limits.
fn lease_lifetime(
    check: &Check,
    result: &CheckResult,
    receipts: &[Receipt],
    interval_ms: u64,
) -> Option<u64> {
    let clock_ms = receipts.first()?.clock_us / 1000;
    check
        .global
        .iter()
        .zip(&result.limits)
        .map(|(a, status)| match a.limit.algorithm.lease_life() {
            LeaseLife::UntilReset => Some(status.reset_after_ms),
            LeaseLife::UntilWindowEnd => {
                let window = a.limit.window_ms.max(1);
                Some(window - clock_ms % window)
            }
            // Never past the bucket's being full again (its reset): units
            // still held then would come on top of a whole burst.
            LeaseLife::OneInterval => Some(interval_ms.min(status.reset_after_ms)),
            LeaseLife::NotLeased => None,
        })
        .try_fold(u64::MAX, |least, l| Some(least.min(l?)))
        .filter(|&l| l > 0 && l < u64::MAX)
}
