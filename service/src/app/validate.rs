//! What a call may hold, beyond what serde checks: bounds on the call as
//! a whole, on each check and each settlement, each refusal naming the
//! field. One call's bad input gets its own error and changes nothing
//! for the others.

use meshlimit_protocol::bounds::{self, LimitField};
use meshlimit_protocol::{Check, CheckRequest, Limit, Settlement};

/// Bounds on one call, so one caller cannot make a script or a reply huge.
pub const MAX_CHECKS: usize = 1024;
pub const MAX_LIMITS_PER_CHECK: usize = 32;
pub const MAX_SUBJECT_BYTES: usize = 64 * 1024;

/// Checks what serde cannot, for a whole call and each of its checks: the
/// first problem, or none.
pub fn validate(request: &CheckRequest) -> Result<(), String> {
    validate_batch(request)?;
    for (i, check) in request.checks.iter().enumerate() {
        validate_check(i, check)?;
    }
    Ok(())
}

/// The bounds of a call as a whole.
pub fn validate_batch(request: &CheckRequest) -> Result<(), String> {
    if request.checks.is_empty() && request.settlements.is_empty() && request.lost.is_empty() {
        return Err("checks: must contain at least one check (or settlement)".into());
    }
    if request.lost.len() > MAX_CHECKS {
        return Err(format!("lost: at most {MAX_CHECKS} per call"));
    }
    if request.checks.len() > MAX_CHECKS {
        return Err(format!("checks: at most {MAX_CHECKS} per call"));
    }
    if request.settlements.len() > MAX_CHECKS {
        return Err(format!("settlements: at most {MAX_CHECKS} per call"));
    }
    Ok(())
}

/// What makes one lost ask one to look for; `i` is its place in the call.
/// Its limits are its check's, a renewal's costs of 0 included.
pub fn validate_lost(i: usize, lost: &meshlimit_protocol::LostAsk) -> Result<(), String> {
    validate_limits(&format!("lost[{i}]"), &lost.subject, &lost.limits, 0)?;
    if lost.id == 0 {
        return Err(format!("lost[{i}].id: must not be 0"));
    }
    Ok(())
}

/// What makes one settlement applicable; `i` is its place in the call.
pub fn validate_settlement(i: usize, s: &Settlement) -> Result<(), String> {
    let at = format!("settlements[{i}]");
    validate_limits(&at, &s.subject, &s.limits, 1)?;
    if s.actual.len() != s.limits.len() || s.receipts.len() != s.limits.len() {
        return Err(format!(
            "{at}: one `actual` and one `receipts` entry per limit"
        ));
    }
    for (j, (limit, actual)) in s.limits.iter().zip(&s.actual).enumerate() {
        // A sliding log's settlement adds or removes one member per unit of
        // `actual - cost`: as many as the largest check adds, no more, or
        // one forged settlement holds Redis for seconds. Its reservation
        // was admitted, so it fits the log.
        let log = limit.algorithm == meshlimit_protocol::Algorithm::SlidingWindowLog;
        let most = bounds::max_settled(limit.algorithm);
        if log && limit.cost > limit.requests.min(most) {
            return Err(format!(
                "{at}.limits[{j}].cost: a sliding_window_log reservation holds at most its limit ({})",
                limit.requests.min(most)
            ));
        }
        if *actual > most {
            return Err(format!("{at}.actual[{j}]: at most {most}"));
        }
    }
    for (j, r) in s.receipts.iter().enumerate() {
        if r.nonce.is_empty() || r.nonce.len() > 64 || r.place == 0 {
            return Err(format!("{at}.receipts[{j}]: not a receipt meshlimitd gave"));
        }
    }
    Ok(())
}

/// What makes one check decidable; `i` is its place in the call.
pub fn validate_check(i: usize, check: &Check) -> Result<(), String> {
    // A check that only renews a lease (the filter asks before a lease
    // runs out, for no request) costs 0.
    let min_cost = if check.lease.is_some_and(|l| l.units > 0) {
        0
    } else {
        1
    };
    validate_limits(
        &format!("checks[{i}]"),
        &check.subject,
        &check.limits,
        min_cost,
    )?;
    if let Some(ask) = check.lease {
        if ask.units > bounds::MAX_LEASE_UNITS {
            return Err(format!(
                "checks[{i}].lease.units: at most {}",
                bounds::MAX_LEASE_UNITS
            ));
        }
        if ask.share == 0 || ask.share > bounds::MAX_LEASE_SHARE {
            return Err(format!(
                "checks[{i}].lease.share: must be between 1 and {}",
                bounds::MAX_LEASE_SHARE
            ));
        }
    }
    Ok(())
}

/// A subject and its limits, of the check or settlement at `at`; costs of
/// at least `min_cost`.
fn validate_limits(at: &str, subject: &str, limits: &[Limit], min_cost: u64) -> Result<(), String> {
    if subject.is_empty() {
        return Err(format!("{at}.subject: must not be empty"));
    }
    if subject.len() > MAX_SUBJECT_BYTES {
        return Err(format!("{at}.subject: at most {MAX_SUBJECT_BYTES} bytes"));
    }
    if limits.is_empty() || limits.len() > MAX_LIMITS_PER_CHECK {
        return Err(format!(
            "{at}.limits: must hold 1 to {MAX_LIMITS_PER_CHECK} limits"
        ));
    }
    let outer = at;
    for (j, limit) in limits.iter().enumerate() {
        let at = format!("{outer}.limits[{j}]");
        if !bounds::is_limit_name(&limit.name) {
            return Err(format!(
                "{at}.name: 1 to {} of letters, digits, '-', '_', '.', '/'",
                bounds::MAX_LIMIT_NAME_LEN
            ));
        }
        if let Err(e) = bounds::check_limit(
            limit.requests,
            limit.window_ms,
            limit.algorithm,
            limit.burst,
        ) {
            let field = match e.field {
                LimitField::Requests => "requests",
                LimitField::Window => "window_ms",
                LimitField::Burst => "burst",
            };
            return Err(format!("{at}.{field}: {}", e.problem));
        }
        if let Some(subject) = &limit.subject {
            if subject.is_empty() || subject.len() > MAX_SUBJECT_BYTES {
                return Err(format!("{at}.subject: 1 to {MAX_SUBJECT_BYTES} bytes"));
            }
        }
        if let Some(calendar) = &limit.calendar {
            if limit.algorithm != meshlimit_protocol::Algorithm::FixedWindow {
                return Err(format!("{at}.calendar: only a fixed_window has one"));
            }
            calendar
                .check()
                .map_err(|e| format!("{at}.calendar: {e}"))?;
        }
        if limit.cost < min_cost || limit.cost > bounds::MAX_COST {
            return Err(format!(
                "{at}.cost: must be between {min_cost} and {}",
                bounds::MAX_COST
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshlimit_protocol::{Algorithm, Limit};

    fn request(algorithm: Algorithm, subject: &str, requests: u64) -> CheckRequest {
        CheckRequest {
            checks: vec![Check {
                subject: subject.into(),
                limits: vec![Limit {
                    name: "api/m".into(),
                    requests,
                    window_ms: 1000,
                    algorithm,
                    cost: 1,
                    burst: None,
                    shadow: false,
                    subject: None,
                    calendar: None,
                }],
                receipt: false,
                lease: None,
                trace: None,
                id: 0,
            }],
            settlements: Vec::new(),
            lost: Vec::new(),
        }
    }

    #[test]
    fn valid_requests_pass() {
        assert!(validate(&request(Algorithm::FixedWindow, "s", 1)).is_ok());
    }

    #[test]
    fn bad_values_are_named() {
        let e = validate(&request(Algorithm::FixedWindow, "s", 0)).unwrap_err();
        assert_eq!(e, "checks[0].limits[0].requests: must be at least 1");
        let e = validate(&request(Algorithm::FixedWindow, "", 1)).unwrap_err();
        assert!(e.starts_with("checks[0].subject"));
        let mut burst = request(Algorithm::FixedWindow, "s", 1);
        burst.checks[0].limits[0].burst = Some(3);
        let e = validate(&burst).unwrap_err();
        assert!(e.contains("only token_bucket has a burst"), "{e}");
        assert!(validate(&request(Algorithm::TokenBucket, "s", 1)).is_ok());
        assert!(validate(&CheckRequest {
            checks: vec![],
            settlements: Vec::new(),
            lost: Vec::new(),
        })
        .is_err());
    }
}
