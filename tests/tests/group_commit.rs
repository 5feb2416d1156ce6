//! Group commit end to end: concurrent checks coalesced into batches by
//! each worker's root context, still exact, still decided one by one.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use meshlimit_testbed::http::Conn;
use meshlimit_testbed::Topology;

/// Group commit on, with `extra` settings, and a limit of `limit` a minute
/// per `x-api-key`.
fn grouped(limit: u64, extra: Value) -> PluginConfig {
    let mut group_commit = json!({"enabled": true});
    for (field, value) in extra.as_object().cloned().unwrap_or_default() {
        group_commit[field] = value;
    }
    PluginConfig::new()
        .set("service", json!({"timeout": "1s"}))
        .client_id(json!({"headers": ["x-api-key"]}))
        .rule_field("match", json!({}))
        .limit_field("requests", json!(limit))
        .set("group_commit", group_commit)
}

/// Sends `per_thread` requests from each of `threads` keep-alive
/// connections; the client id of each request comes from `id`.
fn hammer(
    t: &Topology,
    threads: usize,
    per_thread: usize,
    id: impl Fn(usize, usize) -> String + Sync,
) -> Vec<(String, u16)> {
    let out = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for th in 0..threads {
            let (out, id, entry) = (&out, &id, t.entry());
            s.spawn(move || {
                let mut conn = Conn::new(&entry);
                for i in 0..per_thread {
                    let client = id(th, i);
                    let r = conn.get("/api/x", &[("x-api-key", client.as_bytes())]);
                    let status = r.map(|r| r.status).unwrap_or(0);
                    out.lock().unwrap().push((client, status));
                }
            });
        }
    });
    out.into_inner().unwrap()
}

fn allowed_by_client(results: &[(String, u16)]) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for (client, status) in results {
        assert!(*status == 200 || *status == 429, "status {status}");
        *m.entry(client.clone()).or_insert(0) += usize::from(*status == 200);
    }
    m
}

#[test]
fn one_hot_client_under_64_connections_is_exact_and_batched() {
    let t = topology(grouped(20, json!({})).build());
    wait_for_fresh_window(Duration::from_secs(20));
    // The deny cache would hide batching once the client is over its limit:
    // count the calls while it still has quota.
    let results = hammer(&t, 64, 3, |_, _| "hot".to_string());
    assert_eq!(
        t.stat_total("meshlimit.fallback_allowed"),
        0,
        "{}",
        t.fallback_causes()
    );
    assert_eq!(allowed_by_client(&results)["hot"], 20);
    let checks = t.stat_total("meshlimit.batched_checks");
    let batches = t.stat_total("meshlimit.batches");
    assert!(checks > 0 && batches > 0);
    assert_no_vm_panics(&t);
}

#[test]
fn fifty_clients_at_once_each_get_exactly_their_limit() {
    let t = topology(grouped(10, json!({})).build());
    wait_for_fresh_window(Duration::from_secs(25));
    // 64 connections, 50 clients, 20 requests per client.
    let results = hammer(&t, 64, 16, |th, i| format!("c{}", (th * 16 + i) % 50));
    let allowed = allowed_by_client(&results);
    assert_eq!(allowed.len(), 50);
    for (client, n) in &allowed {
        assert_eq!(*n, 10, "{client}");
    }
    let (checks, batches) = (
        t.stat_total("meshlimit.batched_checks"),
        t.stat_total("meshlimit.batches"),
    );
    assert!(
        batches < checks,
        "{checks} checks in {batches} calls: coalesced"
    );
    assert_eq!(t.fallback_decisions(), 0);
    assert_no_vm_panics(&t);
}

#[test]
fn a_mixed_batch_answers_each_request_correctly() {
    // Long queue age and a slow first call: checks of allowed and denied
    // clients end up in the same batches.
    let t = topology(grouped(3, json!({"max_batch": 64})).build());
    wait_for_fresh_window(Duration::from_secs(15));
    // Exhaust "full" first, then mix it with fresh clients concurrently.
    let _ = hammer(&t, 1, 4, |_, _| "full".to_string());
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for th in 0..16 {
            let (results, entry) = (&results, t.entry());
            s.spawn(move || {
                let mut conn = Conn::new(&entry);
                for i in 0..3 {
                    let id = if th % 2 == 0 {
                        "full".to_string()
                    } else {
                        format!("fresh-{th}")
                    };
                    let r = conn.get("/api/x", &[("x-api-key", id.as_bytes())]).unwrap();
                    results.lock().unwrap().push((id, i, r));
                }
            });
        }
    });
    for (id, i, r) in results.into_inner().unwrap() {
        if id == "full" {
            assert_eq!(r.status, 429, "{id}: {}", t.fallback_causes());
            assert_eq!(r.body, "rate limit exceeded\n");
            assert!(r.header("retry-after").is_some());
        } else {
            assert_eq!(r.status, 200, "{id} request {i}: {}", t.fallback_causes());
            assert_eq!(r.body, "hello from the upstream\n");
            let rl = r.header("ratelimit").unwrap_or("").to_string();
            assert!(rl.starts_with("\"api/per-minute\";r="), "{id}: {rl}");
        }
    }
    assert_no_vm_panics(&t);
}

#[test]
fn meshlimitd_killed_with_batches_in_flight_decides_every_request_by_failure_mode() {
    let mut t = topology(
        grouped(1_000_000, json!({}))
            .set("service", json!({"timeout": "200ms"}))
            .build(),
    );
    let done = AtomicUsize::new(0);
    let slowest = std::sync::Mutex::new(Duration::ZERO);
    let results = std::thread::scope(|s| {
        let workers: Vec<_> = (0..32)
            .map(|th| {
                let (entry, done, slowest) = (t.entry(), &done, &slowest);
                s.spawn(move || {
                    let mut conn = Conn::new(&entry);
                    let mut statuses = Vec::new();
                    while done.load(Ordering::Relaxed) == 0 {
                        let started = Instant::now();
                        let id = format!("k{th}");
                        let status = conn
                            .get("/api/x", &[("x-api-key", id.as_bytes())])
                            .map(|r| r.status)
                            .unwrap_or(0);
                        let took = started.elapsed();
                        let mut s = slowest.lock().unwrap();
                        *s = (*s).max(took);
                        statuses.push(status);
                    }
                    statuses
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        if let Some(p) = t.meshlimitd_proc() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &p.pid().unwrap_or(0).to_string()])
                .status();
        }
        std::thread::sleep(Duration::from_millis(1_000));
        done.store(1, Ordering::Relaxed);
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect::<Vec<u16>>()
    });
    assert!(
        results.iter().all(|s| *s == 200),
        "every request decided, none failed: {:?}",
        results
            .iter()
            .filter(|s| **s != 200)
            .take(5)
            .collect::<Vec<_>>()
    );
    let slowest = *slowest.lock().unwrap();
    // The call timeout (200 ms) plus a generous margin for a loaded machine.
    assert!(
        slowest < Duration::from_millis(1_000),
        "a request waited {slowest:?}"
    );
    assert!(t.stat_total("meshlimit.fallback_allowed") > 0);
    assert_no_vm_panics(&t);
}

#[test]
fn clients_that_hang_up_while_queued_do_not_disturb_the_batch() {
    let t = topology(grouped(1_000_000, json!({})).build());
    // Half of the clients send a request and close at once; the others wait
    // for their answers.
    let results = std::thread::scope(|s| {
        let quitters: Vec<_> = (0..200)
            .map(|i| {
                let entry = t.entry();
                s.spawn(move || {
                    if let Ok(mut c) = TcpStream::connect(&entry) {
                        let req = format!(
                            "GET /api/x HTTP/1.1\r\nhost: x\r\nx-api-key: quitter-{i}\r\n\r\n"
                        );
                        let _ = c.write_all(req.as_bytes());
                    }
                })
            })
            .collect();
        let stayers = hammer(&t, 16, 10, |th, i| format!("stayer-{th}-{i}"));
        for q in quitters {
            let _ = q.join();
        }
        stayers
    });
    assert!(
        results.iter().all(|(_, s)| *s == 200),
        "the clients that stayed got their answers"
    );
    // The proxy is still healthy afterwards.
    assert_eq!(send(&t, &key("after")).status, 200);
    assert_no_vm_panics(&t);
}
