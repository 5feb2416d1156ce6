//! meshlimitd on a real 3-master, 3-replica Redis Cluster, end to end
//! through two Envoy replicas: exact counts on every master, hash-tag
//! safety, a master killed under traffic, and slots moved under traffic.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use meshlimit_testbed::{Topology, TopologyOptions};

fn cluster_topology(limits: Value) -> Topology {
    cluster_topology_with(rule_config(json!({}), limits))
}

fn cluster_topology_with(plugin_config: String) -> Topology {
    Topology::start(TopologyOptions {
        plugin_config,
        redis_cluster: true,
        ..TopologyOptions::default()
    })
}

fn per_minute() -> Value {
    json!([{"name": "per-minute", "requests": 20, "window": "60s"}])
}

/// The Redis key of client `id`'s per-minute counter.
fn counter_key(id: &str) -> String {
    let tag = meshlimitd::keys::subject_tag(&format!("hdr:x-api-key:{id}"));
    format!("ml:{{{tag}}}:api/per-minute:fw:60000")
}

/// Client ids whose counters live on `n` different masters.
fn clients_on_different_masters(t: &Topology, n: usize) -> Vec<(String, u16, u16)> {
    let cluster = t.cluster.as_ref().expect("a cluster topology");
    let mut found: Vec<(String, u16, u16)> = Vec::new();
    for i in 0..200 {
        let id = format!("client-{i}");
        let slot = cluster.keyslot(&counter_key(&id));
        let Some(master) = cluster.master_of(slot) else {
            continue;
        };
        if found.iter().all(|(_, _, port)| *port != master.port) {
            found.push((id, slot, master.port));
        }
        if found.len() == n {
            break;
        }
    }
    assert_eq!(found.len(), n, "not enough masters");
    found
}

#[test]
fn counts_are_exact_for_clients_on_every_master() {
    let t = cluster_topology(per_minute());
    wait_for_fresh_window(Duration::from_secs(20));
    for (id, slot, port) in clients_on_different_masters(&t, 3) {
        eprintln!("{id}: key slot {slot}, master on port {port}");
        assert_eq!(burst(&t, &key(&id), 60), (20, 40), "{id} on master {port}");
    }
    assert_eq!(t.stat_total("meshlimit.fallback_allowed"), 0);
}

#[test]
fn hostile_ids_keep_their_own_counters_and_one_slot_per_call() {
    let t = cluster_topology(
        json!([{"name": "per-minute", "requests": 5, "window": "60s"}, {"name": "per-hour", "requests": 50, "window": "1h"}]),
    );
    wait_for_fresh_window(Duration::from_secs(20));
    let big = "k".repeat(16 * 1024);
    let ids: Vec<Vec<u8>> = vec![
        b"a".to_vec(),
        b"{a}".to_vec(),
        b"x{a}y".to_vec(),
        b"}{".to_vec(),
        big.into_bytes(),
        b"tab\there".to_vec(),
        vec![b'o', 0xff, b'x'],
    ];
    for id in &ids {
        assert_eq!(
            burst(&t, &[("x-api-key", id.clone())], 7),
            (5, 2),
            "id of {} bytes",
            id.len()
        );
    }
    let cluster = t.cluster.as_ref().unwrap();
    let mut keys = Vec::new();
    for node in cluster.nodes().into_iter().filter(|n| n.master) {
        keys.extend(
            cluster
                .cli(node.port, &["--scan", "--pattern", "ml:*"])
                .lines()
                .map(String::from),
        );
    }
    assert_eq!(keys.len(), 2 * ids.len(), "two counters per id: {keys:?}");
    // Both keys of one call (one subject) are in one slot.
    let mut by_tag = std::collections::BTreeMap::<String, Vec<u16>>::new();
    for k in &keys {
        let tag = k[k.find('{').unwrap() + 1..k.find('}').unwrap()].to_string();
        by_tag.entry(tag).or_default().push(cluster.keyslot(k));
    }
    assert_eq!(by_tag.len(), ids.len());
    for (tag, slots) in by_tag {
        assert!(slots.windows(2).all(|w| w[0] == w[1]), "{tag}: {slots:?}");
    }
    assert_no_vm_panics(&t);
}

/// Sends requests for `id` until `stop`; counts statuses.
fn traffic(t: &Topology, id: &str, stop: &AtomicBool, ok: &AtomicUsize, bad: &AtomicUsize) {
    let mut conn = meshlimit_testbed::http::Conn::new(&t.entry());
    while !stop.load(Ordering::Relaxed) {
        match conn.get("/api/x", &[("x-api-key", id.as_bytes())]) {
            Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::Relaxed),
            Ok(r) if r.status == 429 => 0,
            _ => bad.fetch_add(1, Ordering::Relaxed),
        };
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_killed_master_is_replaced_and_limiting_turns_global_again() {
    // Leases off: every request checks, so checks cross the gap. A hot
    // client's lease (2 s of its pace) can outlast the failover, and the
    // run then has no failed check for the fallback to bridge (seen: 0
    // fallback decisions in CI, 1 to 21 in three runs by hand).
    let t = cluster_topology_with(
        meshlimit_testbed::plugin::PluginConfig::new()
            .limits(json!([{"name": "per-minute", "requests": 1000000, "window": "60s"}]))
            .set("leases", json!({"enabled": false}))
            .build(),
    );
    let (id, slot, port) = clients_on_different_masters(&t, 1).remove(0);
    let (stop, ok, bad) = (
        AtomicBool::new(false),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    let gap = std::thread::scope(|s| {
        s.spawn(|| traffic(&t, &id, &stop, &ok, &bad));
        std::thread::sleep(Duration::from_millis(500));
        let killed = Instant::now();
        t.cluster.as_ref().unwrap().kill(port);
        // The gap: until the slot has a new master and checks are global again.
        let mut calm = 0;
        let mut last = t.fallback_decisions();
        while calm < 10 && killed.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(100));
            let now = t.fallback_decisions();
            calm = if now == last && last > 0 { calm + 1 } else { 0 };
            last = now;
        }
        let gap = killed
            .elapsed()
            .saturating_sub(Duration::from_millis(1_000));
        stop.store(true, Ordering::Relaxed);
        gap
    });
    let cluster = t.cluster.as_ref().unwrap();
    let new_master = cluster.master_of(slot).map(|n| n.port);
    eprintln!(
        "master {port} of slot {slot} killed; new master {new_master:?}; fallback decisions {}; gap about {} ms",
        t.fallback_decisions(),
        gap.as_millis()
    );
    assert_eq!(
        bad.load(Ordering::Relaxed),
        0,
        "no 5xx or errors during the failover"
    );
    assert!(
        new_master.is_some_and(|p| p != port),
        "a replica took over the slot"
    );
    assert!(
        t.fallback_decisions() > 0,
        "the gap was bridged by local decisions"
    );
    assert!(gap < Duration::from_secs(20), "global again after {gap:?}");
    // Global again: a fresh client on the same slot's new master is exact.
    wait_for_global_decisions(&t, Duration::from_secs(10));
    let before = t.globally_allowed();
    assert_eq!(burst(&t, &key(&id), 10).0, 10);
    assert_eq!(t.globally_allowed() - before, 10);
}

#[test]
fn a_leased_client_rides_a_killed_master_and_is_leased_again() {
    // Leases on, the default. While the slot has no master, the hot
    // client's requests come from the lease each replica holds, then (a
    // renewal failing) from the fallback; none of them is an error. Once a
    // replica has taken over, each replica's breaker closes on a probe and
    // a renewal reaches the new master: the client is leased again, its
    // requests come from leases, none from the fallback.
    let t = cluster_topology(json!([{"name": "per-minute", "requests": 1000000, "window": "60s"}]));
    let (id, slot, port) = clients_on_different_masters(&t, 1).remove(0);
    let (stop, ok, bad) = (
        AtomicBool::new(false),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    let grants = |i: usize| t.stat(i, "meshlimit.lease_grants");
    let cluster = t.cluster.as_ref().unwrap();
    std::thread::scope(|s| {
        s.spawn(|| traffic(&t, &id, &stop, &ok, &bad));
        let leased = eventually(Duration::from_secs(10), || t.lease_hits() > 20);
        let killed = Instant::now();
        if leased {
            cluster.kill(port);
        }
        let replaced = leased
            && eventually(Duration::from_secs(30), || {
                cluster.master_of(slot).is_some_and(|n| n.port != port)
            });
        // A grant counted once the new master is known was answered by it.
        let granted_before = [grants(1), grants(2)];
        let leased_again = replaced
            && eventually(Duration::from_secs(20), || {
                grants(1) > granted_before[0] && grants(2) > granted_before[1]
            });
        let (hits, fell_back) = (t.lease_hits(), t.fallback_decisions());
        std::thread::sleep(Duration::from_secs(1));
        let (hits_after, fell_back_after) = (t.lease_hits(), t.fallback_decisions());
        stop.store(true, Ordering::Relaxed);
        eprintln!(
            "master {port} of slot {slot} killed; replaced {replaced}, leased again {leased_again} \
             after about {} ms; fallback decisions {fell_back}; lease hits {hits} then {hits_after}",
            killed.elapsed().as_millis()
        );
        assert!(leased, "the hot client was leased before the kill");
        assert!(replaced, "a replica took over the slot");
        assert!(
            leased_again,
            "each replica was granted a lease by the new master"
        );
        assert!(hits_after > hits, "requests come from the new leases");
        assert_eq!(
            fell_back_after, fell_back,
            "none from the fallback once leased again"
        );
    });
    assert_eq!(
        bad.load(Ordering::Relaxed),
        0,
        "no 5xx or errors during the failover"
    );
    assert_no_vm_panics(&t);
}

#[test]
fn moving_a_clients_slot_under_traffic_keeps_its_count() {
    let t = cluster_topology(json!([{"name": "per-hour", "requests": 100000, "window": "1h"}]));
    let id = "mover";
    let key_name = {
        let tag = meshlimitd::keys::subject_tag(&format!("hdr:x-api-key:{id}"));
        format!("ml:{{{tag}}}:api/per-hour:fw:3600000")
    };
    let cluster = t.cluster.as_ref().unwrap();
    let slot = cluster.keyslot(&key_name);
    let (stop, ok, bad) = (
        AtomicBool::new(false),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    std::thread::scope(|s| {
        s.spawn(|| traffic(&t, id, &stop, &ok, &bad));
        std::thread::sleep(Duration::from_millis(500));
        let src = cluster.master_of(slot).unwrap();
        let dst = cluster
            .nodes()
            .into_iter()
            .find(|n| n.master && n.port != src.port)
            .unwrap();
        let host = cluster.host.clone();
        let slot_s = slot.to_string();
        // The documented migration: IMPORTING, MIGRATING, MIGRATE the keys,
        // then hand the slot to its new owner everywhere.
        cluster.cli(
            dst.port,
            &["cluster", "setslot", &slot_s, "importing", &src.id],
        );
        cluster.cli(
            src.port,
            &["cluster", "setslot", &slot_s, "migrating", &dst.id],
        );
        std::thread::sleep(Duration::from_millis(200));
        let dst_port = dst.port.to_string();
        for _ in 0..50 {
            let listed = cluster.cli(src.port, &["cluster", "getkeysinslot", &slot_s, "100"]);
            let keys: Vec<&str> = listed.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            // MIGRATE host port "" db timeout KEYS k...
            let mut args = vec![
                "migrate",
                host.as_str(),
                dst_port.as_str(),
                "",
                "0",
                "5000",
                "KEYS",
            ];
            args.extend(keys.iter().copied());
            let answer = cluster.cli(src.port, &args);
            assert!(
                answer.contains("OK") || answer.contains("NOKEY"),
                "MIGRATE: {answer}"
            );
        }
        for node in cluster.nodes().into_iter().filter(|n| n.master) {
            cluster.cli(node.port, &["cluster", "setslot", &slot_s, "node", &dst.id]);
        }
        std::thread::sleep(Duration::from_millis(700));
        stop.store(true, Ordering::Relaxed);
        assert_eq!(
            cluster.master_of(slot).map(|n| n.port),
            Some(dst.port),
            "the slot moved"
        );
    });
    assert_eq!(bad.load(Ordering::Relaxed), 0, "no 5xx during the move");
    let allowed = ok.load(Ordering::Relaxed) as u64;
    let local = t.stat_total("meshlimit.fallback_allowed");
    let counted = || -> u64 {
        cluster
            .cli(cluster.master_of(slot).unwrap().port, &["get", &key_name])
            .trim()
            .parse()
            .unwrap_or(0)
    };
    // Units leased and not used are given back once the client is idle
    // (an interval, then a tick); until then Redis counts them too.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while counted() + local != allowed && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let counted = counted();
    eprintln!("slot {slot} moved under traffic: {allowed} admitted, {counted} counted in Redis, {local} decided by fallback");
    // Exact apart from the requests decided locally during the move.
    assert_eq!(counted + local, allowed);
}

/// A 3-master, 3-replica Redis Cluster, two Envoy replicas, group commit
/// on. Traffic comes only from clients whose counters live on two of the
/// masters; the third master is killed. Only checks whose slots live on a
/// dead node may fall back: a batch used to fail as a whole when any of
/// its script runs failed, and checks already charged on a healthy node
/// were then charged again locally (1,378 fallback decisions for clients
/// whose masters never failed).
///
/// The filter waits 250 ms for an answer here, not the default 20 ms: what
/// a dead node could do to the others lasts its failover (seconds), while
/// two fresh-clone `make test` runs failed this test on a host stall of
/// some 20 ms as the master was killed (2 and 4 fallbacks; reproduced with
/// the disk kept busy: runs on both live masters timed out together, and
/// every later run was answered). A host that slow fails the default
/// deadline whatever Redis does.
#[test]
fn a_dead_node_moves_no_other_nodes_clients_into_fallback() {
    let t = cluster_topology_with(
        meshlimit_testbed::plugin::PluginConfig::new()
            .set("service", json!({"timeout": "250ms"}))
            .limits(json!([{"name": "per-minute", "requests": 1000000, "window": "60s"}]))
            .build(),
    );
    let cluster = t.cluster.as_ref().unwrap();
    let victim = clients_on_different_masters(&t, 3).remove(2).2;
    let survivors: Vec<String> = (0..400)
        .map(|i| format!("survivor-{i}"))
        .filter(|id| {
            cluster
                .master_of(cluster.keyslot(&counter_key(id)))
                .map(|n| n.port)
                != Some(victim)
        })
        .take(24)
        .collect();
    assert_eq!(survivors.len(), 24);
    // Every survivor decided globally once before the kill.
    for id in &survivors {
        assert_eq!(send(&t, &key(id)).status, 200);
    }
    assert_eq!(t.fallback_decisions(), 0);
    let (stop, ok, bad) = (
        AtomicBool::new(false),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    std::thread::scope(|s| {
        for ids in survivors.chunks(3) {
            let (t, stop, ok, bad) = (&t, &stop, &ok, &bad);
            s.spawn(move || {
                let mut conn = meshlimit_testbed::http::Conn::new(&t.entry());
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let id = &ids[n % ids.len()];
                    n += 1;
                    match conn.get("/api/x", &[("x-api-key", id.as_bytes())]) {
                        Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::Relaxed),
                        _ => bad.fetch_add(1, Ordering::Relaxed),
                    };
                }
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        cluster.kill(victim);
        // Through the failover (about 3 s) and after.
        std::thread::sleep(Duration::from_secs(6));
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!(
        "master {victim} killed; {} requests from clients on the other masters, {} fallback decisions; failed calls by kind: {}",
        ok.load(Ordering::Relaxed),
        t.fallback_decisions(),
        ["timeout", "connection", "unavailable", "bad_status", "bad_body"]
            .map(|kind| format!(
                "{kind} {}",
                t.stat_total(&format!("meshlimit.service_errors.{kind}"))
            ))
            .join(", ")
    );
    // meshlimitd's side of any failed call: Redis errors and its answers.
    let metrics = meshlimit_testbed::http::get(&t.meshlimitd_addr(), "/metrics", &[]).unwrap();
    for line in metrics.body.lines().filter(|l| {
        (l.starts_with("meshlimitd_redis_errors") || l.starts_with("meshlimitd_check_responses"))
            && !l.ends_with(" 0")
    }) {
        eprintln!("  {line}");
    }
    assert_eq!(bad.load(Ordering::Relaxed), 0, "no errors, no 429");
    assert!(ok.load(Ordering::Relaxed) > 1_000, "traffic flowed");
    assert_eq!(
        t.fallback_decisions(),
        0,
        "no check of a live node fell back"
    );
    assert_no_vm_panics(&t);
}

/// A cluster left at Redis' default `cluster-require-full-coverage yes`
/// refuses every command while any master is down (1,630 of 18,027
/// decisions of clients on live masters fell back in a measured run):
/// meshlimitd says so in `/readyz` (still ready: the cluster answers) and
/// in a gauge, naming the masters, instead of only docs/operators.md.
#[test]
fn a_cluster_requiring_full_coverage_is_reported_in_readyz_and_a_gauge() {
    let t = Topology::start(TopologyOptions {
        plugin_config: rule_config(json!({}), per_minute()),
        redis_cluster: true,
        replicas: 0,
        front: false,
        ..TopologyOptions::default()
    });
    let ready = || meshlimit_testbed::http::get(&t.meshlimitd_addr(), "/readyz", &[]).unwrap();
    let r = ready();
    assert_eq!(
        (r.status, r.body.as_str()),
        (200, "ready\n"),
        "set to no by the testbed"
    );
    let cluster = t.cluster.as_ref().unwrap();
    let master = cluster.master_of(0).expect("slot 0 has a master");
    cluster.cli(
        master.port,
        &["CONFIG", "SET", "cluster-require-full-coverage", "yes"],
    );
    let r = ready();
    assert_eq!(r.status, 200, "still ready: {}", r.body);
    assert!(
        r.body.contains("cluster-require-full-coverage yes")
            && r.body.contains(&format!(":{}", master.port)),
        "{}",
        r.body
    );
    let metrics = meshlimit_testbed::http::get(&t.meshlimitd_addr(), "/metrics", &[]).unwrap();
    assert!(
        metrics
            .body
            .contains("meshlimitd_redis_cluster_full_coverage_required 1"),
        "{}",
        metrics.body
    );
}
