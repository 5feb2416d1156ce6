//! Spans for decisions, exported over OTLP/gRPC: off unless
//! `--otlp-endpoint` is set.
//!
//! One span, `meshlimit.check`, for each check decided, a child of the
//! span of the request it decides: the filter puts that request's context
//! in the check (`Check::trace`, see `meshlimit_protocol::trace`), and a
//! caller that sends a bare `traceparent` or B3 header on its call gets
//! its checks parented to that. A check whose request is not traced makes
//! a span only at `--otlp-root-sample-ratio` (0 by default: a lease
//! renewal or a settlement belongs to no request); one whose request is
//! traced but not sampled makes none.
//!
//! What a span says (attribute names under `meshlimit.`): the decision,
//! the limit that decided it with its rule and algorithm, what remains of
//! it, every limit of the check, the lease asked and granted, and how long
//! the scripts took; a check that could not be decided has an error
//! status with the reason.

use std::time::{Duration, SystemTime};

use meshlimit_protocol::trace::TraceParent;
use meshlimit_protocol::{Check, CheckOutcome, CheckResult, LimitStatus};
use opentelemetry::trace::{
    Span, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer,
};
use opentelemetry::{Context, KeyValue, StringValue, Value};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

/// Where spans go, and how often a check of an untraced request makes one.
#[derive(Debug, Clone)]
pub struct TraceSettings {
    /// An OTLP/gRPC endpoint (`http://collector:4317`).
    pub endpoint: String,
    /// Share of checks of untraced requests that start a trace of their
    /// own, from 0 to 1.
    pub root_ratio: f64,
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("--otlp-root-sample-ratio must be between 0 and 1, not {0}")]
    Ratio(f64),
    #[error("cannot build the OTLP exporter for {endpoint}: {reason}")]
    Exporter { endpoint: String, reason: String },
}

/// The tracer of decisions, shared by every front.
#[derive(Clone, Debug)]
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    root_ratio: f64,
}

/// One check's span, as the decision saw it.
pub struct CheckSpan<'a> {
    pub check: &'a Check,
    pub outcome: &'a CheckOutcome,
    /// When deciding the call began.
    pub started: SystemTime,
    /// How long the call's scripts took (every check of a batch shares
    /// its runs).
    pub scripts: Duration,
    /// Checks in the call.
    pub batch: usize,
}

impl Traces {
    /// Starts the exporter (spans are sent in batches, in the background;
    /// an unreachable collector costs dropped spans, never a decision).
    /// Must run inside the tokio runtime: the gRPC client lives on it.
    pub fn start(settings: &TraceSettings) -> Result<Traces, TraceError> {
        if !(0.0..=1.0).contains(&settings.root_ratio) {
            return Err(TraceError::Ratio(settings.root_ratio));
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(settings.endpoint.clone())
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| TraceError::Exporter {
                endpoint: settings.endpoint.clone(),
                reason: e.to_string(),
            })?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                settings.root_ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name("meshlimitd")
                    .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                    .build(),
            )
            .build();
        let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "meshlimitd");
        Ok(Traces {
            provider,
            tracer,
            root_ratio: settings.root_ratio,
        })
    }

    /// Records the span of one decided (or failed) check.
    pub fn record(&self, span: &CheckSpan<'_>) {
        let parent = span.check.trace.as_deref().and_then(TraceParent::parse);
        // The sampler would say the same; deciding first spares building
        // the attributes of a span nobody keeps.
        let keep = match parent {
            Some(p) => p.sampled(),
            None => self.root_ratio > 0.0,
        };
        if !keep {
            return;
        }
        let cx = parent.map_or_else(Context::new, |p| {
            Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from_bytes(p.trace_id),
                SpanId::from_bytes(p.span_id),
                TraceFlags::new(p.flags),
                true,
                TraceState::NONE,
            ))
        });
        let builder = self
            .tracer
            .span_builder("meshlimit.check")
            .with_kind(SpanKind::Server)
            .with_start_time(span.started)
            .with_attributes(attributes(span));
        let mut otel = self.tracer.build_with_context(builder, &cx);
        if let CheckOutcome::Failed(failure) = span.outcome {
            otel.set_status(Status::error(failure.error.clone()));
        }
        otel.end();
    }

    /// Sends what is buffered (at shutdown).
    pub fn shutdown(&self) {
        let _ = self.provider.shutdown_with_timeout(Duration::from_secs(3));
    }
}

/// The span's attributes.
fn attributes(span: &CheckSpan<'_>) -> Vec<KeyValue> {
    let check = span.check;
    let names: Vec<StringValue> = check
        .limits
        .iter()
        .map(|l| StringValue::from(l.name.clone()))
        .collect();
    let mut out = vec![
        KeyValue::new("meshlimit.limits", Value::Array(names.into())),
        KeyValue::new("meshlimit.cost", cost(check)),
        KeyValue::new(
            "meshlimit.script.duration_ms",
            span.scripts.as_secs_f64() * 1000.0,
        ),
        KeyValue::new("meshlimit.batch.checks", span.batch as i64),
    ];
    if let Some(lease) = check.lease {
        out.push(KeyValue::new("meshlimit.lease.asked", clamp(lease.units)));
    }
    match span.outcome {
        CheckOutcome::Decided(result) => {
            out.push(KeyValue::new("meshlimit.decision", decision(result)));
            out.push(KeyValue::new(
                "meshlimit.lease.granted",
                clamp(result.leased),
            ));
            if let Some((i, status)) = deciding(result) {
                if let Some(limit) = check.limits.get(i) {
                    let (rule, name) = limit.name.split_once('/').unwrap_or(("", &limit.name));
                    out.push(KeyValue::new("meshlimit.rule", rule.to_string()));
                    out.push(KeyValue::new("meshlimit.limit", name.to_string()));
                    out.push(KeyValue::new(
                        "meshlimit.algorithm",
                        limit.algorithm.as_str(),
                    ));
                }
                out.push(KeyValue::new(
                    "meshlimit.remaining",
                    clamp(status.remaining),
                ));
            }
        }
        CheckOutcome::Failed(failure) => {
            out.push(KeyValue::new("meshlimit.decision", "error"));
            out.push(KeyValue::new("meshlimit.error", failure.error.clone()));
        }
    }
    out
}

/// `allowed`, `denied`, or `shadow_denied` (a shadow limit said no; the
/// request was admitted).
fn decision(result: &CheckResult) -> &'static str {
    if !result.allowed {
        "denied"
    } else if result.limits.iter().any(|l| !l.allowed) {
        "shadow_denied"
    } else {
        "allowed"
    }
}

/// The limit that decided: the first that denied, else the one with the
/// least left.
fn deciding(result: &CheckResult) -> Option<(usize, &LimitStatus)> {
    result
        .limits
        .iter()
        .enumerate()
        .find(|(_, l)| !l.allowed && !l.shadow)
        .or_else(|| result.limits.iter().enumerate().find(|(_, l)| !l.allowed))
        .or_else(|| {
            result
                .limits
                .iter()
                .enumerate()
                .min_by_key(|(_, l)| l.remaining)
        })
}

fn cost(check: &Check) -> i64 {
    check.limits.first().map_or(0, |l| clamp(l.cost))
}

fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The trace context a caller sent as headers (HTTP) or metadata (gRPC),
/// as a `traceparent` value: W3C's, else B3's single header, else B3's
/// multiple headers. `get` reads one header's value.
pub fn context_from_headers<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<String> {
    let parent = get("traceparent")
        .and_then(TraceParent::parse)
        .or_else(|| get("b3").and_then(TraceParent::from_b3))
        .or_else(|| {
            let sampled = match get("x-b3-flags") {
                Some("1") => Some("1"),
                _ => get("x-b3-sampled"),
            };
            TraceParent::from_b3_parts(get("x-b3-traceid")?, get("x-b3-spanid")?, sampled)
        })?;
    Some(parent.to_header())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callers_headers_name_its_context_w3c_first() {
        let w3c = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let headers = [
            ("traceparent", w3c),
            ("b3", "a3ce929d0e0e4736-00f067aa0ba902b7-1"),
        ];
        let get = |n: &str| headers.iter().find(|(k, _)| *k == n).map(|(_, v)| *v);
        assert_eq!(context_from_headers(get).as_deref(), Some(w3c));
        let multi = [
            ("x-b3-traceid", "a3ce929d0e0e4736"),
            ("x-b3-spanid", "00f067aa0ba902b7"),
            ("x-b3-flags", "1"),
        ];
        let get = |n: &str| multi.iter().find(|(k, _)| *k == n).map(|(_, v)| *v);
        assert_eq!(
            context_from_headers(get).as_deref(),
            Some("00-0000000000000000a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        assert_eq!(context_from_headers(|_| None), None);
    }

    #[test]
    fn the_deciding_limit_is_the_first_that_denied() {
        let status = |allowed: bool, shadow: bool, remaining: u64| LimitStatus {
            allowed,
            limit: 10,
            remaining,
            reset_after_ms: 0,
            retry_after_ms: 0,
            shadow,
            reason: None,
        };
        let result = |limits: Vec<LimitStatus>| CheckResult {
            allowed: limits.iter().all(|l| l.allowed || l.shadow),
            limits,
            receipts: None,
            leased: 0,
        };
        let r = result(vec![
            status(true, false, 5),
            status(false, true, 0),
            status(false, false, 0),
        ]);
        assert_eq!(
            (decision(&r), deciding(&r).map(|(i, _)| i)),
            ("denied", Some(2))
        );
        let r = result(vec![status(true, false, 5), status(false, true, 0)]);
        assert_eq!(
            (decision(&r), deciding(&r).map(|(i, _)| i)),
            ("shadow_denied", Some(1))
        );
        let r = result(vec![status(true, false, 5), status(true, false, 3)]);
        assert_eq!(
            (decision(&r), deciding(&r).map(|(i, _)| i)),
            ("allowed", Some(1))
        );
    }
}
