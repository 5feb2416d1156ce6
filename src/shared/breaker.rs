//! Circuit breaker around calls to meshlimitd, shared by every worker of an
//! Envoy through one shared-data key.
//!
//! Closed: every check calls meshlimitd. After `failures` consecutive failed
//! calls it opens for `open`, and decides by `failure_mode` without calling,
//! so an outage costs the local decision, not the call timeout. When the
//! interval ends, exactly one request probes (the CAS on the shared state
//! elects it); success closes the breaker, failure reopens it for twice as
//! long, up to `max_open`.

use super::keys::Keys;
use super::store::{le_word, le_words, retry_on_conflict, SharedStore, StoreError};
pub use crate::config::BreakerConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct State {
    consecutive_failures: u32,
    /// Until when calls are skipped (0: closed).
    open_until_ms: u64,
    /// The interval the next opening will last.
    next_open_ms: u64,
    /// A probe is in flight until then; others keep skipping.
    probe_until_ms: u64,
}

/// What to do with a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Closed: call.
    Call,
    /// Half-open and elected: call, and report how it went.
    Probe,
    /// Open: decide by `failure_mode` without calling.
    Skip,
}

/// What a reported outcome changed, for stats and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    None,
    Opened { for_ms: u64 },
    Closed,
}

pub struct Breaker<'a, S: SharedStore> {
    pub config: BreakerConfig,
    pub store: &'a S,
    pub(crate) keys: &'a Keys,
}

impl<S: SharedStore> Breaker<'_, S> {
    /// Whether this check may call meshlimitd now.
    pub fn gate(&self, now_ms: u64, call_timeout_ms: u64) -> Gate {
        retry_on_conflict(|| {
            let Ok((state, cas)) = self.load() else {
                // Shared data failing is no reason to stop limiting globally.
                return Ok(Gate::Call);
            };
            if state.open_until_ms == 0 {
                return Ok(Gate::Call);
            }
            // A deadline further off than the longest it can be was set
            // before the clock stepped back: it is over.
            let stepped_back = state.open_until_ms > now_ms.saturating_add(self.config.max_open_ms)
                || state.probe_until_ms > now_ms.saturating_add(2 * call_timeout_ms.max(1));
            if !stepped_back && (now_ms < state.open_until_ms || now_ms < state.probe_until_ms) {
                return Ok(Gate::Skip);
            }
            // Half-open: try to be the one probe.
            let next = State {
                probe_until_ms: now_ms + 2 * call_timeout_ms.max(1),
                open_until_ms: state.open_until_ms.min(now_ms).max(1),
                ..state
            };
            self.save(&next, cas).map(|()| Gate::Probe)
        })
        .unwrap_or(Gate::Skip)
    }

    /// Whether the breaker is closed, read without taking part in it: a
    /// half-open breaker's [`Breaker::gate`] makes its caller the one
    /// probe, which must then call.
    pub fn is_closed(&self) -> bool {
        self.load()
            .map_or(true, |(state, _)| state.open_until_ms == 0)
    }

    /// Records a call's outcome.
    pub fn record(&self, success: bool, now_ms: u64) -> Transition {
        retry_on_conflict(|| {
            let Ok((state, cas)) = self.load() else {
                return Ok(Transition::None);
            };
            let (next, transition) = if success {
                if state == State::default() {
                    return Ok(Transition::None);
                }
                let was_open = state.open_until_ms != 0;
                (
                    State::default(),
                    if was_open {
                        Transition::Closed
                    } else {
                        Transition::None
                    },
                )
            } else if state.open_until_ms != 0 && now_ms < state.open_until_ms {
                // A call that was in flight when the breaker opened: it says
                // nothing new. Only a failed probe (after the interval)
                // reopens it, for twice as long.
                return Ok(Transition::None);
            } else {
                let failures = state.consecutive_failures.saturating_add(1);
                let open_now = state.open_until_ms != 0 || failures >= self.config.failures;
                if open_now {
                    let for_ms = state
                        .next_open_ms
                        .max(self.config.open_ms)
                        .min(self.config.max_open_ms);
                    (
                        State {
                            consecutive_failures: failures,
                            open_until_ms: now_ms + for_ms,
                            next_open_ms: (for_ms * 2).min(self.config.max_open_ms),
                            probe_until_ms: 0,
                        },
                        Transition::Opened { for_ms },
                    )
                } else {
                    (
                        State {
                            consecutive_failures: failures,
                            ..state
                        },
                        Transition::None,
                    )
                }
            };
            self.save(&next, cas).map(|()| transition)
        })
        .unwrap_or(Transition::None)
    }

    fn load(&self) -> Result<(State, Option<u32>), StoreError> {
        let (bytes, cas) = self.store.get(self.keys.breaker())?;
        let word = |i: usize| bytes.as_deref().and_then(|b| le_word(b, i)).unwrap_or(0);
        Ok((
            State {
                consecutive_failures: word(0).min(u64::from(u32::MAX)) as u32,
                open_until_ms: word(1),
                next_open_ms: word(2),
                probe_until_ms: word(3),
            },
            cas,
        ))
    }

    fn save(&self, state: &State, cas: Option<u32>) -> Result<(), StoreError> {
        let words = le_words(&[
            u64::from(state.consecutive_failures),
            state.open_until_ms,
            state.next_open_ms,
            state.probe_until_ms,
        ]);
        self.store.set(self.keys.breaker(), &words, cas)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeStore;

    const CFG: BreakerConfig = BreakerConfig {
        failures: 3,
        open_ms: 250,
        max_open_ms: 1_000,
    };

    static KEYS: std::sync::LazyLock<Keys> = std::sync::LazyLock::new(|| Keys::new("test"));

    fn breaker(store: &FakeStore) -> Breaker<'_, FakeStore> {
        Breaker {
            config: CFG,
            store,
            keys: &KEYS,
        }
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let s = FakeStore::default();
        let b = breaker(&s);
        assert_eq!(b.record(false, 0), Transition::None);
        assert_eq!(b.record(false, 0), Transition::None);
        assert_eq!(b.record(true, 0), Transition::None);
        assert_eq!(b.gate(0, 20), Gate::Call, "a success resets the count");
        b.record(false, 10);
        b.record(false, 10);
        assert_eq!(b.record(false, 10), Transition::Opened { for_ms: 250 });
        assert_eq!(b.gate(11, 20), Gate::Skip);
        assert_eq!(b.gate(259, 20), Gate::Skip);
    }

    #[test]
    fn one_probe_when_the_interval_ends_and_success_closes() {
        let s = FakeStore::default();
        let b = breaker(&s);
        for _ in 0..3 {
            b.record(false, 0);
        }
        assert_eq!(b.gate(250, 20), Gate::Probe);
        assert_eq!(b.gate(251, 20), Gate::Skip, "only one probe at a time");
        assert_eq!(b.record(true, 260), Transition::Closed);
        assert_eq!(b.gate(261, 20), Gate::Call);
    }

    #[test]
    fn failed_probes_double_the_interval_up_to_the_cap() {
        let s = FakeStore::default();
        let b = breaker(&s);
        for _ in 0..3 {
            b.record(false, 0);
        }
        let mut now = 0;
        let mut intervals = Vec::new();
        for _ in 0..5 {
            // Wait until the probe is allowed, then fail it.
            while b.gate(now, 20) != Gate::Probe {
                now += 1;
            }
            if let Transition::Opened { for_ms } = b.record(false, now) {
                intervals.push(for_ms);
            }
        }
        assert_eq!(intervals, [500, 1_000, 1_000, 1_000, 1_000]);
    }

    /// Calls that were in flight when the breaker opened fail one after
    /// the other: they say nothing new, so the breaker stays open for
    /// `open`, not twice as long per late failure (up to `max_open`).
    #[test]
    fn late_failures_while_open_neither_extend_nor_double_it() {
        let s = FakeStore::default();
        let b = Breaker {
            keys: &Keys::new("test"),
            config: BreakerConfig {
                failures: 5,
                open_ms: 250,
                max_open_ms: 2_000,
            },
            store: &s,
        };
        let mut opened = Vec::new();
        for i in 0..8 {
            if let Transition::Opened { for_ms } = b.record(false, 100 + i) {
                opened.push(for_ms);
            }
        }
        assert_eq!(opened, [250]);
        assert_eq!(b.gate(349, 20), Gate::Skip);
        assert_eq!(
            b.gate(354, 20),
            Gate::Probe,
            "open for 250 ms from the 5th failure"
        );
        // The probe fails: now it doubles.
        assert_eq!(b.record(false, 360), Transition::Opened { for_ms: 500 });
    }

    /// The breaker runs on the wall clock, shared by every worker. When the
    /// clock steps back, a deadline further away than `max_open` can only
    /// be from before the step: it must not keep the breaker open that
    /// long.
    #[test]
    fn a_clock_stepping_back_does_not_keep_it_open() {
        let s = FakeStore::default();
        let b = breaker(&s);
        for _ in 0..3 {
            b.record(false, 10_000_000);
        }
        assert_eq!(b.gate(10_000_100, 20), Gate::Skip);
        // The clock steps back an hour: one probe, as after any interval.
        let back = 10_000_100 - 3_600_000;
        assert_eq!(b.gate(back, 20), Gate::Probe);
        assert_eq!(b.gate(back + 1, 20), Gate::Skip, "only one probe");
        assert_eq!(
            b.record(false, back + 5),
            Transition::Opened { for_ms: 500 }
        );
        assert_eq!(b.gate(back + 6, 20), Gate::Skip);
    }

    #[test]
    fn a_lost_probe_does_not_block_forever() {
        let s = FakeStore::default();
        let b = breaker(&s);
        for _ in 0..3 {
            b.record(false, 0);
        }
        assert_eq!(b.gate(300, 20), Gate::Probe);
        // The probe's stream vanished without an outcome: after twice the
        // call timeout another request may probe.
        assert_eq!(b.gate(339, 20), Gate::Skip);
        assert_eq!(b.gate(340, 20), Gate::Probe);
    }

    #[test]
    fn broken_shared_data_keeps_calling() {
        let s = FakeStore {
            broken: std::cell::Cell::new(true),
            ..FakeStore::default()
        };
        let b = breaker(&s);
        assert_eq!(b.record(false, 0), Transition::None);
        assert_eq!(b.gate(0, 20), Gate::Call);
    }
}
