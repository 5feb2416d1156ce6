//! Incident controls through real Envoys, meshlimitd and Redis: the
//! fleet-wide switch to shadow and back, listing live overrides, reading a
//! subject's usage, and the log naming the credential that made a change.

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
use meshlimit_testbed::http::{self, Response};
use meshlimit_testbed::{Topology, TopologyOptions};

const ONCALL: &str = "oncall-0123456789-secret";
const LEAD: &str = "lead-0123456789-secret";

fn incident_topology() -> (Topology, meshlimit_testbed::procs::TempDir) {
    let dir = meshlimit_testbed::procs::TempDir::new("admin-tokens");
    let file = dir.path().join("admin-tokens");
    std::fs::write(
        &file,
        format!("# who may act\noncall {ONCALL}\nlead {LEAD}\n"),
    )
    .unwrap();
    let t = Topology::start(TopologyOptions {
        plugin_config: PluginConfig::new()
            .set("decision_log", json!({"sample": 1, "level": "info"}))
            .build(),
        meshlimitd_args: vec!["--admin-token-file".into(), file.display().to_string()],
        ..TopologyOptions::default()
    });
    (t, dir)
}

fn admin(t: &Topology, token: &str, method: &str, path: &str, body: &str) -> Response {
    let auth = format!("Bearer {token}");
    http::request(
        &t.meshlimitd_addr(),
        method,
        path,
        &[("authorization", auth.as_bytes())],
        body.as_bytes(),
    )
    .unwrap()
}

/// Statuses of `n` requests of `client` through replica `replica`, on a
/// kept-alive connection (a refusal closing the connection would cost
/// Envoy's delayed close, a second, in what is measured).
fn through(t: &Topology, replica: usize, client: &str, n: usize) -> Vec<u16> {
    let mut conn = http::Conn::new(&t.replica_addr(replica));
    (0..n)
        .map(|_| {
            conn.get("/api", &[("x-api-key", client.as_bytes())])
                .unwrap()
                .status
        })
        .collect()
}

/// Waits (at most `within`) until a request of `client` through each
/// replica gets `status`; how long it took.
fn until_every_replica_answers(
    t: &Topology,
    client: &str,
    status: u16,
    within: Duration,
) -> Duration {
    let started = Instant::now();
    loop {
        if through(t, 1, client, 1) == [status] && through(t, 2, client, 1) == [status] {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "still not {status} after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_fleet_goes_shadow_within_a_second_and_back() {
    let (t, _dir) = incident_topology();
    wait_for_fresh_window(Duration::from_secs(30));
    assert_eq!(burst(&t, &key("spent"), 22), (20, 2));

    // Shadow: nothing is refused anywhere within a second.
    let r = admin(
        &t,
        ONCALL,
        "PUT",
        "/v1/enforcement",
        r#"{"enforcement":"shadow"}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let took = until_every_replica_answers(&t, "spent", 200, Duration::from_secs(3));
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(burst(&t, &key("spent"), 10), (10, 0));
    assert!(t.stat_total("meshlimit.shadow_denied") >= 10);
    let r = admin(&t, LEAD, "GET", "/v1/enforcement", "");
    assert_eq!(
        serde_json::from_str::<Value>(&r.body).unwrap()["enforcement"],
        "shadow"
    );
    let metrics = http::get(&t.meshlimitd_addr(), "/metrics", &[])
        .unwrap()
        .body;
    assert!(
        metrics.contains("meshlimitd_enforcement_shadow 1"),
        "{metrics}"
    );

    // Usage: what the client has used of its limit, charged or not.
    let usage = |client: &str| -> Value {
        let path = format!("/v1/usage/api/per-minute?subject=hdr%3Ax-api-key%3A{client}");
        let r = admin(&t, LEAD, "GET", &path, "");
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str(&r.body).unwrap()
    };
    let spent = usage("spent");
    let read = |u: &Value, k: &str| u[k].as_u64().unwrap_or_default();
    assert_eq!(
        (read(&spent, "requests"), read(&spent, "remaining")),
        (20, 0),
        "{spent}"
    );
    assert!(read(&spent, "used") >= 20, "{spent}");
    let fresh = usage("nobody");
    assert_eq!(
        (read(&fresh, "used"), read(&fresh, "remaining")),
        (0, 20),
        "{fresh}"
    );

    // Back to enforce: refused again within a second.
    let r = admin(
        &t,
        LEAD,
        "PUT",
        "/v1/enforcement",
        r#"{"enforcement":"enforce"}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let took = until_every_replica_answers(&t, "spent", 429, Duration::from_secs(3));
    assert!(took < Duration::from_secs(1), "took {took:?}");

    // Who did what, by credential id; a wrong secret changes nothing.
    let r = admin(
        &t,
        "wrong-0123456789-secret",
        "PUT",
        "/v1/enforcement",
        r#"{"enforcement":"shadow"}"#,
    );
    assert_eq!(r.status, 401);
    let log = t.logs("meshlimitd");
    assert!(!log.contains('\u{1b}'), "no colour codes in a log file");
    assert!(log.contains("credentials: oncall, lead"), "{log}");
    assert!(
        log.lines()
            .any(|l| l.contains("switched to shadow") && l.contains("by=oncall")),
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("switched back on") && l.contains("by=lead")),
        "{log}"
    );
    assert!(
        !log.contains(ONCALL) && !log.contains(LEAD),
        "no secret in the log"
    );
    assert_no_vm_panics(&t);
}

#[test]
fn live_overrides_are_listed_and_the_fallback_keeps_the_last_state_heard() {
    let (mut t, _dir) = incident_topology();
    for subject in ["hdr:x-api-key:b", "hdr:x-api-key:a"] {
        let body = format!(r#"{{"subject":"{subject}","requests":50,"ttl_seconds":600}}"#);
        assert_eq!(
            admin(&t, ONCALL, "PUT", "/v1/overrides/api/per-minute", &body).status,
            200
        );
    }
    let brief = r#"{"subject":"hdr:x-api-key:brief","requests":5,"ttl_seconds":1}"#;
    assert_eq!(
        admin(&t, ONCALL, "PUT", "/v1/overrides/api/per-minute", brief).status,
        200
    );
    std::thread::sleep(Duration::from_millis(1_200));
    let r = admin(&t, LEAD, "GET", "/v1/overrides", "");
    assert_eq!(r.status, 200, "{}", r.body);
    let listed: Vec<Value> = serde_json::from_str(&r.body).unwrap();
    let subjects: Vec<&str> = listed
        .iter()
        .map(|o| o["subject"].as_str().unwrap())
        .collect();
    assert_eq!(
        subjects,
        ["hdr:x-api-key:a", "hdr:x-api-key:b"],
        "the expired one is gone"
    );
    assert_eq!(listed[0]["requests"], 50);
    assert!(t.logs("meshlimitd").contains("by=oncall"));

    // The fleet goes shadow; each replica hears it with its next call;
    // then meshlimitd goes away. The fallback (each replica's share of
    // 20 for this client) keeps refusing nothing.
    assert_eq!(
        admin(
            &t,
            ONCALL,
            "PUT",
            "/v1/enforcement",
            r#"{"enforcement":"shadow"}"#
        )
        .status,
        200
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(through(&t, 1, "heard-1", 1), [200]);
    assert_eq!(through(&t, 2, "heard-2", 1), [200]);
    t.stop_meshlimitd();
    let statuses: Vec<u16> = (1..=2)
        .flat_map(|r| through(&t, r, "cut-off", 25))
        .collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(t.stat_total("meshlimit.fallback_allowed") >= 50);
    assert_no_vm_panics(&t);
}
