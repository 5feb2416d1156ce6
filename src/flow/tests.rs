//! The request flow against the fake host: what only the end-to-end tests
//! used to see, one branch at a time, in microseconds. Compiled only under
//! `#[cfg(test)]` (see `flow/mod.rs`).

use super::*;
use crate::host::fake::{Acted, FakeHost, FakeRequest};
use serde_json::json;

mod decision_log;
mod fake_meshlimitd;
mod fleet_switch;
mod interleavings;
mod leases;
mod local;
mod routing;
mod rule_stats;
mod tokens;
mod tracing;

const ROOT: u32 = 1;

/// Every log line of every test (tests run in parallel: look for lines
/// naming your own subject or configuration).
static LOGGED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

struct CaptureLog;

impl log::Log for CaptureLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        if let Ok(mut lines) = LOGGED.lock() {
            lines.push(format!("{} {}", record.level(), record.args()));
        }
    }
    fn flush(&self) {}
}

fn capture_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = log::set_logger(&CaptureLog);
        log::set_max_level(log::LevelFilter::Trace);
    });
}

/// Whether a line containing every one of `parts` was logged.
fn logged(parts: &[&str]) -> bool {
    LOGGED
        .lock()
        .unwrap()
        .iter()
        .any(|l| parts.iter().all(|p| l.contains(p)))
}

/// A worker on a fake host, with helpers to drive requests through it.
struct Harness {
    host: FakeHost,
    worker: Worker,
    next_context: u32,
}

/// A config with the `api` rule (20 a minute per `x-api-key`); `extra` is
/// spliced in at the top level (e.g. `"failure_mode": "deny",`).
fn config(extra: &str) -> Config {
    crate::config::parse(
        format!(
            r#"{{{extra}
            "client_id": {{"headers": ["x-api-key"], "when_missing": "reject"}},
            "rules": [{{"name": "api", "match": {{"path_prefix": "/api/"}},
                        "limits": [{{"name": "per-minute", "requests": 20, "window": "60s"}}]}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

fn harness_with(config: Config) -> Harness {
    capture_logs();
    let host = FakeHost::default();
    host.enter(ROOT);
    let worker = Worker::new(&host, config, ROOT);
    Harness {
        host,
        worker,
        next_context: 100,
    }
}

fn harness(extra: &str) -> Harness {
    harness_with(config(extra))
}

/// Without group commit: each request calls for itself.
const ONE_CALL: &str = r#""group_commit": {"enabled": false},"#;
/// Group commit with one call slot: checks queue behind the call in flight.
const ONE_SLOT: &str = r#""group_commit": {"max_calls_in_flight": 1},"#;

impl Harness {
    /// A new request from `id` (no key when empty) to `path`, through
    /// `on_request_headers` in its own context.
    fn request_to(&mut self, path: &str, id: &str) -> (Stream, Step) {
        self.next_context += 1;
        let mut stream = self.worker.stream(self.next_context);
        let mut req = FakeRequest::default().with_header(":path", path.as_bytes());
        if !id.is_empty() {
            req = req.with_header("x-api-key", id.as_bytes());
        }
        *self.host.request.borrow_mut() = req;
        self.host.enter(stream.context_id);
        let step = self
            .worker
            .on_request_headers(&self.host, &mut stream, true);
        (stream, step)
    }

    fn request(&mut self, id: &str) -> (Stream, Step) {
        self.request_to("/api/items", id)
    }

    /// The root is woken and sends what is due.
    fn wake(&self) {
        self.host.enter(ROOT);
        self.worker.on_wake(&self.host);
    }

    /// Call `token`, which no stream owns (a batch, a renewal, a return, a
    /// settlement, a top-up), comes back with `status` and `body`
    /// (`status` None: no response at all, as after a timeout or reset).
    /// It goes where the SDK sends it: to the context whose callback
    /// dispatched it, and nowhere when that context has ended (false).
    fn answer_batch(&self, token: u32, status: Option<u32>, body: &str) -> bool {
        let Some(to) = self.host.answer_goes_to(token) else {
            return false;
        };
        self.host.respond(status, body);
        self.host.enter(to);
        let headers = usize::from(status.is_some());
        self.worker
            .on_batch_answer(&self.host, token, headers, body.len());
        true
    }

    /// The stream's own call comes back (the SDK hands it to the stream:
    /// it was dispatched from the stream's callback, and the stream lives).
    fn answer_own(&self, stream: &mut Stream, status: Option<u32>, body: &str) -> Step {
        let token = stream.in_flight.as_ref().map_or(0, |f| f.token);
        assert_eq!(
            self.host.answer_goes_to(token),
            Some(stream.context_id),
            "the SDK delivers call {token}'s answer to the stream"
        );
        self.host.respond(status, body);
        self.host.enter(stream.context_id);
        let headers = usize::from(status.is_some());
        self.worker
            .on_call_answer(&self.host, stream, headers, body.len())
    }

    /// The call that decides `stream` comes back, wherever it left from:
    /// the stream's own call, or the root's, for a check whose answer
    /// outlives its request (it asks for a lease, or reserves), which
    /// leaves from the root with group commit off too. The step the
    /// stream is left with.
    fn answer_check(&mut self, stream: &mut Stream, status: Option<u32>, body: &str) -> Step {
        if stream.in_flight.is_some() {
            return self.answer_own(stream, status, body);
        }
        self.wake();
        self.answer_batch(self.last_token(), status, body);
        self.acted_for(stream)
    }

    /// The step `stream` is left with once the root has sent what it
    /// queued: `step` itself unless the check waits for the root (a check
    /// whose answer outlives its request leaves from the root, group
    /// commit or not).
    fn decided(&self, stream: &Stream, step: Step) -> Step {
        if step != Step::Pause || stream.in_flight.is_some() {
            return step;
        }
        self.wake();
        self.acted_for(stream)
    }

    /// What the root did for `stream` since it was last asked, as a step
    /// (`Pause`: nothing yet); what it did for other streams stays.
    fn acted_for(&self, stream: &Stream) -> Step {
        let mut acted = self.host.acted.borrow_mut();
        let mine = acted.iter().position(|a| match a {
            Acted::Resumed(id) | Acted::Replied(id, _) => *id == stream.context_id,
            Acted::ResumedResponse(_) => false,
        });
        match mine.map(|i| acted.remove(i)) {
            Some(Acted::Resumed(_)) => Step::Continue,
            Some(Acted::Replied(_, reply)) => Step::Reply(reply),
            _ => Step::Pause,
        }
    }

    /// The stream ends (its response went out, or the client reset): the
    /// worker forgets it in the stream's last callback, then the SDK
    /// deletes the context, dropping the answers still due to it.
    fn end(&self, stream: &Stream) {
        self.host.enter(stream.context_id);
        self.worker.on_stream_end(&self.host, stream);
        self.host.end(stream.context_id);
    }

    fn calls(&self) -> usize {
        self.host.sent.borrow().len()
    }

    /// The token of the last call sent.
    fn last_token(&self) -> u32 {
        self.host.sent.borrow().last().map(|c| c.token).unwrap()
    }

    fn last_call_body(&self) -> serde_json::Value {
        let sent = self.host.sent.borrow();
        serde_json::from_slice(&sent.last().unwrap().body).unwrap()
    }

    fn stat(&self, name: &str) -> u64 {
        self.host.stat(&format!("meshlimit.{name}"))
    }

    fn fallbacks(&self) -> u64 {
        self.stat("fallback_allowed") + self.stat("fallback_denied")
    }

    fn advance(&self, ms: u64) {
        self.host.now.set(self.host.now.get() + ms);
    }
}

/// One check's answer for one limit of 20.
fn result(allowed: bool, remaining: u64) -> String {
    let retry = if allowed { 0 } else { 30_000 };
    format!(
        r#"{{"allowed":{allowed},"limits":[{{"allowed":{allowed},"limit":20,"remaining":{remaining},"reset_after_ms":30000,"retry_after_ms":{retry}}}]}}"#
    )
}

fn answer(results: &[String]) -> String {
    format!(r#"{{"results":[{}]}}"#, results.join(","))
}

fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.as_str())
}

fn reply_status(step: &Step) -> Option<u32> {
    match step {
        Step::Reply(r) => Some(r.status),
        _ => None,
    }
}

// ---- the order of the request path ----

#[test]
fn unmatched_requests_pass_untouched() {
    let mut h = harness("");
    h.host.take_hostcalls();
    let (_, step) = h.request_to("/health", "a");
    assert_eq!(step, Step::Continue);
    assert_eq!(h.calls(), 0);
    // Only the headers were read: no clock, no shared data, no stat.
    assert_eq!(h.host.take_hostcalls(), ["get_header_map_pairs"]);
}

/// Envoy keeps one stat per name: each worker's VM that defines it gets
/// an id of its own, and all of them count into it (what the end-to-end
/// tests read from the admin API, summed over two workers). The fake
/// host does the same.
#[test]
fn every_worker_counts_into_the_same_stat() {
    let mut h = harness("");
    assert_eq!(reply_status(&h.request("").1), Some(401));
    h.worker = Worker::new(&h.host, config(""), ROOT);
    assert_eq!(reply_status(&h.request("").1), Some(401));
    assert_eq!(h.stat("rejected_no_client_id"), 2);
}

#[test]
fn rejections_are_replied_and_counted_without_a_call() {
    let mut h = harness("");
    let (_, step) = h.request("");
    assert_eq!(reply_status(&step), Some(401));
    assert_eq!(h.stat("rejected_no_client_id"), 1);
    let h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]},
                "rules": [{"name": "api", "cost": {"header": "x-cost", "max": 5},
                           "limits": [{"name": "m", "requests": 3, "window": "60s"}]}]}"#,
        )
        .unwrap(),
    );
    *h.host.request.borrow_mut() = FakeRequest::default()
        .with_header(":path", b"/")
        .with_header("x-api-key", b"a")
        .with_header("x-cost", b"9");
    let mut s = h.worker.stream(5);
    let step = h.worker.on_request_headers(&h.host, &mut s, true);
    assert_eq!(reply_status(&step), Some(400));
    assert_eq!(h.stat("rejected_invalid_cost"), 1);
    h.host.request.borrow_mut().headers.pop();
    h.host
        .request
        .borrow_mut()
        .headers
        .push(("x-cost".into(), b"4".to_vec()));
    let step = h.worker.on_request_headers(&h.host, &mut s, true);
    assert_eq!(reply_status(&step), Some(429));
    assert_eq!(h.stat("rejected_cost_above_capacity"), 1);
    assert_eq!(h.calls(), 0);
}

#[test]
fn a_local_deny_costs_no_call() {
    let mut h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]}, "rules": [
              {"name": "edge", "scope": "local", "limits": [{"name": "s", "requests": 2, "window": "1s"}]},
              {"name": "api", "limits": [{"name": "m", "requests": 100, "window": "60s"}]}]}"#,
        )
        .unwrap(),
    );
    for _ in 0..2 {
        let (_, step) = h.request("a");
        assert_eq!(
            step,
            Step::Pause,
            "admitted locally, queued for the global limit"
        );
    }
    h.wake();
    assert_eq!(h.calls(), 1);
    let (_, step) = h.request("a");
    assert_eq!(reply_status(&step), Some(429));
    let Step::Reply(deny) = step else { panic!() };
    assert_eq!(
        header(&deny.headers, "ratelimit"),
        Some("\"edge/s\";r=0;t=1")
    );
    assert_eq!((h.stat("local_allowed"), h.stat("local_denied")), (2, 1));
    h.wake();
    assert_eq!(h.calls(), 1, "the local deny made no call");
}

#[test]
fn local_only_requests_never_call() {
    let mut h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]}, "rules": [
              {"name": "edge", "scope": "local", "limits": [{"name": "s", "requests": 1, "window": "1s"}]}]}"#,
        )
        .unwrap(),
    );
    let (mut s, step) = h.request("a");
    assert_eq!(step, Step::Continue);
    h.worker.on_response_headers(&h.host, &mut s);
    let headers = h.host.response_headers.borrow();
    assert!(headers
        .iter()
        .any(|(_, k, v)| k == "ratelimit" && v == "\"edge/s\";r=0;t=1"));
    drop(headers);
    assert_eq!(reply_status(&h.request("a").1), Some(429));
    h.wake();
    assert_eq!(h.calls(), 0);
}

#[test]
fn a_cached_deny_costs_no_call() {
    let mut h = harness(ONE_CALL);
    let (mut s, step) = h.request("a");
    assert_eq!(step, Step::Pause);
    let step = h.answer_check(&mut s, Some(200), &answer(&[result(false, 0)]));
    assert_eq!(reply_status(&step), Some(429));
    assert_eq!(h.calls(), 1);
    let (_, step) = h.request("a");
    let Step::Reply(deny) = step else {
        panic!("expected a cached deny")
    };
    assert_eq!(deny.status, 429);
    assert_eq!(header(&deny.headers, "retry-after"), Some("30"));
    assert_eq!(h.calls(), 1, "no call for a cached deny");
    assert_eq!(h.stat("deny_cache_hits"), 1);
    // Another client is not affected, and the deny ends when it said.
    assert_eq!(h.request("b").1, Step::Pause);
    h.advance(30_000);
    assert_eq!(h.request("a").1, Step::Pause);
    assert_eq!(h.calls(), 3);
}

/// Two meshlimit plugins in one proxy share shared data when they share a
/// `vm_id` (Istio leaves it empty): one pointing at a missing cluster must
/// not open the other's breaker, nor touch its counters. Each instance's
/// keys carry its plugin name, root id and cluster (`shared::keys`).
#[test]
fn a_failing_plugin_instance_never_opens_anothers_breaker() {
    capture_logs();
    let host = FakeHost::default();
    host.enter(ROOT);
    let worker_of = |name: &str, cluster: &str| {
        *host.request.borrow_mut() =
            FakeRequest::default().with_property(&["plugin_name"], name.as_bytes());
        let extra = format!(
            r#""group_commit": {{"enabled": false}}, "service": {{"cluster": "{cluster}"}},"#
        );
        Worker::new(&host, config(&extra), ROOT)
    };
    let broken = worker_of("gateway.typo", "meshlimit-typo");
    let healthy = worker_of("gateway.api", "meshlimit");
    let request = |worker: &Worker, context: u32| {
        let mut stream = worker.stream(context);
        *host.request.borrow_mut() = FakeRequest::default()
            .with_header(":path", b"/api/items")
            .with_header("x-api-key", format!("c{context}").as_bytes());
        host.enter(context);
        worker.on_request_headers(&host, &mut stream, true)
    };
    // The broken instance cannot dispatch: five failures open its breaker.
    host.dispatch_fails.set(true);
    for context in 100..105 {
        assert_eq!(
            request(&broken, context),
            Step::Continue,
            "failure_mode local"
        );
    }
    assert!(logged(&["breaker open"]));
    host.dispatch_fails.set(false);
    // The healthy instance still calls meshlimitd for every fresh client.
    let calls = host.sent.borrow().len();
    for context in 200..203 {
        assert_eq!(
            request(&healthy, context),
            Step::Pause,
            "decided by meshlimitd"
        );
    }
    assert_eq!(host.sent.borrow().len(), calls + 3);
    let keys: Vec<String> = host.store.data.borrow().keys().cloned().collect();
    assert!(keys.iter().all(|k| k.starts_with("meshlimit.")), "{keys:?}");
}

#[test]
fn an_open_breaker_costs_no_call_and_one_probe_closes_it() {
    let mut h = harness(ONE_CALL);
    // Five failed calls (the default) open it.
    for _ in 0..5 {
        let (mut s, _) = h.request("a");
        let step = h.answer_check(&mut s, Some(503), r#"{"error":"redis down"}"#);
        assert_eq!(step, Step::Continue, "failure_mode local admits");
    }
    assert_eq!(h.stat("breaker_opened"), 1);
    assert_eq!(h.stat("breaker_open"), 1);
    let calls = h.calls();
    let (_, step) = h.request("a");
    assert_eq!(step, Step::Continue);
    assert_eq!(h.calls(), calls, "open: decided without a call");
    // After `open` (250ms), exactly one request probes.
    h.advance(250);
    let (mut probe, step) = h.request("a");
    assert_eq!(step, Step::Pause);
    assert_eq!(h.request("b").1, Step::Continue, "others keep skipping");
    // The probe asks for a lease: the root sends it.
    h.wake();
    assert_eq!(h.calls(), calls + 1);
    h.answer_check(&mut probe, Some(200), &answer(&[result(true, 10)]));
    assert_eq!(h.stat("breaker_open"), 0, "closed again");
    // The lease asks of the failed calls are named lost, in one call, once
    // a call succeeds (never while meshlimitd fails).
    h.wake();
    assert_eq!(h.calls(), calls + 2);
    let lost = h.last_call_body()["lost"].as_array().map_or(0, Vec::len);
    assert_eq!(lost as u64, h.stat("lease_asks_lost"));
    assert!(lost > 0);
    assert_eq!(h.request("c").1, Step::Pause);
    assert_eq!(h.calls(), calls + 3);
}

// ---- failure modes on each kind of failure ----

/// Every kind of failed call, as the answer that produces it.
fn failures() -> Vec<(&'static str, Option<u32>, &'static str)> {
    vec![
        ("timeout", None, ""),
        ("connection", Some(503), "upstream connect error"),
        ("unavailable", Some(503), r#"{"error":"redis down"}"#),
        ("bad_status", Some(418), r#"{"error":"teapot"}"#),
        ("bad_body", Some(200), r#"{"nonsense":true}"#),
    ]
}

#[test]
fn every_failure_mode_on_every_kind_of_failure() {
    for (mode, expect) in [
        ("local", Some(Step::Continue)),
        ("allow", Some(Step::Continue)),
        ("deny", None),
    ] {
        for (kind, status, body) in failures() {
            for grouped in [false, true] {
                let extra = format!(
                    r#""failure_mode": "{mode}", "breaker": {{"failures": 1000}}, {}"#,
                    if grouped { "" } else { ONE_CALL }
                );
                let mut h = harness(&extra);
                let (mut s, step) = h.request("a");
                assert_eq!(step, Step::Pause);
                if grouped {
                    h.wake();
                }
                if kind == "timeout" {
                    // Envoy reports no response; the elapsed time says why.
                    h.advance(20);
                }
                let step = if grouped {
                    h.answer_batch(1, status, body);
                    match h.host.take_acted().pop().unwrap() {
                        Acted::Resumed(_) => Step::Continue,
                        Acted::Replied(_, r) => Step::Reply(r),
                        Acted::ResumedResponse(_) => unreachable!("no response yet"),
                    }
                } else {
                    h.answer_check(&mut s, status, body)
                };
                let what = format!("{mode} / {kind} / grouped {grouped}");
                match &expect {
                    Some(e) => assert_eq!(&step, e, "{what}"),
                    None => {
                        let Step::Reply(r) = &step else {
                            panic!("{what}: expected the configured deny")
                        };
                        assert_eq!(r.status, 429, "{what}");
                        assert_eq!(header(&r.headers, "retry-after"), Some("1"), "{what}");
                    }
                }
                assert_eq!(h.stat(&format!("service_errors.{kind}")), 1, "{what}");
                assert_eq!(h.fallbacks(), 1, "{what}");
                assert_eq!(
                    h.stat("fallback_denied"),
                    u64::from(mode == "deny"),
                    "{what}"
                );
                assert_eq!(h.stat("requests_allowed"), 0, "{what}");
            }
        }
    }
}

#[test]
fn the_local_fallback_enforces_this_envoys_share() {
    // Two replicas: each enforces half of 20 while meshlimitd is away.
    let mut h = harness(
        r#""local": {"expected_replicas": 2}, "breaker": {"failures": 1000}, "group_commit": {"enabled": false},"#,
    );
    h.host.dispatch_fails.set(true);
    let mut allowed = 0;
    for _ in 0..15 {
        let (s, step) = h.request("a");
        let step = h.decided(&s, step);
        if step == Step::Continue {
            allowed += 1;
        } else {
            let Step::Reply(r) = step else { panic!() };
            assert_eq!(r.status, 429);
            // The policy stays the global one; what remains is this
            // Envoy's share.
            assert_eq!(
                header(&r.headers, "ratelimit-policy"),
                Some("\"api/per-minute\";q=20;w=60")
            );
            assert!(header(&r.headers, "ratelimit")
                .unwrap()
                .starts_with("\"api/per-minute\";r=0;"));
        }
    }
    assert_eq!(allowed, 10);
    assert_eq!(
        (h.stat("fallback_allowed"), h.stat("fallback_denied")),
        (10, 5)
    );
    assert_eq!(h.stat("service_errors.connection"), 15);
}

/// Asks lost while meshlimitd fails wait for it; the root's tick, which
/// names asks that no call named, never takes a half-open breaker's one
/// probe: a request still probes. (A tick that took it kept a Redis
/// outage's replicas on the fallback for as long as asks waited, ten
/// seconds: `tests/tests/e2e.rs`
/// `redis_outage_falls_back_per_replica_and_recovers` failed so.)
#[test]
fn the_tick_never_takes_the_half_open_breakers_probe() {
    let mut h = harness(ONE_CALL);
    for _ in 0..5 {
        let (mut s, _) = h.request("a");
        h.answer_check(&mut s, Some(503), r#"{"error":"redis down"}"#);
    }
    assert_eq!(h.stat("breaker_opened"), 1);
    assert!(h.stat("lease_asks_lost") > 0, "asks wait to be named");
    let calls = h.calls();
    h.advance(600);
    h.tick();
    h.wake();
    assert_eq!(h.calls(), calls, "nothing named while the breaker is open");
    let (_, step) = h.request("a");
    assert_eq!(step, Step::Pause, "the request probes");
}

#[test]
fn a_4xx_never_trips_the_breaker_but_5xx_do() {
    let mut h = harness(ONE_CALL);
    for _ in 0..10 {
        let (mut s, _) = h.request("a");
        h.answer_check(&mut s, Some(400), r#"{"error":"bad"}"#);
    }
    assert_eq!(h.stat("breaker_opened"), 0);
    for _ in 0..5 {
        let (mut s, _) = h.request("a");
        h.answer_check(&mut s, Some(500), "oops");
    }
    assert_eq!(h.stat("breaker_opened"), 1);
}

#[test]
fn failures_of_calls_in_flight_while_open_only_extend_it() {
    let mut h = harness(
        r#""breaker": {"failures": 2, "open": "1s", "max_open": "8s"}, "group_commit": {"max_calls_in_flight": 1},"#,
    );
    for id in ["a", "b", "c", "d"] {
        h.request(id);
    }
    h.wake();
    // All four checks travel in one batch: one failure, not four.
    h.answer_batch(1, None, "");
    assert_eq!(h.stat("breaker_opened"), 0);
    h.request("e");
    h.wake();
    h.answer_batch(2, Some(503), "no");
    assert_eq!(h.stat("breaker_opened"), 1);
}

// ---- group commit ----

#[test]
fn concurrent_checks_share_one_call_and_each_gets_its_answer() {
    let mut h = harness(ONE_SLOT);
    let (first, step) = h.request("a");
    assert_eq!(step, Step::Pause);
    assert_eq!(h.host.wakes.get(), 1, "an idle batcher wakes the root");
    h.wake();
    assert_eq!(h.calls(), 1);
    assert_eq!(h.host.sent.borrow()[0].from, ROOT, "the root owns the call");
    // While that call is out, three more queue behind it.
    let streams: Vec<_> = ["b", "c", "d"].iter().map(|id| h.request(id)).collect();
    assert!(streams.iter().all(|(_, s)| *s == Step::Pause));
    h.wake();
    assert_eq!(h.calls(), 1, "queued behind the call in flight");
    h.answer_batch(1, Some(200), &answer(&[result(true, 19)]));
    // The answer sent the queued three at once, then resumed the first.
    assert_eq!(h.calls(), 2);
    assert_eq!(h.last_call_body()["checks"].as_array().unwrap().len(), 3);
    assert_eq!(h.host.take_acted(), vec![Acted::Resumed(first.context_id)]);
    h.answer_batch(
        2,
        Some(200),
        &answer(&[result(true, 18), result(false, 0), result(true, 17)]),
    );
    let acted = h.host.take_acted();
    assert_eq!(acted[0], Acted::Resumed(streams[0].0.context_id));
    assert!(
        matches!(&acted[1], Acted::Replied(id, r) if *id == streams[1].0.context_id && r.status == 429)
    );
    assert_eq!(acted[2], Acted::Resumed(streams[2].0.context_id));
    assert_eq!(
        (h.stat("requests_allowed"), h.stat("requests_denied")),
        (3, 1)
    );
    assert_eq!((h.stat("batches"), h.stat("batched_checks")), (2, 4));
    // The admitted streams get their headers with the response.
    let mut s = streams.into_iter().next().unwrap().0;
    h.host.enter(s.context_id);
    h.worker.on_response_headers(&h.host, &mut s);
    assert!(h
        .host
        .response_headers
        .borrow()
        .iter()
        .any(|(id, k, v)| *id == s.context_id && k == "ratelimit" && v.contains("r=18")));
}

#[test]
fn a_batch_answer_of_the_wrong_shape_falls_back_for_every_check() {
    let too_few = answer(&[result(true, 1)]);
    let too_many = answer(&[result(true, 1), result(true, 1), result(true, 1)]);
    let wrong_limits = r#"{"results":[{"allowed":true,"limits":[]},{"allowed":true,"limits":[]}]}"#;
    for body in [too_few.as_str(), too_many.as_str(), wrong_limits] {
        let mut h = harness(ONE_SLOT);
        h.request("first");
        h.wake();
        h.request("a");
        h.request("b");
        h.answer_batch(1, Some(200), &answer(&[result(true, 1)]));
        h.host.take_acted();
        h.answer_batch(2, Some(200), body);
        assert_eq!(h.host.take_acted().len(), 2, "{body}");
        // Error stats count the checks the failure decided.
        assert_eq!(h.stat("service_errors.bad_body"), 2, "{body}");
        assert_eq!(h.fallbacks(), 2, "{body}");
        assert_eq!(h.stat("requests_allowed"), 1, "only the first: {body}");
    }
}

#[test]
fn mis_ordered_results_are_caught_when_their_shapes_differ() {
    let mut h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]}, "group_commit": {"max_calls_in_flight": 1}, "rules": [
              {"name": "api", "match": {"path_prefix": "/api/"}, "limits": [{"name": "m", "requests": 20, "window": "60s"}]},
              {"name": "two", "match": {"path_prefix": "/two/"}, "limits": [
                 {"name": "m", "requests": 20, "window": "60s"}, {"name": "h", "requests": 90, "window": "1h"}]}]}"#,
        )
        .unwrap(),
    );
    h.request("first");
    h.wake();
    h.request_to("/api/x", "a");
    h.request_to("/two/x", "b");
    h.answer_batch(1, Some(200), &answer(&[result(true, 1)]));
    h.host.take_acted();
    let two = r#"{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":1,"reset_after_ms":1,"retry_after_ms":0},{"allowed":true,"limit":90,"remaining":1,"reset_after_ms":1,"retry_after_ms":0}]}"#;
    // The two-limit result first: it answers the wrong checks.
    h.answer_batch(2, Some(200), &answer(&[two.to_string(), result(true, 1)]));
    assert_eq!(h.stat("service_errors.bad_body"), 2);
    assert_eq!(h.fallbacks(), 2);
}

#[test]
fn a_stream_that_ends_while_queued_leaves_the_batch() {
    let mut h = harness(ONE_SLOT);
    h.request("first");
    h.wake();
    let (gone, _) = h.request("gone");
    let (stays, _) = h.request("stays");
    h.end(&gone);
    h.answer_batch(1, Some(200), &answer(&[result(true, 1)]));
    let body = h.last_call_body();
    let checks = body["checks"].as_array().unwrap();
    assert_eq!(checks.len(), 1);
    assert_eq!(checks[0]["subject"], "hdr:x-api-key:stays");
    h.host.take_acted();
    h.answer_batch(2, Some(200), &answer(&[result(true, 1)]));
    assert_eq!(h.host.take_acted(), vec![Acted::Resumed(stays.context_id)]);
}

#[test]
fn a_stream_that_ends_while_its_batch_is_in_flight_is_skipped() {
    let mut h = harness("");
    let (gone, _) = h.request("gone");
    h.wake();
    h.end(&gone);
    h.answer_batch(1, Some(200), &answer(&[result(true, 1)]));
    assert!(h.host.take_acted().is_empty(), "nothing to act on");
    assert_eq!(
        h.stat("requests_allowed"),
        1,
        "still counted: it was charged"
    );
    // Its headers are not kept for a stream that will never ask for them.
    assert!(h.worker.decided_headers.borrow().is_empty());
}

#[test]
fn a_stream_that_ends_while_its_own_call_is_out_changes_nothing() {
    let mut h = harness(ONE_CALL);
    let (s, step) = h.request("a");
    assert_eq!(step, Step::Pause);
    let token = h.last_token();
    h.end(&s);
    // Its own call was filed under the stream: the SDK drops the answer
    // with the context, so nothing acts and nothing is kept for it.
    assert_eq!(h.host.answer_goes_to(token), None);
    assert!(h.host.take_acted().is_empty());
    assert!(h.worker.outbox.is_idle());
    assert!(h.worker.awaiting.borrow().is_empty());
}

#[test]
fn a_full_queue_refuses_and_decides_by_failure_mode() {
    let mut h = harness(r#""group_commit": {"max_queued": 2, "max_calls_in_flight": 1},"#);
    h.request("first");
    h.wake();
    assert_eq!(h.request("a").1, Step::Pause);
    assert_eq!(h.request("b").1, Step::Pause);
    assert_eq!(
        h.request("c").1,
        Step::Continue,
        "refused: failure_mode local"
    );
    assert_eq!(h.stat("batch_overflow"), 1);
    assert_eq!(h.stat("fallback_allowed"), 1);
}

#[test]
fn a_root_that_cannot_be_woken_calls_for_the_stream_itself() {
    let mut h = harness(ONE_SLOT);
    h.host.queue_fails.set(false);
    let (s, step) = h.request("a");
    assert_eq!(step, Step::Pause);
    h.host.queue_fails.set(true);
    h.wake();
    // The next wake-up fails: the stream calls for itself (still as the
    // root, which owns every call).
    h.answer_batch(1, Some(200), &answer(&[result(true, 1)]));
    h.host.take_acted();
    let (mut own, step) = h.request("b");
    assert_eq!(step, Step::Pause);
    let sent = h.host.sent.borrow().last().unwrap().clone();
    assert_eq!(sent.from, ROOT, "owned by the root, for the stream");
    assert_eq!(
        h.host.context.get(),
        own.context_id,
        "back in the stream's context"
    );
    assert!(own.in_flight.is_some(), "the stream waits for its own call");
    assert_eq!(
        h.answer_check(&mut own, Some(200), &answer(&[result(true, 2)])),
        Step::Continue
    );
    drop(s);
}

#[test]
fn without_a_wake_queue_every_request_calls_for_itself() {
    let host = FakeHost::default();
    host.queue_fails.set(true);
    let worker = Worker::new(&host, config(""), ROOT);
    *host.request.borrow_mut() = FakeRequest::default()
        .with_header(":path", b"/api/x")
        .with_header("x-api-key", b"a");
    let mut s = worker.stream(9);
    host.enter(9);
    assert_eq!(worker.on_request_headers(&host, &mut s, true), Step::Pause);
    assert_eq!(host.sent.borrow()[0].from, ROOT, "calls belong to the root");
}

#[test]
fn a_failed_batch_dispatch_falls_back_for_every_check() {
    let mut h = harness("");
    h.request("a");
    h.host.dispatch_fails.set(true);
    h.wake();
    let acted = h.host.take_acted();
    assert_eq!(acted.len(), 1);
    assert!(matches!(acted[0], Acted::Resumed(_)));
    assert_eq!(h.stat("service_errors.connection"), 1);
    assert_eq!(h.stat("fallback_allowed"), 1);
}

// ---- headers ----

#[test]
fn headers_on_allow_and_deny() {
    let mut h = harness(ONE_CALL);
    let (mut s, _) = h.request("a");
    assert_eq!(
        h.answer_check(&mut s, Some(200), &answer(&[result(true, 7)])),
        Step::Continue
    );
    h.worker.on_response_headers(&h.host, &mut s);
    let added: Vec<(String, String)> = h
        .host
        .response_headers
        .borrow()
        .iter()
        .map(|(_, k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(
        added,
        vec![
            (
                "ratelimit-policy".to_string(),
                "\"api/per-minute\";q=20;w=60".to_string()
            ),
            (
                "ratelimit".to_string(),
                "\"api/per-minute\";r=7;t=30".to_string()
            ),
        ]
    );
    let (mut s, _) = h.request("b");
    let Step::Reply(deny) = h.answer_check(&mut s, Some(200), &answer(&[result(false, 0)])) else {
        panic!("expected a deny")
    };
    assert_eq!(deny.status, 429);
    assert_eq!(deny.body, "rate limit exceeded\n");
    assert_eq!(header(&deny.headers, "retry-after"), Some("30"));
    assert_eq!(
        header(&deny.headers, "ratelimit"),
        Some("\"api/per-minute\";r=0;t=30")
    );
}

#[test]
fn shadow_denials_are_counted_not_enforced() {
    let mut h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]}, "group_commit": {"enabled": false},
                "rules": [{"name": "api", "shadow": true, "limits": [{"name": "m", "requests": 1, "window": "60s"}]}]}"#,
        )
        .unwrap(),
    );
    let (mut s, _) = h.request("a");
    let body = r#"{"results":[{"allowed":true,"limits":[{"allowed":false,"limit":1,"remaining":0,"reset_after_ms":5,"retry_after_ms":5,"shadow":true}]}]}"#;
    assert_eq!(h.answer_check(&mut s, Some(200), body), Step::Continue);
    assert_eq!(h.stat("shadow_denied"), 1);
    assert_eq!(h.last_call_body()["checks"][0]["limits"][0]["shadow"], true);
}

// ---- what a request costs the host ----

/// The hostcalls of one request decided by meshlimitd through a batch,
/// after a warm-up (seed read, breaker state seen). Before the flow was
/// host-independent the glue made the same ones, but read `:path` and the
/// id header in two crossings (and added a zero to a stat); now all the
/// headers come in one.
#[test]
fn hostcalls_per_request_with_group_commit() {
    let mut h = harness("");
    h.request("warm");
    h.wake();
    h.answer_batch(1, Some(200), &answer(&[result(true, 1)]));
    h.advance(1);
    h.host.take_hostcalls();
    let (mut s, _) = h.request("a");
    assert_eq!(
        h.host.take_hostcalls(),
        [
            "get_header_map_pairs", // :path, x-api-key: all headers at once
            "get_current_time",     //
            "get_shared_data",      // the lease slot (any worker's lease serves)
            "get_shared_data",      // deny cache
            "get_shared_data",      // breaker (once per millisecond)
            "enqueue_shared_queue", // wake the root
        ]
    );
    h.wake();
    assert_eq!(
        h.host.take_hostcalls(),
        [
            "get_current_time",
            "set_effective_context", // calls belong to the root
            "dispatch_http_call",
            "increment_metric", // batches
            "increment_metric", // batched_checks
        ]
    );
    h.answer_batch(2, Some(200), &answer(&[result(true, 1)]));
    assert_eq!(
        h.host.take_hostcalls(),
        [
            "get_call_response_header", // :status
            "get_call_response_body",
            "get_current_time",
            "get_shared_data",       // breaker: still closed, nothing to write
            "set_effective_context", // the stream's
            "resume_http_request",
            "increment_metric", // requests_allowed, once per batch
        ]
    );
    h.host.enter(s.context_id);
    h.worker.on_response_headers(&h.host, &mut s);
    assert_eq!(h.host.take_hostcalls(), ["add_header", "add_header"]);
}

/// The same with one call per request: the call is sent as the root (so
/// a client's reset cannot cancel it and leak the SDK's entry for it).
#[test]
fn hostcalls_per_request_with_one_call_each() {
    let mut h = harness(ONE_CALL);
    let (mut warm, _) = h.request("warm");
    h.answer_check(&mut warm, Some(200), &answer(&[result(true, 1)]));
    h.advance(1);
    h.host.take_hostcalls();
    let (mut s, _) = h.request("a");
    assert_eq!(
        h.host.take_hostcalls(),
        [
            "get_header_map_pairs",
            "get_current_time",
            "get_shared_data",
            "get_shared_data",
            "get_shared_data",
            "set_effective_context", // the call belongs to the root
            "dispatch_http_call",
            "set_effective_context", // back to the stream
        ]
    );
    let step = h.answer_check(&mut s, Some(200), &answer(&[result(true, 1)]));
    assert!(perform(&h.host, step, true));
    assert_eq!(
        h.host.take_hostcalls(),
        [
            "get_call_response_header",
            "get_call_response_body",
            "get_current_time",
            "get_shared_data",
            "increment_metric",
            "resume_http_request",
        ]
    );
    h.worker.on_response_headers(&h.host, &mut s);
    assert_eq!(h.host.take_hostcalls(), ["add_header", "add_header"]);
}

#[test]
fn every_stat_is_defined_at_configure() {
    let h = harness("");
    for stat in crate::stats::Stat::ALL {
        // The version gauge holds the filter's version from the start.
        let want = match stat {
            crate::stats::Stat::Version => crate::stats::version_number(),
            _ => 0,
        };
        assert!(
            h.host.stat(stat.def().name) == want,
            "{} defined and {want}",
            stat.def().name
        );
    }
    assert_eq!(h.host.stat("meshlimit.version"), 100, "0.1.0");
}

// ---- the rest of the branches ----

#[test]
fn an_answer_for_a_call_never_sent_is_ignored() {
    let h = harness("");
    // Not through `answer_batch`: the SDK traps on a token it never filed,
    // so only a token the worker forgot (not Envoy's mistake) gets here.
    let body = answer(&[result(true, 1)]);
    h.host.respond(Some(200), &body);
    h.host.enter(ROOT);
    h.worker.on_batch_answer(&h.host, 42, 1, body.len());
    assert!(h.host.take_acted().is_empty());
    assert_eq!(h.stat("requests_allowed"), 0);
}

#[test]
fn without_a_deny_cache_every_request_calls() {
    let mut h = harness(&format!(r#""deny_cache": {{"slots": 0}}, {ONE_CALL}"#));
    for _ in 0..2 {
        let (mut s, step) = h.request("a");
        assert_eq!(step, Step::Pause);
        let step = h.answer_check(&mut s, Some(200), &answer(&[result(false, 0)]));
        assert_eq!(reply_status(&step), Some(429));
    }
    assert_eq!(h.calls(), 2);
    assert_eq!(h.stat("deny_cache_hits"), 0);
}

#[test]
fn broken_shared_data_admits_uncounted_and_says_so() {
    let mut h = harness(ONE_CALL);
    h.host.store.broken.set(true);
    h.host.dispatch_fails.set(true);
    for _ in 0..30 {
        assert_eq!(h.request("a").1, Step::Continue);
    }
    assert_eq!(h.stat("fallback_uncounted"), 30);
    assert_eq!(h.stat("fallback_allowed"), 30);
    assert!(logged(&[
        "could not connect to meshlimitd",
        "deciding by failure_mode Local"
    ]));
}

#[test]
fn stats_the_host_refuses_are_skipped() {
    let host = FakeHost::default();
    host.metrics_refused.set(true);
    let worker = Worker::new(&host, config(ONE_CALL), ROOT);
    *host.request.borrow_mut() = FakeRequest::default()
        .with_header(":path", b"/api/x")
        .with_header("x-api-key", b"a");
    let mut s = worker.stream(3);
    assert_eq!(worker.on_request_headers(&host, &mut s, true), Step::Pause);
    host.respond(Some(200), &answer(&[result(true, 1)]));
    assert_eq!(worker.on_call_answer(&host, &mut s, 1, 10), Step::Continue);
    assert!(!host.take_hostcalls().contains(&"increment_metric"));
    assert!(logged(&["cannot define stat meshlimit.requests_allowed"]));
}

#[test]
fn a_reply_that_cannot_be_sent_is_logged() {
    let mut h = harness("");
    h.host.reply_fails.set(true);
    let (_, step) = h.request("");
    assert!(!perform(&h.host, step, false));
    assert!(logged(&["cannot send the 401 response"]));
    assert!(perform(&h.host, Step::Continue, false));
    assert!(
        h.host.take_acted().is_empty(),
        "not paused: nothing to resume"
    );
}

#[test]
fn methods_are_matched_from_the_headers_read_once() {
    let h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]}, "group_commit": {"enabled": false},
                "rules": [{"name": "writes", "match": {"methods": ["POST"]},
                           "limits": [{"name": "m", "requests": 5, "window": "60s"}]}]}"#,
        )
        .unwrap(),
    );
    h.host
        .request
        .borrow_mut()
        .headers
        .push((":method".into(), b"GET".to_vec()));
    h.host.take_hostcalls();
    let mut s = h.worker.stream(5);
    assert_eq!(
        h.worker.on_request_headers(&h.host, &mut s, true),
        Step::Continue,
        "a GET matches no rule"
    );
    assert_eq!(h.host.take_hostcalls(), ["get_header_map_pairs"]);
    *h.host.request.borrow_mut() = FakeRequest::default()
        .with_header(":method", b"POST")
        .with_header(":path", b"/")
        .with_header("x-api-key", b"a");
    assert_eq!(
        h.worker.on_request_headers(&h.host, &mut s, true),
        Step::Pause
    );
}

#[test]
fn an_open_breaker_with_failure_mode_deny_denies_without_a_call() {
    let mut h = harness(&format!(
        r#""failure_mode": "deny", "breaker": {{"failures": 1}}, {ONE_CALL}"#
    ));
    let (mut s, _) = h.request("a");
    h.answer_check(&mut s, None, "");
    assert_eq!(h.stat("breaker_opened"), 1);
    let (_, step) = h.request("a");
    let Step::Reply(r) = step else {
        panic!("expected the configured deny")
    };
    assert_eq!(header(&r.headers, "retry-after"), Some("1"));
    assert_eq!(h.calls(), 1);
    assert!(logged(&["breaker open", "deciding by failure_mode Deny"]));
    // The fallback's line is written once per interval: the first failure's.
    assert!(logged(&[
        "could not connect to meshlimitd; deciding by failure_mode Deny",
        "this one: denied"
    ]));
}

#[test]
fn without_group_commit_waking_and_ending_do_nothing() {
    let mut h = harness(ONE_CALL);
    let (s, _) = h.request("a");
    h.wake();
    h.end(&s);
    assert_eq!(h.calls(), 1);
    assert!(logged(&["group commit off"]));
    harness("");
    assert!(logged(&["configured 1 rule(s)", "group commit on"]));
}

/// Local and global rules: the global answer is combined with the local
/// decision in the headers; with `failure_mode: allow` only the local
/// statuses remain.
#[test]
fn local_and_global_results_are_reported_together() {
    let both = |extra: &str| {
        crate::config::parse(
            format!(
                r#"{{{extra} "client_id": {{"headers": ["x-api-key"]}}, "group_commit": {{"enabled": false}}, "rules": [
                  {{"name": "edge", "scope": "local", "limits": [{{"name": "s", "requests": 5, "window": "1s"}}]}},
                  {{"name": "api", "limits": [{{"name": "per-minute", "requests": 20, "window": "60s"}}]}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    };
    let mut h = harness_with(both(""));
    let (mut s, _) = h.request("a");
    let body = h.last_call_body();
    assert_eq!(body["checks"][0]["limits"].as_array().unwrap().len(), 1);
    assert_eq!(
        h.answer_check(&mut s, Some(200), &answer(&[result(true, 1)])),
        Step::Continue
    );
    h.worker.on_response_headers(&h.host, &mut s);
    let added = h.host.response_headers.borrow().clone();
    assert!(added.iter().any(|(_, k, v)| k == "ratelimit-policy"
        && v == "\"edge/s\";q=5;w=1, \"api/per-minute\";q=20;w=60"));
    assert!(added
        .iter()
        .any(|(_, k, v)| k == "ratelimit" && v == "\"api/per-minute\";r=1;t=30"));
    let mut h = harness_with(both(r#""failure_mode": "allow","#));
    let (mut s, _) = h.request("a");
    assert_eq!(h.answer_check(&mut s, None, ""), Step::Continue);
    h.worker.on_response_headers(&h.host, &mut s);
    let added = h.host.response_headers.borrow().clone();
    assert!(added
        .iter()
        .any(|(_, k, v)| k == "ratelimit" && v == "\"edge/s\";r=4;t=1"));
}

/// Shared data outlives a configuration push (same `vm_id`): a deny cached
/// under the old limit must not deny under the new one.
#[test]
fn a_cached_deny_does_not_outlive_a_changed_limit() {
    let one_per_hour = |requests: u64| {
        crate::config::parse(
            format!(
                r#"{{"client_id": {{"headers": ["x-api-key"]}}, "group_commit": {{"enabled": false}},
                    "rules": [{{"name": "api", "limits": [{{"name": "hourly", "requests": {requests}, "window": "1h"}}]}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    };
    let mut h = harness_with(one_per_hour(1));
    let (mut s, _) = h.request_to("/", "a");
    let denied = r#"{"results":[{"allowed":false,"limits":[{"allowed":false,"limit":1,"remaining":0,"reset_after_ms":3000000,"retry_after_ms":3000000}]}]}"#;
    h.answer_check(&mut s, Some(200), denied);
    assert!(matches!(h.request_to("/", "a").1, Step::Reply(_)), "cached");
    // The operator raises the limit; the new worker shares the old data.
    let raised = Worker::new(&h.host, one_per_hour(100), ROOT);
    h.worker = raised;
    let calls = h.calls();
    assert_eq!(
        h.request_to("/", "a").1,
        Step::Pause,
        "decided by meshlimitd"
    );
    assert_eq!(h.calls(), calls + 1);
}

/// One check's bad input never changes another check's decision: meshlimitd
/// refuses that check alone, or cannot reach its Redis node, and the rest
/// of the batch keeps meshlimitd's decisions.
#[test]
fn a_check_refused_or_undecided_alone_leaves_the_batch_decided() {
    let mut h = harness(ONE_SLOT);
    h.request("first");
    h.wake();
    let (a, _) = h.request("a");
    let (bad, _) = h.request("bad");
    let (gone, _) = h.request("on-a-dead-node");
    let (b, _) = h.request("b");
    h.answer_batch(1, Some(200), &answer(&[result(true, 1)]));
    h.host.take_acted();
    let refused = r#"{"error":"checks[1].subject: at most 65536 bytes","kind":"invalid"}"#;
    let unavailable = r#"{"error":"redis error: connection refused","kind":"unavailable"}"#;
    h.answer_batch(
        2,
        Some(200),
        &answer(&[
            result(true, 5),
            refused.to_string(),
            unavailable.to_string(),
            result(false, 0),
        ]),
    );
    let acted = h.host.take_acted();
    assert_eq!(acted[0], Acted::Resumed(a.context_id));
    assert_eq!(
        acted[1],
        Acted::Resumed(bad.context_id),
        "failure_mode local"
    );
    assert_eq!(
        acted[2],
        Acted::Resumed(gone.context_id),
        "failure_mode local"
    );
    assert!(matches!(&acted[3], Acted::Replied(id, r) if *id == b.context_id && r.status == 429));
    assert_eq!(h.stat("requests_allowed"), 2, "first and a");
    assert_eq!(h.stat("requests_denied"), 1, "b");
    assert_eq!(h.stat("service_errors.invalid_check"), 1);
    assert_eq!(h.stat("service_errors.unavailable"), 1);
    assert_eq!(h.fallbacks(), 2);
    assert_eq!(h.stat("breaker_opened"), 0, "the call itself succeeded");
    assert!(logged(&["meshlimitd refused the check: checks[1].subject"]));
}

#[test]
fn calls_carry_the_shared_token_and_the_callers_timeout() {
    let mut h = harness(r#""service": {"timeout": "25ms", "auth_token": "s3cret-s3cret-s3cret"},"#);
    h.request("a");
    h.wake();
    let sent = h.host.sent.borrow()[0].clone();
    assert_eq!(
        sent.authorization.as_deref(),
        Some("Bearer s3cret-s3cret-s3cret")
    );
    assert_eq!(sent.timeout_ms, 25);
    let mut h = harness("");
    h.request("a");
    h.wake();
    assert_eq!(h.host.sent.borrow()[0].authorization, None);
}

/// Proxy-wasm hands the filter the first of repeated headers only; an
/// upstream may read another. `x-api-key: victim` + `x-api-key: mine` must
/// not spend the victim's quota, and two cost headers are no cost at all.
#[test]
fn repeated_id_or_cost_headers_are_ambiguous() {
    let h = harness(ONE_CALL);
    h.host.request.borrow_mut().headers = vec![
        (":path".into(), b"/api/x".to_vec()),
        ("x-api-key".into(), b"victim".to_vec()),
        ("x-api-key".into(), b"mine".to_vec()),
    ];
    let mut s = h.worker.stream(50);
    let step = h.worker.on_request_headers(&h.host, &mut s, true);
    assert_eq!(
        reply_status(&step),
        Some(401),
        "counts as missing: when_missing reject"
    );
    assert_eq!(h.calls(), 0);
    let mut h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]}, "rules": [{"name": "api", "cost": {"header": "x-cost", "max": 10},
                "limits": [{"name": "m", "requests": 10, "window": "60s"}]}]}"#,
        )
        .unwrap(),
    );
    h.host.request.borrow_mut().headers = vec![
        (":path".into(), b"/".to_vec()),
        ("x-api-key".into(), b"a".to_vec()),
        ("x-cost".into(), b"9".to_vec()),
        ("x-cost".into(), b"1".to_vec()),
    ];
    let step = h.worker.on_request_headers(&h.host, &mut s, true);
    assert_eq!(reply_status(&step), Some(400));
    assert_eq!(h.stat("rejected_invalid_cost"), 1);
    // x-forwarded-for headers are one list.
    let _ = h.request("a");
}

/// Limits counted by a peer identity: a caller without one is not counted
/// (and says so in a stat), or refused with 403 where configured; the
/// identity is read from the host only for the limits that need it.
#[test]
fn a_missing_attribute_is_counted_in_a_stat_and_never_called_for() {
    let config = crate::config::parse(
        br#"{"group_commit": {"enabled": false}, "rules": [
          {"name": "mesh", "match": {"path_prefix": "/svc/"},
           "limits": [{"name": "per-caller", "requests": 5, "window": "1s", "by": ["peer_identity"]}]},
          {"name": "strict", "match": {"path_prefix": "/strict/"},
           "limits": [{"name": "per-caller", "requests": 5, "window": "1s", "by": ["peer_identity"],
                       "missing": "reject"}]}]}"#,
    )
    .unwrap();
    let mut h = harness_with(config);
    assert_eq!(h.request_to("/svc/x", "").1, Step::Continue);
    assert_eq!(h.stat("skipped_missing_attribute"), 1);
    assert_eq!(h.calls(), 0);
    let (_, step) = h.request_to("/strict/x", "");
    assert_eq!(reply_status(&step), Some(403));
    assert_eq!(h.stat("rejected_missing_attribute"), 1);
    // With a certificate's identity, the limit is checked for it.
    h.next_context += 1;
    let mut stream = h.worker.stream(h.next_context);
    *h.host.request.borrow_mut() = FakeRequest::default()
        .with_header(":path", b"/svc/x")
        .with_property(
            &["connection", "uri_san_peer_certificate"],
            b"spiffe://td/sa/a",
        );
    h.host.enter(stream.context_id);
    assert_eq!(
        h.worker.on_request_headers(&h.host, &mut stream, true),
        Step::Pause
    );
    let sent = h.host.sent.borrow();
    let body: serde_json::Value = serde_json::from_slice(&sent[0].body).unwrap();
    assert_eq!(body["checks"][0]["subject"], "peer:spiffe://td/sa/a");
}

/// A gRPC request denied gets a gRPC status (RESOURCE_EXHAUSTED by
/// default, `response.grpc_status`), not the HTTP 429 that gRPC clients
/// read as UNAVAILABLE and retry.
#[test]
fn a_denied_grpc_request_gets_a_grpc_status() {
    let mut h = harness(ONE_CALL);
    let mut deny_one = |id: &str, content_type: &[u8]| {
        h.next_context += 1;
        let mut s = h.worker.stream(h.next_context);
        *h.host.request.borrow_mut() = FakeRequest::default()
            .with_header(":path", b"/api/items")
            .with_header("content-type", content_type)
            .with_header("x-api-key", id.as_bytes());
        h.host.enter(s.context_id);
        assert_eq!(
            h.worker.on_request_headers(&h.host, &mut s, true),
            Step::Pause
        );
        let step = h.answer_check(&mut s, Some(200), &answer(&[result(false, 0)]));
        let Step::Reply(reply) = step else {
            panic!("denied: {step:?}")
        };
        assert_eq!(reply.grpc_status, 8, "RESOURCE_EXHAUSTED");
        h.host.enter(s.context_id);
        perform(&h.host, Step::Reply(reply), true);
        h.host.grpc_replies.get()
    };
    assert_eq!(deny_one("g", b"application/grpc+proto"), 1, "as gRPC");
    assert_eq!(deny_one("j", b"application/json"), 1, "plain HTTP: a 429");
}
