//! Rate-limit response headers.
//!
//! `draft` follows the IETF httpapi RateLimit draft: `RateLimit-Policy`
//! lists every limit that applied (`"name";q=<quota>;w=<window s>`) and
//! `RateLimit` reports the most constraining one (`"name";r=<remaining>;
//! t=<seconds to reset>`). `x-ratelimit` is the older de-facto trio.
//! Every deny carries `Retry-After` whatever the style.

use meshlimit_protocol::{CheckResult, LimitStatus};

use crate::check::Applied;
use crate::config::HeaderStyle;

/// Response headers: names are always ours (static), values are made per
/// request.
pub type Headers = Vec<(&'static str, String)>;

/// Whole seconds, rounded up: a client that waits the advertised time must
/// not be refused for having waited a few milliseconds too little.
pub fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// `Retry-After` seconds for a deny (never 0: "retry now" would invite a
/// hot loop).
pub fn retry_after_secs(ms: u64) -> u64 {
    ceil_secs(ms).max(1)
}

/// Headers describing `result`, whose statuses are in the order of `limits`.
/// Shadow limits are left out: they describe no quota the client has.
pub fn rate_limit_headers(style: HeaderStyle, limits: &[Applied], result: &CheckResult) -> Headers {
    let Some(top) = most_constraining(limits, result) else {
        return Vec::new();
    };
    let (name, status) = top;
    match style {
        HeaderStyle::None => Vec::new(),
        HeaderStyle::XRatelimit => {
            x_ratelimit(status.limit, status.remaining, status.reset_after_ms)
        }
        HeaderStyle::Draft => {
            // The configured quota, or a higher one meshlimitd applied (a
            // live override raising it; a fallback's share is lower and
            // leaves the policy as configured, a lowered override shows in
            // `r`); and the window, except for calendar windows, whose
            // length varies (a month): `w` is optional in the draft.
            let statuses = result.limits.iter().map(Some);
            let policy = draft_policy(limits, statuses.chain(std::iter::repeat(None)));
            vec![
                ("ratelimit-policy", policy),
                rate_limit(name, status.remaining, status.reset_after_ms),
            ]
        }
        HeaderStyle::RateLimitOnly => {
            vec![rate_limit(name, status.remaining, status.reset_after_ms)]
        }
    }
}

/// Adds, through `add`, the headers of a request admitted without a call
/// (a lease hit, or `scope: local` rules alone): the limit at `top` (an
/// index into `limits`) is the most constraining, with `remaining` units
/// left and its window whole again in `reset_after_ms`. The same as
/// [`rate_limit_headers`] for a result whose most constraining status says
/// that at the configured quota, without making that result. The policy,
/// the same for every such request of the check, is made once and kept in
/// `policy`; the other values are written in `scratch`, so a busy client's
/// hits allocate nothing once it has grown.
pub fn add_admitted(
    style: HeaderStyle,
    limits: &[Applied],
    (top, remaining, reset_after_ms): (usize, u64, u64),
    policy: &std::cell::OnceCell<String>,
    scratch: &mut String,
    mut add: impl FnMut(&'static str, &str),
) {
    let Some(top) = limits.get(top).filter(|a| !a.shadow) else {
        return;
    };
    match style {
        HeaderStyle::None => {}
        HeaderStyle::XRatelimit => {
            for (name, n) in [
                ("x-ratelimit-limit", top.limit.requests),
                ("x-ratelimit-remaining", remaining),
                ("x-ratelimit-reset", ceil_secs(reset_after_ms)),
            ] {
                scratch.clear();
                push_u64(scratch, n);
                add(name, scratch);
            }
        }
        HeaderStyle::Draft | HeaderStyle::RateLimitOnly => {
            if style == HeaderStyle::Draft {
                let policy = policy.get_or_init(|| draft_policy(limits, std::iter::repeat(None)));
                add("ratelimit-policy", policy);
            }
            scratch.clear();
            push_rate_limit(
                scratch,
                &top.limit.qualified_name,
                remaining,
                reset_after_ms,
            );
            add("ratelimit", scratch);
        }
    }
}

/// The first enforced limit: the most constraining when every limit
/// reports the same (a lease's units count against each alike).
pub fn first_enforced(limits: &[Applied]) -> Option<usize> {
    limits.iter().position(|a| !a.shadow)
}

/// Where `result`'s most constraining status is (an index into its
/// limits, in the order of the check's).
pub fn most_constraining_index(result: &CheckResult) -> Option<usize> {
    let top = result.most_constraining()?;
    result.limits.iter().position(|s| std::ptr::eq(s, top))
}

fn x_ratelimit(limit: u64, remaining: u64, reset_after_ms: u64) -> Headers {
    vec![
        ("x-ratelimit-limit", limit.to_string()),
        ("x-ratelimit-remaining", remaining.to_string()),
        ("x-ratelimit-reset", ceil_secs(reset_after_ms).to_string()),
    ]
}

/// `RateLimit-Policy` for `limits`, each with its status if it has one.
/// Written by hand, not with `format!`: made for every admitted request.
fn draft_policy<'a>(
    limits: &[Applied],
    statuses: impl Iterator<Item = Option<&'a LimitStatus>>,
) -> String {
    let mut policy = String::with_capacity(48 * limits.len());
    for (a, status) in limits.iter().zip(statuses).filter(|(a, _)| !a.shadow) {
        // The quota meshlimitd applied: a live override's, raised or
        // lowered (a fallback's statuses carry the configured one).
        let quota = status.map_or(a.limit.requests, |s| s.limit);
        if !policy.is_empty() {
            policy.push_str(", ");
        }
        policy.push('"');
        policy.push_str(&a.limit.qualified_name);
        policy.push_str("\";q=");
        push_u64(&mut policy, quota);
        if a.limit.calendar.is_none() {
            policy.push_str(";w=");
            push_u64(&mut policy, ceil_secs(a.limit.window_ms));
        }
    }
    policy
}

/// The `RateLimit` header for the limit `name`.
fn rate_limit(name: &str, remaining: u64, reset_after_ms: u64) -> (&'static str, String) {
    let mut now = String::with_capacity(name.len() + 32);
    push_rate_limit(&mut now, name, remaining, reset_after_ms);
    ("ratelimit", now)
}

/// The `RateLimit` value for the limit `name`: `"name";r=<remaining>;t=<s>`.
fn push_rate_limit(out: &mut String, name: &str, remaining: u64, reset_after_ms: u64) {
    out.push('"');
    out.push_str(name);
    out.push_str("\";r=");
    push_u64(out, remaining);
    out.push_str(";t=");
    push_u64(out, ceil_secs(reset_after_ms));
}

/// Appends `n` in decimal.
fn push_u64(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut len = 0;
    for d in digits.iter_mut() {
        *d = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend(digits.iter().take(len).rev().map(|&d| char::from(d)));
}

fn most_constraining<'a>(
    limits: &'a [Applied],
    result: &'a CheckResult,
) -> Option<(&'a str, &'a LimitStatus)> {
    let index = most_constraining_index(result)?;
    let applied = limits.get(index)?;
    Some((
        applied.limit.qualified_name.as_str(),
        result.limits.get(index)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LimitConfig;
    use crate::testing;

    fn limit(name: &str, requests: u64, window_ms: u64) -> LimitConfig {
        testing::limit(&format!("api/{name}"), requests, window_ms)
    }

    fn ap(l: &LimitConfig) -> Applied {
        testing::applied(l)
    }

    fn st(allowed: bool, limit: u64, remaining: u64, reset: u64, retry: u64) -> LimitStatus {
        testing::status(allowed, limit, remaining, reset, retry)
    }

    /// A lease hit's headers, made without a result, are those of the
    /// result every limit of the check would report (each admitted with
    /// the same units left), in every style, whatever the limits: one,
    /// several, shadow ones first, a calendar window, shadow only.
    #[test]
    fn a_lease_hits_headers_are_those_of_its_result() {
        let mut monthly = limit("monthly", 100, 31 * 86_400_000);
        monthly.calendar = Some(meshlimit_protocol::Calendar {
            unit: meshlimit_protocol::CalendarUnit::Month,
            utc_offset_minutes: 0,
        });
        let shadow = Applied {
            shadow: true,
            ..ap(&limit("trial", 5, 1_000))
        };
        let sets: Vec<Vec<Applied>> = vec![
            vec![ap(&limit("per-hour", 1_000_000_000, 3_600_000))],
            vec![
                shadow.clone(),
                ap(&limit("per-minute", 20, 60_000)),
                ap(&monthly),
            ],
            vec![ap(&monthly), ap(&limit("per-second", 3, 1_500))],
            vec![shadow],
        ];
        for style in [
            HeaderStyle::Draft,
            HeaderStyle::RateLimitOnly,
            HeaderStyle::XRatelimit,
            HeaderStyle::None,
        ] {
            for limits in &sets {
                for (remaining, reset) in [(0, 0), (7, 1), (12_345, 59_001)] {
                    let result = CheckResult {
                        allowed: true,
                        limits: limits
                            .iter()
                            .map(|a| a.admitted(remaining, reset))
                            .collect(),
                        receipts: None,
                        leased: 0,
                    };
                    let (policy, mut scratch) = (std::cell::OnceCell::new(), String::new());
                    for _ in 0..2 {
                        let mut added = Vec::new();
                        let Some(top) = first_enforced(limits) else {
                            assert!(rate_limit_headers(style, limits, &result).is_empty());
                            continue;
                        };
                        add_admitted(
                            style,
                            limits,
                            (top, remaining, reset),
                            &policy,
                            &mut scratch,
                            |name, value| added.push((name, value.to_string())),
                        );
                        assert_eq!(
                            added,
                            rate_limit_headers(style, limits, &result),
                            "{style:?} {remaining} {reset}"
                        );
                    }
                }
            }
        }
    }

    /// Local rules' headers, made at the response from the most
    /// constraining status alone, are those of their result, whichever
    /// limit constrains most and whatever the others report.
    #[test]
    fn local_rules_headers_from_the_most_constraining_status_are_those_of_their_result() {
        let limits = [
            ap(&limit("per-second", 5, 1_000)),
            ap(&limit("per-minute", 100, 60_000)),
            Applied {
                shadow: true,
                ..ap(&limit("shadow", 1, 1_000))
            },
        ];
        for style in [
            HeaderStyle::Draft,
            HeaderStyle::RateLimitOnly,
            HeaderStyle::XRatelimit,
            HeaderStyle::None,
        ] {
            for (a, b) in [(4, 99), (99, 4), (3, 3), (0, 0)] {
                let result = CheckResult {
                    allowed: true,
                    limits: vec![
                        st(true, 5, a, 400, 0),
                        st(true, 100, b, 59_000, 0),
                        LimitStatus {
                            shadow: true,
                            ..st(false, 1, 0, 1_000, 1_000)
                        },
                    ],
                    receipts: None,
                    leased: 0,
                };
                let top = most_constraining_index(&result).unwrap();
                let status = &result.limits[top];
                let (policy, mut scratch) = (std::cell::OnceCell::new(), String::new());
                let mut added = Vec::new();
                add_admitted(
                    style,
                    &limits,
                    (top, status.remaining, status.reset_after_ms),
                    &policy,
                    &mut scratch,
                    |name, value| added.push((name, value.to_string())),
                );
                assert_eq!(
                    added,
                    rate_limit_headers(style, &limits, &result),
                    "{style:?} {a} {b}"
                );
            }
        }
    }

    /// A live override that raised the quota shows in the policy; a
    /// calendar window has no fixed length, so no `w`.
    #[test]
    fn the_policy_shows_a_raised_quota_and_no_window_for_a_calendar() {
        let mut monthly = limit("monthly", 100, 31 * 86_400_000);
        monthly.calendar = Some(meshlimit_protocol::Calendar {
            unit: meshlimit_protocol::CalendarUnit::Month,
            utc_offset_minutes: 0,
        });
        let raised = limit("per-minute", 20, 60_000);
        let result = CheckResult {
            allowed: true,
            limits: vec![st(true, 100, 50, 90_000_000, 0), st(true, 40, 30, 1_000, 0)],
            receipts: None,
            leased: 0,
        };
        let h = rate_limit_headers(HeaderStyle::Draft, &[ap(&monthly), ap(&raised)], &result);
        assert_eq!(
            h[0].1,
            "\"api/monthly\";q=100, \"api/per-minute\";q=40;w=60"
        );
    }

    /// A live override that lowered the quota shows too: a client refused
    /// at 100 is not told its quota is 1000.
    #[test]
    fn the_policy_shows_a_lowered_quota() {
        let lowered = limit("per-minute", 1000, 60_000);
        let result = CheckResult {
            allowed: false,
            limits: vec![st(false, 100, 0, 30_000, 30_000)],
            receipts: None,
            leased: 0,
        };
        let h = rate_limit_headers(HeaderStyle::Draft, &[ap(&lowered)], &result);
        assert_eq!(h[0].1, "\"api/per-minute\";q=100;w=60");
    }

    /// Two limits admitted, the second with the least remaining.
    fn per_second_and_per_hour() -> ([Applied; 2], CheckResult) {
        let limits = [
            ap(&limit("per-second", 10, 1000)),
            ap(&limit("per-hour", 1000, 3_600_000)),
        ];
        let result = CheckResult {
            allowed: true,
            limits: vec![st(true, 10, 9, 400, 0), st(true, 1000, 3, 1_800_001, 0)],
            receipts: None,
            leased: 0,
        };
        (limits, result)
    }

    #[test]
    fn draft_lists_policies_and_reports_least_remaining() {
        let (limits, result) = per_second_and_per_hour();
        let h = rate_limit_headers(HeaderStyle::Draft, &limits, &result);
        assert_eq!(
            h,
            vec![
                (
                    "ratelimit-policy",
                    "\"api/per-second\";q=10;w=1, \"api/per-hour\";q=1000;w=3600".to_string()
                ),
                ("ratelimit", "\"api/per-hour\";r=3;t=1801".to_string()),
            ]
        );
    }

    /// `ratelimit`: the draft's `RateLimit` as `draft` makes it, and no
    /// `RateLimit-Policy`.
    #[test]
    fn ratelimit_style_sends_the_draft_field_alone() {
        let (limits, result) = per_second_and_per_hour();
        let h = rate_limit_headers(HeaderStyle::RateLimitOnly, &limits, &result);
        assert_eq!(
            h,
            vec![("ratelimit", "\"api/per-hour\";r=3;t=1801".to_string())]
        );
    }

    #[test]
    fn x_ratelimit_style() {
        let a = limit("m", 20, 60_000);
        let result = CheckResult {
            allowed: false,
            limits: vec![st(false, 20, 0, 12_500, 12_500)],
            receipts: None,
            leased: 0,
        };
        let h = rate_limit_headers(HeaderStyle::XRatelimit, &[ap(&a)], &result);
        assert_eq!(
            h,
            vec![
                ("x-ratelimit-limit", "20".to_string()),
                ("x-ratelimit-remaining", "0".to_string()),
                ("x-ratelimit-reset", "13".to_string()),
            ]
        );
    }

    #[test]
    fn none_style_and_empty_results_render_nothing() {
        let a = limit("m", 20, 60_000);
        let result = CheckResult {
            allowed: true,
            limits: vec![st(true, 20, 1, 1, 0)],
            receipts: None,
            leased: 0,
        };
        assert!(rate_limit_headers(HeaderStyle::None, &[ap(&a)], &result).is_empty());
        let empty = CheckResult {
            allowed: true,
            limits: vec![],
            receipts: None,
            leased: 0,
        };
        assert!(rate_limit_headers(HeaderStyle::Draft, &[ap(&a)], &empty).is_empty());
    }

    #[test]
    fn shadow_limits_are_left_out_of_the_headers() {
        let (a, b) = (limit("real", 10, 1000), limit("trial", 2, 1000));
        let mut shadow = ap(&b);
        shadow.shadow = true;
        let mut trial = st(false, 2, 0, 900, 900);
        trial.shadow = true;
        let result = CheckResult {
            allowed: true,
            limits: vec![st(true, 10, 8, 900, 0), trial],
            receipts: None,
            leased: 0,
        };
        let h = rate_limit_headers(HeaderStyle::Draft, &[ap(&a), shadow], &result);
        assert_eq!(h[0].1, "\"api/real\";q=10;w=1");
        assert_eq!(h[1].1, "\"api/real\";r=8;t=1");
    }

    #[test]
    fn numbers_are_written_in_decimal() {
        for n in [0, 7, 10, 99, 1_000_000, u64::MAX] {
            let mut out = String::from("q=");
            push_u64(&mut out, n);
            assert_eq!(out, format!("q={n}"));
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1000), 1);
        assert_eq!(retry_after_secs(1001), 2);
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn header_values_are_always_valid_field_values(
            name in "[A-Za-z0-9_.-]{1,20}",
            requests in 1u64..u64::MAX / 2,
            window_ms in 1u64..u64::MAX / 2,
            remaining in any::<u64>(),
            reset in any::<u64>(),
            allowed in any::<bool>(),
            style in prop::sample::select(vec![HeaderStyle::Draft, HeaderStyle::RateLimitOnly, HeaderStyle::XRatelimit, HeaderStyle::None]),
        ) {
            let limit = crate::testing::limit(&format!("r/{name}"), requests, window_ms);
            let applied = crate::testing::applied(&limit);
            let result = CheckResult {
                allowed,
                limits: vec![crate::testing::status(allowed, requests, remaining, reset, reset)], receipts: None, leased: 0,
            };
            for (k, v) in rate_limit_headers(style, &[applied], &result) {
                prop_assert!(k.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'));
                prop_assert!(v.bytes().all(|b| (0x20..0x7f).contains(&b)), "{}: {}", k, v);
            }
            prop_assert!(retry_after_secs(reset) >= 1);
        }
    }
}
