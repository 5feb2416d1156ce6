//! `make soak`: mixed traffic for SOAK_SECONDS (default 600) through two
//! replicas, with Redis restarted every SOAK_RESTART_SECONDS (default 120),
//! and hostile clients throughout (33,000-byte binary ids, duplicate id
//! headers, streams reset mid-check). Reports 5xx (must be 0), fallback
//! decisions while Redis was up (must be 0: hostile input changes no one
//! else's decision), decisions by kind, and memory before and after;
//! writes docs/soak.md.
//!
//! `make memory` (`meshlimit-soak --flood N`): N distinct client ids through
//! one Envoy with Redis down (local fallback), then through meshlimitd with
//! Redis up; reports resident memory along the way; writes docs/memory.md.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use meshlimit_testbed::http::Conn;
use meshlimit_testbed::procs::rss_kib;
use meshlimit_testbed::tools;
use meshlimit_testbed::{Topology, TopologyOptions};

fn env_secs(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const SOAK_CONFIG: &str = r#"{
  "service": {"timeout": "50ms"},
  "client_id": {"headers": ["x-api-key"], "when_missing": "client_address", "trusted_hops": 1},
  "rules": [
    {"name": "fixed", "match": {"path_prefix": "/fixed"}, "limits": [{"name": "m", "requests": 30, "window": "10s"}]},
    {"name": "log", "match": {"path_prefix": "/log"}, "limits": [{"name": "m", "requests": 30, "window": "10s", "algorithm": "sliding_window_log"}]},
    {"name": "bucket", "match": {"path_prefix": "/bucket"}, "limits": [{"name": "m", "requests": 3, "window": "1s", "algorithm": "token_bucket", "burst": 5}]}
  ]
}"#;

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    denied: AtomicU64,
    server_errors: AtomicU64,
    other: AtomicU64,
    hostile: AtomicU64,
}

/// Time after a Redis restart before limiting is expected to be global
/// again (the breaker's probes, meshlimitd's reconnection).
const RECOVERY: Duration = Duration::from_secs(10);

/// One hostile request, by kind: a huge binary id, two id headers, or a
/// stream reset while its check is out. Returns whether it got a 5xx.
fn hostile(entry: &str, kind: u64, n: u64) -> bool {
    use std::io::Write;
    match kind % 3 {
        0 => {
            let huge = vec![0xff_u8; 33_000];
            let r = meshlimit_testbed::http::get(entry, "/fixed/h", &[("x-api-key", &huge)]);
            matches!(r, Ok(r) if r.status >= 500)
        }
        1 => {
            let victim = format!("client-{}", n % 200);
            let r = meshlimit_testbed::http::get(
                entry,
                "/log/d",
                &[("x-api-key", victim.as_bytes()), ("x-api-key", b"mine")],
            );
            matches!(r, Ok(r) if r.status >= 500)
        }
        _ => {
            if let Ok(mut conn) = std::net::TcpStream::connect(entry) {
                let _ = write!(
                    conn,
                    "GET /bucket/r HTTP/1.1\r\nhost: soak\r\nx-api-key: resetter-{}\r\n\r\n",
                    n % 50
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            false
        }
    }
}

/// The hostile client, until `stop`: a request every 20 ms, each one of
/// [`hostile`]'s kinds in turn.
fn hostile_client(entry: &str, counts: &Counts, stop: &AtomicBool) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        if hostile(entry, n, n / 3) {
            counts.server_errors.fetch_add(1, Ordering::Relaxed);
        }
        counts.hostile.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One keep-alive connection (`w` of 4) of well-behaved and abusive
/// clients over the three rules, until `stop`.
fn mixed_traffic(w: u64, entry: &str, counts: &Counts, stop: &AtomicBool) {
    let mut conn = Conn::new(entry);
    let mut n = w;
    while !stop.load(Ordering::Relaxed) {
        n = n
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let path = ["/fixed/a", "/log/b", "/bucket/c"][(n >> 33) as usize % 3];
        // 200 well-behaved clients and 3 abusive ones.
        let id = if n.is_multiple_of(10) {
            format!("abuser-{}", (n >> 20) % 3)
        } else {
            format!("client-{}", (n >> 24) % 200)
        };
        let slot = match conn.get(path, &[("x-api-key", id.as_bytes())]) {
            Ok(r) if r.status == 200 => &counts.ok,
            Ok(r) if r.status == 429 => &counts.denied,
            Ok(r) if r.status >= 500 => &counts.server_errors,
            _ => &counts.other,
        };
        slot.fetch_add(1, Ordering::Relaxed);
        if w == 0 && n.is_multiple_of(4) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn soak() {
    let seconds = env_secs("SOAK_SECONDS", 600);
    let restart_every = env_secs("SOAK_RESTART_SECONDS", 120);
    let mut t = Topology::start(TopologyOptions {
        plugin_config: SOAK_CONFIG.into(),
        ..TopologyOptions::default()
    });
    println!("soak: {seconds}s of mixed traffic, Redis restarted every {restart_every}s");
    let rss_before = (t.replica_rss_kib(1), t.replica_rss_kib(2));
    let counts = Counts::default();
    let stop = AtomicBool::new(false);
    let entry = t.entry();
    let mut restarts = 0;
    // Fallback decisions while Redis was up: from RECOVERY after each
    // restart (and after the start) to the next restart.
    let mut steady_fallbacks = 0;
    std::thread::scope(|s| {
        {
            let (entry, counts, stop) = (entry.clone(), &counts, &stop);
            s.spawn(move || hostile_client(&entry, counts, stop));
        }
        for w in 0..4u64 {
            let (entry, counts, stop) = (entry.clone(), &counts, &stop);
            s.spawn(move || mixed_traffic(w, &entry, counts, stop));
        }
        let start = Instant::now();
        let mut next_restart = Duration::from_secs(restart_every);
        let mut steady_since: Option<u64> = None;
        let mut last_restart = Duration::ZERO;
        while start.elapsed() < Duration::from_secs(seconds) {
            std::thread::sleep(Duration::from_millis(200));
            if steady_since.is_none() && start.elapsed() >= last_restart + RECOVERY {
                steady_since = Some(t.fallback_decisions());
            }
            if start.elapsed() >= next_restart {
                if let Some(from) = steady_since.take() {
                    steady_fallbacks += t.fallback_decisions() - from;
                }
                println!("  {:>4}s: restarting Redis", start.elapsed().as_secs());
                last_restart = start.elapsed();
                t.stop_redis();
                std::thread::sleep(Duration::from_secs(2));
                t.start_redis();
                restarts += 1;
                next_restart += Duration::from_secs(restart_every);
            }
        }
        if let Some(from) = steady_since.take() {
            steady_fallbacks += t.fallback_decisions() - from;
        }
        stop.store(true, Ordering::Relaxed);
    });
    let rss_after = (t.replica_rss_kib(1), t.replica_rss_kib(2));
    let stat = |n: &str| t.stat_total(n);
    let mut report = String::new();
    let total = counts.ok.load(Ordering::Relaxed)
        + counts.denied.load(Ordering::Relaxed)
        + counts.server_errors.load(Ordering::Relaxed)
        + counts.other.load(Ordering::Relaxed);
    let _ = writeln!(
        report,
        "# Soak\n\nGenerated by `make soak` (tests/src/bin/meshlimit-soak.rs): {seconds} s of mixed traffic\n(4 keep-alive connections through the front Envoy, two replicas; 200\nwell-behaved clients and 3 abusive ones over three rules: fixed window,\nsliding log, token bucket), Redis stopped for 2 s and restarted every\n{restart_every} s ({restarts} restarts). Beside them, one hostile client\nthroughout, in turn: a 33,000-byte binary id, two `x-api-key` headers (a\nvictim's and its own), a stream reset while its check is out.\n\n| what | value |\n|---|---|\n| requests | {total} |\n| hostile requests (not in the counts below) | {} |\n| **fallback decisions while Redis was up** (from {}s after each restart to the next) | **{steady_fallbacks}** |\n| 200 | {} |\n| 429 | {} |\n| **5xx** | **{}** |\n| connection errors or other statuses | {} |\n| decided by meshlimitd (allowed / denied) | {} / {} |\n| decided by the deny cache | {} |\n| decided locally (fallback allowed / denied) | {} / {} |\n| breaker openings | {} |\n| replica-1 RSS before / after | {} / {} KiB |\n| replica-2 RSS before / after | {} / {} KiB |",
        counts.hostile.load(Ordering::Relaxed),
        RECOVERY.as_secs(),
        counts.ok.load(Ordering::Relaxed),
        counts.denied.load(Ordering::Relaxed),
        counts.server_errors.load(Ordering::Relaxed),
        counts.other.load(Ordering::Relaxed),
        stat("meshlimit.requests_allowed"),
        stat("meshlimit.requests_denied"),
        stat("meshlimit.deny_cache_hits"),
        stat("meshlimit.fallback_allowed"),
        stat("meshlimit.fallback_denied"),
        stat("meshlimit.breaker_opened"),
        rss_before.0,
        rss_after.0,
        rss_before.1,
        rss_after.1,
    );
    write_report("docs/soak.md", &report);
    if counts.server_errors.load(Ordering::Relaxed) > 0 || steady_fallbacks > 0 {
        std::process::exit(1);
    }
}

fn flood(n: u64) {
    let mut t = Topology::start(TopologyOptions {
        plugin_config: SOAK_CONFIG.into(),
        replicas: 1,
        front: false,
        ..TopologyOptions::default()
    });
    let entry = t.entry();
    let send = |from: u64, to: u64| {
        std::thread::scope(|s| {
            for w in 0..4 {
                let entry = entry.clone();
                s.spawn(move || {
                    let mut conn = Conn::new(&entry);
                    for i in (from + w..to).step_by(4) {
                        let id = format!("flood-{i:010}");
                        let _ = conn.get("/fixed/x", &[("x-api-key", id.as_bytes())]);
                    }
                });
            }
        });
    };
    let marks: Vec<u64> = [10_000, 100_000, 250_000, 500_000, 1_000_000, 2_000_000]
        .into_iter()
        .filter(|m| *m <= n)
        .collect();
    let mut report = String::new();
    let _ = writeln!(
        report,
        "# Memory under a flood of distinct client ids\n\nGenerated by `make memory` (tests/src/bin/meshlimit-soak.rs --flood {n}): distinct\n`x-api-key` values, 4 keep-alive connections to one Envoy (2 workers),\nresident memory (VmRSS) of the processes after each mark.\n\n## Redis down: every request decided by the local fallback\n\n| distinct ids | Envoy RSS (KiB) |\n|---|---|"
    );
    t.stop_redis();
    let mut done = 0;
    for m in &marks {
        send(done, *m);
        done = *m;
        let rss = t.replica_rss_kib(1);
        println!("fallback: {m} ids, Envoy {rss} KiB");
        let _ = writeln!(report, "| {m} | {rss} |");
    }
    t.start_redis();
    t.wait_meshlimitd_healthy();
    std::thread::sleep(Duration::from_secs(3));
    let _ = writeln!(
        report,
        "\n## Redis up: every request decided by meshlimitd\n\n| distinct ids | Envoy RSS (KiB) | meshlimitd RSS (KiB) |\n|---|---|---|"
    );
    let base = done;
    let service_marks: Vec<u64> = marks
        .iter()
        .copied()
        .filter(|m| *m <= n.min(500_000))
        .collect();
    let mut sent = 0;
    for m in &service_marks {
        send(base + sent, base + m);
        sent = *m;
        let (envoy, service) = (t.replica_rss_kib(1), rss_kib(t.meshlimitd_pid()));
        println!("global: {m} ids, Envoy {envoy} KiB, meshlimitd {service} KiB");
        let _ = writeln!(report, "| {m} | {envoy} | {service} |");
    }
    let _ = writeln!(
        report,
        "\nShared data is bounded by configuration, not by clients: fallback\ncounters use `local.slots` keys of 160 bytes (4 clients each; 4096 slots =\n640 KiB), quota leases `leases.slots` keys of 312 bytes (4096 = 1,248 KiB),\nthe deny cache `deny_cache.slots` keys of 32 bytes (4096 = 128 KiB), plus a\nfew single keys (the seed, the breaker, recent denials, the fleet switch,\nlease ends). Each worker's VM keeps tables of its own, bounded too: the\nchecks it planned for up to 512 places (the plan memo: a few hundred bytes\neach, from at most 2 KiB of a request's inputs) and what it observes of\nbusy clients (`leases.slots` entries); what a request allocates beyond\nthem is freed at the end of its stream. meshlimitd keeps no per-client\nstate (Redis does, with an expiry on every key)."
    );
    write_report("docs/memory.md", &report);
}

fn write_report(rel: &str, report: &str) {
    let path = tools::root().join(rel);
    if let Err(e) = std::fs::write(&path, report) {
        eprintln!("cannot write {}: {e}", path.display());
    }
    println!("\n{report}\nwritten to {}", path.display());
}

fn main() {
    meshlimit_testbed::procs::stop_all_on_panic();
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--flood") => flood(
            args.get(2)
                .and_then(|n| n.parse().ok())
                .unwrap_or(1_000_000),
        ),
        _ => soak(),
    }
}
