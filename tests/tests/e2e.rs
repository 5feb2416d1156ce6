//! End to end: real Envoy (front + two replicas running meshlimit.wasm),
//! real meshlimitd, real redis-server, all on a loopback address of the
//! test's own.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use meshlimit_testbed::http;
use meshlimit_testbed::procs::TempDir;
use meshlimit_testbed::topology::validate_envoy_config;
use meshlimit_testbed::{Topology, TopologyOptions};

#[test]
fn global_limit_holds_exactly_across_two_replicas() {
    let t = topology(keyed_config("local"));
    wait_for_fresh_window(Duration::from_secs(15));
    // Clients A and B at the same time, each 60 requests.
    let results = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|s| {
        for id in ["client-a", "client-b"] {
            let (t, results) = (&t, Arc::clone(&results));
            s.spawn(move || {
                let r = burst(t, &key(id), 60);
                results.lock().unwrap().push((id, r));
            });
        }
    });
    for (id, (ok, denied)) in results.lock().unwrap().iter() {
        assert_eq!((*ok, *denied), (LIMIT, 60 - LIMIT), "{id}");
    }
    let (r1, r2) = (t.replica_requests(1), t.replica_requests(2));
    assert!(r1 > 0 && r2 > 0, "both replicas must serve: {r1} / {r2}");
    assert_eq!(r1 + r2, 120);
    assert_eq!(t.globally_allowed(), 2 * LIMIT as u64);
    // Denials come from meshlimitd first, then from the deny cache.
    let denied =
        t.stat_total("meshlimit.requests_denied") + t.stat_total("meshlimit.deny_cache_hits");
    assert_eq!(denied, 120 - 2 * LIMIT as u64);
    assert!(t.stat_total("meshlimit.deny_cache_hits") > 0);
    assert_eq!(t.stat_total("meshlimit.fallback_allowed"), 0);
}

#[test]
fn sixty_four_concurrent_connections_never_exceed_the_limit() {
    let t = topology(keyed_config("local"));
    wait_for_fresh_window(Duration::from_secs(20));
    let allowed = Arc::new(Mutex::new(0usize));
    let other = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|s| {
        for _ in 0..64 {
            let (t, allowed, other) = (&t, Arc::clone(&allowed), Arc::clone(&other));
            s.spawn(move || {
                for _ in 0..4 {
                    let r = send(t, &key("hot-client"));
                    match r.status {
                        200 => *allowed.lock().unwrap() += 1,
                        429 => {}
                        s => other.lock().unwrap().push(s),
                    }
                }
            });
        }
    });
    assert!(
        other.lock().unwrap().is_empty(),
        "statuses: {:?}",
        other.lock().unwrap()
    );
    let fallbacks = t.fallback_decisions();
    assert_eq!(
        fallbacks,
        0,
        "the service must have decided every request: {}",
        t.fallback_causes()
    );
    assert_eq!(*allowed.lock().unwrap(), LIMIT);
}

#[test]
fn headers_report_the_limit_and_retry_after() {
    // Leases off: each request's remaining is then meshlimitd's count
    // (from a lease it is what this replica holds, a floor: tests/leases.rs).
    let t = topology(
        keyed("local")
            .set("leases", json!({"enabled": false}))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(10));
    for n in 1..=LIMIT {
        let r = send(&t, &key("header-client"));
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"api/per-minute\";q=20;w=60")
        );
        let rl = r.header("ratelimit").unwrap_or_default().to_string();
        assert!(
            rl.starts_with(&format!("\"api/per-minute\";r={};t=", LIMIT - n)),
            "request {n}: {rl}"
        );
        assert_eq!(r.body, "hello from the upstream\n");
    }
    let r = send(&t, &key("header-client"));
    assert_eq!(r.status, 429);
    assert_eq!(r.body, "rate limit exceeded\n");
    let retry: u64 = r
        .header("retry-after")
        .unwrap_or("x")
        .parse()
        .expect("numeric Retry-After");
    assert!((1..=60).contains(&retry), "retry-after {retry}");
    let rl = r.header("ratelimit").unwrap_or_default();
    assert_eq!(rl, format!("\"api/per-minute\";r=0;t={retry}"));
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"api/per-minute\";q=20;w=60")
    );
}

#[test]
fn x_ratelimit_headers_when_configured() {
    let config = keyed("local").set("response", json!({"headers": "x-ratelimit"}));
    let t = topology(config.build());
    wait_for_fresh_window(Duration::from_secs(5));
    let r = send(&t, &key("x-client"));
    assert_eq!(r.header("x-ratelimit-limit"), Some("20"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("19"));
    assert!(r.header("ratelimit").is_none());
}

#[test]
fn redis_outage_falls_back_per_replica_and_recovers() {
    let mut t = topology(keyed_config("local"));
    wait_for_fresh_window(Duration::from_secs(25));
    t.stop_redis();
    // Each replica now enforces the limit on its own: 20 each, 40 in all.
    let (ok, denied) = burst(&t, &key("outage-client"), 60);
    assert_eq!((ok, denied), (2 * LIMIT, 60 - 2 * LIMIT));
    assert_eq!(t.stat_total("meshlimit.fallback_allowed"), 2 * LIMIT as u64);
    assert_eq!(
        t.stat_total("meshlimit.fallback_denied"),
        60 - 2 * LIMIT as u64
    );
    // The breaker opened after a few failed calls; the rest were not made.
    let unavailable = t.stat_total("meshlimit.service_errors.unavailable");
    assert!((5..60).contains(&unavailable), "{unavailable} failed calls");
    assert!(t.stat_total("meshlimit.breaker_opened") >= 1);
    assert_eq!(t.stat_total("meshlimit.requests_allowed"), 0);
    // Redis back: no restart of Envoy or meshlimitd, the global limit returns.
    t.start_redis();
    wait_for_global_decisions(&t, Duration::from_secs(10));
    wait_for_fresh_window(Duration::from_secs(10));
    assert_eq!(burst(&t, &key("after-outage"), 40), (LIMIT, 40 - LIMIT));
    let log = t.logs("replica-1") + &t.logs("replica-2");
    assert!(log.contains("cannot reach Redis"), "the fallback is logged");
}

#[test]
fn meshlimitd_down_is_a_fallback_not_an_error() {
    let mut t = topology(keyed_config("local"));
    wait_for_fresh_window(Duration::from_secs(15));
    t.stop_meshlimitd();
    let (ok, denied) = burst(&t, &key("no-service"), 50);
    assert_eq!((ok, denied), (2 * LIMIT, 50 - 2 * LIMIT));
    assert!(t.stat_total("meshlimit.service_errors.connection") >= 5);
    assert!(t.stat_total("meshlimit.breaker_opened") >= 1);
    t.start_meshlimitd();
    wait_for_global_decisions(&t, Duration::from_secs(10));
}

#[test]
fn with_group_commit_off_every_check_is_its_own_call() {
    let mut t = topology(
        keyed("local")
            .set("group_commit", json!({"enabled": false}))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(15));
    assert_eq!(burst(&t, &key("solo"), 30), (LIMIT, 10));
    let calls: u64 = (1..=2)
        .map(|i| {
            http::envoy_stats(
                &t.replica_admin(i),
                "^cluster\\.meshlimit\\.upstream_rq_total$",
            )
            .first()
            .map_or(0, |(_, v)| *v)
        })
        .sum();
    let cached = t.stat_total("meshlimit.deny_cache_hits");
    // Renewals are calls of their own, for no request.
    let renewals = t.stat_total("meshlimit.lease_renewals");
    assert_eq!(
        calls - renewals + cached + t.lease_hits(),
        30,
        "one call per request that neither the cache nor a lease answered"
    );
    assert_eq!(t.stat_total("meshlimit.batches"), 0);
    // The per-request path falls back the same way.
    t.stop_meshlimitd();
    assert_eq!(
        burst(&t, &key("solo-down"), 50),
        (2 * LIMIT, 50 - 2 * LIMIT)
    );
    assert!(t.stat_total("meshlimit.service_errors.connection") >= 1);
    t.start_meshlimitd();
    wait_for_global_decisions(&t, Duration::from_secs(10));
    assert_no_vm_panics(&t);
}

#[test]
fn failure_mode_deny_sends_the_configured_deny() {
    let config = keyed("deny").set(
        "response",
        json!({"status": 503, "body": "limiter unavailable\n"}),
    );
    let mut t = Topology::start(TopologyOptions {
        plugin_config: config.build(),
        replicas: 1,
        front: false,
        ..TopologyOptions::default()
    });
    t.stop_meshlimitd();
    let r = send(&t, &key("anyone"));
    assert_eq!(r.status, 503);
    assert_eq!(r.body, "limiter unavailable\n");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(t.stat(1, "meshlimit.fallback_denied"), 1);
}

#[test]
fn failure_mode_allow_lets_everything_through() {
    let mut t = Topology::start(TopologyOptions {
        plugin_config: keyed_config("allow"),
        replicas: 1,
        front: false,
        ..TopologyOptions::default()
    });
    t.stop_meshlimitd();
    assert_eq!(burst(&t, &key("anyone"), 30), (30, 0));
    assert_eq!(t.stat(1, "meshlimit.fallback_allowed"), 30);
}

#[test]
fn missing_client_id_follows_when_missing() {
    // reject: a clear 401, counted.
    let t = single_replica(plugin_config(
        json!({"headers": ["x-api-key"], "when_missing": "reject"}),
        "local",
    ));
    let r = t.get("/api/items", &[]);
    assert_eq!(r.status, 401);
    assert!(r.body.contains("x-api-key"), "{}", r.body);
    assert_eq!(t.stat(1, "meshlimit.rejected_no_client_id"), 1);
    drop(t);

    // anonymous: every request without an id shares one bucket.
    let t = single_replica(plugin_config(
        json!({"headers": ["x-api-key"], "when_missing": "anonymous"}),
        "local",
    ));
    wait_for_fresh_window(Duration::from_secs(10));
    assert_eq!(burst(&t, &[], 25), (LIMIT, 5));
    assert_eq!(send(&t, &key("has-a-key")).status, 200);
}

#[test]
fn a_query_parameter_identifies_the_client_however_it_is_encoded() {
    let t = single_replica(plugin_config(
        json!({"query_params": ["api_key"], "when_missing": "reject"}),
        "local",
    ));
    wait_for_fresh_window(Duration::from_secs(10));
    // Two spellings of one key share one quota, as they are one key to the
    // upstream.
    let spellings = ["/api/items?api_key=k1", "/api/items?page=2&api%5Fkey=%6B1"];
    let admitted = (0..LIMIT + 4)
        .filter(|i| t.get(spellings[i % 2], &[]).status == 200)
        .count();
    assert_eq!(admitted, LIMIT);
    let other = t.get("/api/items?api_key=k2", &[]);
    assert_eq!(other.status, 200, "another key has its own quota");
    // Given twice, the key is ambiguous: missing, so rejected here.
    let r = t.get("/api/items?api_key=k2&api_key=k1", &[]);
    assert_eq!(r.status, 401);
    assert!(r.body.contains("api_key"), "{}", r.body);
    assert_no_vm_panics(&t);
}

#[test]
fn client_address_comes_from_the_trusted_forwarded_for_hop() {
    // Through the front (one trusted hop), clients without a key are counted
    // by their address; a forged x-forwarded-for entry changes nothing.
    let t = topology(keyed_config("local"));
    wait_for_fresh_window(Duration::from_secs(15));
    let mut allowed = 0;
    for i in 0..30 {
        let forged = format!("10.9.9.{i}");
        let r = send(&t, &[("x-forwarded-for", forged.into_bytes())]);
        allowed += usize::from(r.status == 200);
    }
    assert_eq!(allowed, LIMIT, "every request came from one address");
}

#[test]
fn hostile_client_ids_get_their_own_counters_and_never_crash_the_filter() {
    let t = topology(keyed_config("local"));
    wait_for_fresh_window(Duration::from_secs(30));
    let mut big = vec![b'k'; 16 * 1024];
    let ids: Vec<Vec<u8>> = vec![
        b"a".to_vec(),
        b"{a}".to_vec(),
        b"x{a}y".to_vec(),
        b"}{".to_vec(),
        big.clone(),
        {
            big.push(b'k');
            big
        },
        b"tab\there".to_vec(),
        vec![b'o', 0xff, 0xfe, b'x'],
    ];
    for id in &ids {
        let (ok, denied) = burst(&t, &[("x-api-key", id.clone())], LIMIT + 3);
        assert_eq!((ok, denied), (LIMIT, 3), "id of {} bytes", id.len());
    }
    // A raw control byte is refused by Envoy's HTTP parser before the filter.
    let r = http::get(&t.entry(), "/api/items", &[("x-api-key", b"ctl\x01byte")]);
    if let Ok(r) = r {
        assert_eq!(r.status, 400);
    }
    // The VMs are alive and count correctly afterwards.
    assert_eq!(burst(&t, &key("after-hostile"), LIMIT + 1), (LIMIT, 1));
    assert_no_vm_panics(&t);
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(
        keys.lines().all(|k| k.len() < 200),
        "keys stay small:\n{keys}"
    );
    assert!(keys
        .lines()
        .all(|k| k.matches('{').count() == 1 && k.matches('}').count() == 1));
    for k in keys.lines() {
        let ttl: i64 = t.redis_cli(&["pttl", k]).trim().parse().unwrap_or(-3);
        assert!(ttl > 0, "{k} has no expiry ({ttl})");
    }
}

#[test]
fn a_config_with_an_unknown_field_is_rejected_naming_the_field() {
    let t = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        start_service: false,
        ..TopologyOptions::default()
    });
    let dir = TempDir::new("bad-config");
    let bad = keyed("local").limit_field("burts", json!(5)).build();
    let (ok, out) = validate_envoy_config(&t.replica_config_with(1, &bad), dir.path(), "bad");
    assert!(!ok, "Envoy must refuse the config:\n{out}");
    assert!(
        out.contains("invalid meshlimit configuration: field `rules[0].limits[0].burts`: unknown field `burts`"),
        "Envoy's log must name the field:\n{out}"
    );
    let zero = keyed("local").limit_field("requests", json!(0)).build();
    let (ok, out) = validate_envoy_config(&t.replica_config_with(1, &zero), dir.path(), "zero");
    assert!(!ok);
    assert!(
        out.contains("field `rules[0].limits[0].requests`: must be at least 1"),
        "{out}"
    );
}

/// A real gRPC client (Python's grpcio) through a replica: the requests
/// past the limit fail with RESOURCE_EXHAUSTED and the deny's reason, not
/// with the UNAVAILABLE that gRPC clients read an HTTP 429 as (and retry).
#[test]
fn a_denied_grpc_request_fails_with_resource_exhausted() {
    let t = topology(keyed_config("local"));
    wait_for_fresh_window(Duration::from_secs(15));
    let client = r#"
import sys, grpc
channel = grpc.insecure_channel(sys.argv[1])
call = channel.unary_unary("/meshlimit.test.Echo/Say")
for _ in range(int(sys.argv[2])):
    try:
        call(b"", metadata=(("x-api-key", "grpc-client"),), timeout=5)
        print("OK")
    except grpc.RpcError as e:
        print(e.code().name, "|", e.details())
"#;
    let n = LIMIT + 5;
    let out = std::process::Command::new(meshlimit_testbed::tools::venv_python())
        .args(["-c", client, &t.replica_addr(1), &n.to_string()])
        .output()
        .unwrap();
    let lines = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{lines}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let denied: Vec<&str> = lines
        .lines()
        .filter(|l| l.starts_with("RESOURCE_EXHAUSTED"))
        .collect();
    // The admitted ones reach an upstream that does not speak gRPC: any
    // other status, but never RESOURCE_EXHAUSTED nor UNAVAILABLE.
    assert_eq!(denied.len(), 5, "{lines}");
    assert!(
        denied.iter().all(|l| l.contains("rate limit exceeded")),
        "{lines}"
    );
    assert!(!lines.contains("UNAVAILABLE"), "{lines}");
}

/// Truthful headers with the default configuration (leases on): a client
/// of 20 a minute through two replicas behind a round-robin front reads
/// `r` falling by one per admitted request, 19 to 0, and 0 on its refusal;
/// `X-RateLimit-Remaining` the same. (A fresh client used to read 19, 18,
/// then 9: the units charged into a lease were reported as gone. A limit
/// under 64 is not leased.)
#[test]
fn remaining_falls_by_one_per_request_with_the_default_configuration() {
    for style in ["draft", "x-ratelimit"] {
        let t = topology(
            PluginConfig::new()
                .set("response", json!({"headers": style}))
                .build(),
        );
        wait_for_fresh_window(Duration::from_secs(10));
        let mut seen = Vec::new();
        for _ in 0..=LIMIT {
            let r = send(&t, &key("truthful"));
            let remaining = match style {
                "draft" => r
                    .header("ratelimit")
                    .and_then(|v| v.split(";r=").nth(1))
                    .and_then(|v| v.split(';').next())
                    .map(str::to_string),
                _ => r.header("x-ratelimit-remaining").map(str::to_string),
            };
            seen.push((r.status, remaining.unwrap_or_default()));
        }
        let expected: Vec<(u16, String)> = (1..=LIMIT)
            .map(|n| (200, (LIMIT - n).to_string()))
            .chain([(429, "0".to_string())])
            .collect();
        assert_eq!(seen, expected, "{style}");
    }
}
