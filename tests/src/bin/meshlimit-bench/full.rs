//! `make bench`: every configuration side by side in one run (see the
//! crate doc for the rows), then the report (`report`).

use std::collections::BTreeMap;

use meshlimit_testbed::procs::rss_kib;
use meshlimit_testbed::tools;
use meshlimit_testbed::topology::GRPC_PORT;

use crate::counted::{CallCount, Fallbacks};
use crate::fleet::Fleet;
use crate::load::{median, median_rps, Sample, REPEATS, SECONDS};
use crate::machine::{busy_ticks, cpu_ticks, pin_for_runs, stat, unpin_all, with_cpu, CpuShare};
use crate::report::Report;
use crate::rows::{run, run_for, Target};
use crate::service::{grpc_load, redis_benchmark};

/// Configurations (indices into the targets) also run unpinned.
const UNPINNED: [usize; 4] = [0, 2, 5, 6];
/// The throughput targets' pairs of configurations (indices into the
/// targets): the do-nothing filter (13, 16) beside meshlimit's default
/// (14, 17) and a `scope: local` rule (19, 20), one busy client and the
/// Zipf mix.
pub(crate) const BUSY_PAIR: (usize, usize) = (11, 12);
pub(crate) const ZIPF_PAIR: (usize, usize) = (14, 15);
pub(crate) const LOCAL_PAIR: (usize, usize) = (11, 17);
pub(crate) const LOCAL_ZIPF_PAIR: (usize, usize) = (14, 18);
/// The rows of those pairs, each also run in forks (`fleet::FORKS`).
pub(crate) const PAIR_ROWS: [usize; 6] = [11, 12, 14, 15, 17, 18];
/// Runs of each target pair, side by side (in turn first and second),
/// each in the forks' processes in turn. A target is read from the pair's
/// ratios, each of two runs next to each other: the three repeats'
/// medians of a row alone spanned 0.84 to 1.00 of the floor in one run,
/// too wide for a target at 0.9.
const TARGET_PAIRS: usize = 11;
/// Seconds of a pair row's own load, unmeasured, right before each of its
/// target-pair runs. A row waits a minute or more between its runs, and a
/// leased row gives its clients' leases back once they idle for
/// `leases.interval` (2 s): measured cold, the Zipf mix's run is also the
/// restart of its 1,000 clients (a cold check, then a first ask, each),
/// not the steady state the target names. The saturation repeats stay
/// cold; the report shows the mix's ratio there too.
pub(crate) const WARM_SECONDS: u64 = 3;

/// Pins the Envoys under test to wait off the test core (each runs there
/// alone, see `machine::pin_for_runs`) and everything else to the other
/// cores (`pinned`), or lets every process run anywhere. Whether the runs
/// are pinned (not on one core).
fn set_pinning(targets: &[&Target], support: &[Option<u32>], pinned: bool) -> bool {
    if pinned {
        return pin_for_runs(targets.iter().map(|t| t.pid), support.iter().copied());
    }
    unpin_all(
        targets
            .iter()
            .map(|t| Some(t.pid))
            .chain(support.iter().copied()),
    );
    false
}

/// The client id a row sends: row 4's client is over its limit.
fn key(t: &Target) -> &'static str {
    if t.name.starts_with("4.") {
        "x-api-key: abuser"
    } else {
        "x-api-key: bench"
    }
}

/// Samples by row.
pub(crate) type Runs = BTreeMap<usize, Vec<Sample>>;

/// `make bench`.
pub(crate) fn bench() {
    println!(
        "meshlimit bench: {SECONDS}s runs, {} connections, {REPEATS} repeats, interleaved",
        crate::load::SATURATION_CONNECTIONS
    );
    let fleet = Fleet::start();
    let targets = fleet.targets();
    let forks = fleet.fork_targets();
    for (i, fork_row) in forks.iter().flatten() {
        assert_eq!(
            targets.get(*i).map(|t| t.name),
            Some(fork_row.name),
            "a fork's row {i} is not the row the pairs read there"
        );
    }
    // Every Envoy under test, the forks' too.
    let measured: Vec<&Target> = targets
        .iter()
        .chain(forks.iter().flat_map(BTreeMap::values))
        .collect();
    // The Envoy under test gets a core of its own, as a proxy's worker does
    // in production; its upstream, meshlimitd, Redis and the load generator
    // share the others (in production meshlimitd and Redis are on other
    // machines altogether). Unpinned runs of a few configurations follow.
    let support = fleet.support_pids();
    let pinned = set_pinning(&measured, &support, true);
    // Warm up: JIT, connections, the deny cache, the open breaker.
    for t in &measured {
        let _ = run(t, key(t), Some(2_000));
    }
    let calls_before: Vec<(CallCount, u64)> = targets.iter().map(call_counts).collect();
    let fallbacks_before: Vec<Fallbacks> =
        targets.iter().map(|t| Fallbacks::read(&t.admin)).collect();
    let (saturation, cpu) = saturation_runs(&fleet, &targets);
    let calls: Vec<(f64, u64)> = targets
        .iter()
        .zip(&calls_before)
        .map(|(t, (calls0, cx0))| {
            let (calls, cx) = call_counts(t);
            (calls.per_request_since(*calls0), cx.saturating_sub(*cx0))
        })
        .collect();
    let paired = target_pairs(&targets, &forks);
    // Over the saturation runs and the target pairs: every run a ratio is
    // read from.
    let fallbacks: Vec<Fallbacks> = targets
        .iter()
        .zip(&fallbacks_before)
        .map(|(t, before)| Fallbacks::read(&t.admin).since(before))
        .collect();
    let rate = fixed_rate(&saturation);
    let fixed = fixed_runs(&targets, rate);
    // Unpinned: every process may run on every core, as on a busy node.
    set_pinning(&measured, &support, false);
    let unpinned = if pinned {
        unpinned_runs(&targets)
    } else {
        Runs::new()
    };
    let (service_rps, grpc_rps, redis_rps) = service_runs(&fleet);
    let report = Report {
        cpu_split: &cpu,
        targets: &targets,
        saturation: &saturation,
        paired: &paired,
        unpinned: &unpinned,
        fixed: &fixed,
        calls: &calls,
        fallbacks: &fallbacks,
        rate,
        service_rps,
        grpc_rps,
        redis_rps,
        rss: &targets
            .iter()
            .map(|t| rss_kib(Some(t.pid)))
            .collect::<Vec<_>>(),
        wasm_bytes: std::fs::metadata(tools::wasm())
            .map(|m| m.len())
            .unwrap_or(0),
    };
    report.write();
    drop(fleet);
}

/// A row's requests and calls to meshlimitd, and its new connections to
/// meshlimitd, so far.
fn call_counts(t: &Target) -> (CallCount, u64) {
    (
        CallCount::read(&t.admin),
        stat(&t.admin, "cluster.meshlimit.upstream_cx_total"),
    )
}

/// Every row as fast as it goes, interleaved, [`REPEATS`] times; the
/// first repeat of 3 and 7 also splits the machine's CPU by process.
fn saturation_runs(fleet: &Fleet, targets: &[Target]) -> (Runs, Vec<CpuShare>) {
    let mut saturation = Runs::new();
    let mut cpu: Vec<CpuShare> = Vec::new();
    for rep in 0..REPEATS {
        for (i, t) in targets.iter().enumerate() {
            let watched = fleet.watched(i);
            let before: Vec<u64> = watched.iter().map(|(_, p)| cpu_ticks(*p)).collect();
            let busy_before = busy_ticks();
            let envoy_before = cpu_ticks(Some(t.pid));
            let s = with_cpu(t, run(t, key(t), None), envoy_before);
            if rep == 0 && !watched.is_empty() {
                cpu.push(cpu_share(t.name, &s, &watched, &before, busy_before));
            }
            println!(
                "  saturation {rep} {:<52} {:>8.0} req/s  p99 {:.2} ms",
                t.name, s.rps, s.p99_ms
            );
            saturation.entry(i).or_default().push(s);
        }
    }
    (saturation, cpu)
}

/// Milliseconds of CPU per 1000 requests of run `s`, by process, and the
/// rest of the machine's (mostly the load generator).
fn cpu_share(
    name: &'static str,
    s: &Sample,
    watched: &[(&'static str, Option<u32>)],
    before: &[u64],
    busy_before: u64,
) -> CpuShare {
    let requests = (s.rps * SECONDS as f64).max(1.0);
    let tick_ms = 10.0; // USER_HZ is 100 on Linux
    let mut per_1000: Vec<(&'static str, f64)> = watched
        .iter()
        .zip(before)
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
    CpuShare { name, per_1000 }
}

/// The target pairs' ratios: [`TARGET_PAIRS`] pairs, each row in turn
/// first, each in the next fork's processes, each row's run right after
/// [`WARM_SECONDS`] of its own load.
fn target_pairs(
    targets: &[Target],
    forks: &[BTreeMap<usize, Target>],
) -> BTreeMap<usize, Vec<f64>> {
    let mut paired: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for (floor, row) in [BUSY_PAIR, ZIPF_PAIR, LOCAL_PAIR, LOCAL_ZIPF_PAIR] {
        let ratios = paired.entry(row).or_default();
        for k in 0..TARGET_PAIRS {
            let fork = forks.get(k % forks.len().max(1));
            let pick = |i: usize| fork.and_then(|f| f.get(&i)).or_else(|| targets.get(i));
            let (Some(ft), Some(rt)) = (pick(floor), pick(row)) else {
                continue;
            };
            let rps = |t: &Target| {
                let _ = run_for(WARM_SECONDS, t, key(t), None);
                run(t, key(t), None).rps
            };
            let (f, r) = if k % 2 == 0 {
                let f = rps(ft);
                (f, rps(rt))
            } else {
                let r = rps(rt);
                (rps(ft), r)
            };
            println!(
                "  pair {k} (fork {}) {:<52} {:.3} of the do-nothing filter ({r:.0} vs {f:.0} req/s)",
                k % forks.len().max(1) + 1,
                rt.name,
                r / f.max(1.0)
            );
            ratios.push(r / f.max(1.0));
        }
    }
    paired
}

/// The rate latency is measured at: half the slowest row's median
/// throughput, in hundreds.
fn fixed_rate(saturation: &Runs) -> u64 {
    let min = saturation
        .keys()
        .map(|&i| median_rps(saturation, i))
        .fold(f64::MAX, f64::min);
    let rate = ((min * 0.5 / 100.0).floor() * 100.0).max(100.0) as u64;
    println!("fixed rate for latency: {rate} req/s");
    rate
}

fn fixed_runs(targets: &[Target], rate: u64) -> Runs {
    let mut fixed = Runs::new();
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
    fixed
}

fn unpinned_runs(targets: &[Target]) -> Runs {
    let mut unpinned = Runs::new();
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
    unpinned
}

/// Row 6: meshlimitd alone over HTTP and gRPC, and redis-benchmark running
/// the same script; medians of checks per second.
fn service_runs(fleet: &Fleet) -> (f64, f64, f64) {
    let check = r#"{"checks":[{"subject":"hdr:x-api-key:bench6","limits":[{"name":"api/hour","requests":1000000000,"window_ms":3600000,"algorithm":"fixed_window"}]}]}"#;
    let service_url = format!("http://{}/v1/check", fleet.global.meshlimitd_addr());
    let sha = fleet
        .global
        .redis_cli(&["script", "load", meshlimitd::script::CHECK])
        .trim()
        .to_string();
    let (mut service, mut grpc, mut redis) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..REPEATS {
        let s = crate::load::load(
            crate::load::SECONDS,
            &service_url,
            &[],
            None,
            Some(check),
            crate::load::Url::One,
        );
        let g = grpc_load(&fleet.native.addr(GRPC_PORT));
        let r = redis_benchmark(&fleet.global.host, &sha);
        println!(
            "  service {rep}: meshlimitd {:.0} checks/s (gRPC {g:.0}/s), redis-benchmark EVALSHA {:.0}/s",
            s.rps, r
        );
        service.push(s.rps);
        grpc.push(g);
        redis.push(r);
    }
    (median(service), median(grpc), median(redis))
}
