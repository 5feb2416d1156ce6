//! `make bench`'s report: docs/benchmarks.md (tables, the targets met or
//! not) and docs/benchmarks.svg.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use meshlimit_testbed::tools;

use crate::counted::Fallbacks;
use crate::envoys::compare_wasm;
use crate::fleet::FORKS;
use crate::full::{Runs, BUSY_PAIR, LOCAL_PAIR, LOCAL_ZIPF_PAIR, WARM_SECONDS, ZIPF_PAIR};
use crate::load::{
    median, median_of, median_rps, Sample, CONNECTIONS, REPEATS, SATURATION_CONNECTIONS, SECONDS,
};
use crate::machine::{cores, cpu_sets, CpuShare};
use crate::rows::Target;

/// What one `make bench` run measured, by row (indices into `targets`).
pub(crate) struct Report<'a> {
    pub(crate) cpu_split: &'a [CpuShare],
    pub(crate) targets: &'a [Target],
    pub(crate) saturation: &'a Runs,
    /// The target pairs' ratios, by the row measured against its floor.
    pub(crate) paired: &'a BTreeMap<usize, Vec<f64>>,
    pub(crate) unpinned: &'a Runs,
    pub(crate) fixed: &'a Runs,
    /// Calls to meshlimitd per request, and new connections to it.
    pub(crate) calls: &'a [(f64, u64)],
    pub(crate) fallbacks: &'a [Fallbacks],
    /// The fixed rate of the latency runs.
    pub(crate) rate: u64,
    pub(crate) service_rps: f64,
    pub(crate) grpc_rps: f64,
    pub(crate) redis_rps: f64,
    /// Each row's Envoy's resident memory, KiB.
    pub(crate) rss: &'a [u64],
    pub(crate) wasm_bytes: u64,
}

/// Rows answering themselves, by index: bare Envoy, and leases off for
/// one busy client and the Zipf mix.
const BARE_DIRECT: usize = 10;
const UNLEASED: usize = 13;
const UNLEASED_ZIPF: usize = 16;
/// Row 4 (the deny cache), row 21 (a spent token budget) and row 22 (the
/// same POST as 21, refused by a request limit).
const DENY: usize = 3;
const SPENT_BUDGET: usize = 19;
const DENY_SAME_POST: usize = 20;

/// Ratios from the lowest, two decimals each, for the reader to see their
/// spread.
fn in_order(mut ratios: Vec<f64>) -> String {
    ratios.sort_by(f64::total_cmp);
    let shown: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    shown.join(", ")
}

fn check(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "**not met**"
    }
}

impl Report<'_> {
    fn sat(&self, i: usize) -> f64 {
        median_rps(self.saturation, i)
    }

    fn envoy_cpu(&self, i: usize) -> f64 {
        median_of(self.saturation, i, |s| s.envoy_cpu_us)
    }

    fn lat(&self, i: usize, f: fn(&Sample) -> f64) -> f64 {
        median_of(self.fixed, i, f)
    }

    fn p50(&self, i: usize) -> f64 {
        self.lat(i, |s| s.p50_ms)
    }

    fn per_rq(&self, i: usize) -> f64 {
        self.calls.get(i).map_or(1.0, |c| c.0)
    }

    /// A pair's ratio: the median of its side-by-side runs' ratios.
    fn pair_ratio(&self, row: usize) -> f64 {
        median(self.paired.get(&row).cloned().unwrap_or_default())
    }

    /// A pair's ratios, in order, for the reader to see their spread.
    fn pairs_seen(&self, row: usize) -> String {
        let ratios = self.paired.get(&row).cloned().unwrap_or_default();
        format!("{} pairs: {}", ratios.len(), in_order(ratios))
    }

    /// The saturation repeats' ratios of `row` to `floor`, in order: each
    /// run a minute or more after the row's last, so a leased row's
    /// clients start without their leases.
    fn cold_ratios(&self, floor: usize, row: usize) -> String {
        let (Some(fs), Some(rs)) = (self.saturation.get(&floor), self.saturation.get(&row)) else {
            return "none".to_string();
        };
        in_order(
            fs.iter()
                .zip(rs)
                .map(|(f, r)| r.rps / f.rps.max(1.0))
                .collect(),
        )
    }

    /// Writes docs/benchmarks.md and .svg (target/bench-compare.* when a
    /// compare build ran: a measurement for a change, not the project's
    /// report), and prints the markdown.
    pub(crate) fn write(&self) {
        let mut md = self.header();
        self.table(&mut md);
        self.call_targets(&mut md);
        self.batching_targets(&mut md);
        self.hit_path_targets(&mut md);
        self.unpinned_table(&mut md);
        self.cpu_table(&mut md);
        self.footer(&mut md);
        let (path, svg) = if compare_wasm().is_some() {
            ("target/bench-compare.md", "target/bench-compare.svg")
        } else {
            ("docs/benchmarks.md", "docs/benchmarks.svg")
        };
        let (path, svg) = (tools::root().join(path), tools::root().join(svg));
        let _ = std::fs::write(&path, &md);
        let chart = chart(self.targets, &|i| self.sat(i), &|i| {
            self.lat(i, |s| s.p99_ms)
        });
        let _ = std::fs::write(&svg, chart);
        println!(
            "\n{md}\nwritten to {} and {}",
            path.display(),
            svg.display()
        );
    }

    fn header(&self) -> String {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| {
                c.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_default();
        let pinning = match (self.unpinned.is_empty(), cpu_sets()) {
            (false, Some((envoy, others))) => format!(
                "The Envoy under test runs alone on CPU {envoy}, as a proxy's worker has a core to itself in \
                 production; its upstream, meshlimitd, Redis and the load generator share CPU(s) {others}, \
                 where the other Envoys under test wait for their runs (in production meshlimitd and Redis run on other machines). A table of unpinned runs follows."
            ),
            _ => "No CPU pinning: every process shares the machine's cores.".to_string(),
        };
        format!(
            "# Benchmarks\n\nGenerated by `make bench` (tests/src/bin/meshlimit-bench/) on {} cores ({cpu}), \
             loopback. Each Envoy runs one worker; the upstream is another Envoy (one worker) answering 200; \
             meshlimitd runs tokio's default two worker threads; Redis is Debian's redis-server. \
             {pinning} The load generator is oha: {SATURATION_CONNECTIONS} connections \
             for throughput, {CONNECTIONS} for latency at a fixed rate. \
             Runs of {SECONDS} s, interleaved across configurations and repeated {REPEATS} times; medians. \
             Ratios are to configuration 1 from the same run: absolute numbers move with the machine's load, \
             ratios much less. The targets against the do-nothing filter are read from pairs run side by \
             side, in {} Envoys of each of their rows: the rows' own and {FORKS} forks (see the notes), each \
             row's run right after {WARM_SECONDS} s of its own load, unmeasured: the steady state, not the \
             restart of clients whose leases went back while the row waited.\n\n",
            cores(),
            FORKS + 1
        )
    }

    /// The main table, row 6 (meshlimitd alone), and which rows fell back.
    fn table(&self, md: &mut String) {
        let base = self.sat(0);
        let rate = self.rate;
        let _ = writeln!(md, "| configuration | throughput (req/s) | ratio | Envoy CPU per request | p50 at {rate} req/s | p99 | p99.9 | added p99 vs 1 | calls to meshlimitd per request | new connections to meshlimitd | Envoy RSS |\n|---|---|---|---|---|---|---|---|---|---|---|");
        for (i, t) in self.targets.iter().enumerate() {
            let (per_rq, cx) = self.calls.get(i).copied().unwrap_or((0.0, 0));
            let _ = writeln!(
                md,
                "| {} | {:.0} | **{:.2}** | {:.0} µs | {:.3} ms | {:.3} ms | {:.3} ms | {:+.3} ms | {:.2} | {} | {} MiB |",
                t.name,
                self.sat(i),
                self.sat(i) / base,
                self.envoy_cpu(i),
                self.p50(i),
                self.lat(i, |s| s.p99_ms),
                self.lat(i, |s| s.p999_ms),
                self.lat(i, |s| s.p99_ms) - self.lat(0, |s| s.p99_ms),
                per_rq,
                cx,
                self.rss.get(i).copied().unwrap_or(0) / 1024
            );
        }
        let (service, grpc, redis) = (self.service_rps, self.grpc_rps, self.redis_rps);
        let _ = writeln!(
            md,
            "| 6. meshlimitd alone (HTTP checks) | {service:.0} | **{:.2}** of redis-benchmark | | | | | | | | |\n| 6''. meshlimitd alone (gRPC `ShouldRateLimit`) | {grpc:.0} | **{:.2}** of redis-benchmark | | | | | | | | |\n| 6'. redis-benchmark, same script (EVALSHA) | {redis:.0} | 1.00 | | | | | | | | |\n",
            service / redis.max(1.0),
            grpc / redis.max(1.0)
        );
        // Row 5 decides by its fallback by design; any other row that fell
        // back measured something else than its name says.
        let fell_back: Vec<String> = self
            .targets
            .iter()
            .zip(self.fallbacks)
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
        let _ = writeln!(md, "{fell_back}\n");
    }

    /// Targets of the rows with calls: one call per request (3), the deny
    /// cache (4), the open breaker (5), meshlimitd alone (6), gRPC (11).
    fn call_targets(&self, md: &mut String) {
        let base = self.sat(0);
        let (service, grpc, redis) = (self.service_rps, self.grpc_rps, self.redis_rps);
        let _ = writeln!(md, "## Targets\n\n| target | measured | |\n|---|---|---|");
        let _ = writeln!(
            md,
            "| (3) throughput >= 0.25 of (1) | {:.2} | {} |",
            self.sat(2) / base,
            check(self.sat(2) / base >= 0.25)
        );
        let added = self.lat(2, |s| s.p99_ms) - self.lat(0, |s| s.p99_ms);
        let _ = writeln!(
            md,
            "| (3) added p99 at the fixed rate <= 1 ms | {added:+.3} ms | {} |",
            check(added <= 1.0)
        );
        let added_gc = self.lat(5, |s| s.p99_ms) - self.lat(0, |s| s.p99_ms);
        let _ = writeln!(
            md,
            "| (7) the default (group commit): added p99 at the fixed rate <= 1 ms | {added_gc:+.3} ms | {} |",
            check(added_gc <= 1.0)
        );
        for (row, what) in [
            (3, "abuse costs no round trip"),
            (4, "an outage costs no timeout"),
        ] {
            let _ = writeln!(
                md,
                "| ({}) >= 0.6 of (1): {what} | {:.2} | {} |",
                row + 1,
                self.sat(row) / base,
                check(self.sat(row) / base >= 0.6)
            );
        }
        for (row, what, rps) in [
            ("(6)", "", service),
            ("(6'')", " the rate limit service's gRPC path", grpc),
        ] {
            let _ = writeln!(
                md,
                "| {row}{what} >= 0.5 of redis-benchmark EVALSHA | {:.2} | {} |",
                rps / redis.max(1.0),
                check(redis > 0.0 && rps / redis.max(1.0) >= 0.5)
            );
        }
        let _ = writeln!(
            md,
            "| (11) Envoy's native ratelimit filter with meshlimitd over gRPC, beside the wasm filter (7) and bare Envoy (1) | {:.2} of (1), {:.2} of (7); one gRPC call per request ({:.2}), no batching | measured |",
            self.sat(9) / base,
            self.sat(9) / self.sat(5).max(1.0),
            self.calls.get(9).map_or(0.0, |c| c.0)
        );
        let _ = writeln!(
            md,
            "| wasm module < 1 MiB | {} KiB | {} |",
            self.wasm_bytes / 1024,
            check(self.wasm_bytes < tools::WASM_MAX_BYTES)
        );
    }

    /// Targets of group commit (7, 8), policies (9) and token budgets (10).
    fn batching_targets(&self, md: &mut String) {
        let base = self.sat(0);
        let gc = self.sat(5).max(self.sat(6));
        let _ = writeln!(
            md,
            "| group commit at saturation >= 0.5 of (1) | {:.2} (one hot client {:.2}, 1000 clients {:.2}) | {} |",
            gc / base,
            self.sat(5) / base,
            self.sat(6) / base,
            check(gc / base >= 0.5)
        );
        let _ = writeln!(
            md,
            "| group commit p50 at the fixed rate no worse than one call per request (3) | {:.3} vs {:.3} ms | {} |",
            self.p50(5),
            self.p50(2),
            check(self.p50(5) <= self.p50(2) * 1.1)
        );
        let (cpu, one) = (self.envoy_cpu(7), self.envoy_cpu(5));
        let _ = writeln!(
            md,
            "| (9) three matched rules with header conditions: at most 10% more Envoy CPU per request than one rule (7) | {cpu:.0} vs {one:.0} µs: {:+.0}% (throughput {:.2} of (7): meshlimitd and Redis, on the other core, do three limits' work) | {} |",
            (cpu / one.max(0.001) - 1.0) * 100.0,
            self.sat(7) / self.sat(5).max(1.0),
            check(cpu <= one * 1.10)
        );
        let _ = writeln!(
            md,
            "| calls to meshlimitd per request at saturation with group commit: well under 0.2 | {:.2} (one hot client), {:.2} (1000 clients); one call per request: {:.2} | {} |",
            self.per_rq(5),
            self.per_rq(6),
            self.per_rq(2),
            check(self.per_rq(5) < 0.2 && self.per_rq(6) < 0.2)
        );
        let _ = writeln!(
            md,
            "| (10) a token budget, non-streamed: calls to meshlimitd per request with settlements included, under 0.2 | {:.2} (a check and a settlement per request, in group commit's batches); throughput {:.2} of (7), Envoy CPU {:.0} vs {:.0} µs per request (the body is read, a second job batched) | {} |",
            self.per_rq(8),
            self.sat(8) / self.sat(5).max(1.0),
            self.envoy_cpu(8),
            one,
            check(self.per_rq(8) < 0.2)
        );
        // Row 21 is read against row 22, the same request refused by a
        // request limit: what the token budget adds to refusing it. The
        // POST costs more than row 4's GET whatever refuses it (its body,
        // and HTTP/1.1 closing a connection answered before its body is
        // in), and that is shown beside.
        let (spent, same, get) = (
            self.envoy_cpu(SPENT_BUDGET),
            self.envoy_cpu(DENY_SAME_POST),
            self.envoy_cpu(DENY),
        );
        let _ = writeln!(
            md,
            "| (21) a spent token budget refused at the headers costs no more than any other deny of the same request (22): Envoy CPU per request within 10% | {spent:.0} vs {same:.0} µs: {:+.0}% (throughput {:.2} of (22); calls per request {:.2}; its POST's body is never read). The deny cache's GET (4): {get:.0} µs | {} |",
            (spent / same.max(0.001) - 1.0) * 100.0,
            self.sat(SPENT_BUDGET) / self.sat(DENY_SAME_POST).max(1.0),
            self.per_rq(SPENT_BUDGET),
            check(spent <= same * 1.10)
        );
    }

    /// Targets of the rows answering themselves (12 to 20): a lease hit
    /// and a `scope: local` rule against the do-nothing filter.
    fn hit_path_targets(&self, md: &mut String) {
        let ((noop, leased), (noop_zipf, leased_zipf)) = (BUSY_PAIR, ZIPF_PAIR);
        let _ = writeln!(
            md,
            "| (14) one busy client, meshlimit's default (leases) >= 0.9 of the do-nothing wasm filter (13), side by side | {:.2} of (13), the median of {}; the medians' ratio {:.2} ({:.2} of (12); leases off (15): {:.2} of (13)) | {} |",
            self.pair_ratio(leased),
            self.pairs_seen(leased),
            self.sat(leased) / self.sat(noop).max(1.0),
            self.sat(leased) / self.sat(BARE_DIRECT).max(1.0),
            self.sat(UNLEASED) / self.sat(noop).max(1.0),
            check(self.pair_ratio(leased) >= 0.9)
        );
        let _ = writeln!(
            md,
            "| (14) calls to meshlimitd per request under 0.01 | {:.4} (leases off (15): {:.3}) | {} |",
            self.per_rq(leased),
            self.per_rq(UNLEASED),
            check(self.per_rq(leased) < 0.01)
        );
        let _ = writeln!(
            md,
            "| (17) 1000 clients, Zipf: >= 0.7 of the do-nothing wasm filter on the same mix (16), side by side | {:.2} of (16), the median of {}; from cold (the repeats, each a minute or more after the row's last run: its clients' leases had gone back) {}, the medians' ratio {:.2}; {:.4} calls per request (leases off (18): {:.2} of (16), {:.3} calls per request) | {} |",
            self.pair_ratio(leased_zipf),
            self.pairs_seen(leased_zipf),
            self.cold_ratios(noop_zipf, leased_zipf),
            self.sat(leased_zipf) / self.sat(noop_zipf).max(1.0),
            self.per_rq(leased_zipf),
            self.sat(UNLEASED_ZIPF) / self.sat(noop_zipf).max(1.0),
            self.per_rq(UNLEASED_ZIPF),
            check(self.pair_ratio(leased_zipf) >= 0.7)
        );
        for ((_, local), (floor, target)) in [
            (LOCAL_PAIR, ("one busy client", 0.9)),
            (LOCAL_ZIPF_PAIR, ("1000 clients, Zipf", 0.7)),
        ] {
            let _ = writeln!(
                md,
                "| ({}) {floor}, a `scope: local` rule >= {target} of the do-nothing wasm filter, side by side | {:.2}, the median of {}; the medians' ratio {:.2}; {:.4} calls per request | {} |",
                local + 2,
                self.pair_ratio(local),
                self.pairs_seen(local),
                self.sat(local) / self.sat(if target > 0.8 { noop } else { noop_zipf }).max(1.0),
                self.per_rq(local),
                check(self.pair_ratio(local) >= target)
            );
        }
        let added_p50 = self.p50(leased) - self.p50(BARE_DIRECT);
        let _ = writeln!(
            md,
            "| (14) a leased client: p50 added at the fixed rate, vs (12), under 0.1 ms | {added_p50:+.3} ms (the do-nothing filter (13): {:+.3} ms; leases off (15): {:+.3} ms) | {} |",
            self.p50(noop) - self.p50(BARE_DIRECT),
            self.p50(UNLEASED) - self.p50(BARE_DIRECT),
            check(added_p50 < 0.1)
        );
    }

    fn unpinned_table(&self, md: &mut String) {
        if self.unpinned.is_empty() {
            return;
        }
        let free = |i: usize| median_rps(self.unpinned, i);
        let _ = writeln!(
            md,
            "\n## Unpinned\n\nThe same saturation runs with every process free to run on every core (the \
             load generator, both Envoys, meshlimitd and Redis competing for the same {} cores), after the \
             pinned ones; medians of {REPEATS}.\n\n| configuration | throughput (req/s) | ratio unpinned | ratio pinned (above) |\n|---|---|---|---|",
            cores()
        );
        for (i, t) in self.targets.iter().enumerate() {
            if self.unpinned.contains_key(&i) {
                let _ = writeln!(
                    md,
                    "| {} | {:.0} | **{:.2}** | {:.2} |",
                    t.name,
                    free(i),
                    free(i) / free(0),
                    self.sat(i) / self.sat(0)
                );
            }
        }
    }

    fn cpu_table(&self, md: &mut String) {
        let Some(first) = self.cpu_split.first() else {
            return;
        };
        let _ = writeln!(md, "\n## Where the time goes\n\nCPU (user + system) per 1000 requests during the first saturation run, from `/proc`: milliseconds of CPU, all processes on the machine's {} cores.\n", cores());
        let names: Vec<&str> = first.per_1000.iter().map(|(n, _)| *n).collect();
        let _ = writeln!(md, "| configuration | {} | total |", names.join(" | "));
        let _ = writeln!(md, "|---|{}---|", "---|".repeat(names.len()));
        for c in self.cpu_split {
            let total: f64 = c.per_1000.iter().map(|(_, v)| v).sum();
            let cells: Vec<String> = c.per_1000.iter().map(|(_, v)| format!("{v:.0}")).collect();
            let _ = writeln!(md, "| {} | {} | {total:.0} |", c.name, cells.join(" | "));
        }
    }

    /// Memory per VM, bad statuses, and docs/benchmarks-notes.md.
    fn footer(&self, md: &mut String) {
        let bad: u64 = self
            .saturation
            .values()
            .chain(self.fixed.values())
            .flatten()
            .map(|s| s.non_2xx_4xx)
            .sum();
        let rss = |i: usize| self.rss.get(i).copied().unwrap_or(0) as f64;
        let vm = (rss(2) - rss(0)) / 2.0 / 1024.0;
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
    }
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
