//! The second phase: meshlimitd's answer, or the lack of one, read into
//! [`CheckResult`]s or a [`ServiceError`]. Nothing here knows the host or
//! the configuration: only the call's status and body.

use meshlimit_protocol::{
    CheckOutcome, CheckResponse, CheckResult, Enforcement, ErrorBody, FailureKind,
};

use crate::stats::Stat;

/// Why the service's answer could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceError {
    /// No answer within the configured timeout.
    Timeout,
    /// No connection to any meshlimitd (refused, reset, no healthy host).
    Connection,
    /// meshlimitd answered 503: it cannot reach Redis.
    Unavailable,
    /// Any other non-200 status.
    BadStatus(u32),
    /// 200 with a body that is not a valid answer to our check.
    BadBody(String),
    /// meshlimitd decided the batch but refused this one check (it broke
    /// a rule of the API); the batch's other checks were decided.
    Refused(String),
}

impl ServiceError {
    /// The stat counting failed calls of this kind.
    pub fn stat(&self) -> Stat {
        match self {
            ServiceError::Timeout => Stat::ServiceErrorTimeout,
            ServiceError::Connection => Stat::ServiceErrorConnection,
            ServiceError::Unavailable => Stat::ServiceErrorUnavailable,
            ServiceError::BadStatus(_) => Stat::ServiceErrorBadStatus,
            ServiceError::BadBody(_) => Stat::ServiceErrorBadBody,
            ServiceError::Refused(_) => Stat::ServiceErrorInvalidCheck,
        }
    }

    /// Suffix of the stat counting this kind of error.
    pub fn kind(&self) -> &'static str {
        match self {
            ServiceError::Timeout => "timeout",
            ServiceError::Connection => "connection",
            ServiceError::Unavailable => "unavailable",
            ServiceError::BadStatus(_) => "bad_status",
            ServiceError::BadBody(_) => "bad_body",
            ServiceError::Refused(_) => "invalid_check",
        }
    }
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceError::Timeout => f.write_str("meshlimitd did not answer in time"),
            ServiceError::Connection => f.write_str("could not connect to meshlimitd"),
            ServiceError::Unavailable => f.write_str("meshlimitd cannot reach Redis (503)"),
            ServiceError::BadStatus(s) => write!(f, "meshlimitd answered status {s}"),
            ServiceError::BadBody(why) => write!(f, "meshlimitd sent an unusable body: {why}"),
            ServiceError::Refused(why) => write!(f, "meshlimitd refused the check: {why}"),
        }
    }
}

/// Largest answer body we will parse; anything bigger is not ours.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Reads meshlimitd's answer to a one-check call with `expected_limits`
/// limits. `status` is `None` when Envoy gave no response at all (it calls
/// back with no headers on timeout and reset); `timed_out` tells the two
/// apart from the elapsed time.
pub fn read_answer(
    status: Option<u32>,
    body: Option<&[u8]>,
    expected_limits: usize,
    timed_out: bool,
) -> Result<CheckResult, ServiceError> {
    read_answer_heard(status, body, expected_limits, timed_out).0
}

/// As [`read_answer`], with the fleet-wide switch's state the answer
/// reported, whatever became of the check.
pub fn read_answer_heard(
    status: Option<u32>,
    body: Option<&[u8]>,
    expected_limits: usize,
    timed_out: bool,
) -> (Result<CheckResult, ServiceError>, Option<Enforcement>) {
    match read_batch_answer(status, body, &[expected_limits], 0, timed_out) {
        Ok(mut answer) => (
            answer
                .results
                .pop()
                .ok_or_else(|| ServiceError::BadBody("expected exactly one result".into()))
                .and_then(|r| r),
            answer.enforcement,
        ),
        Err(e) => (Err(e), None),
    }
}

/// The answer to each check of a batch call, and to each settlement.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchAnswer {
    pub results: Vec<Result<CheckResult, ServiceError>>,
    pub settled: Vec<meshlimit_protocol::SettleOutcome>,
    /// The fleet-wide switch's state, when meshlimitd has one.
    pub enforcement: Option<Enforcement>,
}

/// Reads the answer to a batch call: one outcome per check, in order, the
/// i-th decided with `expected_limits[i]` limit statuses, or refused on its
/// own. A failed call, or an answer that does not fit the batch (too few or
/// too many results, a result of the wrong shape), fails every check: its
/// results cannot be matched to checks.
pub fn read_batch_answer(
    status: Option<u32>,
    body: Option<&[u8]>,
    expected_limits: &[usize],
    expected_settlements: usize,
    timed_out: bool,
) -> Result<BatchAnswer, ServiceError> {
    let body = body.unwrap_or_default();
    match status {
        None if timed_out => return Err(ServiceError::Timeout),
        None => return Err(ServiceError::Connection),
        Some(200) => {}
        Some(504) => return Err(ServiceError::Timeout),
        Some(503) => {
            // meshlimitd's own 503 carries a JSON error; Envoy's local reply
            // for a failed connection does not.
            return Err(if serde_json::from_slice::<ErrorBody>(body).is_ok() {
                ServiceError::Unavailable
            } else {
                ServiceError::Connection
            });
        }
        Some(other) => return Err(ServiceError::BadStatus(other)),
    }
    if body.is_empty() {
        return Err(ServiceError::BadBody("empty body".into()));
    }
    let max =
        MAX_ANSWER_BYTES.saturating_mul((expected_limits.len() + expected_settlements).max(1));
    if body.len() > max {
        return Err(ServiceError::BadBody(format!("{} bytes", body.len())));
    }
    let answer: CheckResponse =
        serde_json::from_slice(body).map_err(|e| ServiceError::BadBody(e.to_string()))?;
    if answer.results.len() != expected_limits.len() {
        return Err(ServiceError::BadBody(format!(
            "expected {} result(s), got {}",
            expected_limits.len(),
            answer.results.len()
        )));
    }
    // A meshlimitd that predates settlements answers the checks and
    // leaves them out: the checks' decisions stand, the settlements failed
    // (their reservations stand: over-counted, never over budget).
    let settled = if answer.settled.len() == expected_settlements {
        answer.settled
    } else {
        let failure = meshlimit_protocol::CheckFailure {
            error: format!(
                "expected {expected_settlements} settlement outcome(s), got {}",
                answer.settled.len()
            ),
            kind: FailureKind::Invalid,
        };
        vec![meshlimit_protocol::SettleOutcome::Failed(failure); expected_settlements]
    };
    let mut results = Vec::with_capacity(answer.results.len());
    for (outcome, expected) in answer.results.into_iter().zip(expected_limits) {
        let result = match outcome {
            CheckOutcome::Decided(result) => result,
            CheckOutcome::Failed(failure) => {
                results.push(Err(match failure.kind {
                    FailureKind::Invalid => ServiceError::Refused(failure.error),
                    FailureKind::Unavailable => ServiceError::Unavailable,
                }));
                continue;
            }
        };
        if result.limits.len() != *expected {
            return Err(ServiceError::BadBody(format!(
                "expected {expected} limit statuses, got {}",
                result.limits.len()
            )));
        }
        let enforced_allow = result
            .limits
            .iter()
            .filter(|l| !l.shadow)
            .all(|l| l.allowed);
        if result.allowed != enforced_allow {
            return Err(ServiceError::BadBody(
                "overall decision contradicts the limits".into(),
            ));
        }
        results.push(Ok(result));
    }
    Ok(BatchAnswer {
        results,
        settled,
        enforcement: answer.enforcement,
    })
}
