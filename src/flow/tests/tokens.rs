//! Token budgets through the flow, on the fake host: a reservation read
//! from the body, its settlement riding the next batch, a stream topped
//! up and cut at its budget, and a client that leaves.

use super::*;
use crate::tokens::sse::CUT_EVENTS;

/// A token rule: reserve `reserve` (a JSON value), usage from the body or
/// the last event, a budget of 1,000 a minute per `x-api-key`.
fn token_config(reserve: &str) -> Config {
    token_config_with(reserve, ONE_SLOT)
}

fn token_config_with(reserve: &str, extra: &str) -> Config {
    crate::config::parse(
        format!(
            r#"{{{extra} "client_id": {{"headers": ["x-api-key"], "when_missing": "reject"}},
            "rules": [{{"name": "llm", "match": {{"path_prefix": "/v1/"}},
                "cost": {{"reserve": {reserve},
                          "response": {{"json": "usage.total_tokens", "sse_json": "usage.total_tokens"}}}},
                "limits": [{{"name": "tokens", "requests": 1000, "window": "60s"}}]}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

/// An admitted answer for one limit of 1,000, with a receipt.
fn reserved(remaining: u64) -> String {
    format!(
        r#"{{"allowed":true,"limits":[{{"allowed":true,"limit":1000,"remaining":{remaining},"reset_after_ms":30000,"retry_after_ms":0}}],"receipts":[{{"clock_us":7,"nonce":"n1","place":0}}]}}"#
    )
}

impl Harness {
    /// A POST to `/v1/chat` from `id` whose body follows.
    pub(super) fn post(&mut self, id: &str) -> (Stream, Step) {
        self.next_context += 1;
        let mut stream = self.worker.stream(self.next_context);
        *self.host.request.borrow_mut() = FakeRequest::default()
            .with_header(":path", b"/v1/chat")
            .with_header(":method", b"POST")
            .with_header("x-api-key", id.as_bytes());
        self.host.enter(stream.context_id);
        let step = self
            .worker
            .on_request_headers(&self.host, &mut stream, false);
        (stream, step)
    }

    /// A POST from `id` whose fixed reservation meshlimitd admitted, with
    /// `remaining` left: the stream, resumed.
    fn admitted_post(&mut self, id: &str, remaining: u64) -> Stream {
        let (s, _) = self.post(id);
        self.wake();
        self.answer_batch(
            self.last_token(),
            Some(200),
            &answer(&[reserved(remaining)]),
        );
        self.host.take_acted();
        s
    }

    pub(super) fn request_body(&self, stream: &mut Stream, body: &[u8], end: bool) -> Step {
        *self.host.request_body.borrow_mut() = body.to_vec();
        self.host.enter(stream.context_id);
        self.worker
            .on_request_body(&self.host, stream, body.len(), end)
    }

    pub(super) fn response_headers(
        &self,
        stream: &mut Stream,
        status: &str,
        content_type: &str,
    ) -> bool {
        self.response_headers_with(
            stream,
            &[(":status", status), ("content-type", content_type)],
        )
    }

    fn response_headers_with(&self, stream: &mut Stream, headers: &[(&str, &str)]) -> bool {
        *self.host.upstream_headers.borrow_mut() = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect();
        self.host.enter(stream.context_id);
        self.worker.on_response_headers(&self.host, stream)
    }

    /// A response chunk; what the client gets of it, and whether it went on.
    pub(super) fn response_body(
        &self,
        stream: &Stream,
        chunk: &[u8],
        end: bool,
    ) -> (Vec<u8>, bool) {
        *self.host.response_body.borrow_mut() = chunk.to_vec();
        self.host.enter(stream.context_id);
        let go_on = self
            .worker
            .on_response_body(&self.host, stream, chunk.len(), end);
        (self.host.response_body.borrow().clone(), go_on)
    }
}

fn delta(i: u32) -> String {
    format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n")
}

#[test]
fn a_reservation_read_from_the_body_is_settled_in_the_next_batch() {
    // The prompt is left out here (see the prompt's own test below).
    let mut h = harness_with(token_config(
        r#"{"request_json": "max_tokens", "default": 50, "max": 500, "prompt_bytes_per_token": 0}"#,
    ));
    let (mut s, step) = h.post("a");
    assert_eq!(step, Step::Continue, "headers go on; the body waits");
    assert_eq!(h.request_body(&mut s, br#"{"max_tok"#, false), Step::Pause);
    let step = h.request_body(&mut s, br#"{"max_tokens": 300}"#, true);
    assert_eq!(step, Step::Pause, "queued");
    h.wake();
    let call = h.last_call_body();
    assert_eq!(call["checks"][0]["limits"][0]["cost"], 300);
    assert_eq!(call["checks"][0]["receipt"], true);
    h.answer_batch(1, Some(200), &answer(&[reserved(700)]));
    assert_eq!(h.host.take_acted(), [Acted::Resumed(s.context_id)]);
    assert_eq!(h.stat("tokens_reserved"), 300);

    assert!(h.response_headers(&mut s, "200", "application/json"));
    let (_, go_on) = h.response_body(&s, br#"{"usage":{"total_to"#, false);
    assert!(go_on, "chunks pass as they come");
    let (_, go_on) = h.response_body(&s, br#"kens":120}}"#, true);
    assert!(!go_on, "the end waits for the settlement");
    h.wake();
    let call = h.last_call_body();
    assert_eq!(call["checks"], json!([]));
    let settlement = &call["settlements"][0];
    assert_eq!(settlement["actual"], json!([120]));
    assert_eq!(settlement["limits"][0]["cost"], 300);
    assert_eq!(settlement["receipts"][0]["nonce"], "n1");
    h.answer_batch(
        2,
        Some(200),
        r#"{"results":[],"settled":[{"remaining":[880]}]}"#,
    );
    assert_eq!(h.host.take_acted(), [Acted::ResumedResponse(s.context_id)]);
    assert_eq!(
        (h.stat("tokens_settled"), h.stat("tokens_refunded")),
        (120, 180)
    );
    // The same, on the rule's limit (added to its stats on the tick).
    h.host.enter(ROOT);
    h.worker.on_tick(&h.host);
    let limit = |event: &str| {
        h.host
            .stat(&format!("meshlimit.rule.llm.limit.tokens.{event}"))
    };
    assert_eq!(
        (
            limit("tokens_reserved"),
            limit("tokens_settled"),
            limit("tokens_refunded")
        ),
        (300, 120, 180)
    );
}

/// Envoy's HTTP/1 codec hands a response's body on, then its end in an
/// empty chunk of its own; a client reading by `content-length` has the
/// whole body with the first. The chunk that completes the length is the
/// response's end: it waits for the settlement, so the client cannot send
/// its next request before its unused units are free (a CI run of
/// `tests/tests/tokens.rs` saw the next request refused for them).
#[test]
fn the_chunk_that_completes_the_content_length_waits_for_the_settlement() {
    let mut h = harness_with(token_config("1000"));
    let mut s = h.admitted_post("a", 0);
    let body = br#"{"usage":{"total_tokens":100}}"#;
    let length = body.len().to_string();
    assert!(h.response_headers_with(
        &mut s,
        &[
            (":status", "200"),
            ("content-type", "application/json"),
            ("content-length", &length)
        ],
    ));
    let (_, go_on) = h.response_body(&s, &body[..10], false);
    assert!(go_on, "chunks before it pass as they come");
    let (_, go_on) = h.response_body(&s, &body[10..], false);
    assert!(!go_on, "the body is whole: it waits for the settlement");
    h.wake();
    assert_eq!(h.last_call_body()["settlements"][0]["actual"], json!([100]));
    h.answer_batch(
        h.last_token(),
        Some(200),
        r#"{"results":[],"settled":[{"remaining":[900]}]}"#,
    );
    assert_eq!(h.host.take_acted(), [Acted::ResumedResponse(s.context_id)]);
    let (_, go_on) = h.response_body(&s, b"", true);
    assert!(go_on, "the codec's empty end goes on");
    let calls = h.calls();
    h.wake();
    assert_eq!(h.calls(), calls, "settled once");
    assert_eq!(h.stat("tokens_settled"), 100);
}

/// A reservation whose call timed out (its script may have run): the
/// fallback reserved it, so meshlimitd's charge is named in the next call
/// that succeeds, by the id the check went with, and goes back (see
/// `service/tests/leases.rs` `a_lost_reservation_goes_back_exactly_once`).
#[test]
fn a_lost_reservation_is_named_in_the_next_call() {
    let mut h = harness_with(token_config("40"));
    let (s, _) = h.post("a");
    h.wake();
    let sent = h.last_call_body()["checks"][0].clone();
    let id = sent["id"].as_u64().unwrap_or(0);
    assert!(id != 0 && sent["receipt"] == true, "{sent}");
    h.answer_batch(h.last_token(), None, "");
    assert_eq!(
        (
            h.stat("answers_lost"),
            h.stat("reservations_lost"),
            h.stat("lease_asks_lost")
        ),
        (1, 1, 0)
    );
    assert_eq!(
        h.host.take_acted(),
        [Acted::Resumed(s.context_id)],
        "the fallback admits it"
    );
    let (_, _) = h.post("b");
    h.wake();
    assert!(
        h.last_call_body().get("lost").is_none(),
        "not before a call succeeds"
    );
    h.answer_batch(h.last_token(), Some(200), &answer(&[reserved(960)]));
    let named = h.last_call_body();
    assert_eq!(
        named["lost"],
        json!([{"subject": sent["subject"], "limits": sent["limits"], "id": id}]),
        "{named}"
    );
}

/// A lost reservation whose worker gets no more requests (its client's
/// next ones went to the Envoy's other workers): the root's tick names it
/// in a call of its own, half a second on, once the breaker is closed.
#[test]
fn a_lost_reservation_is_named_by_the_tick_when_no_call_comes() {
    let mut h = harness_with(token_config("40"));
    h.post("a");
    h.wake();
    let sent = h.last_call_body()["checks"][0].clone();
    h.answer_batch(h.last_token(), None, "");
    let calls = h.calls();
    h.tick();
    assert_eq!(h.calls(), calls, "not at once");
    h.advance(600);
    h.tick();
    h.wake();
    assert_eq!(h.calls(), calls + 1, "a call of its own");
    let named = h.last_call_body();
    assert_eq!(named["lost"][0]["id"], sent["id"], "{named}");
    assert_eq!(named["checks"], json!([]), "{named}");
}

/// An event stream framed by its `content-length`: the gate may take the
/// usage event out or end the stream at the budget, so the client must
/// not be told the upstream's length (Envoy frames the body it gets).
#[test]
fn an_event_stream_goes_without_the_upstreams_content_length() {
    let mut h = harness_with(token_config("40"));
    let mut s = h.admitted_post("a", 960);
    assert!(h.response_headers_with(
        &mut s,
        &[
            (":status", "200"),
            ("content-type", "text/event-stream"),
            ("content-length", "2970")
        ],
    ));
    let headers = h.host.upstream_headers.borrow();
    assert!(
        !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-length")),
        "{headers:?}"
    );
    assert!(headers.iter().any(|(k, _)| k == "content-type"));
}

#[test]
fn a_body_with_no_reservation_reserves_the_default_and_one_above_the_capacity_is_refused() {
    let mut h = harness_with(token_config(
        r#"{"request_json": "max_tokens", "default": 50, "max": 5000, "prompt_bytes_per_token": 0}"#,
    ));
    let (mut s, _) = h.post("a");
    h.request_body(&mut s, b"not json", true);
    h.wake();
    assert_eq!(h.last_call_body()["checks"][0]["limits"][0]["cost"], 50);
    let (mut s, _) = h.post("b");
    let step = h.request_body(&mut s, br#"{"max_tokens": 4000}"#, true);
    assert_eq!(reply_status(&step), Some(429), "4000 can never fit in 1000");
    assert_eq!(h.stat("rejected_cost_above_capacity"), 1);
}

#[test]
fn a_stream_is_topped_up_then_cut_cleanly_at_its_budget() {
    let mut h = harness_with(token_config("2"));
    let (mut s, step) = h.post("a");
    assert_eq!(
        step,
        Step::Pause,
        "a fixed reservation is decided at the headers"
    );
    h.wake();
    h.answer_batch(1, Some(200), &answer(&[reserved(998)]));
    h.host.take_acted();
    assert!(h.response_headers(&mut s, "200", "text/event-stream"));
    let three = format!("{}{}{}", delta(0), delta(1), delta(2));
    let (out, go_on) = h.response_body(&s, three.as_bytes(), false);
    assert!(go_on);
    assert_eq!(
        out,
        format!("{}{}", delta(0), delta(1)).as_bytes(),
        "the third waits"
    );
    h.wake();
    let call = h.last_call_body();
    assert_eq!(
        call["checks"][0]["limits"][0]["cost"], 64,
        "a top-up of one step: the reservation, 64 at least (not a call per token)"
    );
    // No room: the budget is spent.
    let spent = r#"{"allowed":false,"limits":[{"allowed":false,"limit":1000,"remaining":0,"reset_after_ms":30000,"retry_after_ms":30000}]}"#;
    h.answer_batch(2, Some(200), &answer(&[spent.to_string()]));
    let (out, _) = h.response_body(&s, delta(3).as_bytes(), false);
    assert_eq!(out, CUT_EVENTS, "a final event and [DONE]");
    assert_eq!(h.stat("streams_cut"), 1);
    let (out, _) = h.response_body(&s, delta(4).as_bytes(), true);
    assert!(
        out.is_empty(),
        "the rest of the upstream's stream is dropped"
    );
    h.wake();
    let settlement = &h.last_call_body()["settlements"][0];
    assert_eq!(settlement["actual"], json!([2]), "what was delivered");
}

#[test]
fn a_client_that_leaves_before_the_response_is_refunded() {
    let mut h = harness_with(token_config("40"));
    let (s, _) = h.post("a");
    h.wake();
    h.answer_batch(1, Some(200), &answer(&[reserved(960)]));
    h.end(&s);
    h.wake();
    assert_eq!(h.last_call_body()["settlements"][0]["actual"], json!([0]));
    assert_eq!(h.stat("tokens_refunded"), 40);
}

#[test]
fn with_meshlimitd_away_a_reservation_is_settled_in_the_local_counters() {
    let mut h = harness_with(token_config_with("600", ONE_CALL));
    h.host.dispatch_fails.set(true);
    let mut admitted = Vec::new();
    for id in ["x", "x", "x"] {
        let (mut s, step) = h.post(id);
        let step = h.decided(&s, step);
        if step == Step::Continue {
            h.response_headers(&mut s, "200", "application/json");
            h.response_body(&s, br#"{"usage":{"total_tokens":100}}"#, true);
        }
        admitted.push(step == Step::Continue);
    }
    // Each holds 600 and settles at 100: without the local settlement
    // the second would not fit.
    assert_eq!(admitted, [true, true, true]);
    assert_eq!(h.stat("tokens_settled"), 300);
    let (s, step) = h.post("x");
    assert_eq!(h.decided(&s, step), Step::Continue, "300 + 600 fit");
    let (s, step) = h.post("x");
    assert_eq!(
        reply_status(&h.decided(&s, step)),
        Some(429),
        "900 + 600 do not"
    );
}

/// A response held for its settlement must not wait for other traffic:
/// when the root cannot be woken, the settlement goes in a call of its own.
#[test]
fn a_settlement_goes_alone_when_the_root_cannot_be_woken() {
    let mut h = harness_with(token_config("40"));
    let mut s = h.admitted_post("a", 960);
    h.host.queue_fails.set(true);
    assert!(h.response_headers(&mut s, "200", "application/json"));
    let (_, go_on) = h.response_body(&s, br#"{"usage":{"total_tokens":10}}"#, true);
    assert!(!go_on);
    assert_eq!(h.calls(), 2, "sent at once, without the root");
    assert_eq!(h.last_call_body()["settlements"][0]["actual"], json!([10]));
    h.answer_batch(
        2,
        Some(200),
        r#"{"results":[],"settled":[{"remaining":[990]}]}"#,
    );
    assert_eq!(h.host.take_acted(), [Acted::ResumedResponse(s.context_id)]);
}

/// Envoy may still accept a finished stream's context id (seen with an
/// upstream that answered before the request body was in): the answer for
/// a stream that ended acts on nothing, keeps nothing, and gives back what
/// it reserved.
#[test]
fn a_stream_gone_before_its_answer_keeps_nothing_and_gets_its_reservation_back() {
    let mut h = harness_with(token_config("40"));
    let (s, _) = h.post("a");
    h.wake();
    h.end(&s);
    h.answer_batch(1, Some(200), &answer(&[reserved(960)]));
    assert!(h.host.take_acted().is_empty(), "nothing to act on");
    assert!(h.worker.budgets.borrow().is_empty());
    assert!(h.worker.decided_headers.borrow().is_empty());
    h.wake();
    assert_eq!(h.last_call_body()["settlements"][0]["actual"], json!([0]));
    assert_eq!(h.stat("tokens_refunded"), 40);
}

/// Reservations read from the body (`max_tokens`, 50 by default, at most
/// 500), with the headers held (`allow_on_headers_stop_iteration`).
fn held_harness() -> Harness {
    harness_with(token_config_with(
        r#"{"request_json": "max_tokens", "default": 50, "max": 500}"#,
        r#""allow_on_headers_stop_iteration": true,"#,
    ))
}

/// With `allow_on_headers_stop_iteration` (Envoy honouring a paused header
/// callback with body callbacks), a request whose reservation is in its
/// body holds its headers until it is decided: a denied one never reaches
/// the upstream, an admitted one goes on whole.
#[test]
fn held_headers_go_on_only_when_the_request_is_admitted() {
    let mut h = held_harness();
    let (mut denied, step) = h.post("a");
    assert_eq!(step, Step::Pause, "the headers wait");
    assert_eq!(
        h.request_body(&mut denied, br#"{"max_tokens""#, false),
        Step::Pause
    );
    assert_eq!(
        h.request_body(&mut denied, br#"{"max_tokens": 300}"#, true),
        Step::Pause
    );
    h.wake();
    h.answer_batch(
        h.last_token(),
        Some(200),
        &answer(&[r#"{"allowed":false,"limits":[{"allowed":false,"limit":1000,"remaining":100,"reset_after_ms":30000,"retry_after_ms":30000}]}"#.to_string()]),
    );
    assert!(
        matches!(h.host.take_acted()[..], [Acted::Replied(id, ref r)] if id == denied.context_id && r.status == 429),
        "answered locally, headers never sent"
    );
    let (mut admitted, step) = h.post("b");
    assert_eq!(step, Step::Pause);
    h.request_body(&mut admitted, br#"{"max_tokens": 300}"#, true);
    h.wake();
    h.answer_batch(h.last_token(), Some(200), &answer(&[reserved(700)]));
    assert_eq!(h.host.take_acted(), [Acted::Resumed(admitted.context_id)]);
}

/// Set in the plugin configuration but not in Envoy's, a held request
/// would get no body callbacks and hang: the first one held a second with
/// no body makes the worker let every held request go on and stop holding.
#[test]
fn held_headers_whose_body_never_comes_go_on_and_holding_stops() {
    let mut h = held_harness();
    assert!(h.host.tick_ms.get().is_some(), "a tick to watch them");
    let (first, _) = h.post("a");
    h.advance(500);
    let (second, _) = h.post("b");
    h.host.enter(ROOT);
    h.worker.on_tick(&h.host);
    assert!(h.host.take_acted().is_empty(), "not late yet");
    h.advance(600);
    h.host.enter(ROOT);
    h.worker.on_tick(&h.host);
    let mut acted = h.host.take_acted();
    acted.sort_by_key(|a| format!("{a:?}"));
    assert_eq!(
        acted,
        [
            Acted::Resumed(first.context_id),
            Acted::Resumed(second.context_id)
        ]
    );
    assert!(logged(&[
        "allow_on_headers_stop_iteration is set",
        "Envoy's Wasm PluginConfig"
    ]));
    assert_eq!(h.post("c").1, Step::Continue, "no longer held");
}

/// Once a held request got its body, Envoy honours the setting: a slow
/// body later is no reason to stop holding.
#[test]
fn once_a_held_body_came_holding_goes_on_however_slow_the_next() {
    let mut h = held_harness();
    let (mut s, _) = h.post("a");
    h.request_body(&mut s, br#"{"max_tokens""#, false);
    let (_slow, _) = h.post("b");
    h.advance(5_000);
    h.host.enter(ROOT);
    h.worker.on_tick(&h.host);
    assert!(h.host.take_acted().is_empty());
    assert_eq!(h.post("c").1, Step::Pause, "still held");
}

/// Without held headers, a client whose budget is spent (meshlimitd said
/// 0 remain) is refused at its next request's headers, for as long as the
/// deny cache trusts an entry (a second: a refund may free units): its
/// headers never go upstream. A budget with units left is not cached (a
/// smaller reservation may fit).
#[test]
fn a_spent_budget_is_refused_at_the_headers() {
    let reserve = r#"{"request_json": "max_tokens", "default": 50, "max": 500}"#;
    let mut h = harness_with(token_config(reserve));
    let denied = |remaining: u64| {
        answer(&[format!(
            r#"{{"allowed":false,"limits":[{{"allowed":false,"limit":1000,"remaining":{remaining},"reset_after_ms":30000,"retry_after_ms":30000}}]}}"#
        )])
    };
    let refused_after_its_body = |h: &mut Harness, id: &str, remaining: u64| {
        let (mut s, step) = h.post(id);
        assert_eq!(step, Step::Continue, "headers go on (no hold)");
        h.request_body(&mut s, br#"{"max_tokens": 300}"#, true);
        h.wake();
        h.answer_batch(h.last_token(), Some(200), &denied(remaining));
        assert!(matches!(h.host.take_acted()[..], [Acted::Replied(..)]));
    };
    refused_after_its_body(&mut h, "spent", 0);
    let calls = h.calls();
    let (_, step) = h.post("spent");
    assert_eq!(reply_status(&step), Some(429), "refused at the headers");
    assert_eq!(h.calls(), calls, "without a call");
    assert_eq!(h.stat("deny_cache_hits"), 1);
    h.advance(1_001);
    assert_eq!(
        h.post("spent").1,
        Step::Continue,
        "a second later: asked again"
    );
    // 100 units left: a request reserving less may fit; nothing cached.
    refused_after_its_body(&mut h, "low", 100);
    assert_eq!(h.post("low").1, Step::Continue);
}

/// A usage above what one settlement may carry (10^6 a limit) is charged at
/// that bound: sent whole, meshlimitd refused the settlement and only the
/// reservation stayed charged (issue 34, item 4).
#[test]
fn a_usage_past_the_settlement_bound_is_charged_at_the_bound() {
    let mut h = harness_with(token_config("40"));
    let (mut s, _) = h.post("a");
    h.wake();
    h.answer_batch(1, Some(200), &answer(&[reserved(960)]));
    assert!(h.response_headers(&mut s, "200", "application/json"));
    h.response_body(&s, br#"{"usage":{"total_tokens":5000000}}"#, true);
    h.wake();
    let settlement = &h.last_call_body()["settlements"][0];
    assert_eq!(settlement["actual"], json!([1_000_000]), "{settlement}");
    assert_eq!(settlement["limits"][0]["cost"], 40);
}

/// The reservation covers the prompt: a token for every four bytes of
/// the body (by default), on top of `max_tokens`; a stream's deltas have
/// only the rest, and a stream that reports no usage is charged the
/// prompt and its deltas, never the deltas alone.
#[test]
fn the_prompt_is_reserved_and_charged_when_no_usage_comes() {
    let mut h = harness_with(token_config(
        r#"{"request_json": "max_tokens", "default": 50, "max": 500}"#,
    ));
    let (mut s, _) = h.post("a");
    // 20 tokens of completion, and 400 bytes of prompt: 100 tokens.
    let body = format!(
        r#"{{"max_tokens": 20, "stream": true, "messages": "{}"}}"#,
        "x".repeat(400 - 50)
    );
    assert_eq!(body.len(), 400);
    h.request_body(&mut s, body.as_bytes(), true);
    h.wake();
    assert_eq!(h.last_call_body()["checks"][0]["limits"][0]["cost"], 120);
    h.answer_batch(1, Some(200), &answer(&[reserved(880)]));
    assert!(h.response_headers(&mut s, "200", "text/event-stream"));
    // Twenty-one deltas: the twentieth fills the completion's part (the
    // prompt's is the prompt's), and the next waits for a top-up.
    let events: String = (0..21).map(delta).collect();
    let calls = h.calls();
    let (passed, _) = h.response_body(&s, events.as_bytes(), false);
    let passed = String::from_utf8_lossy(&passed).to_string();
    assert_eq!(passed.matches("data:").count(), 20, "{passed}");
    h.wake();
    assert_eq!(h.calls(), calls + 1, "a top-up for the 21st");
}

#[test]
fn a_huge_prompt_can_never_fit_a_small_budget_and_is_refused() {
    let mut h = harness_with(token_config(
        r#"{"request_json": "max_tokens", "default": 50, "max": 500}"#,
    ));
    let (mut s, _) = h.post("a");
    // 8,000 bytes of prompt: 2,000 tokens on a budget of 1,000.
    let body = format!(r#"{{"max_tokens": 1, "messages": "{}"}}"#, "x".repeat(8000));
    let step = h.request_body(&mut s, body.as_bytes(), true);
    assert_eq!(reply_status(&step), Some(429));
}

/// Whether the request going upstream still says its length.
fn has_content_length(h: &Harness) -> bool {
    h.host
        .request
        .borrow()
        .headers
        .iter()
        .any(|(k, _)| k == "content-length")
}

/// Headers of a chat request with a `content-length`, through the flow.
fn post_with_length(h: &mut Harness, length: usize) -> Stream {
    h.next_context += 1;
    let mut stream = h.worker.stream(h.next_context);
    *h.host.request.borrow_mut() = FakeRequest::default()
        .with_header(":path", b"/v1/chat")
        .with_header(":method", b"POST")
        .with_header("content-length", length.to_string().as_bytes())
        .with_header("x-api-key", b"a");
    h.host.enter(stream.context_id);
    let step = h.worker.on_request_headers(&h.host, &mut stream, false);
    assert_eq!(step, Step::Continue);
    stream
}

#[test]
fn a_stream_that_does_not_ask_for_its_usage_is_made_to() {
    let mut h = harness_with(token_config(
        r#"{"request_json": "max_tokens", "default": 50, "max": 500, "ask_stream_usage": true}"#,
    ));
    let body = br#"{"max_tokens": 20, "stream": true, "messages": []}"#;
    let mut s = post_with_length(&mut h, body.len());
    // The body will grow: its length does not go upstream.
    assert!(!has_content_length(&h));
    h.request_body(&mut s, body, true);
    assert_eq!(
        h.host.request_body.borrow().as_slice(),
        br#"{"stream_options":{"include_usage":true},"max_tokens": 20, "stream": true, "messages": []}"#
    );
    assert_eq!(h.stat("stream_usage_asked"), 1);
    // The reservation is the client's body's, not the grown one's.
    h.wake();
    assert_eq!(
        h.last_call_body()["checks"][0]["limits"][0]["cost"],
        20 + 13
    );
    // A request that is no stream is left as it came.
    let plain = br#"{"max_tokens": 20, "messages": []}"#;
    let mut s = post_with_length(&mut h, plain.len());
    h.request_body(&mut s, plain, true);
    assert_eq!(h.host.request_body.borrow().as_slice(), plain);
    assert_eq!(h.stat("stream_usage_asked"), 1);
}

#[test]
fn without_ask_stream_usage_the_request_is_left_as_it_came() {
    let mut h = harness_with(token_config(
        r#"{"request_json": "max_tokens", "default": 50, "max": 500}"#,
    ));
    let body = br#"{"max_tokens": 20, "stream": true, "messages": []}"#;
    let mut s = post_with_length(&mut h, body.len());
    assert!(has_content_length(&h));
    h.request_body(&mut s, body, true);
    assert_eq!(h.host.request_body.borrow().as_slice(), body);
}

/// A budget per model: `by: ["client", "json:model"]` counts each model a
/// client names in its body on a counter of its own; a body without the
/// field skips the limit (`missing: skip`) or is refused (`reject`).
#[test]
fn a_budget_counted_by_a_body_field_has_a_counter_per_value() {
    let config = |missing: &str| {
        crate::config::parse(
            format!(
                r#"{{{ONE_SLOT} "client_id": {{"headers": ["x-api-key"], "when_missing": "reject"}},
                "rules": [{{"name": "llm", "match": {{"path_prefix": "/v1/"}},
                    "cost": {{"reserve": {{"request_json": "max_tokens", "default": 50, "max": 500,
                                           "prompt_bytes_per_token": 0}},
                              "response": {{"json": "usage.total_tokens"}}}},
                    "limits": [{{"name": "tokens", "requests": 1000, "window": "60s",
                                 "by": ["client", "json:model"], "missing": "{missing}"}}]}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    };
    let mut h = harness_with(config("skip"));
    let mut subjects = Vec::new();
    for (token, model) in [(1, "gpt-4o"), (2, "mini|x%")] {
        let (mut s, _) = h.post("a");
        let body = format!(r#"{{"model": "{model}", "max_tokens": 20}}"#);
        h.request_body(&mut s, body.as_bytes(), true);
        h.wake();
        let call = h.last_call_body();
        subjects.push(
            call["checks"][0]["limits"][0]["subject"]
                .as_str()
                .unwrap()
                .to_string(),
        );
        assert_eq!(call["checks"][0]["limits"][0]["cost"], 20);
        h.answer_batch(token, Some(200), &answer(&[reserved(980)]));
    }
    assert_eq!(
        subjects,
        [
            "hdr:x-api-key:a|json:model:gpt-4o",
            "hdr:x-api-key:a|json:model:mini%7Cx%25"
        ]
    );
    // No model: not counted on this limit, and nothing else to decide.
    let calls = h.calls();
    let (mut s, _) = h.post("a");
    let step = h.request_body(&mut s, br#"{"max_tokens": 20}"#, true);
    assert_eq!(step, Step::Continue);
    assert_eq!(h.stat("skipped_missing_attribute"), 1);
    h.wake();
    assert_eq!(h.calls(), calls);
    // With `missing: reject`, refused with the reason.
    let mut h = harness_with(config("reject"));
    let (mut s, _) = h.post("a");
    let step = h.request_body(&mut s, br#"{"model": null, "max_tokens": 20}"#, true);
    assert_eq!(reply_status(&step), Some(403));
    assert_eq!(h.stat("rejected_missing_attribute"), 1);
}

/// Over HTTP/2 a budget the deny cache knows to be spent is refused too,
/// with nothing upstream: the stream is paused at its headers (Envoy then
/// stops it whole, body and all) and answered on the root's tick once
/// its client's upload is over, rather than reset mid-upload. A client
/// gone before the tick is answered nothing.
#[test]
fn over_http2_a_spent_budget_is_refused_on_the_tick_with_nothing_upstream() {
    let reserve = r#"{"request_json": "max_tokens", "default": 50, "max": 500}"#;
    let mut h = harness_with(token_config(reserve));
    let h2_post = |h: &mut Harness| {
        h.next_context += 1;
        let mut stream = h.worker.stream(h.next_context);
        *h.host.request.borrow_mut() = FakeRequest::default()
            .with_header(":path", b"/v1/chat")
            .with_header(":method", b"POST")
            .with_header("x-api-key", b"spent")
            .with_property(&["request", "protocol"], b"HTTP/2");
        h.host.enter(stream.context_id);
        let step = h.worker.on_request_headers(&h.host, &mut stream, false);
        (stream, step)
    };
    // Spent: the first request is refused after its body, and cached.
    let (mut s, _) = h.post("spent");
    h.request_body(&mut s, br#"{"max_tokens": 300}"#, true);
    h.wake();
    h.answer_batch(
        h.last_token(),
        Some(200),
        &answer(&[r#"{"allowed":false,"limits":[{"allowed":false,"limit":1000,"remaining":0,"reset_after_ms":30000,"retry_after_ms":30000}]}"#.to_string()]),
    );
    h.host.take_acted();
    let calls = h.calls();
    let (waiting, step) = h2_post(&mut h);
    assert_eq!(step, Step::Pause, "stopped whole at its headers");
    let (gone, _) = h2_post(&mut h);
    h.end(&gone);
    h.host.enter(ROOT);
    h.worker.on_tick(&h.host);
    assert!(h.host.take_acted().is_empty(), "not before its wait");
    h.advance(50);
    h.host.enter(ROOT);
    h.worker.on_tick(&h.host);
    let acted = h.host.take_acted();
    assert!(
        matches!(&acted[..], [Acted::Replied(id, reply)] if *id == waiting.context_id && reply.status == 429),
        "{acted:?}"
    );
    assert_eq!(h.calls(), calls, "without a call");
}
