//! Traces through a real Envoy: the filter forwards a request's trace
//! context (W3C or B3) on its check call, and meshlimitd exports a span
//! for the check over OTLP, a child of the request's span, to a receiver
//! speaking OTLP's own gRPC service.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::time::Duration;

use common::*;
use meshlimit_testbed::otlp::{OtlpReceiver, ReceivedSpan};
use meshlimit_testbed::services::unique_host;
use meshlimit_testbed::{http, Topology, TopologyOptions};

const SPANS_WITHIN: Duration = Duration::from_secs(10);

fn traced_topology(receiver: &OtlpReceiver) -> Topology {
    let config = PluginConfig::new()
        .rules(json!([
            {"name": "api", "match": {"path_prefix": "/"},
             "limits": [{"name": "per-minute", "requests": 2, "window": "60s"}]}
        ]))
        .build();
    Topology::start(TopologyOptions {
        plugin_config: config,
        replicas: 1,
        front: false,
        meshlimitd_args: vec!["--otlp-endpoint".into(), receiver.endpoint()],
        // Export every 100 ms rather than every 5 s.
        meshlimitd_env: vec![("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into())],
        ..TopologyOptions::default()
    })
}

fn get(t: &Topology, client: &str, trace: &[(&str, &str)]) -> u16 {
    let mut headers: Vec<(&str, &[u8])> = vec![("x-api-key", client.as_bytes())];
    headers.extend(trace.iter().map(|(n, v)| (*n, v.as_bytes())));
    t.get("/api/items", &headers).status
}

fn only(spans: Vec<ReceivedSpan>, what: &str) -> ReceivedSpan {
    assert_eq!(spans.len(), 1, "{what}: {spans:#?}");
    spans.into_iter().next().unwrap()
}

#[test]
fn a_checks_span_is_a_child_of_its_requests_span() {
    let receiver = OtlpReceiver::start(&unique_host());
    let t = traced_topology(&receiver);
    wait_for_fresh_window(Duration::from_secs(10));

    // W3C: the span hangs under the request's span.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace}-{parent}-01");
    assert_eq!(get(&t, "w3c", &[("traceparent", &traceparent)]), 200);
    let span = only(receiver.trace(trace, 1, SPANS_WITHIN), "w3c");
    assert_eq!(span.name, "meshlimit.check");
    assert_eq!(span.parent_span_id, parent);
    assert_eq!(span.service, "meshlimitd");
    let attr = |s: &ReceivedSpan, k: &str| s.attributes.get(k).cloned().unwrap_or_default();
    assert_eq!(attr(&span, "meshlimit.decision"), "allowed");
    assert_eq!(attr(&span, "meshlimit.rule"), "api");
    assert_eq!(attr(&span, "meshlimit.limit"), "per-minute");
    assert_eq!(attr(&span, "meshlimit.algorithm"), "fixed_window");
    assert_eq!(attr(&span, "meshlimit.remaining"), "1");
    assert!(
        span.attributes.contains_key("meshlimit.script.duration_ms"),
        "{span:#?}"
    );

    // B3, as Istio's sidecars send it: a 64-bit trace id, padded.
    let b3_trace = "a3ce929d0e0e4736";
    let b3_span = "0020000000000001";
    let b3 = [
        ("x-b3-traceid", b3_trace),
        ("x-b3-spanid", b3_span),
        ("x-b3-sampled", "1"),
    ];
    assert_eq!(get(&t, "b3", &b3), 200);
    let span = only(
        receiver.trace(&format!("{:0>32}", b3_trace), 1, SPANS_WITHIN),
        "b3",
    );
    assert_eq!(span.parent_span_id, b3_span);

    // A denial: the third request of a limit of 2, decided by a call.
    let denied_trace = "11111111111111111111111111111111";
    assert_eq!(get(&t, "spent", &[]), 200);
    assert_eq!(get(&t, "spent", &[]), 200);
    let tp = format!("00-{denied_trace}-2222222222222222-01");
    assert_eq!(get(&t, "spent", &[("traceparent", &tp)]), 429);
    let span = only(receiver.trace(denied_trace, 1, SPANS_WITHIN), "denied");
    assert_eq!(attr(&span, "meshlimit.decision"), "denied");
    assert_eq!(attr(&span, "meshlimit.remaining"), "0");

    // An unsampled trace makes no span, and neither does an untraced
    // request (the root ratio is 0): only the three above were exported.
    let unsampled = "33333333333333333333333333333333";
    let tp = format!("00-{unsampled}-4444444444444444-00");
    assert_eq!(get(&t, "unsampled", &[("traceparent", &tp)]), 200);
    let marker = "55555555555555555555555555555555";
    let tp = format!("00-{marker}-6666666666666666-01");
    assert_eq!(get(&t, "marker", &[("traceparent", &tp)]), 200);
    only(receiver.trace(marker, 1, SPANS_WITHIN), "marker");
    let all = receiver.spans();
    assert!(all.iter().all(|s| s.trace_id != unsampled), "{all:#?}");
    assert_eq!(all.len(), 4, "{all:#?}");
    assert_no_vm_panics(&t);
}

#[test]
fn a_caller_that_traces_its_call_parents_every_check_of_it() {
    let receiver = OtlpReceiver::start(&unique_host());
    let t = traced_topology(&receiver);
    let trace = "77777777777777777777777777777777";
    let check = |subject: &str| json!({"subject": subject, "limits": [{"name": "direct/l", "requests": 5, "window_ms": 60000, "algorithm": "sliding_window_log"}]});
    let body = json!({"checks": [check("a"), check("b")]}).to_string();
    let traceparent = format!("00-{trace}-8888888888888888-01");
    let r = http::request(
        &t.meshlimitd_addr(),
        "POST",
        "/v1/check",
        &[
            ("content-type", b"application/json"),
            ("traceparent", traceparent.as_bytes()),
        ],
        body.as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let spans = receiver.trace(trace, 2, SPANS_WITHIN);
    assert_eq!(spans.len(), 2, "{spans:#?}");
    for s in &spans {
        assert_eq!(s.parent_span_id, "8888888888888888");
        assert_eq!(s.attributes["meshlimit.batch.checks"], "2");
        assert_eq!(s.attributes["meshlimit.algorithm"], "sliding_window_log");
    }
}
