//! meshlimitd under pressure, against a real redis-server made slow or
//! unresponsive with SIGSTOP: bounded work, fast 503s, graceful shutdown.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use meshlimit_testbed::http::{self, Response};
use meshlimit_testbed::services::Standalone;

type Fixture = Standalone;

fn start(extra: &[&str]) -> Fixture {
    Standalone::start(Path::new(env!("CARGO_BIN_EXE_meshlimitd")), extra)
}

const CHECK: &[u8] = br#"{"checks":[{"subject":"s","limits":[{"name":"a/m","requests":1000,"window_ms":60000,"algorithm":"fixed_window"}]}]}"#;

fn post(addr: &str) -> (Response, Duration) {
    let start = Instant::now();
    let r = http::request(addr, "POST", "/v1/check", &[], CHECK).unwrap();
    (r, start.elapsed())
}

fn signal(pid: Option<u32>, sig: &str) {
    let pid = pid.unwrap().to_string();
    assert!(Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success());
}

#[test]
fn too_many_checks_in_flight_are_shed_with_a_fast_503() {
    let f = start(&[
        "--max-in-flight",
        "2",
        "--queue-timeout-ms",
        "5",
        "--redis-timeout-ms",
        "3000",
        "--request-timeout-ms",
        "5000",
    ]);
    assert_eq!(post(&f.service.addr).0.status, 200, "loads the script");
    signal(f.redis.pid(), "-STOP");
    let results: Vec<(Response, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..12)
            .map(|i| {
                let addr = f.service.addr.clone();
                s.spawn(move || {
                    // The first two take the slots; the others find them full.
                    std::thread::sleep(Duration::from_millis(if i < 2 { 0 } else { 150 }));
                    post(&addr)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(600));
        signal(f.redis.pid(), "-CONT");
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let shed: Vec<_> = results.iter().filter(|(r, _)| r.status == 503).collect();
    assert_eq!(
        shed.len(),
        10,
        "{:?}",
        results.iter().map(|(r, _)| r.status).collect::<Vec<_>>()
    );
    assert!(shed
        .iter()
        .all(|(r, t)| r.body.contains("overloaded") && *t < Duration::from_millis(300)));
    assert_eq!(
        results.iter().filter(|(r, _)| r.status == 200).count(),
        2,
        "the two in flight complete"
    );
    let metrics = http::get(&f.service.addr, "/metrics", &[]).unwrap().body;
    assert!(
        metrics.contains("meshlimitd_overloaded_total 10"),
        "{metrics}"
    );
}

#[test]
fn a_black_holed_redis_gets_fast_503s_after_a_few_timeouts() {
    let f = start(&["--redis-timeout-ms", "100"]);
    assert_eq!(post(&f.service.addr).0.status, 200);
    signal(f.redis.pid(), "-STOP");
    let slow: Vec<(Response, Duration)> = (0..3).map(|_| post(&f.service.addr)).collect();
    assert!(slow
        .iter()
        .all(|(r, t)| r.status == 503 && *t >= Duration::from_millis(90)));
    let fast: Vec<(Response, Duration)> = (0..10).map(|_| post(&f.service.addr)).collect();
    assert!(fast.iter().all(|(r, _)| r.status == 503));
    let quick = fast
        .iter()
        .filter(|(_, t)| *t < Duration::from_millis(50))
        .count();
    assert!(
        quick >= 8,
        "{quick} of 10 answered fast: {:?}",
        fast.iter().map(|(_, t)| t).collect::<Vec<_>>()
    );
    signal(f.redis.pid(), "-CONT");
    let deadline = Instant::now() + Duration::from_secs(5);
    while post(&f.service.addr).0.status != 200 {
        assert!(Instant::now() < deadline, "no recovery");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_answers_in_flight_checks_refuses_new_ones_and_exits_zero() {
    let mut f = start(&["--redis-timeout-ms", "3000", "--request-timeout-ms", "5000"]);
    assert_eq!(post(&f.service.addr).0.status, 200);
    signal(f.redis.pid(), "-STOP");
    let addr = f.service.addr.clone();
    let in_flight = std::thread::spawn(move || post(&addr));
    std::thread::sleep(Duration::from_millis(200));
    signal(f.service.proc.pid(), "-TERM");
    std::thread::sleep(Duration::from_millis(200));
    // New connections are refused once shutdown began.
    assert!(http::request(&f.service.addr, "POST", "/v1/check", &[], CHECK).is_err());
    signal(f.redis.pid(), "-CONT");
    let (r, _) = in_flight.join().unwrap();
    assert_eq!(r.status, 200, "the in-flight check is answered: {}", r.body);
    assert_eq!(f.service.proc.wait(Duration::from_secs(5)), Some(0));
    assert!(f.service.proc.output().contains("shutting down"));
}

/// The caller's deadline travels with the call: with Redis black-holed, a
/// call whose caller waits 5 ms is answered 503 after about 5 ms instead of
/// the Redis timeout, so no script starts after the caller gave up (it
/// would be charged in Redis while the caller charges the request
/// locally).
#[test]
fn no_work_past_the_callers_deadline() {
    let f = start(&["--redis-timeout-ms", "400", "--request-timeout-ms", "1000"]);
    assert_eq!(post(&f.service.addr).0.status, 200, "loads the script");
    signal(f.redis.pid(), "-STOP");
    let timed = |headers: &[(&str, &[u8])]| {
        let started = Instant::now();
        let r = http::request(
            &f.service.addr,
            "POST",
            "/v1/check",
            headers,
            br#"{"checks":[{"subject":"s","limits":[{"name":"api/m","requests":5,"window_ms":60000,"algorithm":"fixed_window"}]}]}"#,
        )
        .unwrap();
        (r, started.elapsed())
    };
    let (short, short_took) = timed(&[(meshlimit_protocol::TIMEOUT_HEADER, b"5")]);
    let (long, long_took) = timed(&[]);
    signal(f.redis.pid(), "-CONT");
    assert_eq!((short.status, long.status), (503, 503));
    assert!(
        short.body.contains("not decided within 4.5ms"),
        "{}",
        short.body
    );
    assert!(short_took < Duration::from_millis(100), "{short_took:?}");
    assert!(long_took >= Duration::from_millis(350), "{long_took:?}");
}
