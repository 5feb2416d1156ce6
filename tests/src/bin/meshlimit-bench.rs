//! `make bench`: what meshlimit costs per request, side by side in one run,
//! reported as ratios to bare Envoy. Writes docs/benchmarks.md and
//! docs/benchmarks.svg.
//!
//! Configurations (each Envoy with one worker, in front of the same kind of
//! upstream Envoy answering 200):
//!  1. Envoy alone;
//!  2. Envoy with its built-in local_ratelimit (in-process token bucket);
//!  3. meshlimit, global, every request allowed, group commit off (a call
//!     and a script each);
//!  4. meshlimit, global, the client over its limit (the deny cache answers);
//!  5. meshlimit with Redis down and the breaker open (local fallback);
//!  6. meshlimitd alone, checks/s over HTTP, beside redis-benchmark running
//!     the same script with EVALSHA (the Redis ceiling);
//!  7. meshlimit, global, group commit, one hot client;
//!  8. meshlimit, global, group commit, 1000 clients (each request's id
//!     drawn at random, in a query parameter, by the same single oha);
//!  9. as 7, the request matched by three rules with header conditions (a
//!     plan, a route cap `by: []`, a tenant limit `by` a header and the
//!     path): what mesh policies cost over 7's single rule.
//! 10. as 7, a token budget; 11. Envoy's native ratelimit filter asking
//!     meshlimitd over gRPC.
//! 12. to 18. Envoy answering itself (`direct_response`, no upstream),
//!     so that the filter's cost is most of what is measured: bare Envoy,
//!     a do-nothing Rust wasm filter that reads the client id as the
//!     benched configuration does (`x-api-key`, else `:path` for the
//!     Zipf mix's `key` parameter: the practical limit of any wasm filter
//!     deciding by the client; tests/noop-filter), and meshlimit's
//!     default (quota leases) beside leases off, for one hot client and
//!     for 1000 clients whose request rates follow a Zipf distribution
//!     (a few clients send most requests, as real traffic has).
//!
//! Runs are interleaved (1..5, 1..5, ...) and repeated; medians are
//! reported. The throughput targets against the do-nothing filter are
//! read from pairs run side by side instead (the repeats, and
//! [`TARGET_PAIRS`] more): the median of the pairs' ratios. The load
//! generator is oha.
//!
//! `MESHLIMIT_BENCH_AB=<builds, separated by :>` (`make bench-ab`) prices a change to
//! the hit path: see `ab`.
//!
//! `MESHLIMIT_COMPARE_WASM=<path to another build>` adds configurations 3
//! and 7 run with that build, interleaved with the others in the same run
//! (e.g. main before a change against the change), and writes the report to
//! target/bench-compare.md instead of docs/.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::Command;

use meshlimit_testbed::http;
use meshlimit_testbed::plugin::PluginConfig;
use meshlimit_testbed::procs::{rss_kib, Proc, TempDir};
use meshlimit_testbed::render::{render, template};
use meshlimit_testbed::services::REDIS_PORT;
use meshlimit_testbed::tools;
use meshlimit_testbed::topology::{FRONT_PORT, GRPC_PORT, UPSTREAM_PORT};
use meshlimit_testbed::{Topology, TopologyOptions};
use serde_json::json;

const SECONDS: u64 = 5;
/// Connections for fixed-rate (latency) runs.
const CONNECTIONS: u32 = 16;
/// Connections for saturation runs: enough that configurations whose
/// requests wait on a call still saturate the CPU (with 16, the ones with a
/// call per request stayed latency-bound at about 70% CPU).
const SATURATION_CONNECTIONS: u32 = 64;
const REPEATS: usize = 3;
/// Configurations (indices into the targets) also run unpinned.
const UNPINNED: [usize; 4] = [0, 2, 5, 6];
/// The throughput targets' pairs of configurations (indices into the
/// targets): the do-nothing filter (13, 16) and meshlimit's default (14,
/// 17), one busy client and the Zipf mix.
const BUSY_PAIR: (usize, usize) = (11, 12);
const ZIPF_PAIR: (usize, usize) = (14, 15);
/// Extra runs of each target pair, side by side (in turn first and
/// second). A target is read from the pair's ratios, each of two runs
/// next to each other: the three repeats' medians of a row alone spanned
/// 0.84 to 1.00 of the floor in one run, too wide for a target at 0.9.
const TARGET_PAIRS: usize = 8;

#[derive(Debug, Clone, Default)]
struct Sample {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    non_2xx_4xx: u64,
    /// CPU the Envoy under test spent per request (saturation runs).
    envoy_cpu_us: f64,
}

fn oha() -> String {
    std::env::var("OHA").unwrap_or_else(|_| "oha".into())
}

/// CPUs of the load generator while the runs are pinned (None: unpinned).
static LOADGEN_CPUS: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// The machine's cores, read once, first thing: the bench later pins its
/// own process (it runs the token row's fake model), and
/// `available_parallelism` follows the process's CPU affinity.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The CPU for the Envoy under test, and the CPUs for everything else (its
/// upstream, meshlimitd, Redis, the load generator); None on one core.
fn cpu_sets() -> Option<(String, String)> {
    let n = cores();
    let others = if n == 2 {
        "1".to_string()
    } else {
        format!("1-{}", n - 1)
    };
    (n >= 2).then_some(("0".to_string(), others))
}

/// Sets the CPUs every thread of `pid` may run on.
fn pin(pid: Option<u32>, cpus: &str) {
    let Some(pid) = pid else { return };
    let ok = Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "taskset could not pin process {pid} to CPUs {cpus}");
}

/// One oha run; `rate` None means as fast as possible. `url` is a URL, a
/// regex or a file of URLs, as `how` says; each request then goes to a
/// URL drawn from it.
fn load(url: &str, headers: &[&str], rate: Option<u64>, post: Option<&str>, how: Url) -> Sample {
    let connections = if rate.is_some() {
        CONNECTIONS
    } else {
        SATURATION_CONNECTIONS
    };
    let loadgen_cpus = LOADGEN_CPUS.lock().map(|c| c.clone()).unwrap_or(None);
    let mut cmd = match loadgen_cpus {
        Some(cpus) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpus, &oha()]);
            c
        }
        None => Command::new(oha()),
    };
    cmd.args([
        "--no-tui",
        "--output-format",
        "json",
        "-z",
        &format!("{SECONDS}s"),
    ])
    .args(["-c", &connections.to_string()]);
    if let Some(r) = rate {
        cmd.args(["-q", &r.to_string()]);
    }
    for h in headers {
        cmd.args(["-H", h]);
    }
    match how {
        Url::One => {}
        Url::Regex => {
            cmd.arg("--rand-regex-url");
        }
        Url::File => {
            cmd.arg("--urls-from-file");
        }
    }
    if let Some(body) = post {
        cmd.args(["-m", "POST", "-T", "application/json", "-d", body]);
    }
    cmd.arg(url)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let run = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run oha: {e} (make bench installs it)"));
    parse(run.wait_with_output())
}

fn parse(out: std::io::Result<std::process::Output>) -> Sample {
    let out = out.unwrap_or_else(|e| panic!("oha failed: {e}"));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "oha output is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let ms = |k: &str| v["latencyPercentiles"][k].as_f64().unwrap_or(f64::NAN) * 1000.0;
    let bad = v["statusCodeDistribution"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(code, _)| !(code.starts_with('2') || code.starts_with('4')))
                .filter_map(|(_, n)| n.as_u64())
                .sum()
        })
        .unwrap_or(0);
    Sample {
        rps: v["summary"]["requestsPerSec"].as_f64().unwrap_or(0.0),
        p50_ms: ms("p50"),
        p99_ms: ms("p99"),
        p999_ms: ms("p99.9"),
        non_2xx_4xx: bad,
        envoy_cpu_us: 0.0,
    }
}

/// Median throughput of configuration `i`'s runs.
fn median_rps(runs: &BTreeMap<usize, Vec<Sample>>, i: usize) -> f64 {
    median_of(runs, i, |s| s.rps)
}

/// Median of one measure (`f`) over configuration `i`'s runs.
fn median_of(runs: &BTreeMap<usize, Vec<Sample>>, i: usize, f: fn(&Sample) -> f64) -> f64 {
    median(
        runs.get(&i)
            .map(|v| v.iter().map(f).collect())
            .unwrap_or_default(),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn stat(admin: &str, name: &str) -> u64 {
    http::envoy_stats(admin, &format!("^{}$", name.replace('.', "\\.")))
        .first()
        .map_or(0, |(_, v)| *v)
}

/// CPU time (user + system) a process used so far, in clock ticks.
fn cpu_ticks(pid: Option<u32>) -> u64 {
    pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .and_then(|s| {
            // Fields after the command name (which may contain spaces).
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

/// CPU time of the whole machine so far (all cores, excluding idle), ticks.
fn busy_ticks() -> u64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            let cpu: Vec<u64> = s
                .lines()
                .next()?
                .split_whitespace()
                .skip(1)
                .filter_map(|v| v.parse().ok())
                .collect();
            Some(
                cpu.iter().sum::<u64>()
                    - cpu.get(3).copied().unwrap_or(0)
                    - cpu.get(4).copied().unwrap_or(0),
            )
        })
        .unwrap_or(0)
}

/// Where the CPU went during one saturation run: per process, in
/// milliseconds of CPU per 1000 requests.
struct CpuShare {
    name: &'static str,
    per_1000: Vec<(&'static str, f64)>,
}

fn meshlimit_topology(config: &str) -> Topology {
    meshlimit_topology_with(config, None)
}

fn meshlimit_topology_with(config: &str, wasm: Option<std::path::PathBuf>) -> Topology {
    Topology::start(TopologyOptions {
        plugin_config: config.into(),
        replicas: 1,
        front: false,
        replica_workers: 1,
        wasm,
        ..TopologyOptions::default()
    })
}

/// The other build `MESHLIMIT_COMPARE_WASM` names, if any.
fn compare_wasm() -> Option<std::path::PathBuf> {
    std::env::var_os("MESHLIMIT_COMPARE_WASM").map(std::path::PathBuf::from)
}

/// The benched configuration: the filter's default timeout, clients by
/// `x-api-key`, `requests` an hour.
fn per_hour(requests: u64) -> PluginConfig {
    PluginConfig::new()
        .set("service", json!({"timeout": "20ms"}))
        .client_id(json!({"headers": ["x-api-key"]}))
        .rule_field("match", json!({}))
        .limits(json!([{"name": "hour", "requests": requests, "window": "1h"}]))
}

/// Every request allowed.
fn allow_all() -> PluginConfig {
    per_hour(1_000_000_000)
}

/// Three rules with header conditions, all matching the benched request
/// (`x-api-key: bench`, `x-plan: pro`, `x-tenant: acme`): a plan, a route
/// cap counted for everyone, and a tenant-per-route limit.
fn three_rules() -> String {
    let big = 1_000_000_000u64;
    allow_all()
        .rules(json!([
            {"name": "pro", "match": {"headers": [{"name": "x-plan", "exact": "pro"}]},
             "limits": [{"name": "hour", "requests": big, "window": "1h"}]},
            {"name": "route", "match": {"path": {"prefix": "/"}, "headers": [{"name": "x-api-key", "present": true}]},
             "limits": [{"name": "hour", "requests": big, "window": "1h", "by": []}]},
            {"name": "tenant", "match": {"headers": [{"name": "x-tenant", "in": ["acme", "umbrella"]}]},
             "limits": [{"name": "hour", "requests": big, "window": "1h", "by": ["header:x-tenant", "path"]}]}
        ]))
        .build()
}

/// A token budget on a chat route: each request reserves its body's
/// `max_tokens` and settles at the usage the JSON response reports.
fn token_budget() -> String {
    allow_all()
        .rule_field(
            "cost",
            json!({"reserve": {"request_json": "max_tokens", "default": 100, "max": 1000},
                   "response": {"json": "usage.total_tokens"}}),
        )
        .build()
}

/// Row 3: every request its own call (group commit off). Leases are on by default and would
/// decide a hot client's requests without one (from when they landed until
/// December 2026 this row did, at 0.00 to 0.01 calls per request).
fn one_call_each() -> String {
    leases_off(allow_all().set("group_commit", json!({"enabled": false})))
}

struct Target {
    name: &'static str,
    url: String,
    admin: String,
    pid: u32,
    /// `url` draws a client id for each request (see [`MANY_CLIENTS`]).
    many_clients: bool,
    /// Headers sent besides the client id.
    headers: &'static [&'static str],
    /// A JSON body to POST (else a GET).
    post: Option<&'static str>,
    /// A file of URLs, one drawn per request (oha's `--urls-from-file`):
    /// the Zipf mix of clients.
    urls_file: Option<std::path::PathBuf>,
}

/// The query string of the many-clients configuration: one of 1000 client
/// ids per request, drawn by oha (one load generator, as for the others).
const MANY_CLIENTS: &str = r"\?key=c[0-9]{3}";

/// The replica of a meshlimit topology as a target, sent `headers` besides
/// the client id.
fn replica_target(name: &'static str, t: &Topology, headers: &'static [&'static str]) -> Target {
    Target {
        name,
        url: format!("http://{}/", t.replica_addr(1)),
        admin: t.replica_admin(1),
        pid: t.replica_pids().first().copied().unwrap_or(0),
        many_clients: false,
        headers,
        post: None,
        urls_file: None,
    }
}

fn run(t: &Target, key: &str, rate: Option<u64>) -> Sample {
    // The many-clients runs send no id header: it would win over the
    // query parameter.
    let mut headers: Vec<&str> = t.headers.to_vec();
    if !t.many_clients {
        headers.push(key);
    }
    match &t.urls_file {
        Some(file) => load(
            &file.display().to_string(),
            &headers,
            rate,
            t.post,
            Url::File,
        ),
        None if t.many_clients => load(&t.url, &headers, rate, t.post, Url::Regex),
        None => load(&t.url, &headers, rate, t.post, Url::One),
    }
}

/// How oha finds the URL of each request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Url {
    One,
    /// Drawn from a regex (`--rand-regex-url`).
    Regex,
    /// Drawn from the lines of a file (`--urls-from-file`).
    File,
}

/// Clients of the Zipf mix, and URLs drawn for it.
const ZIPF_CLIENTS: usize = 1000;
const ZIPF_URLS: usize = 200_000;

/// A file of `ZIPF_URLS` URLs of `base` with a `?key=` drawn from
/// `ZIPF_CLIENTS` clients by Zipf's law (exponent 1: the busiest client
/// sends about 13% of the requests, the top ten 39%, half the clients
/// fewer than one in 2000 each). Deterministic: the same file every run.
fn zipf_urls(dir: &std::path::Path, base: &str) -> std::path::PathBuf {
    let weights: Vec<f64> = (1..=ZIPF_CLIENTS).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut cdf = Vec::with_capacity(ZIPF_CLIENTS);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / total;
        cdf.push(acc);
    }
    // xorshift64*: no dependency for a reproducible draw.
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut out = String::with_capacity(ZIPF_URLS * (base.len() + 12));
    for _ in 0..ZIPF_URLS {
        let u = next();
        let client = cdf.partition_point(|&c| c < u).min(ZIPF_CLIENTS - 1);
        let _ = writeln!(out, "{base}?key=z{client:03}");
    }
    let path = dir.join("zipf-urls.txt");
    std::fs::write(&path, out).unwrap_or_else(|e| panic!("cannot write the Zipf URLs: {e}"));
    path
}

/// An Envoy config that answers every request itself (`direct_response`)
/// instead of routing to the upstream.
fn answering_itself(config: &str) -> String {
    let route = "route: { cluster: upstream }";
    assert!(config.contains(route), "the template has no upstream route");
    config.replace(
        route,
        r#"direct_response: { status: 200, body: { inline_string: "ok\n" } }"#,
    )
}

/// The do-nothing wasm filter (tests/noop-filter), as an HTTP filter of
/// envoy/bench-baseline.yaml: the same runtime and VM settings as
/// meshlimit's in envoy/replica.yaml.
fn noop_filter() -> String {
    let wasm = tools::root().join("target/wasm32-wasip1/release/meshlimit_bench_noop.wasm");
    assert!(
        wasm.exists(),
        "{} is missing: `make bench` builds it (cargo build --release --target wasm32-wasip1 -p meshlimit-bench-noop)",
        wasm.display()
    );
    format!(
        r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: noop
                root_id: noop
                vm_config:
                  vm_id: noop
                  runtime: envoy.wasm.runtime.v8
                  code:
                    local: {{ filename: {} }}"#,
        wasm.display()
    )
}

/// An Envoy from envoy/bench-baseline.yaml (replica `i` of `base`, admin on
/// 19900 + i) with `filters` as its HTTP filters, routing to the upstream
/// or, with `answering`, answering every request itself. The process and
/// its listener's address.
fn baseline_envoy(base: &Topology, i: u16, filters: &str, answering: bool) -> (Proc, String) {
    let mut vars = base.base_vars(19_900 + i, FRONT_PORT + i);
    vars.insert("UPSTREAM_HOST", base.host.clone());
    vars.insert("UPSTREAM_PORT", UPSTREAM_PORT.to_string());
    vars.insert("HTTP_FILTERS", filters.to_string());
    vars.insert("REPLICA_NAME", format!("baseline-{i}"));
    let mut config = render(&template("bench-baseline.yaml"), &vars);
    if answering {
        config = answering_itself(&config);
    }
    (
        base.start_envoy(&format!("replica-{i}"), &config, 1),
        base.addr(FRONT_PORT + i),
    )
}

/// A meshlimit topology whose one replica answers requests itself.
fn meshlimit_answering(config: &str) -> (Topology, Proc) {
    meshlimit_answering_with(config, None)
}

/// The same, running the filter build `wasm` (None: the project's).
fn meshlimit_answering_with(config: &str, wasm: Option<std::path::PathBuf>) -> (Topology, Proc) {
    let t = Topology::start(TopologyOptions {
        plugin_config: config.into(),
        replicas: 0,
        front: false,
        replica_workers: 1,
        wasm,
        ..TopologyOptions::default()
    });
    let replica = t.start_replica(1, &answering_itself(&t.replica_config(1)));
    (t, replica)
}

/// Leases off (group commit, as before leases).
fn leases_off(config: PluginConfig) -> String {
    config.set("leases", json!({"enabled": false})).build()
}

fn main() {
    cores();
    if std::env::var_os("MESHLIMIT_BENCH_PROFILE").is_some() {
        return profile();
    }
    if let Some(other) = std::env::var_os("MESHLIMIT_BENCH_AB") {
        // Empty: this build beside the do-nothing filter alone.
        return ab(std::env::split_paths(&other)
            .filter(|p| !p.as_os_str().is_empty())
            .collect());
    }
    println!("meshlimit bench: {SECONDS}s runs, {CONNECTIONS} connections, {REPEATS} repeats, interleaved");
    // 1 and 2: baselines from envoy/bench-baseline.yaml.
    let base = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        start_service: false,
        ..TopologyOptions::default()
    });
    let (bare, bare_addr) = baseline_envoy(&base, 3, "", false);
    let local_rl = r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: local_rl
              token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
              filter_enabled: { default_value: { numerator: 100, denominator: HUNDRED } }
              filter_enforced: { default_value: { numerator: 100, denominator: HUNDRED } }"#;
    let (lrl, lrl_addr) = baseline_envoy(&base, 4, local_rl, false);
    // 3, 4, 5: meshlimit in envoy/replica.yaml.
    // Group commit is the default; 3 turns it off to show the cost of one
    // call per request.
    let global = meshlimit_topology(&one_call_each());
    let deny = meshlimit_topology(&per_hour(1).build());
    let mut down = meshlimit_topology(&allow_all().build());
    down.stop_redis();
    let grouped_hot = meshlimit_topology(&allow_all().build());
    let grouped_many = meshlimit_topology(
        &allow_all()
            .client_id(json!({"headers": ["x-api-key"], "query_params": ["key"]}))
            .build(),
    );
    let policies = meshlimit_topology(&three_rules());
    // Its upstream is the fake model (tests/src/llm.rs), in this process:
    // Envoy's direct_response answers before a request body is in, and a
    // token budget reads its reservation from the body.
    // 11: Envoy's native ratelimit filter asking meshlimitd over gRPC.
    let rls_dir = TempDir::new("bench-rls");
    std::fs::write(
        rls_dir.path().join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 1000000000 }\n",
    )
    .unwrap_or_else(|e| panic!("cannot write the rate limit configuration: {e}"));
    let native = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        rls_config_dir: Some(rls_dir.path().to_path_buf()),
        ..TopologyOptions::default()
    });
    let native_envoy = {
        let mut vars = native.base_vars(19_901, FRONT_PORT + 1);
        vars.extend([
            ("REPLICA_NAME", "native".to_string()),
            ("RLS_HOST", native.host.clone()),
            ("RLS_PORT", GRPC_PORT.to_string()),
            ("UPSTREAM_HOST", native.host.clone()),
            ("UPSTREAM_PORT", UPSTREAM_PORT.to_string()),
            ("FAILURE_MODE_DENY", "false".to_string()),
        ]);
        native.start_envoy(
            "replica-1",
            &render(&template("native-ratelimit.yaml"), &vars),
            1,
        )
    };
    let tokens = Topology::start(TopologyOptions {
        plugin_config: token_budget(),
        replicas: 1,
        front: false,
        replica_workers: 1,
        llm: true,
        ..TopologyOptions::default()
    });
    // 12..18: Envoy answering itself, so that the filter is most of the
    // cost: bare, the do-nothing filter, and meshlimit's default (leases)
    // beside leases off, for one hot client and the Zipf mix.
    let (bare_direct, bare_direct_addr) = baseline_envoy(&base, 5, "", true);
    let (noop_direct, noop_direct_addr) = baseline_envoy(&base, 6, &noop_filter(), true);
    let many = || allow_all().client_id(json!({"headers": ["x-api-key"], "query_params": ["key"]}));
    let (leased_hot, leased_hot_envoy) = meshlimit_answering(&allow_all().build());
    let (unleased_hot, unleased_hot_envoy) = meshlimit_answering(&leases_off(allow_all()));
    let (leased_zipf, leased_zipf_envoy) = meshlimit_answering(&many().build());
    let (unleased_zipf, unleased_zipf_envoy) = meshlimit_answering(&leases_off(many()));
    let zipf_dir = TempDir::new("bench-zipf");
    let direct_target =
        |name: &'static str, addr: &str, admin: String, pid: Option<u32>, zipf: bool| Target {
            many_clients: zipf,
            urls_file: zipf.then(|| {
                let dir = zipf_dir.path().join(addr.replace([':', '.'], "-"));
                let _ = std::fs::create_dir_all(&dir);
                zipf_urls(&dir, &format!("http://{addr}/"))
            }),
            ..direct_row(name, addr, admin, pid)
        };
    // The compare build, for 3 and 7.
    let compared: Vec<Topology> = compare_wasm()
        .map(|wasm| {
            vec![
                meshlimit_topology_with(&one_call_each(), Some(wasm.clone())),
                meshlimit_topology_with(&allow_all().build(), Some(wasm)),
            ]
        })
        .unwrap_or_default();
    let mut targets = vec![
        Target {
            name: "1. Envoy alone",
            url: format!("http://{bare_addr}/"),
            admin: base.addr(19_903),
            pid: bare.pid().unwrap_or(0),
            many_clients: false,
            headers: &[],
            post: None,
            urls_file: None,
        },
        Target {
            name: "2. Envoy + local_ratelimit",
            url: format!("http://{lrl_addr}/"),
            admin: base.addr(19_904),
            pid: lrl.pid().unwrap_or(0),
            many_clients: false,
            headers: &[],
            post: None,
            urls_file: None,
        },
        replica_target("3. meshlimit, global, one call per request", &global, &[]),
        replica_target("4. meshlimit, over limit (deny cache)", &deny, &[]),
        replica_target("5. meshlimit, Redis down, breaker open", &down, &[]),
        replica_target(
            "7. meshlimit, global, group commit, one hot client",
            &grouped_hot,
            &[],
        ),
        Target {
            name: "8. meshlimit, global, group commit, 1000 clients",
            url: format!("http://{}/{MANY_CLIENTS}", grouped_many.replica_addr(1)),
            admin: grouped_many.replica_admin(1),
            pid: grouped_many.replica_pids()[0],
            many_clients: true,
            headers: &[],
            post: None,
            urls_file: None,
        },
        replica_target(
            "9. as 7, three rules with header conditions",
            &policies,
            &["x-plan: pro", "x-tenant: acme"],
        ),
        Target {
            url: format!("http://{}/v1/chat/completions", tokens.replica_addr(1)),
            post: Some(
                r#"{"model":"bench","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}"#,
            ),
            ..replica_target(
                "10. as 7, a token budget (non-streamed: reserve, settle)",
                &tokens,
                &[],
            )
        },
        Target {
            name: "11. Envoy's native ratelimit filter, meshlimitd over gRPC",
            url: format!("http://{}/api", native.replica_addr(1)),
            admin: native.replica_admin(1),
            pid: native_envoy.pid().unwrap_or(0),
            many_clients: false,
            headers: &["x-user: bench"],
            post: None,
            urls_file: None,
        },
        direct_target(
            "12. Envoy alone, answering itself",
            &bare_direct_addr,
            base.addr(19_905),
            bare_direct.pid(),
            false,
        ),
        direct_target(
            "13. a do-nothing Rust wasm filter reading the client id, answering itself",
            &noop_direct_addr,
            base.addr(19_906),
            noop_direct.pid(),
            false,
        ),
        direct_target(
            "14. meshlimit's default (leases), one hot client, answering itself",
            &leased_hot.replica_addr(1),
            leased_hot.replica_admin(1),
            leased_hot_envoy.pid(),
            false,
        ),
        direct_target(
            "15. as 14, leases off",
            &unleased_hot.replica_addr(1),
            unleased_hot.replica_admin(1),
            unleased_hot_envoy.pid(),
            false,
        ),
        direct_target(
            "16. as 13, the Zipf mix of 1000 clients",
            &noop_direct_addr,
            base.addr(19_906),
            noop_direct.pid(),
            true,
        ),
        direct_target(
            "17. meshlimit's default (leases), the Zipf mix of 1000 clients, answering itself",
            &leased_zipf.replica_addr(1),
            leased_zipf.replica_admin(1),
            leased_zipf_envoy.pid(),
            true,
        ),
        direct_target(
            "18. as 17, leases off",
            &unleased_zipf.replica_addr(1),
            unleased_zipf.replica_admin(1),
            unleased_zipf_envoy.pid(),
            true,
        ),
    ];
    for (topology, name) in compared.iter().zip([
        "3'. as 3, with the compare build",
        "7'. as 7, with the compare build",
    ]) {
        targets.push(replica_target(name, topology, &[]));
    }
    // The Envoy under test gets a core of its own, as a proxy's worker does
    // in production; its upstream, meshlimitd, Redis and the load generator
    // share the others (in production meshlimitd and Redis are on other
    // machines altogether). Unpinned runs of a few configurations follow.
    let support: Vec<Option<u32>> = [
        &base,
        &global,
        &deny,
        &down,
        &grouped_hot,
        &grouped_many,
        &policies,
        &tokens,
        &native,
        &leased_hot,
        &unleased_hot,
        &leased_zipf,
        &unleased_zipf,
    ]
    .into_iter()
    .chain(&compared)
    .flat_map(|t| [t.upstream_pid(), t.meshlimitd_pid(), t.redis_pid()])
    // This process: the fake model upstream of the token-budget row.
    .chain([Some(std::process::id())])
    .collect();
    let set_pinning = |pinned: bool| {
        let Some((envoy_cpus, other_cpus)) = cpu_sets() else {
            return false;
        };
        let all = format!("0-{}", cores() - 1);
        let (envoy_cpus, other_cpus) = if pinned {
            (envoy_cpus, other_cpus)
        } else {
            (all.clone(), all)
        };
        for t in &targets {
            pin(Some(t.pid), &envoy_cpus);
        }
        for p in &support {
            pin(*p, &other_cpus);
        }
        if let Ok(mut cpus) = LOADGEN_CPUS.lock() {
            *cpus = pinned.then_some(other_cpus);
        }
        pinned
    };
    let pinned = set_pinning(true);
    let key = |t: &Target| {
        if t.name.starts_with("4.") {
            "x-api-key: abuser"
        } else {
            "x-api-key: bench"
        }
    };
    // Warm up: JIT, connections, the deny cache, the open breaker.
    for t in &targets {
        let _ = run(t, key(t), Some(2_000));
    }
    let calls_before: Vec<(u64, u64, u64)> = targets
        .iter()
        .map(|t| {
            (
                stat(&t.admin, "http.ingress.downstream_rq_total"),
                calls_to_meshlimitd(&t.admin),
                stat(&t.admin, "cluster.meshlimit.upstream_cx_total"),
            )
        })
        .collect();
    let fallbacks_before: Vec<Fallbacks> =
        targets.iter().map(|t| Fallbacks::read(&t.admin)).collect();
    let mut saturation: BTreeMap<usize, Vec<Sample>> = BTreeMap::new();
    // The processes behind each meshlimit configuration, for the CPU split.
    let procs = |i: usize| -> Vec<(&'static str, Option<u32>)> {
        let topo = match i {
            2 => &global,
            5 => &grouped_hot,
            _ => return Vec::new(),
        };
        vec![
            ("Envoy with meshlimit", topo.replica_pids().first().copied()),
            ("upstream Envoy", topo.upstream_pid()),
            ("meshlimitd", topo.meshlimitd_pid()),
            ("redis-server", topo.redis_pid()),
        ]
    };
    let mut cpu: Vec<CpuShare> = Vec::new();
    for rep in 0..REPEATS {
        for (i, t) in targets.iter().enumerate() {
            let watched = procs(i);
            let before: Vec<u64> = watched.iter().map(|(_, p)| cpu_ticks(*p)).collect();
            let busy_before = busy_ticks();
            let envoy_before = cpu_ticks(Some(t.pid));
            let s = with_cpu(t, run(t, key(t), None), envoy_before);
            if rep == 0 && !watched.is_empty() {
                let requests = (s.rps * SECONDS as f64).max(1.0);
                let tick_ms = 10.0; // USER_HZ is 100 on Linux
                let mut per_1000: Vec<(&'static str, f64)> = watched
                    .iter()
                    .zip(&before)
                    .map(|((name, p), b)| {
                        (
                            *name,
                            (cpu_ticks(*p) - b) as f64 * tick_ms * 1000.0 / requests,
                        )
                    })
                    .collect();
                let watched_total: f64 = per_1000.iter().map(|(_, v)| v).sum();
                let busy = (busy_ticks() - busy_before) as f64 * tick_ms * 1000.0 / requests;
                per_1000.push((
                    "everything else (mostly oha)",
                    (busy - watched_total).max(0.0),
                ));
                cpu.push(CpuShare {
                    name: t.name,
                    per_1000,
                });
            }
            println!(
                "  saturation {rep} {:<52} {:>8.0} req/s  p99 {:.2} ms",
                t.name, s.rps, s.p99_ms
            );
            saturation.entry(i).or_default().push(s);
        }
    }
    let calls: Vec<(f64, u64)> = targets
        .iter()
        .zip(&calls_before)
        .map(|(t, (rq0, call0, cx0))| {
            let rq = stat(&t.admin, "http.ingress.downstream_rq_total").saturating_sub(*rq0);
            let calls = calls_to_meshlimitd(&t.admin).saturating_sub(*call0);
            let cx = stat(&t.admin, "cluster.meshlimit.upstream_cx_total").saturating_sub(*cx0);
            (calls as f64 / rq.max(1) as f64, cx)
        })
        .collect();
    // The target pairs: the repeats' ratios (each pair ran side by side,
    // the two rows next to each other), and as many more pairs again.
    let mut paired: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for (floor, row) in [BUSY_PAIR, ZIPF_PAIR] {
        let (Some(fs), Some(rs)) = (saturation.get(&floor), saturation.get(&row)) else {
            continue;
        };
        let ratios = paired.entry(row).or_default();
        ratios.extend(fs.iter().zip(rs).map(|(f, r)| r.rps / f.rps.max(1.0)));
        let (Some(ft), Some(rt)) = (targets.get(floor), targets.get(row)) else {
            continue;
        };
        for k in 0..TARGET_PAIRS {
            let floor_first = k % 2 == 0;
            let rps = |t: &Target| run(t, key(t), None).rps;
            let (f, r) = if floor_first {
                let f = rps(ft);
                (f, rps(rt))
            } else {
                let r = rps(rt);
                (rps(ft), r)
            };
            println!(
                "  pair {k} {:<52} {:.3} of the do-nothing filter ({r:.0} vs {f:.0} req/s)",
                rt.name,
                r / f.max(1.0)
            );
            ratios.push(r / f.max(1.0));
        }
    }
    // Over the saturation runs and the target pairs: every run a ratio is
    // read from.
    let fallbacks: Vec<Fallbacks> = targets
        .iter()
        .zip(&fallbacks_before)
        .map(|(t, before)| Fallbacks::read(&t.admin).since(before))
        .collect();
    let rate = {
        let min = saturation
            .keys()
            .map(|&i| median_rps(&saturation, i))
            .fold(f64::MAX, f64::min);
        ((min * 0.5 / 100.0).floor() * 100.0).max(100.0) as u64
    };
    println!("fixed rate for latency: {rate} req/s");
    let mut fixed: BTreeMap<usize, Vec<Sample>> = BTreeMap::new();
    for rep in 0..REPEATS {
        for (i, t) in targets.iter().enumerate() {
            let s = run(t, key(t), Some(rate));
            println!(
                "  fixed {rep} {:<52} p50 {:.3} p99 {:.3} p99.9 {:.3} ms",
                t.name, s.p50_ms, s.p99_ms, s.p999_ms
            );
            fixed.entry(i).or_default().push(s);
        }
    }
    // Unpinned: every process may run on every core, as on a busy node.
    set_pinning(false);
    let mut unpinned: BTreeMap<usize, Vec<Sample>> = BTreeMap::new();
    if pinned {
        for rep in 0..REPEATS {
            for (i, t) in targets
                .iter()
                .enumerate()
                .filter(|(i, _)| UNPINNED.contains(i))
            {
                let s = run(t, key(t), None);
                println!("  unpinned {rep} {:<52} {:>8.0} req/s", t.name, s.rps);
                unpinned.entry(i).or_default().push(s);
            }
        }
    }
    // 6: meshlimitd alone and redis-benchmark with the same script.
    let check = r#"{"checks":[{"subject":"hdr:x-api-key:bench6","limits":[{"name":"api/hour","requests":1000000000,"window_ms":3600000,"algorithm":"fixed_window"}]}]}"#;
    let service_url = format!("http://{}/v1/check", global.meshlimitd_addr());
    let script = meshlimitd::script::CHECK;
    let sha = global
        .redis_cli(&["script", "load", script])
        .trim()
        .to_string();
    let mut service_rps = Vec::new();
    let mut grpc_rps = Vec::new();
    let mut redis_rps = Vec::new();
    for rep in 0..REPEATS {
        let s = load(&service_url, &[], None, Some(check), Url::One);
        service_rps.push(s.rps);
        let g = grpc_load(&native.addr(GRPC_PORT));
        grpc_rps.push(g);
        let r = redis_benchmark(&global.host, &sha);
        println!(
            "  service {rep}: meshlimitd {:.0} checks/s (gRPC {g:.0}/s), redis-benchmark EVALSHA {:.0}/s",
            s.rps, r
        );
        redis_rps.push(r);
    }
    let rss: Vec<u64> = targets.iter().map(|t| rss_kib(Some(t.pid))).collect();
    let wasm_bytes = std::fs::metadata(tools::wasm())
        .map(|m| m.len())
        .unwrap_or(0);
    report(
        &cpu,
        &targets,
        &saturation,
        &paired,
        &unpinned,
        &fixed,
        &calls,
        &fallbacks,
        rate,
        (median(service_rps), median(grpc_rps)),
        median(redis_rps),
        &rss,
        wasm_bytes,
    );
    drop((bare, lrl, grouped_hot, grouped_many, policies, tokens));
    drop((bare_direct, noop_direct, zipf_dir));
    drop((
        leased_hot_envoy,
        unleased_hot_envoy,
        leased_zipf_envoy,
        unleased_zipf_envoy,
    ));
    drop((leased_hot, unleased_hot, leased_zipf, unleased_zipf));
    drop((native_envoy, native, rls_dir));
}

/// Requests an Envoy's filter decided by its local fallback, and its calls
/// to meshlimitd that timed out. A row meant to measure global decisions
/// that fell back measured the fallback instead: meshlimitd answered late
/// (its core is shared with the load generator), timeouts opened the
/// breaker, and a lease that ran out could not be renewed. The report and
/// `make bench-ab` name such rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Fallbacks {
    decisions: u64,
    timeouts: u64,
}

impl Fallbacks {
    fn read(admin: &str) -> Fallbacks {
        let stats = http::envoy_stats(
            admin,
            r"^wasmcustom\.meshlimit\.(fallback_(allowed|denied|uncounted)|service_errors\.timeout)$",
        );
        let sum = |part: &str| {
            stats
                .iter()
                .filter(|(name, _)| name.contains(part))
                .map(|(_, v)| *v)
                .sum()
        };
        Fallbacks {
            decisions: sum("fallback_"),
            timeouts: sum("timeout"),
        }
    }

    fn since(self, before: &Fallbacks) -> Fallbacks {
        Fallbacks {
            decisions: self.decisions.saturating_sub(before.decisions),
            timeouts: self.timeouts.saturating_sub(before.timeouts),
        }
    }

    /// What fell back and timed out, or `None` when nothing did.
    fn describe(&self) -> Option<String> {
        (*self != Fallbacks::default()).then(|| {
            format!(
                "{} requests decided by the fallback, {} calls timed out",
                self.decisions, self.timeouts
            )
        })
    }
}

/// Calls an Envoy made to meshlimitd: the wasm filter's HTTP checks, or
/// the native filter's gRPC ones.
fn calls_to_meshlimitd(admin: &str) -> u64 {
    stat(admin, "cluster.meshlimit.upstream_rq_total")
        + stat(admin, "cluster.meshlimit_rls.upstream_rq_total")
}

/// `ShouldRateLimit` calls per second on meshlimitd's gRPC port, as fast
/// as 8 connections with 8 calls in flight each get answers, for
/// [`SECONDS`]: one descriptor, the same script as 6.
fn grpc_load(addr: &str) -> f64 {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use std::sync::atomic::{AtomicU64, Ordering};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("cannot start a runtime: {e}"));
    let answered = std::sync::Arc::new(AtomicU64::new(0));
    let request = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: "bench-grpc".into(),
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    };
    let url = format!("http://{addr}");
    runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(SECONDS);
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let channel = tonic::transport::Endpoint::from_shared(url.clone())
                .unwrap_or_else(|e| panic!("bad address {url}: {e}"))
                .connect()
                .await
                .unwrap_or_else(|e| panic!("cannot reach the rate limit service at {url}: {e}"));
            for _ in 0..8 {
                let mut client = RateLimitServiceClient::new(channel.clone());
                let (request, answered) = (request.clone(), answered.clone());
                tasks.push(tokio::spawn(async move {
                    while tokio::time::Instant::now() < deadline {
                        if client.should_rate_limit(request.clone()).await.is_ok() {
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }));
            }
        }
        for task in tasks {
            let _ = task.await;
        }
    });
    answered.load(Ordering::Relaxed) as f64 / SECONDS as f64
}

fn redis_benchmark(host: &str, sha: &str) -> f64 {
    let out = Command::new("redis-benchmark")
        .args([
            "-h",
            host,
            "-p",
            &REDIS_PORT.to_string(),
            "-c",
            &CONNECTIONS.to_string(),
            "-n",
            "200000",
            "-q",
        ])
        .args(["evalsha", sha, "1", "ml:{e:bench6}:api/hour:fw:3600000"])
        // As meshlimitd lays them out (no test clock, no lease), for the
        // limit of the check meshlimitd is measured with.
        .args(meshlimitd::script::check_args("nonce", false, "", (0, 1)))
        .args(meshlimitd::script::limit_args(&meshlimit_protocol::Limit {
            name: "api/hour".into(),
            requests: 1_000_000_000,
            window_ms: 3_600_000,
            algorithm: meshlimit_protocol::Algorithm::FixedWindow,
            cost: 1,
            burst: None,
            shadow: false,
            subject: None,
            calendar: None,
        }))
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-benchmark: {e}"));
    // "evalsha ...: 51234.56 requests per second, p50=..."
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    text.lines()
        .filter_map(|l| {
            l.split(": ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
        })
        .next_back()
        .unwrap_or(0.0)
}

#[allow(clippy::too_many_arguments)]
fn report(
    cpu_split: &[CpuShare],
    targets: &[Target],
    saturation: &BTreeMap<usize, Vec<Sample>>,
    paired: &BTreeMap<usize, Vec<f64>>,
    unpinned: &BTreeMap<usize, Vec<Sample>>,
    fixed: &BTreeMap<usize, Vec<Sample>>,
    calls: &[(f64, u64)],
    fallbacks: &[Fallbacks],
    rate: u64,
    (service_rps, grpc_rps): (f64, f64),
    redis_rps: f64,
    rss: &[u64],
    wasm_bytes: u64,
) {
    let sat = |i: usize| median_rps(saturation, i);
    let envoy_cpu = |i: usize| median_of(saturation, i, |s| s.envoy_cpu_us);
    let lat = |i: usize, f: fn(&Sample) -> f64| median_of(fixed, i, f);
    let bad: u64 = saturation
        .values()
        .chain(fixed.values())
        .flatten()
        .map(|s| s.non_2xx_4xx)
        .sum();
    let base = sat(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let pinning = match (unpinned.is_empty(), cpu_sets()) {
        (false, Some((envoy, others))) => format!(
            "The Envoy under test runs alone on CPU {envoy}, as a proxy's worker has a core to itself in \
             production; its upstream, meshlimitd, Redis and the load generator share CPU(s) {others} \
             (in production meshlimitd and Redis run on other machines). A table of unpinned runs follows."
        ),
        _ => "No CPU pinning: every process shares the machine's cores.".to_string(),
    };
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Benchmarks\n\nGenerated by `make bench` (tests/src/bin/meshlimit-bench.rs) on {} cores ({cpu}), \
         loopback. Each Envoy runs one worker; the upstream is another Envoy (one worker) answering 200; \
         meshlimitd runs tokio's default two worker threads; Redis is Debian's redis-server. \
         {pinning} The load generator is oha: {SATURATION_CONNECTIONS} connections \
         for throughput, {CONNECTIONS} for latency at a fixed rate. \
         Runs of {SECONDS} s, interleaved across configurations and repeated {REPEATS} times; medians. \
         Ratios are to configuration 1 from the same run: absolute numbers move with the machine's load, \
         ratios much less.\n",
        cores()
    );
    let _ = writeln!(md, "| configuration | throughput (req/s) | ratio | Envoy CPU per request | p50 at {rate} req/s | p99 | p99.9 | added p99 vs 1 | calls to meshlimitd per request | new connections to meshlimitd | Envoy RSS |\n|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, t) in targets.iter().enumerate() {
        let (per_rq, cx) = calls.get(i).copied().unwrap_or((0.0, 0));
        let _ = writeln!(
            md,
            "| {} | {:.0} | **{:.2}** | {:.0} µs | {:.3} ms | {:.3} ms | {:.3} ms | {:+.3} ms | {:.2} | {} | {} MiB |",
            t.name,
            sat(i),
            sat(i) / base,
            envoy_cpu(i),
            lat(i, |s| s.p50_ms),
            lat(i, |s| s.p99_ms),
            lat(i, |s| s.p999_ms),
            lat(i, |s| s.p99_ms) - lat(0, |s| s.p99_ms),
            per_rq,
            cx,
            rss.get(i).copied().unwrap_or(0) / 1024
        );
    }
    // Row 5 decides by its fallback by design; any other row that did
    // measured something else than its name says.
    let fell_back: Vec<String> = targets
        .iter()
        .zip(fallbacks)
        .filter(|(t, _)| !t.name.starts_with("5."))
        .filter_map(|(t, f)| Some(format!("{} ({})", t.name, f.describe()?)))
        .collect();
    let fell_back = if fell_back.is_empty() {
        "Over the saturation runs and the target pairs, no configuration but 5 decided a request by its fallback, and no call to meshlimitd timed out.".to_string()
    } else {
        format!(
            "**Decided partly by the fallback** over the saturation runs and the target pairs (meshlimitd answered late): {}. Their rows measure the fallback as much as their names.",
            fell_back.join("; ")
        )
    };
    let _ = writeln!(
        md,
        "| 6. meshlimitd alone (HTTP checks) | {service_rps:.0} | **{:.2}** of redis-benchmark | | | | | | | | |\n| 6''. meshlimitd alone (gRPC `ShouldRateLimit`) | {grpc_rps:.0} | **{:.2}** of redis-benchmark | | | | | | | | |\n| 6'. redis-benchmark, same script (EVALSHA) | {redis_rps:.0} | 1.00 | | | | | | | | |\n",
        service_rps / redis_rps.max(1.0),
        grpc_rps / redis_rps.max(1.0)
    );
    let _ = writeln!(md, "{fell_back}\n");
    let check = |ok: bool| if ok { "met" } else { "**not met**" };
    let _ = writeln!(md, "## Targets\n\n| target | measured | |\n|---|---|---|");
    let _ = writeln!(
        md,
        "| (3) throughput >= 0.25 of (1) | {:.2} | {} |",
        sat(2) / base,
        check(sat(2) / base >= 0.25)
    );
    let added = lat(2, |s| s.p99_ms) - lat(0, |s| s.p99_ms);
    let _ = writeln!(
        md,
        "| (3) added p99 at the fixed rate <= 1 ms | {added:+.3} ms | {} |",
        check(added <= 1.0)
    );
    let added_gc = lat(5, |s| s.p99_ms) - lat(0, |s| s.p99_ms);
    let _ = writeln!(
        md,
        "| (7) the default (group commit): added p99 at the fixed rate <= 1 ms | {added_gc:+.3} ms | {} |",
        check(added_gc <= 1.0)
    );
    let _ = writeln!(
        md,
        "| (4) >= 0.6 of (1): abuse costs no round trip | {:.2} | {} |",
        sat(3) / base,
        check(sat(3) / base >= 0.6)
    );
    let _ = writeln!(
        md,
        "| (5) >= 0.6 of (1): an outage costs no timeout | {:.2} | {} |",
        sat(4) / base,
        check(sat(4) / base >= 0.6)
    );
    let _ = writeln!(
        md,
        "| (6) >= 0.5 of redis-benchmark EVALSHA | {:.2} | {} |",
        service_rps / redis_rps.max(1.0),
        check(redis_rps > 0.0 && service_rps / redis_rps.max(1.0) >= 0.5)
    );
    let _ = writeln!(
        md,
        "| (6'') the rate limit service's gRPC path >= 0.5 of redis-benchmark EVALSHA | {:.2} | {} |",
        grpc_rps / redis_rps.max(1.0),
        check(redis_rps > 0.0 && grpc_rps / redis_rps.max(1.0) >= 0.5)
    );
    let _ = writeln!(
        md,
        "| (11) Envoy's native ratelimit filter with meshlimitd over gRPC, beside the wasm filter (7) and bare Envoy (1) | {:.2} of (1), {:.2} of (7); one gRPC call per request ({:.2}), no batching | measured |",
        sat(9) / base,
        sat(9) / sat(5).max(1.0),
        calls.get(9).map_or(0.0, |c| c.0)
    );
    let _ = writeln!(
        md,
        "| wasm module < 1 MiB | {} KiB | {} |",
        wasm_bytes / 1024,
        check(wasm_bytes < 1 << 20)
    );
    let gc = sat(5).max(sat(6));
    let _ = writeln!(
        md,
        "| group commit at saturation >= 0.5 of (1) | {:.2} (one hot client {:.2}, 1000 clients {:.2}) | {} |",
        gc / base,
        sat(5) / base,
        sat(6) / base,
        check(gc / base >= 0.5)
    );
    let p50 = |i: usize| lat(i, |s| s.p50_ms);
    let _ = writeln!(
        md,
        "| group commit p50 at the fixed rate no worse than one call per request (3) | {:.3} vs {:.3} ms | {} |",
        p50(5),
        p50(2),
        check(p50(5) <= p50(2) * 1.1)
    );
    let _ = writeln!(
        md,
        "| (9) three matched rules with header conditions: at most 10% more Envoy CPU per request than one rule (7) | {:.0} vs {:.0} µs: {:+.0}% (throughput {:.2} of (7): meshlimitd and Redis, on the other core, do three limits' work) | {} |",
        envoy_cpu(7),
        envoy_cpu(5),
        (envoy_cpu(7) / envoy_cpu(5).max(0.001) - 1.0) * 100.0,
        sat(7) / sat(5).max(1.0),
        check(envoy_cpu(7) <= envoy_cpu(5) * 1.10)
    );
    let per_rq = |i: usize| calls.get(i).map_or(1.0, |c| c.0);
    let _ = writeln!(
        md,
        "| calls to meshlimitd per request at saturation with group commit: well under 0.2 | {:.2} (one hot client), {:.2} (1000 clients); one call per request: {:.2} | {} |",
        per_rq(5),
        per_rq(6),
        per_rq(2),
        check(per_rq(5) < 0.2 && per_rq(6) < 0.2)
    );
    let _ = writeln!(
        md,
        "| (10) a token budget, non-streamed: calls to meshlimitd per request with settlements included, under 0.2 | {:.2} (a check and a settlement per request, in group commit's batches); throughput {:.2} of (7), Envoy CPU {:.0} vs {:.0} µs per request (the body is read, a second job batched) | {} |",
        per_rq(8),
        sat(8) / sat(5).max(1.0),
        envoy_cpu(8),
        envoy_cpu(5),
        check(per_rq(8) < 0.2)
    );
    // 12..18: answering itself (indices 10..16).
    let ((noop_d, leased), (noop_zipf, leased_zipf)) = (BUSY_PAIR, ZIPF_PAIR);
    let (bare_d, unleased, unleased_zipf) = (10, 13, 16);
    // A pair's ratio: the median of its side-by-side runs' ratios.
    let pair_ratio = |row: usize| median(paired.get(&row).cloned().unwrap_or_default());
    let pairs_seen = |row: usize| {
        let mut ratios = paired.get(&row).cloned().unwrap_or_default();
        ratios.sort_by(f64::total_cmp);
        let shown: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        format!("{} pairs: {}", ratios.len(), shown.join(", "))
    };
    let _ = writeln!(
        md,
        "| (14) one busy client, meshlimit's default (leases) >= 0.9 of the do-nothing wasm filter (13), side by side | {:.2} of (13), the median of {}; the medians' ratio {:.2} ({:.2} of (12); leases off (15): {:.2} of (13)) | {} |",
        pair_ratio(leased),
        pairs_seen(leased),
        sat(leased) / sat(noop_d).max(1.0),
        sat(leased) / sat(bare_d).max(1.0),
        sat(unleased) / sat(noop_d).max(1.0),
        check(pair_ratio(leased) >= 0.9)
    );
    let _ = writeln!(
        md,
        "| (14) calls to meshlimitd per request under 0.01 | {:.4} (leases off (15): {:.3}) | {} |",
        per_rq(leased),
        per_rq(unleased),
        check(per_rq(leased) < 0.01)
    );
    let _ = writeln!(
        md,
        "| (17) 1000 clients, Zipf: >= 0.7 of the do-nothing wasm filter on the same mix (16), side by side | {:.2} of (16), the median of {}; the medians' ratio {:.2}; {:.4} calls per request (leases off (18): {:.2} of (16), {:.3} calls per request) | {} |",
        pair_ratio(leased_zipf),
        pairs_seen(leased_zipf),
        sat(leased_zipf) / sat(noop_zipf).max(1.0),
        per_rq(leased_zipf),
        sat(unleased_zipf) / sat(noop_zipf).max(1.0),
        per_rq(unleased_zipf),
        check(pair_ratio(leased_zipf) >= 0.7)
    );
    let added_p50 = p50(leased) - p50(bare_d);
    let _ = writeln!(
        md,
        "| (14) a leased client: p50 added at the fixed rate, vs (12), under 0.1 ms | {added_p50:+.3} ms (the do-nothing filter (13): {:+.3} ms; leases off (15): {:+.3} ms) | {} |",
        p50(noop_d) - p50(bare_d),
        p50(unleased) - p50(bare_d),
        check(added_p50 < 0.1)
    );
    if !unpinned.is_empty() {
        let free = |i: usize| median_rps(unpinned, i);
        let _ = writeln!(
            md,
            "\n## Unpinned\n\nThe same saturation runs with every process free to run on every core (the \
             load generator, both Envoys, meshlimitd and Redis competing for the same {} cores), after the \
             pinned ones; medians of {REPEATS}.\n\n| configuration | throughput (req/s) | ratio unpinned | ratio pinned (above) |\n|---|---|---|---|",
            cores()
        );
        for (i, t) in targets.iter().enumerate() {
            if unpinned.contains_key(&i) {
                let _ = writeln!(
                    md,
                    "| {} | {:.0} | **{:.2}** | {:.2} |",
                    t.name,
                    free(i),
                    free(i) / free(0),
                    sat(i) / base
                );
            }
        }
    }
    if !cpu_split.is_empty() {
        let _ = writeln!(md, "\n## Where the time goes\n\nCPU (user + system) per 1000 requests during the first saturation run, from `/proc`: milliseconds of CPU, all processes on the machine's {} cores.\n", cores());
        let names: Vec<&str> = cpu_split[0].per_1000.iter().map(|(n, _)| *n).collect();
        let _ = writeln!(md, "| configuration | {} | total |", names.join(" | "));
        let _ = writeln!(md, "|---|{}---|", "---|".repeat(names.len()));
        for c in cpu_split {
            let total: f64 = c.per_1000.iter().map(|(_, v)| v).sum();
            let cells: Vec<String> = c.per_1000.iter().map(|(_, v)| format!("{v:.0}")).collect();
            let _ = writeln!(md, "| {} | {} | {total:.0} |", c.name, cells.join(" | "));
        }
    }
    let vm = (rss.get(2).copied().unwrap_or(0) as f64 - rss.first().copied().unwrap_or(0) as f64)
        / 2.0
        / 1024.0;
    let _ = writeln!(
        md,
        "\nPer-VM memory: an Envoy with meshlimit holds two VMs (the main thread's and its one worker's); \
         its RSS minus bare Envoy's, halved, is about **{vm:.1} MiB per VM** (V8 and the module). \
         Responses other than 2xx/4xx during all runs: {bad}.\n"
    );
    md.push_str(
        &std::fs::read_to_string(tools::root().join("docs/benchmarks-notes.md"))
            .unwrap_or_default(),
    );
    // A comparison of two builds is a measurement for a change, not the
    // project's report.
    let (path, svg) = if compare_wasm().is_some() {
        (
            tools::root().join("target/bench-compare.md"),
            tools::root().join("target/bench-compare.svg"),
        )
    } else {
        (
            tools::root().join("docs/benchmarks.md"),
            tools::root().join("docs/benchmarks.svg"),
        )
    };
    let _ = std::fs::write(&path, &md);
    let _ = std::fs::write(&svg, chart(targets, &sat, &|i| lat(i, |s| s.p99_ms)));
    println!(
        "\n{md}\nwritten to {} and {}",
        path.display(),
        svg.display()
    );
}

/// Two bar charts side by side: throughput and p99 at the fixed rate.
fn chart(targets: &[Target], sat: &dyn Fn(usize) -> f64, p99: &dyn Fn(usize) -> f64) -> String {
    let (w, row, left) = (900.0, 34.0, 300.0);
    let h = 70.0 + row * targets.len() as f64;
    let max_rps = (0..targets.len()).map(sat).fold(1.0, f64::max);
    let max_p99 = (0..targets.len())
        .map(p99)
        .filter(|v| v.is_finite())
        .fold(0.001, f64::max);
    let bar_w = (w - left - 40.0) / 2.0 - 20.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\
         <text x=\"{left}\" y=\"22\" font-weight=\"bold\">throughput (req/s, higher is better)</text>\
         <text x=\"{}\" y=\"22\" font-weight=\"bold\">p99 at fixed rate (ms, lower is better)</text>",
        left + bar_w + 40.0
    );
    for (i, t) in targets.iter().enumerate() {
        let y = 40.0 + row * i as f64;
        let (r, l) = (sat(i), p99(i));
        let _ = write!(
            s,
            "<text x=\"8\" y=\"{:.0}\">{}</text>\
             <rect x=\"{left}\" y=\"{y:.0}\" width=\"{:.1}\" height=\"20\" fill=\"#4a7fb5\"/>\
             <text x=\"{:.1}\" y=\"{:.0}\">{r:.0}</text>\
             <rect x=\"{:.1}\" y=\"{y:.0}\" width=\"{:.1}\" height=\"20\" fill=\"#c0504d\"/>\
             <text x=\"{:.1}\" y=\"{:.0}\">{l:.2}</text>",
            y + 15.0,
            t.name,
            bar_w * r / max_rps,
            left + bar_w * r / max_rps + 4.0,
            y + 15.0,
            left + bar_w + 40.0,
            (bar_w * l / max_p99).max(1.0),
            left + bar_w + 40.0 + (bar_w * l / max_p99).max(1.0) + 4.0,
            y + 15.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// `make bench-profile`: what each step of the asynchronous path costs
/// Envoy. The shipped filter with leases off (every request of the hot
/// client calls, through group commit) beside builds that skip one step
/// each (src/flow/profile.rs), Envoy answering itself, pinned as in
/// `make bench`; Envoy's CPU per request, interleaved runs, medians.
/// Writes docs/benchmarks-profile.md.
fn profile() {
    let built = |name: &str| {
        let p = tools::root().join(format!(
            "target/profile-{name}/wasm32-wasip1/release/meshlimit.wasm"
        ));
        assert!(
            p.exists(),
            "{} is missing: `make bench-profile` builds it",
            p.display()
        );
        Some(p)
    };
    // (row, build, leases on)
    let variants: [(&str, Option<std::path::PathBuf>, bool); 10] = [
        (
            "A. as shipped, leases off: every request calls (group commit)",
            None,
            false,
        ),
        (
            "B. A without RateLimit headers",
            built("skip-headers"),
            false,
        ),
        (
            "C. A without pause and resume (the check still queued, sent, answered)",
            built("skip-pause"),
            false,
        ),
        (
            "D. A without the call: admitted at once (no queue, wake-up, dispatch, answer)",
            built("skip-call"),
            false,
        ),
        (
            "E. as shipped, leases on: every request a lease hit",
            None,
            true,
        ),
        (
            "F. E without RateLimit headers",
            built("skip-headers"),
            true,
        ),
        (
            "G. going on once the check is planned (headers read, rules matched, subject made)",
            built("skip-decide"),
            true,
        ),
        (
            "H. going on once the request's headers are read",
            built("skip-plan"),
            true,
        ),
        (
            "I. E with group commit off (a lease hit needs no call either way)",
            None,
            true,
        ),
        (
            "J. going on before reading the request's headers",
            built("skip-read"),
            true,
        ),
    ];
    let base = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        start_service: false,
        ..TopologyOptions::default()
    });
    let (bare, bare_addr) = baseline_envoy(&base, 5, "", true);
    let (noop, noop_addr) = baseline_envoy(&base, 6, &noop_filter(), true);
    let runs: Vec<(Topology, Proc)> = variants
        .iter()
        .enumerate()
        .map(|(i, (_, wasm, leases))| {
            let config = match (leases, i) {
                (false, _) => leases_off(allow_all()),
                (true, 8) => allow_all()
                    .set("group_commit", json!({"enabled": false}))
                    .build(),
                (true, _) => allow_all().build(),
            };
            meshlimit_answering_with(&config, wasm.clone())
        })
        .collect();
    let mut targets = vec![
        direct_row(
            "Envoy alone, answering itself",
            &bare_addr,
            base.addr(19_905),
            bare.pid(),
        ),
        direct_row(
            "the do-nothing wasm filter",
            &noop_addr,
            base.addr(19_906),
            noop.pid(),
        ),
    ];
    for ((name, _, _), (t, envoy)) in variants.iter().zip(&runs) {
        targets.push(replica_row(name, t, envoy));
    }
    let key = "x-api-key: bench";
    pin_and_warm(
        "bench-profile",
        &targets,
        std::iter::once(&base).chain(runs.iter().map(|(t, _)| t)),
        key,
    );
    let mut samples: BTreeMap<usize, Vec<Sample>> = BTreeMap::new();
    for rep in 0..REPEATS {
        for (i, t) in targets.iter().enumerate() {
            let before = cpu_ticks(Some(t.pid));
            let s = with_cpu(t, run(t, key, None), before);
            println!(
                "  profile {rep} {:<64} {:>8.0} req/s {:>5.1} µs",
                t.name, s.rps, s.envoy_cpu_us
            );
            samples.entry(i).or_default().push(s);
        }
    }
    let rps = |i: usize| median_rps(&samples, i);
    let cpu = |i: usize| median_of(&samples, i, |s| s.envoy_cpu_us);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Where the time goes, step by step\n\nGenerated by `make bench-profile` \
         (tests/src/bin/meshlimit-bench.rs, `profile`). Envoy (one worker, pinned to a core of its own) \
         answers every request itself; one hot client; oha with {SATURATION_CONNECTIONS} connections; \
         {REPEATS} interleaved runs of {SECONDS} s, medians. Rows B, C, D, F, G, H and J are builds of the \
         filter that skip one step (src/flow/profile.rs), J before the first: a step's cost is the drop in Envoy's CPU per \
         request when it is skipped. The machine is noisy: differences under about 2 µs are within the \
         runs' spread.\n\n| configuration | throughput (req/s) | ratio to Envoy alone | ratio to the do-nothing filter | Envoy CPU per request |\n|---|---|---|---|---|"
    );
    for (i, t) in targets.iter().enumerate() {
        let _ = writeln!(
            md,
            "| {} | {:.0} | {:.2} | {:.2} | {:.1} µs |",
            t.name,
            rps(i),
            rps(i) / rps(0).max(1.0),
            rps(i) / rps(1).max(1.0),
            cpu(i)
        );
    }
    // Rows: 0 bare, 1 noop, 2..=11 the variants A..J.
    let row = |letter: char| 2 + (letter as usize - 'A' as usize);
    let d = |a: char, b: char| cpu(row(a)) - cpu(row(b));
    let _ = writeln!(
        md,
        "\n## What each step costs Envoy, per request\n\n| step | µs |\n|---|---|\n\
         | the do-nothing filter over Envoy alone (a VM crossing per callback, one header read) | {:.1} |\n\
         | ... of which reading one header (do-nothing - J) | {:.1} |\n\
         | reading every request header in one hostcall, over reading one (H - do-nothing) | {:.1} |\n\
         | planning: rules matched, client id, subject (G - H) | {:.1} |\n\
         | a lease hit: the clock, the worker's draw (the slot read and written when it runs out), the verdict (F - G) | {:.1} |\n\
         | RateLimit headers, made and added (E - F) | {:.1} |\n\
         | the asynchronous path over a lease hit (A - E) | {:.1} |\n\
         | ... of which pause and resume (A - C) | {:.1} |\n\
         | ... of which queue, wake-up, dispatch, reading the answer (C - D) | {:.1} |\n\
         | RateLimit headers on the asynchronous path (A - B) | {:.1} |\n",
        cpu(1) - cpu(0),
        cpu(1) - cpu(row('J')),
        cpu(row('H')) - cpu(1),
        d('G', 'H'),
        d('F', 'G'),
        d('E', 'F'),
        d('A', 'E'),
        d('A', 'C'),
        d('C', 'D'),
        d('A', 'B'),
    );
    let path = tools::root().join("docs/benchmarks-profile.md");
    let _ = std::fs::write(&path, &md);
    println!("\n{md}\nwritten to {}", path.display());
    drop((runs, bare, noop, base));
}

/// `make bench-ab`: the project's build against others (`others`), one
/// hot client from leases, beside the do-nothing filter, each Envoy
/// answering itself and pinned to the same core, in
/// `MESHLIMIT_BENCH_AB_ROUNDS` alternated rounds (default 8). A change
/// worth a fraction of a microsecond per request is within one full `make
/// bench`'s spread; the medians of many alternated rounds of these rows
/// alone are not. Prints each round and the medians; writes nothing.
fn ab(others: Vec<std::path::PathBuf>) {
    for other in &others {
        assert!(
            other.exists(),
            "{} is missing: MESHLIMIT_BENCH_AB names the builds to compare with (separated by ':')",
            other.display()
        );
    }
    let rounds: usize = std::env::var("MESHLIMIT_BENCH_AB_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(8);
    let base = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        start_service: false,
        ..TopologyOptions::default()
    });
    let (noop, noop_addr) = baseline_envoy(&base, 6, &noop_filter(), true);
    // MESHLIMIT_BENCH_AB_RATE=<req/s>: latency at that fixed rate instead
    // of throughput, with Envoy alone (answering itself) as a last row: the
    // p50 each row adds to it, as `make bench`'s target (14) reads it.
    let rate: Option<u64> = std::env::var("MESHLIMIT_BENCH_AB_RATE")
        .ok()
        .and_then(|r| r.parse().ok());
    let bare = rate.map(|_| baseline_envoy(&base, 5, "", true));
    // MESHLIMIT_BENCH_AB_ZIPF=1: the Zipf mix of 1000 clients (rows 16 and
    // 17 of `make bench`) instead of one hot client.
    let zipf = flag("MESHLIMIT_BENCH_AB_ZIPF");
    let config = if zipf {
        allow_all()
            .client_id(json!({"headers": ["x-api-key"], "query_params": ["key"]}))
            .build()
    } else {
        allow_all().build()
    };
    let zipf_dir = TempDir::new("bench-ab-zipf");
    // A row as the mix asks: its URLs drawn from a file for its address.
    let mixed = |target: Target, addr: &str| Target {
        many_clients: zipf,
        urls_file: zipf.then(|| {
            let dir = zipf_dir.path().join(addr.replace([':', '.'], "-"));
            let _ = std::fs::create_dir_all(&dir);
            zipf_urls(&dir, &format!("http://{addr}/"))
        }),
        ..target
    };
    let builds: Vec<(String, Option<std::path::PathBuf>)> =
        std::iter::once(("this build".to_string(), None))
            .chain(
                others
                    .iter()
                    .map(|p| (p.display().to_string(), Some(p.clone()))),
            )
            .collect();
    let runs: Vec<(Topology, Proc)> = builds
        .iter()
        .map(|(_, wasm)| meshlimit_answering_with(&config, wasm.clone()))
        .collect();
    let names: Vec<&'static str> = std::iter::once("the do-nothing wasm filter")
        .chain(
            builds
                .iter()
                .map(|(n, _)| &*Box::leak(n.clone().into_boxed_str())),
        )
        .collect();
    let noop_row = direct_row(names[0], &noop_addr, base.addr(19_906), noop.pid());
    let mut targets = vec![mixed(noop_row, &noop_addr)];
    for (name, (t, envoy)) in names.iter().skip(1).zip(&runs) {
        targets.push(mixed(replica_row(name, t, envoy), &t.replica_addr(1)));
    }
    if let Some((envoy, addr)) = &bare {
        let row = direct_row("Envoy alone", addr, base.addr(19_905), envoy.pid());
        targets.push(mixed(row, addr));
    }
    let key = "x-api-key: bench";
    pin_and_warm(
        "bench-ab",
        &targets,
        std::iter::once(&base).chain(runs.iter().map(|(t, _)| t)),
        key,
    );
    println!(
        "bench-ab: {} builds, {rounds} rounds of {SECONDS} s",
        builds.len()
    );
    let fallbacks_before: Vec<Fallbacks> =
        targets.iter().map(|t| Fallbacks::read(&t.admin)).collect();
    // `make bench-perf`: each Envoy's call chains, recorded over the rounds.
    let recording = std::env::var_os("MESHLIMIT_BENCH_PERF")
        .map(std::path::PathBuf::from)
        .map(|dir| PerfRecording::start(&dir, &targets));
    let mut samples: BTreeMap<usize, Vec<Sample>> = BTreeMap::new();
    // All rows at once: the Envoys share their core, and whatever slows
    // the machine during a round slows every row alike.
    let together = flag("MESHLIMIT_BENCH_AB_TOGETHER");
    for round in 0..rounds {
        if together {
            let before: Vec<u64> = targets.iter().map(|t| cpu_ticks(Some(t.pid))).collect();
            let runs: Vec<Sample> = std::thread::scope(|sc| {
                let handles: Vec<_> = targets
                    .iter()
                    .map(|t| sc.spawn(|| run(t, key, None)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_default())
                    .collect()
            });
            for (i, (t, s)) in targets.iter().zip(runs).enumerate() {
                let s = with_cpu(t, s, before.get(i).copied().unwrap_or(0));
                println!(
                    "  round {round} {:<48} {:>8.0} req/s {:>6.2} µs",
                    t.name, s.rps, s.envoy_cpu_us
                );
                samples.entry(i).or_default().push(s);
            }
            continue;
        }
        // Each round starts with another row, so no row always runs first.
        for k in 0..targets.len() {
            let i = (round + k) % targets.len();
            let Some(t) = targets.get(i) else { continue };
            let before = cpu_ticks(Some(t.pid));
            let s = with_cpu(t, run(t, key, rate), before);
            println!(
                "  round {round} {:<48} {:>8.0} req/s {:>6.2} µs p50 {:.3} ms",
                t.name, s.rps, s.envoy_cpu_us, s.p50_ms
            );
            samples.entry(i).or_default().push(s);
        }
    }
    let cpu = |i: usize| median_of(&samples, i, |s| s.envoy_cpu_us);
    let rps = |i: usize| median_rps(&samples, i);
    // The machine's speed drifts over minutes; a row's ratio to the
    // do-nothing filter within the same round drifts much less. `ratio`
    // of a row's sample and the filter's in the same round.
    let median_ratio = |i: usize, ratio: fn(&Sample, &Sample) -> f64| {
        let (Some(row), Some(floor)) = (samples.get(&i), samples.get(&0)) else {
            return 0.0;
        };
        median(row.iter().zip(floor).map(|(s, f)| ratio(s, f)).collect())
    };
    let round_ratio = |i: usize| median_ratio(i, |s, f| s.rps / f.rps.max(1.0));
    // The same from Envoy's CPU per request: the throughput ratio were each
    // row alone on the core; with the rows together, the one to read.
    let round_cpu_ratio =
        |i: usize| median_ratio(i, |s, f| f.envoy_cpu_us / s.envoy_cpu_us.max(0.001));
    println!(
        "\n| row | req/s | ratio to the do-nothing filter | median of the rounds' ratios | the same from CPU per request | Envoy CPU per request | minus this build |\n|---|---|---|---|---|---|---|"
    );
    for (i, t) in targets.iter().enumerate() {
        println!(
            "| {} | {:.0} | {:.3} | {:.3} | {:.3} | {:.2} µs | {:+.2} µs |",
            t.name,
            rps(i),
            rps(i) / rps(0).max(1.0),
            round_ratio(i),
            round_cpu_ratio(i),
            cpu(i),
            cpu(i) - cpu(1)
        );
    }
    if let (Some(rate), Some(bare)) = (rate, targets.len().checked_sub(1)) {
        let p50 = |i: usize| median_of(&samples, i, |s| s.p50_ms);
        // Within a round, as the throughput ratios: the row's p50 minus
        // Envoy alone's of the same round.
        let added = |i: usize| {
            let (Some(row), Some(floor)) = (samples.get(&i), samples.get(&bare)) else {
                return f64::NAN;
            };
            median(
                row.iter()
                    .zip(floor)
                    .map(|(s, f)| s.p50_ms - f.p50_ms)
                    .collect(),
            )
        };
        println!(
            "\n| row (at {rate} req/s) | p50 | p50 added to Envoy alone (median of the rounds') |\n|---|---|---|"
        );
        for (i, t) in targets.iter().enumerate() {
            println!("| {} | {:.3} ms | {:+.3} ms |", t.name, p50(i), added(i));
        }
    }
    if let Some(recording) = recording {
        recording.finish(&targets);
    }
    for (t, before) in targets.iter().zip(&fallbacks_before) {
        if let Some(what) = Fallbacks::read(&t.admin).since(before).describe() {
            println!(
                "\n{}: {what}: its rounds measured the fallback too (meshlimitd answered late).",
                t.name
            );
        }
    }
    for t in &targets {
        print_timers(t);
    }
    drop((runs, noop, bare, base));
}

/// Samples a second `make bench-perf` takes of each Envoy: what one
/// sample is worth in scripts/perf_split.py follows from it.
const PERF_HZ: u32 = 499;

/// `perf record -g` on every Envoy of a `make bench-ab` run, and the
/// requests each served meanwhile; [`PerfRecording::finish`] splits their
/// time with scripts/perf_split.py: inside the VM (the filter's wasm and
/// its hostcalls) and outside it, and the call paths that differ from the
/// first row's (the do-nothing filter).
struct PerfRecording {
    dir: std::path::PathBuf,
    recorders: Vec<std::process::Child>,
    requests_before: Vec<u64>,
}

impl PerfRecording {
    fn start(dir: &std::path::Path, targets: &[Target]) -> PerfRecording {
        let _ = std::fs::create_dir_all(dir);
        let recorders = targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                Command::new("perf")
                    .args(["record", "-q", "-g", "-e", "cpu-clock", "-p"])
                    .arg(t.pid.to_string())
                    .arg("-F")
                    .arg(PERF_HZ.to_string())
                    .arg("-o")
                    .arg(dir.join(format!("row{i}.data")))
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| {
                        panic!("cannot run perf: {e} (make bench-perf installs it)")
                    })
            })
            .collect();
        let requests_before = targets
            .iter()
            .map(|t| stat(&t.admin, "http.ingress.downstream_rq_total"))
            .collect();
        PerfRecording {
            dir: dir.to_path_buf(),
            recorders,
            requests_before,
        }
    }

    fn finish(self, targets: &[Target]) {
        let requests: Vec<u64> = targets
            .iter()
            .zip(&self.requests_before)
            .map(|(t, before)| {
                stat(&t.admin, "http.ingress.downstream_rq_total").saturating_sub(*before)
            })
            .collect();
        for mut recorder in self.recorders {
            // perf writes its file out on SIGINT.
            let _ = Command::new("kill")
                .args(["-INT", &recorder.id().to_string()])
                .status();
            let _ = recorder.wait();
        }
        let mut args = Vec::new();
        for (i, (t, n)) in targets.iter().zip(&requests).enumerate() {
            let stacks = self.dir.join(format!("row{i}.stacks"));
            let written = std::fs::File::create(&stacks).ok().and_then(|out| {
                Command::new("perf")
                    .args(["script", "-F", "ip,dso", "-i"])
                    .arg(self.dir.join(format!("row{i}.data")))
                    .stdout(out)
                    .stderr(std::process::Stdio::null())
                    .status()
                    .ok()
            });
            if written.is_some_and(|s| s.success()) {
                args.push(format!("{}={}:{n}", t.name, stacks.display()));
            }
        }
        // Every Envoy runs the same binary.
        let envoy = targets
            .first()
            .and_then(|t| std::fs::read_link(format!("/proc/{}/exe", t.pid)).ok())
            .unwrap_or_else(tools::envoy);
        let split = Command::new("python3")
            .arg(tools::root().join("scripts/perf_split.py"))
            .arg(envoy)
            .arg(PERF_HZ.to_string())
            .args(&args)
            .status();
        assert!(
            split.is_ok_and(|s| s.success()),
            "scripts/perf_split.py failed on {}",
            self.dir.display()
        );
    }
}

/// The in-VM timers of a `make bench-timers` build (src/wasm/timers.rs),
/// if `t` runs one: each callback's and costly hostcall's time, per call
/// and per request (requests counted by the streams created, the warm-up
/// included).
fn print_timers(t: &Target) {
    let stats = http::envoy_stats(&t.admin, r"^wasmcustom\.meshlimit\.profile\.");
    let value = |name: &str| {
        stats
            .iter()
            .find(|(n, _)| n.strip_prefix("wasmcustom.meshlimit.profile.") == Some(name))
            .map_or(0, |(_, v)| *v)
    };
    let requests = value("stream_created.calls");
    if requests == 0 {
        return;
    }
    println!(
        "\n{}: in-VM timers over {requests} requests (a callback's time includes its hostcalls')\n\n| site | calls per request | µs per call | µs per request |\n|---|---|---|---|",
        t.name
    );
    for (name, _) in stats.iter().filter(|(n, _)| n.ends_with(".calls")) {
        let Some(site) = name
            .strip_prefix("wasmcustom.meshlimit.profile.")
            .and_then(|n| n.strip_suffix(".calls"))
        else {
            continue;
        };
        let (calls, us) = (
            value(&format!("{site}.calls")),
            value(&format!("{site}.us")),
        );
        println!(
            "| {site} | {:.3} | {:.2} | {:.2} |",
            calls as f64 / requests as f64,
            us as f64 / calls.max(1) as f64,
            us as f64 / requests as f64
        );
    }
}

/// Pins the Envoys under test (`targets`) to a core of their own and the
/// rest of `topologies` (upstreams, meshlimitd, Redis) and the load
/// generator to the other, then warms every row up at a fixed rate.
fn pin_and_warm<'t>(
    what: &str,
    targets: &[Target],
    topologies: impl Iterator<Item = &'t Topology>,
    key: &str,
) {
    let Some((envoy_cpus, other_cpus)) = cpu_sets() else {
        panic!("{what} pins Envoy to a core of its own: it needs two cores");
    };
    for t in targets {
        pin(Some(t.pid), &envoy_cpus);
    }
    for p in topologies.flat_map(|t| [t.upstream_pid(), t.meshlimitd_pid(), t.redis_pid()]) {
        pin(p, &other_cpus);
    }
    if let Ok(mut cpus) = LOADGEN_CPUS.lock() {
        *cpus = Some(other_cpus);
    }
    for t in targets {
        let _ = run(t, key, Some(2_000));
    }
}

/// A saturation run of `t`, with the Envoy CPU it spent per request
/// (since `before`, its CPU ticks when the run started; USER_HZ is 100 on
/// Linux: a tick is 10 ms).
fn with_cpu(t: &Target, mut s: Sample, before: u64) -> Sample {
    s.envoy_cpu_us =
        (cpu_ticks(Some(t.pid)) - before) as f64 * 10_000.0 / (s.rps * SECONDS as f64).max(1.0);
    s
}

/// Whether the environment variable `name` is set to something (an empty
/// value, as `make` passes an unset one, is off).
fn flag(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty())
}

/// The row of replica 1 of `t`, run by `envoy`, answering itself.
fn replica_row(name: &'static str, t: &Topology, envoy: &Proc) -> Target {
    direct_row(name, &t.replica_addr(1), t.replica_admin(1), envoy.pid())
}

/// A row of the profile: an Envoy answering itself.
fn direct_row(name: &'static str, addr: &str, admin: String, pid: Option<u32>) -> Target {
    Target {
        name,
        url: format!("http://{addr}/"),
        admin,
        pid: pid.unwrap_or(0),
        many_clients: false,
        headers: &[],
        post: None,
        urls_file: None,
    }
}
