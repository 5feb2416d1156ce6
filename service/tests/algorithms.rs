//! Each algorithm against a real redis-server: admissions over time match
//! the algorithm's definition.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use meshlimit_testbed::http;
use meshlimit_testbed::services::Standalone;
use serde_json::{json, Value};

type Fixture = Standalone;

fn start(extra: &[&str]) -> Fixture {
    Standalone::start(Path::new(env!("CARGO_BIN_EXE_meshlimitd")), extra)
}

fn limit(algorithm: &str, requests: u64, window_ms: u64) -> Value {
    json!({"name": format!("api/{algorithm}"), "requests": requests, "window_ms": window_ms, "algorithm": algorithm})
}

fn decide(f: &Fixture, subject: &str, limits: &[Value]) -> Value {
    let body =
        serde_json::to_vec(&json!({"checks": [{"subject": subject, "limits": limits}]})).unwrap();
    let r = http::request(&f.service.addr, "POST", "/v1/check", &[], &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    v["results"][0].clone()
}

fn is_allowed(v: &Value) -> bool {
    v["allowed"] == json!(true)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Sleeps until `offset_ms` into the next window of `window_ms` (Redis and
/// this process read the same clock).
fn sleep_until_offset(window_ms: u64, offset_ms: u64) {
    let now = now_ms();
    let target = (now / window_ms + 1) * window_ms + offset_ms;
    std::thread::sleep(Duration::from_millis(target - now));
}

#[test]
fn fixed_window_admits_a_burst_on_each_side_of_an_edge() {
    let f = start(&[]);
    let l = [limit("fixed_window", 10, 1_000)];
    // 10 in the last 150 ms of one window, 10 in the first 150 ms of the next.
    sleep_until_offset(1_000, 850);
    let before = (0..12)
        .filter(|_| is_allowed(&decide(&f, "edge", &l)))
        .count();
    sleep_until_offset(1_000, 10);
    let after = (0..12)
        .filter(|_| is_allowed(&decide(&f, "edge", &l)))
        .count();
    assert_eq!(
        (before, after),
        (10, 10),
        "2x the limit within ~300 ms: the known edge effect"
    );
}

#[test]
fn sliding_window_log_never_admits_more_than_n_in_any_window() {
    let f = start(&[]);
    let (n, w) = (5usize, 500u64);
    let l = [limit("sliding_window_log", n as u64, w)];
    let mut admitted: Vec<(u64, u64)> = Vec::new();
    let end = Instant::now() + Duration::from_millis(2_200);
    let mut i = 0u64;
    while Instant::now() < end {
        let sent = now_ms();
        let ok = is_allowed(&decide(&f, "log", &l));
        let received = now_ms();
        if ok {
            admitted.push((sent, received));
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(7 + i % 23));
    }
    // The script's clock reading lies between send and receive, so every
    // admission j with recv_j < send_k + W is certainly within W of
    // admission k: those can never be more than n.
    for (k, &(send_k, _)) in admitted.iter().enumerate() {
        let in_window = admitted[k..]
            .iter()
            .filter(|(_, recv_j)| *recv_j < send_k + w)
            .count();
        assert!(
            in_window <= n,
            "window starting at admission {k} holds {in_window}"
        );
    }
    // And over the whole run it admitted close to n per window, not fewer.
    assert!(
        admitted.len() >= 2_000 / w as usize * n - n,
        "{} admitted",
        admitted.len()
    );
}

#[test]
fn sliding_window_log_lets_a_persistent_client_back_in_with_an_exact_retry() {
    let f = start(&[]);
    let l = [limit("sliding_window_log", 3, 1_000)];
    let first = now_ms();
    for _ in 0..3 {
        assert!(is_allowed(&decide(&f, "knocker", &l)));
    }
    // Keep knocking every 50 ms: denials are not recorded, so the client
    // gets back in once its first admission leaves the window.
    let mut retry = 0;
    let back_in = loop {
        let r = decide(&f, "knocker", &l);
        if is_allowed(&r) {
            break now_ms();
        }
        if retry == 0 {
            retry = r["limits"][0]["retry_after_ms"].as_u64().unwrap();
            assert!(retry > 800 && retry <= 1_000, "retry {retry}");
        }
        assert!(now_ms() - first < 3_000, "never let back in");
        std::thread::sleep(Duration::from_millis(50));
    };
    let waited = back_in - first;
    assert!(
        (1_000..1_200).contains(&waited),
        "back in after {waited} ms"
    );
    let key = f.redis.cli(&["--scan", "--pattern", "ml:*"]);
    let members: usize = f.redis.cli(&["zcard", key.trim()]).trim().parse().unwrap();
    assert!(
        members <= 3,
        "only admitted requests are recorded: {members}"
    );
}

#[test]
fn sliding_window_counter_weighs_the_previous_window() {
    let f = start(&[]);
    let l = [limit("sliding_window_counter", 10, 2_000)];
    sleep_until_offset(2_000, 20);
    for _ in 0..10 {
        assert!(is_allowed(&decide(&f, "swc", &l)));
    }
    // Half-way through the next window, about half of the 10 still count.
    sleep_until_offset(2_000, 1_000);
    let admitted = (0..10)
        .filter(|_| is_allowed(&decide(&f, "swc", &l)))
        .count();
    assert!((4..=6).contains(&admitted), "{admitted} admitted half-way");
    let key = f.redis.cli(&["--scan", "--pattern", "ml:*"]);
    assert_eq!(f.redis.cli(&["type", key.trim()]).trim(), "hash");
    assert_eq!(
        f.redis.cli(&["hlen", key.trim()]).trim(),
        "3",
        "constant memory"
    );
}

#[test]
fn token_bucket_spaces_requests_and_honours_burst() {
    let f = start(&[]);
    let mut l = limit("token_bucket", 10, 1_000);
    l["burst"] = json!(3);
    let l = [l];
    let admitted = (0..6).filter(|_| is_allowed(&decide(&f, "tb", &l))).count();
    assert_eq!(admitted, 3, "the burst, then nothing");
    let denied = decide(&f, "tb", &l);
    let retry = denied["limits"][0]["retry_after_ms"].as_u64().unwrap();
    assert!(
        (1..=100).contains(&retry),
        "one token every 100 ms, retry {retry}"
    );
    std::thread::sleep(Duration::from_millis(retry + 5));
    assert!(is_allowed(&decide(&f, "tb", &l)));
    assert!(!is_allowed(&decide(&f, "tb", &l)));
    // Over 1 s of steady knocking, about 10 more are admitted.
    let end = Instant::now() + Duration::from_millis(1_000);
    let mut n = 0;
    while Instant::now() < end {
        n += usize::from(is_allowed(&decide(&f, "tb", &l)));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!((9..=11).contains(&n), "{n} admitted in 1 s at 10/s");
    let key = f.redis.cli(&["--scan", "--pattern", "ml:*"]);
    assert_eq!(
        f.redis.cli(&["type", key.trim()]).trim(),
        "string",
        "one timestamp per key"
    );
}

#[test]
fn mixed_algorithms_in_one_check_are_all_or_nothing() {
    let f = start(&[]);
    let mut tb = limit("token_bucket", 2, 60_000);
    tb["burst"] = json!(2);
    let l = [
        limit("sliding_window_log", 10, 60_000),
        tb,
        limit("sliding_window_counter", 10, 60_000),
    ];
    let results: Vec<bool> = (0..5).map(|_| is_allowed(&decide(&f, "mix", &l))).collect();
    assert_eq!(results, [true, true, false, false, false]);
    let r = decide(&f, "mix", &[limit("sliding_window_log", 10, 60_000)]);
    assert_eq!(
        r["limits"][0]["remaining"],
        json!(7),
        "only the 2 admitted + this one"
    );
    let r = decide(&f, "mix", &[limit("sliding_window_counter", 10, 60_000)]);
    assert_eq!(r["limits"][0]["remaining"], json!(7));
}

#[test]
fn cost_takes_several_units_and_an_impossible_cost_says_why() {
    let f = start(&[]);
    let mut five = limit("fixed_window", 10, 60_000);
    five["cost"] = json!(5);
    let r = decide(&f, "cost", &[five.clone()]);
    assert!(is_allowed(&r));
    assert_eq!(r["limits"][0]["remaining"], json!(5));
    for algorithm in [
        "fixed_window",
        "sliding_window_log",
        "sliding_window_counter",
        "token_bucket",
    ] {
        let mut eleven = limit(algorithm, 10, 60_000);
        eleven["cost"] = json!(11);
        let r = decide(&f, &format!("big-{algorithm}"), &[eleven]);
        assert!(!is_allowed(&r), "{algorithm}");
        assert_eq!(
            r["limits"][0]["reason"],
            json!(format!(
                "cost 11 exceeds the capacity 10 of limit api/{algorithm}"
            ))
        );
        // Nothing was charged.
        let r = decide(
            &f,
            &format!("big-{algorithm}"),
            &[limit(algorithm, 10, 60_000)],
        );
        assert_eq!(r["limits"][0]["remaining"], json!(9), "{algorithm}");
    }
}

#[test]
fn shadow_limits_are_counted_but_never_deny() {
    let f = start(&[]);
    let mut shadow = limit("fixed_window", 2, 60_000);
    shadow["name"] = json!("trial/strict");
    shadow["shadow"] = json!(true);
    let l = [limit("fixed_window", 100, 60_000), shadow];
    let results: Vec<Value> = (0..5).map(|_| decide(&f, "sh", &l)).collect();
    assert!(results.iter().all(is_allowed));
    let shadow_denied = results
        .iter()
        .filter(|r| r["limits"][1]["allowed"] == json!(false))
        .count();
    assert_eq!(shadow_denied, 3, "what the rule would deny if enforced");
    assert!(results
        .iter()
        .all(|r| r["limits"][1]["shadow"] == json!(true)));
}

/// A batch shares script runs between its checks; each check must still be
/// decided exactly as a call of its own would decide it.
#[test]
fn a_batch_decides_every_algorithm_as_single_calls_do() {
    let f = start(&[]);
    let mixed = |shadow: bool| {
        vec![
            limit("fixed_window", 4, 60_000),
            limit("sliding_window_log", 5, 60_000),
            limit("sliding_window_counter", 6, 60_000),
            json!({"name": "api/tb", "requests": 3, "window_ms": 60_000,
                   "algorithm": "token_bucket", "burst": 3, "shadow": shadow}),
        ]
    };
    // One subject checked one call at a time; another with the same checks
    // (and a third, interleaved, on its own limits) in one batch.
    let singles: Vec<Value> = (0..8)
        .map(|_| decide(&f, "single", &mixed(false)))
        .collect();
    let mut checks = Vec::new();
    for i in 0..8 {
        checks.push(json!({"subject": "batched", "limits": mixed(false)}));
        if i % 2 == 0 {
            checks.push(json!({"subject": "other", "limits": mixed(true)}));
        }
    }
    let body = serde_json::to_vec(&json!({ "checks": checks })).unwrap();
    let r = http::request(&f.service.addr, "POST", "/v1/check", &[], &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let results = v["results"].as_array().unwrap();
    let batched: Vec<&Value> = checks
        .iter()
        .zip(results)
        .filter(|(c, _)| c["subject"] == json!("batched"))
        .map(|(_, r)| r)
        .collect();
    assert_eq!(batched.len(), singles.len());
    let shape = |r: &Value| -> Vec<(bool, u64)> {
        r["limits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                (
                    l["allowed"] == json!(true),
                    l["remaining"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    for (i, (single, batch)) in singles.iter().zip(&batched).enumerate() {
        assert_eq!(single["allowed"], batch["allowed"], "check {i}");
        assert_eq!(shape(single), shape(batch), "check {i}");
    }
    // The first 3 fit every limit (the token bucket's burst); then the
    // bucket denies and, all or nothing, nothing else is charged.
    let admitted = singles.iter().filter(|r| is_allowed(r)).count();
    assert_eq!(admitted, 3);
    // The interleaved subject's token bucket is shadow: its fourth check is
    // admitted (the fixed window allows 4), the bucket's denial reported
    // but not enforced.
    let other: Vec<bool> = checks
        .iter()
        .zip(results)
        .filter(|(c, _)| c["subject"] == json!("other"))
        .map(|(_, r)| is_allowed(r))
        .collect();
    assert_eq!(other, [true, true, true, true]);
}
