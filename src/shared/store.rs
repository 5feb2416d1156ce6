//! The shared-data store as the filter sees it, and the helpers every user
//! of it shares.

use std::hash::{Hash, Hasher};

/// Why a shared-data operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// Another worker wrote the key since we read it: retry.
    CasMismatch,
    /// Anything else the host reported.
    Failed,
}

/// proxy-wasm shared data: one byte string per key, shared by every worker
/// of the VM, with compare-and-swap. It has no expiry, which is why callers
/// use a fixed set of keys ([`super::keys`]).
pub trait SharedStore {
    /// The value and its CAS token.
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError>;
    /// Writes when the key still holds what was read: the value whose
    /// token is `cas`, or, with `None`, nothing (the key was missing when
    /// read, so another worker may have created it since: a read-modify-
    /// write that starts from a missing key must not overwrite it).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
    /// Writes whatever the key holds: last write wins (a cache).
    fn overwrite(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
}

/// Compare-and-swap attempts before a read-modify-write gives up.
pub(crate) const MAX_CAS_RETRIES: usize = 8;

/// Runs a read-modify-write `attempt` again while another worker's write
/// gets in between (a CAS mismatch), at most [`MAX_CAS_RETRIES`] times.
/// Returns the first outcome that is not a mismatch, or the last mismatch.
pub(crate) fn retry_on_conflict<T>(
    mut attempt: impl FnMut() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let mut outcome = Err(StoreError::CasMismatch);
    for _ in 0..MAX_CAS_RETRIES {
        outcome = attempt();
        if !matches!(outcome, Err(StoreError::CasMismatch)) {
            break;
        }
    }
    outcome
}

/// The `i`-th little-endian u64 of a shared-data value, if it has one.
/// Values in shared data are sequences of such words.
pub fn le_word(bytes: &[u8], i: usize) -> Option<u64> {
    bytes
        .get(i * 8..i * 8 + 8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
}

/// Little-endian words, as [`le_word`] reads them.
pub(crate) fn le_words(words: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(words.len() * 8);
    for word in words {
        out.extend_from_slice(&word.to_le_bytes());
    }
    out
}

/// What a fingerprint is for: the same (limit, subject) gets unrelated
/// fingerprints in the fallback counters and in the deny cache.
#[derive(Debug, Clone, Copy, Hash)]
pub(crate) enum Purpose {
    Fallback,
    DenyCache,
    Lease,
}

/// A keyed 64-bit fingerprint of a subject on a limit. Keyed with the
/// per-Envoy random seed so that a client cannot craft ids that collide
/// with a victim's; users store the full fingerprint and compare it, so a
/// slot collision is seen, never mistaken for the other subject. `limit` is
/// the limit's whole definition (name, quota, window, algorithm): shared
/// data outlives a configuration push, and state kept under an old
/// definition must not be read under a new one.
pub(crate) fn fingerprint(
    seed: (u64, u64),
    purpose: Purpose,
    limit: &impl Hash,
    subject: &str,
) -> u64 {
    #[allow(deprecated)] // SipHasher is the keyed hash std offers.
    let mut h = std::hash::SipHasher::new_with_keys(seed.0, seed.1);
    purpose.hash(&mut h);
    limit.hash(&mut h);
    subject.hash(&mut h);
    h.finish()
}

/// The slot (of `slots`) a fingerprint lives in.
pub(crate) fn slot(fingerprint: u64, slots: u32) -> u64 {
    (fingerprint >> 32 ^ fingerprint.rotate_left(17)) % u64::from(slots.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_are_retried_a_bounded_number_of_times() {
        let mut tries = 0;
        let r: Result<(), _> = retry_on_conflict(|| {
            tries += 1;
            Err(StoreError::CasMismatch)
        });
        assert_eq!((r, tries), (Err(StoreError::CasMismatch), MAX_CAS_RETRIES));
        let mut tries = 0;
        let r = retry_on_conflict(|| {
            tries += 1;
            if tries < 3 {
                Err(StoreError::CasMismatch)
            } else {
                Ok(tries)
            }
        });
        assert_eq!(r, Ok(3));
        let r: Result<(), _> = retry_on_conflict(|| Err(StoreError::Failed));
        assert_eq!(r, Err(StoreError::Failed));
    }

    #[test]
    fn words_round_trip() {
        let bytes = le_words(&[1, u64::MAX, 7]);
        assert_eq!(le_word(&bytes, 1), Some(u64::MAX));
        assert_eq!(le_word(&bytes, 2), Some(7));
        assert_eq!(le_word(&bytes, 3), None);
    }

    #[test]
    fn fingerprints_depend_on_everything_they_cover() {
        let base = fingerprint((1, 2), Purpose::Fallback, &("api/m", 60_000), "a");
        assert_ne!(
            base,
            fingerprint((1, 3), Purpose::Fallback, &("api/m", 60_000), "a")
        );
        assert_ne!(
            base,
            fingerprint((1, 2), Purpose::DenyCache, &("api/m", 60_000), "a")
        );
        assert_ne!(
            base,
            fingerprint((1, 2), Purpose::Fallback, &("api/h", 60_000), "a")
        );
        assert_ne!(
            base,
            fingerprint((1, 2), Purpose::Fallback, &("api/m", 1_000), "a")
        );
        assert_ne!(
            base,
            fingerprint((1, 2), Purpose::Fallback, &("api/m", 60_000), "b")
        );
        assert!(slot(base, 16) < 16);
    }
}
