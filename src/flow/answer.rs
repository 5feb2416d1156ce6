//! What happens when a call comes back (or fails): the breaker is told once
//! per call, each check gets its verdict from meshlimitd's answer or, when
//! there is none, from `failure_mode`.

use log::warn;
use meshlimit_protocol::CheckResult;

use super::decision_log::Source;
use super::metrics::Tally;
use super::rule_stats::Event;
use super::{with_local, Job, Queued, Step, Stream, Worker};
use crate::check::{Applied, Check};
use crate::config::FailureMode;
use crate::decision::{self, BatchAnswer, ServiceError, Verdict};
use crate::host::Host;

/// Whether a call that carried a lease ask may have had it granted with
/// no answer to show for it: it timed out, meshlimitd answered 503 (its
/// script may still run), or the connection failed (perhaps after the
/// call went out).
fn asked_and_lost<T>(outcome: &Result<T, ServiceError>) -> bool {
    matches!(
        outcome,
        Err(ServiceError::Timeout | ServiceError::Unavailable | ServiceError::Connection)
    )
}
use crate::stats::Stat;

impl Worker {
    /// The stream's own call came back (`headers` is the number of response
    /// headers Envoy reports: 0 after a timeout or reset).
    pub fn on_call_answer(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        headers: usize,
        body_size: usize,
    ) -> Step {
        let Some(in_flight) = stream.in_flight.take() else {
            return Step::Pause;
        };
        let (status, body) = read_call_response(host, headers, body_size, 1);
        let now = host.now_ms();
        let timed_out = self.timed_out(in_flight.started_ms, now);
        let (outcome, enforcement) = decision::read_answer_heard(
            status,
            body.as_deref(),
            in_flight.check.global.len(),
            timed_out,
        );
        self.fleet_switch.hear(host, now, enforcement);
        self.report_call(host, outcome.as_ref().err(), now);
        self.heard(host, &in_flight.check, &outcome, now);
        if outcome.is_ok() {
            self.send_lost(host, stream.context_id, now);
            self.resend_returns(host, stream.context_id);
        }
        self.conclude(
            host,
            stream,
            now,
            &in_flight.check,
            in_flight.local.as_ref(),
            outcome,
        )
    }

    /// The step for a stream's own check once its outcome is known (the
    /// breaker already told).
    pub(super) fn conclude(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        now: u64,
        check: &Check,
        local: Option<&CheckResult>,
        outcome: Result<CheckResult, ServiceError>,
    ) -> Step {
        let verdict = self.verdict_after_call(
            host,
            &mut Tally::new(&self.metrics, host),
            now,
            (stream.context_id, check, local),
            outcome,
        );
        stream.apply(verdict)
    }

    /// A batch call the root sent came back: every stream in it is resumed
    /// or answered.
    pub fn on_batch_answer(&self, host: &impl Host, token: u32, headers: usize, body_size: usize) {
        let Some((batch, started)) = self.outbox.answered(token) else {
            return;
        };
        let expected: Vec<usize> = batch
            .iter()
            .filter_map(|q| Some(q.check()?.global.len()))
            .collect();
        let settlements: usize = batch.iter().map(|q| q.settlements().len()).sum();
        let (status, body) = read_call_response(host, headers, body_size, batch.len());
        let now = host.now_ms();
        let timed_out = self.timed_out(started, now);
        let answers =
            decision::read_batch_answer(status, body.as_deref(), &expected, settlements, timed_out);
        self.report_call(host, answers.as_ref().err(), now);
        if let Ok(answer) = &answers {
            self.fleet_switch.hear(host, now, answer.enforcement);
            self.send_lost(host, self.root_context_id, now);
            self.resend_returns(host, self.root_context_id);
        }
        // The checks that queued meanwhile go out before this batch's
        // streams are resumed: meshlimitd and Redis work on the next batch
        // while this worker forwards the admitted requests, instead of
        // waiting for it to finish.
        self.flush(host, now);
        self.settle_batch(host, now, &batch, answers);
        // The next return call, once this one is answered.
        self.pump_returns(host, self.root_context_id, false);
        self.finish_closing(host, false);
    }

    /// Decides every check of a batch from the call's answer (or its
    /// failure, which every check shares) and acts for its stream.
    pub(super) fn settle_batch(
        &self,
        host: &impl Host,
        now: u64,
        batch: &[Queued],
        answers: Result<BatchAnswer, ServiceError>,
    ) {
        let mut tally = Tally::new(&self.metrics, host);
        let (mut checks, mut settled) = (0, 0);
        for queued in batch {
            if let Job::Lost { asks } = &queued.job {
                // Nothing is answered for them; a call that failed names
                // them again once one succeeds.
                if answers.is_err() {
                    self.lease_book.note_lost(asks.iter().cloned(), now);
                }
                continue;
            }
            if let Job::Settle { settlements } | Job::Return { settlements } = &queued.job {
                let outcomes = match &answers {
                    Ok(answer) => Ok(answer
                        .settled
                        .get(settled..settled + settlements.len())
                        .unwrap_or_default()
                        .to_vec()),
                    Err(e) => Err(e.clone()),
                };
                settled += settlements.len();
                if matches!(queued.job, Job::Return { .. }) {
                    self.on_returned(host, settlements, outcomes);
                } else {
                    self.on_settled(host, queued.context_id, outcomes);
                }
                continue;
            }
            // Each check has its own outcome: one refused check (or one
            // on a Redis node that failed) changes no other's decision.
            let outcome = match &answers {
                Ok(answer) => answer
                    .results
                    .get(checks)
                    .cloned()
                    .unwrap_or_else(|| Err(ServiceError::BadBody("missing result".into()))),
                Err(e) => Err(e.clone()),
            };
            checks += 1;
            if let Some(check) = queued.check() {
                self.heard(host, check, &outcome, now);
            }
            match &queued.job {
                Job::Admit { check, .. }
                    if !self.awaiting.borrow_mut().remove(&queued.context_id) =>
                {
                    // The stream ended while its check was out (a client
                    // reset, or an upstream that answered before the
                    // request's body was in): nothing to act on, and a
                    // reservation made for it is given back.
                    if let Ok(mut result) = outcome {
                        // Counted: meshlimitd charged it.
                        tally.decided(result.allowed);
                        self.rule_stats.result(host, &check.global, &result, false);
                        self.give_back(host, queued.context_id, check, &result);
                        // A lease granted with it serves the next requests.
                        self.install_lease(host, now, queued.context_id, check, &mut result);
                    }
                }
                Job::Admit { check, local, .. } => {
                    let verdict = self.verdict_after_call(
                        host,
                        &mut tally,
                        now,
                        (queued.context_id, check, local.as_ref()),
                        outcome,
                    );
                    self.act_for(host, queued.context_id, verdict);
                }
                Job::TopUp { check } => self.on_top_up(host, queued.context_id, check, outcome),
                Job::Renew { check } => {
                    // No request waits: only its grant matters (installed
                    // as the root, whose answer this is).
                    match outcome {
                        Ok(mut result) if result.allowed => {
                            self.install_lease(host, now, self.root_context_id, check, &mut result);
                        }
                        Ok(_) => self.end_lease(host, now, check),
                        Err(_) => {}
                    }
                }
                Job::Settle { .. } | Job::Return { .. } | Job::Lost { .. } => {}
            }
        }
    }

    /// What a check's call came to, for what it asked: a lost answer is
    /// counted (the check may have been charged while its request was
    /// decided without meshlimitd), and a lease ask or a reservation in it
    /// is named lost later; asks shrink after lost answers.
    fn heard<T>(
        &self,
        host: &impl Host,
        check: &Check,
        outcome: &Result<T, ServiceError>,
        now: u64,
    ) {
        let asked = check.lease.is_some_and(|t| t.want > 0);
        if asked {
            self.lease_book.asks.answered(outcome);
        }
        if asked_and_lost(outcome) {
            self.metrics.bump(host, Stat::AnswersLost);
            if asked || check.id != 0 {
                self.ask_lost(host, check, now);
            }
        }
    }

    /// Tells the breaker how a call went (once per call, not per check),
    /// and the lease asks that an answered one may grow back.
    fn report_call(&self, host: &impl Host, error: Option<&ServiceError>, now: u64) {
        match error {
            None => {
                self.guard.record_call(host, &self.metrics, true, now);
                self.lease_book.asks.call_answered();
            }
            Some(e) if trips_breaker(e) => self.guard.record_call(host, &self.metrics, false, now),
            Some(_) => {}
        }
    }

    /// Envoy's timer and the wall clock we read can disagree by a
    /// millisecond or two: no answer after 90% of the timeout is a timeout.
    fn timed_out(&self, started_ms: u64, now: u64) -> bool {
        now.saturating_sub(started_ms) * 10 >= self.config.service.timeout_ms * 9
    }

    /// What a request gets once its call was answered, or failed. The
    /// caller has already told the breaker.
    pub(super) fn verdict_after_call(
        &self,
        host: &impl Host,
        tally: &mut Tally<'_, impl Host>,
        now: u64,
        (context_id, check, local): (u32, &Check, Option<&CheckResult>),
        outcome: Result<CheckResult, ServiceError>,
    ) -> Verdict {
        let (decided, place) = match outcome {
            Ok(mut result) => {
                tally.decided(result.allowed);
                self.rule_stats.result(host, &check.global, &result, false);
                self.decision_log
                    .result(now, Source::Call, &check.global, &result);
                self.install_lease(host, now, context_id, check, &mut result);
                self.count_leased_units(host, now, check, &mut result);
                if super::lease_ends::refused_below_its_configured_limit(check, &result) {
                    self.end_lease(host, now, check);
                }
                self.guard
                    .count_shadow(host, &self.metrics, now, &check.global, &result);
                if let Some(cache) = self.guard.deny_cache(host, now) {
                    let evicted = decision::remember_denials(check, &result, &cache, now);
                    self.metrics.add(host, Stat::DenyCacheEvictions, evicted);
                }
                let place = super::budget::global_place(check, &result);
                (result, place)
            }
            Err(e) => match self.fallback(host, now, check, Some(&e)) {
                Ok(result) => {
                    let place = self.fallback_place(now);
                    (result, place)
                }
                Err(verdict) => return verdict,
            },
        };
        let verdict = with_local(&self.config, check, local, &decided);
        self.on_admitted(host, context_id, check, &decided, &verdict, place);
        verdict
    }

    /// Decides the global limits without meshlimitd, as `failure_mode`
    /// says, and says so in the stats and (at most once per interval) in
    /// the log. `why` is the failed call, or `None` when the open breaker
    /// skipped the call. A decided result, or for `failure_mode: deny` the
    /// configured deny.
    pub(super) fn fallback(
        &self,
        host: &impl Host,
        now: u64,
        check: &Check,
        why: Option<&ServiceError>,
    ) -> Result<CheckResult, Verdict> {
        if let Some(e) = why {
            self.metrics.bump(host, e.stat());
        }
        let config = &self.config;
        let decided = match config.failure_mode {
            FailureMode::Allow => Ok(CheckResult {
                allowed: true,
                limits: Vec::new(),
                receipts: None,
                leased: 0,
            }),
            // The fleet is in shadow: nothing is refused, failing or not.
            FailureMode::Deny if self.fleet_switch.shadow(host, now) => Ok(CheckResult {
                allowed: true,
                limits: Vec::new(),
                receipts: None,
                leased: 0,
            }),
            FailureMode::Deny => Err(decision::failure_deny(config)),
            FailureMode::Local => {
                // Each Envoy enforces its share of the global limit.
                let scaled: Vec<Applied> = check.global.iter().map(Applied::for_fallback).collect();
                let mut decided = self
                    .guard
                    .local_limiter(host, now)
                    .check(host, &scaled, now);
                self.fleet_switch.obey(host, now, &mut decided.result);
                if decided.degraded {
                    self.metrics.bump(host, Stat::FallbackUncounted);
                }
                self.guard
                    .count_shadow(host, &self.metrics, now, &scaled, &decided.result);
                self.rule_stats.result(host, &scaled, &decided.result, true);
                self.decision_log
                    .result(now, Source::Fallback, &scaled, &decided.result);
                // The headers' policy stays the global one (what remains
                // is this Envoy's share).
                for (status, applied) in decided.result.limits.iter_mut().zip(&check.global) {
                    status.limit = applied.limit.requests;
                }
                Ok(decided.result)
            }
        };
        let allowed = matches!(&decided, Ok(r) if r.allowed);
        if config.failure_mode != FailureMode::Local {
            // No counter decided: every limit was decided by the mode.
            for applied in &check.global {
                self.rule_stats.count(host, applied, Event::Fallback);
                if allowed {
                    self.rule_stats.count(host, applied, Event::Allowed);
                }
            }
            self.decision_log
                .uncounted(now, Source::Fallback, &check.global, allowed, None);
        }
        self.metrics.bump(
            host,
            if allowed {
                Stat::FallbackAllowed
            } else {
                Stat::FallbackDenied
            },
        );
        if let Some(skipped) = self.fallback_log.allow(now) {
            let why = why.map_or_else(|| "breaker open".to_string(), ToString::to_string);
            warn!(
                "{why}; deciding by failure_mode {:?} (this one: {}; {skipped} fallback decisions since the last line)",
                config.failure_mode,
                if allowed { "allowed" } else { "denied" }
            );
        }
        decided
    }
}

/// Whether a failed call says meshlimitd is unhealthy. A 4xx says our
/// request was wrong, which no amount of waiting fixes.
fn trips_breaker(e: &ServiceError) -> bool {
    !matches!(e, ServiceError::BadStatus(s) if *s < 500)
}

/// The status and body of the answered call's response. No headers: the
/// call failed (timeout or reset) and Envoy has no response to read; asking
/// for one anyway would be an error status.
fn read_call_response(
    host: &impl Host,
    headers: usize,
    body_size: usize,
    checks: usize,
) -> (Option<u32>, Option<Vec<u8>>) {
    let status = if headers > 0 {
        host.call_response_header(":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok())
    } else {
        None
    };
    // Read one byte more than we accept, so an oversized body is seen as
    // oversized rather than as truncated JSON.
    let max = decision::MAX_ANSWER_BYTES.saturating_mul(checks.max(1)) + 1;
    let body = if status.is_some() && body_size > 0 {
        host.call_response_body(body_size.min(max))
    } else {
        None
    };
    (status, body)
}
