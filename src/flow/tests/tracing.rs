//! The request's trace context rides on its check call.

use super::*;

const W3C: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

impl Harness {
    /// A request from `id` carrying `trace` headers, through
    /// `on_request_headers` in its own context.
    fn traced_request(&mut self, id: &str, trace: &[(&str, &str)]) -> (Stream, Step) {
        self.next_context += 1;
        let mut stream = self.worker.stream(self.next_context);
        let mut req = FakeRequest::default()
            .with_header(":path", b"/api/items")
            .with_header("x-api-key", id.as_bytes());
        for (name, value) in trace {
            req = req.with_header(name, value.as_bytes());
        }
        *self.host.request.borrow_mut() = req;
        self.host.enter(stream.context_id);
        let step = self
            .worker
            .on_request_headers(&self.host, &mut stream, true);
        (stream, step)
    }

    fn last_trace_headers(&self) -> Vec<(String, String)> {
        self.host
            .sent
            .borrow()
            .last()
            .unwrap()
            .trace_headers
            .clone()
    }
}

#[test]
fn a_check_call_carries_its_requests_trace_context() {
    for extra in [ONE_CALL, ""] {
        let mut h = harness(extra);
        let (stream, step) =
            h.traced_request("traced", &[("traceparent", W3C), ("tracestate", "v=1")]);
        let _ = h.decided(&stream, step);
        assert_eq!(h.calls(), 1, "{extra}");
        assert_eq!(
            h.last_trace_headers(),
            [
                ("traceparent".into(), W3C.into()),
                ("tracestate".into(), "v=1".into())
            ],
            "{extra}"
        );
        assert_eq!(h.last_call_body()["checks"][0]["trace"], W3C, "{extra}");
    }
}

#[test]
fn b3_is_forwarded_as_b3_and_the_check_carries_it_as_w3c() {
    let mut h = harness(ONE_CALL);
    let b3 = "a3ce929d0e0e4736-00f067aa0ba902b7-1";
    let (stream, step) = h.traced_request("b3", &[("b3", b3)]);
    let _ = h.decided(&stream, step);
    assert_eq!(h.last_trace_headers(), [("b3".into(), b3.into())]);
    assert_eq!(
        h.last_call_body()["checks"][0]["trace"],
        "00-0000000000000000a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
}

#[test]
fn each_check_of_a_batch_carries_its_own_requests_context() {
    let mut h = harness(ONE_SLOT);
    let other = "00-11111111111111111111111111111111-2222222222222222-01";
    // The first call goes out alone; the next three share the second.
    let (s0, _) = h.traced_request("a", &[("traceparent", W3C)]);
    h.wake();
    let (s1, _) = h.request("b");
    let (s2, _) = h.traced_request("c", &[("traceparent", other)]);
    let (s3, _) = h.traced_request("d", &[("traceparent", "00-bad")]);
    let first = h.last_token();
    h.answer_batch(first, Some(200), &answer(&[result(true, 19)]));
    assert_eq!(h.calls(), 2);
    let body = h.last_call_body();
    let traces: Vec<&serde_json::Value> = body["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["trace"])
        .collect();
    assert_eq!(traces, [&json!(null), &json!(other), &json!(null)]);
    // The call's headers: the first context among its checks.
    assert_eq!(
        h.last_trace_headers(),
        [("traceparent".into(), other.into())]
    );
    for s in [s0, s1, s2, s3] {
        h.end(&s);
    }
}

#[test]
fn a_request_without_a_context_sends_none() {
    let mut h = harness(ONE_CALL);
    let (stream, step) = h.request("plain");
    let _ = h.decided(&stream, step);
    assert!(h.last_trace_headers().is_empty());
    assert!(h.last_call_body()["checks"][0].get("trace").is_none());
}
