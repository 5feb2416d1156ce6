//! Reservations and settlements (the service side of token budgets),
//! against a real redis-server: a check may ask for receipts; a later
//! settlement charges or gives back the difference between reserved and
//! used units, in the counter and window that were charged, for every
//! algorithm.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;

use meshlimit_testbed::services::Standalone;
use serde_json::{json, Value};

fn start() -> Standalone {
    Standalone::start(Path::new(env!("CARGO_BIN_EXE_meshlimitd")), &[])
}

fn limit(algorithm: &str, cost: u64) -> Value {
    json!({"name": format!("llm/{algorithm}"), "requests": 1000, "window_ms": 60_000,
           "algorithm": algorithm, "cost": cost})
}

/// A reservation of `cost`: the result (with its receipts when admitted).
fn reserve(f: &Standalone, subject: &str, algorithm: &str, cost: u64) -> Value {
    let v = f.check(&json!({"checks": [{"subject": subject, "limits": [limit(algorithm, cost)], "receipt": true}]}),
    );
    v["results"][0].clone()
}

/// Settles a reservation of `reserved` at `actual`; what remains.
fn settle(
    f: &Standalone,
    subject: &str,
    algorithm: &str,
    reserved: u64,
    actual: u64,
    receipts: &Value,
) -> i64 {
    let v = f.check(&json!({"checks": [], "settlements": [{"subject": subject, "limits": [limit(algorithm, reserved)],
                                                "actual": [actual], "receipts": receipts}]}),
    );
    assert!(v["results"].as_array().unwrap().is_empty());
    v["settled"][0]["remaining"][0]
        .as_i64()
        .unwrap_or_else(|| panic!("{v}"))
}

/// Every algorithm a limit can use.
const ALGORITHMS: [&str; 4] = [
    "fixed_window",
    "sliding_window_counter",
    "sliding_window_log",
    "token_bucket",
];

fn remaining(result: &Value) -> i64 {
    result["limits"][0]["remaining"].as_i64().unwrap()
}

#[test]
fn refunds_and_extra_charges_land_in_the_charged_counter_for_every_algorithm() {
    let f = start();
    for algorithm in ALGORITHMS {
        let subject = format!("tenant-{algorithm}");
        // Reserve 500 of 1000, use 100: 900 left at once.
        let r = reserve(&f, &subject, algorithm, 500);
        assert_eq!(r["allowed"], json!(true), "{algorithm}: {r}");
        assert!((499..=500).contains(&remaining(&r)), "{algorithm}: {r}");
        let receipts = r["receipts"].clone();
        assert_eq!(receipts.as_array().unwrap().len(), 1, "{algorithm}");
        let left = settle(&f, &subject, algorithm, 500, 100, &receipts);
        assert!((898..=900).contains(&left), "{algorithm}: {left}");
        // Reserve 500 more, use 700: 200 more charged, 200 left.
        let r = reserve(&f, &subject, algorithm, 500);
        assert!(r["allowed"] == json!(true), "{algorithm}: {r}");
        let left = settle(&f, &subject, algorithm, 500, 700, &r["receipts"]);
        assert!((198..=201).contains(&left), "{algorithm}: {left}");
        // What the next check sees agrees.
        let next = reserve(&f, &subject, algorithm, 1);
        assert!(
            (197..=200).contains(&remaining(&next)),
            "{algorithm}: {next}"
        );
        // A reservation that does not fit is denied and has no receipt.
        let denied = reserve(&f, &subject, algorithm, 500);
        assert_eq!(denied["allowed"], json!(false), "{algorithm}");
        assert!(denied.get("receipts").is_none(), "{algorithm}: {denied}");
    }
    // The sliding log holds exactly the units used: 100 + 700 + 1.
    let members = f.redis.cli(&[
        "ZCARD",
        "ml:{e:tenant-sliding_window_log}:llm/sliding_window_log:swl:60000",
    ]);
    assert_eq!(members.trim(), "801");
}

/// Checks of one call share a run: each gets its own nonce in its receipt;
/// a settlement that breaks a rule gets its own error, and the call's
/// checks are decided.
#[test]
fn receipts_in_batches_and_bad_settlements_alone() {
    let f = start();
    let v = f.check(&json!({"checks": [
        {"subject": "a", "limits": [limit("fixed_window", 10)], "receipt": true},
        {"subject": "b", "limits": [limit("fixed_window", 10)], "receipt": true},
        {"subject": "c", "limits": [limit("fixed_window", 10)]}
    ]}));
    let nonce = |i: usize| {
        v["results"][i]["receipts"][0]["nonce"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_ne!(nonce(0), nonce(1));
    assert!(v["results"][2].get("receipts").is_none(), "not asked for");
    let receipts = v["results"][1]["receipts"].clone();
    let v = f.check(&json!({"checks": [{"subject": "d", "limits": [limit("fixed_window", 1)]}],
        "settlements": [
            {"subject": "b", "limits": [limit("fixed_window", 10)], "actual": [4], "receipts": receipts},
            {"subject": "b", "limits": [limit("fixed_window", 10)], "actual": [4, 5], "receipts": receipts},
            {"subject": "b", "limits": [limit("sliding_window_log", 10)], "actual": [1_000_000], "receipts": receipts}
        ]}),
    );
    assert_eq!(v["results"][0]["allowed"], json!(true));
    assert_eq!(v["settled"][0]["remaining"][0], json!(996));
    assert_eq!(v["settled"][1]["kind"], json!("invalid"), "{v}");
    assert!(
        v["settled"][2]["error"]
            .as_str()
            .unwrap()
            .contains("actual[0]"),
        "{v}"
    );
    let b = f.check(&json!({"checks": [{"subject": "b", "limits": [limit("fixed_window", 1)]}]}));
    assert_eq!(b["results"][0]["limits"][0]["remaining"], json!(995));
}

/// A fixed (or calendar) window's reservation settled after its window
/// ended, above what it reserved: the debt is charged to the current
/// window (it used to vanish with the ended one). The scripts' clock is
/// moved a window ahead with meshlimitd's test hook.
#[test]
fn debt_settled_after_its_window_ended_is_carried_into_the_current_one() {
    let f = Standalone::start(
        Path::new(env!("CARGO_BIN_EXE_meshlimitd")),
        &["--test-clock-offset-key", "ml:test:clock"],
    );
    for (name, calendar) in [("fixed", None), ("daily", Some("day"))] {
        let mut limit = json!({"name": format!("llm/{name}"), "requests": 1000, "window_ms": 60_000,
                               "algorithm": "fixed_window", "cost": 100});
        if let Some(unit) = calendar {
            limit["window_ms"] = json!(86_400_000);
            limit["calendar"] = json!({"unit": unit, "utc_offset_minutes": 0});
        }
        let subject = format!("debtor-{name}");
        f.redis.cli(&["SET", "ml:test:clock", "0"]);
        let v = f.check(
            &json!({"checks": [{"subject": subject, "limits": [limit.clone()], "receipt": true}]}),
        );
        let receipts = v["results"][0]["receipts"].clone();
        assert_eq!(
            v["results"][0]["limits"][0]["remaining"],
            json!(900),
            "{name}: {v}"
        );
        // A window (a day) later, the response settles: it used 400.
        let ahead = if calendar.is_some() {
            "86400000"
        } else {
            "60000"
        };
        f.redis.cli(&["SET", "ml:test:clock", ahead]);
        let v = f.check(
            &json!({"checks": [], "settlements": [{"subject": subject, "limits": [limit.clone()],
                                          "actual": [400], "receipts": receipts}]}),
        );
        assert_eq!(v["settled"][0]["remaining"][0], json!(700), "{name}: {v}");
        let mut probe = limit.clone();
        probe["cost"] = json!(1);
        let v = f.check(&json!({"checks": [{"subject": subject, "limits": [probe]}]}));
        assert_eq!(
            v["results"][0]["limits"][0]["remaining"],
            json!(699),
            "{name}: {v}"
        );
    }
}

/// Redis restarted and lost its state: a refund (or a lease's return)
/// whose receipt was made before names counters that never held its
/// units, and gives nothing back (the receipt's epoch is not the one the
/// subject's counters have now); a debt on it is still charged. Before,
/// the refund decremented the new counter that checks made since (for
/// every algorithm but the sliding log, back to 0 here).
#[test]
fn a_refund_after_redis_lost_its_state_gives_nothing_back() {
    let mut f = start();
    let mut reserved = Vec::new();
    for algorithm in ALGORITHMS {
        let r = reserve(&f, "restarted", algorithm, 100);
        assert_eq!(r["allowed"], true, "{r}");
        // A sliding log needs no epoch (its returns remove its own members).
        let epoch = r["receipts"][0]["epoch"].as_u64().unwrap_or(0);
        assert_eq!(epoch > 0, algorithm != "sliding_window_log", "{r}");
        reserved.push((algorithm, r["receipts"].clone()));
    }
    // Redis restarts: every counter is gone.
    let host = f.redis.host.clone();
    f.redis.stop();
    f.redis = meshlimit_testbed::services::RedisServer::start(&host, f.dir.path());
    let ready = std::time::Instant::now();
    while f
        .post_check(
            &json!({"checks": [{"subject": "probe", "limits": [limit("fixed_window", 1)]}]}),
        )
        .status
        != 200
    {
        assert!(
            ready.elapsed() < std::time::Duration::from_secs(10),
            "meshlimitd back"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    for (algorithm, receipts) in &reserved {
        // New counters: 5 units charged since the restart.
        let now = reserve(&f, "restarted", algorithm, 5);
        assert_eq!(remaining(&now), 995, "{algorithm}: {now}");
        // The refund of the 100 reserved before: nothing given back.
        assert_eq!(
            settle(&f, "restarted", algorithm, 100, 0, receipts),
            995,
            "{algorithm}"
        );
        // A receipt of the new counters still gives back.
        assert_eq!(
            settle(&f, "restarted", algorithm, 5, 0, &now["receipts"]),
            1000,
            "{algorithm}"
        );
    }
    // A debt on an old receipt is still charged, even where the counter
    // is gone again (refunded to nothing above): 50 more.
    for (algorithm, receipts) in &reserved {
        let left = settle(&f, "restarted", algorithm, 100, 150, receipts);
        assert!((949..=950).contains(&left), "{algorithm}: {left}");
    }
    // What was not given back is counted: 100 on each of three algorithms.
    let metrics = meshlimit_testbed::http::get(&f.service.addr, "/metrics", &[])
        .unwrap()
        .body;
    assert!(
        metrics.contains("meshlimitd_return_units_on_lost_counters_total 300"),
        "{metrics}"
    );
}

/// A settlement with an id is applied once: the filter sends a lease
/// return again when its call failed (applied or lost, it cannot tell),
/// and the second must change nothing. Counted in
/// `meshlimitd_settlements_repeated_total`. Without an id, a settlement
/// sent twice gives back twice (the filter never does).
#[test]
fn a_settlement_with_an_id_is_applied_once() {
    let f = start();
    for algorithm in ALGORITHMS {
        let subject = format!("resent-{algorithm}");
        let first = reserve(&f, &subject, algorithm, 100);
        let second = reserve(&f, &subject, algorithm, 100);
        assert_eq!(remaining(&second), 800, "{algorithm}: {second}");
        let settle_with_id = |id: u64| {
            let v = f.check(&json!({"checks": [], "settlements": [{
                "subject": subject, "limits": [limit(algorithm, 100)],
                "actual": [0], "receipts": first["receipts"], "id": id}]}));
            v["settled"][0]["remaining"][0].as_i64().unwrap()
        };
        assert_eq!(settle_with_id(7), 900, "{algorithm}");
        assert_eq!(
            settle_with_id(7),
            900,
            "{algorithm}: sent again, applied once"
        );
        // Another id is another settlement; but a sliding log's removes
        // its receipt's own members, gone already whatever the id.
        let again = if algorithm == "sliding_window_log" {
            900
        } else {
            1000
        };
        assert_eq!(settle_with_id(8), again, "{algorithm}");
    }
    let metrics = meshlimit_testbed::http::get(&f.service.addr, "/metrics", &[])
        .unwrap()
        .body;
    assert!(
        metrics.contains("meshlimitd_settlements_repeated_total 4"),
        "{metrics}"
    );
}
