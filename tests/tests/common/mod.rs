//! Helpers shared by the end-to-end test files.
#![allow(dead_code)]

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use meshlimit_testbed::http::Response;
pub use meshlimit_testbed::plugin::PluginConfig;
use meshlimit_testbed::{Topology, TopologyOptions};
pub use serde_json::{json, Value};

/// The limit every test config uses, per minute.
pub const LIMIT: usize = meshlimit_testbed::plugin::USUAL_LIMIT as usize;

/// The tests' usual config (see [`PluginConfig::new`]) with `client_id`
/// and `failure_mode`.
pub fn plugin_config(client_id: Value, failure_mode: &str) -> String {
    PluginConfig::new()
        .client_id(client_id)
        .failure_mode(failure_mode)
        .build()
}

/// The usual config, by `failure_mode`.
pub fn keyed(failure_mode: &str) -> PluginConfig {
    PluginConfig::new().failure_mode(failure_mode)
}

pub fn keyed_config(failure_mode: &str) -> String {
    keyed(failure_mode).build()
}

/// One replica, no front proxy: requests go straight to it.
pub fn single_replica(plugin_config: String) -> Topology {
    Topology::start(TopologyOptions {
        plugin_config,
        replicas: 1,
        front: false,
        ..TopologyOptions::default()
    })
}

pub fn topology(plugin_config: String) -> Topology {
    Topology::start(TopologyOptions {
        plugin_config,
        ..TopologyOptions::default()
    })
}

/// Windows are aligned to Redis time; a burst that straddles a minute
/// boundary would be counted in two windows. Start bursts early in a window.
pub fn wait_for_fresh_window(needed: Duration) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let into = now.as_millis() as u64 % 60_000;
    if into + needed.as_millis() as u64 > 58_000 {
        std::thread::sleep(Duration::from_millis(60_000 - into + 300));
    }
}

pub fn key(id: &str) -> Vec<(&'static str, Vec<u8>)> {
    vec![("x-api-key", id.as_bytes().to_vec())]
}

pub fn send(t: &Topology, headers: &[(&'static str, Vec<u8>)]) -> Response {
    let refs: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    t.get("/api/items", &refs)
}

/// (allowed, denied) over `n` sequential requests; any other status fails.
pub fn burst(t: &Topology, headers: &[(&'static str, Vec<u8>)], n: usize) -> (usize, usize) {
    let (mut ok, mut denied) = (0, 0);
    for _ in 0..n {
        let r = send(t, headers);
        match r.status {
            200 => ok += 1,
            429 => denied += 1,
            other => panic!("unexpected status {other}: {}", r.body),
        }
    }
    (ok, denied)
}

/// Waits until `what` holds, for at most `within`.
pub fn eventually(within: Duration, what: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !what() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    true
}

/// Sends requests until several in a row (so every replica's breaker has
/// closed) are decided by the service, for at most `within`.
pub fn wait_for_global_decisions(t: &Topology, within: Duration) {
    let deadline = Instant::now() + within;
    let mut in_a_row = 0;
    let mut n = 0;
    while in_a_row < 6 {
        let before = t.fallback_decisions();
        n += 1;
        let probe = send(t, &key(&format!("probe-{n}")));
        assert_eq!(probe.status, 200);
        if t.fallback_decisions() == before {
            in_a_row += 1;
        } else {
            in_a_row = 0;
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(
            Instant::now() < deadline,
            "still falling back after {within:?}"
        );
    }
}

/// The usual config with the `api` rule's `limits`, and its other fields
/// from `rule` (an object, e.g. `{"shadow": true}`).
pub fn rule_config(rule: Value, limits: Value) -> String {
    let mut config = PluginConfig::new().limits(limits);
    for (field, value) in rule.as_object().cloned().unwrap_or_default() {
        config = config.rule_field(&field, value);
    }
    config.build()
}

/// Requests admitted out of `per_thread * threads`, sent concurrently; any
/// status but 200 and 429 fails the test.
pub fn concurrent_allowed(t: &Topology, id: &str, threads: usize, per_thread: usize) -> usize {
    let allowed = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..per_thread {
                    let r = send(t, &key(id));
                    assert!(
                        r.status == 200 || r.status == 429,
                        "status {}: {}",
                        r.status,
                        r.body
                    );
                    if r.status == 200 {
                        allowed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    allowed.into_inner()
}

/// Fails if any replica's VM panicked (a trap breaks every later request
/// on that worker until the VM is reloaded).
pub fn assert_no_vm_panics(t: &Topology) {
    for i in 1..=t.options.replicas {
        let log = t.logs(&format!("replica-{i}"));
        let panics: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("panicked") || l.contains("RuntimeError"))
            .collect();
        assert!(
            panics.is_empty(),
            "replica-{i} VM trapped:\n{}",
            panics.join("\n")
        );
    }
}

/// The checks meshlimitd has decided, over every outcome
/// (`meshlimitd_decisions_total`).
pub fn meshlimitd_decisions(t: &Topology) -> u64 {
    let metrics = meshlimit_testbed::http::get(&t.meshlimitd_addr(), "/metrics", &[])
        .map(|r| r.body)
        .unwrap_or_default();
    metrics
        .lines()
        .filter(|l| l.starts_with("meshlimitd_decisions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}
