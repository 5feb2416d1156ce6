//! Calls whose answers must outlive the request that caused them, on a
//! host that routes answers as the proxy-wasm SDK does (see
//! [`FakeHost`]): to the context whose callback dispatched the call, and
//! nowhere once that context is deleted. A fast upstream ends a stream
//! before meshlimitd answers what the stream's callback sent for its
//! worker (a lease renewal, a return, a settlement, a top-up), so those
//! must leave from the root, with group commit on or off.
//!
//! [`FakeMeshlimitd`] answers the calls as meshlimitd does for fixed
//! windows (it charges whether or not the answer is delivered), so a test
//! can count what a client was admitted against what was charged.

use std::collections::HashMap;

use super::fake_meshlimitd::FakeMeshlimitd;
use super::*;

/// A worker on the strict fake host, its live streams, and meshlimitd
/// behind it: requests come in, calls are answered and routed as Envoy
/// and the SDK would, streams end when their response is out.
struct Network {
    h: Harness,
    service: FakeMeshlimitd,
    /// Calls answered so far (by count: tokens go up).
    answered: usize,
    /// Wake-ups the root has run so far.
    woken: u32,
    /// Streams paused for their check, by context id.
    paused: HashMap<u32, Stream>,
    admitted: usize,
    denied: usize,
    /// Answers the SDK dropped (their context had ended).
    dropped: usize,
    /// Admitted requests get a response before their stream ends (else
    /// the client resets as soon as it is admitted).
    respond: bool,
}

impl Network {
    fn new(h: Harness) -> Self {
        Network {
            h,
            service: FakeMeshlimitd::default(),
            answered: 0,
            woken: 0,
            paused: HashMap::new(),
            admitted: 0,
            denied: 0,
            dropped: 0,
            respond: true,
        }
    }

    /// A request from `id` behind an upstream that answers at once: once
    /// admitted or denied, its stream ends before anything else happens.
    fn request(&mut self, id: &str) {
        let (mut stream, step) = self.h.request(id);
        self.h.host.enter(stream.context_id);
        let step = match step {
            Step::Pause => {
                self.paused.insert(stream.context_id, stream);
                return;
            }
            step => step,
        };
        self.finish(&mut stream, step);
    }

    /// A decided stream's response goes out, and the stream ends.
    fn finish(&mut self, stream: &mut Stream, step: Step) {
        match step {
            Step::Continue => {
                self.admitted += 1;
                if self.respond {
                    self.h.host.enter(stream.context_id);
                    self.h.worker.on_response_headers(&self.h.host, stream);
                }
            }
            Step::Reply(reply) => {
                assert_eq!(reply.status, 429, "{reply:?}");
                self.denied += 1;
            }
            Step::Pause => unreachable!(),
        }
        self.h.end(stream);
    }

    /// The event loop runs until nothing is due: the root runs its
    /// wake-ups, meshlimitd answers every call (charging it whether or not
    /// the answer arrives), and each answer goes where the SDK sends it.
    fn settle_down(&mut self) {
        loop {
            if self.h.host.wakes.get() > self.woken {
                self.woken = self.h.host.wakes.get();
                self.h.wake();
                continue;
            }
            let call = self.h.host.sent.borrow().get(self.answered).cloned();
            let Some(call) = call else {
                return;
            };
            self.answered += 1;
            let body = self.service.answer(&call.body, self.h.host.now.get());
            self.deliver(call.token, &body);
            self.release_decided();
        }
    }

    fn deliver(&mut self, token: u32, body: &str) {
        let Some(to) = self.h.host.answer_goes_to(token) else {
            self.dropped += 1;
            return;
        };
        self.h.host.respond(Some(200), body);
        self.h.host.enter(to);
        // What the glue does (`wasm::Stream::on_http_call_response`).
        if let Some(stream) = self.paused.get_mut(&to) {
            if self.h.worker.owns_call(stream, token) {
                let step = self
                    .h
                    .worker
                    .on_call_answer(&self.h.host, stream, 1, body.len());
                if step != Step::Pause {
                    let mut stream = self.paused.remove(&to).unwrap();
                    self.finish(&mut stream, step);
                }
                return;
            }
        }
        self.h
            .worker
            .on_batch_answer(&self.h.host, token, 1, body.len());
    }

    /// Streams the root resumed or answered go on and end.
    fn release_decided(&mut self) {
        for acted in self.h.host.take_acted() {
            let (id, step) = match acted {
                Acted::Resumed(id) => (id, Step::Continue),
                Acted::Replied(id, reply) => (id, Step::Reply(reply)),
                Acted::ResumedResponse(_) => continue,
            };
            if let Some(mut stream) = self.paused.remove(&id) {
                self.finish(&mut stream, step);
            }
        }
    }
}

/// Without group commit, a busy client's lease renewals are sent while a
/// request's callback runs. Behind a fast upstream that stream is gone
/// when meshlimitd answers: sent from the stream, the grant is dropped
/// (charged in Redis, never installed) and asked again. Sent from the
/// root, every charged unit serves a request: the client gets its whole
/// window, and no more.
#[test]
fn without_group_commit_a_busy_leased_client_behind_a_fast_upstream_gets_its_whole_window() {
    let config = crate::config::parse(
        br#"{"group_commit": {"enabled": false}, "leases": {"interval": "1s"},
             "client_id": {"headers": ["x-api-key"], "when_missing": "reject"},
             "rules": [{"name": "api", "match": {"path_prefix": "/api/"},
                        "limits": [{"name": "per-hour", "requests": 2000, "window": "1h"}]}]}"#,
    )
    .unwrap();
    let mut net = Network::new(harness_with(config));
    // 3,000 requests, 2 a millisecond, the root's tick every 250 ms.
    for i in 0..3000u64 {
        net.request("busy");
        net.settle_down();
        if i % 2 == 1 {
            net.h.advance(1);
        }
        if i % 500 == 499 {
            net.h.host.enter(ROOT);
            net.h.worker.on_tick(&net.h.host);
            net.settle_down();
        }
    }
    let charged = net.service.used("hdr:x-api-key:busy", "api/per-hour");
    assert_eq!(
        (net.admitted, net.denied),
        (2000, 1000),
        "the whole window and no more ({charged} charged, {} answers dropped, {} renewals, {} grants)",
        net.dropped,
        net.h.stat("lease_renewals"),
        net.h.stat("lease_grants"),
    );
    assert_eq!(charged, 2000);
    assert_eq!(net.dropped, 0, "no answer went to a stream that had ended");
    assert!(
        net.h.stat("lease_renewals") <= net.h.stat("lease_grants") + 1,
        "each renewal asked once: {} renewals, {} grants",
        net.h.stat("lease_renewals"),
        net.h.stat("lease_grants")
    );
    assert!(net.h.worker.outbox.is_idle(), "nothing kept in flight");
}

/// A token rule reserving 40 of 1,000 a minute, group commit off.
fn reserving_without_group_commit() -> Network {
    let config = crate::config::parse(
        br#"{"group_commit": {"enabled": false},
             "client_id": {"headers": ["x-api-key"], "when_missing": "reject"},
             "rules": [{"name": "llm", "match": {"path_prefix": "/v1/"},
                "cost": {"reserve": 40, "response": {"json": "usage.total_tokens"}},
                "limits": [{"name": "tokens", "requests": 1000, "window": "60s"}]}]}"#,
    )
    .unwrap();
    Network::new(harness_with(config))
}

impl Network {
    /// A POST from `a` with no body: paused for its reservation.
    fn post(&mut self) -> Stream {
        self.h.next_context += 1;
        let mut stream = self.h.worker.stream(self.h.next_context);
        *self.h.host.request.borrow_mut() = FakeRequest::default()
            .with_header(":path", b"/v1/chat")
            .with_header(":method", b"POST")
            .with_header("x-api-key", b"a");
        self.h.host.enter(stream.context_id);
        let step = self
            .h
            .worker
            .on_request_headers(&self.h.host, &mut stream, true);
        assert_eq!(step, Step::Pause, "reserving");
        stream
    }

    /// What meshlimitd holds charged for `a`'s tokens.
    fn tokens_charged(&self) -> u64 {
        self.service.used("hdr:x-api-key:a", "llm/tokens")
    }
}

/// Without group commit, a client that resets while its reservation is
/// being decided gets it back: the call left from the root, so its answer
/// reaches the worker, which gives back what was reserved for nobody.
#[test]
fn without_group_commit_a_client_reset_while_its_reservation_call_is_out_is_refunded() {
    let mut net = reserving_without_group_commit();
    let stream = net.post();
    // The call goes out (the root runs its wake-up), then the client
    // resets before meshlimitd answers.
    net.woken = net.h.host.wakes.get();
    net.h.wake();
    assert_eq!(net.h.calls(), 1, "the reservation is out");
    net.h.end(&stream);
    net.settle_down();
    assert_eq!(
        net.dropped, 0,
        "the reservation's answer reached the worker"
    );
    assert_eq!(net.tokens_charged(), 0, "given back");
    assert!(net.h.worker.outbox.is_idle(), "nothing kept in flight");
}

/// Without group commit, a client that resets once admitted, before any
/// response, is refunded (`refund_on_error`): the settlement, made in the
/// stream's last callback, leaves from the root and is answered.
#[test]
fn without_group_commit_a_settlement_made_as_its_stream_ends_is_answered() {
    let mut net = reserving_without_group_commit();
    net.respond = false;
    let stream = net.post();
    net.paused.insert(stream.context_id, stream);
    net.settle_down();
    assert_eq!(net.admitted, 1);
    assert_eq!(net.dropped, 0, "the settlement's answer reached the worker");
    assert_eq!(net.tokens_charged(), 0, "refunded");
    assert_eq!(net.h.stat("tokens_refunded"), 40);
    assert_eq!(net.h.stat("settlements_failed"), 0);
    assert!(net.h.worker.outbox.is_idle(), "nothing kept in flight");
}
