//! `ShouldRateLimit`: a request's descriptors become one check on the
//! limiter, decided all or nothing in one script run (a denied request
//! charges none of its descriptors, where envoyproxy/ratelimit charges
//! the others), and the answer becomes one status per descriptor, with
//! `current_limit`, `limit_remaining` and `duration_until_reset`, so
//! Envoy's `enable_x_ratelimit_headers` can write them.

use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit as ProtoUnit, Code, DescriptorStatus, RateLimit as ProtoLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use meshlimit_protocol::{
    bounds, Check, CheckFailure, CheckOutcome, CheckResult, FailureKind, Limit,
};
use tracing::warn;

use super::config::{Domains, Limited, RateLimit, Unit};
use super::reload::Current;
use crate::app::{AppState, Caller};
use crate::traces::CheckSpan;

/// The gRPC service: the HTTP API's state (limiter, bounds, metrics) and
/// the configuration in use.
pub struct RlsService {
    pub state: AppState,
    pub config: Current,
}

/// How one descriptor of a request is decided.
#[derive(Debug, Clone, PartialEq)]
enum Slot {
    /// No limit applies (none matched, or it was replaced): OK.
    Free,
    /// `unlimited: true`: OK, never counted.
    Unlimited,
    /// `requests_per_unit: 0`: always over (OK in shadow mode).
    Blocked { unit: Unit, shadow: bool },
    /// The check's `index`-th limit, charged `hits`; its stats' key.
    Counted {
        index: usize,
        requests: u64,
        unit: Unit,
        shadow: bool,
        hits: u64,
        stat_key: std::sync::Arc<str>,
    },
}

/// A request, planned: the check to run (if any descriptor is counted),
/// and how each descriptor's status is made.
#[derive(Debug, Clone, PartialEq)]
struct Plan {
    check: Option<Check>,
    slots: Vec<Slot>,
}

/// A descriptor's counter subject: its entries, each part escaped so that
/// no value can pass for two entries.
fn subject(entries: &[(&str, &str)]) -> String {
    let escape = |s: &str| {
        s.replace('%', "%25")
            .replace('|', "%7C")
            .replace('=', "%3D")
    };
    let parts: Vec<String> = entries
        .iter()
        .map(|(k, v)| format!("{}={}", escape(k), escape(v)))
        .collect();
    format!("rls:{}", parts.join("|"))
}

fn plan(domains: &Domains, request: &RateLimitRequest) -> Result<Plan, String> {
    // The HTTP API's bounds: one request's script stays short.
    if request.descriptors.len() > crate::app::MAX_LIMITS_PER_CHECK {
        return Err(format!(
            "{} descriptors: at most {} in one request",
            request.descriptors.len(),
            crate::app::MAX_LIMITS_PER_CHECK
        ));
    }
    let request_hits = match request.hits_addend {
        0 => 1,
        n => u64::from(n),
    };
    let entries: Vec<Vec<(&str, &str)>> = request
        .descriptors
        .iter()
        .map(|d: &RateLimitDescriptor| {
            d.entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect()
        })
        .collect();
    let matched: Vec<_> = entries
        .iter()
        .map(|e| domains.lookup(&request.domain, e))
        .collect();
    // `replaces`: a matched limit drops the limits it names.
    let replaced: Vec<&str> = matched
        .iter()
        .flatten()
        .flat_map(|m| m.limit.replaces.iter().map(String::as_str))
        .collect();
    let blocked = matched
        .iter()
        .flatten()
        .any(|m| !m.shadow && matches!(m.limit.limit, RateLimit::Blocked { .. }));
    let mut limits = Vec::new();
    let mut slots = Vec::with_capacity(matched.len());
    for (i, m) in matched.iter().enumerate() {
        let Some(m) = m else {
            slots.push(Slot::Free);
            continue;
        };
        if m.limit
            .name
            .as_deref()
            .is_some_and(|n| replaced.contains(&n))
        {
            slots.push(Slot::Free);
            continue;
        }
        match &m.limit.limit {
            RateLimit::Unlimited => slots.push(Slot::Unlimited),
            RateLimit::Blocked { unit, .. } => slots.push(Slot::Blocked {
                unit: *unit,
                shadow: m.shadow,
            }),
            RateLimit::Limited(l) => {
                let entries = entries.get(i).map_or(&[][..], Vec::as_slice);
                let hits = request
                    .descriptors
                    .get(i)
                    .and_then(|d| d.hits_addend.as_ref())
                    .map_or(request_hits, |h| h.value);
                let limit = counted(i, entries, hits, l, m.shadow, blocked)?;
                slots.push(Slot::Counted {
                    index: limits.len(),
                    requests: l.requests,
                    unit: l.unit,
                    shadow: m.shadow,
                    hits,
                    stat_key: l.stat_key.clone(),
                });
                limits.push(limit);
            }
        }
    }
    let check = (!limits.is_empty()).then(|| Check {
        subject: format!("rls:{}", request.domain),
        limits,
        receipt: false,
        lease: None,
        trace: None,
        id: 0,
    });
    Ok(Plan { check, slots })
}

/// The limit descriptor `i` (its `entries`) is counted against, charged
/// `hits`, or its bound the request breaks. A request another descriptor
/// blocks is only looked at: all or nothing, nothing is charged.
fn counted(
    i: usize,
    entries: &[(&str, &str)],
    hits: u64,
    l: &Limited,
    shadow: bool,
    blocked: bool,
) -> Result<Limit, String> {
    if hits > bounds::MAX_COST {
        return Err(format!(
            "descriptors[{i}]: hits_addend {hits} is above {}",
            bounds::MAX_COST
        ));
    }
    let subject = subject(entries);
    if subject.len() > crate::app::MAX_SUBJECT_BYTES {
        return Err(format!(
            "descriptors[{i}]: entries of {} bytes, at most {}",
            subject.len(),
            crate::app::MAX_SUBJECT_BYTES
        ));
    }
    Ok(Limit {
        name: l.id.clone(),
        requests: l.requests,
        window_ms: l.window_ms(),
        algorithm: l.algorithm,
        cost: if blocked { 0 } else { hits },
        burst: None,
        shadow,
        subject: Some(subject),
        calendar: None,
    })
}

fn proto_limit(requests: u64, unit: Unit) -> ProtoLimit {
    ProtoLimit {
        name: String::new(),
        requests_per_unit: u32::try_from(requests).unwrap_or(u32::MAX),
        unit: match unit {
            Unit::Second => ProtoUnit::Second,
            Unit::Minute => ProtoUnit::Minute,
            Unit::Hour => ProtoUnit::Hour,
            Unit::Day => ProtoUnit::Day,
            Unit::Week => ProtoUnit::Week,
            Unit::Month => ProtoUnit::Month,
            Unit::Year => ProtoUnit::Year,
        } as i32,
    }
}

fn duration(ms: u64) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// Each counted descriptor's stats under envoyproxy/ratelimit's names, so
/// that its dashboards keep working after a migration: `total_hits`,
/// `over_limit` (refused), `near_limit` (admitted past 80% of the limit,
/// its default `NEAR_LIMIT_RATIO`) and `shadow_mode` (over the limit in
/// shadow mode), each by the hits the descriptor carried.
fn count_descriptors(metrics: &crate::metrics::Metrics, plan: &Plan, result: &CheckResult) {
    use crate::metrics::RlsEvent;
    for slot in &plan.slots {
        let Slot::Counted {
            index,
            requests,
            shadow,
            hits,
            stat_key,
            ..
        } = slot
        else {
            continue;
        };
        let Some(status) = result.limits.get(*index) else {
            continue;
        };
        metrics.rls_descriptor(stat_key, RlsEvent::TotalHits, *hits);
        match (status.allowed, *shadow) {
            (false, true) => metrics.rls_descriptor(stat_key, RlsEvent::ShadowMode, *hits),
            (false, false) => metrics.rls_descriptor(stat_key, RlsEvent::OverLimit, *hits),
            (true, _) if result.allowed && status.remaining.saturating_mul(5) < *requests => {
                metrics.rls_descriptor(stat_key, RlsEvent::NearLimit, *hits);
            }
            (true, _) => {}
        }
    }
}

/// The answer for a planned request and its check's result.
impl Plan {
    /// Every descriptor as if in `shadow_mode` (the fleet-wide switch is
    /// in shadow): counted, never over the limit.
    fn shadow_all(&mut self) {
        for slot in &mut self.slots {
            if let Slot::Blocked { shadow, .. } | Slot::Counted { shadow, .. } = slot {
                *shadow = true;
            }
        }
        if let Some(check) = &mut self.check {
            for limit in &mut check.limits {
                limit.shadow = true;
            }
        }
    }
}

fn answer(plan: &Plan, result: Option<&CheckResult>) -> RateLimitResponse {
    let code = |over: bool| if over { Code::OverLimit } else { Code::Ok } as i32;
    let statuses: Vec<DescriptorStatus> = plan
        .slots
        .iter()
        .map(|slot| match slot {
            Slot::Free => DescriptorStatus {
                code: code(false),
                ..DescriptorStatus::default()
            },
            Slot::Unlimited => DescriptorStatus {
                code: code(false),
                limit_remaining: u32::MAX,
                ..DescriptorStatus::default()
            },
            Slot::Blocked { unit, shadow } => DescriptorStatus {
                code: code(!shadow),
                current_limit: Some(proto_limit(0, *unit)),
                duration_until_reset: Some(duration(unit.millis())),
                ..DescriptorStatus::default()
            },
            Slot::Counted {
                index,
                requests,
                unit,
                shadow,
                ..
            } => {
                let status = result.and_then(|r| r.limits.get(*index));
                DescriptorStatus {
                    code: code(!shadow && status.is_some_and(|s| !s.allowed)),
                    current_limit: Some(proto_limit(*requests, *unit)),
                    limit_remaining: status
                        .map_or(0, |s| u32::try_from(s.remaining).unwrap_or(u32::MAX)),
                    duration_until_reset: status.map(|s| duration(s.reset_after_ms)),
                    ..DescriptorStatus::default()
                }
            }
        })
        .collect();
    let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    RateLimitResponse {
        overall_code: code(over),
        statuses,
        ..RateLimitResponse::default()
    }
}

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        // The HTTP API's shared token, as gRPC metadata (Envoy's
        // `grpc_service.initial_metadata`).
        let presented = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        if let Err(denied) = self.state.authorize(Caller::Proxy, presented) {
            self.state.metrics.rls_response("unauthenticated");
            return Err(tonic::Status::unauthenticated(denied.to_string()));
        }
        // Envoy's ratelimit filter sends its span's context as metadata
        // when the listener traces.
        let trace = self.state.traces.as_ref().and_then(|_| {
            let metadata = request.metadata();
            crate::traces::context_from_headers(|name| metadata.get(name)?.to_str().ok())
        });
        let request = request.into_inner();
        let domains = self.config.get();
        let metrics = &self.state.metrics;
        let mut plan = plan(&domains, &request).map_err(|e| {
            metrics.rls_response("invalid");
            tonic::Status::invalid_argument(e)
        })?;
        let respond = |response: RateLimitResponse| {
            metrics.rls_response(if response.overall_code == Code::OverLimit as i32 {
                "over_limit"
            } else {
                "ok"
            });
            Ok(tonic::Response::new(response))
        };
        if let Some(check) = &mut plan.check {
            check.trace = trace;
        }
        if self.state.fleet.shadow() {
            plan.shadow_all();
        }
        let Some(check) = &plan.check else {
            return respond(answer(&plan, None));
        };
        let state = &self.state;
        let unavailable = |why: String| {
            metrics.rls_response("unavailable");
            tonic::Status::unavailable(why)
        };
        let Some(_permit) = crate::app::permit(state).await else {
            return Err(unavailable(crate::app::OVERLOADED.into()));
        };
        let (started, clock) = (std::time::SystemTime::now(), std::time::Instant::now());
        let decided =
            tokio::time::timeout(state.limits.request_timeout, state.limiter.check(check))
                .await
                .map_err(|_| unavailable("not decided in time".into()))?;
        if let Some(traces) = &state.traces {
            let outcome = match &decided {
                Ok(result) => CheckOutcome::Decided(result.clone()),
                Err(e) => CheckOutcome::Failed(CheckFailure {
                    error: e.to_string(),
                    kind: FailureKind::Unavailable,
                }),
            };
            traces.record(&CheckSpan {
                check,
                outcome: &outcome,
                started,
                scripts: clock.elapsed(),
                batch: 1,
            });
        }
        match decided {
            Ok(result) => {
                metrics.decision(result.allowed);
                let names = check.limits.iter().map(|l| l.name.as_str());
                metrics.limit_decisions(names.zip(&result.limits), result.allowed);
                count_descriptors(metrics, &plan, &result);
                metrics.rls_shadow_over_limit(
                    result
                        .limits
                        .iter()
                        .filter(|s| s.shadow && !s.allowed)
                        .count() as u64,
                );
                respond(answer(&plan, Some(&result)))
            }
            Err(e) => {
                if let Some(skipped) = state.error_log.allow() {
                    warn!("rate limit service: cannot decide: {e} ({skipped} similar lines suppressed)");
                }
                Err(unavailable(e.to_string()))
            }
        }
    }
}

/// How long the gRPC server waits for in-flight requests at shutdown.
pub const DRAIN: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::google::protobuf::UInt64Value;
    use std::collections::BTreeMap;

    fn domains(yaml: &str) -> Domains {
        Domains::from_files(&BTreeMap::from([("t.yaml".to_string(), yaml.to_string())])).unwrap()
    }

    fn descriptor(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: k.to_string(),
                    value: v.to_string(),
                })
                .collect(),
            hits_addend: hits.map(|value| UInt64Value { value }),
            ..RateLimitDescriptor::default()
        }
    }

    fn request(descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors,
            hits_addend: hits,
        }
    }

    const CONFIG: &str = r#"
domain: d
descriptors:
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 10, name: per-user }
  - key: vip
    rate_limit: { unit: minute, requests_per_unit: 100, replaces: [{ name: per-user }] }
  - key: ip
    value: 10.0.0.9
    rate_limit: { unit: second, requests_per_unit: 0 }
  - key: free
    rate_limit: { unlimited: true }
"#;

    /// Descriptor `hits_addend` over the request's; 0 looks without
    /// charging; a limit named by another's `replaces` is dropped.
    #[test]
    fn descriptors_become_one_check_with_their_hits_and_replacements() {
        let d = domains(CONFIG);
        let p = plan(&d, &request(vec![descriptor(&[("user", "a")], None)], 3)).unwrap();
        let check = p.check.unwrap();
        assert_eq!(check.limits[0].cost, 3);
        assert_eq!(check.limits[0].subject.as_deref(), Some("rls:user=a"));
        let p = plan(&d, &request(vec![descriptor(&[("user", "a")], Some(0))], 3)).unwrap();
        assert_eq!(p.check.unwrap().limits[0].cost, 0);
        let both = request(
            vec![
                descriptor(&[("user", "a")], None),
                descriptor(&[("vip", "a")], None),
            ],
            0,
        );
        let p = plan(&d, &both).unwrap();
        assert_eq!(p.slots[0], Slot::Free, "replaced");
        assert_eq!(p.check.unwrap().limits.len(), 1);
    }

    #[test]
    fn a_blocked_descriptor_is_over_and_charges_nothing_else() {
        let d = domains(CONFIG);
        let r = request(
            vec![
                descriptor(&[("user", "a")], None),
                descriptor(&[("ip", "10.0.0.9")], None),
            ],
            0,
        );
        let p = plan(&d, &r).unwrap();
        assert_eq!(p.check.as_ref().unwrap().limits[0].cost, 0);
        let response = answer(&p, None);
        assert_eq!(response.overall_code, Code::OverLimit as i32);
        assert_eq!(response.statuses[1].code, Code::OverLimit as i32);
    }

    #[test]
    fn statuses_carry_the_limit_the_remaining_and_the_reset() {
        let d = domains(CONFIG);
        let r = request(
            vec![
                descriptor(&[("user", "a")], None),
                descriptor(&[("free", "x")], None),
                descriptor(&[("nothing", "x")], None),
            ],
            0,
        );
        let p = plan(&d, &r).unwrap();
        let result = CheckResult {
            allowed: false,
            limits: vec![meshlimit_protocol::LimitStatus {
                allowed: false,
                limit: 10,
                remaining: 0,
                reset_after_ms: 41_500,
                retry_after_ms: 41_500,
                shadow: false,
                reason: None,
            }],
            receipts: None,
            leased: 0,
        };
        let response = answer(&p, Some(&result));
        assert_eq!(response.overall_code, Code::OverLimit as i32);
        let user = &response.statuses[0];
        assert_eq!(user.current_limit.as_ref().unwrap().requests_per_unit, 10);
        assert_eq!(
            user.current_limit.as_ref().unwrap().unit,
            ProtoUnit::Minute as i32
        );
        assert_eq!(user.duration_until_reset.as_ref().unwrap().seconds, 41);
        assert_eq!(response.statuses[1].limit_remaining, u32::MAX);
        assert_eq!(response.statuses[2].code, Code::Ok as i32);
        assert!(response.statuses[2].current_limit.is_none());
    }

    #[test]
    fn requests_past_the_bounds_are_refused() {
        let d = domains(CONFIG);
        let many = request(
            (0..33)
                .map(|i| descriptor(&[("user", &i.to_string())], None))
                .collect(),
            0,
        );
        assert!(plan(&d, &many).unwrap_err().contains("at most 32"));
        let huge = "x".repeat(70_000);
        let big = request(vec![descriptor(&[("user", &huge)], None)], 0);
        assert!(plan(&d, &big).unwrap_err().contains("bytes"));
        let hits = request(vec![descriptor(&[("user", "a")], Some(2_000_000))], 0);
        assert!(plan(&d, &hits).unwrap_err().contains("hits_addend"));
    }

    #[test]
    fn values_cannot_pass_for_two_entries() {
        assert_ne!(
            subject(&[("a", "1|b=2")]),
            subject(&[("a", "1"), ("b", "2")])
        );
    }
}
