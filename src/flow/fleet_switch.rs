//! The fleet-wide enforcement switch as this worker last heard it (see
//! meshlimitd's `fleet.rs`): in `shadow`, meshlimitd decides every limit
//! as a shadow limit, and the decisions the filter makes on its own obey
//! the same:
//! - a cached deny is not served once `shadow` was heard (and a cached
//!   deny lives half a second at most, `shared::deny_cache`: within that
//!   of the switch, every denied client's request calls, and hears it);
//! - the fallback and `scope: local` rules turn their denials into shadow
//!   denials, as last heard (cut off from meshlimitd, a worker keeps the
//!   last state it heard).
//!
//! Every answer of a meshlimitd with its admin API on says the state; one
//! without says nothing, and then there is no switch. What one worker
//! hears, every worker of the Envoy learns: a change is written to shared
//! data (with when it was heard), and each worker reads that at most every
//! [`READ_EVERY_MS`] when it decides on its own, keeping the latest heard.
//! A hit (a lease, a draw) admits anyway and reads nothing.

use std::cell::Cell;

use meshlimit_protocol::{CheckResult, Enforcement};

use crate::shared::store::{le_word, le_words, SharedStore};

/// How often a worker reads what the others heard.
pub(crate) const READ_EVERY_MS: u64 = 100;

pub(super) struct FleetSwitch {
    /// Its shared-data key (the plugin instance's).
    key: String,
    shadow: Cell<bool>,
    /// When the state held was heard (by this worker or another).
    heard_ms: Cell<u64>,
    /// When shared data was last read.
    read_ms: Cell<Option<u64>>,
}

impl FleetSwitch {
    pub(super) fn new(key: &str) -> FleetSwitch {
        FleetSwitch {
            key: key.to_string(),
            shadow: Cell::new(false),
            heard_ms: Cell::new(0),
            read_ms: Cell::new(None),
        }
    }

    /// Takes what an answer said (`None`: nothing, no switch there); a
    /// change is written for the other workers.
    pub(super) fn hear(
        &self,
        store: &impl SharedStore,
        now: u64,
        enforcement: Option<Enforcement>,
    ) {
        let Some(enforcement) = enforcement else {
            return;
        };
        let shadow = enforcement == Enforcement::Shadow;
        let changed = shadow != self.shadow.get();
        self.shadow.set(shadow);
        self.heard_ms.set(now);
        if changed {
            let _ = store.overwrite(&self.key, &le_words(&[u64::from(shadow), now]));
        }
    }

    /// Whether the fleet is in shadow, as this Envoy last heard.
    pub(super) fn shadow(&self, store: &impl SharedStore, now: u64) -> bool {
        let due = self
            .read_ms
            .get()
            .is_none_or(|at| now.saturating_sub(at) >= READ_EVERY_MS);
        if due {
            self.read_ms.set(Some(now));
            if let Ok((Some(bytes), _)) = store.get(&self.key) {
                let (mode, heard) = (le_word(&bytes, 0), le_word(&bytes, 1));
                if let (Some(mode), Some(heard)) = (mode, heard) {
                    if heard > self.heard_ms.get() {
                        self.shadow.set(mode == 1);
                        self.heard_ms.set(heard);
                    }
                }
            }
        }
        self.shadow.get()
    }

    /// In shadow, a denial becomes a shadow denial: every refusing limit
    /// is marked shadow, and the request is admitted.
    pub(super) fn obey(&self, store: &impl SharedStore, now: u64, result: &mut CheckResult) {
        if result.allowed && result.limits.iter().all(|l| l.allowed) {
            return;
        }
        if !self.shadow(store, now) {
            return;
        }
        for status in result.limits.iter_mut().filter(|s| !s.allowed) {
            status.shadow = true;
            status.retry_after_ms = 0;
        }
        result.allowed = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeStore;
    use meshlimit_protocol::LimitStatus;

    fn denied() -> CheckResult {
        CheckResult {
            allowed: false,
            limits: vec![LimitStatus {
                allowed: false,
                limit: 10,
                remaining: 0,
                reset_after_ms: 500,
                retry_after_ms: 500,
                shadow: false,
                reason: None,
            }],
            receipts: None,
            leased: 0,
        }
    }

    #[test]
    fn without_a_switch_nothing_changes() {
        let store = FakeStore::default();
        let s = FleetSwitch::new("k");
        assert!(!s.shadow(&store, 1));
        let mut r = denied();
        s.obey(&store, 1, &mut r);
        assert_eq!(r, denied());
    }

    #[test]
    fn what_one_worker_hears_the_others_learn() {
        let store = FakeStore::default();
        let (a, b) = (FleetSwitch::new("k"), FleetSwitch::new("k"));
        assert!(!b.shadow(&store, 1000));
        a.hear(&store, 1000, Some(Enforcement::Shadow));
        assert!(!b.shadow(&store, 1050), "read at most every 100 ms");
        assert!(b.shadow(&store, 1100));
        let mut r = denied();
        b.obey(&store, 1100, &mut r);
        assert!(r.allowed && r.limits[0].shadow && !r.limits[0].allowed);
        // Heard later by b itself, enforce wins over the older shadow.
        b.hear(&store, 2000, Some(Enforcement::Enforce));
        assert!(!a.shadow(&store, 2100));
        a.hear(&store, 2200, None);
        assert!(
            !a.shadow(&store, 2300),
            "an answer without a switch changes nothing"
        );
        a.hear(&store, 2400, Some(Enforcement::Unknown));
        assert!(!a.shadow(&store, 2500), "an unknown state is enforce");
    }
}
