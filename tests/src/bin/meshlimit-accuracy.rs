//! `make accuracy`: replays generated traffic against a real Redis through
//! meshlimitd and compares each algorithm with the exact answer to "at most
//! N requests in any window of length W". Writes `docs/accuracy.md`.
//!
//! Every event of a trace is one call to meshlimitd carrying four checks,
//! one per algorithm (each its own key), so all four decide the same
//! traffic at the same Redis time. Each decision is judged against the
//! definition applied to the algorithm's own admissions: admitting while N
//! of them already lie in the preceding W is a wrong admission; denying
//! while fewer than N do is a wrong denial. (Comparing with an independent
//! exact run instead would count every later difference of two histories
//! that diverged once.)

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use meshlimit_testbed::http;
use meshlimit_testbed::procs::TempDir;
use meshlimit_testbed::services::{unique_host, Meshlimitd, RedisServer};
use meshlimit_testbed::tools;

const N: u64 = 10;
const W_MS: u64 = 1_000;
const ALGORITHMS: [&str; 4] = [
    "fixed_window",
    "sliding_window_log",
    "sliding_window_counter",
    "token_bucket",
];

/// A deterministic generator (xorshift), so traces are the same every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() % 1_000_000) as f64 / 1_000_000.0
    }
    /// Exponential inter-arrival time with the given rate per second.
    fn gap_ms(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate * 1000.0
    }
}

/// (offset in ms from the trace start, client)
type Trace = Vec<(f64, String)>;

fn steady(rng: &mut Rng) -> Trace {
    let mut t = 0.0;
    let mut out = Vec::new();
    while t < 6_000.0 {
        t += rng.gap_ms(1.5 * N as f64);
        out.push((t, "steady".to_string()));
    }
    out
}

/// N requests in the last 60 ms of a window and N in the first 60 ms of the
/// next, repeatedly: the case fixed windows get wrong. Offsets are relative
/// to a window boundary (the replay starts on one).
fn edges(_rng: &mut Rng) -> Trace {
    let mut out = Vec::new();
    for pair in 0..4u64 {
        let edge = (2 * pair + 1) as f64 * W_MS as f64 + 1_000.0;
        for i in 0..N {
            out.push((edge - 60.0 + i as f64 * 5.0, "edgy".to_string()));
            out.push((edge + 5.0 + i as f64 * 5.0, "edgy".to_string()));
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

fn many_clients(rng: &mut Rng) -> Trace {
    let mut out = Vec::new();
    for c in 0..50 {
        let rate = N as f64 * (0.5 + 2.5 * rng.unit());
        let mut t = rng.unit() * 200.0;
        while t < 5_000.0 {
            out.push((t, format!("client-{c}")));
            t += rng.gap_ms(rate);
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

struct Event {
    client: String,
    /// Midpoint of send and receive, µs: when Redis decided.
    at_us: u64,
    admitted: [bool; 4],
}

fn body(run: &str, client: &str) -> Vec<u8> {
    let checks: Vec<serde_json::Value> = ALGORITHMS
        .iter()
        .map(|a| {
            serde_json::json!({
                "subject": format!("{run}:{client}"),
                "limits": [{"name": format!("acc/{a}"), "requests": N, "window_ms": W_MS, "algorithm": a}]
            })
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({ "checks": checks })).unwrap_or_default()
}

fn replay(addr: &str, run: &str, trace: &Trace) -> Vec<Event> {
    // Start on a window boundary so the edge trace hits real edges.
    let now = now_ms();
    std::thread::sleep(Duration::from_millis(W_MS - now % W_MS));
    let start = Instant::now();
    let mut events = Vec::with_capacity(trace.len());
    for (offset, client) in trace {
        let due = Duration::from_micros((offset * 1000.0) as u64);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let sent = SystemTime::now();
        let reply = http::request(addr, "POST", "/v1/check", &[], &body(run, client));
        let recv = SystemTime::now();
        let Ok(reply) = reply else { continue };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&reply.body) else {
            continue;
        };
        let mut admitted = [false; 4];
        for (i, a) in admitted.iter_mut().enumerate() {
            *a = v["results"][i]["allowed"] == serde_json::json!(true);
        }
        let us =
            |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64;
        events.push(Event {
            client: client.clone(),
            at_us: (us(sent) + us(recv)) / 2,
            admitted,
        });
    }
    events
}

#[derive(Default, Clone)]
struct Score {
    requests: u64,
    wrongly_admitted: u64,
    wrongly_denied: u64,
    /// Most admissions of one client in any window of length W.
    worst_window: u64,
}

fn score(events: &[Event]) -> [Score; 4] {
    let mut scores: [Score; 4] = Default::default();
    let w_us = W_MS * 1000;
    let mut by_client: HashMap<&str, Vec<&Event>> = HashMap::new();
    for e in events {
        by_client.entry(&e.client).or_default().push(e);
    }
    for evs in by_client.values() {
        for (i, s) in scores.iter_mut().enumerate() {
            let mut recent: VecDeque<u64> = VecDeque::new();
            for e in evs {
                while recent.front().is_some_and(|&t| t + w_us <= e.at_us) {
                    recent.pop_front();
                }
                let room = (recent.len() as u64) < N;
                s.requests += 1;
                match (e.admitted[i], room) {
                    (true, false) => s.wrongly_admitted += 1,
                    (false, true) => s.wrongly_denied += 1,
                    _ => {}
                }
                if e.admitted[i] {
                    recent.push_back(e.at_us);
                    s.worst_window = s.worst_window.max(recent.len() as u64);
                }
            }
        }
    }
    scores
}

/// Redis bytes of one client's key for each algorithm, measured right
/// after the client used its whole quota (the sliding log then holds N
/// members; fixed-window keys would otherwise have expired already).
fn memory_per_client(addr: &str, redis: &RedisServer) -> [f64; 4] {
    let mut out = [0.0; 4];
    for (i, a) in ALGORITHMS.iter().enumerate() {
        let b = serde_json::to_vec(&serde_json::json!({"checks": [{
            "subject": "memory-probe",
            "limits": [{"name": format!("mem/{a}"), "requests": N, "window_ms": 60_000, "algorithm": a}]
        }]}))
        .unwrap_or_default();
        for _ in 0..N {
            let _ = http::request(addr, "POST", "/v1/check", &[], &b);
        }
        let key = redis.cli(&["--scan", "--pattern", &format!("ml:*mem/{a}:*")]);
        out[i] = redis
            .cli(&["memory", "usage", key.trim()])
            .trim()
            .parse()
            .unwrap_or(0.0);
    }
    out
}

fn command_calls(redis: &RedisServer) -> BTreeMap<String, u64> {
    redis
        .cli(&["info", "commandstats"])
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .next()?
                .strip_prefix("calls=")?
                .parse()
                .ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// Redis commands (inside the script, plus the EVALSHA) per decision.
fn commands_per_decision(addr: &str, redis: &RedisServer) -> [f64; 4] {
    let mut out = [0.0; 4];
    for (i, a) in ALGORITHMS.iter().enumerate() {
        let before = command_calls(redis);
        let n = 200;
        for k in 0..n {
            let b = serde_json::to_vec(&serde_json::json!({"checks": [{
                "subject": format!("cmd-{}", k % 20),
                "limits": [{"name": format!("cmd/{a}"), "requests": N, "window_ms": W_MS, "algorithm": a}]
            }]}))
            .unwrap_or_default();
            let _ = http::request(addr, "POST", "/v1/check", &[], &b);
        }
        let after = command_calls(redis);
        let total: u64 = after
            .iter()
            .filter(|(name, _)| !matches!(name.as_str(), "info" | "script" | "ping"))
            .map(|(name, calls)| calls - before.get(name).copied().unwrap_or(0))
            .sum();
        out[i] = total as f64 / n as f64;
    }
    out
}

fn pct(n: u64, of: u64) -> String {
    if of == 0 {
        return "-".into();
    }
    format!("{:.3}%", 100.0 * n as f64 / of as f64)
}

fn main() {
    meshlimit_testbed::procs::stop_all_on_panic();
    let dir = TempDir::new("accuracy");
    let host = unique_host();
    let redis = RedisServer::start(&host, dir.path());
    let service = Meshlimitd::start(&host, &redis.url(), dir.path(), &[]);
    println!("meshlimit accuracy: N = {N} per W = {W_MS} ms; Redis and meshlimitd on {host}");

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let traces: Vec<(&str, &str, Trace)> = vec![
        (
            "steady",
            "one client, Poisson arrivals at 1.5x the limit, 6 s",
            steady(&mut rng),
        ),
        (
            "edges",
            "one client, N just before and N just after each of 4 window edges",
            edges(&mut rng),
        ),
        (
            "many",
            "50 clients, Poisson at 0.5x to 3x the limit each, 5 s",
            many_clients(&mut rng),
        ),
    ];
    let mut report = String::new();
    let _ = writeln!(
        report,
        "# Accuracy of meshlimit's algorithms\n\nGenerated by `make accuracy` (tests/src/bin/meshlimit-accuracy.rs): traces replayed in real time against a real\nredis-server through meshlimitd, each event one call with one check per\nalgorithm. Each decision is judged against \"at most N in any window of\nlength W\" applied to that algorithm's own admissions: *wrongly admitted*\nmeans N of its admissions already lay in the preceding W; *wrongly denied*\nmeans fewer than N did. *Worst window* is the most admissions of one client\nin any window of length W (N = {N}, W = {W_MS} ms). Times are the midpoint\nof sending and receiving each call (loopback, well under a millisecond).\n"
    );
    let mut all: Vec<[Score; 4]> = Vec::new();
    for (run, what, trace) in &traces {
        println!("replaying {run}: {} events ({what})", trace.len());
        let events = replay(&service.addr, run, trace);
        let scores = score(&events);
        let _ = writeln!(
            report,
            "## Trace `{run}`: {what}\n\n{} requests.\n",
            events.len()
        );
        let _ = writeln!(report, "| algorithm | wrongly admitted | wrongly denied | worst window (N = {N}) |\n|---|---|---|---|");
        for (i, a) in ALGORITHMS.iter().enumerate() {
            let s = &scores[i];
            let _ = writeln!(
                report,
                "| `{a}` | {} ({}) | {} ({}) | {} ({:.2}x) |",
                s.wrongly_admitted,
                pct(s.wrongly_admitted, s.requests),
                s.wrongly_denied,
                pct(s.wrongly_denied, s.requests),
                s.worst_window,
                s.worst_window as f64 / N as f64
            );
        }
        let _ = writeln!(report);
        all.push(scores);
    }
    let memory = memory_per_client(&service.addr, &redis);
    let commands = commands_per_decision(&service.addr, &redis);
    let _ = writeln!(report, "## Overall and cost\n");
    let _ = writeln!(report, "| algorithm | wrong decisions, all traces | Redis memory per active client and limit | Redis commands per decision |\n|---|---|---|---|");
    for (i, a) in ALGORITHMS.iter().enumerate() {
        let (wrong, total) = all.iter().fold((0, 0), |(w, t), s| {
            (
                w + s[i].wrongly_admitted + s[i].wrongly_denied,
                t + s[i].requests,
            )
        });
        let _ = writeln!(
            report,
            "| `{a}` | {} of {total} ({}) | {:.0} bytes | {:.1} |",
            wrong,
            pct(wrong, total),
            memory[i],
            commands[i]
        );
    }
    let _ = writeln!(
        report,
        "\nMemory is Redis' `MEMORY USAGE` of one client's key right after it used\nits whole quota of N = {N}; the sliding log grows with the admissions it\nkeeps (up to N members per client), the others are constant. Commands\ncount every command run inside the script (from `INFO commandstats`) plus\nthe `EVALSHA`, averaged over 200 decisions.\n\nFor comparison, Cloudflare reported that the sliding window counter made\n0.003% wrong decisions on 400 million requests of their real traffic\n(\"How we built rate limiting capable of scaling to millions of domains\",\n2017). Their traffic is mostly clients far below or far above their limit;\nthese traces are deliberately hostile (arrival rates near the limit and\nbursts at window edges), so the sliding counter's figure here is an upper\nbound for friendlier traffic, not a like-for-like comparison.\n\nReading the table: `sliding_window_log` is the definition itself (any\ndifference would come from the midpoint estimate of when Redis decided);\n`fixed_window` admits up to 2N around an edge; `sliding_window_counter`\nassumes the previous window's requests were evenly spread, which is wrong\nfor bursts; `token_bucket` enforces a rate (N/W, burst N), a different\ndefinition from \"N in any W\", so its differences are by design."
    );
    let path = tools::root().join("docs/accuracy.md");
    if let Err(e) = std::fs::write(&path, &report) {
        eprintln!("cannot write {}: {e}", path.display());
        std::process::exit(1);
    }
    println!("\n{report}\nwritten to {}", path.display());
}
