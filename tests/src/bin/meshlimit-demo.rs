//! `make demo`: starts Redis, meshlimitd and four Envoys on loopback and
//! shows, in plain tables, what clients see: a global limit that holds
//! across two replicas, a per-replica fallback while Redis is down, the
//! global limit again once Redis is back, and a token budget for an LLM
//! route (reserved, settled, refunded, a stream cut at the budget). Stops
//! everything it started.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use meshlimit_testbed::llm;
use meshlimit_testbed::plugin::PluginConfig;
use meshlimit_testbed::topology::{FRONT_PORT, MESHLIMITD_PORT, REDIS_PORT};
use meshlimit_testbed::{Topology, TopologyOptions};
use serde_json::json;

const LIMIT: usize = 20;
/// The token budget of the third act, per API key and minute.
const TOKENS: u64 = 1_000;

#[derive(Default)]
struct Tally {
    sent: usize,
    allowed: usize,
    denied: usize,
    other: usize,
    /// replica -> (allowed, denied)
    by_replica: BTreeMap<String, (usize, usize)>,
}

fn send(t: &Topology, client: &str, n: usize, tally: &mut Tally) {
    for _ in 0..n {
        let r = t.get("/api/orders", &[("x-api-key", client.as_bytes())]);
        let replica = r.header("x-meshlimit-replica").unwrap_or("?").to_string();
        let slot = tally.by_replica.entry(replica).or_default();
        tally.sent += 1;
        match r.status {
            200 => {
                tally.allowed += 1;
                slot.0 += 1;
            }
            429 => {
                tally.denied += 1;
                slot.1 += 1;
            }
            _ => tally.other += 1,
        }
    }
}

fn table(title: &str, rows: &[(&str, &Tally)], expected: &str) {
    println!("\n  {title}");
    println!(
        "  {:<8} {:>5} {:>8} {:>7} {:>6}   {:<17} {:<17}",
        "client", "sent", "allowed", "denied", "other", "via replica-1", "via replica-2"
    );
    for (client, t) in rows {
        let via = |r: &str| {
            let (a, d) = t.by_replica.get(r).copied().unwrap_or_default();
            format!("{a:>2} ok / {d:>2} 429")
        };
        println!(
            "  {:<8} {:>5} {:>8} {:>7} {:>6}   {:<17} {:<17}",
            client,
            t.sent,
            t.allowed,
            t.denied,
            t.other,
            via("replica-1"),
            via("replica-2")
        );
    }
    println!("  expected: {expected}");
}

fn stats_line(t: &Topology, name: &str) -> String {
    format!(
        "{name}: replica-1 = {}, replica-2 = {}",
        t.stat(1, name),
        t.stat(2, name)
    )
}

/// Fixed windows are aligned to the minute: wait rather than split a burst
/// across two windows and print confusing numbers.
fn fresh_window(needed_secs: u64) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let into = now % 60;
    if into + needed_secs > 58 {
        let wait = 60 - into + 1;
        println!(
            "  (waiting {wait}s for a fresh one-minute window, so the counts are easy to read)"
        );
        std::thread::sleep(Duration::from_secs(wait));
    }
}

/// Act 4: a token budget for an LLM route across two replicas. True when
/// every number is the expected one.
fn token_budget() -> bool {
    println!(
        "\n4. A token budget for an LLM route: {TOKENS} tokens a minute per key, on two replicas."
    );
    let t = token_topology();
    println!("  (a fake OpenAI-shaped model answers; each request reserves its max_tokens,");
    println!("   and settles at the usage the model reports)");
    fresh_window(10);
    println!(
        "\n  {:<44} {:<10} {:>8} {:>6} {:>7}  budget used (Redis)",
        "erin's request", "via", "reserved", "used", "status"
    );
    let mut ok = true;
    let mut step =
        |what: &str, replica: usize, max: u64, stream: bool, tokens: &str, want: (u16, u64)| {
            let r = llm::chat(
                &t.replica_addr(replica),
                "erin",
                max,
                stream,
                &[("x-llm-tokens", tokens)],
            );
            let (status, body) = r.map_or((0, String::new()), |r| (r.status, r.body));
            let used = if stream {
                llm::events(&body)
                    .iter()
                    .filter(|e| e.contains("\"content\""))
                    .count()
                    .to_string()
            } else if status == 200 {
                tokens.to_string()
            } else {
                "-".into()
            };
            let counted = t.key_count("llm/tokens", "erin");
            println!("  {what:<44} replica-{replica:<2} {max:>8} {used:>6} {status:>7}  {counted}");
            ok &= (status, counted) == want;
            body
        };
    step(
        "a completion that uses 150 of 600",
        1,
        600,
        false,
        "150",
        (200, 150),
    );
    step(
        "800 more: fits because 450 were given back",
        2,
        800,
        false,
        "700",
        (200, 850),
    );
    let body = step(
        "a stream of 400 tokens, reserving 50",
        1,
        50,
        true,
        "400",
        (200, TOKENS),
    );
    let model_requests = || {
        t.llm.as_ref().map_or(0, |m| {
            m.requests_begun.load(std::sync::atomic::Ordering::Relaxed)
        })
    };
    let before = model_requests();
    step("one more token", 2, 1, false, "1", (429, TOKENS));
    step("and another", 1, 1, true, "1", (429, TOKENS));
    let after = model_requests();
    println!("\n  requests the model saw: {before} before the two refusals, {after} after (refused at their headers)");
    ok &= before == after;
    let last: Vec<String> = llm::events(&body).into_iter().rev().take(2).collect();
    println!("\n  the stream was topped up while the budget had room, then ended cleanly:");
    for line in last.iter().rev() {
        println!("    data: {line}");
    }
    print_token_stats(&t);
    ok
}

/// Two replicas before the fake model, with act 4's token budget.
fn token_topology() -> Topology {
    let config = PluginConfig::new()
        .rules(json!([{
            "name": "llm",
            "match": {"path_prefix": "/v1/"},
            "cost": {"reserve": {"request_json": "max_tokens", "default": 100, "max": 10000,
                                 "prompt_bytes_per_token": 0, "ask_stream_usage": true},
                     "response": {"json": "usage.total_tokens", "sse_json": "usage.total_tokens"}},
            "limits": [{"name": "tokens", "requests": TOKENS, "window": "60s"}]
        }]))
        // A refused request is refused at its headers: the model never
        // sees it (Envoy's Wasm PluginConfig says the same).
        .set("allow_on_headers_stop_iteration", json!(true))
        .build();
    Topology::start(TopologyOptions {
        plugin_config: config,
        front: false,
        llm: true,
        hold_headers: true,
        ..TopologyOptions::default()
    })
}

/// The token budget's stats on each replica, and what was expected.
fn print_token_stats(t: &Topology) {
    println!("  Envoy stats (wasmcustom.*):");
    for name in [
        "meshlimit.tokens_reserved",
        "meshlimit.tokens_settled",
        "meshlimit.tokens_refunded",
        "meshlimit.streams_cut",
    ] {
        println!("    {}", stats_line(t, name));
    }
    println!("  expected: 150 + 700 + 150 streamed = {TOKENS} exactly, never more; the last two requests refused, unseen by the model");
}

fn main() {
    meshlimit_testbed::procs::stop_all_on_panic();
    let mut t = start();
    let (alice, bob) = act_global(&t);
    let carol = act_redis_down(&mut t);
    let dave = act_redis_back(&mut t);
    drop(t);
    let tokens_ok = token_budget();

    println!("\nStopping everything.");
    let expectations = [
        ("alice: 20 allowed", alice.allowed == LIMIT),
        ("bob: 20 allowed", bob.allowed == LIMIT),
        ("carol: 40 allowed", carol.allowed == 2 * LIMIT),
        ("dave: 20 allowed", dave.allowed == LIMIT),
        (
            "no status other than 200 and 429",
            alice.other + bob.other + carol.other + dave.other == 0,
        ),
        ("the token budget's numbers", tokens_ok),
    ];
    let missed: Vec<&str> = expectations
        .iter()
        .filter(|(_, met)| !met)
        .map(|(what, _)| *what)
        .collect();
    if missed.is_empty() {
        println!("Done: every number matched what was expected.");
    } else {
        println!("Not as expected: {}", missed.join("; "));
        println!("Done, but some numbers differ from what was expected (see above).");
        std::process::exit(1);
    }
}

/// Starts the demo's processes and says what runs where.
fn start() -> Topology {
    println!("meshlimit demo: one shared limit for a client, whichever Envoy replica serves it.\n");
    println!("Starting on loopback (every process is stopped at the end):");
    let t = Topology::start(TopologyOptions::default());
    let h = t.host.clone();
    println!("  redis-server   {h}:{REDIS_PORT}");
    println!("  meshlimitd     {h}:{MESHLIMITD_PORT}   (runs the Lua scripts on Redis)");
    println!(
        "  replica-1/2    {h}:{} and :{}  (Envoy + meshlimit.wasm)",
        FRONT_PORT + 1,
        FRONT_PORT + 2
    );
    println!("  front          {h}:{FRONT_PORT}   (Envoy, round robin over the replicas)");
    println!("  rule: {LIMIT} requests per minute per x-api-key (envoy/plugin-config.json)");

    t
}

/// Act 1: two clients through the front load balancer, one limit each
/// across both replicas.
fn act_global(t: &Topology) -> (Tally, Tally) {
    println!("\n1. Redis up: the limit is global.");
    fresh_window(15);
    let (mut alice, mut bob) = (Tally::default(), Tally::default());
    for _ in 0..30 {
        send(t, "alice", 2, &mut alice);
        send(t, "bob", 1, &mut bob);
    }
    table(
        "alice sends 60, bob 30, interleaved, through the front load balancer:",
        &[("alice", &alice), ("bob", &bob)],
        &format!("{LIMIT} allowed each, in total across both replicas (an in-memory limiter would allow {})", 2 * LIMIT),
    );
    // Lease hits reach the stat on the filter's next tick.
    let _ = t.lease_hits();
    println!("  how the allowed ones were decided (Envoy stats, wasmcustom.*):");
    for name in [
        "meshlimit.requests_allowed",
        "meshlimit.lease_grants",
        "meshlimit.lease_hits",
    ] {
        println!("    {}", stats_line(t, name));
    }
    println!("  (busy clients get quota leases: units meshlimitd charged in Redis ahead of time,");
    println!("   spent by the replica without a call; never more than the limit, docs/leases.md)");
    let last = t.get("/api/orders", &[("x-api-key", b"alice")]);
    println!("\n  what alice's next request gets back:");
    println!("    HTTP {}", last.status);
    for name in ["retry-after", "ratelimit", "ratelimit-policy"] {
        println!("    {name}: {}", last.header(name).unwrap_or("-"));
    }

    (alice, bob)
}

/// Act 2: Redis stopped; each replica decides from its own counters.
fn act_redis_down(t: &mut Topology) -> Tally {
    println!("\n2. Redis stopped: every replica falls back to its own local counters.");
    t.stop_redis();
    fresh_window(10);
    let mut carol = Tally::default();
    send(t, "carol", 60, &mut carol);
    table(
        "carol sends 60 while Redis is down:",
        &[("carol", &carol)],
        &format!(
            "no 5xx; each replica allows {LIMIT} on its own ({} in all) until Redis returns",
            2 * LIMIT
        ),
    );
    println!("  Envoy stats (wasmcustom.*):");
    for name in [
        "meshlimit.fallback_allowed",
        "meshlimit.fallback_denied",
        "meshlimit.service_errors.unavailable",
        "meshlimit.breaker_opened",
    ] {
        println!("    {}", stats_line(t, name));
    }
    println!("  (after 5 failed calls each replica's breaker opened: the other requests");
    println!(
        "   were decided locally without calling meshlimitd, so no request waited on a timeout)"
    );

    carol
}

/// Act 3: Redis back; the limit is global again.
fn act_redis_back(t: &mut Topology) -> Tally {
    println!("\n3. Redis restarted (Envoy and meshlimitd keep running).");
    t.start_redis();
    let started = Instant::now();
    // Several global decisions in a row: every replica's breaker has closed.
    let mut in_a_row = 0;
    while in_a_row < 6 && started.elapsed() < Duration::from_secs(15) {
        let before = t.fallback_decisions();
        t.get("/api/orders", &[("x-api-key", b"probe")]);
        if t.fallback_decisions() == before {
            in_a_row += 1;
        } else {
            in_a_row = 0;
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    println!(
        "  global decisions again after {:.1}s",
        started.elapsed().as_secs_f64()
    );
    fresh_window(10);
    let mut dave = Tally::default();
    send(t, "dave", 60, &mut dave);
    table(
        "dave sends 60:",
        &[("dave", &dave)],
        &format!("{LIMIT} allowed: the global limit is back"),
    );

    dave
}
