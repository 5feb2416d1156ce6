//! What an Envoy's stats say a row measured: calls to meshlimitd, and
//! decisions that fell back.

use meshlimit_testbed::http;

use crate::machine::stat;

/// Requests an Envoy's filter decided by its local fallback, and its calls
/// to meshlimitd that timed out. A row meant to measure global decisions
/// that fell back measured the fallback instead: meshlimitd answered late
/// (its core is shared with the load generator), timeouts opened the
/// breaker, and a lease that ran out could not be renewed. The report and
/// `make bench-ab` name such rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Fallbacks {
    pub(crate) decisions: u64,
    pub(crate) timeouts: u64,
}

impl Fallbacks {
    pub(crate) fn read(admin: &str) -> Fallbacks {
        let stats = http::envoy_stats(
            admin,
            r"^wasmcustom\.meshlimit\.(fallback_(allowed|denied|uncounted)|service_errors\.timeout)$",
        );
        let sum = |part: &str| {
            stats
                .iter()
                .filter(|(name, _)| name.contains(part))
                .map(|(_, v)| *v)
                .sum()
        };
        Fallbacks {
            decisions: sum("fallback_"),
            timeouts: sum("timeout"),
        }
    }

    pub(crate) fn since(self, before: &Fallbacks) -> Fallbacks {
        Fallbacks {
            decisions: self.decisions.saturating_sub(before.decisions),
            timeouts: self.timeouts.saturating_sub(before.timeouts),
        }
    }

    /// What fell back and timed out, or `None` when nothing did.
    pub(crate) fn describe(&self) -> Option<String> {
        (*self != Fallbacks::default()).then(|| {
            format!(
                "{} requests decided by the fallback, {} calls timed out",
                self.decisions, self.timeouts
            )
        })
    }
}

/// Requests an Envoy answered and calls it made to meshlimitd, so far.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CallCount {
    requests: u64,
    calls: u64,
}

impl CallCount {
    pub(crate) fn read(admin: &str) -> CallCount {
        CallCount {
            requests: stat(admin, "http.ingress.downstream_rq_total"),
            calls: calls_to_meshlimitd(admin),
        }
    }

    /// Calls per request since `before`.
    pub(crate) fn per_request_since(self, before: CallCount) -> f64 {
        let requests = self.requests.saturating_sub(before.requests);
        self.calls.saturating_sub(before.calls) as f64 / requests.max(1) as f64
    }
}

/// Calls an Envoy made to meshlimitd: the wasm filter's HTTP checks, or
/// the native filter's gRPC ones.
fn calls_to_meshlimitd(admin: &str) -> u64 {
    stat(admin, "cluster.meshlimit.upstream_rq_total")
        + stat(admin, "cluster.meshlimit_rls.upstream_rq_total")
}
