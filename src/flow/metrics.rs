//! The stats as the flow uses them: ids defined once per configuration
//! from [`Stat::ALL`], and counts published in one hostcall per batch.

use crate::host::Host;
use crate::stats::{MetricKind, Stat};

/// The host's id of every stat (`None` where the host refused one).
pub(crate) struct Metrics {
    ids: Vec<Option<u32>>,
}

impl Metrics {
    /// Defines every stat.
    pub(crate) fn define(host: &impl Host) -> Self {
        Metrics {
            ids: Stat::ALL
                .iter()
                .map(|stat| {
                    let def = stat.def();
                    let id = host.define_metric(def.kind, def.name);
                    if id.is_none() {
                        log::warn!("cannot define stat {}", def.name);
                    }
                    id
                })
                .collect(),
        }
    }

    fn id(&self, stat: Stat) -> Option<u32> {
        self.ids.get(stat as usize).copied().flatten()
    }

    pub(crate) fn bump(&self, host: &impl Host, stat: Stat) {
        self.add(host, stat, 1);
    }

    /// Adds `n` (nothing to add costs no hostcall).
    pub(crate) fn add(&self, host: &impl Host, stat: Stat, n: usize) {
        if n == 0 {
            return;
        }
        if let Some(id) = self.id(stat) {
            host.increment_metric(id, n as u64);
        }
    }

    /// Sets a gauge.
    pub(crate) fn set(&self, host: &impl Host, stat: Stat, value: u64) {
        debug_assert_eq!(stat.def().kind, MetricKind::Gauge);
        if let Some(id) = self.id(stat) {
            host.record_metric(id, value);
        }
    }
}

/// Decisions counted while handling one answer, published to the stats
/// once (when dropped) instead of one hostcall per check.
pub(crate) struct Tally<'a, H: Host> {
    metrics: &'a Metrics,
    host: &'a H,
    allowed: usize,
    denied: usize,
}

impl<'a, H: Host> Tally<'a, H> {
    pub(crate) fn new(metrics: &'a Metrics, host: &'a H) -> Self {
        Tally {
            metrics,
            host,
            allowed: 0,
            denied: 0,
        }
    }

    pub(crate) fn decided(&mut self, allowed: bool) {
        if allowed {
            self.allowed += 1;
        } else {
            self.denied += 1;
        }
    }
}

impl<H: Host> Drop for Tally<'_, H> {
    fn drop(&mut self) {
        if self.allowed > 0 {
            self.metrics
                .add(self.host, Stat::RequestsAllowed, self.allowed);
        }
        if self.denied > 0 {
            self.metrics
                .add(self.host, Stat::RequestsDenied, self.denied);
        }
    }
}
