//! The fleet-wide enforcement switch: in an incident, one admin call
//! (`PUT /v1/enforcement`) turns every limit of every proxy into shadow,
//! decided and counted but refusing nothing, and one call turns it back.
//!
//! The switch lives in one Redis key, written by the admin API and read by
//! every meshlimitd instance every [`REFRESH`]: each decision then reads
//! the instance's copy (no Redis command per decision). In shadow, every
//! limit of every check is decided as a shadow limit. Each answer tells
//! the filter the switch's state, and the filter's own decisions (a cached
//! deny, the fallback, `scope: local` rules) obey the last state it heard
//! (see the filter's `flow/fleet_switch.rs`). So within about a second of
//! the call, nothing is refused anywhere; an Envoy cut off from meshlimitd
//! keeps the last state it heard.
//!
//! Only with the admin API on (`--admin-token-file`): without it there is
//! no switch, and answers say nothing of one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use meshlimit_protocol::{Check, Enforcement};
use tracing::warn;

use crate::limiter::Limiter;
use crate::metrics::Metrics;

/// How often each instance reads the switch from Redis.
pub const REFRESH: Duration = Duration::from_millis(250);

/// This instance's copy of the switch.
#[derive(Clone, Debug, Default)]
pub struct FleetSwitch {
    /// The admin API is on: the switch exists.
    on: bool,
    shadow: Arc<AtomicBool>,
}

impl FleetSwitch {
    /// The switch of an instance whose admin API is `on`.
    pub fn new(on: bool) -> FleetSwitch {
        FleetSwitch {
            on,
            shadow: Arc::default(),
        }
    }

    /// What answers report: the state, or nothing without a switch.
    pub fn reported(&self) -> Option<Enforcement> {
        self.on.then(|| {
            if self.shadow() {
                Enforcement::Shadow
            } else {
                Enforcement::Enforce
            }
        })
    }

    /// Whether every limit is decided as a shadow limit now.
    pub fn shadow(&self) -> bool {
        self.on && self.shadow.load(Ordering::Relaxed)
    }

    /// Takes a state read from Redis (or just written there).
    pub fn set(&self, enforcement: Enforcement, metrics: &Metrics) {
        let shadow = enforcement == Enforcement::Shadow;
        self.shadow.store(shadow, Ordering::Relaxed);
        metrics.fleet_shadow(shadow);
    }

    /// Reads the switch from Redis every [`REFRESH`], for good. A failed
    /// read keeps the last state (logged once a minute at most).
    pub async fn refresh_forever(self, limiter: Limiter, metrics: Metrics) {
        if !self.on {
            return;
        }
        let mut last_warning: Option<std::time::Instant> = None;
        loop {
            match limiter.read_switch().await {
                Ok(stored) => self.set(stored.enforcement, &metrics),
                Err(e) => {
                    if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                        warn!(
                            "cannot read the enforcement switch (keeping {:?}): {e}",
                            self.reported()
                        );
                        last_warning = Some(std::time::Instant::now());
                    }
                }
            }
            tokio::time::sleep(REFRESH).await;
        }
    }
}

/// `checks` with every limit made a shadow limit (the switch is on).
pub fn shadowed(checks: &[Check]) -> Vec<Check> {
    checks
        .iter()
        .map(|c| {
            let mut c = c.clone();
            for limit in &mut c.limits {
                limit.shadow = true;
            }
            c
        })
        .collect()
}
