//! The counting algorithms for the local fallback, as pure functions of a
//! small fixed-size state, so they fit the fixed shared-data slots.
//!
//! They follow the definitions of meshlimitd's Lua script (see
//! `service/src/lua/decide.lua`), with one exception: the sliding window log
//! needs memory proportional to its limit, which a fixed slot cannot hold,
//! so during a fallback it is approximated by the sliding window counter.

use meshlimit_protocol::Algorithm;

/// Per-client state in one slot entry. Meaning by algorithm:
/// fixed window `(window, count, -)`, sliding window counter
/// `(window, current, previous)`, token bucket `(TAT in µs, -, -)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    pub a: u64,
    pub b: u64,
    pub c: u64,
}

/// The limit as the algorithms need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    pub algorithm: Algorithm,
    pub requests: u64,
    pub window_ms: u64,
    /// Token bucket capacity (`requests` when the limit sets no burst).
    pub burst: u64,
    /// Fixed window only: calendar edges instead of `window_ms` ones.
    pub calendar: Option<meshlimit_protocol::Calendar>,
}

/// The decision for one limit, and the state to store if it is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub fits: bool,
    pub remaining: u64,
    pub reset_after_ms: u64,
    pub retry_after_ms: u64,
    /// State after charging; only stored when the whole check is admitted.
    pub charged: State,
}

pub fn evaluate(p: &Params, state: State, cost: u64, now_ms: u64) -> Outcome {
    let window = p.window_ms.max(1);
    match p.algorithm {
        Algorithm::FixedWindow => {
            // A window is named by its start: its number, or for a
            // calendar window the millisecond it starts.
            let (idx, reset) = match &p.calendar {
                Some(calendar) => {
                    let (start, end) = calendar.window(now_ms);
                    (start, end.saturating_sub(now_ms).max(1))
                }
                None => (now_ms / window, window - now_ms % window),
            };
            let used = if state.a == idx { state.b } else { 0 };
            let fits = used.saturating_add(cost) <= p.requests;
            let after = if fits { used + cost } else { used };
            Outcome {
                fits,
                remaining: p.requests.saturating_sub(after),
                reset_after_ms: reset,
                retry_after_ms: if fits { 0 } else { reset },
                charged: State {
                    a: idx,
                    b: used + cost,
                    c: 0,
                },
            }
        }
        Algorithm::SlidingWindowCounter | Algorithm::SlidingWindowLog => {
            sliding_counter(p, state, cost, now_ms, window)
        }
        Algorithm::TokenBucket => token_bucket(p, state, cost, now_ms),
    }
}

fn sliding_counter(p: &Params, state: State, cost: u64, now_ms: u64, window: u64) -> Outcome {
    let idx = now_ms / window;
    let (cur, prev) = if state.a == idx {
        (state.b, state.c)
    } else if state.a + 1 == idx {
        (0, state.b)
    } else {
        (0, 0)
    };
    let into = now_ms % window;
    let limit = p.requests as f64;
    let (w, curf, prevf, costf) = (window as f64, cur as f64, prev as f64, cost as f64);
    let used = prevf * (w - into as f64) / w + curf;
    let fits = used + costf <= limit;
    let retry = if fits || cost > p.requests {
        0
    } else if cur + cost <= p.requests && prev > 0 {
        let f = 1.0 - (limit - curf - costf) / prevf;
        ((f * w - into as f64).ceil() as u64).max(1)
    } else {
        let f = if cur > 0 {
            (1.0 - (limit - costf) / curf).max(0.0)
        } else {
            0.0
        };
        ((w - into as f64 + f * w).ceil() as u64).max(1)
    };
    let (after_used, after_cur) = if fits {
        (used + costf, cur + cost)
    } else {
        (used, cur)
    };
    let reset = if after_cur > 0 {
        2 * window - into
    } else if prev > 0 {
        window - into
    } else {
        0
    };
    Outcome {
        fits,
        remaining: (limit - after_used).max(0.0).floor() as u64,
        reset_after_ms: reset,
        retry_after_ms: retry,
        charged: State {
            a: idx,
            b: cur + cost,
            c: prev,
        },
    }
}

/// The state after a reservation of `reserved` units, charged at
/// `charged_ms`, turned out to cost `actual`: the difference is taken from
/// (or added to) what that charge wrote, as meshlimitd's `settle.lua`
/// does. A window that has passed is left alone (its units are spent).
pub fn settle(
    p: &Params,
    state: State,
    reserved: u64,
    actual: u64,
    charged_ms: u64,
    now_ms: u64,
) -> State {
    let window = p.window_ms.max(1);
    let adjust = |count: u64| count.saturating_add(actual).saturating_sub(reserved);
    match p.algorithm {
        Algorithm::FixedWindow => {
            let idx = match &p.calendar {
                Some(calendar) => calendar.window(charged_ms).0,
                None => charged_ms / window,
            };
            if state.a == idx {
                State {
                    b: adjust(state.b),
                    ..state
                }
            } else {
                state
            }
        }
        Algorithm::SlidingWindowCounter | Algorithm::SlidingWindowLog => {
            let idx = charged_ms / window;
            if state.a == idx {
                State {
                    b: adjust(state.b),
                    ..state
                }
            } else if state.a == idx + 1 {
                State {
                    c: adjust(state.c),
                    ..state
                }
            } else {
                state
            }
        }
        Algorithm::TokenBucket => {
            let now_us = now_ms.saturating_mul(1000);
            let t = p.window_ms as f64 * 1000.0 / p.requests.max(1) as f64;
            let tat = state.a as f64 + (actual as f64 - reserved as f64) * t;
            State {
                a: if actual >= reserved {
                    tat.ceil() as u64
                } else {
                    // Given back, but never earlier than now: a bucket
                    // holds no more than its burst.
                    (tat.ceil() as u64).max(now_us)
                },
                ..state
            }
        }
    }
}

/// GCRA: `T = window / requests`; a request of cost k fits when
/// `max(TAT, now) + k*T - burst*T <= now`.
fn token_bucket(p: &Params, state: State, cost: u64, now_ms: u64) -> Outcome {
    let now_us = now_ms.saturating_mul(1000) as f64;
    let t = p.window_ms as f64 * 1000.0 / p.requests.max(1) as f64;
    let tat = (state.a as f64).max(now_us);
    let new_tat = tat + t * cost as f64;
    let allow_at = new_tat - t * p.burst as f64;
    let fits = allow_at <= now_us;
    let after = if fits { new_tat } else { tat };
    Outcome {
        fits,
        remaining: ((t * p.burst as f64 - (after - now_us)) / t)
            .max(0.0)
            .floor() as u64,
        reset_after_ms: ((after - now_us) / 1000.0).ceil().max(0.0) as u64,
        retry_after_ms: if fits || cost > p.burst {
            0
        } else {
            ((allow_at - now_us) / 1000.0).ceil() as u64
        },
        charged: State {
            a: new_tat.ceil() as u64,
            b: 0,
            c: 0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(algorithm: Algorithm, requests: u64, window_ms: u64, burst: u64) -> Params {
        Params {
            algorithm,
            requests,
            window_ms,
            burst,
            calendar: None,
        }
    }

    /// Runs requests at the given times, storing state on admission.
    fn run(p: &Params, times: &[u64]) -> Vec<bool> {
        let mut state = State::default();
        times
            .iter()
            .map(|&now| {
                let o = evaluate(p, state, 1, now);
                if o.fits {
                    state = o.charged;
                }
                o.fits
            })
            .collect()
    }

    /// During a fallback a calendar window still ends on its calendar edge
    /// (here 2028-03-01T00:00+02:00), as meshlimitd's script has it.
    #[test]
    fn calendar_windows_reset_on_the_calendar_edge() {
        let calendar = meshlimit_protocol::Calendar {
            unit: meshlimit_protocol::CalendarUnit::Month,
            utc_offset_minutes: 120,
        };
        let p = Params {
            calendar: Some(calendar),
            ..params(Algorithm::FixedWindow, 2, 31 * 86_400_000, 2)
        };
        let march: u64 = 1_835_474_400_000;
        let admitted = run(
            &p,
            &[march - 2_000, march - 1_000, march - 1, march, march + 1],
        );
        assert_eq!(admitted, [true, true, false, true, true]);
        let o = evaluate(&p, State::default(), 1, march - 1_000);
        assert_eq!(o.reset_after_ms, 1_000);
    }

    #[test]
    fn fixed_window_allows_a_burst_on_each_side_of_an_edge() {
        let p = params(Algorithm::FixedWindow, 3, 1000, 3);
        let admitted = run(
            &p,
            &[
                10_990, 10_991, 10_992, 10_993, 11_000, 11_001, 11_002, 11_003,
            ],
        );
        assert_eq!(admitted, [true, true, true, false, true, true, true, false]);
    }

    #[test]
    fn sliding_counter_weighs_the_previous_window() {
        let p = params(Algorithm::SlidingWindowCounter, 10, 1000, 10);
        let mut state = State::default();
        for _ in 0..10 {
            let o = evaluate(&p, state, 1, 10_000);
            assert!(o.fits);
            state = o.charged;
        }
        // Half-way through the next window, half of the 10 still count.
        let mut admitted = 0;
        for _ in 0..10 {
            let o = evaluate(&p, state, 1, 11_500);
            if o.fits {
                admitted += 1;
                state = o.charged;
            }
        }
        assert_eq!(admitted, 5);
        let denied = evaluate(&p, state, 1, 11_500);
        assert!(!denied.fits);
        // 5 (prev weighted at 0.5) + 5 cur + 1 > 10 until the previous
        // window's weight drops below 0.4, i.e. at 11_600.
        assert_eq!(denied.retry_after_ms, 100);
        assert!(evaluate(&p, state, 1, 11_600).fits);
    }

    #[test]
    fn token_bucket_spaces_requests_and_honours_burst() {
        // 10 per second, burst 3: three at once, then one every 100 ms.
        let p = params(Algorithm::TokenBucket, 10, 1000, 3);
        let mut state = State::default();
        let now = 50_000;
        for i in 0..3 {
            let o = evaluate(&p, state, 1, now);
            assert!(o.fits, "burst request {i}");
            state = o.charged;
        }
        let denied = evaluate(&p, state, 1, now);
        assert!(!denied.fits);
        assert_eq!(denied.retry_after_ms, 100);
        assert_eq!(denied.remaining, 0);
        assert!(!evaluate(&p, state, 1, now + 99).fits);
        let later = evaluate(&p, state, 1, now + 100);
        assert!(later.fits);
        // A full refill takes burst * T.
        assert_eq!(evaluate(&p, state, 1, now).reset_after_ms, 300);
    }

    #[test]
    fn cost_counts_as_several_requests() {
        let p = params(Algorithm::FixedWindow, 10, 1000, 10);
        let o = evaluate(&p, State::default(), 5, 0);
        assert!(o.fits);
        assert_eq!(o.remaining, 5);
        assert!(!evaluate(&p, State::default(), 11, 0).fits);
        let tb = params(Algorithm::TokenBucket, 10, 1000, 10);
        let o = evaluate(&tb, State::default(), 11, 0);
        assert!(!o.fits);
        assert_eq!(o.retry_after_ms, 0, "waiting never makes 11 fit in 10");
    }

    /// A refund takes back what the reservation charged, in its window;
    /// a charge beyond it adds the difference; a passed window stays.
    #[test]
    fn settling_adjusts_the_window_that_was_charged() {
        let f = params(Algorithm::FixedWindow, 100, 1000, 100);
        let charged = evaluate(&f, State::default(), 50, 5_100).charged;
        assert_eq!(settle(&f, charged, 50, 10, 5_100, 5_200).b, 10);
        assert_eq!(settle(&f, charged, 50, 70, 5_100, 5_200).b, 70);
        assert_eq!(settle(&f, charged, 50, 0, 4_100, 5_200), charged);
        let c = params(Algorithm::SlidingWindowCounter, 100, 1000, 100);
        let next = State { a: 6, b: 0, c: 50 };
        assert_eq!(settle(&c, next, 50, 20, 5_100, 6_100).c, 20);
        let tb = params(Algorithm::TokenBucket, 10, 1000, 10);
        let charged = evaluate(&tb, State::default(), 5, 50_000).charged;
        let back = settle(&tb, charged, 5, 1, 50_000, 50_000);
        assert_eq!(evaluate(&tb, back, 1, 50_000).remaining, 8);
        assert_eq!(settle(&tb, charged, 5, 0, 50_000, 60_000).a, 60_000_000);
    }

    #[test]
    fn stale_state_is_ignored() {
        let p = params(Algorithm::SlidingWindowCounter, 2, 1000, 2);
        let old = State { a: 3, b: 2, c: 2 };
        assert!(evaluate(&p, old, 2, 9_000).fits);
        let f = params(Algorithm::FixedWindow, 2, 1000, 2);
        assert!(evaluate(&f, State { a: 3, b: 2, c: 0 }, 2, 9_000).fits);
    }
}
