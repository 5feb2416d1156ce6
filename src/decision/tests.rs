use super::*;
use crate::check::Applied;
use crate::config;
use crate::config::Config;
use crate::host::fake::FakeRequest;
use crate::testing;
use meshlimit_protocol::{CheckResult, LimitStatus};

fn cfg(extra: &str) -> Config {
    config::parse(
        format!(
            r#"{{{extra}"rules":[
            {{"name":"api","match":{{"path_prefix":"/api/","methods":["GET"]}},
              "limits":[{{"name":"per-minute","requests":20,"window":"60s"}},{{"name":"per-hour","requests":100,"window":"1h"}}]}},
            {{"name":"all","limits":[{{"name":"burst","requests":50,"window":"1s"}}]}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

fn keyed() -> Config {
    cfg(r#""client_id":{"headers":["x-api-key"],"when_missing":"reject"},"#)
}

#[test]
fn every_limit_of_every_matching_rule_is_in_one_check() {
    let c = keyed();
    let req = FakeRequest::default().with_header("x-api-key", b"A");
    let Plan::Check(p) = plan(&c, &req, "GET", "/api/items") else {
        panic!("expected a check")
    };
    let refs: Vec<_> = p
        .global
        .iter()
        .map(|a| (a.limit.qualified_name.as_str(), a.cost))
        .collect();
    assert_eq!(
        refs,
        vec![("api/per-minute", 1), ("api/per-hour", 1), ("all/burst", 1)]
    );
    let body = p.to_request();
    assert_eq!(body.checks.len(), 1);
    let names: Vec<_> = body.checks[0]
        .limits
        .iter()
        .map(|l| l.name.as_str())
        .collect();
    assert_eq!(names, ["api/per-minute", "api/per-hour", "all/burst"]);
    assert_eq!(body.checks[0].subject, "hdr:x-api-key:A");
    assert_eq!(body.checks[0].limits[0].window_ms, 60_000);
}

#[test]
fn unmatched_requests_pass_and_missing_ids_are_rejected() {
    let c = cfg(r#""client_id":{"headers":["x-api-key"],"when_missing":"reject"},"#);
    let only_api = config::parse(
        br#"{"client_id":{"headers":["x-api-key"],"when_missing":"reject"},"rules":[{"name":"api","match":{"path_prefix":"/api/"},"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
    )
    .unwrap();
    assert_eq!(
        plan(&only_api, &FakeRequest::default(), "GET", "/health"),
        Plan::Pass { skipped: 0 }
    );
    let Plan::Reject(r, RejectReason::NoClientId) =
        plan(&c, &FakeRequest::default(), "GET", "/api/x")
    else {
        panic!("expected a rejection")
    };
    assert_eq!(r.status, 401);
    assert!(r.body.contains("x-api-key"));
}

fn status(allowed: bool, limit: u64, remaining: u64, reset: u64) -> LimitStatus {
    testing::status(
        allowed,
        limit,
        remaining,
        reset,
        if allowed { 0 } else { reset },
    )
}

fn applied(c: &Config, refs: &[(usize, usize)]) -> Vec<Applied> {
    refs.iter()
        .map(|&(r, l)| testing::applied(&c.rules[r].limits[l]))
        .collect()
}

fn body(results: &str) -> Vec<u8> {
    format!(r#"{{"results":[{results}]}}"#).into_bytes()
}

#[test]
fn answers_are_read_and_checked() {
    let ok = body(
        r#"{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":500,"retry_after_ms":0}]}"#,
    );
    let r = read_answer(Some(200), Some(&ok), 1, false).unwrap();
    assert!(r.allowed);
    assert_eq!(r.limits[0].remaining, 19);
    assert!(matches!(
        read_answer(Some(200), Some(&ok), 2, false),
        Err(ServiceError::BadBody(_))
    ));
}

#[test]
fn every_kind_of_failure_is_classified() {
    use ServiceError::*;
    assert_eq!(read_answer(None, None, 1, true), Err(Timeout));
    assert_eq!(read_answer(None, None, 1, false), Err(Connection));
    assert_eq!(read_answer(Some(504), None, 1, false), Err(Timeout));
    assert_eq!(
        read_answer(
            Some(503),
            Some(b"upstream connect error or disconnect/reset before headers"),
            1,
            false
        ),
        Err(Connection)
    );
    assert_eq!(
        read_answer(Some(503), Some(br#"{"error":"redis down"}"#), 1, false),
        Err(Unavailable)
    );
    assert_eq!(
        read_answer(Some(400), Some(b"{}"), 1, false),
        Err(BadStatus(400))
    );
    for bad in [
        &b""[..],
        b"not json",
        b"{\"results\":[]}",
        b"[1,2]",
        &[0xff; 10],
    ] {
        assert!(
            matches!(read_answer(Some(200), Some(bad), 1, false), Err(BadBody(_))),
            "{bad:?}"
        );
    }
    let huge = vec![b' '; MAX_ANSWER_BYTES + 1];
    assert!(matches!(
        read_answer(Some(200), Some(&huge), 1, false),
        Err(BadBody(_))
    ));
    let contradiction = body(
        r#"{"allowed":true,"limits":[{"allowed":false,"limit":1,"remaining":0,"reset_after_ms":1,"retry_after_ms":1}]}"#,
    );
    assert!(matches!(
        read_answer(Some(200), Some(&contradiction), 1, false),
        Err(BadBody(_))
    ));
}

/// Rolling upgrades: a newer meshlimitd may add optional fields; an
/// older filter reads the answer as before (it used to refuse it, and
/// every check fell back until the filter was upgraded too).
#[test]
fn answers_from_a_newer_meshlimitd_are_read() {
    let newer = r#"{"results":[{"allowed":true,"lease":{"units":5},"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":500,"retry_after_ms":0,"tokens_left":3}]}],"served_by":"meshlimitd-2"}"#;
    let r = read_answer(Some(200), Some(newer.as_bytes()), 1, false).unwrap();
    assert!(r.allowed);
    assert_eq!(r.limits[0].remaining, 19);
}

#[test]
fn batch_answers_are_read_in_order_and_checked_whole() {
    let one = r#"{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":500,"retry_after_ms":0}]}"#;
    let denied = r#"{"allowed":false,"limits":[{"allowed":false,"limit":20,"remaining":0,"reset_after_ms":500,"retry_after_ms":500}]}"#;
    let b = body(&format!("{one},{denied}"));
    let results = read_batch_answer(Some(200), Some(&b), &[1, 1], 0, false)
        .unwrap()
        .results;
    assert!(results[0].as_ref().unwrap().allowed && !results[1].as_ref().unwrap().allowed);
    assert!(matches!(
        read_batch_answer(Some(200), Some(&b), &[1, 1, 1], 0, false),
        Err(ServiceError::BadBody(_))
    ));
    assert!(matches!(
        read_batch_answer(Some(200), Some(&b), &[1, 2], 0, false),
        Err(ServiceError::BadBody(_))
    ));
    assert_eq!(
        read_batch_answer(None, None, &[1, 1], 0, true),
        Err(ServiceError::Timeout)
    );
}

/// An older meshlimitd leaves settlements unanswered: its checks'
/// decisions stand, only the settlements failed.
#[test]
fn settlements_left_unanswered_fail_alone() {
    let one = r#"{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":500,"retry_after_ms":0}]}"#;
    let answer = read_batch_answer(Some(200), Some(&body(one)), &[1], 2, false).unwrap();
    let (results, settled) = (answer.results, answer.settled);
    assert!(results[0].as_ref().unwrap().allowed);
    assert_eq!(settled.len(), 2);
    assert!(settled
        .iter()
        .all(|s| matches!(s, meshlimit_protocol::SettleOutcome::Failed(_))));
}

#[test]
fn deny_carries_status_retry_after_and_headers() {
    let c = keyed();
    let limits = applied(&c, &[(0, 0)]);
    let result = CheckResult {
        allowed: false,
        limits: vec![status(false, 20, 0, 41_200)],
        receipts: None,
        leased: 0,
    };
    let Verdict::Deny(d) = verdict(&c, &limits, &result) else {
        panic!("expected deny")
    };
    assert_eq!(d.status, 429);
    assert_eq!(d.body, "rate limit exceeded\n");
    let get = |n: &str| {
        d.headers
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(get("retry-after").as_deref(), Some("42"));
    assert_eq!(
        get("ratelimit").as_deref(),
        Some("\"api/per-minute\";r=0;t=42")
    );
    assert_eq!(
        get("ratelimit-policy").as_deref(),
        Some("\"api/per-minute\";q=20;w=60")
    );
}

#[test]
fn allow_carries_headers_for_the_response() {
    let c = keyed();
    let limits = applied(&c, &[(0, 0), (0, 1)]);
    let result = CheckResult {
        allowed: true,
        limits: vec![status(true, 20, 5, 1000), status(true, 100, 2, 2000)],
        receipts: None,
        leased: 0,
    };
    let Verdict::Allow { headers } = verdict(&c, &limits, &result) else {
        panic!("expected allow")
    };
    assert!(headers.contains(&("ratelimit", "\"api/per-hour\";r=2;t=2".into())));
}

fn cost_cfg(cost: &str, shadow: bool) -> Config {
    config::parse(
        format!(
            r#"{{"client_id":{{"headers":["x-api-key"]}},"rules":[{{"name":"api","cost":{cost},"shadow":{shadow},
              "limits":[{{"name":"m","requests":10,"window":"60s"}}]}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

#[test]
fn cost_comes_from_the_rule_or_a_bounded_header() {
    let req = FakeRequest::default().with_header("x-api-key", b"A");
    let Plan::Check(p) = plan(&cost_cfg("5", false), &req, "GET", "/") else {
        panic!("expected a check")
    };
    assert_eq!(p.global[0].cost, 5);
    assert_eq!(p.to_request().checks[0].limits[0].cost, 5);
    let header = cost_cfg(r#"{"header":"x-cost","max":10,"default":2}"#, false);
    let cost_of = |v: Option<&[u8]>| {
        let mut r = FakeRequest::default().with_header("x-api-key", b"A");
        if let Some(v) = v {
            r = r.with_header("x-cost", v);
        }
        plan(&header, &r, "GET", "/")
    };
    assert!(matches!(cost_of(None), Plan::Check(p) if p.global[0].cost == 2));
    assert!(matches!(cost_of(Some(b" 7 ")), Plan::Check(p) if p.global[0].cost == 7));
    for bad in [&b"0"[..], b"11", b"-1", b"x", b"1.5", &[0xff]] {
        let Plan::Reject(d, RejectReason::InvalidCost) = cost_of(Some(bad)) else {
            panic!("{bad:?} should be refused")
        };
        assert_eq!(d.status, 400);
        assert!(d.body.contains("from 1 to 10"), "{}", d.body);
    }
}

#[test]
fn a_cost_above_capacity_is_denied_with_the_reason() {
    let req = FakeRequest::default().with_header("x-api-key", b"A");
    let Plan::Reject(d, RejectReason::CostAboveCapacity) =
        plan(&cost_cfg("11", false), &req, "GET", "/")
    else {
        panic!("expected a rejection")
    };
    assert_eq!(d.status, 429);
    assert_eq!(
        d.body,
        "request cost 11 exceeds the capacity 10 of limit api/m\n"
    );
    assert!(d.headers.contains(&("retry-after", "60".into())));
    // In shadow mode it is only observed.
    assert!(matches!(
        plan(&cost_cfg("11", true), &req, "GET", "/"),
        Plan::Check(_)
    ));
}

#[test]
fn shadow_denials_do_not_deny() {
    let c = cost_cfg("1", true);
    let req = FakeRequest::default().with_header("x-api-key", b"A");
    let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
        panic!("expected a check")
    };
    let limits = p.all();
    assert!(limits[0].shadow);
    let body = body(
        r#"{"allowed":true,"limits":[{"allowed":false,"limit":10,"remaining":0,"reset_after_ms":5,"retry_after_ms":5,"shadow":true}]}"#,
    );
    let result = read_answer(Some(200), Some(&body), 1, false).unwrap();
    assert!(
        matches!(verdict(&c, &limits, &result), Verdict::Allow { headers } if headers.is_empty())
    );
}

#[test]
fn denials_are_cached_until_retry_and_answered_locally() {
    use crate::host::fake::FakeStore;
    use crate::shared::deny_cache::DenyCache;
    let c = keyed();
    let store = FakeStore::default();
    let cache = DenyCache {
        keys: &crate::shared::keys::Keys::new("test"),
        slots: 64,
        seed: (1, 2),
        store: &store,
    };
    let req = FakeRequest::default().with_header("x-api-key", b"A");
    let Plan::Check(p) = plan(&c, &req, "GET", "/api/x") else {
        panic!("expected a check")
    };
    assert!(cached_deny(&c, &p, &cache, 1_000).is_none());
    let result = CheckResult {
        allowed: false,
        limits: vec![
            status(false, 20, 0, 30_000),
            status(true, 100, 50, 1000),
            status(true, 50, 3, 10),
        ],
        receipts: None,
        leased: 0,
    };
    remember_denials(&p, &result, &cache, 1_000);
    let Some((Verdict::Deny(d), _)) = cached_deny(&c, &p, &cache, 1_400) else {
        panic!("expected a cached deny")
    };
    assert!(d.headers.contains(&("retry-after", "30".into())));
    assert!(d
        .headers
        .contains(&("ratelimit", "\"api/per-minute\";r=0;t=30".into())));
    assert!(
        cached_deny(&c, &p, &cache, 2_000).is_none(),
        "trusted for a second, then asked again"
    );
    // Another client is not affected.
    let other = FakeRequest::default().with_header("x-api-key", b"B");
    let Plan::Check(q) = plan(&c, &other, "GET", "/api/x") else {
        panic!("expected a check")
    };
    assert!(cached_deny(&c, &q, &cache, 1_500).is_none());
}

#[test]
fn local_rules_stay_out_of_the_call_and_results_combine() {
    let c = config::parse(
        br#"{"client_id":{"headers":["x-api-key"]},"rules":[
          {"name":"edge","scope":"local","limits":[{"name":"s","requests":5,"window":"1s"}]},
          {"name":"api","limits":[{"name":"m","requests":100,"window":"60s"}]}]}"#,
    )
    .unwrap();
    let req = FakeRequest::default().with_header("x-api-key", b"A");
    let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
        panic!("expected a check")
    };
    let (local, global) = (&p.local, &p.global);
    assert_eq!((local.len(), global.len()), (1, 1));
    let body = p.to_request();
    assert_eq!(body.checks[0].limits.len(), 1);
    assert_eq!(body.checks[0].limits[0].name, "api/m");
    let l = CheckResult {
        allowed: true,
        limits: vec![status(true, 5, 1, 300)],
        receipts: None,
        leased: 0,
    };
    let g = CheckResult {
        allowed: true,
        limits: vec![status(true, 100, 40, 9000)],
        receipts: None,
        leased: 0,
    };
    let (applied, result) = combine((local, &l), (global, &g));
    let Verdict::Allow { headers } = verdict(&c, &applied, &result) else {
        panic!("expected allow")
    };
    assert!(headers.contains(&("ratelimit", "\"edge/s\";r=1;t=1".into())));
    let denied = CheckResult {
        allowed: false,
        limits: vec![status(false, 100, 0, 9000)],
        receipts: None,
        leased: 0,
    };
    let (_, result) = combine((local, &l), (global, &denied));
    assert!(!result.allowed);
}

#[test]
fn failure_deny_uses_the_configured_response() {
    let c = cfg(r#""response":{"status":503,"body":"busy\n"},"#);
    let Verdict::Deny(d) = failure_deny(&c) else {
        panic!("expected deny")
    };
    assert_eq!((d.status, d.body.as_str()), (503, "busy\n"));
    assert!(d.headers.contains(&("retry-after", "1".into())));
}

/// Rules with limits counted by other attributes than the client.
fn by_cfg() -> Config {
    config::parse(
        br#"{"client_id":{"headers":["x-api-key"],"when_missing":"reject"},"rules":[
          {"name":"route","limits":[{"name":"cap","requests":100,"window":"1s","by":[]}]},
          {"name":"tenant","limits":[
            {"name":"m","requests":10,"window":"60s","by":["header:x-tenant"],
             "overrides":[{"subjects":["big"],"requests":1000}]},
            {"name":"strict","requests":5,"window":"60s","by":["header:x-region"],"missing":"reject"}]}]}"#,
    )
    .unwrap()
}

#[test]
fn each_limit_carries_its_own_subject_and_the_wire_names_only_the_others() {
    let c = by_cfg();
    let req = FakeRequest::default()
        .with_header("x-tenant", b"big")
        .with_header("x-region", b"eu");
    let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
        panic!("expected a check")
    };
    let subjects: Vec<&str> = p.global.iter().map(|a| a.subject.as_str()).collect();
    assert_eq!(subjects, ["*", "hdr:x-tenant:big", "hdr:x-region:eu"]);
    // No limit counts by the client: no client id was needed (and
    // `when_missing: reject` did not refuse the request).
    assert_eq!(p.subject, "*");
    let wire = p.to_request();
    let limits = &wire.checks[0].limits;
    assert_eq!(wire.checks[0].subject, "*");
    assert_eq!(limits[0].subject, None, "the check's own subject");
    assert_eq!(limits[1].subject.as_deref(), Some("hdr:x-tenant:big"));
    assert_eq!(limits[1].requests, 1000, "the static override, by value");
    assert_eq!(limits[2].requests, 5);
}

#[test]
fn a_missing_attribute_skips_or_refuses_as_configured() {
    let c = by_cfg();
    // No tenant: `m` is skipped; the region limit still applies.
    let req = FakeRequest::default().with_header("x-region", b"eu");
    let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
        panic!("expected a check")
    };
    assert_eq!(p.skipped, 1);
    assert_eq!(p.global.len(), 2);
    // No region: refused, naming the attribute and the limit.
    let req = FakeRequest::default().with_header("x-tenant", b"t");
    let Plan::Reject(d, RejectReason::MissingAttribute) = plan(&c, &req, "GET", "/") else {
        panic!("expected a refusal")
    };
    assert_eq!(d.status, 403);
    assert_eq!(d.body, "missing header:x-region for limit tenant/strict\n");
    // A header sent twice is no value at all.
    let twice = FakeRequest::default()
        .with_header("x-region", b"eu")
        .with_header("x-region", b"us");
    assert!(matches!(
        plan(&c, &twice, "GET", "/"),
        Plan::Reject(_, RejectReason::MissingAttribute)
    ));
}

/// `match` and `by` agree on what a missing attribute is: an empty
/// header is absent to both. A rule that requires the header never sees it
/// missing, and a rule for requests without it catches the empty one
/// (before, `x-tenant:` with no value matched the tenants' rule, was
/// skipped by its `by`, and escaped the anonymous rule: counted nowhere).
#[test]
fn an_empty_header_is_absent_to_match_and_by_alike() {
    let c = config::parse(
        br#"{"rules":[
          {"name":"tenants","match":{"headers":[{"name":"x-tenant","present":true}]},
           "limits":[{"name":"m","requests":10,"window":"60s","by":["header:x-tenant"]}]},
          {"name":"anonymous","match":{"headers":[{"name":"x-tenant","absent":true}]},
           "limits":[{"name":"m","requests":5,"window":"60s","by":[]}]}]}"#,
    )
    .unwrap();
    let names = |req: &FakeRequest| match plan(&c, req, "GET", "/") {
        Plan::Check(p) => {
            assert_eq!(p.skipped, 0, "never missing to a rule that requires it");
            p.global
                .iter()
                .map(|a| a.limit.qualified_name.clone())
                .collect::<Vec<_>>()
        }
        other => panic!("expected a check, got {other:?}"),
    };
    let tenant = FakeRequest::default().with_header("x-tenant", b"acme");
    assert_eq!(names(&tenant), ["tenants/m"]);
    let empty = FakeRequest::default().with_header("x-tenant", b"");
    assert_eq!(names(&empty), ["anonymous/m"]);
    assert_eq!(names(&FakeRequest::default()), ["anonymous/m"]);
}

#[test]
fn every_limit_skipped_means_nothing_to_check() {
    let c = config::parse(
        br#"{"rules":[{"name":"t","limits":[{"name":"m","requests":1,"window":"1s","by":["jwt:sub"]}]}]}"#,
    )
    .unwrap();
    assert_eq!(
        plan(&c, &FakeRequest::default(), "GET", "/"),
        Plan::Pass { skipped: 1 }
    );
}

#[test]
fn the_client_id_is_the_checks_subject_when_a_limit_counts_by_it() {
    let c = config::parse(
        br#"{"client_id":{"headers":["x-api-key"]},"rules":[
          {"name":"route","limits":[{"name":"cap","requests":100,"window":"1s","by":[]}]},
          {"name":"api","limits":[{"name":"m","requests":10,"window":"60s",
            "overrides":[{"subjects":["vip"],"requests":99}]}]}]}"#,
    )
    .unwrap();
    let req = FakeRequest::default().with_header("x-api-key", b"vip");
    let Plan::Check(p) = plan(&c, &req, "GET", "/") else {
        panic!("expected a check")
    };
    assert_eq!(p.subject, "hdr:x-api-key:vip");
    let wire = p.to_request();
    assert_eq!(wire.checks[0].limits[0].subject.as_deref(), Some("*"));
    assert_eq!(wire.checks[0].limits[1].subject, None);
    assert_eq!(
        wire.checks[0].limits[1].requests, 99,
        "an override by the id's value"
    );
}

#[test]
fn every_service_error_kind_has_its_stat() {
    for e in [
        ServiceError::Timeout,
        ServiceError::Connection,
        ServiceError::Unavailable,
        ServiceError::BadStatus(418),
        ServiceError::BadBody(String::new()),
        ServiceError::Refused(String::new()),
    ] {
        let name = e.stat().def().name;
        assert_eq!(name, format!("meshlimit.service_errors.{}", e.kind()));
    }
}
