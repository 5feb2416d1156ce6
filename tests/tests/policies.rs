//! Mesh policies end to end: rules that select requests by more than a
//! path, limits that count by request attributes, live overrides,
//! calendar windows, and identities from mTLS and verified JWTs.

mod common;

use std::time::Duration;

use common::*;
use meshlimit_testbed::{Topology, TopologyOptions};

/// Plans chosen by a header the auth layer sets: `x-plan: free` gets 5 a
/// minute, `pro` 50, no header the default 2; through two replicas, so the
/// counts are global. A client sending both plan headers gets the default:
/// a header sent twice counts as absent.
#[test]
fn plans_are_rules_selected_by_a_header() {
    let plan = |name: &str, condition: Value, requests: u64| {
        json!({"name": name, "match": {"headers": [condition]},
               "limits": [{"name": "per-minute", "requests": requests, "window": "60s"}]})
    };
    let t = topology(
        PluginConfig::new()
            .rules(json!([
                plan("free", json!({"name": "x-plan", "exact": "free"}), 5),
                plan("pro", json!({"name": "x-plan", "exact": "pro"}), 50),
                plan("default", json!({"name": "x-plan", "absent": true}), 2),
            ]))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(20));
    let with_plan = |id: &str, plans: &[&str]| {
        let mut headers = key(id);
        for p in plans {
            headers.push(("x-plan", p.as_bytes().to_vec()));
        }
        headers
    };
    assert_eq!(burst(&t, &with_plan("f", &["free"]), 8), (5, 3));
    assert_eq!(burst(&t, &with_plan("p", &["pro"]), 55), (50, 5));
    assert_eq!(burst(&t, &with_plan("n", &[]), 4), (2, 2));
    assert_eq!(
        burst(&t, &with_plan("both", &["free", "pro"]), 4),
        (2, 2),
        "both plans at once: the default's 2"
    );
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(
        keys.contains("default/per-minute") && keys.contains("pro/per-minute"),
        "{keys}"
    );
    assert_no_vm_panics(&t);
}

/// A cap for a route whatever the client, on an exact path and a host.
#[test]
fn rules_match_hosts_and_exact_paths() {
    let t = single_replica(
        PluginConfig::new()
            .rules(json!([{
                "name": "login",
                "match": {"hosts": ["*.test"], "path": {"exact": "/login"}, "methods": ["GET"]},
                "limits": [{"name": "per-minute", "requests": 3, "window": "60s"}]
            }]))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(10));
    // The test client sends `host: meshlimit.test`.
    let login = |path: &str| t.get(path, &[("x-api-key", b"c")]).status;
    let statuses: Vec<u16> = (0..4).map(|_| login("/login")).collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(login("/login/other"), 200, "not the exact path");
    assert_eq!(login("/logins"), 200);
    let other_host = http_get_with_host(&t, "other.example", "/login");
    assert_eq!(other_host, 200, "another host is not limited");
}

fn http_get_with_host(t: &meshlimit_testbed::Topology, host: &str, path: &str) -> u16 {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(t.entry()).unwrap();
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nhost: {host}\r\nx-api-key: c\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = conn.read_to_string(&mut out);
    out.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn status(t: &Topology, path: &str, headers: &[(&str, &[u8])]) -> u16 {
    t.get(path, headers).status
}

/// `by: []`: one counter for the route, whoever calls: three clients
/// through two replicas, concurrently, get exactly 30 in total.
#[test]
fn a_route_cap_counts_every_client_together() {
    let t = topology(
        PluginConfig::new()
            .limit_field("requests", json!(30))
            .limit_field("by", json!([]))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(20));
    let allowed = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for id in ["a", "b", "c"] {
            let (t, allowed) = (&t, &allowed);
            s.spawn(move || {
                for _ in 0..15 {
                    match send(t, &key(id)).status {
                        200 => {
                            allowed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        429 => {}
                        other => panic!("status {other}"),
                    }
                }
            });
        }
    });
    assert_eq!(allowed.into_inner(), 30);
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert_eq!(keys.lines().count(), 1, "one counter: {keys}");
    assert_no_vm_panics(&t);
}

/// `by: ["header:x-tenant", "path"]`: per tenant per route; a request
/// without the tenant header is not counted on that limit, and says so.
#[test]
fn limits_count_by_a_tenant_and_a_route_together() {
    let t = single_replica(
        PluginConfig::new()
            .limit_field("requests", json!(3))
            .limit_field("by", json!(["header:x-tenant", "path"]))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(10));
    let count = |tenant: Option<&[u8]>, path: &str| {
        let headers: Vec<(&str, &[u8])> = tenant.map(|v| ("x-tenant", v)).into_iter().collect();
        (0..4).filter(|_| status(&t, path, &headers) == 200).count()
    };
    assert_eq!(count(Some(b"acme"), "/a"), 3);
    assert_eq!(count(Some(b"acme"), "/b"), 3, "another route");
    assert_eq!(count(Some(b"umbrella"), "/a"), 3, "another tenant");
    assert_eq!(
        count(Some(b"acme"), "/a/../a"),
        0,
        "the same route, spelled otherwise"
    );
    assert_eq!(count(None, "/a"), 4, "no tenant: not counted");
    assert_eq!(t.stat(1, "meshlimit.skipped_missing_attribute"), 4);
    assert_no_vm_panics(&t);
}

/// A live override through meshlimitd's admin API: a client exhausted at
/// 20 gets 20 more on both replicas once it is raised to 40 (cached
/// denials end within a second); deleting it restores 20; an override
/// that expires stops applying; a wrong admin token gets 401 and changes
/// nothing.
#[test]
fn a_live_override_applies_on_every_replica() {
    let dir = meshlimit_testbed::procs::TempDir::new("admin-token");
    let token_file = dir.path().join("admin-token");
    let token = "admin-0123456789-secret";
    std::fs::write(&token_file, token).unwrap();
    let t = Topology::start(TopologyOptions {
        plugin_config: PluginConfig::new().build(),
        meshlimitd_args: vec![
            "--admin-token-file".into(),
            token_file.display().to_string(),
        ],
        ..TopologyOptions::default()
    });
    wait_for_fresh_window(Duration::from_secs(25));
    let admin = |method: &str, body: &str, token: &str| {
        let path = if method == "PUT" {
            "/v1/overrides/api/per-minute".to_string()
        } else {
            "/v1/overrides/api/per-minute?subject=hdr%3Ax-api-key%3Apartner".to_string()
        };
        let auth = format!("Bearer {token}");
        meshlimit_testbed::http::request(
            &t.meshlimitd_addr(),
            method,
            &path,
            &[("authorization", auth.as_bytes())],
            body.as_bytes(),
        )
        .unwrap()
    };
    let on = |replica: usize, n: usize| {
        (0..n)
            .filter(|_| {
                meshlimit_testbed::http::get(
                    &t.replica_addr(replica),
                    "/api",
                    &[("x-api-key", b"partner")],
                )
                .unwrap()
                .status
                    == 200
            })
            .count()
    };
    assert_eq!(burst(&t, &key("partner"), 21), (20, 1));
    let raise = r#"{"subject":"hdr:x-api-key:partner","requests":40}"#;
    let r = admin("PUT", raise, "wrong-token-0123456789");
    assert_eq!(r.status, 401);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(on(1, 1) + on(2, 1), 0, "a wrong token changed nothing");
    let r = admin("PUT", raise, token);
    assert_eq!(r.status, 200, "{}", r.body);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(on(1, 10) + on(2, 10), 20, "20 more, on both replicas");
    assert_eq!(on(1, 1) + on(2, 1), 0, "and no more");
    assert_eq!(admin("DELETE", "", token).status, 204);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(on(1, 1) + on(2, 1), 0, "back to 20");
    let brief = r#"{"subject":"hdr:x-api-key:partner","requests":41,"ttl_seconds":2}"#;
    assert_eq!(admin("PUT", brief, token).status, 200);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(on(1, 1), 1, "the 41st");
    std::thread::sleep(Duration::from_millis(2_000));
    let r = admin("GET", "", token);
    assert_eq!(r.status, 404, "expired: {}", r.body);
    assert_eq!(on(2, 2), 0);
    assert_no_vm_panics(&t);
}

/// A monthly quota at +02:00, a minute before a leap-day month end (the
/// script's clock shifted by meshlimitd's test hook): the deny's
/// Retry-After and RateLimit count to the real reset, and one second after
/// it the quota is whole, for March's 31 days.
#[test]
fn a_calendar_month_resets_at_the_real_month_end() {
    let t = Topology::start(TopologyOptions {
        plugin_config: PluginConfig::new()
            .limits(json!([{"name": "monthly", "requests": 3, "calendar": "month", "utc_offset": "+02:00"}]))
            .build(),
        replicas: 1,
        front: false,
        meshlimitd_args: vec!["--test-clock-offset-key".into(), "ml:test:clock".into()],
        ..TopologyOptions::default()
    });
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    // 2028-02-29T23:59:30+02:00: 30 s before March starts at +02:00.
    let feb_end_minus_30s: i64 = 1_835_474_370_000;
    let set_clock = |at: i64| {
        t.redis_cli(&["SET", "ml:test:clock", &(at - now_ms()).to_string()]);
    };
    set_clock(feb_end_minus_30s);
    let statuses: Vec<u16> = (0..3).map(|_| send(&t, &key("m")).status).collect();
    assert_eq!(statuses, [200, 200, 200]);
    let denied = send(&t, &key("m"));
    assert_eq!(denied.status, 429);
    let retry: i64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!((29..=31).contains(&retry), "retry-after {retry}");
    let ratelimit = denied.header("ratelimit").unwrap();
    let t_secs: i64 = ratelimit.rsplit("t=").next().unwrap().parse().unwrap();
    assert!(
        ratelimit.starts_with("\"api/monthly\";r=0;") && (29..=31).contains(&t_secs),
        "{ratelimit}"
    );
    set_clock(feb_end_minus_30s + 31_000);
    // A cached deny is trusted for a second.
    std::thread::sleep(Duration::from_millis(1_100));
    let march = send(&t, &key("m"));
    assert_eq!(march.status, 200);
    let ratelimit = march.header("ratelimit").unwrap();
    let t_secs: i64 = ratelimit.rsplit("t=").next().unwrap().parse().unwrap();
    let march_secs = 31 * 86_400 - 1;
    assert!(
        (t_secs - march_secs).abs() <= 2,
        "{ratelimit}: March (+02:00) has 31 days"
    );
    assert!(ratelimit.contains(";r=2;"), "{ratelimit}");
    assert_no_vm_panics(&t);
}
