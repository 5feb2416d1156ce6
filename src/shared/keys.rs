//! Every shared-data key (and shared-queue name) the filter uses, in one
//! place: two features can never pick the same key by accident.

/// The fingerprint seed every worker shares (two little-endian words).
pub(crate) const SEED: &str = "meshlimit.seed";
/// The circuit breaker's state.
pub(crate) const BREAKER: &str = "meshlimit.breaker";
/// When the deny cache last learnt a deny (see `DenyCache::quiet`).
pub(crate) const DENY_RECENT: &str = "meshlimit.denied-at";

/// A slot of the fallback counters.
pub(crate) fn fallback_slot(slot: u64) -> String {
    format!("meshlimit.fb.{slot}")
}

/// A slot of the quota leases.
pub(crate) fn lease_slot(slot: u64) -> String {
    format!("meshlimit.lease.{slot}")
}

/// A slot of the deny cache.
pub(crate) fn deny_slot(slot: u64) -> String {
    format!("meshlimit.deny.{slot}")
}

/// The shared queue through which one worker's streams wake its root
/// (a random nonce per worker: queues are per VM, roots per worker).
pub(crate) fn wake_queue(nonce: u64) -> String {
    format!("meshlimit.batch.{nonce:x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_two_features_share_a_key() {
        let keys = [
            SEED.to_string(),
            BREAKER.to_string(),
            DENY_RECENT.to_string(),
            fallback_slot(0),
            deny_slot(0),
            lease_slot(0),
            wake_queue(0),
        ];
        for (i, a) in keys.iter().enumerate() {
            for b in keys.iter().skip(i + 1) {
                assert!(!a.starts_with(b.as_str()) && !b.starts_with(a.as_str()));
            }
        }
    }
}
