//! The dashboards and alerts against a real Prometheus (Debian's, which
//! setup installs) scraping a live Envoy and meshlimitd under traffic:
//! every panel's expression returns series, and every alert's expression
//! is valid PromQL whose metrics are scraped. A renamed stat, a label that
//! tag extraction no longer makes, or a typo in a panel fails here, not on
//! an operator's screen.

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
use meshlimit_testbed::procs::{Proc, TempDir};
use meshlimit_testbed::{tools, Topology, TopologyOptions};

/// Prometheus' port on the topology's own address.
const PROMETHEUS_PORT: u16 = 19_090;

/// Metrics an alert reads that this testbed cannot make, and why.
const NOT_HERE: [(&str, &str); 1] = [(
    "istio_agent_wasm_remote_fetch_count",
    "Istio's agent exports it; there is no Istio here",
)];

/// A request rule (3 a minute, so that some are denied and some near the
/// limit) and a token budget on the fake model's route.
fn config() -> String {
    PluginConfig::new()
        .rules(json!([
            {"name": "api", "match": {"path_prefix": "/api"},
             "limits": [{"name": "per-minute", "requests": 3, "window": "60s"}]},
            {"name": "llm", "match": {"path_prefix": "/v1/"},
             "cost": {"reserve": {"request_json": "max_tokens", "default": 100, "max": 1000},
                      "response": {"json": "usage.total_tokens"}},
             "limits": [{"name": "tokens", "requests": 100000, "window": "1h"}]}
        ]))
        .build()
}

fn start_prometheus(t: &Topology, dir: &TempDir) -> Proc {
    let config = format!(
        "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\n\
         scrape_configs:\n\
         - job_name: envoy\n  metrics_path: /stats/prometheus\n  static_configs: [{{ targets: ['{}'] }}]\n\
         - job_name: meshlimitd\n  metrics_path: /metrics\n  static_configs: [{{ targets: ['{}'] }}]\n",
        t.replica_admin(1),
        t.meshlimitd_addr()
    );
    let path = dir.path().join("prometheus.yml");
    std::fs::write(&path, config).unwrap();
    let mut cmd = Command::new("prometheus");
    cmd.arg(format!("--config.file={}", path.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={}", t.addr(PROMETHEUS_PORT)));
    Proc::spawn("prometheus", &mut cmd, dir.path())
}

/// `%`-encodes a query for a URL.
fn encode(query: &str) -> String {
    query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus' answer to an instant query: its status and how many series.
fn query(t: &Topology, expr: &str) -> (String, usize) {
    let path = format!("/api/v1/query?query={}", encode(expr));
    let body = http::get(&t.addr(PROMETHEUS_PORT), &path, &[])
        .map(|r| r.body)
        .unwrap_or_default();
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let status = v["status"].as_str().unwrap_or("unreachable").to_string();
    let series = v["data"]["result"].as_array().map_or(0, Vec::len);
    (status, series)
}

/// Every panel expression of a Grafana dashboard in deploy/grafana.
fn panel_exprs(dashboard: &str) -> Vec<String> {
    let path = tools::root().join("deploy/grafana").join(dashboard);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .collect()
}

/// Every alert's expression in deploy/prometheus/alerts.yaml (block
/// scalars `expr: |` included).
fn alert_exprs() -> Vec<String> {
    let text =
        std::fs::read_to_string(tools::root().join("deploy/prometheus/alerts.yaml")).unwrap();
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(expr) = line.trim_start().strip_prefix("expr:") else {
            continue;
        };
        if expr.trim() == "|" {
            let mut block = String::new();
            while let Some(next) = lines.peek() {
                if next.trim_start().starts_with("for:") || next.trim_start().starts_with("labels:")
                {
                    break;
                }
                block.push_str(next.trim());
                block.push(' ');
                lines.next();
            }
            out.push(block);
        } else {
            out.push(expr.trim().to_string());
        }
    }
    out
}

#[test]
fn every_panel_and_alert_reads_series_a_live_prometheus_scrapes() {
    let t = Topology::start(TopologyOptions {
        plugin_config: config(),
        replicas: 1,
        front: false,
        llm: true,
        ..TopologyOptions::default()
    });
    let dir = TempDir::new("prometheus");
    let _prometheus = start_prometheus(&t, &dir);
    // Traffic (requests admitted, near the limit, denied; a token budget
    // reserved and settled) until every expression has its series. Each
    // target is scraped on its own phase: Envoy having the two scrapes
    // rate() needs says nothing about meshlimitd, so the wait is on every
    // expression, not on one of them.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut missing = vec!["no query ran".to_string()];
    while !missing.is_empty() && Instant::now() < deadline {
        for _ in 0..5 {
            send(&t, &key("dash"));
        }
        let r = http::request(
            &t.replica_addr(1),
            "POST",
            "/v1/chat/completions",
            &[
                ("x-api-key", b"dash"),
                ("x-llm-tokens", b"7"),
                ("content-type", b"application/json"),
            ],
            br#"{"model":"m","max_tokens":50,"messages":[]}"#,
        );
        assert!(r.is_ok_and(|r| r.status == 200), "the token route answers");
        missing = expressions_without_series(&t);
        if !missing.is_empty() {
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    assert!(
        missing.is_empty(),
        "expressions with no series:\n{}",
        missing.join("\n")
    );
}

/// Every panel expression that returns no series, every alert expression
/// Prometheus refuses, and every metric an alert reads that is not scraped.
fn expressions_without_series(t: &Topology) -> Vec<String> {
    let mut missing = Vec::new();
    for dashboard in ["meshlimit-fleet.json", "meshlimit-llm.json"] {
        for expr in panel_exprs(dashboard) {
            let (status, n) = query(t, &expr);
            if status != "success" || n == 0 {
                missing.push(format!("{dashboard}: {expr} ({status}, {n} series)"));
            }
        }
    }
    for expr in alert_exprs() {
        let (status, _) = query(t, &expr);
        if status != "success" {
            missing.push(format!("alert: {expr} ({status})"));
        }
        // Every metric it reads is scraped (an alert that can never fire
        // because its metric was renamed is worse than none).
        for name in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("meshlimit") || w.starts_with("istio_"))
        {
            if NOT_HERE.iter().any(|(n, _)| *n == name) {
                continue;
            }
            let (_, n) = query(t, &format!("count({{__name__=\"{name}\"}})"));
            if n == 0 {
                missing.push(format!("alert: {name} is not scraped ({expr})"));
            }
        }
    }
    missing
}
