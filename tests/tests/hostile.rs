//! Hostile clients, end to end (docs/security.md): what one request carries
//! changes only its own decision.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use meshlimit_testbed::fake::Behavior;
use meshlimit_testbed::{Topology, TopologyOptions};

/// Two replicas behind a front proxy, group commit on (the default), 20 a
/// minute. 32 well-behaved clients send 10 requests each while one client
/// sends ids of 33,000 bytes of 0xFF. That id used to be hex-encoded to
/// 66 KB, meshlimitd refused the whole batch it travelled in, and every
/// check of the batch fell back to the local counters (about 900 of the
/// 320 normal requests' decisions, and the hostile client itself was let
/// through by the fallback). Now the id is a digest and just an id.
#[test]
fn a_huge_binary_id_is_just_an_id_and_costs_no_one_else_anything() {
    let t = topology(keyed_config("local"));
    wait_for_fresh_window(Duration::from_secs(30));
    let hostile: Vec<(&'static str, Vec<u8>)> = vec![("x-api-key", vec![0xff; 33_000])];
    let normal_allowed = AtomicUsize::new(0);
    let (hostile_allowed, hostile_denied) = std::thread::scope(|s| {
        for group in 0..8 {
            let (t, normal_allowed) = (&t, &normal_allowed);
            s.spawn(move || {
                for round in 0..10 {
                    for c in 0..4 {
                        let id = format!("normal-{}", group * 4 + c);
                        let r = send(t, &key(&id));
                        assert_eq!(r.status, 200, "{id}, request {round}: {}", r.body);
                        normal_allowed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        let attacker = s.spawn(|| burst(&t, &hostile, 60));
        attacker.join().unwrap()
    });
    assert_eq!(normal_allowed.into_inner(), 320);
    assert_eq!(
        (hostile_allowed, hostile_denied),
        (LIMIT, 60 - LIMIT),
        "the hostile client gets its 20, then 429 like everyone else"
    );
    assert_eq!(t.stat_total("meshlimit.fallback_allowed"), 0);
    assert_eq!(t.stat_total("meshlimit.fallback_denied"), 0);
    assert_eq!(t.stat_total("meshlimit.service_errors.invalid_check"), 0);
    assert_eq!(t.globally_allowed(), 320 + LIMIT as u64);
    // Redis holds one short key for the hostile client, not 66 KB of hex.
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(keys.lines().all(|k| k.len() < 200), "{keys}");
    assert_no_vm_panics(&t);
}

/// Clients that reset their streams while the check is out, with group
/// commit off (one call per request). Envoy cancels the calls a stream's
/// context owns when that context is destroyed (`Context::~Context`), and
/// a cancelled call is never answered: the SDK would keep its entry for
/// good and trap on a reused token after about 2^30 of them. Calls now
/// belong to the root, as batches do, so none can be cancelled with a
/// stream. (With Envoy 1.40 over HTTP/1 the stream's context outlived
/// these resets and its calls completed even before the change: this test
/// shows the proxy healthy and every call answered, not the old leak.)
#[test]
fn resetting_clients_leave_no_call_behind() {
    // meshlimitd answers each check after 100 ms; the clients leave after 5.
    let t = Topology::start(TopologyOptions {
        plugin_config: keyed("local")
            .set("group_commit", json!({"enabled": false}))
            .build(),
        fake: Some(Behavior::SlowBody(Duration::from_millis(100))),
        replicas: 1,
        front: false,
        ..TopologyOptions::default()
    });
    for i in 0..20 {
        let mut conn = std::net::TcpStream::connect(t.replica_addr(1)).unwrap();
        write!(
            conn,
            "GET /api/x HTTP/1.1\r\nhost: meshlimit.test\r\nx-api-key: resetter-{i}\r\n\r\n"
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(5));
        drop(conn);
    }
    let cluster_stat = |name: &str| {
        meshlimit_testbed::http::envoy_stats(
            &t.replica_admin(1),
            &format!("^cluster\\.meshlimit\\.{name}$"),
        )
        .first()
        .map_or(0, |(_, v)| *v)
    };
    // Every call is answered in full (the answers take 100 ms).
    let deadline = Instant::now() + Duration::from_secs(5);
    while cluster_stat("upstream_rq_active") > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (dispatched, completed) = (
        cluster_stat("upstream_rq_total"),
        cluster_stat("upstream_rq_completed"),
    );
    assert!(dispatched >= 20, "{dispatched} calls");
    assert_eq!(cluster_stat("upstream_rq_active"), 0);
    assert_eq!(
        completed, dispatched,
        "every call completed, none cancelled with its stream"
    );
    // The proxy goes on deciding.
    assert_eq!(send(&t, &key("after")).status, 200);
    assert_no_vm_panics(&t);
}

/// `x-api-key: victim` and `x-api-key: mine` in one request: an upstream
/// may authenticate either copy, so the request spends no one's quota; it
/// counts as having no id (here: refused, as `when_missing: reject` says).
#[test]
fn a_repeated_id_header_spends_no_ones_quota() {
    let t = single_replica(plugin_config(
        json!({"headers": ["x-api-key"], "when_missing": "reject"}),
        "local",
    ));
    wait_for_fresh_window(Duration::from_secs(10));
    let r = t.get(
        "/api/items",
        &[("x-api-key", b"victim"), ("x-api-key", b"mine")],
    );
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(t.stat(1, "meshlimit.rejected_no_client_id"), 1);
    // The victim's quota is whole.
    assert_eq!(burst(&t, &key("victim"), LIMIT).0, LIMIT);
}

/// Opens up to `max` checks on one HTTP/2 connection to `addr`, each reset
/// as soon as its headers are out, for at most `within`; returns how many
/// went out, and why the connection ended early, if it did.
fn reset_flood(addr: &str, token: &str, max: usize, within: Duration) -> (usize, Option<String>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut send, connection) = h2::client::handshake(tcp).await.unwrap();
        let driver = tokio::spawn(connection);
        let started = Instant::now();
        let (mut sent, mut ended) = (0, None);
        while sent < max && started.elapsed() < within {
            send = match send.ready().await {
                Ok(ready) => ready,
                Err(e) => {
                    ended = Some(e.to_string());
                    break;
                }
            };
            let request =
                http::Request::post(format!("http://{addr}{}", meshlimit_protocol::CHECK_PATH))
                    .header("authorization", format!("Bearer {token}"))
                    .header("content-type", "application/json")
                    .body(())
                    .unwrap();
            match send.send_request(request, false) {
                Ok((_answer, mut body)) => {
                    body.send_reset(h2::Reason::CANCEL);
                    sent += 1;
                }
                Err(e) => {
                    ended = Some(e.to_string());
                    break;
                }
            }
        }
        driver.abort();
        (sent, ended)
    })
}

/// meshlimitd speaks HTTP/2 (h2c) since the filter's cluster does, so a
/// pod that reaches it can too: this one, holding the shared token, opens
/// 20,000 checks on one connection and resets each as soon as its headers
/// are out (the "rapid reset" of CVE-2023-44487). No check of them starts
/// a script (a check is decided once its whole body is in), meshlimitd's
/// memory stays flat, and it decides everyone else's checks exactly as
/// before, meanwhile and after.
#[test]
fn a_pod_resetting_http2_checks_as_fast_as_it_can_starts_no_script() {
    let t = Topology::start(TopologyOptions {
        // Leases off: each new client's request is one check, decided once.
        plugin_config: keyed("local")
            .set("leases", json!({"enabled": false}))
            .build(),
        replicas: 1,
        front: false,
        shared_token: true,
        ..TopologyOptions::default()
    });
    wait_for_global_decisions(&t, Duration::from_secs(10));
    wait_for_fresh_window(Duration::from_secs(20));
    let rss_before = meshlimit_testbed::procs::rss_kib(t.meshlimitd_pid());
    let decided_before = meshlimitd_decisions(&t);
    let addr = t.meshlimitd_addr();
    let flood = std::thread::spawn(move || {
        reset_flood(
            &addr,
            meshlimit_testbed::topology::SHARED_TOKEN,
            20_000,
            Duration::from_secs(10),
        )
    });
    // Meanwhile, a client through Envoy: one request a check, decided by
    // meshlimitd (a new client's first request is a call).
    let mut meanwhile = 0;
    while !flood.is_finished() && meanwhile < 200 {
        let r = send(&t, &key(&format!("meanwhile-{meanwhile}")));
        assert_eq!(r.status, 200, "{}", r.body);
        meanwhile += 1;
    }
    let (sent, ended) = flood.join().unwrap();
    eprintln!("{sent} checks opened and reset ({ended:?}); {meanwhile} requests meanwhile");
    assert!(sent >= 1_000 || ended.is_some(), "{sent} sent, {ended:?}");
    let decided = meshlimitd_decisions(&t) - decided_before;
    let fallbacks = t.fallback_decisions();
    // Every check meshlimitd decided was one of those requests' (a call
    // that timed out under the flood's load is decided by the fallback,
    // and its script may still have run).
    assert!(
        decided <= meanwhile as u64 && decided + fallbacks >= meanwhile as u64,
        "{decided} checks decided by meshlimitd and {fallbacks} by the fallback for {meanwhile} requests"
    );
    // Afterwards, a client's limit is exact, decided by meshlimitd.
    assert_eq!(burst(&t, &key("after-the-flood"), LIMIT + 5), (LIMIT, 5));
    let rss_after = meshlimit_testbed::procs::rss_kib(t.meshlimitd_pid());
    assert!(
        rss_after < rss_before + 32 * 1024,
        "meshlimitd grew from {rss_before} to {rss_after} KiB"
    );
}
