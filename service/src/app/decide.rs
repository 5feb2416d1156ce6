//! How a call is decided: its checks (each on its own and atomically, a
//! batch's sharing script runs) and its settlements (each on its own),
//! one check's failure never costing another its decision.

use meshlimit_protocol::{
    Check, CheckFailure, CheckOutcome, CheckRequest, CheckResponse, CheckResult, FailureKind,
    SettleOutcome, Settlement,
};
use tracing::{debug, warn};

use super::validate::{validate_batch, validate_check, validate_settlement};
use super::AppState;
use crate::limiter::LimiterError;
use crate::traces::CheckSpan;

/// What a whole call comes to.
pub enum Decided {
    /// Its checks decided and its settlements applied (some may carry
    /// their own errors).
    Answered(CheckResponse),
    /// The call is the caller's mistake (400), with the reason.
    Refused(String),
    /// Redis could decide nothing now (503: the caller falls back).
    Unavailable(String),
}

/// Decides a call: its bounds, then its checks and settlements.
pub async fn decide_call(state: &AppState, request: &CheckRequest) -> Decided {
    if let Err(reason) = validate_batch(request) {
        return Decided::Refused(reason);
    }
    if !request.lost.is_empty() {
        // Nothing is answered for them: they go back beside the call.
        let (state, lost) = (state.clone(), request.lost.clone());
        tokio::spawn(async move { super::give_back::forget_all(&state, &lost).await });
    }
    if request.checks.is_empty() && request.settlements.is_empty() {
        return Decided::Answered(CheckResponse {
            results: Vec::new(),
            settled: Vec::new(),
            enforcement: state.fleet.reported(),
        });
    }
    if request.settlements.is_empty() {
        return match decide_checks(state, &request.checks).await {
            Answer::Decided(results) => Decided::Answered(CheckResponse {
                results,
                settled: Vec::new(),
                enforcement: state.fleet.reported(),
            }),
            Answer::Refused(reason) => Decided::Refused(reason),
            Answer::Unavailable(e) => Decided::Unavailable(e),
        };
    }
    // With settlements, the call is answered whatever became of its
    // checks: a settlement applied must be reported, so checks that could
    // not be decided get their own errors instead of failing the call.
    let (checks, settled) = tokio::join!(
        async {
            if request.checks.is_empty() {
                return Answer::Decided(Vec::new());
            }
            decide_checks(state, &request.checks).await
        },
        settle_all(state, &request.settlements)
    );
    let failed = |error: String, kind: FailureKind| {
        request
            .checks
            .iter()
            .map(|_| {
                CheckOutcome::Failed(CheckFailure {
                    error: error.clone(),
                    kind,
                })
            })
            .collect()
    };
    let results = match checks {
        Answer::Decided(results) => results,
        Answer::Refused(reason) => failed(reason, FailureKind::Invalid),
        Answer::Unavailable(e) => failed(e, FailureKind::Unavailable),
    };
    Decided::Answered(CheckResponse {
        results,
        settled,
        enforcement: state.fleet.reported(),
    })
}

/// What became of a call's checks.
pub enum Answer {
    Decided(Vec<CheckOutcome>),
    /// No check was valid: the caller's mistake (400).
    Refused(String),
    /// Redis could decide none of them (503: the caller falls back).
    Unavailable(String),
}

/// Applies each settlement on its own (an invalid one, or one whose Redis
/// node fails, gets its own error).
pub async fn settle_all(state: &AppState, settlements: &[Settlement]) -> Vec<SettleOutcome> {
    futures_util::future::join_all(settlements.iter().enumerate().map(|(i, s)| async move {
        if let Err(reason) = validate_settlement(i, s) {
            state.metrics.check_failure("invalid");
            return SettleOutcome::Failed(CheckFailure {
                error: reason,
                kind: FailureKind::Invalid,
            });
        }
        if let Some(Err(forged)) = state.receipt_key.as_ref().map(|k| k.verify(s)) {
            state.metrics.check_failure("forged");
            if let Some(suppressed) = state.error_log.allow() {
                warn!(%forged, suppressed, "refused a settlement whose receipts this fleet did not sign");
            }
            return SettleOutcome::Failed(CheckFailure {
                error: format!("settlements[{i}].{forged}"),
                kind: FailureKind::Invalid,
            });
        }
        match state.limiter.settle(s).await {
            Ok(remaining) => SettleOutcome::Settled { remaining },
            Err(e) => {
                state.metrics.check_failure("unavailable");
                SettleOutcome::Failed(CheckFailure {
                    error: e.to_string(),
                    kind: FailureKind::Unavailable,
                })
            }
        }
    }))
    .await
}

pub async fn decide_checks(state: &AppState, checks: &[Check]) -> Answer {
    // The fleet is in shadow: every limit decided, none refusing.
    let shadowed;
    let checks = if state.fleet.shadow() {
        shadowed = crate::fleet::shadowed(checks);
        &shadowed[..]
    } else {
        checks
    };
    // One check's bad input must not cost the others their decision: an
    // invalid check gets its own error in the answer. Only a call with no
    // valid check at all is the caller's mistake as a whole.
    let checked: Vec<Result<&Check, String>> = checks
        .iter()
        .enumerate()
        .map(|(i, check)| validate_check(i, check).map(|()| check))
        .collect();
    // Usually every check is valid: decide them as they came, uncopied.
    let some_invalid: Vec<Check>;
    let valid: &[Check] = if checked.iter().all(Result::is_ok) {
        checks
    } else {
        some_invalid = checked
            .iter()
            .filter_map(|c| c.as_ref().ok().map(|c| (*c).clone()))
            .collect();
        &some_invalid
    };
    if valid.is_empty() {
        let first = checked
            .into_iter()
            .find_map(Result::err)
            .unwrap_or_default();
        return Answer::Refused(first);
    }
    // Each check is decided on its own and atomically; a batch's checks
    // share script runs (one per Redis node), pipelined.
    let (started, clock) = (std::time::SystemTime::now(), std::time::Instant::now());
    let decided: Vec<Result<CheckResult, LimiterError>> = if let [one] = valid {
        vec![state.limiter.check(one).await]
    } else {
        state.limiter.prepare_batch().await;
        state.limiter.check_batch(valid).await
    };
    let scripts = clock.elapsed();
    if decided.iter().all(Result::is_err) {
        // Redis cannot decide anything now: the caller falls back (and its
        // breaker learns that meshlimitd is of no use for the moment).
        let e = decided
            .into_iter()
            .find_map(Result::err)
            .map_or_else(|| "not decided".to_string(), |e| e.to_string());
        if let Some(suppressed) = state.error_log.allow() {
            warn!(error = %e, suppressed, "cannot decide: answering 503 so the caller falls back");
        }
        return Answer::Unavailable(e);
    }
    let mut decided = decided.into_iter();
    let mut results = Vec::with_capacity(checked.len());
    for check in checked {
        let decided_check = check.as_ref().ok().copied();
        let outcome = match check {
            Err(reason) => refused(state, reason),
            Ok(check) => decided_outcome(state, check, decided.next()),
        };
        if let (Some(traces), Some(check)) = (&state.traces, decided_check) {
            traces.record(&CheckSpan {
                check,
                outcome: &outcome,
                started,
                scripts,
                batch: checks.len(),
            });
        }
        results.push(outcome);
    }
    debug!(checks = results.len(), "decided");
    Answer::Decided(results)
}

/// A check of a batch refused on its own (the others are decided).
fn refused(state: &AppState, reason: String) -> CheckOutcome {
    state.metrics.check_failure("invalid");
    if let Some(suppressed) = state.error_log.allow() {
        warn!(%reason, suppressed, "refused one check of a batch; the others are decided");
    }
    CheckOutcome::Failed(CheckFailure {
        error: reason,
        kind: FailureKind::Invalid,
    })
}

/// What a valid check comes to, from its script run's result, counted.
fn decided_outcome(
    state: &AppState,
    check: &Check,
    decided: Option<Result<CheckResult, LimiterError>>,
) -> CheckOutcome {
    match decided {
        Some(Ok(mut result)) => {
            if let Some(key) = state
                .receipt_key
                .as_ref()
                .filter(|_| super::receipts::for_the_caller(check, &result))
            {
                key.sign(check, &mut result);
            }
            if state.admin_tokens.is_some() {
                state.seen.note(check.limits.iter());
            }
            state.metrics.decision(result.allowed);
            let names = check.limits.iter().map(|l| l.name.as_str());
            state
                .metrics
                .limit_decisions(names.zip(&result.limits), result.allowed);
            CheckOutcome::Decided(result)
        }
        Some(Err(e)) => {
            // Its Redis node failed; the others were decided.
            state.metrics.check_failure("unavailable");
            if let Some(suppressed) = state.error_log.allow() {
                warn!(error = %e, suppressed, "cannot decide some checks of a batch: answering an error for them alone");
            }
            CheckOutcome::Failed(CheckFailure {
                error: e.to_string(),
                kind: FailureKind::Unavailable,
            })
        }
        None => CheckOutcome::Failed(CheckFailure {
            error: "not decided".into(),
            kind: FailureKind::Unavailable,
        }),
    }
}
