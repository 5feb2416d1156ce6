//! Token budgets end to end: a fake LLM upstream (JSON and event streams,
//! usage in the body, the last event or a header) behind real Envoys,
//! meshlimitd and Redis. The budget is reserved before each request,
//! settled from its response, never exceeded in mode `reserve`.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use meshlimit_testbed::http::Response;
use meshlimit_testbed::llm;
use meshlimit_testbed::{Topology, TopologyOptions};

/// The token budget's limit: `llm/tokens`.
const LIMIT: &str = "llm/tokens";

/// A config with one rule on `/v1/` priced by `cost`, with `limits`.
fn llm_config(cost: Value, limits: Value) -> String {
    llm_plugin(cost, limits).build()
}

/// [`llm_config`], before it is built (for other settings beside).
fn llm_plugin(cost: Value, limits: Value) -> PluginConfig {
    PluginConfig::new().rules(json!([{
        "name": "llm",
        "match": {"path_prefix": "/v1/"},
        "cost": cost,
        "limits": limits
    }]))
}

/// The usual token cost: reserve the request's max_tokens (default 100,
/// at most 10,000), usage from the JSON body or the last event. The
/// prompt is left out of the reservation here, so that these tests'
/// numbers are max_tokens' (`the_prompt_is_reserved_...` has it).
fn usual_cost() -> Value {
    json!({
        "reserve": {"request_json": "max_tokens", "default": 100, "max": 10000,
                    "prompt_bytes_per_token": 0, "ask_stream_usage": true},
        "response": {"json": "usage.total_tokens", "sse_json": "usage.total_tokens",
                     "header": "x-usage-tokens"}
    })
}

fn budget(tokens: u64) -> Value {
    json!([{"name": "tokens", "requests": tokens, "window": "60s"}])
}

fn llm_topology(plugin_config: String, replicas: usize) -> Topology {
    Topology::start(TopologyOptions {
        plugin_config,
        replicas,
        front: false,
        llm: true,
        ..TopologyOptions::default()
    })
}

/// A chat completion request to replica `replica`: `max_tokens`, and the
/// fake model's behaviour in `llm` headers.
fn chat(
    t: &Topology,
    replica: usize,
    client: &str,
    max_tokens: u64,
    stream: bool,
    llm: &[(&str, &str)],
) -> Response {
    llm::chat(&t.replica_addr(replica), client, max_tokens, stream, llm)
        .unwrap_or_else(|e| panic!("chat request failed: {e}"))
}

/// The budget's counter for `client` in Redis.
fn counter(t: &Topology, client: &str) -> u64 {
    t.key_count(LIMIT, client)
}

/// The first check, its settlement and the counter in Redis: reserved
/// max_tokens, settled at the usage the JSON body reports.
#[test]
fn a_json_response_settles_at_its_reported_usage() {
    let t = llm_topology(llm_config(usual_cost(), budget(10_000)), 1);
    wait_for_fresh_window(Duration::from_secs(10));
    let r = chat(
        &t,
        1,
        "json",
        500,
        false,
        &[("x-llm-tokens", "120"), ("x-llm-prompt", "3")],
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("\"total_tokens\":123"), "{}", r.body);
    assert_eq!(counter(&t, "json"), 123);
    assert_eq!(t.stat(1, "meshlimit.tokens_reserved"), 500);
    assert_eq!(t.stat(1, "meshlimit.tokens_settled"), 123);
    assert_eq!(t.stat(1, "meshlimit.tokens_refunded"), 377);
    assert_no_vm_panics(&t);
}

fn stat(t: &Topology, name: &str) -> u64 {
    t.stat_total(&format!("meshlimit.{name}"))
}

/// `total_tokens` as a response reports it (JSON body).
fn reported(r: &Response) -> u64 {
    serde_json::from_str::<Value>(&r.body)
        .ok()
        .and_then(|v| v["usage"]["total_tokens"].as_u64())
        .unwrap_or_else(|| panic!("no usage in {}", r.body))
}

/// Waits until the counter reads `want` (a settlement sent when a stream
/// ended is not awaited by anyone), for at most 5 s.
fn counter_reaches(t: &Topology, client: &str, want: u64) -> u64 {
    let mut last = counter(t, client);
    for _ in 0..100 {
        if last == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        last = counter(t, client);
    }
    last
}

/// The issue's first test: a 10,000-token budget, 64 concurrent clients
/// reserving 500 each and using 100 to 500, through two replicas. The
/// budget is never exceeded, and once everything settled the counter in
/// Redis is exactly the usage of the admitted requests.
#[test]
fn concurrent_reservations_never_exceed_the_budget_and_settle_exactly() {
    let t = llm_topology(llm_config(usual_cost(), budget(10_000)), 2);
    wait_for_fresh_window(Duration::from_secs(20));
    let results: Vec<(u16, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let t = &t;
                s.spawn(move || {
                    (0..3)
                        .map(|j| {
                            let used = (100 + (i * 37 + j * 101) % 401).to_string();
                            let r = chat(
                                t,
                                1 + (i + j) % 2,
                                "shared",
                                500,
                                false,
                                &[("x-llm-tokens", &used)],
                            );
                            let usage = if r.status == 200 { reported(&r) } else { 0 };
                            (r.status, usage)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let admitted: Vec<u64> = results
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, u)| *u)
        .collect();
    let used: u64 = admitted.iter().sum();
    assert!(
        results.iter().all(|(s, _)| *s == 200 || *s == 429),
        "only 200 and 429: {results:?}"
    );
    assert!(used <= 10_000, "settled usage {used} exceeds the budget");
    assert!(admitted.len() >= 20, "only {} admitted", admitted.len());
    assert!(
        admitted.len() < 192,
        "some must be refused for their reservation"
    );
    assert_eq!(
        counter(&t, "shared"),
        used,
        "the counter is the admitted usage"
    );
    assert_eq!(stat(&t, "tokens_settled"), used);
    assert_no_vm_panics(&t);
}

/// A request reserving 1,000 that uses 100 gives 900 back at once: the
/// next request, on the other replica, reserves them. "At once": the
/// client reads the response by its `content-length`, and Envoy's codec
/// hands the body's end on in a chunk of its own, after the body; the
/// refund is in Redis before the client has the last byte.
#[test]
fn a_refund_is_free_for_the_next_request_on_the_other_replica() {
    let t = llm_topology(llm_config(usual_cost(), budget(1_000)), 2);
    wait_for_fresh_window(Duration::from_secs(10));
    let first = chat(&t, 1, "refund", 1_000, false, &[("x-llm-tokens", "100")]);
    assert_eq!(first.status, 200);
    assert!(
        first.header("content-length").is_some(),
        "read by its length"
    );
    assert_eq!(
        counter(&t, "refund"),
        100,
        "settled before the body was whole"
    );
    let second = chat(&t, 2, "refund", 900, false, &[("x-llm-tokens", "900")]);
    assert_eq!(second.status, 200, "900 were given back: {}", second.body);
    let third = chat(&t, 1, "refund", 1, false, &[("x-llm-tokens", "1")]);
    assert_eq!(third.status, 429, "the budget is spent");
    assert!(third.header("retry-after").is_some());
    assert_eq!(counter(&t, "refund"), 1_000);
    assert_eq!(stat(&t, "tokens_refunded"), 900);
}

fn events(r: &Response) -> Vec<String> {
    llm::events(&r.body)
}

/// A reservation whose answer meshlimitd sent in time, but that reached
/// Envoy after the call's timeout (held back on the way by the testbed's
/// late proxy): the filter decided the request by its fallback, which
/// reserved and settled it in its own counters, and named the reservation
/// once meshlimitd answered again; what the script charged in Redis came
/// back. On the old code the 1,000 reserved stayed charged until the
/// window ended: each answer lost so burnt a reservation of the client's
/// budget.
#[test]
fn a_reservation_whose_answer_came_too_late_is_given_back() {
    let t = Topology::start(TopologyOptions {
        plugin_config: llm_plugin(usual_cost(), budget(10_000))
            .set_in("service", "timeout", json!("50ms"))
            .build(),
        replicas: 1,
        front: false,
        llm: true,
        late_answers: true,
        ..TopologyOptions::default()
    });
    wait_for_fresh_window(Duration::from_secs(20));
    t.late(Duration::from_millis(200));
    let lost = chat(&t, 1, "late", 1_000, false, &[("x-llm-tokens", "100")]);
    assert_eq!(lost.status, 200, "admitted by the fallback: {}", lost.body);
    assert_eq!(
        counter_reaches(&t, "late", 1_000),
        1_000,
        "meshlimitd charged the reservation"
    );
    assert_eq!(stat(&t, "reservations_lost"), 1);
    t.late(Duration::ZERO);
    // The held answer reaches Envoy 200 ms after it left meshlimitd; over
    // HTTP/2 it is ahead of the next call's answer on their connection.
    std::thread::sleep(Duration::from_millis(250));
    // The next call that succeeds names it (or, when this request goes to
    // the Envoy's other worker, the tick of the worker that lost it): it
    // goes back, and this request's own usage is all that stays charged.
    let next = chat(&t, 1, "late", 10, false, &[("x-llm-tokens", "7")]);
    assert_eq!(next.status, 200, "{}", next.body);
    assert_eq!(counter_reaches(&t, "late", 7), 7, "given back");
    assert_no_vm_panics(&t);
}

/// An event stream an upstream framed by its `content-length` (it
/// buffered the stream): the filter asked for the usage event on the
/// client's behalf and takes it out, so the body the client gets is
/// shorter than the length the upstream said. The response goes to the
/// client without that length (chunked), its events whole, and is charged
/// the usage it reported. (It went with the upstream's length, longer than
/// the body: a client reading by it waits for bytes that never come.)
#[test]
fn a_stream_framed_by_its_length_reaches_the_client_whole() {
    let t = llm_topology(llm_config(usual_cost(), budget(10_000)), 1);
    wait_for_fresh_window(Duration::from_secs(10));
    let r = chat(
        &t,
        1,
        "framed",
        200,
        true,
        &[
            ("x-llm-tokens", "20"),
            ("x-llm-prompt", "5"),
            ("x-llm-framing", "length"),
        ],
    );
    assert_eq!(r.status, 200);
    if let Some(length) = r.header("content-length") {
        assert_eq!(length, r.body.len().to_string(), "the length is the body's");
    }
    let data = events(&r);
    assert_eq!(data.len(), 20 + 2, "20 deltas, finish, [DONE]: {data:?}");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(counter(&t, "framed"), 25, "charged the reported usage");
    assert_no_vm_panics(&t);
}

/// A stream is charged exactly what its last event reports; without a
/// usage event, it settles at its reservation.
#[test]
fn streams_settle_at_their_usage_event_or_their_reservation() {
    let t = llm_topology(llm_config(usual_cost(), budget(10_000)), 1);
    wait_for_fresh_window(Duration::from_secs(10));
    let r = chat(
        &t,
        1,
        "sse",
        200,
        true,
        &[("x-llm-tokens", "50"), ("x-llm-prompt", "5")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let data = events(&r);
    // The client did not ask for the usage: the filter did, and reads the
    // usage event without passing it on.
    assert_eq!(data.len(), 50 + 2, "50 deltas, finish, [DONE]");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(counter(&t, "sse"), 55, "charged the reported usage exactly");

    let r = chat(
        &t,
        1,
        "sse-quiet",
        200,
        true,
        &[("x-llm-tokens", "50"), ("x-llm-usage", "none")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(events(&r).last().map(String::as_str), Some("[DONE]"));
    assert_eq!(
        counter(&t, "sse-quiet"),
        200,
        "no usage: the reservation stands"
    );

    // Usage in a response header: the headers wait for the settlement and
    // report what is left after it.
    let r = chat(
        &t,
        1,
        "hdr",
        400,
        false,
        &[("x-llm-tokens", "40"), ("x-llm-usage", "header")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(counter(&t, "hdr"), 40);
    let ratelimit = r.header("ratelimit").unwrap_or_default();
    assert!(
        ratelimit.contains("r=9960"),
        "remaining after settlement: {ratelimit}"
    );
    assert_no_vm_panics(&t);
}

/// A stream that outgrows its reservation is topped up while the budget
/// has room, and ended cleanly when it has none: a final rate_limited
/// chunk and [DONE], never a reset; the counter holds exactly the budget.
#[test]
fn a_stream_past_the_budget_ends_with_a_final_event() {
    let t = llm_topology(llm_config(usual_cost(), budget(100)), 1);
    wait_for_fresh_window(Duration::from_secs(10));
    let r = chat(&t, 1, "long", 30, true, &[("x-llm-tokens", "200")]);
    assert_eq!(r.status, 200);
    let data = events(&r);
    let deltas = data.iter().filter(|d| d.contains("\"content\"")).count();
    assert_eq!(deltas, 100, "exactly the budget was delivered");
    let n = data.len();
    assert!(n >= 2, "{data:?}");
    assert!(
        data[n - 2].contains("\"finish_reason\":\"rate_limited\""),
        "{}",
        data[n - 2]
    );
    assert_eq!(data[n - 1], "[DONE]");
    for d in &data[..n - 1] {
        serde_json::from_str::<Value>(d).unwrap_or_else(|e| panic!("{d}: {e}"));
    }
    assert_eq!(counter_reaches(&t, "long", 100), 100);
    assert_eq!(stat(&t, "streams_cut"), 1);
    // A stream within what is left is topped up and completes.
    let t2 = llm_topology(llm_config(usual_cost(), budget(1_000)), 1);
    let r = chat(&t2, 1, "topped", 30, true, &[("x-llm-tokens", "80")]);
    assert_eq!(
        events(&r)
            .iter()
            .filter(|d| d.contains("\"content\""))
            .count(),
        80
    );
    assert_eq!(counter(&t2, "topped"), 80, "settled at the usage event");
    assert_eq!(stat(&t2, "streams_cut"), 0);
    assert_no_vm_panics(&t);
}

/// An upstream 5xx gives the reservation back; a client that leaves in
/// the middle of a stream is charged its reservation (no usage seen).
#[test]
fn upstream_errors_refund_and_client_resets_settle() {
    let t = llm_topology(llm_config(usual_cost(), budget(1_000)), 1);
    wait_for_fresh_window(Duration::from_secs(15));
    let r = chat(&t, 1, "err", 700, false, &[("x-llm-status", "500")]);
    assert_eq!(r.status, 500);
    assert_eq!(counter(&t, "err"), 0, "refunded");
    assert_eq!(stat(&t, "tokens_refunded"), 700);

    // Read three events, then hang up.
    let body = json!({"max_tokens": 300, "stream": true}).to_string();
    let mut conn = TcpStream::connect(t.replica_addr(1)).unwrap();
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-api-key: gone\r\nx-llm-tokens: 100\r\nx-llm-usage: none\r\nx-llm-delay-ms: 30\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    while seen.windows(8).filter(|w| w == b"content\"").count() < 3 {
        let n = conn.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(conn);
    assert_eq!(
        counter_reaches(&t, "gone", 300),
        300,
        "settled at the reservation"
    );
    assert_no_vm_panics(&t);
}

/// Mode `after` is what other gateways do: admit while anything is left,
/// charge the usage after. Concurrent requests overshoot the budget by up
/// to their own usage (here 8 x 400 on a budget of 1,000), which mode
/// `reserve` never does.
#[test]
fn mode_after_overshoots_by_the_requests_in_flight() {
    let after = json!({"mode": "after", "response": {"json": "usage.total_tokens"}});
    let t = llm_topology(llm_config(after, budget(1_000)), 2);
    wait_for_fresh_window(Duration::from_secs(15));
    let overlapping = |t: &Topology, client: &str| -> usize {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    s.spawn(move || {
                        chat(
                            t,
                            1 + i % 2,
                            client,
                            400,
                            false,
                            &[("x-llm-tokens", "400"), ("x-llm-delay-ms", "300")],
                        )
                        .status
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|s| *s == 200)
                .count()
        })
    };
    assert_eq!(
        overlapping(&t, "after"),
        8,
        "all admitted: each held one unit"
    );
    assert_eq!(counter(&t, "after"), 3_200, "3.2x the budget");
    assert_eq!(
        chat(&t, 1, "after", 1, false, &[]).status,
        429,
        "then refused"
    );

    let t = llm_topology(llm_config(usual_cost(), budget(1_000)), 2);
    let admitted = overlapping(&t, "reserve");
    assert_eq!(admitted, 2, "mode reserve: only what fits");
    assert_eq!(counter(&t, "reserve"), 800);
}

/// With Redis stopped, reservations and settlements go to the local
/// counters: no 5xx, the unused part of a reservation is freed locally
/// too, and the stats say the fallback decided.
#[test]
fn with_redis_down_reservations_settle_in_the_local_counters() {
    let mut t = llm_topology(llm_config(usual_cost(), budget(1_000)), 1);
    wait_for_fresh_window(Duration::from_secs(15));
    assert_eq!(
        chat(&t, 1, "warm", 10, false, &[("x-llm-tokens", "1")]).status,
        200
    );
    t.stop_redis();
    let statuses: Vec<u16> = [600, 600, 900]
        .iter()
        .map(|&max| chat(&t, 1, "local", max, false, &[("x-llm-tokens", "100")]).status)
        .collect();
    assert_eq!(
        statuses,
        [200, 200, 429],
        "100 + 100 settled, then 900 does not fit"
    );
    assert!(stat(&t, "fallback_allowed") >= 2);
    assert_eq!(stat(&t, "tokens_settled"), 1 + 200);
    assert_no_vm_panics(&t);
}

/// A large request body arrives in many pieces (TCP segments for
/// HTTP/1.1, DATA frames for HTTP/2): the reservation is read from the
/// whole of it, here a `max_tokens` before 40 KB of prompt.
#[test]
fn a_body_in_many_frames_is_read_whole_over_http1_and_http2() {
    let t = llm_topology(llm_config(usual_cost(), budget(10_000)), 1);
    let dir = meshlimit_testbed::procs::TempDir::new("h2-body");
    let path = dir.path().join("body.json");
    let prompt = "x".repeat(40_000);
    std::fs::write(
        &path,
        format!(r#"{{"max_tokens": 700, "prompt": "{prompt}"}}"#),
    )
    .unwrap();
    for (flag, client, version) in [
        ("--http1.1", "h1", "1.1"),
        ("--http2-prior-knowledge", "h2", "2"),
    ] {
        let before = stat(&t, "tokens_reserved");
        let out = std::process::Command::new("curl")
            .args([
                "-s",
                flag,
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{http_version}",
            ])
            .args([
                "-H",
                &format!("x-api-key: {client}"),
                "-H",
                "x-llm-tokens: 5",
            ])
            .args(["-H", "content-type: application/json", "--data-binary"])
            .arg(format!("@{}", path.display()))
            .arg(format!("http://{}/v1/chat/completions", t.replica_addr(1)))
            .output()
            .expect("curl runs (scripts/setup.sh installs it)");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("200 {version}")
        );
        assert_eq!(
            stat(&t, "tokens_reserved") - before,
            700,
            "{flag}: max_tokens read"
        );
        assert_eq!(counter(&t, client), 5, "{flag}: settled at the usage");
    }
}

/// A chat request through curl, over HTTP/1.1 or HTTP/2 (prior
/// knowledge) as `version` says: its status. (curl reads a refusal by its
/// length, where the testbed's client waits for the connection to close.)
fn chat_curl(t: &Topology, version: &str, client: &str, max_tokens: u64) -> String {
    let flag = if version == "2" {
        "--http2-prior-knowledge"
    } else {
        "--http1.1"
    };
    let out = std::process::Command::new("curl")
        .args(["-s", flag, "-o", "/dev/null", "-w", "%{http_code}"])
        .args(["-H", &format!("x-api-key: {client}")])
        .args(["-H", "content-type: application/json", "--data-binary"])
        .arg(format!(r#"{{"model":"fake","max_tokens":{max_tokens}}}"#))
        .arg(format!("http://{}/v1/chat/completions", t.replica_addr(1)))
        .output()
        .expect("curl runs (scripts/setup.sh installs it)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One replica whose Envoy holds request headers for body-priced rules
/// when `held` (its Wasm PluginConfig sets allow_on_headers_stop_iteration,
/// and so does the plugin configuration); a budget of 1,000 an hour.
fn spent_budget_topology(held: bool) -> (Topology, meshlimit_testbed::procs::Proc) {
    hold_topology(held, held)
}

/// As [`spent_budget_topology`], the setting in the plugin configuration
/// (`plugin`) and in Envoy's Wasm PluginConfig (`envoy`) apart. The budget
/// is an hour's: no window turns while a test spends it.
fn hold_topology(plugin: bool, envoy: bool) -> (Topology, meshlimit_testbed::procs::Proc) {
    let held = envoy;
    let plugin = PluginConfig::new()
        .rules(json!([{"name": "llm", "match": {"path_prefix": "/v1/"},
                       "cost": usual_cost(),
                       "limits": [{"name": "tokens", "requests": 1000, "window": "1h"}]}]))
        .set("allow_on_headers_stop_iteration", json!(plugin))
        .build();
    let t = Topology::start(TopologyOptions {
        plugin_config: plugin,
        replicas: 0,
        front: false,
        llm: true,
        ..TopologyOptions::default()
    });
    let mut config = t.replica_config(1);
    if held {
        config = config.replacen(
            "failure_policy: FAIL_RELOAD\n",
            "failure_policy: FAIL_RELOAD\n                allow_on_headers_stop_iteration: true\n",
            1,
        );
    }
    let replica = t.start_replica(1, &config);
    (t, replica)
}

/// A client whose budget is spent sends 200 requests (100 over HTTP/1.1,
/// 100 over HTTP/2): with the headers held, the model sees none of them,
/// not a connection and not a request begun. Without it, the spent budget
/// is refused at the headers from the deny cache (over HTTP/2 on the
/// root's tick), which trusts it for half a second at a time: about two
/// requests a second reach the model (their headers; their bodies never
/// do), over either protocol, as docs/tokens.md says.
#[test]
fn a_spent_client_never_reaches_the_model_when_headers_are_held() {
    for held in [true, false] {
        let (t, _replica) = spent_budget_topology(held);
        let llm = t.llm.as_ref().unwrap();
        // Spend the budget: 1,000 reserved, 1,000 used.
        let r = chat(&t, 1, "spent", 1000, false, &[("x-llm-tokens", "1000")]);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(counter_reaches(&t, "spent", 1000), 1000);
        let started = std::time::Instant::now();
        let mut reached = Vec::new();
        for version in ["1.1", "2"] {
            let before = (
                llm.connections.load(Ordering::Relaxed),
                llm.requests_begun.load(Ordering::Relaxed),
            );
            for _ in 0..100 {
                let status = chat_curl(&t, version, "spent", 10);
                assert_eq!(status, "429", "held {held}, HTTP/{version}");
            }
            reached.push((
                llm.connections.load(Ordering::Relaxed) - before.0,
                llm.requests_begun.load(Ordering::Relaxed) - before.1,
            ));
        }
        let seconds = started.elapsed().as_secs();
        eprintln!(
            "held {held}: 100 refused requests over HTTP/1.1, 100 over HTTP/2 in {seconds}s; the model saw {reached:?} (connections, requests begun)"
        );
        if held {
            assert_eq!(reached, [(0, 0), (0, 0)], "nothing reaches the model");
        } else {
            // The spent budget is refused at the headers while the deny
            // cache trusts it (half a second at a time): over HTTP/1.1 at
            // once, over HTTP/2 on the root's tick, the stream stopped
            // whole meanwhile (see docs/tokens.md). Before, over HTTP/2
            // the body decided, and about half of them began on the model.
            for (version, (_, begun)) in ["1.1", "2"].iter().zip(&reached) {
                assert!(
                    (1..=2 * seconds + 2).contains(begun),
                    "HTTP/{version}: {reached:?} in {seconds}s"
                );
            }
        }
        assert_eq!(counter(&t, "spent"), 1000, "refusals charge nothing");
    }
}

/// The plugin configuration says Envoy holds headers, Envoy's does not:
/// Envoy then sends a held request no body callbacks (the fake host's
/// assumption, checked here against Envoy). The first such request goes on
/// after about a second, the worker stops holding, and the next ones go
/// on at once; none hangs.
#[test]
fn a_hold_envoy_does_not_honour_costs_one_second_once_and_never_hangs() {
    let (t, _replica) = hold_topology(true, false);
    let started = std::time::Instant::now();
    let r = chat(&t, 1, "unheld", 10, false, &[]);
    let first = started.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        first >= Duration::from_millis(900) && first < Duration::from_secs(5),
        "held until the worker saw no body come: {first:?}"
    );
    let started = std::time::Instant::now();
    for _ in 0..5 {
        assert_eq!(chat(&t, 1, "unheld", 10, false, &[]).status, 200);
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "no longer held: {:?}",
        started.elapsed()
    );
}

/// Each provider's shape (OpenAI's chat completions, Anthropic's messages,
/// Gemini's generateContent), as JSON and as a stream, is charged the
/// usage it reports, and a weighted sum prices output tokens apart: the
/// counters in Redis hold exactly what the model reported.
#[test]
fn each_provider_is_charged_the_usage_it_reports() {
    let rule = |name: &str, response: Value| {
        json!({"name": name, "match": {"path_prefix": "/v1/", "headers": [{"name": "x-rule", "exact": name}]},
               "cost": {"reserve": {"request_json": "max_tokens", "default": 100, "max": 10000},
                        "response": response},
               "limits": [{"name": "tokens", "requests": 100000, "window": "60s"}]})
    };
    let config = PluginConfig::new()
        .rules(json!([
            rule("openai", json!({"provider": "openai"})),
            rule("anthropic", json!({"provider": "anthropic"})),
            rule("gemini", json!({"provider": "gemini"})),
            rule("priced", json!({"provider": "anthropic",
                                  "json": ["usage.input_tokens", {"path": "usage.output_tokens", "weight": 4}],
                                  "sse_json": ["message.usage.input_tokens", {"path": "usage.output_tokens", "weight": 4}]})),
        ]))
        .build();
    let t = llm_topology(config, 1);
    wait_for_fresh_window(Duration::from_secs(15));
    for (rule, shape, per_request) in [
        ("openai", "openai", 50),
        ("anthropic", "anthropic", 50),
        ("gemini", "gemini", 50),
        ("priced", "anthropic", 30 + 4 * 20),
    ] {
        let headers = [
            ("x-llm-shape", shape),
            ("x-rule", rule),
            ("x-llm-prompt", "30"),
            ("x-llm-tokens", "20"),
        ];
        let r = chat(&t, 1, rule, 500, false, &headers);
        assert_eq!(r.status, 200, "{rule}: {r:?}");
        let limit = format!("{rule}/tokens");
        assert_eq!(t.key_count(&limit, rule), per_request, "{rule} (JSON)");
        let r = chat(&t, 1, rule, 500, true, &headers);
        assert_eq!(r.status, 200, "{rule}: {r:?}");
        let mut counted = 0;
        for _ in 0..100 {
            counted = t.key_count(&limit, rule);
            if counted == 2 * per_request {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(counted, 2 * per_request, "{rule} (stream)");
    }
    assert_no_vm_panics(&t);
}

/// The issue's overshoot: 20 concurrent streams with 5,000-token prompts
/// (20,000 bytes each) and `max_tokens: 100`, on a budget of 10,000. With
/// the prompt reserved (a token for four bytes, the default) each reserves
/// about 5,100: one is admitted, the others refused, and the counter ends
/// at the usage the model reported (5,000 + 100), within the budget.
/// Before, all 20 were admitted (100 reserved each) and settled about
/// 102,000.
#[test]
fn the_prompt_is_reserved_so_big_prompts_stay_within_the_budget() {
    let cost = json!({
        "reserve": {"request_json": "max_tokens", "default": 100, "max": 10000},
        "response": {"provider": "openai"}
    });
    let t = llm_topology(llm_config(cost, budget(10_000)), 2);
    wait_for_fresh_window(Duration::from_secs(15));
    let prompt = "word ".repeat(4_000);
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..20)
            .map(|i| {
                let (t, prompt) = (&t, &prompt);
                s.spawn(move || {
                    llm::chat_with_prompt(
                        &t.replica_addr(1 + i % 2),
                        "prompted",
                        100,
                        true,
                        prompt,
                        &[("x-llm-prompt", "5000"), ("x-llm-tokens", "100")],
                    )
                    .map_or(0, |r| r.status)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    assert_eq!(admitted, 1, "{statuses:?}");
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        19,
        "{statuses:?}"
    );
    assert_eq!(counter_reaches(&t, "prompted", 5_100), 5_100);
    assert_no_vm_panics(&t);
}

/// 64 concurrent requests mixing JSON and streams, with and without usage
/// reported, in the three providers' shapes, through two replicas, on one
/// budget (one rule whose usage sums each shape's paths: a shape has only
/// its own). The counter never goes above the budget, and once everything
/// settled it is exactly what the model reported for the admitted
/// requests that reported, plus the reservation of those that did not.
#[test]
fn sixty_four_mixed_requests_keep_the_budget_and_settle_exactly() {
    let cost = json!({
        "reserve": {"request_json": "max_tokens", "default": 100, "max": 10000,
                    "prompt_bytes_per_token": 0, "ask_stream_usage": true},
        "response": {
            "json": ["usage.total_tokens", "usage.input_tokens", "usage.output_tokens",
                     "usageMetadata.totalTokenCount"],
            "sse_json": ["usage.total_tokens", "message.usage.input_tokens", "usage.output_tokens",
                         "usageMetadata.totalTokenCount"]
        }
    });
    // With the shared token, as shipped: every settlement's receipts are
    // signed and verified.
    let t = Topology::start(TopologyOptions {
        plugin_config: llm_config(cost, budget(10_000)),
        front: false,
        llm: true,
        shared_token: true,
        ..TopologyOptions::default()
    });
    wait_for_fresh_window(Duration::from_secs(20));
    let shapes = ["openai", "anthropic", "gemini"];
    // Request i: its shape, streamed or not, usage or not, and what the
    // model uses (prompt + completion, within max_tokens).
    let plan = |i: usize| {
        let shape = shapes[i % 3];
        let stream = i.is_multiple_of(2);
        let usage = !i.is_multiple_of(5);
        let (prompt, tokens) = (10 + (i as u64 % 7), 40 + 5 * (i as u64 % 11));
        (shape, stream, usage, prompt, tokens)
    };
    let max_tokens = 400;
    let outcomes: Vec<(usize, u16)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let t = &t;
                s.spawn(move || {
                    let (shape, stream, usage, prompt, tokens) = plan(i);
                    let (prompt, tokens) = (prompt.to_string(), tokens.to_string());
                    let headers = [
                        ("x-llm-shape", shape),
                        ("x-llm-usage", if usage { "body" } else { "none" }),
                        ("x-llm-prompt", prompt.as_str()),
                        ("x-llm-tokens", tokens.as_str()),
                    ];
                    let r = llm::chat(
                        &t.replica_addr(1 + i % 2),
                        "mixed",
                        max_tokens,
                        stream,
                        &headers,
                    )
                    .unwrap_or_else(|e| panic!("request {i}: {e}"));
                    (i, r.status)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let admitted: Vec<usize> = outcomes
        .iter()
        .filter(|(_, s)| *s == 200)
        .map(|(i, _)| *i)
        .collect();
    assert!(
        outcomes.iter().all(|(_, s)| *s == 200 || *s == 429),
        "{outcomes:?}"
    );
    // 25 reservations of 400 fit in 10,000; more once some settle below.
    assert!(admitted.len() >= 25, "{outcomes:?}");
    let expected: u64 = admitted
        .iter()
        .map(|&i| {
            let (_, _, usage, prompt, tokens) = plan(i);
            if usage {
                prompt + tokens
            } else {
                max_tokens
            }
        })
        .sum();
    assert!(expected <= 10_000, "{expected}");
    assert_eq!(
        counter_reaches(&t, "mixed", expected),
        expected,
        "{outcomes:?}"
    );
    assert_every_call_authorized(&t);
    assert_no_vm_panics(&t);
}

/// Every call to meshlimitd carried the shared token, and every
/// settlement's receipts verified.
fn assert_every_call_authorized(t: &Topology) {
    let metrics = meshlimit_testbed::http::get(&t.meshlimitd_addr(), "/metrics", &[])
        .unwrap()
        .body;
    for line in [
        "meshlimitd_unauthorized_total 0",
        "meshlimitd_check_failures_total{kind=\"forged\"} 0",
        "meshlimitd_check_failures_total{kind=\"invalid\"} 0",
    ] {
        assert!(metrics.contains(line), "{line}: {metrics}");
    }
}

/// A streamed chat request through curl (HTTP/1.1, or HTTP/2 with prior
/// knowledge), as the OpenAI SDKs send one by default: no
/// `stream_options`. The model uses 30 prompt and 12 completion tokens.
/// Its status and body.
fn stream_curl(t: &Topology, version: &str, client: &str) -> (String, String) {
    let flag = if version == "2" {
        "--http2-prior-knowledge"
    } else {
        "--http1.1"
    };
    let out = std::process::Command::new("curl")
        .args(["-s", flag, "-w", "\n%{http_code}"])
        .args(["-H", &format!("x-api-key: {client}")])
        .args(["-H", "x-llm-prompt: 30", "-H", "x-llm-tokens: 12"])
        .args(["-H", "content-type: application/json", "--data-binary"])
        .arg(r#"{"model":"fake","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
        .arg(format!("http://{}/v1/chat/completions", t.replica_addr(1)))
        .output()
        .expect("curl runs (scripts/setup.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or((&text, ""));
    (status.to_string(), body.to_string())
}

/// A streamed request that does not ask for its usage (the OpenAI SDKs'
/// default; the fake model, as OpenAI, then reports none) is made to ask:
/// the budget is charged what the model reports, and the client does not
/// see the usage event it did not ask for. Over HTTP/1.1 (the body's
/// length changes: Envoy frames it anew) and HTTP/2, headers held or not.
/// Before, such a stream was charged its reservation (100 here, not 42).
#[test]
fn a_stream_that_does_not_ask_for_its_usage_is_charged_what_the_model_reports() {
    for held in [true, false] {
        let (t, _replica) = hold_topology(held, held);
        let client = if held { "asker-held" } else { "asker" };
        let mut expected = 0;
        for version in ["1.1", "2"] {
            let (status, body) = stream_curl(&t, version, client);
            assert_eq!(status, "200", "held {held}, HTTP/{version}: {body}");
            let events = llm::events(&body);
            assert_eq!(
                events.iter().filter(|e| e.contains("\"content\"")).count(),
                12,
                "{body}"
            );
            assert!(events.last().is_some_and(|e| e == "[DONE]"), "{body}");
            assert!(!body.contains("usage"), "not asked for, not shown: {body}");
            expected += 42;
            assert_eq!(
                counter_reaches(&t, client, expected),
                expected,
                "held {held}, HTTP/{version}"
            );
        }
        assert_eq!(t.stat(1, "meshlimit.stream_usage_asked"), 2);
        assert_no_vm_panics(&t);
    }
}

/// A budget per model (`by: ["client", "json:model"]`): a client that
/// spent its budget on one model is refused that model and still admitted
/// to another, each model's counter in Redis on its own.
#[test]
fn a_budget_per_model_counts_each_model_apart() {
    let t = llm_topology(
        PluginConfig::new()
            .rules(json!([{
                "name": "llm",
                "match": {"path_prefix": "/v1/"},
                "cost": usual_cost(),
                "limits": [{"name": "tokens", "requests": 1000, "window": "1h",
                            "by": ["client", "json:model"]}]
            }]))
            .build(),
        1,
    );
    let ask = |model: &str, tokens: &str| {
        let body = json!({"model": model, "max_tokens": 1000,
                          "messages": [{"role": "user", "content": "hi"}]})
        .to_string();
        meshlimit_testbed::http::request(
            &t.replica_addr(1),
            "POST",
            "/v1/chat/completions",
            &[
                ("x-api-key", b"modeler"),
                ("content-type", b"application/json"),
                ("x-llm-tokens", tokens.as_bytes()),
            ],
            body.as_bytes(),
        )
        .unwrap()
        .status
    };
    assert_eq!(ask("big", "1000"), 200, "the first spends big's budget");
    assert!(eventually(Duration::from_secs(5), || {
        t.redis_cli(&["--scan", "--pattern", "ml:*json:model:big*"])
            .lines()
            .any(|k| t.redis_cli(&["GET", k]).trim() == "1000")
    }));
    assert_eq!(ask("big", "10"), 429, "big is spent");
    assert_eq!(ask("small", "10"), 200, "small has its own budget");
    // A counter per model (each beside its epoch: the reservations'
    // receipts come back).
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*json:model:*:fw:*"]);
    assert_eq!(keys.lines().count(), 2, "{keys}");
    assert_no_vm_panics(&t);
}
