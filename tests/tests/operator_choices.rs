//! Operator choices, end to end: local-only rules, fleet-aware fallback,
//! and alert rules that name metrics the project really exports.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use meshlimit_testbed::http;
use meshlimit_testbed::{Topology, TopologyOptions};

fn cluster_stat(t: &Topology, i: usize, name: &str) -> u64 {
    http::envoy_stats(
        &t.replica_admin(i),
        &format!("^cluster\\.meshlimit\\.{name}$"),
    )
    .first()
    .map_or(0, |(_, v)| *v)
}

#[test]
fn a_local_only_rule_needs_no_meshlimitd_at_all() {
    let t = Topology::start(TopologyOptions {
        plugin_config: rule_config(
            json!({"scope": "local"}),
            json!([{"name": "per-minute", "requests": 5, "window": "60s"}]),
        ),
        start_service: false,
        ..TopologyOptions::default()
    });
    wait_for_fresh_window(Duration::from_secs(10));
    // Two replicas, each enforcing 5 on its own.
    assert_eq!(burst(&t, &key("edge-client"), 20), (10, 10));
    assert_eq!(t.stat_total("meshlimit.local_allowed"), 10);
    assert_eq!(t.stat_total("meshlimit.local_denied"), 10);
    for name in [
        "fallback_allowed",
        "fallback_denied",
        "service_errors.connection",
        "requests_allowed",
    ] {
        assert_eq!(t.stat_total(&format!("meshlimit.{name}")), 0, "{name}");
    }
    for i in 1..=2 {
        assert_eq!(
            cluster_stat(&t, i, "upstream_rq_total"),
            0,
            "replica-{i} called meshlimitd"
        );
    }
    let r = send(&t, &key("fresh"));
    assert!(r
        .header("ratelimit")
        .unwrap_or("")
        .starts_with("\"api/per-minute\";r=4;"));
}

#[test]
fn mixed_local_and_global_rules_send_only_the_global_part() {
    let config = PluginConfig::new()
        .set("service", json!({"timeout": "1s"}))
        .client_id(json!({"headers": ["x-api-key"]}))
        .rules(json!([
            {"name": "edge", "scope": "local", "limits": [{"name": "burst", "requests": 100, "window": "60s"}]},
            {"name": "api", "limits": [{"name": "per-minute", "requests": 20, "window": "60s"}]}
        ]));
    let t = topology(config.build());
    wait_for_fresh_window(Duration::from_secs(10));
    assert_eq!(burst(&t, &key("mixed"), 30), (20, 10));
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(
        keys.contains("api/per-minute") && !keys.contains("edge/"),
        "{keys}"
    );
}

#[test]
fn the_fleet_keeps_near_the_global_limit_during_a_fallback() {
    let config = PluginConfig::new()
        .set("service", json!({"timeout": "1s"}))
        .client_id(json!({"headers": ["x-api-key"]}))
        .rule_field("match", json!({}))
        .rule_field("fallback_share", json!(0.5));
    let mut t = topology(config.build());
    wait_for_fresh_window(Duration::from_secs(10));
    t.stop_redis();
    // Each of the two replicas enforces 20 x 0.5 = 10 on its own.
    assert_eq!(burst(&t, &key("fleet"), 40), (20, 20));
    assert_eq!(t.stat_total("meshlimit.fallback_allowed"), 20);
    assert_eq!(t.stat_total("meshlimit.fallback_denied"), 20);
    for i in 1..=2 {
        assert_eq!(t.stat(i, "meshlimit.fallback_allowed"), 10, "replica-{i}");
    }
}

/// Metric names (`meshlimit_*` from Envoy, `meshlimitd_*`) used in an
/// alert rules file.
fn alert_metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for expr_line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        for token in expr_line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if token.starts_with("meshlimit_") || token.starts_with("meshlimitd_") {
                names.insert(token.to_string());
            }
        }
    }
    names
}

#[test]
fn every_alert_names_metrics_that_envoy_and_meshlimitd_export() {
    let t = topology(keyed_config("local"));
    // Touch the paths so histogram and labelled series exist.
    send(&t, &key("alerts"));
    let envoy = http::get(&t.replica_admin(1), "/stats/prometheus", &[])
        .map(|r| r.body)
        .unwrap_or_default();
    let service = http::get(&t.meshlimitd_addr(), "/metrics", &[])
        .map(|r| r.body)
        .unwrap_or_default();
    let path = meshlimit_testbed::tools::root().join("deploy/prometheus/alerts.yaml");
    let rules = std::fs::read_to_string(&path).unwrap();
    let names = alert_metric_names(&rules);
    assert!(names.len() >= 10, "{names:?}");
    // A series, or for a counter that has not counted yet its family's
    // TYPE line (OpenMetrics names the family without `_total`).
    let exported = |name: &str| {
        let scrape = if name.starts_with("meshlimitd_") {
            &service
        } else {
            &envoy
        };
        let family = name.trim_end_matches("_total").trim_end_matches("_bucket");
        scrape.lines().any(|l| {
            l.starts_with(&format!("{name}{{"))
                || l.starts_with(&format!("{name} "))
                || l.starts_with(&format!("# TYPE {family} "))
        })
    };
    let missing: Vec<&String> = names.iter().filter(|n| !exported(n)).collect();
    assert!(
        missing.is_empty(),
        "alerts name metrics nobody exports: {missing:?}"
    );
}
