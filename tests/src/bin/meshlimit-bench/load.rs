//! Load from oha: one run's throughput and latency, and medians of runs.

use std::collections::BTreeMap;
use std::process::Command;

pub(crate) const SECONDS: u64 = 5;

/// Connections for fixed-rate (latency) runs.
pub(crate) const CONNECTIONS: u32 = 16;

/// Connections for saturation runs: enough that configurations whose
/// requests wait on a call still saturate the CPU (with 16, the ones with a
/// call per request stayed latency-bound at about 70% CPU).
pub(crate) const SATURATION_CONNECTIONS: u32 = 64;

pub(crate) const REPEATS: usize = 3;

#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    pub(crate) rps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) p999_ms: f64,
    pub(crate) non_2xx_4xx: u64,
    /// CPU the Envoy under test spent per request (saturation runs).
    pub(crate) envoy_cpu_us: f64,
    /// Calls to meshlimitd per request the Envoy under test answered
    /// (`make bench-ab`'s rounds).
    pub(crate) calls_per_request: f64,
}

pub(crate) fn oha() -> String {
    std::env::var("OHA").unwrap_or_else(|_| "oha".into())
}

/// One oha run; `rate` None means as fast as possible. `url` is a URL, a
/// regex or a file of URLs, as `how` says; each request then goes to a
/// URL drawn from it.
pub(crate) fn load(
    seconds: u64,
    url: &str,
    headers: &[&str],
    rate: Option<u64>,
    post: Option<&str>,
    how: Url,
) -> Sample {
    let connections = if rate.is_some() {
        CONNECTIONS
    } else {
        SATURATION_CONNECTIONS
    };
    let loadgen_cpus = crate::machine::loadgen_cores();
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
        &format!("{seconds}s"),
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

pub(crate) fn parse(out: std::io::Result<std::process::Output>) -> Sample {
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
        calls_per_request: 0.0,
    }
}

/// Median throughput of configuration `i`'s runs.
pub(crate) fn median_rps(runs: &BTreeMap<usize, Vec<Sample>>, i: usize) -> f64 {
    median_of(runs, i, |s| s.rps)
}

/// Median of one measure (`f`) over configuration `i`'s runs.
pub(crate) fn median_of(
    runs: &BTreeMap<usize, Vec<Sample>>,
    i: usize,
    f: fn(&Sample) -> f64,
) -> f64 {
    median(
        runs.get(&i)
            .map(|v| v.iter().map(f).collect())
            .unwrap_or_default(),
    )
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// How oha finds the URL of each request.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Url {
    One,
    /// Drawn from a regex (`--rand-regex-url`).
    Regex,
    /// Drawn from the lines of a file (`--urls-from-file`).
    File,
}
