//! Quota leases (the service side), against a real redis-server: a check
//! may ask for up to `units` more units on every limit; the script grants
//! only what fits after the request, divided by `share`, on fixed and
//! sliding-counter windows and token buckets, never on a sliding log;
//! unused units come back as a settlement at 0 in the counter they were
//! charged to.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;

use meshlimit_testbed::procs::eventually;
use meshlimit_testbed::services::Standalone;
use serde_json::{json, Value};

fn start() -> Standalone {
    Standalone::start(Path::new(env!("CARGO_BIN_EXE_meshlimitd")), &[])
}

fn limit(algorithm: &str, requests: u64) -> Value {
    json!({"name": format!("hot/{algorithm}"), "requests": requests, "window_ms": 60_000,
           "algorithm": algorithm})
}

/// A check of one request on `limits`, asking for a lease of `units`.
fn leased_check(subject: &str, limits: &[Value], units: u64, share: u64) -> Value {
    json!({"subject": subject, "limits": limits, "lease": {"units": units, "share": share}})
}

fn ask(f: &Standalone, subject: &str, limits: &[Value], units: u64, share: u64) -> Value {
    let v = f.check(&json!({"checks": [leased_check(subject, limits, units, share)]}));
    v["results"][0].clone()
}

fn leased(result: &Value) -> u64 {
    result["leased"].as_u64().unwrap_or(0)
}

fn remaining(result: &Value, i: usize) -> u64 {
    result["limits"][i]["remaining"].as_u64().unwrap()
}

/// A call whose caller waits `timeout_ms` (`x-meshlimit-timeout-ms`).
fn call_within(
    f: &Standalone,
    body: &Value,
    timeout_ms: &str,
) -> meshlimit_testbed::http::Response {
    meshlimit_testbed::http::request(
        &f.service.addr,
        "POST",
        "/v1/check",
        &[(meshlimit_protocol::TIMEOUT_HEADER, timeout_ms.as_bytes())],
        body.to_string().as_bytes(),
    )
    .unwrap()
}

#[test]
fn a_lease_is_what_fits_divided_by_the_share_and_never_more_than_the_limit() {
    let f = start();
    for algorithm in ["fixed_window", "sliding_window_counter", "token_bucket"] {
        let subject = format!("client-{algorithm}");
        let l = limit(algorithm, 100);
        // 99 left after the request; a quarter of that is 24.
        let r = ask(&f, &subject, std::slice::from_ref(&l), 50, 4);
        assert_eq!(r["allowed"], json!(true), "{algorithm}: {r}");
        assert_eq!(leased(&r), 24, "{algorithm}: {r}");
        assert_eq!(remaining(&r, 0), 75, "{algorithm}: {r}");
        assert_eq!(r["receipts"].as_array().map(Vec::len), Some(1), "{r}");
        // Asking for less than fits gets what was asked.
        let r = ask(&f, &subject, std::slice::from_ref(&l), 10, 1);
        assert_eq!((leased(&r), remaining(&r, 0)), (10, 64), "{algorithm}: {r}");
        // Until the tail: each lease takes at most half of what is left,
        // and the last units are decided one by one.
        let mut total = 1 + 24 + 1 + 10;
        let mut calls = 2;
        loop {
            let r = ask(&f, &subject, std::slice::from_ref(&l), 1_000, 2);
            if r["allowed"] != json!(true) {
                assert_eq!(leased(&r), 0, "a denied check leases nothing: {r}");
                break;
            }
            assert!(leased(&r) <= remaining(&r, 0) + leased(&r), "{r}");
            assert!(leased(&r) == 0 || leased(&r) >= 8, "never a few units: {r}");
            total += 1 + leased(&r);
            calls += 1;
            assert!(calls < 100, "{algorithm}: no end");
        }
        assert_eq!(total, 100, "{algorithm}: the limit, and not one unit more");
    }
}

/// A lease of a few units saves a few calls, and held by one replica it is
/// a large part of what is left (another replica is refused it until it
/// comes back): under 8 units a share, the script grants none, and the
/// last units of a window are decided one by one.
#[test]
fn no_lease_from_a_limit_with_less_than_eight_units_a_share_left() {
    let f = start();
    for algorithm in ["fixed_window", "sliding_window_counter", "token_bucket"] {
        let subject = format!("tail-{algorithm}");
        let l = limit(algorithm, 64);
        // 63 left after the request: 15 a share, 5 asked.
        let r = ask(&f, &subject, std::slice::from_ref(&l), 5, 4);
        assert_eq!(leased(&r), 5, "{algorithm}: {r}");
        // 57 left: 14 a share.
        let r = ask(&f, &subject, std::slice::from_ref(&l), 100, 4);
        assert_eq!((leased(&r), remaining(&r, 0)), (14, 43), "{algorithm}: {r}");
        // 42 left: 10 a share.
        let r = ask(&f, &subject, std::slice::from_ref(&l), 100, 4);
        assert_eq!((leased(&r), remaining(&r, 0)), (10, 32), "{algorithm}: {r}");
        // 31 left: 7 a share, none leased.
        let r = ask(&f, &subject, std::slice::from_ref(&l), 100, 4);
        assert_eq!((leased(&r), remaining(&r, 0)), (0, 31), "{algorithm}: {r}");
    }
}

/// A limit under 64 a window is never leased, however much of it is left:
/// split between replicas, a client would see refusals while another
/// replica held its units (issue 35: 17 of 20 through four replicas).
#[test]
fn a_limit_too_small_to_split_is_never_leased() {
    let f = start();
    for algorithm in ["fixed_window", "sliding_window_counter", "token_bucket"] {
        let small = limit(algorithm, 63);
        let r = ask(
            &f,
            &format!("small-{algorithm}"),
            std::slice::from_ref(&small),
            20,
            1,
        );
        assert_eq!(leased(&r), 0, "{algorithm}: {r}");
        assert!((61..=62).contains(&remaining(&r, 0)), "{algorithm}: {r}");
        let enough = limit(algorithm, 64);
        let r = ask(
            &f,
            &format!("enough-{algorithm}"),
            std::slice::from_ref(&enough),
            20,
            1,
        );
        assert_eq!(leased(&r), 20, "{algorithm}: {r}");
    }
}

#[test]
fn the_tightest_limit_sizes_the_lease_and_a_sliding_log_gets_none() {
    let f = start();
    let tight = json!({"name": "hot/tight", "requests": 70, "window_ms": 60_000,
                       "algorithm": "fixed_window"});
    let wide = limit("sliding_window_counter", 1000);
    let r = ask(&f, "both", &[tight.clone(), wide.clone()], 100, 2);
    // 69 left on the tight one: 34 leased on both.
    assert_eq!(leased(&r), 34, "{r}");
    assert_eq!((remaining(&r, 0), remaining(&r, 1)), (35, 965), "{r}");
    let log = limit("sliding_window_log", 1000);
    let r = ask(&f, "both", &[wide, log], 100, 1);
    assert_eq!(r["allowed"], json!(true), "{r}");
    assert_eq!(leased(&r), 0, "a sliding log is never leased: {r}");
    assert!(r.get("receipts").is_none(), "{r}");
    // A check that asks for no lease gets none, in a batch too.
    let v = f.check(
        &json!({"checks": [{"subject": "plain", "limits": [limit("fixed_window", 100)]},
                           leased_check("batched", &[limit("fixed_window", 100)], 3, 1)]}),
    );
    assert_eq!(leased(&v["results"][0]), 0, "{v}");
    assert_eq!(leased(&v["results"][1]), 3, "{v}");
    assert_eq!(remaining(&v["results"][1], 0), 96, "{v}");
}

#[test]
fn unused_units_come_back_as_a_settlement_at_zero() {
    let f = start();
    for algorithm in ["fixed_window", "sliding_window_counter", "token_bucket"] {
        let subject = format!("idle-{algorithm}");
        let l = limit(algorithm, 100);
        let r = ask(&f, &subject, std::slice::from_ref(&l), 40, 1);
        assert_eq!((leased(&r), remaining(&r, 0)), (40, 59), "{algorithm}: {r}");
        // 15 of the 40 used; 25 go back.
        let mut unused = l.clone();
        unused["cost"] = json!(25);
        let v = f.check(
            &json!({"checks": [], "settlements": [{"subject": subject, "limits": [unused],
                                                    "actual": [0], "receipts": r["receipts"]}]}),
        );
        let left = v["settled"][0]["remaining"][0].as_u64().unwrap();
        assert!((84..=85).contains(&left), "{algorithm}: {v}");
    }
}

/// A lease on a second's window and a minute's lives as long as the
/// second; once it ended, the filter gives back what the lease left
/// (`src/flow/leases.rs` `expiry_ends_every_window`), and the units go back
/// to the minute, whose window still counts them, and not to the next
/// second, which never held them.
#[test]
fn units_given_back_after_the_shorter_window_ended_go_to_the_longer_one() {
    let f = start();
    let second = json!({"name": "hot/s", "requests": 100, "window_ms": 1_000,
                        "algorithm": "fixed_window"});
    let minute = json!({"name": "hot/m", "requests": 6_000, "window_ms": 60_000,
                        "algorithm": "fixed_window"});
    let limits = [second.clone(), minute.clone()];
    // Start early in a second, so that the ask is charged to one that ends
    // well after it.
    let early_in_a_second = || {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.unwrap().subsec_millis() < 300
    };
    assert!(eventually(
        std::time::Duration::from_secs(3),
        early_in_a_second
    ));
    let r = ask(&f, "two-windows", &limits, 40, 1);
    assert_eq!(leased(&r), 40, "{r}");
    assert_eq!((remaining(&r, 0), remaining(&r, 1)), (59, 5_959), "{r}");
    std::thread::sleep(std::time::Duration::from_millis(1_100));
    // The second has ended; 30 of the 40 were not used.
    let unused: Vec<Value> = limits
        .iter()
        .map(|l| {
            let mut l = l.clone();
            l["cost"] = json!(30);
            l
        })
        .collect();
    let v = f.check(
        &json!({"checks": [], "settlements": [{"subject": "two-windows",
        "limits": unused, "actual": [0, 0], "receipts": r["receipts"]}]}),
    );
    let left: Vec<u64> = v["settled"][0]["remaining"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    // The minute has them back (5,989 left); the new second never held
    // them (all 100 left).
    assert_eq!(left, [100, 5_989], "{v}");
    let v = f.check(&json!({"checks": [{"subject": "two-windows", "limits": limits}]}));
    let r = &v["results"][0];
    assert_eq!((remaining(r, 0), remaining(r, 1)), (99, 5_988), "{r}");
}

#[test]
fn lease_bounds_are_checked_and_named() {
    let f = start();
    for (lease, field) in [
        (
            json!({"units": 2_000_000, "share": 1}),
            "checks[0].lease.units",
        ),
        (json!({"units": 5, "share": 0}), "checks[0].lease.share"),
    ] {
        let body = json!({"checks": [{"subject": "s", "limits": [limit("fixed_window", 10)],
                                      "lease": lease}]});
        let r = f.post_check(&body);
        assert!(r.body.contains(field), "{}", r.body);
    }
}

/// A renewal: a check of cost 0 that only asks for a lease (the filter
/// sends one before its lease runs out, for no request). It is charged the
/// lease alone, on every leasable algorithm; cost 0 without a lease ask is
/// refused, naming the field.
#[test]
fn a_renewal_costs_nothing_but_its_lease() {
    let f = start();
    for algorithm in ["fixed_window", "sliding_window_counter", "token_bucket"] {
        let subject = format!("renew-{algorithm}");
        let mut l = limit(algorithm, 100);
        l["cost"] = json!(0);
        // 100 left, over a share of 4: 25.
        let r = ask(&f, &subject, std::slice::from_ref(&l), 50, 4);
        assert_eq!(r["allowed"], json!(true), "{algorithm}: {r}");
        assert_eq!((leased(&r), remaining(&r, 0)), (25, 75), "{algorithm}: {r}");
        assert_eq!(r["receipts"].as_array().map(Vec::len), Some(1), "{r}");
    }
    let mut l = limit("fixed_window", 100);
    l["cost"] = json!(0);
    for check in [
        json!({"subject": "no-lease", "limits": [l]}),
        json!({"subject": "no-units", "limits": [l], "lease": {"units": 0, "share": 1}}),
    ] {
        let r = f.post_check(&json!({"checks": [check]}));
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains("checks[0].limits[0].cost"), "{}", r.body);
    }
}

/// Redis Cluster's MIGRATE moves a key with its time to live, not its
/// deadline: on the new node a fixed window's counter expires a
/// millisecond or two later than the window's last millisecond. Units
/// given back after the move must still land in it (they were silently
/// dropped: the settlement compared deadlines exactly).
#[test]
fn units_come_back_to_a_counter_whose_deadline_moved_with_its_slot() {
    let f = start();
    let l = limit("fixed_window", 100);
    let r = ask(&f, "moved", std::slice::from_ref(&l), 40, 1);
    assert_eq!((leased(&r), remaining(&r, 0)), (40, 59), "{r}");
    let keys = f.redis.cli(&["--scan", "--pattern", "ml:*moved*:fw:*"]);
    let key = keys.lines().next().expect("the counter").to_string();
    let deadline: u64 = f.redis.cli(&["pexpiretime", &key]).trim().parse().unwrap();
    for shift in [2, -2] {
        let moved = (deadline as i64 + shift).to_string();
        f.redis.cli(&["pexpireat", &key, &moved]);
        let mut unused = l.clone();
        unused["cost"] = json!(10);
        let v = f.check(
            &json!({"checks": [], "settlements": [{"subject": "moved", "limits": [unused],
                                                    "actual": [0], "receipts": r["receipts"]}]}),
        );
        assert_eq!(
            v["settled"][0]["remaining"][0],
            json!(if shift > 0 { 69 } else { 79 }),
            "{v}"
        );
    }
    assert_eq!(f.redis.cli(&["get", &key]).trim(), "21");
}

/// A decision whose caller gave up: Redis paused writes past the caller's
/// deadline (`x-meshlimit-timeout-ms`), so meshlimitd answered 503 and the
/// caller decided the request without it, while the script still ran and
/// granted a lease nobody would receive. Those units, and the request's
/// own, go back once the script ends: the counter is where it was. On the
/// old code they stayed charged until the window ended (a burnt window
/// under repeated stalls).
#[test]
fn what_a_decision_leased_after_its_caller_gave_up_goes_back() {
    let f = Standalone::start(
        Path::new(env!("CARGO_BIN_EXE_meshlimitd")),
        &["--redis-timeout-ms", "5000"],
    );
    let l = limit("fixed_window", 1000);
    let body = json!({"checks": [leased_check("stalled", std::slice::from_ref(&l), 200, 1)]});
    // The scripts are loaded, as on a running meshlimitd.
    ask(&f, "warm", std::slice::from_ref(&l), 0, 1);
    f.redis.cli(&["CLIENT", "PAUSE", "300", "WRITE"]);
    let started = std::time::Instant::now();
    let r = call_within(&f, &body, "50");
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(started.elapsed() < std::time::Duration::from_millis(250));
    // The script runs once the pause ends; what it granted goes back.
    eventually(GIVE_BACK_WITHIN, || {
        metrics(&f).contains("meshlimitd_abandoned_units_given_back_total 201")
    });
    let after = ask(&f, "stalled", std::slice::from_ref(&l), 0, 1);
    assert_eq!(
        remaining(&after, 0),
        999,
        "only this check is charged: {after}"
    );
    assert_metric(&f, "meshlimitd_abandoned_units_given_back_total 201");
}

/// meshlimitd started with a shared token, and a call to its check API
/// with the token and `headers` besides.
fn start_with_token() -> (meshlimit_testbed::procs::TempDir, Standalone) {
    let dir = meshlimit_testbed::procs::TempDir::new("token");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "correct-horse-battery\n").unwrap();
    let f = Standalone::start(
        Path::new(env!("CARGO_BIN_EXE_meshlimitd")),
        &[
            "--redis-timeout-ms",
            "5000",
            "--auth-token-file",
            token_file.to_str().unwrap(),
        ],
    );
    (dir, f)
}

fn call_with_token(
    f: &Standalone,
    body: &Value,
    headers: &[(&str, &[u8])],
) -> meshlimit_testbed::http::Response {
    let mut all: Vec<(&str, &[u8])> = vec![("authorization", b"Bearer correct-horse-battery")];
    all.extend_from_slice(headers);
    meshlimit_testbed::http::request(
        &f.service.addr,
        "POST",
        "/v1/check",
        &all,
        body.to_string().as_bytes(),
    )
    .unwrap()
}

/// A plain check (no lease, no reservation: a request's unit) whose caller
/// gave up while its script was held up: the caller decided the request
/// by its fallback, so the unit the script charged goes back too, on
/// every algorithm, and with the fleet's token (meshlimitd signs what it
/// gives back itself). On the old code it stayed charged: a unit per
/// lost answer, each counted twice (by the fallback, and in Redis). An
/// answered plain check still carries no receipts.
#[test]
fn what_a_plain_check_charged_after_its_caller_gave_up_goes_back() {
    let (_dir, f) = start_with_token();
    for algorithm in [
        "fixed_window",
        "sliding_window_counter",
        "sliding_window_log",
        "token_bucket",
    ] {
        let l = limit(algorithm, 1000);
        let check = |subject: &str| json!({"checks": [{"subject": subject, "limits": [&l]}]});
        // The scripts are loaded, as on a running meshlimitd.
        let warm = call_with_token(&f, &check("warm"), &[]);
        assert_eq!(warm.status, 200, "{}", warm.body);
        let answered: Value = serde_json::from_str(&warm.body).unwrap();
        assert!(
            answered["results"][0].get("receipts").is_none(),
            "{answered}"
        );
        f.redis.cli(&["CLIENT", "PAUSE", "300", "WRITE"]);
        let r = call_with_token(&f, &check("stalled"), &[("x-meshlimit-timeout-ms", b"50")]);
        assert_eq!(r.status, 503, "{algorithm}: {}", r.body);
        std::thread::sleep(std::time::Duration::from_millis(800));
        let after: Value =
            serde_json::from_str(&call_with_token(&f, &check("stalled"), &[]).body).unwrap();
        assert_eq!(
            remaining(&after["results"][0], 0),
            999,
            "{algorithm}: only this check is charged: {after}"
        );
    }
    assert_metric(&f, "meshlimitd_abandoned_units_given_back_total 4");
}

/// The same with meshlimitd's own Redis timeout (the default 50 ms)
/// shorter than the stall: a run slower than it counts as a Redis timeout
/// but is still awaited, so what it charged for the caller who gave up
/// goes back: a plain check's unit, and a lease asked without an id
/// (which has no grant record its caller could name). On the old code
/// meshlimitd dropped the run at its timeout and never learnt what it
/// charged: both stayed charged (remaining 798 and 998 here, and
/// nothing given back).
#[test]
fn a_run_slower_than_the_redis_timeout_is_still_awaited_and_given_back() {
    let f = start();
    let l = limit("fixed_window", 1000);
    for (subject, check, given_back) in [
        (
            "leased",
            leased_check("leased", std::slice::from_ref(&l), 200, 1),
            201,
        ),
        ("plain", json!({"subject": "plain", "limits": [&l]}), 202),
    ] {
        // The script is loaded, as on a running meshlimitd.
        let mut warm = check.clone();
        warm["subject"] = json!("warm");
        assert_eq!(
            f.check(&json!({"checks": [warm]}))["results"][0]["allowed"],
            true
        );
        f.redis.cli(&["CLIENT", "PAUSE", "300", "WRITE"]);
        let r = call_within(&f, &json!({"checks": [check]}), "20");
        assert_eq!(r.status, 503, "{subject}: {}", r.body);
        eventually(GIVE_BACK_WITHIN, || {
            metrics(&f).contains(&format!(
                "meshlimitd_abandoned_units_given_back_total {given_back}\n"
            ))
        });
        let after = ask(&f, subject, std::slice::from_ref(&l), 0, 1);
        assert_eq!(
            remaining(&after, 0),
            999,
            "{subject}: only this probe is charged: {after}"
        );
    }
    assert_metric(&f, "meshlimitd_abandoned_units_given_back_total 202");
    assert_metric(
        &f,
        "meshlimitd_late_script_answers_total{result=\"answered\"} 2",
    );
    assert_metric(&f, "meshlimitd_redis_errors_total{kind=\"timeout\"} 2");
}

/// A decision that took over half its caller's budget is answered without
/// its lease: the answer may reach the caller after the caller's own
/// timeout (which began before meshlimitd read the call), and a grant in
/// a lost answer would be charged to nobody. The leased units go back at
/// once; the request's own unit stays charged.
#[test]
fn a_late_decision_sends_no_lease_and_gives_it_back() {
    let f = Standalone::start(
        Path::new(env!("CARGO_BIN_EXE_meshlimitd")),
        &["--redis-timeout-ms", "5000", "--request-timeout-ms", "2000"],
    );
    let l = limit("fixed_window", 1000);
    let body = json!({"checks": [leased_check("late", std::slice::from_ref(&l), 200, 1)]});
    ask(&f, "warm", std::slice::from_ref(&l), 0, 1);
    // A budget of 900 ms (90% of 1 s), Redis paused for 600 ms of it.
    f.redis.cli(&["CLIENT", "PAUSE", "600", "WRITE"]);
    let r = call_within(&f, &body, "1000");
    assert_eq!(r.status, 200, "{}", r.body);
    let answer: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let result = &answer["results"][0];
    assert_eq!(result["allowed"], true, "{answer}");
    assert!(result.get("leased").is_none(), "no lease: {answer}");
    assert!(result.get("receipts").is_none(), "{answer}");
    assert_eq!(result["limits"][0]["remaining"], 999, "{answer}");
    eventually(GIVE_BACK_WITHIN, || {
        metrics(&f).contains("meshlimitd_late_lease_units_withheld_total 200")
    });
    let after = ask(&f, "late", std::slice::from_ref(&l), 0, 1);
    assert_eq!(
        remaining(&after, 0),
        998,
        "the request's unit and this one: {after}"
    );
    assert_metric(&f, "meshlimitd_late_lease_units_withheld_total 200");
    // Decided in time, the lease is sent as before.
    let quick = ask(&f, "quick", std::slice::from_ref(&l), 200, 1);
    assert_eq!(quick["leased"], 200, "{quick}");
}

/// How long a give-back meshlimitd applies after its answer may take
/// here (milliseconds when the machine is idle).
const GIVE_BACK_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// meshlimitd's metrics page.
fn metrics(f: &Standalone) -> String {
    meshlimit_testbed::http::get(&f.service.addr, "/metrics", &[])
        .unwrap()
        .body
}

/// meshlimitd's metrics hold `line`.
fn assert_metric(f: &Standalone, line: &str) {
    let metrics = metrics(f);
    assert!(metrics.contains(line), "{line}: {metrics}");
}

fn ask_with_id(f: &Standalone, subject: &str, l: &Value, units: u64, id: u64) -> Value {
    let check =
        json!({"subject": subject, "limits": [l], "lease": {"units": units, "share": 1, "id": id}});
    f.check(&json!({"checks": [check]}))["results"][0].clone()
}

fn name_lost(f: &Standalone, subject: &str, l: &Value, id: u64) {
    let lost = json!({"lost": [{"subject": subject, "limits": [l], "id": id}]});
    let r = meshlimit_testbed::http::request(
        &f.service.addr,
        "POST",
        "/v1/check",
        &[("content-type", b"application/json")],
        lost.to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A lease asked with an id and granted, whose answer the caller says it
/// lost: the grant goes back (request and lease alike: the caller decided
/// that request without meshlimitd), once however often it is named; an
/// ask named lost before its script ran is charged nothing; and an ask
/// meshlimitd itself gave back (its caller's deadline passed) is not given
/// back a second time when its caller names it.
#[test]
fn a_lost_grant_goes_back_exactly_once() {
    let f = Standalone::start(
        Path::new(env!("CARGO_BIN_EXE_meshlimitd")),
        &["--redis-timeout-ms", "5000"],
    );
    let l = limit("fixed_window", 1000);
    let granted = ask_with_id(&f, "lost", &l, 200, 7);
    assert_eq!(leased(&granted), 200, "{granted}");
    assert_eq!(
        f.redis
            .cli(&["GET", "ml:{e:lost}:hot/fixed_window:fw:60000"])
            .trim(),
        "201"
    );
    for _ in 0..3 {
        name_lost(&f, "lost", &l, 7);
    }
    eventually(GIVE_BACK_WITHIN, || {
        f.redis
            .cli(&["GET", "ml:{e:lost}:hot/fixed_window:fw:60000"])
            .trim()
            .is_empty()
    });
    assert_eq!(
        f.redis
            .cli(&["GET", "ml:{e:lost}:hot/fixed_window:fw:60000"])
            .trim(),
        "",
        "given back whole, once"
    );
    assert_metric(&f, "meshlimitd_lost_ask_units_given_back_total 201");
    // Named lost before it ran: its caller decided the request without
    // meshlimitd, so it runs and charges nothing (answered refused).
    name_lost(&f, "early", &l, 8);
    // The naming is applied after its answer: wait for its mark.
    eventually(GIVE_BACK_WITHIN, || {
        f.redis
            .cli(&["GET", "ml:{e:early}:grant:0000000000000008"])
            .trim()
            == "lost"
    });
    let early = ask_with_id(&f, "early", &l, 200, 8);
    assert_eq!(
        (early["allowed"].clone(), leased(&early)),
        (json!(false), 0),
        "{early}"
    );
    assert_eq!(
        f.redis
            .cli(&["GET", "ml:{e:early}:hot/fixed_window:fw:60000"])
            .trim(),
        "",
        "nothing charged"
    );
    // Given back by meshlimitd when its caller gave up, then named lost.
    ask(&f, "warm", std::slice::from_ref(&l), 0, 1);
    f.redis.cli(&["CLIENT", "PAUSE", "300", "WRITE"]);
    let check =
        json!({"subject": "both", "limits": [&l], "lease": {"units": 200, "share": 1, "id": 9}});
    let r = call_within(&f, &json!({"checks": [check]}), "50");
    assert_eq!(r.status, 503, "{}", r.body);
    std::thread::sleep(std::time::Duration::from_millis(600));
    name_lost(&f, "both", &l, 9);
    // A second give-back would show as a counter under 1 (the warm-up's
    // unit is "warm"'s): wait out the naming's give-back.
    std::thread::sleep(std::time::Duration::from_millis(200));
    eventually(GIVE_BACK_WITHIN, || {
        metrics(&f).contains("meshlimitd_lost_ask_units_given_back_total 402")
    });
    let after = ask(&f, "both", std::slice::from_ref(&l), 0, 1);
    assert_eq!(remaining(&after, 0), 999, "given back once: {after}");
    assert_metric(&f, "meshlimitd_lost_ask_units_given_back_total 402");
}

/// A reservation (a token budget's check, `receipt`) asked with an id,
/// whose answer the caller lost: named in a later call, what its script
/// charged goes back, on each limit what that limit was charged (here 300
/// on the token budget, 1 on the request limit beside it), once however
/// often it is named, and never more than was charged whatever costs the
/// naming claims. The caller settled it in its fallback's counters. On
/// the old code only lease asks had records: the 300 stayed charged until
/// the window ended.
#[test]
fn a_lost_reservation_goes_back_exactly_once() {
    let f = start();
    let reserve = |cost: u64| {
        json!([
            {"name": "llm/tokens", "requests": 10_000, "window_ms": 60_000, "cost": cost,
             "algorithm": "fixed_window"},
            {"name": "llm/requests", "requests": 1000, "window_ms": 60_000,
             "algorithm": "fixed_window"}
        ])
    };
    let check =
        json!({"subject": "lost-tokens", "limits": reserve(300), "receipt": true, "id": 21});
    let answer = f.check(&json!({"checks": [check]}));
    assert_eq!(answer["results"][0]["allowed"], true, "{answer}");
    let counters = || {
        [
            "ml:{e:lost-tokens}:llm/tokens:fw:60000",
            "ml:{e:lost-tokens}:llm/requests:fw:60000",
        ]
        .map(|k| f.redis.cli(&["GET", k]).trim().parse::<u64>().unwrap_or(0))
    };
    assert_eq!(counters(), [300, 1]);
    // Named with costs it was never charged: the record decides.
    let lost = json!({"lost": [{"subject": "lost-tokens", "limits": reserve(9_000), "id": 21}]});
    for _ in 0..3 {
        let r = meshlimit_testbed::http::request(
            &f.service.addr,
            "POST",
            "/v1/check",
            &[],
            lost.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    eventually(GIVE_BACK_WITHIN, || counters() == [0, 0]);
    assert_eq!(counters(), [0, 0], "given back whole, once");
}
