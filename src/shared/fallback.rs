//! Per-Envoy fallback counters in proxy-wasm shared data.
//!
//! Used when `meshlimitd` cannot be asked (`failure_mode: local`). Shared
//! data never expires, so the counters live in a fixed set of keys
//! (`slots`), each a small bucket of [`WAYS`] entries; a client is found in
//! its slot by a 64-bit fingerprint. Memory is `slots * WAYS * 40` bytes
//! whatever the number of clients. When a bucket is full, the least recently
//! used entry is evicted: under a flood of invented ids the fallback forgets
//! counts (admits more) rather than charging one client for another's
//! requests. The counting itself is [`crate::algorithms`].
//!
//! Fingerprints are keyed with a per-Envoy random seed
//! ([`super::store::fingerprint`]) so that a client cannot craft ids that
//! collide with a victim's.

use meshlimit_protocol::{CheckResult, LimitStatus};

use super::keys::Keys;
use super::store::{self, le_word, le_words, retry_on_conflict, Purpose, SharedStore, StoreError};
use crate::algorithms::{self, Params, State};
use crate::check::Applied;

/// Entries per slot.
pub const WAYS: usize = 4;
const ENTRY_LEN: usize = 40;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Entry {
    fingerprint: u64,
    state: State,
    /// Last use (ms); the least recently used entry is evicted.
    touched: u64,
}

/// Decisions of the local fallback.
pub struct LocalLimiter<'k> {
    slots: u32,
    seed: (u64, u64),
    keys: &'k Keys,
}

/// A local decision, and whether shared data let us count it properly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalDecision {
    pub result: CheckResult,
    /// Shared data failed or stayed contended: the request was admitted
    /// without being counted.
    pub degraded: bool,
}

impl<'k> LocalLimiter<'k> {
    pub fn new(slots: u32, seed: (u64, u64), keys: &'k Keys) -> Self {
        LocalLimiter {
            slots: slots.max(1),
            seed,
            keys,
        }
    }

    /// The key of `applied`'s counter (a keyed fingerprint of its limit
    /// and subject), as its slot finds it.
    pub fn fingerprint(&self, applied: &Applied) -> u64 {
        store::fingerprint(
            self.seed,
            Purpose::Fallback,
            &*applied.limit,
            &applied.subject,
        )
    }

    /// `applied`'s counter: its fingerprint, and the shared-data key of
    /// the slot it lives in.
    fn place(&self, applied: &Applied) -> (u64, String) {
        let fingerprint = self.fingerprint(applied);
        let key = self
            .keys
            .fallback_slot(store::slot(fingerprint, self.slots));
        (fingerprint, key)
    }

    /// Decides every limit (each for its own subject), all or nothing:
    /// nothing is charged unless every enforced limit admits the request.
    /// Shadow limits are decided and charged like the others but never
    /// deny.
    pub fn check(
        &self,
        store: &impl SharedStore,
        limits: &[Applied],
        now_ms: u64,
    ) -> LocalDecision {
        self.check_drawing(store, limits, now_ms, |_| 0).0
    }

    /// As [`LocalLimiter::check`], and for a check of one limit that fits,
    /// also charges `draw(remaining)` more units (what the limit has left
    /// once the request is charged; 0 for none), which the caller then
    /// holds: a worker's draw (`crate::flow::local_draws`). The units
    /// drawn, counted in the result's `remaining`.
    pub fn check_drawing(
        &self,
        store: &impl SharedStore,
        limits: &[Applied],
        now_ms: u64,
        draw: impl Fn(u64) -> u64,
    ) -> (LocalDecision, u64) {
        if let Ok((result, drawn)) =
            retry_on_conflict(|| self.try_check(store, limits, now_ms, &draw))
        {
            let decision = LocalDecision {
                result,
                degraded: false,
            };
            return (decision, drawn);
        }
        // Fail open, visibly: the caller counts and logs degraded decisions.
        let decision = LocalDecision {
            result: CheckResult {
                allowed: true,
                limits: limits
                    .iter()
                    .map(|a| a.admitted(a.limit.requests.saturating_sub(a.cost), a.limit.window_ms))
                    .collect(),
                receipts: None,
                leased: 0,
            },
            degraded: true,
        };
        (decision, 0)
    }

    fn try_check(
        &self,
        store: &impl SharedStore,
        limits: &[Applied],
        now_ms: u64,
        draw: &dyn Fn(u64) -> u64,
    ) -> Result<(CheckResult, u64), StoreError> {
        /// One shared-data key this check reads and may write. Limits whose
        /// entries share a key update the same copy and write it once: two
        /// writes with one CAS token would make the second fail, and the
        /// retry would charge the first limit again.
        struct Slot {
            key: String,
            cas: Option<u32>,
            entries: [Entry; WAYS],
            charged: bool,
        }
        let mut slots: Vec<Slot> = Vec::with_capacity(limits.len());
        let mut statuses = Vec::with_capacity(limits.len());
        let mut allowed = true;
        let mut drawn = 0;
        for applied in limits {
            let limit = &applied.limit;
            let (fingerprint, key) = self.place(applied);
            let index = match slots.iter().position(|s| s.key == key) {
                Some(index) => index,
                None => {
                    let (bytes, cas) = store.get(&key)?;
                    slots.push(Slot {
                        key,
                        cas,
                        entries: decode(bytes.as_deref()),
                        charged: false,
                    });
                    slots.len() - 1
                }
            };
            let Some(slot) = slots.get_mut(index) else {
                return Err(StoreError::Failed);
            };
            let (way, current) = find_or_evict(&slot.entries, fingerprint);
            let state = if current.fingerprint == fingerprint {
                current.state
            } else {
                State::default()
            };
            let draw = if limits.len() == 1 { draw } else { &|_| 0 };
            let outcome;
            (outcome, drawn) =
                evaluate_drawing(&params(limit), state, (applied.cost, now_ms), draw);
            if !outcome.fits && !applied.shadow {
                allowed = false;
            }
            statuses.push(LimitStatus {
                allowed: outcome.fits,
                limit: limit.requests,
                remaining: outcome.remaining,
                reset_after_ms: outcome.reset_after_ms,
                retry_after_ms: outcome.retry_after_ms,
                shadow: applied.shadow,
                reason: None,
            });
            if outcome.fits {
                // Written only if the whole check is admitted.
                if let Some(e) = slot.entries.get_mut(way) {
                    *e = Entry {
                        fingerprint,
                        state: outcome.charged,
                        touched: now_ms.max(1),
                    };
                }
                slot.charged = true;
            }
        }
        if allowed {
            for slot in slots.iter().filter(|s| s.charged) {
                store.set(&slot.key, &encode(&slot.entries), slot.cas)?;
            }
        } else {
            // A denied request is charged nowhere: report the limits that
            // did fit as they stand, not as if charged.
            for (status, applied) in statuses.iter_mut().zip(limits) {
                if status.allowed {
                    status.remaining =
                        (status.remaining + applied.cost).min(applied.limit.requests);
                }
            }
        }
        let result = CheckResult {
            allowed,
            limits: statuses,
            receipts: None,
            leased: 0,
        };
        Ok((result, drawn))
    }
}

impl LocalLimiter<'_> {
    /// Settles a reservation these counters charged at `charged_ms`:
    /// each limit's entry (if still there) moves by `actual` minus the
    /// reserved cost (see [`algorithms::settle`]). Best effort: a
    /// contended or failed store leaves the reservation standing.
    pub fn settle(
        &self,
        store: &impl SharedStore,
        limits: &[Applied],
        actual: u64,
        charged_ms: u64,
        now_ms: u64,
    ) {
        for applied in limits {
            self.adjust(store, applied, (applied.cost, actual), charged_ms, now_ms);
        }
    }

    /// Gives back `units` a worker drew on `applied` at `charged_ms` and
    /// did not use (see [`LocalLimiter::check_drawing`]): as a
    /// reservation of `units` that cost nothing. Best effort, as
    /// [`LocalLimiter::settle`].
    pub fn give_back(
        &self,
        store: &impl SharedStore,
        applied: &Applied,
        units: u64,
        charged_ms: u64,
        now_ms: u64,
    ) {
        self.adjust(store, applied, (units, 0), charged_ms, now_ms);
    }

    /// Moves `applied`'s entry (if still there) by `actual - reserved`,
    /// in the window `charged_ms` fell in.
    fn adjust(
        &self,
        store: &impl SharedStore,
        applied: &Applied,
        (reserved, actual): (u64, u64),
        charged_ms: u64,
        now_ms: u64,
    ) {
        let (fingerprint, key) = self.place(applied);
        let params = params(&applied.limit);
        let _ = retry_on_conflict(|| {
            let (bytes, cas) = store.get(&key)?;
            let mut entries = decode(bytes.as_deref());
            let Some(entry) = entries
                .iter_mut()
                .find(|e| e.fingerprint == fingerprint && e.touched > 0)
            else {
                return Ok(());
            };
            entry.state =
                algorithms::settle(&params, entry.state, reserved, actual, charged_ms, now_ms);
            store.set(&key, &encode(&entries), cas)
        });
    }
}

/// A request of `cost` on one limit in `state` at `now_ms`, and, when it
/// fits, `draw(remaining)` units more if those fit too: the outcome to
/// store and report, and the units drawn.
fn evaluate_drawing(
    params: &Params,
    state: State,
    (cost, now_ms): (u64, u64),
    draw: &dyn Fn(u64) -> u64,
) -> (algorithms::Outcome, u64) {
    let outcome = algorithms::evaluate(params, state, cost, now_ms);
    let extra = if outcome.fits {
        draw(outcome.remaining)
    } else {
        0
    };
    if extra > 0 {
        let with_draw = algorithms::evaluate(params, state, cost.saturating_add(extra), now_ms);
        if with_draw.fits {
            return (with_draw, extra);
        }
    }
    (outcome, 0)
}

/// A limit as the algorithms take it.
fn params(limit: &crate::config::LimitConfig) -> Params {
    Params {
        algorithm: limit.algorithm,
        requests: limit.requests,
        window_ms: limit.window_ms,
        burst: limit.capacity(),
        calendar: limit.calendar,
    }
}

/// The way holding `fingerprint`, else an empty way, else the least
/// recently used one.
fn find_or_evict(entries: &[Entry; WAYS], fingerprint: u64) -> (usize, Entry) {
    if let Some(i) = entries
        .iter()
        .position(|e| e.fingerprint == fingerprint && e.touched > 0)
    {
        return (i, entries.get(i).copied().unwrap_or_default());
    }
    let oldest = entries
        .iter()
        .enumerate()
        .min_by_key(|(_, e)| e.touched)
        .map_or(0, |(i, _)| i);
    (oldest, Entry::default())
}

fn decode(bytes: Option<&[u8]>) -> [Entry; WAYS] {
    let mut entries = [Entry::default(); WAYS];
    let Some(bytes) = bytes else {
        return entries;
    };
    for (entry, chunk) in entries.iter_mut().zip(bytes.chunks_exact(ENTRY_LEN)) {
        let word = |i: usize| le_word(chunk, i).unwrap_or(0);
        *entry = Entry {
            fingerprint: word(0),
            state: State {
                a: word(1),
                b: word(2),
                c: word(3),
            },
            touched: word(4),
        };
    }
    entries
}

fn encode(entries: &[Entry; WAYS]) -> Vec<u8> {
    let words: Vec<u64> = entries
        .iter()
        .flat_map(|e| [e.fingerprint, e.state.a, e.state.b, e.state.c, e.touched])
        .collect();
    le_words(&words)
}

/// Reads the shared fingerprint seed, creating it from `fresh` when no
/// worker has yet. Every worker must use the same seed, or they would count
/// one client in different slots.
pub fn shared_seed(store: &impl SharedStore, keys: &Keys, fresh: (u64, u64)) -> Option<(u64, u64)> {
    retry_on_conflict(|| {
        let (bytes, cas) = store.get(keys.seed())?;
        if let Some(b) = bytes {
            return Ok(le_word(&b, 0).zip(le_word(&b, 1)));
        }
        // Two workers racing here: the second's write finds the key the
        // first created, a mismatch, and the retry reads the first's seed.
        // Every worker counts with one seed from the start.
        store.set(keys.seed(), &le_words(&[fresh.0, fresh.1]), cas)?;
        Ok(Some(fresh))
    })
    .ok()
    .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    static TEST_KEYS: std::sync::LazyLock<Keys> = std::sync::LazyLock::new(|| Keys::new("test"));
    use crate::config::LimitConfig;
    use crate::host::fake::FakeStore;
    use crate::testing;
    use meshlimit_protocol::Algorithm;

    fn limit(name: &str, requests: u64, window_ms: u64) -> LimitConfig {
        testing::limit(&format!("r/{name}"), requests, window_ms)
    }

    fn applied(limits: &[&LimitConfig]) -> Vec<Applied> {
        limits.iter().map(|l| testing::applied(l)).collect()
    }

    /// `limits` checked for `subject`.
    fn check_as(
        l: &LocalLimiter,
        s: &impl SharedStore,
        subject: &str,
        limits: &[Applied],
        now: u64,
    ) -> LocalDecision {
        let mine: Vec<Applied> = limits
            .iter()
            .map(|a| Applied {
                subject: subject.to_string(),
                ..a.clone()
            })
            .collect();
        l.check(s, &mine, now)
    }

    fn admitted(
        l: &LocalLimiter,
        s: &FakeStore,
        subject: &str,
        limits: &[&LimitConfig],
        n: u32,
        now: u64,
    ) -> u32 {
        let a = applied(limits);
        (0..n)
            .filter(|_| check_as(l, s, subject, &a, now).result.allowed)
            .count() as u32
    }

    #[test]
    fn enforces_the_limit_per_window() {
        let (l, s) = (
            LocalLimiter::new(64, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        let m = limit("m", 5, 60_000);
        assert_eq!(admitted(&l, &s, "a", &[&m], 9, 1_000), 5);
        let denied = check_as(&l, &s, "a", &applied(&[&m]), 1_000);
        assert!(!denied.result.allowed);
        assert_eq!(denied.result.limits[0].retry_after_ms, 59_000);
        assert_eq!(denied.result.limits[0].remaining, 0);
        // Next window: the quota is back.
        assert_eq!(admitted(&l, &s, "a", &[&m], 9, 60_000), 5);
    }

    #[test]
    fn every_algorithm_has_a_fallback() {
        for algorithm in Algorithm::ALL {
            let (l, s) = (
                LocalLimiter::new(64, (1, 2), &TEST_KEYS),
                FakeStore::default(),
            );
            let mut m = limit("m", 5, 60_000);
            m.algorithm = algorithm;
            assert_eq!(admitted(&l, &s, "a", &[&m], 9, 120_000), 5, "{algorithm:?}");
        }
    }

    #[test]
    fn clients_and_limits_count_separately() {
        let (l, s) = (
            LocalLimiter::new(64, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        let m = limit("m", 3, 60_000);
        let h = limit("h", 3, 3_600_000);
        assert_eq!(admitted(&l, &s, "a", &[&m], 5, 0), 3);
        assert_eq!(admitted(&l, &s, "b", &[&m], 5, 0), 3);
        assert_eq!(admitted(&l, &s, "a", &[&h], 5, 0), 3);
    }

    #[test]
    fn denied_requests_charge_no_limit() {
        let (l, s) = (
            LocalLimiter::new(64, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        let small = limit("small", 2, 60_000);
        let big = limit("big", 10, 60_000);
        assert_eq!(admitted(&l, &s, "a", &[&small, &big], 5, 0), 2);
        // Three denials above must not have charged `big`.
        let d = check_as(&l, &s, "a", &applied(&[&big]), 0);
        assert_eq!(d.result.limits[0].remaining, 7);
    }

    #[test]
    fn shadow_limits_never_deny() {
        let (l, s) = (
            LocalLimiter::new(64, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        let m = limit("m", 2, 60_000);
        let mut a = applied(&[&m]);
        a[0].shadow = true;
        let results: Vec<_> = (0..4)
            .map(|_| check_as(&l, &s, "a", &a, 0).result)
            .collect();
        assert!(results.iter().all(|r| r.allowed));
        assert_eq!(results.iter().filter(|r| !r.limits[0].allowed).count(), 2);
    }

    #[test]
    fn memory_is_bounded_by_slots_whatever_the_number_of_clients() {
        let (l, s) = (
            LocalLimiter::new(16, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        let m = limit("m", 1, 60_000);
        let a = applied(&[&m]);
        for i in 0..5_000 {
            check_as(&l, &s, &format!("client-{i}"), &a, 1 + i);
        }
        let data = s.data.borrow();
        assert!(data.len() <= 16);
        assert!(data.values().all(|(v, _)| v.len() == WAYS * ENTRY_LEN));
    }

    #[test]
    fn cas_conflicts_are_retried() {
        let (l, s) = (
            LocalLimiter::new(64, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        *s.conflicts_left.borrow_mut() = 3;
        let m = limit("m", 2, 60_000);
        let d = check_as(&l, &s, "a", &applied(&[&m]), 0);
        assert!(d.result.allowed && !d.degraded);
        assert_eq!(d.result.limits[0].remaining, 1);
    }

    /// Another worker creates a client's slot between this worker's read
    /// (missing) and its write. Envoy creates a missing key whatever the
    /// token, so a write that starts from a missing key must be one that
    /// fails over a key that now exists: it is made again over the other
    /// worker's, and neither request's count is lost.
    #[test]
    fn two_workers_creating_one_slot_at_once_lose_no_count() {
        /// A store whose first write finds the other worker's already in.
        struct Racing<'a> {
            inner: &'a FakeStore,
            other: std::cell::Cell<Option<Box<dyn FnOnce() + 'a>>>,
        }
        impl SharedStore for Racing<'_> {
            fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
                self.inner.get(key)
            }
            fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
                if let Some(other) = self.other.take() {
                    other();
                }
                self.inner.set(key, value, cas)
            }
            fn overwrite(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
                self.inner.overwrite(key, value)
            }
        }
        let (l, s) = (
            LocalLimiter::new(64, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        let m = limit("m", 10, 60_000);
        let limits = applied(&[&m]);
        let racing = Racing {
            inner: &s,
            other: std::cell::Cell::new(Some(Box::new(|| {
                assert!(check_as(&l, &s, "a", &limits, 0).result.allowed);
            }))),
        };
        let mine = check_as(&l, &racing, "a", &limits, 0);
        assert!(mine.result.allowed && !mine.degraded);
        assert_eq!(mine.result.limits[0].remaining, 8, "both requests counted");
        assert_eq!(
            check_as(&l, &s, "a", &limits, 0).result.limits[0].remaining,
            7
        );
    }

    #[test]
    fn endless_conflicts_or_broken_store_fail_open_and_say_so() {
        let (l, s) = (
            LocalLimiter::new(64, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        *s.conflicts_left.borrow_mut() = 1_000;
        let m = limit("m", 2, 60_000);
        let d = check_as(&l, &s, "a", &applied(&[&m]), 0);
        assert!(d.result.allowed && d.degraded);
        let broken = FakeStore {
            broken: std::cell::Cell::new(true),
            ..FakeStore::default()
        };
        assert!(check_as(&l, &broken, "a", &applied(&[&m]), 0).degraded);
    }

    #[test]
    fn a_full_bucket_evicts_rather_than_shares() {
        // One slot: every client lands in the same bucket of WAYS entries.
        let (l, s) = (
            LocalLimiter::new(1, (7, 7), &TEST_KEYS),
            FakeStore::default(),
        );
        let m = limit("m", 1, 60_000);
        let a = applied(&[&m]);
        for i in 0..10 {
            let subject = format!("c{i}");
            // Each new client is admitted once: no one else's count is theirs.
            assert!(
                check_as(&l, &s, &subject, &a, 100 + i).result.allowed,
                "{subject}"
            );
        }
        // The most recent client is still remembered.
        assert!(!check_as(&l, &s, "c9", &a, 200).result.allowed);
    }

    /// Two limits whose entries share a slot are charged once each: the
    /// second write must not fail on the first one's CAS token and retry
    /// the whole check (which charged the first limit again, up to
    /// MAX_CAS_RETRIES times).
    #[test]
    fn limits_sharing_a_slot_are_charged_once() {
        let (l, s) = (
            LocalLimiter::new(1, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        let minute = limit("m", 100, 60_000);
        let big = limit("b", 1000, 60_000);
        assert_eq!(admitted(&l, &s, "a", &[&minute, &big], 300, 0), 100);
        let d = check_as(&l, &s, "a", &applied(&[&big]), 0);
        assert_eq!(
            d.result.limits[0].remaining, 899,
            "big was charged 100 times"
        );
        assert!(!d.degraded);
    }

    /// A reservation charged locally is settled in the same counter: the
    /// unused part is free again at once.
    #[test]
    fn settling_frees_what_a_reservation_did_not_use() {
        let (l, s) = (
            LocalLimiter::new(64, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        let m = limit("m", 100, 60_000);
        let mut reserve = applied(&[&m]);
        reserve[0].cost = 80;
        assert!(check_as(&l, &s, "a", &reserve, 1_000).result.allowed);
        assert!(!check_as(&l, &s, "a", &reserve, 1_000).result.allowed);
        let mine: Vec<Applied> = reserve
            .iter()
            .map(|a| Applied {
                subject: "a".into(),
                ..a.clone()
            })
            .collect();
        l.settle(&s, &mine, 30, 1_000, 2_000);
        let d = check_as(&l, &s, "a", &applied(&[&m]), 2_000);
        assert_eq!(d.result.limits[0].remaining, 69);
    }

    #[test]
    fn seed_is_created_once_and_shared() {
        let s = FakeStore::default();
        let first = shared_seed(&s, &TEST_KEYS, (11, 22)).unwrap();
        let second = shared_seed(&s, &TEST_KEYS, (33, 44)).unwrap();
        assert_eq!(first, (11, 22));
        assert_eq!(second, (11, 22));
    }

    #[test]
    fn garbage_in_shared_data_is_treated_as_empty() {
        let (l, s) = (
            LocalLimiter::new(1, (1, 2), &TEST_KEYS),
            FakeStore::default(),
        );
        s.data
            .borrow_mut()
            .insert("meshlimit.fb.0".into(), (vec![1, 2, 3], 1));
        let m = limit("m", 1, 60_000);
        assert!(check_as(&l, &s, "a", &applied(&[&m]), 0).result.allowed);
    }
}
