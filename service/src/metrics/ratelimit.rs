//! The rate limit service's per-descriptor stats under the names
//! envoyproxy/ratelimit's dashboards read:
//! `ratelimit_service_rate_limit_{total_hits,over_limit,near_limit,shadow_mode}`
//! with `domain`, `key1` and `key2` labels, as its documented
//! statsd_exporter mapping makes them (`ratelimit.service.rate_limit.
//! <domain>.<key1>[.<key2>].<stat>`). Gauges that only grow, so that the
//! names carry no `_total` (a `rate()` over them works as over a counter).
//! Their label sets are bounded by the configuration: a descriptor's key
//! comes from its configured place, never from a request's values.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// What a descriptor's hits did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RlsEvent {
    TotalHits,
    OverLimit,
    NearLimit,
    ShadowMode,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DescriptorLabel {
    domain: String,
    key1: String,
    key2: String,
}

impl DescriptorLabel {
    /// `domain.key1[.key2...]`: the levels past the first join in `key2`.
    fn of(stat_key: &str) -> DescriptorLabel {
        let mut parts = stat_key.splitn(3, '.');
        DescriptorLabel {
            domain: parts.next().unwrap_or_default().to_string(),
            key1: parts.next().unwrap_or_default().to_string(),
            key2: parts.next().unwrap_or_default().to_string(),
        }
    }
}

#[derive(Clone)]
pub(super) struct DescriptorStats {
    families: [Family<DescriptorLabel, Gauge>; 4],
}

impl DescriptorStats {
    pub(super) fn register(root: &mut Registry) -> DescriptorStats {
        let registry = root.sub_registry_with_prefix("ratelimit_service_rate_limit");
        let families: [Family<DescriptorLabel, Gauge>; 4] = Default::default();
        let help = [
            (
                "total_hits",
                "Hits of each descriptor (envoyproxy/ratelimit's total_hits)",
            ),
            (
                "over_limit",
                "Hits refused over each descriptor's limit (over_limit)",
            ),
            (
                "near_limit",
                "Hits admitted past 80% of each descriptor's limit (near_limit)",
            ),
            (
                "shadow_mode",
                "Hits over the limit of a shadow-mode descriptor, admitted (shadow_mode)",
            ),
        ];
        for ((name, help), family) in help.into_iter().zip(&families) {
            registry.register(name, help, family.clone());
        }
        DescriptorStats { families }
    }

    pub(super) fn add(&self, stat_key: &str, event: RlsEvent, hits: u64) {
        let index = match event {
            RlsEvent::TotalHits => 0,
            RlsEvent::OverLimit => 1,
            RlsEvent::NearLimit => 2,
            RlsEvent::ShadowMode => 3,
        };
        if let Some(family) = self.families.get(index) {
            let hits = i64::try_from(hits).unwrap_or(i64::MAX);
            family
                .get_or_create(&DescriptorLabel::of(stat_key))
                .inc_by(hits);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptors_stats_carry_envoyproxy_ratelimits_names_and_labels() {
        let mut root = Registry::default();
        let stats = DescriptorStats::register(&mut root);
        stats.add("edge.user", RlsEvent::TotalHits, 3);
        stats.add("edge.user", RlsEvent::OverLimit, 1);
        stats.add("edge.tenant_acme.path", RlsEvent::NearLimit, 2);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &root).unwrap();
        for line in [
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="user",key2=""} 3"#,
            r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="user",key2=""} 1"#,
            r#"ratelimit_service_rate_limit_near_limit{domain="edge",key1="tenant_acme",key2="path"} 2"#,
        ] {
            assert!(out.contains(line), "{line} in {out}");
        }
    }
}
