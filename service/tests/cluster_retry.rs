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

#[test]
fn a_script_whose_answer_was_lost_is_not_run_again() {
    let dir = TempDir::new("cluster-retry");
    let cluster = RedisCluster::start(&unique_host(), dir.path(), 3);
    let backend = Backend::new(&Options {
        mode: Mode::Cluster,
        urls: cluster.seeds().split(',').map(String::from).collect(),
        sentinel_master: None,
        ca_pem: None,
        client_pem: None,
        timeout: Duration::from_millis(50),
    })
    .unwrap();
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
