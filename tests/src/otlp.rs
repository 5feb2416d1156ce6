//! A small OTLP/gRPC receiver: what meshlimitd exports with
//! `--otlp-endpoint`, kept for a test to read. It speaks OTLP's own
//! generated service (the one an OpenTelemetry Collector serves), so what
//! it accepts is what a collector would.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};

/// A span as received, flattened for assertions.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub name: String,
    /// Hex, as in a `traceparent`.
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// Every attribute as text (arrays joined with `,`).
    pub attributes: BTreeMap<String, String>,
    /// The resource's `service.name`.
    pub service: String,
    /// The status message when the status is an error.
    pub error: Option<String>,
    pub duration: Duration,
}

#[derive(Clone, Default)]
struct Collected(Arc<Mutex<Vec<ReceivedSpan>>>);

#[tonic::async_trait]
impl TraceService for Collected {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = Vec::new();
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .as_ref()
                .and_then(|r| attributes(&r.attributes).remove("service.name"))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    let error = span
                        .status
                        .as_ref()
                        .filter(|s| s.code == 2)
                        .map(|s| s.message.clone());
                    spans.push(ReceivedSpan {
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: attributes(&span.attributes),
                        service: service.clone(),
                        error,
                        duration: Duration::from_nanos(
                            span.end_time_unix_nano
                                .saturating_sub(span.start_time_unix_nano),
                        ),
                    });
                }
            }
        }
        if let Ok(mut all) = self.0.lock() {
            all.extend(spans);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::ArrayValue(a)) => a
            .values
            .iter()
            .map(|v| text(Some(v)))
            .collect::<Vec<_>>()
            .join(","),
        _ => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
        .collect()
}

/// The receiver, serving on its own runtime until dropped.
pub struct OtlpReceiver {
    pub addr: SocketAddr,
    spans: Collected,
    _runtime: tokio::runtime::Runtime,
}

impl OtlpReceiver {
    /// Listens on `host` (a loopback address), on a free port.
    pub fn start(host: &str) -> OtlpReceiver {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start the OTLP receiver's runtime: {e}"));
        let spans = Collected::default();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(format!("{host}:0")))
            .unwrap_or_else(|e| panic!("cannot listen for OTLP on {host}: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("cannot read the OTLP receiver's address: {e}"));
        let service = TraceServiceServer::new(spans.clone());
        runtime.spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
        });
        OtlpReceiver {
            addr,
            spans,
            _runtime: runtime,
        }
    }

    /// The endpoint to give an exporter.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.0.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The spans of trace `trace_id`, once at least `want` came (or
    /// `within` passed: then what came).
    pub fn trace(&self, trace_id: &str, want: usize, within: Duration) -> Vec<ReceivedSpan> {
        let deadline = Instant::now() + within;
        loop {
            let found: Vec<ReceivedSpan> = self
                .spans()
                .into_iter()
                .filter(|s| s.trace_id == trace_id)
                .collect();
            if found.len() >= want || Instant::now() > deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
