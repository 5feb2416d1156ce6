//! `make bench-ab`, `make bench-timers` and `make bench-perf`: builds side
//! by side with the do-nothing filter, in many alternated rounds.

use meshlimit_testbed::procs::{Proc, TempDir};
use meshlimit_testbed::{Topology, TopologyOptions};
use serde_json::json;

use crate::configs::{allow_all, leases_off, one_call_each};
use crate::counted::{CallCount, Fallbacks};
use crate::envoys::{baseline_envoy, meshlimit_answering_over, noop_filter};
use crate::full::Runs;
use crate::load::{median, median_of, median_rps, Sample, SECONDS};
use crate::machine::{cpu_ticks, flag, pin_and_warm, with_cpu};
use crate::perf::PerfRecording;
use crate::rows::{direct_row, replica_row, run, run_for, zipf_urls, Target};
use crate::timers::print_timers;

/// `make bench-ab`: the project's build against others (`others`), one
/// hot client from leases, beside the do-nothing filter, each Envoy
/// answering itself and pinned to the same core, in
/// `MESHLIMIT_BENCH_AB_ROUNDS` alternated rounds (default 8). A change
/// worth a fraction of a microsecond per request is within one full `make
/// bench`'s spread; the medians of many alternated rounds of these rows
/// alone are not. Prints each round and the medians; writes nothing.
pub(crate) fn ab(others: Vec<std::path::PathBuf>) {
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
    let config = ab_config(zipf);
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
    let builds = ab_builds(&others, &config);
    let runs: Vec<(Topology, Proc)> = builds
        .iter()
        .map(|b| meshlimit_answering_over(&b.config, b.wasm.clone(), b.cluster_http1))
        .collect();
    let names: Vec<&'static str> = std::iter::once("the do-nothing wasm filter")
        .chain(builds.iter().map(|b| b.name))
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
    let samples = ab_rounds(&targets, rounds, rate, key);
    ab_tables(&targets, &samples, rate);
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
        print_call_times(t);
        print_timers(t);
    }
    drop((runs, noop, bare, base));
}

/// How long a row's calls to meshlimitd took, as its Envoy timed them
/// (the meshlimit cluster's `upstream_rq_time`, in ms, since it started;
/// Envoy's percentiles): nothing for a row that made none.
fn print_call_times(t: &Target) {
    let path = "/stats?filter=^cluster\\.meshlimit\\.upstream_rq_time$";
    let Ok(page) = meshlimit_testbed::http::get(&t.admin, path, &[]) else {
        return;
    };
    for line in page.body.lines().filter(|l| l.contains("P50(")) {
        // "name: P0(interval,cumulative) P25(..) ...": the cumulative ones.
        let cumulative: Vec<String> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|p| {
                let (name, values) = p.split_once('(')?;
                let (_, all) = values.trim_end_matches(')').split_once(',')?;
                Some(format!("{name} {all}"))
            })
            .collect();
        println!(
            "\n{}: its calls took (ms) {}",
            t.name,
            cumulative.join(", ")
        );
    }
}

/// The rounds: each row in turn (each round starting with another), or
/// all at once with `MESHLIMIT_BENCH_AB_TOGETHER`.
fn ab_rounds(targets: &[Target], rounds: usize, rate: Option<u64>, key: &str) -> Runs {
    let mut samples = Runs::new();
    // All rows at once: the Envoys share their core, and whatever slows
    // the machine during a round slows every row alike.
    let together = flag("MESHLIMIT_BENCH_AB_TOGETHER");
    let warm = warm_seconds();
    for round in 0..rounds {
        if together {
            let runs = all_at_once(targets, |t| {
                if warm > 0 {
                    let _ = run_for(warm, t, key, None);
                }
                let before = (cpu_ticks(Some(t.pid)), CallCount::read(&t.admin));
                (before, run(t, key, None))
            });
            for (i, (t, ((cpu, calls), s))) in targets.iter().zip(runs).enumerate() {
                let s = measured(t, s, cpu, calls);
                println!(
                    "  round {round} {:<48} {:>8.0} req/s {:>6.2} µs {:.4} calls/request",
                    t.name, s.rps, s.envoy_cpu_us, s.calls_per_request
                );
                samples.entry(i).or_default().push(s);
            }
            continue;
        }
        // Each round starts with another row, so no row always runs first.
        for k in 0..targets.len() {
            let i = (round + k) % targets.len();
            let Some(t) = targets.get(i) else { continue };
            if warm > 0 {
                let _ = run_for(warm, t, key, rate);
            }
            let (cpu, calls) = (cpu_ticks(Some(t.pid)), CallCount::read(&t.admin));
            let s = measured(t, run(t, key, rate), cpu, calls);
            println!(
                "  round {round} {:<48} {:>8.0} req/s {:>6.2} µs p50 {:.3} ms {:.4} calls/request",
                t.name, s.rps, s.envoy_cpu_us, s.p50_ms, s.calls_per_request
            );
            samples.entry(i).or_default().push(s);
        }
    }
    samples
}

/// `MESHLIMIT_BENCH_AB_WARM=<s>`: each measured run follows that many
/// seconds of the same load, unmeasured (default 0).
fn warm_seconds() -> u64 {
    std::env::var("MESHLIMIT_BENCH_AB_WARM")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(0)
}

/// `f` of every row, each in a thread of its own, at once, in the rows'
/// order (a row whose thread failed gets the default).
fn all_at_once<T: Send + Default>(targets: &[Target], f: impl Fn(&Target) -> T + Sync) -> Vec<T> {
    std::thread::scope(|sc| {
        let handles: Vec<_> = targets.iter().map(|t| sc.spawn(|| f(t))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

/// A run's sample with the Envoy's CPU and calls per request since
/// `cpu` and `calls`.
fn measured(t: &Target, s: Sample, cpu: u64, calls: CallCount) -> Sample {
    let calls_per_request = CallCount::read(&t.admin).per_request_since(calls);
    Sample {
        calls_per_request,
        ..with_cpu(t, s, cpu)
    }
}

/// The medians, and the ratios to the do-nothing filter (row 0) of the
/// same round; with `rate`, the p50 each row adds to Envoy alone (the
/// last row).
fn ab_tables(targets: &[Target], samples: &Runs, rate: Option<u64>) {
    let cpu = |i: usize| median_of(samples, i, |s| s.envoy_cpu_us);
    let rps = |i: usize| median_rps(samples, i);
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
        "\n| row | req/s | ratio to the do-nothing filter | median of the rounds' ratios | the same from CPU per request | Envoy CPU per request | minus this build | calls per request |\n|---|---|---|---|---|---|---|---|"
    );
    for (i, t) in targets.iter().enumerate() {
        println!(
            "| {} | {:.0} | {:.3} | {:.3} | {:.3} | {:.2} µs | {:+.2} µs | {:.4} |",
            t.name,
            rps(i),
            rps(i) / rps(0).max(1.0),
            round_ratio(i),
            round_cpu_ratio(i),
            cpu(i),
            cpu(i) - cpu(1),
            median_of(samples, i, |s| s.calls_per_request)
        );
    }
    if let (Some(rate), Some(bare)) = (rate, targets.len().checked_sub(1)) {
        let p50 = |i: usize| median_of(samples, i, |s| s.p50_ms);
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
}
/// The plugin config every build runs: one hot client from leases, or
/// the Zipf mix; with `MESHLIMIT_BENCH_AB_LOCAL=1`, its rule `scope:
/// local` (decided from the Envoy's shared data, no call); with
/// `MESHLIMIT_BENCH_AB_CALLS=each`, every request a call of its own (row
/// 3's config: group commit and leases off), with `=batched`, leases off
/// (rows 15 and 18: calls in group commit's batches).
fn ab_config(zipf: bool) -> String {
    let config = if zipf {
        allow_all().client_id(json!({"headers": ["x-api-key"], "query_params": ["key"]}))
    } else {
        allow_all()
    };
    match std::env::var("MESHLIMIT_BENCH_AB_CALLS").as_deref() {
        Ok("each") if !zipf => return one_call_each(),
        Ok("batched") => return leases_off(config),
        Ok(other) => {
            panic!("MESHLIMIT_BENCH_AB_CALLS={other}: `each` (one hot client only) or `batched`")
        }
        Err(_) => {}
    }
    if flag("MESHLIMIT_BENCH_AB_LOCAL") {
        config.rule_field("scope", json!("local")).build()
    } else {
        config.build()
    }
}

/// One build to run.
struct Build {
    /// What its rows print.
    name: &'static str,
    /// The filter's wasm; `None`: this build.
    wasm: Option<std::path::PathBuf>,
    /// Its plugin config.
    config: String,
    /// Its meshlimit cluster speaks HTTP/1.1 instead of replica.yaml's
    /// HTTP/2.
    cluster_http1: bool,
}

impl Build {
    fn this(name: &'static str, config: &str) -> Build {
        Build {
            name,
            wasm: None,
            config: config.to_string(),
            cluster_http1: false,
        }
    }
}

/// This build, then `others`, each with the name its rows print; with
/// `MESHLIMIT_BENCH_AB_RULES=<n>`, this build twice instead: with
/// `config`, and with `n - 1` more rules the request does not match (the
/// cost of the per-rule stats a configuration defines, five a limit, and
/// of the rules the request is matched against); with
/// `MESHLIMIT_BENCH_AB_HEADERS=<style>`, twice: with `config` and with
/// that `response.headers`; with `MESHLIMIT_BENCH_AB_CLUSTER=http1`,
/// twice: its meshlimit cluster over HTTP/2, as shipped, and over HTTP/1.1
/// (what a call costs each way; with `MESHLIMIT_BENCH_AB_CALLS`, so that
/// there are calls to weigh).
fn ab_builds(others: &[std::path::PathBuf], config: &str) -> Vec<Build> {
    match std::env::var("MESHLIMIT_BENCH_AB_CLUSTER").as_deref() {
        Ok("http1") => {
            return vec![
                Build::this("this build, cluster over HTTP/2", config),
                Build {
                    cluster_http1: true,
                    ..Build::this("this build, cluster over HTTP/1.1", config)
                },
            ]
        }
        Ok(other) => panic!("MESHLIMIT_BENCH_AB_CLUSTER={other}: only `http1` is known"),
        Err(_) => {}
    }
    // MESHLIMIT_BENCH_AB_HEADERS=<style>: this build twice, with the
    // default `response.headers` and with `style` (what a header costs).
    if let Ok(style) = std::env::var("MESHLIMIT_BENCH_AB_HEADERS") {
        let name = format!("this build, headers: {style}");
        return this_build_twice(config, "this build", name, |styled| {
            styled["response"] = json!({ "headers": style });
        });
    }
    let rules: Option<usize> = std::env::var("MESHLIMIT_BENCH_AB_RULES")
        .ok()
        .and_then(|n| n.parse().ok());
    if let Some(n) = rules {
        let name = format!("this build, {n} rules");
        return this_build_twice(config, "this build, 1 rule", name, |many| {
            if let Some(rules) = many["rules"].as_array_mut() {
                for i in 1..n {
                    rules.push(json!({"name": format!("other-{i}"),
                        "match": {"path": {"prefix": format!("/other-{i}/")}},
                        "limits": [{"name": "hour", "requests": 1_000_000_000u64, "window": "1h"}]}));
                }
            }
        });
    }
    for other in others {
        assert!(
            other.exists(),
            "{} is missing: MESHLIMIT_BENCH_AB names the builds to compare with (separated by ':')",
            other.display()
        );
    }
    std::iter::once(Build::this("this build", config))
        .chain(others.iter().map(|p| Build {
            wasm: Some(p.clone()),
            ..Build::this(Box::leak(p.display().to_string().into_boxed_str()), config)
        }))
        .collect()
}

/// This build twice: named `first` with `config`, and named `second` with
/// `config` as `edit` changes it.
fn this_build_twice(
    config: &str,
    first: &'static str,
    second: String,
    edit: impl FnOnce(&mut serde_json::Value),
) -> Vec<Build> {
    let mut edited: serde_json::Value =
        serde_json::from_str(config).unwrap_or_else(|e| panic!("bench config: {e}"));
    edit(&mut edited);
    vec![
        Build::this(first, config),
        Build::this(Box::leak(second.into_boxed_str()), &edited.to_string()),
    ]
}
