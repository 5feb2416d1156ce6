//! `make bench-profile`: what each step of the asynchronous path costs
//! Envoy, from builds that skip one step each.

use std::fmt::Write as _;

use meshlimit_testbed::procs::Proc;
use meshlimit_testbed::tools;
use meshlimit_testbed::{Topology, TopologyOptions};
use serde_json::json;

use crate::configs::{allow_all, leases_off};
use crate::envoys::{baseline_envoy, meshlimit_answering_with, noop_filter};
use crate::full::Runs;
use crate::load::{median_of, median_rps, REPEATS, SATURATION_CONNECTIONS, SECONDS};
use crate::machine::{cpu_ticks, pin_and_warm, with_cpu};
use crate::rows::{direct_row, replica_row, run, Target};

/// `make bench-profile`: what each step of the asynchronous path costs
/// Envoy. The shipped filter with leases off (every request of the hot
/// client calls, through group commit) beside builds that skip one step
/// each (src/flow/profile.rs), Envoy answering itself, pinned as in
/// `make bench`; Envoy's CPU per request, interleaved runs, medians.
/// Writes docs/benchmarks-profile.md.
pub(crate) fn profile() {
    let variants = variants();
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
    let mut samples = Runs::new();
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
    let md = profile_report(&targets, &samples);
    let path = tools::root().join("docs/benchmarks-profile.md");
    let _ = std::fs::write(&path, &md);
    println!("\n{md}\nwritten to {}", path.display());
    drop((runs, bare, noop, base));
}

/// The profile's builds: (row, build, leases on). A build that skips one
/// step is made by `make bench-profile` (src/flow/profile.rs).
fn variants() -> [(&'static str, Option<std::path::PathBuf>, bool); 10] {
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
    [
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
    ]
}

/// docs/benchmarks-profile.md: the rows, then what each step costs.
fn profile_report(targets: &[Target], samples: &Runs) -> String {
    let rps = |i: usize| median_rps(samples, i);
    let cpu = |i: usize| median_of(samples, i, |s| s.envoy_cpu_us);
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
    md
}
