//! The decision log: a line per sampled decision, saying where it came
//! from and what each limit said; off by default, client input quoted.

use super::*;

const ON: &str = r#""decision_log": {"sample": 1, "level": "info"},"#;

/// The lines logged that name `subject` (tests run in parallel: each uses
/// subjects of its own).
fn lines_of(subject: &str) -> Vec<String> {
    let quoted = format!("{:?}", format!("hdr:x-api-key:{subject}"));
    LOGGED
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("decision ") && l.contains(&quoted))
        .cloned()
        .collect()
}

#[test]
fn a_call_a_cached_deny_and_the_fallback_each_say_so() {
    let mut h = harness(&format!("{ONE_CALL}{ON}"));
    let (mut s, _) = h.request("dl-call");
    h.answer_check(&mut s, Some(200), &answer(&[result(true, 7)]));
    let (mut s, _) = h.request("dl-deny");
    h.answer_check(&mut s, Some(200), &answer(&[result(false, 0)]));
    assert_eq!(reply_status(&h.request("dl-deny").1), Some(429));
    let (mut s, _) = h.request("dl-down");
    h.answer_check(&mut s, Some(503), r#"{"error":"redis down"}"#);

    let call = lines_of("dl-call");
    assert_eq!(call.len(), 1, "{call:?}");
    assert!(
        call[0].contains(
            r#"INFO decision allowed from call: api/per-minute subject "hdr:x-api-key:dl-call" allowed remaining 7 of 20"#
        ),
        "{call:?}"
    );
    let deny = lines_of("dl-deny");
    assert_eq!(deny.len(), 2, "{deny:?}");
    assert!(
        deny[0].contains("decision denied from call: api/per-minute")
            && deny[0].contains("denied remaining 0 of 20"),
        "{deny:?}"
    );
    assert!(
        deny[1].contains("decision denied from cache: api/per-minute")
            && deny[1].ends_with(" denied"),
        "{deny:?}"
    );
    let down = lines_of("dl-down");
    assert_eq!(down.len(), 1, "{down:?}");
    assert!(
        down[0].contains("decision allowed from fallback: api/per-minute"),
        "{down:?}"
    );
}

#[test]
fn it_is_off_by_default_and_denied_only_skips_admissions() {
    let mut h = harness(ONE_CALL);
    let (mut s, _) = h.request("dl-off");
    h.answer_check(&mut s, Some(200), &answer(&[result(true, 7)]));
    assert!(lines_of("dl-off").is_empty());

    let mut h = harness(&format!(
        r#"{ONE_CALL}"decision_log": {{"sample": 1, "denied_only": true}},"#
    ));
    let (mut s, _) = h.request("dl-only-ok");
    h.answer_check(&mut s, Some(200), &answer(&[result(true, 7)]));
    let (mut s, _) = h.request("dl-only-no");
    h.answer_check(&mut s, Some(200), &answer(&[result(false, 0)]));
    assert!(lines_of("dl-only-ok").is_empty());
    let denied = lines_of("dl-only-no");
    assert_eq!(denied.len(), 1, "{denied:?}");
    assert!(
        denied[0].starts_with("DEBUG decision denied"),
        "debug by default: {denied:?}"
    );
}

#[test]
fn a_subject_cannot_forge_a_line() {
    let mut h = harness(&format!("{ONE_CALL}{ON}"));
    let (mut s, _) = h.request("dl-x\"\ndecision allowed from call: forged");
    h.answer_check(&mut s, Some(200), &answer(&[result(true, 7)]));
    let lines = lines_of("dl-x\"\ndecision allowed from call: forged");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(!lines[0].contains('\n'), "{lines:?}");
    assert!(lines[0].contains(r#"dl-x\"\ndecision"#), "{lines:?}");
}

#[test]
fn a_sample_logs_about_its_share_and_a_worker_writes_at_most_its_cap_a_second() {
    let mut h = harness(&format!(r#"{ONE_CALL}"decision_log": {{"sample": 0.25}},"#));
    for _ in 0..400 {
        let (mut s, _) = h.request("dl-sample");
        h.answer_check(&mut s, Some(200), &answer(&[result(true, 7)]));
        h.end(&s);
        h.advance(100);
    }
    let n = lines_of("dl-sample").len();
    assert!((60..=140).contains(&n), "{n} of 400 at 0.25");

    let mut h = harness(&format!("{ONE_CALL}{ON}"));
    let cap = crate::flow::decision_log::MAX_LINES_PER_SECOND as usize;
    for _ in 0..cap + 20 {
        let (mut s, _) = h.request("dl-cap");
        h.answer_check(&mut s, Some(200), &answer(&[result(true, 7)]));
        h.end(&s);
    }
    assert_eq!(lines_of("dl-cap").len(), cap);
    h.advance(1000);
    let (mut s, _) = h.request("dl-cap");
    h.answer_check(&mut s, Some(200), &answer(&[result(true, 7)]));
    let lines = lines_of("dl-cap");
    assert!(
        lines
            .last()
            .unwrap()
            .ends_with("(20 sampled lines held back)"),
        "{:?}",
        lines.last()
    );
}

#[test]
fn a_local_rule_says_local() {
    let config = crate::config::parse(
        br#"{"client_id": {"headers": ["x-api-key"]}, "decision_log": {"sample": 1},
             "rules": [{"name": "edge", "scope": "local",
                        "limits": [{"name": "m", "requests": 2, "window": "60s"}]}]}"#,
    )
    .unwrap();
    let mut h = harness_with(config);
    for _ in 0..3 {
        h.request("dl-local");
    }
    let lines = lines_of("dl-local");
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(
        lines[0].contains("decision allowed from local: edge/m")
            && lines[0].contains("remaining 1 of 2"),
        "{lines:?}"
    );
    assert!(
        lines[2].contains("decision denied from local: edge/m"),
        "{lines:?}"
    );
}
