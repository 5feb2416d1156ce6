//! End to end through two Envoy replicas: the other algorithms, several
//! limits per rule, request cost, and shadow mode.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::time::Duration;

use common::*;

#[test]
fn sliding_window_log_is_exact_globally_under_64_connections() {
    let t = topology(rule_config(
        json!({}),
        json!([{"name": "log", "requests": 20, "window": "60s", "algorithm": "sliding_window_log"}]),
    ));
    assert_eq!(concurrent_allowed(&t, "swl-client", 64, 4), 20);
    assert_eq!(t.stat_total("meshlimit.fallback_allowed"), 0);
}

#[test]
fn token_bucket_is_exact_globally_under_64_connections() {
    // 20 per hour with a burst of 20: the bucket empties and barely refills.
    let t = topology(rule_config(
        json!({}),
        json!([{"name": "bucket", "requests": 20, "window": "1h", "algorithm": "token_bucket", "burst": 20}]),
    ));
    assert_eq!(concurrent_allowed(&t, "tb-client", 64, 4), 20);
    assert_eq!(t.stat_total("meshlimit.fallback_allowed"), 0);
}

#[test]
fn two_limits_on_one_rule_report_the_least_remaining() {
    let t = topology(rule_config(
        json!({}),
        json!([{"name": "burst", "requests": 5, "window": "10s", "algorithm": "token_bucket"},
            {"name": "hourly", "requests": 8, "window": "1h", "algorithm": "sliding_window_counter"}]),
    ));
    let first = send(&t, &key("two"));
    assert_eq!(
        first.header("ratelimit-policy"),
        Some("\"api/burst\";q=5;w=10, \"api/hourly\";q=8;w=3600")
    );
    assert!(first
        .header("ratelimit")
        .unwrap_or("")
        .starts_with("\"api/burst\";r=4;"));
    for _ in 0..4 {
        assert_eq!(send(&t, &key("two")).status, 200);
    }
    // The bucket is empty; denials must not charge the hourly limit.
    for _ in 0..3 {
        assert_eq!(send(&t, &key("two")).status, 429);
    }
    std::thread::sleep(Duration::from_millis(2_100));
    let r = send(&t, &key("two"));
    assert_eq!(r.status, 200, "a token came back after 2 s");
    let rl = r.header("ratelimit").unwrap_or("").to_string();
    assert!(
        rl.starts_with("\"api/burst\";r=0;"),
        "the emptier limit is reported: {rl}"
    );
    // The hourly counter saw the 6 admitted requests, not the 3 denied.
    let key = t.redis_cli(&["--scan", "--pattern", "*api/hourly*"]);
    assert_eq!(t.redis_cli(&["hget", key.trim(), "c"]).trim(), "6");
}

#[test]
fn cost_from_a_header_is_charged_and_an_impossible_cost_is_explained() {
    let t = topology(rule_config(
        json!({"cost": {"header": "x-cost", "max": 50}}),
        json!([{"name": "units", "requests": 10, "window": "1h"}]),
    ));
    let mut h = key("coster");
    h.push(("x-cost", b"5".to_vec()));
    let r = send(&t, &h);
    assert_eq!(r.status, 200);
    assert!(r
        .header("ratelimit")
        .unwrap_or("")
        .starts_with("\"api/units\";r=5;"));
    let mut h = key("coster");
    h.push(("x-cost", b"11".to_vec()));
    let r = send(&t, &h);
    assert_eq!(r.status, 429);
    assert_eq!(
        r.body,
        "request cost 11 exceeds the capacity 10 of limit api/units\n"
    );
    let mut h = key("coster");
    h.push(("x-cost", b"lots".to_vec()));
    let r = send(&t, &h);
    assert_eq!(r.status, 400);
    assert!(r.body.contains("x-cost"), "{}", r.body);
    assert_eq!(t.stat_total("meshlimit.rejected_cost_above_capacity"), 1);
    assert_eq!(t.stat_total("meshlimit.rejected_invalid_cost"), 1);
    assert_eq!(t.stat_total("meshlimit.rejected_no_client_id"), 0);
    // Neither the impossible nor the invalid request was charged.
    let r = send(&t, &key("coster"));
    assert!(r
        .header("ratelimit")
        .unwrap_or("")
        .starts_with("\"api/units\";r=4;"));
}

#[test]
fn shadow_mode_never_denies_and_counts_what_it_would_deny() {
    let t = topology(rule_config(
        json!({"shadow": true}),
        json!([{"name": "per-minute", "requests": 20, "window": "60s"}]),
    ));
    wait_for_fresh_window(Duration::from_secs(15));
    assert_eq!(burst(&t, &key("shadowed"), 60), (60, 0));
    // The enforcing rule of the first end-to-end test denies 40 of these 60.
    assert_eq!(t.stat_total("meshlimit.shadow_denied"), 40);
    assert_eq!(t.stat_total("meshlimit.requests_denied"), 0);
    let r = send(&t, &key("shadowed"));
    assert!(
        r.header("ratelimit").is_none(),
        "a shadow rule advertises no quota"
    );
    let log = t.logs("replica-1") + &t.logs("replica-2");
    assert!(
        log.contains("shadow rule would deny"),
        "shadow denials are logged"
    );
}

#[test]
fn every_algorithm_falls_back_locally_when_redis_is_down() {
    let mut t = topology(rule_config(
        json!({}),
        json!([{"name": "log", "requests": 10, "window": "1h", "algorithm": "sliding_window_log"},
            {"name": "counter", "requests": 10, "window": "1h", "algorithm": "sliding_window_counter"},
            {"name": "bucket", "requests": 10, "window": "1h", "algorithm": "token_bucket"}]),
    ));
    t.stop_redis();
    // Each of the two replicas admits 10 on its own.
    assert_eq!(burst(&t, &key("fallback-all"), 30), (20, 10));
    assert_eq!(t.stat_total("meshlimit.fallback_allowed"), 20);
}
