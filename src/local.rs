//! Per-Envoy fallback counters in proxy-wasm shared data.
//!
//! Used when `meshlimitd` cannot be asked (`failure_mode: local`). Shared
//! data never expires, so the counters live in a fixed set of keys
//! (`slots`), each a small bucket of [`WAYS`] entries; a client is found in
//! its slot by a 64-bit fingerprint. Memory is `slots * WAYS * 24` bytes
//! whatever the number of clients. When a bucket is full, the entry from the
//! oldest window (or with the lowest count) is evicted: under a flood of
//! invented ids the fallback forgets counts (admits more) rather than
//! charging one client for another's requests.
//!
//! Fingerprints are keyed with a per-Envoy random seed so that a client
//! cannot craft ids that collide with a victim's.

use meshlimit_protocol::{CheckResult, LimitStatus};

use crate::config::LimitConfig;
use crate::host::{SharedStore, StoreError};

/// Entries per slot.
pub const WAYS: usize = 4;
const ENTRY_LEN: usize = 24;
/// Compare-and-swap attempts before giving up on a write.
const MAX_CAS_RETRIES: usize = 8;
/// Shared-data key holding the fingerprint seed.
pub const SEED_KEY: &str = "meshlimit.seed";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Entry {
    fingerprint: u64,
    window: u64,
    count: u64,
}

/// Decisions of the local fallback.
pub struct LocalLimiter {
    slots: u32,
    seed: (u64, u64),
}

/// A local decision, and whether shared data let us count it properly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalDecision {
    pub result: CheckResult,
    /// Shared data failed or stayed contended: the request was admitted
    /// without being counted.
    pub degraded: bool,
}

impl LocalLimiter {
    pub fn new(slots: u32, seed: (u64, u64)) -> Self {
        LocalLimiter {
            slots: slots.max(1),
            seed,
        }
    }

    /// Decides `cost` units for `subject` against every limit, all or
    /// nothing: nothing is charged unless every limit admits the request.
    pub fn check(
        &self,
        store: &impl SharedStore,
        subject: &str,
        limits: &[&LimitConfig],
        cost: u64,
        now_ms: u64,
    ) -> LocalDecision {
        for _ in 0..MAX_CAS_RETRIES {
            match self.try_check(store, subject, limits, cost, now_ms) {
                Ok(result) => {
                    return LocalDecision {
                        result,
                        degraded: false,
                    }
                }
                Err(StoreError::CasMismatch) => continue,
                Err(StoreError::Failed) => break,
            }
        }
        // Fail open, visibly: the caller counts and logs degraded decisions.
        LocalDecision {
            result: CheckResult {
                allowed: true,
                limits: limits
                    .iter()
                    .map(|l| LimitStatus {
                        allowed: true,
                        limit: l.requests,
                        remaining: l.requests.saturating_sub(cost),
                        reset_after_ms: l.window_ms,
                        retry_after_ms: 0,
                    })
                    .collect(),
            },
            degraded: true,
        }
    }

    fn try_check(
        &self,
        store: &impl SharedStore,
        subject: &str,
        limits: &[&LimitConfig],
        cost: u64,
        now_ms: u64,
    ) -> Result<CheckResult, StoreError> {
        struct Pending {
            key: String,
            cas: Option<u32>,
            entries: [Entry; WAYS],
            way: usize,
            updated: Entry,
        }
        let mut pending = Vec::with_capacity(limits.len());
        let mut statuses = Vec::with_capacity(limits.len());
        let mut allowed = true;
        for limit in limits {
            let fingerprint = self.fingerprint(subject, limit);
            let key = format!("meshlimit.fb.{}", self.slot(fingerprint));
            let (bytes, cas) = store.get(&key)?;
            let entries = decode(bytes.as_deref());
            let window = now_ms / limit.window_ms;
            let reset_after_ms = (window + 1) * limit.window_ms - now_ms;
            let (way, current) = find_or_evict(&entries, fingerprint, window);
            let used = if current.fingerprint == fingerprint && current.window == window {
                current.count
            } else {
                0
            };
            let fits = used.saturating_add(cost) <= limit.requests;
            allowed &= fits;
            let after = if fits { used + cost } else { used };
            statuses.push(LimitStatus {
                allowed: fits,
                limit: limit.requests,
                remaining: limit.requests.saturating_sub(after),
                reset_after_ms,
                retry_after_ms: if fits { 0 } else { reset_after_ms },
            });
            pending.push(Pending {
                key,
                cas,
                entries,
                way,
                updated: Entry {
                    fingerprint,
                    window,
                    count: after,
                },
            });
        }
        if allowed {
            // Two limits may share a slot; the second write then sees a CAS
            // mismatch and the whole check is retried from fresh reads.
            for p in pending {
                let mut entries = p.entries;
                if let Some(e) = entries.get_mut(p.way) {
                    *e = p.updated;
                }
                store.set(&p.key, &encode(&entries), p.cas)?;
            }
        } else {
            // A denied request is charged nowhere; remaining for the limits
            // that did fit reflects that.
            for (status, limit) in statuses.iter_mut().zip(limits) {
                if status.allowed {
                    status.remaining = (status.remaining + cost).min(limit.requests);
                }
            }
        }
        Ok(CheckResult {
            allowed,
            limits: statuses,
        })
    }

    fn fingerprint(&self, subject: &str, limit: &LimitConfig) -> u64 {
        #[allow(deprecated)] // SipHasher is the keyed hash std offers.
        let mut h = std::hash::SipHasher::new_with_keys(self.seed.0, self.seed.1);
        use std::hash::{Hash, Hasher};
        limit.qualified_name.hash(&mut h);
        limit.window_ms.hash(&mut h);
        subject.hash(&mut h);
        h.finish()
    }

    fn slot(&self, fingerprint: u64) -> u64 {
        (fingerprint >> 32 ^ fingerprint.rotate_left(17)) % u64::from(self.slots)
    }
}

/// The way holding `fingerprint`, else an empty way, else the stalest.
fn find_or_evict(entries: &[Entry; WAYS], fingerprint: u64, window: u64) -> (usize, Entry) {
    let mut best = 0;
    let mut best_rank = (u8::MAX, u64::MAX, u64::MAX);
    for (i, e) in entries.iter().enumerate() {
        if e.fingerprint == fingerprint && e.count > 0 {
            return (i, *e);
        }
        // Rank: empty or expired entries first, then older windows, then
        // lower counts.
        let rank = if e.count == 0 || e.window < window {
            (0, e.window, e.count)
        } else {
            (1, e.window, e.count)
        };
        if rank < best_rank {
            best_rank = rank;
            best = i;
        }
    }
    (best, entries.get(best).copied().unwrap_or_default())
}

fn decode(bytes: Option<&[u8]>) -> [Entry; WAYS] {
    let mut entries = [Entry::default(); WAYS];
    let Some(bytes) = bytes else {
        return entries;
    };
    for (entry, chunk) in entries.iter_mut().zip(bytes.chunks_exact(ENTRY_LEN)) {
        let word = |i: usize| {
            chunk
                .get(i * 8..i * 8 + 8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(u64::from_le_bytes)
                .unwrap_or(0)
        };
        *entry = Entry {
            fingerprint: word(0),
            window: word(1),
            count: word(2),
        };
    }
    entries
}

fn encode(entries: &[Entry; WAYS]) -> Vec<u8> {
    let mut out = Vec::with_capacity(WAYS * ENTRY_LEN);
    for e in entries {
        out.extend_from_slice(&e.fingerprint.to_le_bytes());
        out.extend_from_slice(&e.window.to_le_bytes());
        out.extend_from_slice(&e.count.to_le_bytes());
    }
    out
}

/// Reads the shared fingerprint seed, creating it from `fresh` when no
/// worker has yet. Every worker must use the same seed, or they would count
/// one client in different slots.
pub fn shared_seed(store: &impl SharedStore, fresh: (u64, u64)) -> Option<(u64, u64)> {
    for _ in 0..MAX_CAS_RETRIES {
        let (bytes, cas) = store.get(SEED_KEY).ok()?;
        if let Some(b) = bytes {
            let a = b.get(0..8).and_then(|s| <[u8; 8]>::try_from(s).ok())?;
            let c = b.get(8..16).and_then(|s| <[u8; 8]>::try_from(s).ok())?;
            return Some((u64::from_le_bytes(a), u64::from_le_bytes(c)));
        }
        let mut value = fresh.0.to_le_bytes().to_vec();
        value.extend_from_slice(&fresh.1.to_le_bytes());
        // Two workers racing here may both write; the last write wins and,
        // since callers read the seed for every fallback decision, every
        // worker agrees from then on.
        match store.set(SEED_KEY, &value, cas) {
            Ok(()) => return Some(fresh),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeStore;
    use meshlimit_protocol::Algorithm;

    fn limit(name: &str, requests: u64, window_ms: u64) -> LimitConfig {
        LimitConfig {
            name: name.into(),
            qualified_name: format!("r/{name}"),
            requests,
            window_ms,
            algorithm: Algorithm::FixedWindow,
        }
    }

    fn admitted(
        l: &LocalLimiter,
        s: &FakeStore,
        subject: &str,
        limits: &[&LimitConfig],
        n: u32,
        now: u64,
    ) -> u32 {
        (0..n)
            .filter(|_| l.check(s, subject, limits, 1, now).result.allowed)
            .count() as u32
    }

    #[test]
    fn enforces_the_limit_per_window() {
        let (l, s) = (LocalLimiter::new(64, (1, 2)), FakeStore::default());
        let m = limit("m", 5, 60_000);
        assert_eq!(admitted(&l, &s, "a", &[&m], 9, 1_000), 5);
        let denied = l.check(&s, "a", &[&m], 1, 1_000);
        assert!(!denied.result.allowed);
        assert_eq!(denied.result.limits[0].retry_after_ms, 59_000);
        assert_eq!(denied.result.limits[0].remaining, 0);
        // Next window: the quota is back.
        assert_eq!(admitted(&l, &s, "a", &[&m], 9, 60_000), 5);
    }

    #[test]
    fn clients_and_limits_count_separately() {
        let (l, s) = (LocalLimiter::new(64, (1, 2)), FakeStore::default());
        let m = limit("m", 3, 60_000);
        let h = limit("h", 3, 3_600_000);
        assert_eq!(admitted(&l, &s, "a", &[&m], 5, 0), 3);
        assert_eq!(admitted(&l, &s, "b", &[&m], 5, 0), 3);
        assert_eq!(admitted(&l, &s, "a", &[&h], 5, 0), 3);
    }

    #[test]
    fn denied_requests_charge_no_limit() {
        let (l, s) = (LocalLimiter::new(64, (1, 2)), FakeStore::default());
        let small = limit("small", 2, 60_000);
        let big = limit("big", 10, 60_000);
        assert_eq!(admitted(&l, &s, "a", &[&small, &big], 5, 0), 2);
        // Three denials above must not have charged `big`.
        let d = l.check(&s, "a", &[&big], 1, 0);
        assert_eq!(d.result.limits[0].remaining, 7);
    }

    #[test]
    fn memory_is_bounded_by_slots_whatever_the_number_of_clients() {
        let (l, s) = (LocalLimiter::new(16, (1, 2)), FakeStore::default());
        let m = limit("m", 1, 60_000);
        for i in 0..5_000 {
            l.check(&s, &format!("client-{i}"), &[&m], 1, 0);
        }
        let data = s.data.borrow();
        assert!(data.len() <= 16);
        assert!(data.values().all(|(v, _)| v.len() == WAYS * ENTRY_LEN));
    }

    #[test]
    fn cas_conflicts_are_retried() {
        let (l, s) = (LocalLimiter::new(64, (1, 2)), FakeStore::default());
        *s.conflicts_left.borrow_mut() = 3;
        let m = limit("m", 2, 60_000);
        let d = l.check(&s, "a", &[&m], 1, 0);
        assert!(d.result.allowed && !d.degraded);
        assert_eq!(d.result.limits[0].remaining, 1);
    }

    #[test]
    fn endless_conflicts_or_broken_store_fail_open_and_say_so() {
        let (l, s) = (LocalLimiter::new(64, (1, 2)), FakeStore::default());
        *s.conflicts_left.borrow_mut() = 1_000;
        let m = limit("m", 2, 60_000);
        let d = l.check(&s, "a", &[&m], 1, 0);
        assert!(d.result.allowed && d.degraded);
        let broken = FakeStore {
            broken: true,
            ..FakeStore::default()
        };
        assert!(l.check(&broken, "a", &[&m], 1, 0).degraded);
    }

    #[test]
    fn a_full_bucket_evicts_rather_than_shares() {
        // One slot: every client lands in the same bucket of WAYS entries.
        let (l, s) = (LocalLimiter::new(1, (7, 7)), FakeStore::default());
        let m = limit("m", 1, 60_000);
        for i in 0..10 {
            let subject = format!("c{i}");
            // Each new client is admitted once: no one else's count is theirs.
            assert!(
                l.check(&s, &subject, &[&m], 1, 0).result.allowed,
                "{subject}"
            );
        }
        // The most recent client is still remembered.
        assert!(!l.check(&s, "c9", &[&m], 1, 0).result.allowed);
    }

    #[test]
    fn seed_is_created_once_and_shared() {
        let s = FakeStore::default();
        let first = shared_seed(&s, (11, 22)).unwrap();
        let second = shared_seed(&s, (33, 44)).unwrap();
        assert_eq!(first, (11, 22));
        assert_eq!(second, (11, 22));
    }

    #[test]
    fn garbage_in_shared_data_is_treated_as_empty() {
        let (l, s) = (LocalLimiter::new(1, (1, 2)), FakeStore::default());
        s.data
            .borrow_mut()
            .insert("meshlimit.fb.0".into(), (vec![1, 2, 3], 1));
        let m = limit("m", 1, 60_000);
        assert!(l.check(&s, "a", &[&m], 1, 0).result.allowed);
    }
}
