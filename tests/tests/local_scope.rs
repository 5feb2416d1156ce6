//! `scope: local` rules end to end, through a real Envoy with two workers:
//! the rule holds exactly across the workers of one Envoy though each
//! worker draws units ahead from the shared-data counter (src/flow/
//! local_draws.rs), its RateLimit headers count down one request at a
//! time, and meshlimitd is never asked.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use meshlimit_testbed::http::{self, Conn};

/// The usual config with its `api` rule local, `requests` a minute.
fn local_rule(requests: u64) -> String {
    PluginConfig::new()
        .rule_field("scope", json!("local"))
        .limit_field("requests", json!(requests))
        .build()
}

/// Calls the replica made to meshlimitd.
fn calls_to_meshlimitd(t: &meshlimit_testbed::Topology) -> u64 {
    http::envoy_stats(
        &t.replica_admin(1),
        r"^cluster\.meshlimit\.upstream_rq_total$",
    )
    .first()
    .map_or(0, |(_, v)| *v)
}

/// Replica 1's filter stat `name`, once it reaches `want` (hits are added
/// to their stat in bulk, at the latest on the next tick) or 3 s passed.
fn stat_reaching(t: &meshlimit_testbed::Topology, name: &str, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let v = t.stat(1, name);
        if v >= want || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_local_rule_holds_exactly_across_the_workers_of_one_envoy() {
    let t = single_replica(local_rule(300));
    wait_for_fresh_window(Duration::from_secs(20));
    // 16 keep-alive connections, spread by Envoy over its two workers,
    // 25 requests each: 400 for a limit of 300.
    let statuses = Mutex::new(Vec::new());
    let addr = t.replica_addr(1);
    std::thread::scope(|s| {
        for _ in 0..16 {
            let (addr, statuses) = (&addr, &statuses);
            s.spawn(move || {
                let mut conn = Conn::new(addr);
                for _ in 0..25 {
                    let r = conn.get("/api/items", &[("x-api-key", b"hot")]).unwrap();
                    statuses.lock().unwrap().push(r.status);
                }
            });
        }
    });
    let statuses = statuses.into_inner().unwrap();
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let denied = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, denied), (300, 100), "statuses: {statuses:?}");
    assert_eq!(stat_reaching(&t, "meshlimit.local_allowed", 300), 300);
    assert_eq!(t.stat(1, "meshlimit.local_denied"), 100);
    assert_eq!(calls_to_meshlimitd(&t), 0, "a local rule never calls");
}

#[test]
fn a_local_rules_headers_count_down_one_request_at_a_time() {
    let t = single_replica(local_rule(300));
    wait_for_fresh_window(Duration::from_secs(20));
    // One connection: one worker, whose draw serves most of these.
    let mut conn = Conn::new(&t.replica_addr(1));
    for n in 1..=40u64 {
        let r = conn.get("/api/items", &[("x-api-key", b"pacer")]).unwrap();
        assert_eq!(r.status, 200);
        let rate_limit = r.header("ratelimit").unwrap_or_default().to_string();
        let want = format!("\"api/per-minute\";r={};", 300 - n);
        assert!(
            rate_limit.starts_with(&want),
            "request {n}: {rate_limit:?}, not {want:?}"
        );
    }
    assert_eq!(calls_to_meshlimitd(&t), 0);
}
