//! A worker's view of how busy each check is, in its own memory (no
//! hostcall): the units each check asked for in the last interval size
//! its next lease, and the units the worker drew from a check's lease are
//! spent from here with no hostcall (see `crate::shared::lease`).

use crate::config::LeaseConfig;
use crate::shared::lease::Draw;

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
    /// Every draw this worker holds, taken out (to be put back).
    pub(crate) fn take_all_draws(&mut self) -> Vec<(u64, Draw)> {
        self.entries
            .iter_mut()
            .filter_map(|e| Some((e.fingerprint, e.draw.take()?)))
            .collect()
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: LeaseConfig = LeaseConfig {
        slots: 16,
        max_units: 1000,
        interval_ms: 1000,
        share: 2,
    };

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

    /// The size README.md and docs/leases.md give for each of
    /// `leases.slots` entries in a worker's memory.
    #[test]
    fn an_entry_is_as_large_as_the_docs_say() {
        assert_eq!(std::mem::size_of::<Seen>(), 104);
    }
}
