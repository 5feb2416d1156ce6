//! Every shared-data key (and shared-queue name) the filter uses, in one
//! place: two features can never pick the same key by accident, and two
//! plugin instances in one proxy never share one.
//!
//! Shared data is shared by every plugin of a `vm_id`, and Istio leaves
//! `vm_id` empty: several meshlimit plugins in one proxy (the ingress
//! gateway's, say) would otherwise share the breaker, the fallback
//! counters, the deny cache and the leases, and one pointing at a missing
//! cluster would open the breaker of the others. So each instance's keys
//! carry [`instance_id`], a digest of what tells instances apart (the
//! plugin's name and root id, and the meshlimitd cluster it calls), which
//! a configuration push leaves as it was: leases and counters outlive it.

use sha2::{Digest, Sha256};

/// One plugin instance's keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keys {
    prefix: String,
    seed: String,
    breaker: String,
    deny_recent: String,
    fleet_switch: String,
    lease_ends: String,
}

impl Keys {
    /// The keys of instance `instance` (see [`instance_id`]).
    pub(crate) fn new(instance: &str) -> Keys {
        let prefix = format!("meshlimit.{instance}.");
        Keys {
            seed: format!("{prefix}seed"),
            breaker: format!("{prefix}breaker"),
            deny_recent: format!("{prefix}denied-at"),
            fleet_switch: format!("{prefix}fleet-switch"),
            lease_ends: format!("{prefix}lease-ends"),
            prefix,
        }
    }

    /// The fingerprint seed every worker shares (two little-endian words).
    pub(crate) fn seed(&self) -> &str {
        &self.seed
    }

    /// The circuit breaker's state.
    pub(crate) fn breaker(&self) -> &str {
        &self.breaker
    }

    /// When the deny cache last learnt a deny (see `DenyCache::quiet`).
    pub(crate) fn deny_recent(&self) -> &str {
        &self.deny_recent
    }

    /// The fleet-wide enforcement switch as this Envoy's workers last
    /// heard it (see `flow::fleet_switch`).
    pub(crate) fn fleet_switch(&self) -> &str {
        &self.fleet_switch
    }

    /// How many leases this Envoy's workers ended early (see
    /// `flow::lease_ends`).
    pub(crate) fn lease_ends(&self) -> &str {
        &self.lease_ends
    }

    /// A slot of the fallback counters (and of `scope: local` rules).
    pub(crate) fn fallback_slot(&self, slot: u64) -> String {
        format!("{}fb.{slot}", self.prefix)
    }

    /// A slot of the quota leases.
    pub(crate) fn lease_slot(&self, slot: u64) -> String {
        format!("{}lease.{slot}", self.prefix)
    }

    /// A slot of the deny cache.
    pub(crate) fn deny_slot(&self, slot: u64) -> String {
        format!("{}deny.{slot}", self.prefix)
    }
}

/// The id of a plugin instance: 16 hex digits of a SHA-256 of its plugin
/// name, its root id and the meshlimitd cluster it calls (each
/// length-prefixed, so no two lists of parts give one id).
pub(crate) fn instance_id(plugin_name: &[u8], root_id: &[u8], cluster: &str) -> String {
    let mut digest = Sha256::new();
    for part in [plugin_name, root_id, cluster.as_bytes()] {
        digest.update((part.len() as u64).to_le_bytes());
        digest.update(part);
    }
    digest
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
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
        let k = Keys::new("0123456789abcdef");
        let keys = [
            k.seed().to_string(),
            k.breaker().to_string(),
            k.deny_recent().to_string(),
            k.fallback_slot(0),
            k.deny_slot(0),
            k.lease_slot(0),
            wake_queue(0),
        ];
        for (i, a) in keys.iter().enumerate() {
            for b in keys.iter().skip(i + 1) {
                assert!(!a.starts_with(b.as_str()) && !b.starts_with(a.as_str()));
            }
        }
    }

    #[test]
    fn instances_that_differ_in_name_root_or_cluster_never_share_a_key() {
        let base = instance_id(b"gateway.api", b"", "meshlimit");
        assert_eq!(base.len(), 16);
        assert_eq!(
            base,
            instance_id(b"gateway.api", b"", "meshlimit"),
            "stable"
        );
        for other in [
            instance_id(b"gateway.llm", b"", "meshlimit"),
            instance_id(b"gateway.api", b"root", "meshlimit"),
            instance_id(b"gateway.api", b"", "meshlimit-typo"),
            // Parts are length-prefixed: moving a byte across is another id.
            instance_id(b"gateway.ap", b"i", "meshlimit"),
        ] {
            assert_ne!(base, other);
            let (a, b) = (Keys::new(&base), Keys::new(&other));
            assert_ne!(a.breaker(), b.breaker());
            assert_ne!(a.lease_slot(3), b.lease_slot(3));
        }
    }
}
