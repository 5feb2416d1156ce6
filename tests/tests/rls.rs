//! meshlimitd as Envoy's rate limit service: real Envoys with their native
//! `ratelimit` filter (envoy/native-ratelimit.yaml) asking meshlimitd over
//! gRPC, with envoyproxy/ratelimit's configuration format, on real Redis.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[allow(unused_imports)]
mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use meshlimit_testbed::procs::{Proc, TempDir};
use meshlimit_testbed::render::{render, template};
use meshlimit_testbed::topology::{GRPC_PORT, UPSTREAM_PORT};
use meshlimit_testbed::{Topology, TopologyOptions};

const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 20, name: per-user }
  - key: vip
    rate_limit: { unit: minute, requests_per_unit: 25, replaces: [{ name: per-user }] }
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: to_number
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: path
    value: /p/wild/*
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: path
    value: /p/free*
    rate_limit: { unlimited: true }
  - key: path
    value: /p/shadow*
    shadow_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: path
    value: /p/yearly
    rate_limit: { unit: year, requests_per_unit: 2 }
  - key: generic_key
    value: api
    rate_limit: { unit: minute, requests_per_unit: 100000 }
  - key: remote_address
    rate_limit: { unit: minute, requests_per_unit: 100000 }
  - key: header_match
    value: admin
    rate_limit: { unit: minute, requests_per_unit: 3 }
"#;

/// Redis, meshlimitd with `--grpc-listen` on the configuration in
/// `config_dir`, the upstream, and `replicas` Envoys with the native
/// filter (`failure_mode_deny` as given).
struct Native {
    t: Topology,
    envoys: Vec<Proc>,
}

fn start(config_dir: &Path, replicas: usize, failure_mode_deny: bool) -> Native {
    let t = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        rls_config_dir: Some(config_dir.to_path_buf()),
        ..TopologyOptions::default()
    });
    let envoys = (1..=replicas)
        .map(|i| {
            let mut vars = t.base_vars(19_900 + i as u16, 10_000 + i as u16);
            vars.extend([
                ("REPLICA_NAME", format!("replica-{i}")),
                ("RLS_HOST", t.host.clone()),
                ("RLS_PORT", GRPC_PORT.to_string()),
                ("UPSTREAM_HOST", t.host.clone()),
                ("UPSTREAM_PORT", UPSTREAM_PORT.to_string()),
                ("FAILURE_MODE_DENY", failure_mode_deny.to_string()),
            ]);
            let config = render(&template("native-ratelimit.yaml"), &vars);
            t.start_envoy(&format!("replica-{i}"), &config, 2)
        })
        .collect();
    Native { t, envoys }
}

fn config_dir(yaml: &str) -> TempDir {
    let dir = TempDir::new("rls-config");
    std::fs::write(dir.path().join("edge.yaml"), yaml).unwrap();
    dir
}

impl Native {
    fn get(&self, replica: usize, path: &str, headers: &[(&str, &[u8])]) -> u16 {
        meshlimit_testbed::http::get(&self.t.replica_addr(replica), path, headers)
            .map_or(0, |r| r.status)
    }
}

/// Route actions (`request_headers`, `generic_key`, `remote_address`,
/// `header_value_match`) through two Envoys with 64 concurrent
/// connections: exactly the configured 20 allowed for one user in total.
/// A request also matching the `admin` header descriptor is held to its 3,
/// and its denials charge nothing else.
#[test]
fn the_native_filter_gets_exact_global_decisions_over_grpc() {
    let dir = config_dir(CONFIG);
    let n = start(dir.path(), 2, false);
    wait_for_fresh_window(Duration::from_secs(20));
    let allowed: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let n = &n;
                s.spawn(move || {
                    (0..2)
                        .filter(|_| n.get(1 + i % 2, "/api", &[("x-user", b"alice")]) == 200)
                        .count()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(allowed, 20, "exactly the limit, across both Envoys");
    let admin: Vec<u16> = (0..5)
        .map(|_| n.get(1, "/api", &[("x-user", b"bob"), ("x-admin", b"yes")]))
        .collect();
    assert_eq!(admin, [200, 200, 200, 429, 429]);
    // bob's two denied requests were not counted on his user limit: 17
    // more of his plain requests pass, not 15.
    let plain = (0..20)
        .filter(|_| n.get(2, "/api", &[("x-user", b"bob")]) == 200)
        .count();
    assert_eq!(
        plain, 17,
        "all or nothing: a denied request charges no descriptor"
    );
    drop(n.envoys);
}

/// The format's descriptors as envoyproxy/ratelimit documents them:
/// nested descriptors, a key without a value (a counter per value), a
/// wildcard value, `unlimited`, `shadow_mode` and `replaces`.
#[test]
fn descriptors_behave_as_the_format_documents() {
    let dir = config_dir(CONFIG);
    let n = start(dir.path(), 1, false);
    wait_for_fresh_window(Duration::from_secs(15));
    let nested = |kind: Option<&[u8]>, to: &[u8]| {
        let mut h: Vec<(&str, &[u8])> = vec![("x-to", to)];
        if let Some(k) = kind {
            h.push(("x-type", k));
        }
        n.get(1, "/nested", &h)
    };
    let marketing: Vec<u16> = (0..3).map(|_| nested(Some(b"marketing"), b"111")).collect();
    assert_eq!(marketing, [200, 200, 429], "2 marketing messages a number");
    assert_eq!(
        nested(Some(b"marketing"), b"222"),
        200,
        "another number, another counter"
    );
    let plain: Vec<u16> = (0..4).map(|_| nested(None, b"111")).collect();
    assert_eq!(
        plain,
        [200, 200, 200, 429],
        "5 to a number in all: 2 marketing + 3"
    );
    let path = |p: &str| n.get(1, p, &[]);
    assert_eq!(
        [path("/p/wild/a"), path("/p/wild/a")],
        [200, 429],
        "a wildcard value"
    );
    assert_eq!(path("/p/wild/b"), 200, "a counter per value it matches");
    assert!((0..5).all(|_| path("/p/free/x") == 200), "unlimited");
    assert!(
        (0..5).all(|_| path("/p/shadow/x") == 200),
        "shadow mode never denies"
    );
    let metrics = meshlimit_testbed::http::get(&n.t.meshlimitd_addr(), "/metrics", &[]).unwrap();
    assert!(
        metrics
            .body
            .contains("meshlimitd_rls_shadow_over_limit_total 4"),
        "4 of the 5 were over, in shadow: {}",
        metrics.body
    );
    // The same under envoyproxy/ratelimit's names, for its dashboards.
    for line in [
        r#"ratelimit_service_rate_limit_shadow_mode{domain="edge",key1="path_/p/shadow*",key2=""} 4"#,
        r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="message_type_marketing",key2="to_number"} 1"#,
        r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="path_/p/shadow*",key2=""} 5"#,
    ] {
        assert!(
            metrics.body.contains(line),
            "{line} missing from {}",
            metrics.body
        );
    }
    let vip = (0..30)
        .filter(|_| n.get(1, "/api", &[("x-user", b"ivy"), ("x-vip", b"gold")]) == 200)
        .count();
    assert_eq!(vip, 25, "the vip limit replaces the per-user one");
}

/// `enable_x_ratelimit_headers: DRAFT_VERSION_03`: Envoy writes the
/// headers from meshlimitd's per-descriptor answer.
#[test]
fn envoy_writes_the_draft_headers_from_the_answer() {
    let dir = config_dir(CONFIG);
    let n = start(dir.path(), 1, false);
    wait_for_fresh_window(Duration::from_secs(10));
    let r = meshlimit_testbed::http::get(&n.t.replica_addr(1), "/api", &[("x-user", b"carol")])
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-limit")
            .map(|v| v.split(',').next().unwrap_or("").trim()),
        Some("20"),
        "{:?}",
        r.headers
    );
    assert_eq!(r.header("x-ratelimit-remaining"), Some("19"));
    let reset: u64 = r.header("x-ratelimit-reset").unwrap().parse().unwrap();
    assert!((1..=60).contains(&reset), "{reset}");
}

/// `hits_addend` from a request header, through the route's action, and
/// `hits_addend: 0`.
#[test]
fn hits_come_from_the_request() {
    let dir = config_dir(CONFIG);
    let n = start(dir.path(), 1, false);
    wait_for_fresh_window(Duration::from_secs(10));
    let statuses: Vec<u16> = (0..5)
        .map(|_| n.get(1, "/hits", &[("x-user", b"dave"), ("x-hits", b"6")]))
        .collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429],
        "3 x 6 = 18 of 20; 24 would pass it"
    );
    assert_eq!(
        n.get(1, "/hits", &[("x-user", b"dave"), ("x-hits", b"2")]),
        200
    );
}

/// A changed file applies within a second or two, under traffic, with no
/// failed request; a broken one is refused and the last good one stays.
#[test]
fn configuration_reloads_and_a_broken_file_keeps_the_last_good_one() {
    let dir = config_dir(CONFIG);
    let n = start(dir.path(), 1, false);
    wait_for_fresh_window(Duration::from_secs(20));
    let user = |name: &[u8]| n.get(1, "/api", &[("x-user", name)]);
    assert_eq!(user(b"erin"), 200);
    std::fs::write(
        dir.path().join("edge.yaml"),
        CONFIG.replace("requests_per_unit: 20", "requests_per_unit: 2"),
    )
    .unwrap();
    let mut statuses = Vec::new();
    for _ in 0..40 {
        statuses.push(user(b"frank"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    assert_eq!(
        statuses
            .iter()
            .rev()
            .take(10)
            .filter(|s| **s == 200)
            .count(),
        0,
        "the new limit of 2 applies"
    );
    std::fs::write(
        dir.path().join("edge.yaml"),
        "domain: edge
descriptors:
  - key: user
    rate_limt: {}
",
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(2_500));
    let logs = n.t.logs("meshlimitd");
    assert!(
        logs.contains("edge.yaml") && logs.contains("rate_limt"),
        "the error names the file and field"
    );
    assert_eq!(user(b"gina"), 200);
    assert_eq!(user(b"gina"), 200);
    assert_eq!(user(b"gina"), 429, "the last good limit, 2, still applies");
}

/// meshlimitd stopped: `failure_mode_deny: false` lets traffic through,
/// `true` refuses it, both within the filter's timeout.
#[test]
fn an_outage_follows_the_filters_failure_mode() {
    let dir = config_dir(CONFIG);
    for deny in [false, true] {
        let mut n = start(dir.path(), 1, deny);
        n.t.stop_meshlimitd();
        let started = std::time::Instant::now();
        let status = n.get(1, "/api", &[("x-user", b"hal")]);
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(
            status,
            if deny { 500 } else { 200 },
            "failure_mode_deny {deny}"
        );
    }
}

/// With `--auth-token-file`, a gRPC call without the shared token (as
/// `authorization` metadata) is refused and counted; with it, decided.
#[test]
fn grpc_calls_need_the_shared_token_when_one_is_set() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let dir = config_dir(CONFIG);
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "a-shared-secret-of-some-length\n").unwrap();
    let t = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        rls_config_dir: Some(dir.path().to_path_buf()),
        meshlimitd_args: vec!["--auth-token-file".into(), token_file.display().to_string()],
        ..TopologyOptions::default()
    });
    let request = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: "jo".into(),
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (without, with) = runtime.block_on(async {
        let url = format!("http://{}", t.addr(GRPC_PORT));
        let mut client = RateLimitServiceClient::connect(url).await.unwrap();
        let without = client.should_rate_limit(request.clone()).await;
        let mut authorized = tonic::Request::new(request.clone());
        authorized.metadata_mut().insert(
            "authorization",
            "Bearer a-shared-secret-of-some-length".parse().unwrap(),
        );
        let with = client.should_rate_limit(authorized).await;
        (without, with)
    });
    assert_eq!(without.unwrap_err().code(), tonic::Code::Unauthenticated);
    let answer = with.unwrap().into_inner();
    assert_eq!(answer.statuses[0].limit_remaining, 19);
    let metrics = meshlimit_testbed::http::get(&t.meshlimitd_addr(), "/metrics", &[]).unwrap();
    assert!(
        metrics
            .body
            .contains("meshlimitd_rls_responses_total{kind=\"unauthenticated\"} 1"),
        "{}",
        metrics.body
    );
    assert!(
        metrics
            .body
            .contains("meshlimitd_rls_responses_total{kind=\"ok\"} 1"),
        "the decided call is counted: {}",
        metrics.body
    );
}
