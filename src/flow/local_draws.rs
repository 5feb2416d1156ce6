//! Local draws: units a worker takes ahead from a `scope: local` rule's
//! counter in shared data, so that a busy client's next requests on this
//! worker are admitted from the worker's own memory, with no shared-data
//! hostcall, as a lease hit is (stage 1 of `decide`). Measured side by
//! side (`make bench`, rows 19 and 20), a request counted in shared data
//! cost a read and a write of its slot more than a lease hit.
//!
//! What keeps a local rule exact:
//! - Every unit of a draw was charged to the counter, in the window it is
//!   spent in, before a request used it: draws never admit more than the
//!   limit.
//! - A draw is taken only from a counter with more than [`UNDRAWN_TAIL`]
//!   requests' worth left once its request is charged, and is at most
//!   1/[`DRAW_SHARE`] of what is left beyond that tail. The last units are
//!   counted one request at a time in shared data: a client whose
//!   requests move between workers is not refused while another worker
//!   holds units, and a small limit is never drawn from.
//! - A draw is spent only in the window it was charged to: by the hit
//!   clock (`clock`), read afresh within `NEAR_EXPIRY_MS` of the end.
//! - What a draw did not use goes back to the counter (settled as a
//!   reservation that cost nothing) on the root's tick once it idled or
//!   expired, and when its entry leaves the table.
//!
//! Which checks: `scope: local` rules alone (no global limit, no token
//! budget) with one enforced limit. Any other goes to shared data with
//! each request.

use std::cell::RefCell;
use std::rc::Rc;

use meshlimit_protocol::{Algorithm, LimitStatus};

use super::clock::NEAR_EXPIRY_MS;
use crate::check::{Applied, Check};
use crate::config::LimitConfig;

/// Checks a worker keeps draws for, at most.
const ENTRIES: usize = 256;
/// Requests' worth a counter keeps undrawn, counted one at a time.
const UNDRAWN_TAIL: u64 = 64;
/// A draw takes at most this fraction of what is left beyond the tail.
const DRAW_SHARE: u64 = 16;
/// Requests' worth in one draw, at most.
const MAX_DRAW: u64 = 256;
/// A client's second draw; each next one doubles, to [`MAX_DRAW`].
const FIRST_DRAW: u64 = 4;
/// A token bucket has no window: its draw is spent within this long.
const BUCKET_DRAW_MS: u64 = 1_000;

/// The limit a check's requests may be drawn for, if any.
pub(super) fn drawable(check: &Check) -> Option<&Applied> {
    match check.local.as_slice() {
        [only] if !only.shadow && check.global.is_empty() && check.tokens.is_none() => Some(only),
        _ => None,
    }
}

/// Units a worker holds for one check.
struct Entry {
    /// The check's counter, keyed as shared data keys it.
    fingerprint: u64,
    check: Rc<Check>,
    /// Left to spend.
    units: u64,
    /// Requests' worth the next draw asks for (0: the client is new here).
    want: u64,
    /// When the units were charged (their window), and when they expire.
    charged_ms: u64,
    expires_ms: u64,
    /// What the counter had left once the draw was charged.
    remaining: u64,
    reset_at_ms: u64,
    /// Spent from since the last tick.
    used: bool,
    last_ms: u64,
}

/// Units to give back to a counter: the check, the units, and when they
/// were charged.
pub(super) type GiveBack = (Rc<Check>, u64, u64);

/// What the worker's draw says for a request.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Spend {
    /// Admitted from the draw: the units left as this worker sees them.
    Hit { remaining: u64, reset_after_ms: u64 },
    /// The draw may be past its window by the reused clock: read it.
    NeedsClock,
    /// No units here: counted in shared data, drawing `want` requests'
    /// worth more if the counter has room.
    Miss { want: u64 },
}

pub(super) struct LocalDraws {
    entries: RefCell<Vec<Entry>>,
    /// Draw hits not yet added to `local_allowed`.
    hits: super::bulk::BulkCount,
    /// The root's tick runs: without it, units would not go back once
    /// idle, so nothing is drawn.
    ticking: bool,
}

impl LocalDraws {
    pub(super) fn new(ticking: bool) -> LocalDraws {
        LocalDraws {
            entries: RefCell::default(),
            hits: super::bulk::BulkCount::default(),
            ticking,
        }
    }

    /// Spends `cost` from the draw for `fingerprint` at `now` (`reused`:
    /// the worker's last clock read).
    pub(super) fn spend(&self, fingerprint: u64, cost: u64, now: u64, reused: bool) -> Spend {
        let mut entries = self.entries.borrow_mut();
        let Some(entry) = entries.iter_mut().find(|e| e.fingerprint == fingerprint) else {
            return Spend::Miss { want: 0 };
        };
        if !self.ticking {
            return Spend::Miss { want: 0 };
        }
        let live = entry.units >= cost && now < entry.expires_ms;
        if !live {
            let want = entry.want.saturating_mul(2).clamp(FIRST_DRAW, MAX_DRAW);
            return Spend::Miss { want };
        }
        if reused && now.saturating_add(NEAR_EXPIRY_MS) >= entry.expires_ms {
            return Spend::NeedsClock;
        }
        entry.units -= cost;
        entry.used = true;
        entry.last_ms = now;
        Spend::Hit {
            remaining: entry.remaining.saturating_add(entry.units),
            reset_after_ms: entry.reset_at_ms.saturating_sub(now),
        }
    }

    /// The units a draw for `want` requests of `cost` takes from a
    /// counter with `remaining` left once the request is charged.
    pub(super) fn draw_size(want: u64, cost: u64, remaining: u64) -> u64 {
        let cost = cost.max(1);
        let room = remaining.saturating_sub(UNDRAWN_TAIL.saturating_mul(cost)) / DRAW_SHARE;
        let units = want.saturating_mul(cost).min(room);
        units - units % cost
    }

    /// Keeps what a request counted in shared data drew (`drawn` units,
    /// maybe none) for the check's next requests, its counter reporting
    /// `status`; a new client gets an entry that draws next time. The
    /// units of a replaced or evicted draw, to give back.
    pub(super) fn record(
        &self,
        (fingerprint, check): (u64, &Rc<Check>),
        (want, drawn): (u64, u64),
        status: &LimitStatus,
        now: u64,
    ) -> Option<GiveBack> {
        let applied = drawable(check).filter(|_| self.ticking)?;
        let fresh = Entry {
            fingerprint,
            check: Rc::clone(check),
            units: drawn,
            want,
            charged_ms: now,
            expires_ms: draw_expiry(&applied.limit, now),
            remaining: status.remaining,
            reset_at_ms: now.saturating_add(status.reset_after_ms),
            used: true,
            last_ms: now,
        };
        let mut entries = self.entries.borrow_mut();
        let slot = match entries.iter().position(|e| e.fingerprint == fingerprint) {
            Some(i) => i,
            None if entries.len() < ENTRIES => {
                entries.push(fresh);
                return None;
            }
            // Full: the least recently used entry leaves.
            None => entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_ms)
                .map_or(0, |(i, _)| i),
        };
        let old = std::mem::replace(entries.get_mut(slot)?, fresh);
        (old.units > 0).then_some((old.check, old.units, old.charged_ms))
    }

    /// The root's tick: draws that idled since the last tick, or expired,
    /// give their units back (the next draw of such a client is smaller).
    pub(super) fn tick(&self, now: u64) -> Vec<GiveBack> {
        let mut back = Vec::new();
        for entry in self.entries.borrow_mut().iter_mut() {
            if entry.units > 0 && (!entry.used || now >= entry.expires_ms) {
                back.push((Rc::clone(&entry.check), entry.units, entry.charged_ms));
                entry.units = 0;
                entry.want /= 2;
            }
            entry.used = false;
        }
        back
    }

    /// Every draw's units, idle or not (the worker is going away).
    pub(super) fn take_all(&self) -> Vec<GiveBack> {
        let mut back = Vec::new();
        for entry in self.entries.borrow_mut().iter_mut() {
            if entry.units > 0 {
                back.push((Rc::clone(&entry.check), entry.units, entry.charged_ms));
                entry.units = 0;
            }
        }
        back
    }

    /// Counts a hit; the hits to add to their stat now, if any (in bulk,
    /// as lease hits are).
    pub(super) fn count_hit(&self) -> Option<u64> {
        self.hits.count()
    }

    /// The hits not yet added to their stat (the tick adds them).
    pub(super) fn take_hits(&self) -> u64 {
        self.hits.take()
    }

    /// Units held, over every entry (tests).
    #[cfg(test)]
    pub(super) fn held(&self) -> u64 {
        self.entries.borrow().iter().map(|e| e.units).sum()
    }
}

/// When units drawn at `now` on `limit` stop being spendable: the end of
/// the window they were charged to.
fn draw_expiry(limit: &LimitConfig, now: u64) -> u64 {
    let window = limit.window_ms.max(1);
    match (limit.algorithm, &limit.calendar) {
        (Algorithm::TokenBucket, _) => now.saturating_add(BUCKET_DRAW_MS),
        (Algorithm::FixedWindow, Some(calendar)) => calendar.window(now).1,
        _ => (now / window).saturating_add(1).saturating_mul(window),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draw_keeps_the_tail_and_takes_a_share_of_the_rest_in_whole_requests() {
        assert_eq!(LocalDraws::draw_size(4, 1, 20), 0, "a small limit");
        assert_eq!(LocalDraws::draw_size(4, 1, 64 + 15), 0);
        assert_eq!(LocalDraws::draw_size(4, 1, 64 + 16), 1);
        assert_eq!(LocalDraws::draw_size(4, 1, 1_000_000), 4);
        assert_eq!(LocalDraws::draw_size(256, 1, 1_000_000), 256);
        assert_eq!(LocalDraws::draw_size(256, 3, 192 + 16 * 10), 9);
        assert_eq!(LocalDraws::draw_size(0, 1, 1_000_000), 0, "a new client");
    }
}
