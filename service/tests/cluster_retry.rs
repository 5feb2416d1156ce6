//! Issue 35, item 8: may the Cluster backend run a script twice? It did.
//! A script run on its master's own connection that got no answer in time
//! (the master busy) was sent again through redis-rs' cluster connection,
//! and once the master was free it ran both: one check, charged twice. A
//! run whose answer is lost may have run; only a refusal Redis gives
//! before running a script (a redirect, a slot in transition, a replica,
//! a node loading) goes through the cluster connection now.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use meshlimit_testbed::procs::TempDir;
use meshlimit_testbed::services::{unique_host, RedisCluster};
use meshlimitd::backend::{Backend, Mode, Options};
use meshlimitd::keys;

/// A script that keeps its node busy for about `ms` milliseconds.
fn busy(ms: u64) -> String {
    format!(
        "local function now() local t = redis.call('TIME') return t[1] * 1000000 + t[2] end \
         local start = now() repeat until now() - start > {} return 1",
        ms * 1000
    )
}

/// meshlimitd's backend for `cluster`, waiting 50 ms for an answer.
fn cluster_backend(cluster: &RedisCluster) -> Backend {
    Backend::new(&Options {
        mode: Mode::Cluster,
        urls: cluster.seeds().split(',').map(String::from).collect(),
        sentinel_master: None,
        ca_pem: None,
        client_pem: None,
        timeout: Duration::from_millis(50),
        response_timeout: Duration::from_millis(50),
    })
    .unwrap()
}

#[test]
fn a_script_whose_answer_was_lost_is_not_run_again() {
    let dir = TempDir::new("cluster-retry");
    let cluster = RedisCluster::start(&unique_host(), dir.path(), 3);
    let backend = cluster_backend(&cluster);
    let tag = "retry";
    let slot = keys::tag_slot(tag);
    let key = format!("{{{tag}}}:n");
    let script = redis::Script::new("return redis.call('INCR', KEYS[1])");
    let mut invocation = script.prepare_invoke();
    invocation.key(&key);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // Once, to have the master's own connection and the script loaded,
    // and redis-rs' cluster connection up (as it is once meshlimitd has
    // run a while).
    // The first run reads the slot map; the second opens the master's own
    // connection.
    for n in 1..=3 {
        let count: i64 = runtime.block_on(backend.invoke(slot, &invocation)).unwrap();
        assert_eq!(count, n);
    }
    let master = cluster.master_of(slot).unwrap().port;
    std::thread::scope(|s| {
        s.spawn(|| cluster.cli(master, &["EVAL", &busy(600), "0"]));
        std::thread::sleep(Duration::from_millis(100));
        // The master is busy: no answer within 50 ms.
        let lost: Result<i64, _> = runtime.block_on(backend.invoke(slot, &invocation));
        assert!(lost.is_err(), "{lost:?}");
    });
    // The busy script is over; whatever was sent has run.
    std::thread::sleep(Duration::from_millis(300));
    let count = cluster.cli(master, &["GET", &key]);
    assert_eq!(count.trim(), "4", "one check ran once, not twice");
}

/// A live master that answers one run late while another master is being
/// failed over (busy, or its host stalled: a fresh-clone `make test` saw
/// runs on two live masters time out together as a master was killed)
/// fails that run alone: the ones after it are answered, through the
/// failover. And redis-rs reports the late answer as an I/O error of kind
/// `TimedOut`, which meshlimitd's `redis_errors` must count as a timeout,
/// not as a lost connection (see `LimiterError::kind`).
#[test]
fn a_live_master_late_during_a_failover_fails_that_run_alone() {
    let dir = TempDir::new("cluster-late");
    let cluster = RedisCluster::start(&unique_host(), dir.path(), 3);
    let backend = cluster_backend(&cluster);
    let script = redis::Script::new("return redis.call('INCR', KEYS[1])");
    let on = |tag: &str| {
        let mut invocation = script.prepare_invoke();
        invocation.key(format!("{{{tag}}}:n"));
        (keys::tag_slot(tag), invocation)
    };
    // Two tags on different masters: the live one, and the one killed.
    let live = "live";
    let live_master = cluster.master_of(keys::tag_slot(live)).unwrap().port;
    let dead = (0..)
        .map(|i| format!("dead-{i}"))
        .find(|t| cluster.master_of(keys::tag_slot(t)).unwrap().port != live_master)
        .unwrap();
    let dead_master = cluster.master_of(keys::tag_slot(&dead)).unwrap().port;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let run = |tag: &str| -> Result<i64, redis::RedisError> {
        let (slot, invocation) = on(tag);
        runtime.block_on(backend.invoke(slot, &invocation))
    };
    for _ in 0..3 {
        run(live).unwrap();
        run(&dead).unwrap();
    }
    // A master dies: its runs fail, and redis-rs' cluster connection, which
    // the dead node's runs go through, repairs in the background until the
    // failover is over (seconds).
    cluster.kill(dead_master);
    for _ in 0..3 {
        assert!(run(&dead).is_err());
    }
    // Meanwhile the live master is busy for 150 ms: one run is late.
    std::thread::scope(|s| {
        s.spawn(|| cluster.cli(live_master, &["EVAL", &busy(150), "0"]));
        std::thread::sleep(Duration::from_millis(50));
        let late = run(live).expect_err("no answer within 50 ms");
        assert!(late.is_timeout(), "{late:?}");
    });
    std::thread::sleep(Duration::from_millis(100));
    // Free again: every run for it is answered, through the failover.
    let failed: Vec<String> = (0..40)
        .filter_map(|_| {
            std::thread::sleep(Duration::from_millis(25));
            run(live).err().map(|e| e.to_string())
        })
        .collect();
    assert_eq!(failed, Vec::<String>::new(), "runs for the live master");
}
