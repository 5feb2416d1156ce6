//! Hostile clients, end to end (docs/security.md): what one request carries
//! changes only its own decision.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;

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
    assert_eq!(
        t.stat_total("meshlimit.requests_allowed"),
        320 + LIMIT as u64
    );
    // Redis holds one short key for the hostile client, not 66 KB of hex.
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(keys.lines().all(|k| k.len() < 200), "{keys}");
    assert_no_vm_panics(&t);
}

/// Clients that reset their streams while the check is out, with group
/// commit off (one call per request). The call used to belong to the
/// stream: Envoy cancelled it with the stream and never answered it, and
/// the SDK kept an entry per such call in its table for good (trapping on
/// a reused token after about 2^30 of them). Calls now belong to the root:
/// each completes, so Envoy counts no cancelled call, and the proxy keeps
/// deciding.
#[test]
fn resetting_clients_leave_no_call_behind() {
    let t = topology(
        keyed("local")
            .set("group_commit", json!({"enabled": false}))
            .set_in("service", "timeout", json!("300ms"))
            .build(),
    );
    // A Redis that answers nothing: every call waits for meshlimitd's own
    // Redis timeout while the clients give up first.
    let redis = t.redis_pid().expect("redis runs").to_string();
    let signal = |sig: &str| {
        assert!(std::process::Command::new("kill")
            .args([sig, &redis])
            .status()
            .unwrap()
            .success());
    };
    signal("-STOP");
    for i in 0..40 {
        let mut conn = std::net::TcpStream::connect(t.replica_addr(1)).unwrap();
        use std::io::Write;
        write!(
            conn,
            "GET /api/x HTTP/1.1\r\nhost: meshlimit.test\r\nx-api-key: resetter-{i}\r\n\r\n"
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(5));
        // Close with a reset (SO_LINGER 0 would be a harder reset; a close
        // with the request in flight is what Envoy sees as a reset stream).
        drop(conn);
    }
    std::thread::sleep(Duration::from_millis(1_000));
    signal("-CONT");
    let cluster_stat = |name: &str| {
        meshlimit_testbed::http::envoy_stats(
            &t.replica_admin(1),
            &format!("^cluster\\.meshlimit\\.{name}$"),
        )
        .first()
        .map_or(0, |(_, v)| *v)
    };
    // Every call completed (a health check may be between its two stats).
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let (dispatched, completed) = loop {
        let (d, c) = (
            cluster_stat("upstream_rq_total"),
            cluster_stat("upstream_rq_completed"),
        );
        if d == c || std::time::Instant::now() > deadline {
            break (d, c);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(dispatched >= 40, "{dispatched} calls");
    assert_eq!(
        completed, dispatched,
        "every call completed, none cancelled with its stream"
    );
    // The proxy goes on deciding globally.
    wait_for_global_decisions(&t, Duration::from_secs(10));
    assert_no_vm_panics(&t);
}
