//! meshlimitd against a real redis-server: exact counts under concurrency,
//! atomicity across limits, expiry, errors and recovery.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::time::{Duration, Instant};

use meshlimit_testbed::http::{self, Response};
use meshlimit_testbed::services::{RedisServer, Standalone};
use serde_json::{json, Value};

type Fixture = Standalone;

fn start(extra: &[&str]) -> Fixture {
    Standalone::start(Path::new(env!("CARGO_BIN_EXE_meshlimitd")), extra)
}

fn limit(name: &str, requests: u64, window_ms: u64) -> Value {
    json!({"name": name, "requests": requests, "window_ms": window_ms, "algorithm": "fixed_window"})
}

fn check_body(subject: &str, limits: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"checks": [{"subject": subject, "limits": limits}]})).unwrap()
}

fn post(addr: &str, body: &[u8]) -> Response {
    http::request(
        addr,
        "POST",
        "/v1/check",
        &[("content-type", b"application/json")],
        body,
    )
    .unwrap()
}

/// The decision for a one-check call.
fn decide(addr: &str, subject: &str, limits: &[Value]) -> Value {
    let r = post(addr, &check_body(subject, limits));
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    v["results"][0].clone()
}

fn allowed(addr: &str, subject: &str, limits: &[Value], n: usize) -> usize {
    (0..n)
        .filter(|_| decide(addr, subject, limits)["allowed"] == json!(true))
        .count()
}

#[test]
fn concurrent_checks_admit_exactly_the_limit() {
    let f = start(&[]);
    let addr = f.service.addr.clone();
    let admitted = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| {
                let n = allowed(&addr, "hot", &[limit("api/m", 50, 60_000)], 15);
                admitted.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            });
        }
    });
    assert_eq!(admitted.into_inner(), 50);
}

#[test]
fn a_denied_check_charges_none_of_its_limits() {
    let f = start(&[]);
    let addr = &f.service.addr;
    let small = limit("api/small", 2, 60_000);
    let big = limit("api/big", 10, 60_000);
    assert_eq!(allowed(addr, "s", &[small.clone(), big.clone()], 5), 2);
    let r = decide(addr, "s", &[big]);
    assert_eq!(
        r["limits"][0]["remaining"],
        json!(7),
        "only the 2 admitted + this one count"
    );
    let denied = decide(addr, "s", &[small]);
    assert_eq!(denied["allowed"], json!(false));
    assert!(denied["limits"][0]["retry_after_ms"].as_u64().unwrap() > 0);
}

#[test]
fn every_key_expires_with_its_window_even_one_created_without_expiry() {
    let f = start(&[]);
    let addr = &f.service.addr;
    // A counter made in a minute's last moments expires before it can be
    // looked at (its window ends): start early in a minute, Redis' clock.
    let seconds: u64 = f
        .redis
        .cli(&["time"])
        .lines()
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    if seconds % 60 >= 58 {
        std::thread::sleep(Duration::from_secs(60 - seconds % 60) + Duration::from_millis(300));
    }
    decide(
        addr,
        "ttl",
        &[limit("api/m", 5, 60_000), limit("api/h", 5, 3_600_000)],
    );
    let keys = f.redis.cli(&["--scan", "--pattern", "ml:*"]);
    assert_eq!(keys.lines().count(), 2, "{keys}");
    for k in keys.lines() {
        let ttl: i64 = f.redis.cli(&["pttl", k]).trim().parse().unwrap();
        let window = if k.contains(":60000") {
            60_000
        } else {
            3_600_000
        };
        assert!(ttl > 0 && ttl <= window, "{k}: {ttl}");
    }
    // Someone INCRs a counter by hand and leaves it immortal: the next
    // check gives it back its expiry.
    let key = keys.lines().find(|k| k.contains(":60000")).unwrap();
    f.redis.cli(&["persist", key]);
    assert_eq!(f.redis.cli(&["pttl", key]).trim(), "-1");
    decide(addr, "ttl", &[limit("api/m", 5, 60_000)]);
    let ttl: i64 = f.redis.cli(&["pttl", key]).trim().parse().unwrap();
    assert!(ttl > 0, "expiry restored: {ttl}");
}

#[test]
fn quota_comes_back_when_the_window_ends() {
    let f = start(&[]);
    let addr = &f.service.addr;
    let l = [limit("api/s", 2, 1_000)];
    // Start at the beginning of a window.
    let r = decide(addr, "w", &l);
    std::thread::sleep(Duration::from_millis(
        r["limits"][0]["reset_after_ms"].as_u64().unwrap() + 20,
    ));
    assert_eq!(allowed(addr, "w", &l, 4), 2);
    let denied = decide(addr, "w", &l);
    let wait = denied["limits"][0]["retry_after_ms"].as_u64().unwrap();
    assert!((1..=1_000).contains(&wait));
    std::thread::sleep(Duration::from_millis(wait + 20));
    assert_eq!(allowed(addr, "w", &l, 3), 2);
}

#[test]
fn hostile_subjects_get_separate_counters_and_one_slot_per_call() {
    let f = start(&[]);
    let addr = &f.service.addr;
    let big = "k".repeat(16 * 1024);
    let subjects = [
        "a",
        "{a}",
        "x{a}y",
        "}{",
        big.as_str(),
        "ctl\u{1}\u{7f}",
        "a%7B",
    ];
    for s in subjects {
        assert_eq!(
            allowed(
                addr,
                s,
                &[limit("api/m", 3, 60_000), limit("api/h", 9, 3_600_000)],
                5
            ),
            3,
            "{s:.20}"
        );
    }
    let keys = f.redis.cli(&["--scan", "--pattern", "ml:*"]);
    assert_eq!(keys.lines().count(), 2 * subjects.len(), "{keys}");
    let tag = |k: &str| k[k.find('{').unwrap() + 1..k.find('}').unwrap()].to_string();
    let mut tags: Vec<String> = keys.lines().map(tag).collect();
    tags.sort();
    tags.dedup();
    // Two limits per subject, one tag (hence one slot) per subject.
    assert_eq!(tags.len(), subjects.len());
    assert!(keys.lines().all(|k| k.len() < 150));
}

#[test]
fn bad_requests_get_a_reason() {
    let f = start(&["--max-body-bytes", "4096"]);
    let addr = &f.service.addr;
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"not json".to_vec(), 400, "malformed check request"),
        // Unknown fields are ignored (rolling upgrades): this one is
        // refused for its empty batch, not for `extra`.
        (br#"{"checks":[],"extra":1}"#.to_vec(), 400, "at least one check"),
        (br#"{"checks":[]}"#.to_vec(), 400, "at least one check"),
        (check_body("s", &[limit("api/m", 0, 1000)]), 400, "checks[0].limits[0].requests: must be at least 1"),
        (check_body("s", &[limit("api/{m}", 1, 1000)]), 400, "checks[0].limits[0].name"),
        (
            serde_json::to_vec(&json!({"checks":[{"subject":"s","limits":[{"name":"a/b","requests":1,"window_ms":1000,"algorithm":"fixed_window","burst":3}]}]})).unwrap(),
            400,
            "only token_bucket has a burst",
        ),
        (vec![b' '; 5000], 413, ""),
    ];
    for (body, status, reason) in cases {
        let r = post(addr, &body);
        assert_eq!(r.status, status, "{}", r.body);
        assert!(
            r.body.contains(reason),
            "{} should contain {reason}",
            r.body
        );
    }
}

#[test]
fn redis_outage_is_a_fast_503_and_recovery_needs_no_restart() {
    let mut f = start(&[]);
    let addr = f.service.addr.clone();
    assert_eq!(http::get(&addr, "/readyz", &[]).unwrap().status, 200);
    f.redis.stop();
    let started = Instant::now();
    let r = post(&addr, &check_body("s", &[limit("api/m", 5, 60_000)]));
    assert_eq!(r.status, 503);
    assert!(r.body.contains("\"error\""), "{}", r.body);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(http::get(&addr, "/readyz", &[]).unwrap().status, 503);
    let host = f.redis.host.clone();
    f.redis = RedisServer::start(&host, f.dir.path());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = post(&addr, &check_body("s", &[limit("api/m", 5, 60_000)]));
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 503);
        assert!(
            Instant::now() < deadline,
            "no recovery after Redis came back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(http::get(&addr, "/readyz", &[]).unwrap().status, 200);
    let metrics = http::get(&addr, "/metrics", &[]).unwrap().body;
    for name in [
        "meshlimitd_decisions_total{result=\"allowed\"}",
        "meshlimitd_redis_errors_total{kind=",
        "meshlimitd_redis_latency_seconds_bucket",
        "meshlimitd_check_responses_total{status=\"503\"}",
    ] {
        assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
    }
}

#[test]
fn a_batch_of_checks_is_decided_check_by_check_in_order() {
    let f = start(&[]);
    let checks: Vec<Value> = (0..100)
        .map(|i| json!({"subject": format!("client-{}", i % 10), "limits": [limit("api/m", 5, 60_000)]}))
        .collect();
    let body = serde_json::to_vec(&json!({ "checks": checks })).unwrap();
    let r = post(&f.service.addr, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(
        results.len(),
        100,
        "one answer per check, in the request's order"
    );
    for client in 0..10 {
        let mine: Vec<&Value> = results.iter().skip(client).step_by(10).collect();
        let allowed: Vec<u64> = mine
            .iter()
            .filter(|r| r["allowed"] == json!(true))
            .map(|r| r["limits"][0]["remaining"].as_u64().unwrap())
            .collect();
        assert_eq!(allowed.len(), 5, "client {client}");
        let mut remaining = allowed.clone();
        remaining.sort();
        assert_eq!(
            remaining,
            [0, 1, 2, 3, 4],
            "each admission counted once, atomically"
        );
    }
    // With the script already loaded, the pipeline runs in request order.
    let again = post(&f.service.addr, &body);
    let v: Value = serde_json::from_str(&again.body).unwrap();
    assert!(v["results"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["allowed"] == json!(false)));
    let fresh: Vec<Value> = (0..20)
        .map(|i| json!({"subject": format!("ordered-{}", i % 2), "limits": [limit("api/m", 5, 60_000)]}))
        .collect();
    let r = post(
        &f.service.addr,
        &serde_json::to_vec(&json!({ "checks": fresh })).unwrap(),
    );
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let admitted: Vec<bool> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["allowed"] == json!(true))
        .collect();
    assert_eq!(admitted, (0..20).map(|i| i < 10).collect::<Vec<_>>());
}

/// The check script run as `script::check_args` and `script::limit_args`
/// lay out its arguments (meshlimitd does, and so does the bench's
/// redis-benchmark row, which had a copy of its own that missed the lease
/// arguments and measured only errors): it decides, exactly.
#[test]
fn the_check_script_decides_with_its_arguments_as_script_rs_lays_them_out() {
    use meshlimit_protocol::{Algorithm, Limit};
    use meshlimitd::script;
    let dir = meshlimit_testbed::procs::TempDir::new("script-args");
    let redis = RedisServer::start(&meshlimit_testbed::services::unique_host(), dir.path());
    let mut con = redis::Client::open(redis.url())
        .and_then(|c| c.get_connection())
        .unwrap();
    let limit = Limit {
        name: "api/minute".into(),
        requests: 100,
        window_ms: 60_000,
        algorithm: Algorithm::FixedWindow,
        cost: 1,
        burst: None,
        shadow: false,
        subject: None,
        calendar: None,
    };
    let run = |con: &mut redis::Connection, want: u64, share: u64| -> Vec<i64> {
        let s = redis::Script::new(script::CHECK);
        let mut invocation = s.key("ml:{t}:api/minute:fw:60000");
        for arg in script::check_args("n", false, "", (want, share), script::Follow::default()) {
            invocation.arg(arg);
        }
        for arg in script::limit_args(&limit) {
            invocation.arg(arg);
        }
        invocation.invoke(con).unwrap()
    };
    // allowed, leased, then per limit, then the clock.
    let first = run(&mut con, 0, 1);
    assert_eq!(
        first.len(),
        script::REPLY_HEAD + script::REPLY_PER_LIMIT + 1,
        "{first:?}"
    );
    assert_eq!((first[0], first[1]), (1, 0));
    // A lease of 5 over a share of 2 (49 a share left after the request): 5.
    assert_eq!(&run(&mut con, 5, 2)[..2], &[1, 5]);
    // 7 charged: 93 more, then none.
    let admitted = (0..95).filter(|_| run(&mut con, 0, 1)[0] == 1).count();
    assert_eq!(admitted, 93);
}

/// meshlimitd's decisions by limit, against a real Redis: the limit that
/// denied has its own series, beside build_info with the version.
#[test]
fn decisions_are_counted_by_limit_and_the_version_is_exported() {
    let f = start(&[]);
    let addr = f.service.addr.clone();
    for _ in 0..3 {
        let r = post(
            &addr,
            &check_body("by-limit", &[limit("api/per-minute", 2, 60_000)]),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let metrics = http::get(&addr, "/metrics", &[]).unwrap().body;
    for line in [
        r#"meshlimitd_limit_decisions_total{limit="api/per-minute",result="allowed"} 2"#,
        r#"meshlimitd_limit_decisions_total{limit="api/per-minute",result="denied"} 1"#,
        r#"meshlimitd_limit_decisions_total{limit="api/per-minute",result="near_limit"} 1"#,
        "meshlimitd_limit_labels_overflowed_total 0",
        r#"meshlimitd_script_duration_seconds_count{algorithm="fixed_window"} 3"#,
        concat!(
            r#"meshlimitd_build_info{version=""#,
            env!("CARGO_PKG_VERSION"),
            r#""} 1"#
        ),
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
}

/// Redis' memory and evictions reach /metrics (read when scraped), for the
/// alerts on a Redis near maxmemory or evicting counters.
#[test]
fn redis_memory_and_evictions_are_exported() {
    let f = start(&[]);
    f.redis.cli(&["config", "set", "maxmemory", "104857600"]);
    let metrics = http::get(&f.service.addr, "/metrics", &[]).unwrap().body;
    assert!(
        metrics.contains("meshlimitd_redis_maxmemory_bytes 104857600"),
        "{metrics}"
    );
    assert!(
        metrics.contains("meshlimitd_redis_evicted_keys 0"),
        "{metrics}"
    );
    let used: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("meshlimitd_redis_used_memory_bytes "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(used > 0, "{metrics}");
    assert!(metrics.contains("meshlimitd_redis_healthy 1"), "{metrics}");
}
