//! Stats per rule and limit through the flow: which limit denied, which
//! shadow limit would have, which decisions the fallback made, and lease
//! hits and local draws counted in bulk, without a hostcall per request.

use super::*;

/// A stat of the limit `rule/limit`.
fn limit_stat(h: &Harness, rule: &str, limit: &str, event: &str) -> u64 {
    h.host
        .stat(&format!("meshlimit.rule.{rule}.limit.{limit}.{event}"))
}

fn tick(h: &Harness) {
    h.host.enter(ROOT);
    h.worker.on_tick(&h.host);
}

#[test]
fn each_limit_has_its_five_stats_defined_at_configure_and_token_limits_three_more() {
    let h = harness("");
    tick(&h);
    for event in [
        "allowed",
        "denied",
        "shadow_denied",
        "fallback",
        "near_limit",
    ] {
        let name = format!("meshlimit.rule.api.limit.per-minute.{event}");
        assert!(h.host.has_stat(&name), "{name} is defined");
    }
}

#[test]
fn the_limit_that_denied_is_counted_and_the_others_are_not() {
    let mut h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]}, "rules": [
              {"name": "edge", "scope": "local", "limits": [{"name": "s", "requests": 2, "window": "1s"}]},
              {"name": "trial", "scope": "local", "shadow": true,
               "limits": [{"name": "s", "requests": 1, "window": "1s"}]}]}"#,
        )
        .unwrap(),
    );
    let steps: Vec<Step> = (0..3).map(|_| h.request("a").1).collect();
    assert_eq!(steps.iter().filter(|s| **s == Step::Continue).count(), 2);
    tick(&h);
    assert_eq!(limit_stat(&h, "edge", "s", "allowed"), 2);
    assert_eq!(limit_stat(&h, "edge", "s", "denied"), 1);
    // Admitted with 1 and 0 of 2 left: both under a tenth? 1 * 10 >= 2.
    assert_eq!(limit_stat(&h, "edge", "s", "near_limit"), 1);
    // The shadow rule never denies; it says it would have, from the
    // second request on.
    assert_eq!(limit_stat(&h, "trial", "s", "denied"), 0);
    assert_eq!(limit_stat(&h, "trial", "s", "shadow_denied"), 2);
    assert_eq!(limit_stat(&h, "edge", "s", "fallback"), 0);
}

#[test]
fn meshlimitds_deny_and_the_deny_cache_count_on_the_limit() {
    let mut h = harness(ONE_CALL);
    let (mut s, _) = h.request("a");
    let step = h.answer_check(&mut s, Some(200), &answer(&[result(false, 0)]));
    assert_eq!(reply_status(&step), Some(429));
    // The next request is refused by the deny cache, on the same limit.
    assert_eq!(reply_status(&h.request("a").1), Some(429));
    tick(&h);
    assert_eq!(limit_stat(&h, "api", "per-minute", "denied"), 2);
    assert_eq!(limit_stat(&h, "api", "per-minute", "allowed"), 0);
}

#[test]
fn decisions_of_the_fallback_are_counted_as_such() {
    let mut h = harness(ONE_CALL);
    let (mut s, _) = h.request("a");
    let step = h.answer_check(&mut s, None, "");
    assert_eq!(step, Step::Continue, "decided by the local fallback");
    tick(&h);
    assert_eq!(limit_stat(&h, "api", "per-minute", "fallback"), 1);
    assert_eq!(limit_stat(&h, "api", "per-minute", "allowed"), 1);
}

/// A busy client's draws on a local rule decide with no hostcall: their
/// counts reach the stats in bulk, all of them by the next tick.
#[test]
fn draw_hits_are_counted_in_bulk_without_a_hostcall_each() {
    let mut h = harness_with(
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]}, "rules": [
              {"name": "edge", "scope": "local", "limits": [{"name": "m", "requests": 1000000, "window": "60s"}]}]}"#,
        )
        .unwrap(),
    );
    for _ in 0..100 {
        assert_eq!(h.request("a").1, Step::Continue);
    }
    let increments = h
        .host
        .take_hostcalls()
        .iter()
        .filter(|c| **c == "increment_metric")
        .count();
    assert!(
        increments < 20,
        "{increments} stat hostcalls for 100 requests"
    );
    tick(&h);
    assert_eq!(limit_stat(&h, "edge", "m", "allowed"), 100);
}
