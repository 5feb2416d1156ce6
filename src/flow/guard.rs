//! The guard: what lets the request path decide without meshlimitd, or
//! not call it at all: the breaker's gate (read at most once a millisecond
//! per worker), the deny cache, the fingerprint seed the deny cache, the
//! leases and the local counters share, and shadow rules' accounting.
//! It keeps the configuration facts it needs, so it is asked without the
//! worker's.

use std::cell::Cell;

use log::{info, warn};
use meshlimit_protocol::CheckResult;

use super::metrics::Metrics;
use crate::check::Applied;
use crate::config::{BreakerConfig, Config, FailureMode};
use crate::decision;
use crate::host::Host;
use crate::shared::breaker::{Breaker, Gate, Transition};
use crate::shared::deny_cache::DenyCache;
use crate::shared::fallback::{self, LocalLimiter};
use crate::shared::keys::Keys;
use crate::stats::Stat;
use crate::throttle::LogThrottle;

/// Interval between two log lines about shadow denials.
const LOG_EVERY_MS: u64 = 10_000;
/// How often a worker re-reads the shared seed.
const SEED_REFRESH_MS: u64 = 10_000;

pub(super) struct Guard {
    /// This plugin instance's shared-data keys.
    keys: Keys,
    breaker: BreakerConfig,
    failure_mode: FailureMode,
    /// The call timeout: a probe is out at most this long.
    timeout_ms: u64,
    deny_cache_slots: u32,
    /// Slots of the fallback counters (`local.slots`).
    local_slots: u32,
    /// The fingerprint seed shared through shared data, re-read now and
    /// then so that workers that raced to create it converge.
    seed: Cell<Option<(u64, u64)>>,
    seed_read_ms: Cell<u64>,
    /// The millisecond in which this worker last found the breaker closed.
    /// Within that millisecond the shared state is not read again: a
    /// hostcall per request saved, and another worker's opening is seen at
    /// most a millisecond later. This worker's own failures clear it.
    breaker_closed_at: Cell<Option<u64>>,
    shadow_log: LogThrottle,
}

impl Guard {
    pub(super) fn new(config: &Config, keys: Keys) -> Guard {
        Guard {
            keys,
            breaker: config.breaker,
            failure_mode: config.failure_mode,
            timeout_ms: config.service.timeout_ms,
            deny_cache_slots: config.deny_cache_slots,
            local_slots: config.local.slots,
            seed: Cell::new(None),
            seed_read_ms: Cell::new(0),
            breaker_closed_at: Cell::new(None),
            shadow_log: LogThrottle::new(LOG_EVERY_MS),
        }
    }

    /// The fingerprint seed every worker of this Envoy shares.
    pub(super) fn seed(&self, host: &impl Host, now: u64) -> (u64, u64) {
        match self.seed.get() {
            Some(seed) if now < self.seed_read_ms.get() + SEED_REFRESH_MS => seed,
            _ => {
                let seed =
                    fallback::shared_seed(host, &self.keys, host.random_seed()).unwrap_or((0, 0));
                self.seed.set(Some(seed));
                self.seed_read_ms.set(now);
                seed
            }
        }
    }

    fn breaker<'a, H: Host>(&'a self, host: &'a H) -> Breaker<'a, H> {
        Breaker {
            config: self.breaker,
            store: host,
            keys: &self.keys,
        }
    }

    /// Whether the breaker is closed (meshlimitd answered the last calls),
    /// read only: see `Breaker::is_closed`.
    pub(super) fn breaker_closed(&self, host: &impl Host) -> bool {
        self.breaker(host).is_closed()
    }

    /// This plugin instance's shared-data keys.
    pub(super) fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The counters of `scope: local` rules and of the fallback, in this
    /// Envoy's shared data.
    pub(super) fn local_limiter(&self, host: &impl Host, now: u64) -> LocalLimiter<'_> {
        LocalLimiter::new(self.local_slots, self.seed(host, now), &self.keys)
    }

    /// The deny cache, unless it is off (`deny_cache.slots: 0`).
    pub(super) fn deny_cache<'a, H: Host>(
        &'a self,
        host: &'a H,
        now: u64,
    ) -> Option<DenyCache<'a, H>> {
        (self.deny_cache_slots > 0).then(|| DenyCache {
            slots: self.deny_cache_slots,
            seed: self.seed(host, now),
            store: host,
            keys: &self.keys,
        })
    }

    /// Whether a check may call meshlimitd now (see `breaker_closed_at`).
    pub(super) fn gate(&self, host: &impl Host, now: u64) -> Gate {
        if self.breaker_closed_at.get() == Some(now) {
            return Gate::Call;
        }
        let gate = self.breaker(host).gate(now, self.timeout_ms);
        self.breaker_closed_at
            .set((gate == Gate::Call).then_some(now));
        gate
    }

    /// Reports a call's outcome to the breaker, and says what changed.
    pub(super) fn record_call(&self, host: &impl Host, metrics: &Metrics, success: bool, now: u64) {
        if !success {
            self.breaker_closed_at.set(None);
        }
        match self.breaker(host).record(success, now) {
            Transition::None => {}
            Transition::Opened { for_ms } => {
                metrics.bump(host, Stat::BreakerOpened);
                metrics.set(host, Stat::BreakerOpen, 1);
                warn!(
                    "breaker open: meshlimitd failing; deciding by failure_mode {:?} without calling for {for_ms}ms",
                    self.failure_mode
                );
            }
            Transition::Closed => {
                metrics.set(host, Stat::BreakerOpen, 0);
                info!("breaker closed: meshlimitd answers again; limits are global again");
            }
        }
    }

    /// Shadow rules: what they would have denied is counted and logged (at
    /// a bounded rate), never enforced. `limits` are the result's limits,
    /// in order.
    pub(super) fn count_shadow(
        &self,
        host: &impl Host,
        metrics: &Metrics,
        now: u64,
        limits: &[Applied],
        result: &CheckResult,
    ) {
        if decision::shadow_denials(result) == 0 {
            return;
        }
        metrics.bump(host, Stat::ShadowDenied);
        if let Some(skipped) = self.shadow_log.allow(now) {
            let denied = limits
                .iter()
                .zip(&result.limits)
                .find(|(_, s)| s.shadow && !s.allowed);
            if let Some((applied, _)) = denied {
                let shown: String = applied.subject.chars().take(64).collect();
                info!(
                    "shadow rule would deny {shown:?} on {} ({skipped} more shadow denials since the last line)",
                    applied.limit.qualified_name
                );
            }
        }
    }
}
