//! What makes a limit valid, wherever it comes from.
//!
//! The filter checks its configuration with these rules at load (naming the
//! config field), and meshlimitd checks every call with the same rules
//! (naming the field of the call): one home, so a limit the filter accepts
//! is never refused by the service, and the service never trusts a caller
//! to have checked.

use crate::Algorithm;

/// Longest window of any limit: 31 days, enough for a monthly quota, short
/// enough that a typo (`"60d"`) is caught, and every key expires.
pub const MAX_WINDOW_MS: u64 = 31 * 86_400_000;
/// Longest rule or limit name, each; names become part of Redis keys and
/// header values.
pub const MAX_NAME_LEN: usize = 64;
/// Longest qualified limit name (`rule/limit`) in a check call.
pub const MAX_LIMIT_NAME_LEN: usize = 160;
/// Most requests per window of a sliding-log limit: the log keeps one
/// member per admitted unit, and one check's work in Redis (trimming and
/// adding members) must stay short, or every other check waits behind it.
/// Above this, the sliding window counter is as exact as clients can tell,
/// in constant memory.
pub const MAX_SLIDING_LOG_REQUESTS: u64 = 10_000;
/// Most units one request may take from a limit (its cost).
pub const MAX_COST: u64 = 1_000_000;
/// Most units one lease may ask for (returns are settlements, whose units
/// are bounded by [`MAX_COST`]).
pub const MAX_LEASE_UNITS: u64 = MAX_COST;
/// Largest divisor of what remains that a lease may ask for.
pub const MAX_LEASE_SHARE: u64 = 1_000_000;
/// How long meshlimitd keeps a lease grant's record, and the mark of an
/// ask named lost (milliseconds; `GRANT_RECORD_MS` in `decide.lua`): a
/// caller names a lost ask within this, or there is nothing left to name.
pub const GRANT_RECORD_MS: u64 = 10_000;
/// How long meshlimitd remembers the id of a settlement it applied
/// (milliseconds; `SETTLEMENT_ID_MS` in `settle.lua`): the same id again
/// within this changes nothing.
pub const SETTLEMENT_ID_MS: u64 = 60_000;
/// How long a filter sends again a lease return whose call failed
/// (milliseconds): well within [`SETTLEMENT_ID_MS`], so that a first
/// attempt that ran late and a later one never both apply.
pub const RESEND_RETURN_MS: u64 = 10_000;

/// The field of a limit that breaks a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitField {
    Requests,
    Window,
    Burst,
}

/// Why a limit is invalid: the field, and what it must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitProblem {
    pub field: LimitField,
    pub problem: String,
}

fn problem(field: LimitField, problem: impl Into<String>) -> LimitProblem {
    LimitProblem {
        field,
        problem: problem.into(),
    }
}

/// Checks a limit's numbers: at least one request, a window from 1 ms to
/// [`MAX_WINDOW_MS`], and a burst (of at least 1) only on token buckets.
pub fn check_limit(
    requests: u64,
    window_ms: u64,
    algorithm: Algorithm,
    burst: Option<u64>,
) -> Result<(), LimitProblem> {
    if requests == 0 {
        return Err(problem(LimitField::Requests, "must be at least 1"));
    }
    if algorithm == Algorithm::SlidingWindowLog && requests > MAX_SLIDING_LOG_REQUESTS {
        return Err(problem(
            LimitField::Requests,
            format!(
                "a sliding_window_log keeps one entry per request: at most {MAX_SLIDING_LOG_REQUESTS} (use sliding_window_counter for more)"
            ),
        ));
    }
    if window_ms == 0 || window_ms > MAX_WINDOW_MS {
        return Err(problem(LimitField::Window, "must be between 1ms and 31d"));
    }
    match (algorithm, burst) {
        (Algorithm::TokenBucket, Some(0)) => Err(problem(LimitField::Burst, "must be at least 1")),
        (Algorithm::TokenBucket, _) | (_, None) => Ok(()),
        (other, Some(_)) => Err(problem(
            LimitField::Burst,
            format!("only token_bucket has a burst, not {}", other.as_str()),
        )),
    }
}

/// The most units one request can ever take from a limit: the burst of a
/// token bucket (its `requests` when unset), else `requests`.
/// The most units a settlement may say were used on one limit: as many as
/// one check may cost (a sliding log adds a member per unit). The filter
/// settles a larger usage at this bound rather than have meshlimitd refuse
/// the settlement and leave only the reservation charged.
pub fn max_settled(algorithm: Algorithm) -> u64 {
    if algorithm == Algorithm::SlidingWindowLog {
        MAX_SLIDING_LOG_REQUESTS
    } else {
        MAX_COST
    }
}

pub fn capacity(algorithm: Algorithm, requests: u64, burst: Option<u64>) -> u64 {
    match algorithm {
        Algorithm::TokenBucket => burst.unwrap_or(requests),
        _ => requests,
    }
}

/// A rule or limit name: 1 to [`MAX_NAME_LEN`] letters, digits, `-`, `_`, `.`.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// A qualified limit name in a call: 1 to [`MAX_LIMIT_NAME_LEN`] letters,
/// digits, `-`, `_`, `.`, `/`.
pub fn is_limit_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_LIMIT_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_names_its_field() {
        let fw = Algorithm::FixedWindow;
        assert!(check_limit(1, 1, fw, None).is_ok());
        assert!(check_limit(1, MAX_WINDOW_MS, Algorithm::TokenBucket, Some(1)).is_ok());
        let field = |r: Result<(), LimitProblem>| r.unwrap_err().field;
        assert_eq!(field(check_limit(0, 1, fw, None)), LimitField::Requests);
        assert_eq!(field(check_limit(1, 0, fw, None)), LimitField::Window);
        assert_eq!(
            field(check_limit(1, MAX_WINDOW_MS + 1, fw, None)),
            LimitField::Window
        );
        assert_eq!(field(check_limit(1, 1, fw, Some(2))), LimitField::Burst);
        let log = Algorithm::SlidingWindowLog;
        assert!(check_limit(MAX_SLIDING_LOG_REQUESTS, 1, log, None).is_ok());
        assert_eq!(
            field(check_limit(MAX_SLIDING_LOG_REQUESTS + 1, 1, log, None)),
            LimitField::Requests
        );
        assert!(check_limit(MAX_SLIDING_LOG_REQUESTS + 1, 1, fw, None).is_ok());
        assert_eq!(
            field(check_limit(1, 1, Algorithm::TokenBucket, Some(0))),
            LimitField::Burst
        );
    }

    #[test]
    fn names_are_plain() {
        assert!(is_plain_name("per-minute_1.x"));
        assert!(!is_plain_name("a/b") && !is_plain_name("") && !is_plain_name("a b"));
        assert!(!is_plain_name(&"a".repeat(MAX_NAME_LEN + 1)));
        assert!(is_limit_name("api/per-minute"));
        assert!(!is_limit_name("api:m") && !is_limit_name(""));
        // The longest qualified name the filter can build fits a call.
        let longest = format!("{}/{}", "a".repeat(MAX_NAME_LEN), "b".repeat(MAX_NAME_LEN));
        assert!(is_limit_name(&longest));
    }
}
