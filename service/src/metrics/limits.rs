//! meshlimitd's decisions by limit, with a cardinality guard.
//!
//! A limit's name comes from the caller (`rule/limit` in the check API,
//! `domain/key...` through the rate limit service), so its label values
//! are bounded here, not by a configuration: the first [`MAX_LIMITS`]
//! names get series of their own, later ones share `limit="other"`, and
//! `meshlimitd_limit_labels_overflowed_total` counts the decisions that
//! went there (an operator sees the cap was reached, and why a name is
//! missing).

use std::collections::HashSet;
use std::sync::RwLock;

use meshlimit_protocol::LimitStatus;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Limit names with series of their own, at most.
pub const MAX_LIMITS: usize = 1_000;

/// The label value of every name beyond [`MAX_LIMITS`].
pub const OTHER: &str = "other";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabel {
    limit: String,
    result: &'static str,
}

/// Decisions by limit and result.
#[derive(Clone)]
pub(super) struct LimitDecisions {
    decisions: Family<LimitLabel, Counter>,
    overflowed: Counter,
    named: std::sync::Arc<RwLock<HashSet<String>>>,
    max: usize,
}

impl LimitDecisions {
    pub(super) fn register(registry: &mut Registry, max: usize) -> LimitDecisions {
        let decisions = Family::<LimitLabel, Counter>::default();
        registry.register(
            "limit_decisions",
            "Limits decided, by limit (rule/limit) and result: allowed, denied, shadow_denied, near_limit (admitted with under a tenth left)",
            decisions.clone(),
        );
        let overflowed = Counter::default();
        registry.register(
            "limit_labels_overflowed",
            "Limit decisions counted under limit=\"other\": more distinct limit names than the cap on label sets",
            overflowed.clone(),
        );
        LimitDecisions {
            decisions,
            overflowed,
            named: std::sync::Arc::default(),
            max,
        }
    }

    /// The label value for `name`: its own while there is room.
    fn label(&self, name: &str) -> Option<String> {
        if self.named.read().is_ok_and(|n| n.contains(name)) {
            return Some(name.to_string());
        }
        let mut named = self.named.write().ok()?;
        if named.contains(name) || named.len() < self.max {
            named.insert(name.to_string());
            return Some(name.to_string());
        }
        None
    }

    /// Counts one limit's status in a decided check.
    pub(super) fn record(&self, name: &str, status: &LimitStatus, admitted: bool) {
        let limit = match self.label(name) {
            Some(limit) => limit,
            None => {
                self.overflowed.inc();
                OTHER.to_string()
            }
        };
        let inc = |result: &'static str| {
            self.decisions
                .get_or_create(&LimitLabel {
                    limit: limit.clone(),
                    result,
                })
                .inc();
        };
        match (status.allowed, status.shadow) {
            (false, true) => inc("shadow_denied"),
            (false, false) => inc("denied"),
            (true, _) => {}
        }
        if admitted {
            inc("allowed");
            if status.remaining.saturating_mul(10) < status.limit {
                inc("near_limit");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(allowed: bool, remaining: u64) -> LimitStatus {
        LimitStatus {
            allowed,
            limit: 100,
            remaining,
            reset_after_ms: 1_000,
            retry_after_ms: 0,
            shadow: false,
            reason: None,
        }
    }

    fn render(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn beyond_the_cap_names_share_one_series_and_say_so() {
        let mut registry = Registry::with_prefix("meshlimitd");
        let limits = LimitDecisions::register(&mut registry, 2);
        for name in ["a/m", "b/m", "a/m", "c/m", "d/m"] {
            limits.record(name, &status(true, 50), true);
        }
        let out = render(&registry);
        assert!(
            out.contains(r#"meshlimitd_limit_decisions_total{limit="a/m",result="allowed"} 2"#),
            "{out}"
        );
        assert!(
            out.contains(r#"meshlimitd_limit_decisions_total{limit="other",result="allowed"} 2"#),
            "{out}"
        );
        assert!(!out.contains(r#"limit="c/m""#));
        assert!(
            out.contains("meshlimitd_limit_labels_overflowed_total 2"),
            "{out}"
        );
    }

    #[test]
    fn denials_shadow_denials_and_near_limits_are_counted_apart() {
        let mut registry = Registry::with_prefix("meshlimitd");
        let limits = LimitDecisions::register(&mut registry, 10);
        limits.record("a/m", &status(false, 0), false);
        limits.record("a/m", &status(true, 5), true);
        let shadow = LimitStatus {
            shadow: true,
            ..status(false, 0)
        };
        limits.record("a/m", &shadow, true);
        let out = render(&registry);
        for (result, n) in [
            ("denied", 1),
            ("allowed", 2),
            ("near_limit", 2),
            ("shadow_denied", 1),
        ] {
            let line =
                format!(r#"meshlimitd_limit_decisions_total{{limit="a/m",result="{result}"}} {n}"#);
            assert!(out.contains(&line), "{line} in {out}");
        }
    }
}
