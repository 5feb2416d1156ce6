//! Maps keyed by the host's context ids and call tokens.
//!
//! Every stream touches a few of these per request (its RateLimit headers,
//! its place in a batch, its token budget): with std's default SipHash,
//! keyed against flooding, that hashing was a measurable part of a
//! request decided without a call. These keys are chosen by Envoy, never
//! by a client, so a multiplicative hash spreads them just as well.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A map from context ids (or call tokens) to `V`.
pub(crate) type ContextMap<V> = HashMap<u32, V, BuildHasherDefault<ContextIdHasher>>;
/// A set of context ids.
pub(crate) type ContextSet = HashSet<u32, BuildHasherDefault<ContextIdHasher>>;

/// Fibonacci hashing of a `u32`: the high bits, which the table uses, mix
/// every bit of the id.
#[derive(Default)]
pub(crate) struct ContextIdHasher(u64);

impl Hasher for ContextIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u32 keys are hashed here; any other input still hashes.
        for &b in bytes {
            self.write_u32(u32::from(b) ^ (self.0 as u32));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_kept_apart() {
        let mut map: ContextMap<u32> = ContextMap::default();
        for id in 0..10_000 {
            map.insert(id, id * 2);
        }
        assert_eq!(map.len(), 10_000);
        assert!((0..10_000).all(|id| map.get(&id) == Some(&(id * 2))));
        assert_eq!(map.remove(&7), Some(14));
        assert_eq!(map.get(&7), None);
    }
}
