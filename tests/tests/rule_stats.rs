//! Stats per rule and limit through a real Envoy: the filter defines them
//! at configure time, counts which limit denied, and Envoy's `stats_tags`
//! (envoy/replica.yaml) turn `rule` and `limit` into Prometheus labels.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use meshlimit_testbed::http;

/// The value of a Prometheus series of replica 1 (0 when absent), once it
/// reaches `want` (lease hits are counted in bulk, by the next tick) or
/// 3 s passed.
fn series(t: &meshlimit_testbed::Topology, name: &str, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let body = http::get(&t.replica_admin(1), "/stats/prometheus", &[])
            .map(|r| r.body)
            .unwrap_or_default();
        let value = body
            .lines()
            .find(|l| l.starts_with(name) && l.get(name.len()..name.len() + 1) == Some(" "))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0);
        if value >= want || Instant::now() > deadline {
            return value;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn which_limit_denied_is_a_labelled_series_in_prometheus() {
    // Two rules: `api` (20 a minute) and a shadow `trial` (5 a minute).
    let config = PluginConfig::new()
        .rules(json!([
            {"name": "api", "match": {"path_prefix": "/"},
             "limits": [{"name": "per-minute", "requests": 20, "window": "60s"}]},
            {"name": "trial", "shadow": true, "match": {"path_prefix": "/"},
             "limits": [{"name": "per-minute", "requests": 5, "window": "60s"}]}
        ]))
        .build();
    let t = single_replica(config);
    wait_for_fresh_window(Duration::from_secs(20));
    let (ok, denied) = burst(&t, &key("labelled"), 25);
    assert_eq!((ok, denied), (20, 5));
    let api =
        |event: &str| format!("meshlimit_rule_limit_{event}{{rule=\"api\",limit=\"per-minute\"}}");
    let trial = |event: &str| {
        format!("meshlimit_rule_limit_{event}{{rule=\"trial\",limit=\"per-minute\"}}")
    };
    assert_eq!(series(&t, &api("allowed"), 20), 20);
    assert_eq!(
        series(&t, &api("denied"), 5),
        5,
        "the api limit refused the last five"
    );
    assert_eq!(
        series(&t, &api("near_limit"), 2),
        2,
        "admitted with 1 of 20 left, then 0"
    );
    assert_eq!(
        series(&t, &trial("denied"), 0),
        0,
        "a shadow limit never denies"
    );
    assert!(
        series(&t, &trial("shadow_denied"), 15) >= 15,
        "it would have, from the sixth on"
    );
    assert_eq!(series(&t, &api("fallback"), 0), 0);
}
