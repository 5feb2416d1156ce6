//! Mesh policies end to end: rules that select requests by more than a
//! path.

mod common;

use std::time::Duration;

use common::*;

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
