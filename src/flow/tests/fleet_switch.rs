//! The fleet-wide enforcement switch through the flow: what the filter
//! decides on its own obeys the state meshlimitd's answers report.

use super::*;

fn answer_in(mode: &str, results: &[String]) -> String {
    format!(
        r#"{{"results":[{}],"enforcement":"{mode}"}}"#,
        results.join(",")
    )
}

/// An answer admitting a shadow denial (what meshlimitd sends in shadow).
fn shadow_denied() -> String {
    r#"{"allowed":true,"limits":[{"allowed":false,"limit":20,"remaining":0,"reset_after_ms":30000,"retry_after_ms":0,"shadow":true}]}"#.into()
}

#[test]
fn a_cached_deny_waits_for_a_fresh_enforce_and_shadow_ends_it() {
    let mut h = harness(ONE_CALL);
    let (mut s, _) = h.request("sw-a");
    let step = h.answer_check(
        &mut s,
        Some(200),
        &answer_in("enforce", &[result(false, 0)]),
    );
    assert_eq!(reply_status(&step), Some(429));
    // Heard `enforce`: the deny is served from the cache (for half a
    // second after it was learnt, `shared::deny_cache`).
    assert_eq!(reply_status(&h.request("sw-a").1), Some(429));
    assert_eq!(h.calls(), 1);
    // Then the request calls: the fleet went shadow meanwhile, and the
    // request is admitted.
    h.advance(1_000);
    let (mut s, step) = h.request("sw-a");
    assert_eq!(step, Step::Pause);
    let step = h.answer_check(&mut s, Some(200), &answer_in("shadow", &[shadow_denied()]));
    assert_eq!(step, Step::Continue);
    let (mut s, step) = h.request("sw-a");
    assert_eq!(step, Step::Pause, "in shadow, no cached deny is served");
    h.answer_check(&mut s, Some(200), &answer_in("shadow", &[shadow_denied()]));
}

#[test]
fn without_a_switch_cached_denies_are_served_as_before() {
    let mut h = harness(ONE_CALL);
    let (mut s, _) = h.request("sw-b");
    h.answer_check(&mut s, Some(200), &answer(&[result(false, 0)]));
    for ms in [0, 200, 200] {
        h.advance(ms);
        assert_eq!(reply_status(&h.request("sw-b").1), Some(429), "{ms}");
    }
    assert_eq!(h.calls(), 1);
}

#[test]
fn the_fallback_obeys_the_last_state_heard() {
    for mode in ["local", "deny"] {
        let mut h = harness(&format!(
            r#"{ONE_CALL}"failure_mode": "{mode}", "breaker": {{"failures": 1000}},"#
        ));
        let (mut s, _) = h.request("sw-c");
        h.answer_check(&mut s, Some(200), &answer_in("shadow", &[result(true, 19)]));
        // meshlimitd is gone; the fleet was in shadow when last heard:
        // the fallback's share (20 / 1 replica) is spent, and nothing is
        // refused.
        let mut refused = 0;
        for _ in 0..30 {
            let (mut s, _) = h.request("sw-c");
            if reply_status(&h.answer_check(&mut s, None, "")).is_some() {
                refused += 1;
            }
            h.end(&s);
        }
        assert_eq!(refused, 0, "{mode}");
        assert!(h.fallbacks() >= 30, "{mode}");
    }
}

#[test]
fn local_rules_obey_the_last_state_heard() {
    let config = crate::config::parse(
        br#"{"client_id": {"headers": ["x-api-key"]},
             "rules": [{"name": "edge", "scope": "local", "match": {"path_prefix": "/edge"},
                        "limits": [{"name": "m", "requests": 2, "window": "60s"}]},
                       {"name": "api", "match": {"path_prefix": "/api/"},
                        "limits": [{"name": "per-minute", "requests": 20, "window": "60s"}]}],
             "group_commit": {"enabled": false}}"#,
    )
    .unwrap();
    let mut h = harness_with(config);
    let (mut s, _) = h.request("sw-d");
    h.answer_check(&mut s, Some(200), &answer_in("shadow", &[result(true, 19)]));
    let steps: Vec<Step> = (0..4).map(|_| h.request_to("/edge", "sw-d").1).collect();
    assert!(steps.iter().all(|s| *s == Step::Continue), "{steps:?}");
    assert_eq!(h.stat("shadow_denied"), 2);
}
