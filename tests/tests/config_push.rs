//! A configuration pushed to a running Envoy (as Istio pushes a changed
//! WasmPlugin): the listener is replaced, the VM (one `vm_id`) and its
//! shared data stay.

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
use meshlimit_testbed::{http, procs};
use meshlimit_testbed::{Topology, TopologyOptions};

/// The replica's rendered config, its listener moved out to a file Envoy
/// watches (filesystem LDS): `(bootstrap, listener resources)`.
fn split_listener(config: &str) -> (String, String) {
    let start = config.find("  listeners:\n").expect("a static listener");
    let end = config.find("  clusters:\n").expect("static clusters");
    let listener = &config[start + "  listeners:\n".len()..end];
    // `  - name: ingress` and its fields, two deeper: one resource.
    let mut resources = String::from("resources:\n");
    for (i, line) in listener.lines().enumerate() {
        let line = line.strip_prefix("  ").unwrap_or(line);
        if i == 0 {
            resources
                .push_str("- \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n  ");
            resources.push_str(line.trim_start_matches("- "));
        } else {
            resources.push_str(line);
        }
        resources.push('\n');
    }
    let bootstrap = format!(
        "{}node: {{ id: replica-1, cluster: meshlimit-test }}\ndynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    path_config_source:\n      path: LDS_PATH\nstatic_resources:\n{}",
        &config[..config.find("static_resources:\n").expect("static resources")],
        &config[end..]
    );
    (bootstrap, resources)
}

/// Redis and meshlimitd; each test starts its pushable replica.
fn without_replicas() -> Topology {
    Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        ..TopologyOptions::default()
    })
}

/// Waits, if need be, for an hour with more than `margin_s` seconds left
/// (a per-hour limit's counter must not start again mid-test).
fn well_inside_the_hour(margin_s: u64) {
    let into_hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() % 3600);
    if into_hour + margin_s >= 3600 {
        std::thread::sleep(Duration::from_secs(3601 - into_hour));
    }
}

/// Starts replica 1 with `plugin_config`, its listener in a file Envoy
/// watches, and waits for the listener: the replica and the file. A
/// replaced listener drains for a second (`--drain-time-s 1`; Envoy's
/// default is ten minutes, Istio's 45 s), then Envoy calls the old
/// configuration's roots' `on_done` and deletes them.
fn start_pushable(
    t: &Topology,
    plugin_config: &str,
) -> (meshlimit_testbed::procs::Proc, std::path::PathBuf) {
    let (bootstrap, listener) = split_listener(&t.replica_config_with(1, plugin_config));
    let lds = t.dir.path().join("lds.yaml");
    std::fs::write(&lds, &listener).unwrap();
    let bootstrap = bootstrap.replace("LDS_PATH", lds.to_str().unwrap());
    let replica = t.start_envoy_with("replica-1", &bootstrap, 2, &["--drain-time-s", "1"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while http::get(&t.replica_addr(1), "/health", &[]).is_err() {
        assert!(Instant::now() < deadline, "the listener never came up");
        std::thread::sleep(Duration::from_millis(100));
    }
    (replica, lds)
}

/// Pushes `plugin_config` to replica 1 (its listener file replaced whole,
/// as a control plane replaces a resource) and waits until Envoy took it.
fn push(t: &Topology, lds: &std::path::Path, plugin_config: &str) {
    take_push(t, lds, plugin_config);
    std::thread::sleep(Duration::from_millis(500));
}

/// [`push`] without the settling wait: returns as soon as Envoy took the
/// new listener (the old one's drain begins then).
fn take_push(t: &Topology, lds: &std::path::Path, plugin_config: &str) {
    let updates = || {
        http::envoy_stats(
            &t.replica_admin(1),
            "^listener_manager\\.lds\\.update_success$",
        )
        .first()
        .map_or(0, |(_, v)| *v)
    };
    let before = updates();
    let (_, listener) = split_listener(&t.replica_config_with(1, plugin_config));
    let next = t.dir.path().join("lds.next.yaml");
    std::fs::write(&next, listener).unwrap();
    std::fs::rename(&next, lds).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while updates() == before {
        assert!(
            Instant::now() < deadline,
            "Envoy never took the new listener"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Shared data outlives a configuration push under the same `vm_id`. The
/// deny cache used to key its entries by the limit's name alone: raising a
/// limit left denied clients denied until the cached deadline (up to the
/// window, 31 days at most). Entries are now keyed by the limit's whole
/// definition.
#[test]
fn a_raised_limit_ends_cached_denials_at_once() {
    let t = without_replicas();
    let per_hour = |requests: u64| {
        keyed("local")
            .limits(json!([{"name": "per-hour", "requests": requests, "window": "1h"}]))
            .build()
    };
    let (mut replica, lds) = start_pushable(&t, &per_hour(1));
    // Else the first requests may be fallbacks, which feed no deny cache.
    t.wait_sees_meshlimitd(1, &mut replica);
    let addr = t.replica_addr(1);
    let get = || {
        http::get(&addr, "/api/x", &[("x-api-key", b"pushed")])
            .unwrap()
            .status
    };
    // The limit is per hour: start well inside one.
    well_inside_the_hour(10);
    assert_eq!(get(), 200);
    assert_eq!(get(), 429, "decided by meshlimitd, then cached");
    assert_eq!(get(), 429);
    assert!(t.stat(1, "meshlimit.deny_cache_hits") >= 1, "a cached deny");
    // The operator raises the limit.
    push(&t, &lds, &per_hour(100));
    let allowed_before = t.stat(1, "meshlimit.requests_allowed");
    assert_eq!(get(), 200, "decided by meshlimitd under the new limit");
    assert_eq!(t.stat(1, "meshlimit.requests_allowed"), allowed_before + 1);
    let log = t.logs("replica-1");
    assert!(!log.contains("panicked"), "{log}");
}

/// The decision log is turned on (and off) by a configuration push, with
/// no restart: each line says where the decision came from and what each
/// limit said.
#[test]
fn a_push_turns_the_decision_log_on_and_off() {
    let t = without_replicas();
    let config = |log: Value| {
        keyed("local")
            .limits(json!([{"name": "per-minute", "requests": 3, "window": "60s"}]))
            .set("decision_log", log)
            .build()
    };
    let (mut replica, lds) = start_pushable(&t, &config(json!({})));
    t.wait_sees_meshlimitd(1, &mut replica);
    wait_for_fresh_window(Duration::from_secs(20));
    let get = |key: &str| {
        http::get(
            &t.replica_addr(1),
            "/api/x",
            &[("x-api-key", key.as_bytes())],
        )
        .unwrap()
        .status
    };
    let lines = || {
        t.logs("replica-1")
            .lines()
            .filter(|l| l.contains("decision ") && l.contains("hdr:x-api-key:logged"))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert_eq!(get("logged"), 200);
    assert!(lines().is_empty(), "off by default: {:?}", lines());

    push(&t, &lds, &config(json!({"sample": 1, "level": "info"})));
    let statuses: Vec<u16> = (0..4).map(|_| get("logged")).collect();
    assert_eq!(statuses, [200, 200, 429, 429]);
    let logged = lines();
    assert_eq!(logged.len(), 4, "{logged:#?}");
    assert!(
        logged[0].contains("decision allowed from call: "),
        "{logged:#?}"
    );
    assert!(
        logged[2].contains("decision denied from call: ") && logged[2].contains("remaining 0 of 3"),
        "{logged:#?}"
    );
    assert!(
        logged[3].contains("decision denied from cache: "),
        "{logged:#?}"
    );

    push(&t, &lds, &config(json!({})));
    assert_eq!(get("logged"), 429);
    assert_eq!(lines().len(), 4, "off again: {:#?}", lines());
}

/// A busy client's plugin configuration: leases idle only ten seconds
/// after their last use, past the one-second drain, so only `on_done` can
/// give them back. Any change makes new roots: here, the decision log's.
fn leased(log: Value) -> String {
    keyed("local")
        .limits(json!([{"name": "per-hour", "requests": 100_000, "window": "1h"}]))
        .set("leases", json!({"interval": "10s"}))
        .set("decision_log", log)
        .build()
}

/// Replica 1, pushable, after a busy client's 200 or more requests over
/// eight connections in turn (both workers take requests, and one may hold
/// a draw from the other's lease when they go): the replica, its listener
/// file, and the count admitted. Redis holds more: the leases' units.
fn after_a_busy_client(t: &Topology) -> (meshlimit_testbed::procs::Proc, std::path::PathBuf, u64) {
    let (mut replica, lds) = start_pushable(t, &leased(json!({})));
    t.wait_sees_meshlimitd(1, &mut replica);
    well_inside_the_hour(30);
    let mut conns: Vec<http::Conn> = (0..8)
        .map(|_| http::Conn::new(&t.replica_addr(1)))
        .collect();
    // At least 200, and on until a lease holds units unspent: one used
    // up to its last unit by the last request holds none.
    let mut admitted = 0;
    let mut charged = 0;
    for i in 0..400 {
        let r = conns[i % 8]
            .get("/api/x", &[("x-api-key", b"busy")])
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        admitted += 1;
        if admitted >= 200 {
            charged = t.key_count("per-hour", "busy");
            if charged > admitted {
                break;
            }
        }
    }
    drop(conns);
    assert!(
        t.stat(1, "meshlimit.lease_grants") > 0,
        "a lease was granted"
    );
    assert!(
        charged > admitted,
        "a lease holds units beyond the {admitted} admitted: {charged} charged"
    );
    (replica, lds, admitted)
}

/// Waits until Redis holds exactly what was admitted.
fn wait_charged(t: &Topology, admitted: u64, within: Duration) {
    let charged = || t.key_count("per-hour", "busy");
    assert!(
        eventually(within, || charged() == admitted),
        "{} charged for {admitted} admitted: the old workers' leases were not given back",
        charged()
    );
}

/// What the old roots must have logged: their leases given back, within
/// the wait, and `proxy_done` accepted (the fake host's rule: from the
/// root whose `on_done` said it had work left, once).
fn assert_went_away_cleanly(t: &Topology) {
    let log = t.logs("replica-1");
    assert!(log.contains("giving back the units of"), "{log}");
    assert!(!log.contains("was not waiting"), "{log}");
    assert!(
        !log.contains("going away after"),
        "confirmed in time: {log}"
    );
    assert!(!log.contains("panicked"), "{log}");
}

/// A push while a busy client holds a lease: the old configuration's
/// workers installed it, and no one else gives it back. Their roots were
/// deleted once the old listener drained, and with them the tick that
/// returns idle leases: the units stayed charged until the window ended
/// (on Envoy 1.40 with a one-second drain and leases idle after ten, 200
/// admitted read as 200 plus the lease in Redis for the rest of the hour).
/// Now each old root gives its leases back in `on_done`, and stays until
/// meshlimitd confirmed them.
#[test]
fn a_pushed_configuration_gives_the_old_workers_leases_back() {
    let t = without_replicas();
    let (_replica, lds, admitted) = after_a_busy_client(&t);
    push(&t, &lds, &leased(json!({"denied_only": true})));
    wait_charged(&t, admitted, Duration::from_secs(8));
    assert_went_away_cleanly(&t);
}

/// The same push with meshlimitd away when the old roots go: their
/// returns fail, and are sent again on the roots' ticks until meshlimitd
/// is back. The fake host's assumption, checked on the real one: a root
/// whose `on_done` said it was not done keeps its ticks (and its calls)
/// until it calls `proxy_done`.
#[test]
fn an_old_worker_keeps_its_ticks_until_its_returns_are_confirmed() {
    let mut t = without_replicas();
    let (_replica, lds, admitted) = after_a_busy_client(&t);
    take_push(&t, &lds, &leased(json!({"denied_only": true})));
    // Away for the drain (a second): fewer failed health checks than
    // mark it unhealthy (three), so its return is not delayed past that.
    t.stop_meshlimitd();
    let went = || t.logs("replica-1").contains("giving back the units of");
    assert!(
        procs::eventually(Duration::from_secs(5), went),
        "{}",
        t.logs("replica-1")
    );
    let charged = t.key_count("per-hour", "busy");
    assert!(
        charged > admitted,
        "nothing can be given back with meshlimitd away: {charged} charged"
    );
    t.start_meshlimitd();
    wait_charged(&t, admitted, Duration::from_secs(8));
    assert_went_away_cleanly(&t);
}
