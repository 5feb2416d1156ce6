//! Deny cache: once meshlimitd says a subject is out of quota on a limit
//! until T, this Envoy denies it locally until T, without a call. Abusive
//! clients then cost no round trip.
//!
//! A cached deny is trusted for at most [`MAX_CACHED_DENY_MS`] after it
//! was learnt, however far off T is (its `Retry-After` still says T):
//! quota can come back before T (a live override raised in meshlimitd, a
//! refund, the fleet-wide switch to shadow), and two calls a second per
//! denied subject cost little.
//!
//! Entries live in a fixed set of shared-data slots (`slots`), each holding
//! one (fingerprint, until) pair; a new deny overwrites its slot. A lookup
//! only denies when the full 64-bit keyed fingerprint matches: a collision
//! can only cost a call (the other entry is missing), never a wrong deny.

use super::keys::Keys;
use super::store::{self, le_word, le_words, Purpose, SharedStore};
use crate::config::LimitConfig;

/// The longest a deny is answered from the cache before meshlimitd is
/// asked again: a raised override, or the fleet-wide switch to shadow
/// (with meshlimitd's refresh of it, `fleet::REFRESH`, within a second),
/// ends cached denials within this time.
pub const MAX_CACHED_DENY_MS: u64 = 500;

/// A deny the cache holds: until when, and at what quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedDeny {
    pub until: u64,
    pub quota: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct DenyCache<'a, S: SharedStore> {
    pub slots: u32,
    pub seed: (u64, u64),
    pub store: &'a S,
    pub(crate) keys: &'a Keys,
}

impl<S: SharedStore> DenyCache<'_, S> {
    /// Whether no deny was learnt in the last [`MAX_CACHED_DENY_MS`]: then
    /// no entry can be trusted, and a check with several limits need not
    /// look each up (one read instead of one per limit).
    pub fn quiet(&self, now_ms: u64) -> bool {
        let last = match self.store.get(self.keys.deny_recent()) {
            Ok((Some(bytes), _)) => le_word(&bytes, 0).unwrap_or(0),
            Ok((None, _)) => 0,
            // Unknown: look the entries up.
            Err(_) => return false,
        };
        now_ms >= last.saturating_add(MAX_CACHED_DENY_MS)
            || last > now_ms.saturating_add(MAX_CACHED_DENY_MS)
    }

    /// Until when `subject` is known to be denied on `limit`, if it is,
    /// and the quota meshlimitd refused it at (a live override's, or the
    /// configured one).
    pub fn denied_until(
        &self,
        subject: &str,
        limit: &LimitConfig,
        now_ms: u64,
    ) -> Option<CachedDeny> {
        let fp = self.fingerprint(subject, limit);
        let (bytes, _) = self.store.get(&self.key(fp)).ok()?;
        let bytes = bytes?;
        let (stored, until) = (le_word(&bytes, 0)?, le_word(&bytes, 1)?);
        let learnt = le_word(&bytes, 2)?;
        // No deny lasts longer than the limit's window: a deadline further
        // off was set before the wall clock stepped back.
        let plausible = until <= now_ms.saturating_add(limit.window_ms)
            && learnt <= now_ms
            && now_ms < learnt.saturating_add(MAX_CACHED_DENY_MS);
        let quota = le_word(&bytes, 3).unwrap_or(limit.requests);
        (stored == fp && until > now_ms && plausible).then_some(CachedDeny { until, quota })
    }

    /// Remembers that `subject` is denied on `limit` until `until_ms`, at
    /// `quota`. Returns true when that evicted another subject's live
    /// entry: many evictions mean the cache is too small for the abusers
    /// at hand.
    pub fn remember(
        &self,
        subject: &str,
        limit: &LimitConfig,
        (until_ms, quota): (u64, u64),
        now_ms: u64,
    ) -> bool {
        let fp = self.fingerprint(subject, limit);
        let key = self.key(fp);
        let evicted = match self.store.get(&key) {
            Ok((Some(old), _)) => {
                le_word(&old, 0).unwrap_or(0) != fp && le_word(&old, 1).unwrap_or(0) > now_ms
            }
            _ => false,
        };
        // Unconditional write: the slot belongs to the latest deny.
        let _ = self
            .store
            .overwrite(&key, &le_words(&[fp, until_ms, now_ms, quota]));
        let _ = self
            .store
            .overwrite(self.keys.deny_recent(), &le_words(&[now_ms]));
        evicted
    }

    fn key(&self, fp: u64) -> String {
        self.keys.deny_slot(store::slot(fp, self.slots))
    }

    /// Covers the limit's definition: a deny cached under one limit never
    /// denies under a changed one (shared data outlives a config push).
    fn fingerprint(&self, subject: &str, limit: &LimitConfig) -> u64 {
        store::fingerprint(self.seed, Purpose::DenyCache, limit, subject)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeStore;
    use crate::testing;

    /// Until when the cache denies, as before quotas were kept.
    fn until<S: SharedStore>(
        c: &DenyCache<'_, S>,
        subject: &str,
        limit: &LimitConfig,
        now: u64,
    ) -> Option<u64> {
        c.denied_until(subject, limit, now).map(|d| d.until)
    }

    /// Remembers a deny at the limit's configured quota.
    fn remember<S: SharedStore>(
        c: &DenyCache<'_, S>,
        subject: &str,
        limit: &LimitConfig,
        until_ms: u64,
        now_ms: u64,
    ) -> bool {
        c.remember(subject, limit, (until_ms, limit.requests), now_ms)
    }

    /// A deny at a live override's quota is served at that quota.
    #[test]
    fn a_cached_deny_keeps_the_quota_it_was_refused_at() {
        let store = FakeStore::default();
        let keys = Keys::new("t");
        let c = DenyCache {
            slots: 16,
            seed: (1, 2),
            store: &store,
            keys: &keys,
        };
        c.remember("a", &m(), (5_000, 3), 0);
        assert_eq!(
            c.denied_until("a", &m(), 10),
            Some(CachedDeny {
                until: 5_000,
                quota: 3
            })
        );
    }

    fn m() -> LimitConfig {
        testing::limit("api/m", 10, 60_000)
    }

    fn h() -> LimitConfig {
        testing::limit("api/h", 10, 3_600_000)
    }

    #[test]
    fn remembers_until_the_deadline() {
        let s = FakeStore::default();
        let c = DenyCache {
            keys: &crate::shared::keys::Keys::new("test"),
            slots: 64,
            seed: (1, 2),
            store: &s,
        };
        assert_eq!(until(&c, "a", &m(), 0), None);
        assert!(!remember(&c, "a", &m(), 500, 0));
        assert_eq!(until(&c, "a", &m(), 499), Some(500));
        assert_eq!(until(&c, "a", &m(), 500), None);
        assert!(!remember(&c, "a", &m(), 5_000, 0));
        assert_eq!(until(&c, "a", &h(), 10), None, "per limit");
        assert_eq!(until(&c, "b", &m(), 10), None, "per subject");
    }

    /// Quota may come back before the deadline (a live override raised in
    /// meshlimitd, the fleet switched to shadow): a deny is trusted for
    /// half a second, then meshlimitd is asked again; the deadline it
    /// reports is still the true one.
    #[test]
    fn a_deny_is_trusted_for_half_a_second_at_most() {
        let s = FakeStore::default();
        let c = DenyCache {
            keys: &crate::shared::keys::Keys::new("test"),
            slots: 64,
            seed: (1, 2),
            store: &s,
        };
        remember(&c, "a", &m(), 30_000, 1_000);
        assert_eq!(until(&c, "a", &m(), 1_499), Some(30_000));
        assert_eq!(until(&c, "a", &m(), 1_500), None);
    }

    #[test]
    fn it_is_quiet_half_a_second_after_the_last_deny() {
        let s = FakeStore::default();
        let c = DenyCache {
            keys: &crate::shared::keys::Keys::new("test"),
            slots: 64,
            seed: (1, 2),
            store: &s,
        };
        assert!(c.quiet(5_000), "nothing learnt yet");
        remember(&c, "a", &m(), 30_000, 5_000);
        assert!(!c.quiet(5_499));
        assert!(c.quiet(5_500));
        // A wall clock that stepped back a long way: not trusted.
        assert!(c.quiet(1_000));
    }

    #[test]
    fn a_collision_costs_a_call_never_a_wrong_deny() {
        // One slot: every entry collides.
        let s = FakeStore::default();
        let c = DenyCache {
            keys: &crate::shared::keys::Keys::new("test"),
            slots: 1,
            seed: (1, 2),
            store: &s,
        };
        remember(&c, "abuser", &m(), 9_000, 0);
        assert_eq!(until(&c, "innocent", &m(), 10), None);
        assert!(
            remember(&c, "other", &m(), 9_000, 10),
            "a live entry was evicted"
        );
        assert!(
            !remember(&c, "late", &m(), 20_000, 9_500),
            "an expired one is not"
        );
        assert_eq!(
            until(&c, "abuser", &m(), 10),
            None,
            "evicted: a call, not a deny"
        );
    }

    #[test]
    fn a_changed_limit_is_not_denied_by_the_old_entry() {
        let s = FakeStore::default();
        let c = DenyCache {
            keys: &crate::shared::keys::Keys::new("test"),
            slots: 64,
            seed: (1, 2),
            store: &s,
        };
        remember(&c, "a", &m(), 5_000, 0);
        let raised = testing::limit("api/m", 100, 60_000);
        assert_eq!(until(&c, "a", &raised, 10), None);
        assert_eq!(until(&c, "a", &m(), 10), Some(5_000));
    }

    #[test]
    fn a_clock_stepping_back_does_not_extend_a_deny() {
        let s = FakeStore::default();
        let c = DenyCache {
            keys: &crate::shared::keys::Keys::new("test"),
            slots: 64,
            seed: (1, 2),
            store: &s,
        };
        remember(&c, "a", &m(), 10_050_000, 10_000_000);
        assert_eq!(until(&c, "a", &m(), 10_000_000), Some(10_050_000));
        assert_eq!(until(&c, "a", &m(), 10_000_000 - 3_600_000), None);
    }

    #[test]
    fn bounded_whatever_the_number_of_subjects() {
        let s = FakeStore::default();
        let c = DenyCache {
            keys: &crate::shared::keys::Keys::new("test"),
            slots: 32,
            seed: (1, 2),
            store: &s,
        };
        for i in 0..10_000 {
            remember(&c, &format!("c{i}"), &m(), 1_000, 0);
        }
        assert!(
            s.data.borrow().len() <= 32 + 1,
            "the slots and when the last deny was learnt"
        );
    }
}
