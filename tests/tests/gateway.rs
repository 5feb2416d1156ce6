//! meshlimit on a gateway behind a load balancer, over a real network hop:
//! the balancer (a front Envoy) runs in a network namespace of the test's
//! own, connected to this host by a veth pair, because on loopback Envoy
//! writes its own address in place of a loopback peer's in
//! `x-forwarded-for` and the hops cannot be told apart. Needs root (as CI
//! runs): it fails with a message saying so otherwise.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use meshlimit_testbed::http;
use meshlimit_testbed::procs::Proc;
use meshlimit_testbed::render::{render, template};
use meshlimit_testbed::tools;
use meshlimit_testbed::topology::FRONT_PORT;
use meshlimit_testbed::{Topology, TopologyOptions};

/// A network namespace joined to this host by a veth pair: this side
/// `10.213.<n>.1`, the namespace's side `10.213.<n>.2`. Deleted (with the
/// pair) on drop.
struct Netns {
    name: String,
    host_ip: String,
    inner_ip: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `ip` (iproute2): {e}"));
    assert!(
        out.status.success(),
        "`ip {}` failed (this test creates a network namespace and needs root): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Netns {
    fn create() -> Netns {
        let n = 1 + std::process::id() % 250;
        let name = format!("mlgw{n}");
        let (outer, inner) = (format!("mlgw{n}a"), format!("mlgw{n}b"));
        // A namespace left by a crashed run of the same pid.
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        let ns = Netns {
            host_ip: format!("10.213.{n}.1"),
            inner_ip: format!("10.213.{n}.2"),
            name,
        };
        ip(&[
            "link", "add", &outer, "type", "veth", "peer", "name", &inner,
        ]);
        ip(&["link", "set", &inner, "netns", &ns.name]);
        ip(&["addr", "add", &format!("{}/24", ns.host_ip), "dev", &outer]);
        ip(&["link", "set", &outer, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns.name, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&["addr", "add", &format!("{}/24", ns.inner_ip), "dev", &inner]);
        inside(&["link", "set", &inner, "up"]);
        inside(&["link", "set", "lo", "up"]);
        ns
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// An Istio gateway runs with `use_remote_address: true`: Envoy appends
/// its peer to `x-forwarded-for` before the filter runs. Behind one L7
/// load balancer (which appends the client) the client is then the second
/// entry from the right: `trusted_hops: 2`, as the README and the gateway
/// example in deploy/istio say. The old advice, 1, counted every client as
/// the load balancer.
#[test]
fn on_a_gateway_behind_a_balancer_the_client_is_two_hops_from_the_right() {
    let t = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        ..TopologyOptions::default()
    });
    let ns = Netns::create();
    let gateway_port = FRONT_PORT + 1;
    let config = keyed("local")
        .client_id(json!({"when_missing": "client_address", "trusted_hops": 2}))
        .limits(json!([{"name": "per-minute", "requests": 3, "window": "60s"}]))
        .build();
    // The gateway: listens on this host's side of the veth pair.
    let gateway = t
        .replica_config_with(1, &config)
        .replace("use_remote_address: false", "use_remote_address: true")
        .replace(
            &format!("address: {}, port_value: {gateway_port}", t.host),
            &format!("address: {}, port_value: {gateway_port}", ns.host_ip),
        );
    assert!(gateway.contains(&ns.host_ip) && gateway.contains("use_remote_address: true"));
    let mut gateway = t.start_envoy("replica-1", &gateway, 1);
    // Before then its calls fail and the fallback decides, counting
    // nothing in Redis (seen on a fresh machine's first run).
    t.wait_sees_meshlimitd(1, &mut gateway);
    // The balancer, in the namespace, in front of the gateway.
    let mut vars = t.base_vars(19_950, FRONT_PORT);
    vars.insert("ADMIN_HOST", ns.inner_ip.clone());
    vars.insert("LISTEN_HOST", ns.inner_ip.clone());
    vars.insert("REPLICA_DISCOVERY", "STATIC".into());
    for (host, port) in [
        ("REPLICA_1_HOST", "REPLICA_1_PORT"),
        ("REPLICA_2_HOST", "REPLICA_2_PORT"),
    ] {
        vars.insert(host, ns.host_ip.clone());
        vars.insert(port, gateway_port.to_string());
    }
    let balancer_config = t.dir.path().join("balancer.yaml");
    std::fs::write(&balancer_config, render(&template("front.yaml"), &vars)).unwrap();
    let mut balancer = Proc::spawn(
        "balancer",
        Command::new("ip")
            .args(["netns", "exec", &ns.name])
            .arg(tools::envoy())
            .arg("-c")
            .arg(&balancer_config)
            .args(["--disable-hot-restart", "--concurrency", "1"]),
        t.dir.path(),
    );
    let admin = format!("{}:19950", ns.inner_ip);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http::get(&admin, "/ready", &[]).is_ok_and(|r| r.status == 200) {
        assert!(
            balancer.alive(),
            "the balancer exited: {}",
            balancer.output()
        );
        assert!(Instant::now() < deadline, "the balancer never got ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_for_fresh_window(Duration::from_secs(10));
    let entry = format!("{}:{FRONT_PORT}", ns.inner_ip);
    let forged: &[(&str, &[u8])] = &[("x-forwarded-for", b"6.6.6.6")];
    let statuses: Vec<u16> = (0..5)
        .map(|_| http::get(&entry, "/api/x", forged).unwrap().status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429], "one client, limited");
    // By meshlimitd: the fallback's share of 3 gives the same statuses,
    // but counts nothing in Redis.
    assert_eq!(
        t.stat(1, "meshlimit.fallback_allowed"),
        0,
        "decided by the fallback"
    );
    // Counted as the client the balancer saw (this host's side of the
    // pair), not as the balancer, nor as what the client wrote itself.
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(keys.contains(&format!("ip:{}}}", ns.host_ip)), "{keys}");
    assert!(
        !keys.contains("6.6.6.6") && !keys.contains(&format!("ip:{}}}", ns.inner_ip)),
        "{keys}"
    );
    drop(balancer);
}
