//! A row of the bench: an Envoy to load, how its requests name clients,
//! and one oha run against it.

use std::fmt::Write as _;

use meshlimit_testbed::procs::Proc;
use meshlimit_testbed::Topology;

use crate::load::{load, Sample, Url, SECONDS};

pub(crate) struct Target {
    pub(crate) name: &'static str,
    pub(crate) url: String,
    pub(crate) admin: String,
    pub(crate) pid: u32,
    /// `url` draws a client id for each request (see [`MANY_CLIENTS`]).
    pub(crate) many_clients: bool,
    /// Headers sent besides the client id.
    pub(crate) headers: &'static [&'static str],
    /// A JSON body to POST (else a GET).
    pub(crate) post: Option<&'static str>,
    /// A file of URLs, one drawn per request (oha's `--urls-from-file`):
    /// the Zipf mix of clients.
    pub(crate) urls_file: Option<std::path::PathBuf>,
}

/// The query string of the many-clients configuration: one of 1000 client
/// ids per request, drawn by oha (one load generator, as for the others).
pub(crate) const MANY_CLIENTS: &str = r"\?key=c[0-9]{3}";

/// The replica of a meshlimit topology as a target, sent `headers` besides
/// the client id.
pub(crate) fn replica_target(
    name: &'static str,
    t: &Topology,
    headers: &'static [&'static str],
) -> Target {
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

/// One run against `t`, on the test core while runs are pinned.
pub(crate) fn run(t: &Target, key: &str, rate: Option<u64>) -> Sample {
    run_for(SECONDS, t, key, rate)
}

/// As [`run`], for `seconds`.
pub(crate) fn run_for(seconds: u64, t: &Target, key: &str, rate: Option<u64>) -> Sample {
    crate::machine::on_the_test_core(t.pid, || run_here(seconds, t, key, rate))
}

fn run_here(seconds: u64, t: &Target, key: &str, rate: Option<u64>) -> Sample {
    // The many-clients runs send no id header: it would win over the
    // query parameter.
    let mut headers: Vec<&str> = t.headers.to_vec();
    if !t.many_clients {
        headers.push(key);
    }
    match &t.urls_file {
        Some(file) => load(
            seconds,
            &file.display().to_string(),
            &headers,
            rate,
            t.post,
            Url::File,
        ),
        None if t.many_clients => load(seconds, &t.url, &headers, rate, t.post, Url::Regex),
        None => load(seconds, &t.url, &headers, rate, t.post, Url::One),
    }
}

/// Clients of the Zipf mix, and URLs drawn for it.
pub(crate) const ZIPF_CLIENTS: usize = 1000;

pub(crate) const ZIPF_URLS: usize = 200_000;

/// A file of `ZIPF_URLS` URLs of `base` with a `?key=` drawn from
/// `ZIPF_CLIENTS` clients by Zipf's law (exponent 1: the busiest client
/// sends about 13% of the requests, the top ten 39%, half the clients
/// fewer than one in 2000 each). Deterministic: the same file every run.
pub(crate) fn zipf_urls(dir: &std::path::Path, base: &str) -> std::path::PathBuf {
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

/// The row of replica 1 of `t`, run by `envoy`, answering itself.
pub(crate) fn replica_row(name: &'static str, t: &Topology, envoy: &Proc) -> Target {
    direct_row(name, &t.replica_addr(1), t.replica_admin(1), envoy.pid())
}

/// A row of the profile: an Envoy answering itself.
pub(crate) fn direct_row(
    name: &'static str,
    addr: &str,
    admin: String,
    pid: Option<u32>,
) -> Target {
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
