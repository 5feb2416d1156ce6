//! Settling token budgets: a reservation made for a request that is gone
//! is given back; a finished response is charged what it used (the
//! difference from its reservation, charged or refunded by meshlimitd in
//! the very counters it was reserved in, or in the local ones); what the
//! response held for the settlement then goes on.

use super::rule_stats::Event;
use log::warn;
use meshlimit_protocol::{CheckResult, LimitStatus, SettleOutcome};

use super::budget::{global_place, Budget, Held, Response};
use super::{Job, Worker};
use crate::check::{Applied, Check};
use crate::decision::ServiceError;
use crate::headers::{self, Headers};
use crate::host::Host;
use crate::stats::Stat;
use crate::tokens::budget::Place;
use crate::tokens::sse::CUT_EVENTS;

impl Worker {
    /// Gives back what an admitted token-priced check reserved for a
    /// stream that is gone.
    pub(super) fn give_back(&self, host: &impl Host, id: u32, check: &Check, result: &CheckResult) {
        let Some(Place::Global(receipts)) = global_place(check, result) else {
            return;
        };
        if !result.allowed {
            return;
        }
        self.metrics
            .add(host, Stat::TokensRefunded, check.reserved() as usize);
        self.rule_stats
            .tokens(host, &check.global, Event::TokensRefunded, check.reserved());
        let settlement = check.settlement(check.reserved(), 0, &receipts);
        let job = Job::Settle {
            settlements: vec![settlement],
        };
        if let Err(e) = self.send_job(host, id, job) {
            self.settlement_failed(host, &e.to_string());
        }
    }

    /// The stream ended while events waited for a top-up: pass what now
    /// fits, cut what does not, settle, and let the response end.
    pub(super) fn finish_held(&self, host: &impl Host, id: u32, b: &mut Budget) {
        let Response::Sse(mut gate) = std::mem::replace(&mut b.response, Response::Done) else {
            return;
        };
        let passed = gate.finish(b.room(gate.deltas));
        let mut out = passed.bytes;
        if passed.blocked && !b.exhausted {
            let step = b.step;
            self.top_up(host, id, b, step);
        }
        if passed.blocked && b.exhausted {
            out.extend_from_slice(CUT_EVENTS);
            host.append_response_body(&out);
            self.cut(host, id, b, &mut gate);
            b.held = Held::No;
            host.resume_response();
            return;
        }
        host.append_response_body(&out);
        if passed.blocked {
            // Another top-up is out.
            b.response = Response::Sse(gate);
            return;
        }
        let actual = gate.usage.unwrap_or_else(|| b.unreported(gate.deltas));
        if !self.settle(host, id, b, actual) {
            b.held = Held::No;
            host.resume_response();
        }
    }

    /// Settles every reservation of `b` for `actual` units used: those
    /// meshlimitd charged in one job, those the fallback charged at once.
    /// True when a settlement is out (its answer resumes what is held).
    pub(super) fn settle(&self, host: &impl Host, id: u32, b: &mut Budget, actual: u64) -> bool {
        b.response = Response::Done;
        let reserved = b.ledger.reserved();
        self.metrics.add(host, Stat::TokensSettled, actual as usize);
        self.metrics.add(
            host,
            Stat::TokensRefunded,
            reserved.saturating_sub(actual) as usize,
        );
        let limits = &b.check.global;
        self.rule_stats
            .tokens(host, limits, Event::TokensSettled, actual);
        self.rule_stats.tokens(
            host,
            limits,
            Event::TokensRefunded,
            reserved.saturating_sub(actual),
        );
        let now = host.now_ms();
        let shares = b.ledger.split(actual);
        let mut settlements = Vec::new();
        for (r, share) in std::mem::take(&mut b.ledger.reservations)
            .iter()
            .zip(shares)
        {
            match &r.place {
                Place::Global(receipts) => {
                    settlements.push(b.check.settlement(r.units, share, receipts));
                }
                Place::Local { at_ms } => {
                    let limits: Vec<Applied> = b
                        .check
                        .token_limits()
                        .map(|a| Applied {
                            cost: r.units,
                            ..a.for_fallback()
                        })
                        .collect();
                    self.guard
                        .local_limiter(host, now)
                        .settle(host, &limits, share, *at_ms, now);
                }
                Place::Unrecorded => {}
            }
        }
        if settlements.is_empty() {
            return false;
        }
        match self.send_job(host, id, Job::Settle { settlements }) {
            Ok(()) => true,
            Err(e) => {
                self.settlement_failed(host, &e.to_string());
                false
            }
        }
    }

    pub(super) fn settlement_failed(&self, host: &impl Host, why: &str) {
        self.metrics.bump(host, Stat::SettlementsFailed);
        if let Some(skipped) = self.error_log.allow(host.now_ms()) {
            warn!(
                "cannot settle a token reservation ({why}); it stands, so the budget is not exceeded ({skipped} similar lines suppressed)"
            );
        }
    }

    /// meshlimitd answered a stream's settlements (or their call failed):
    /// what the stream held goes on.
    pub(super) fn on_settled(
        &self,
        host: &impl Host,
        id: u32,
        outcomes: Result<Vec<SettleOutcome>, ServiceError>,
    ) {
        let remaining = match &outcomes {
            Err(e) => {
                self.settlement_failed(host, &e.to_string());
                None
            }
            Ok(list) => {
                for outcome in list {
                    if let SettleOutcome::Failed(f) = outcome {
                        self.settlement_failed(host, &f.error);
                    }
                }
                list.iter().rev().find_map(|o| match o {
                    SettleOutcome::Settled { remaining } => Some(remaining.clone()),
                    SettleOutcome::Failed(_) => None,
                })
            }
        };
        let Some(mut b) = self.budgets.borrow_mut().remove(&id) else {
            return;
        };
        let held = std::mem::replace(&mut b.held, Held::No);
        if held != Held::No && host.set_effective_context(id) {
            if held == Held::Headers {
                let headers = match remaining {
                    Some(left) => self.settled_headers(&b, &left),
                    None => std::mem::take(&mut b.held_headers),
                };
                for (name, value) in headers {
                    host.add_response_header(name, &value);
                }
            }
            host.resume_response();
        }
        self.budgets.borrow_mut().insert(id, b);
    }

    /// The RateLimit headers for the token-priced limits after settlement.
    pub(super) fn settled_headers(&self, b: &Budget, remaining: &[u64]) -> Headers {
        let limits: Vec<Applied> = b.check.token_limits().cloned().collect();
        let result = CheckResult {
            allowed: true,
            limits: b
                .statuses
                .iter()
                .zip(remaining)
                .map(|(s, left)| LimitStatus {
                    remaining: *left,
                    ..s.clone()
                })
                .collect(),
            receipts: None,
            leased: 0,
        };
        if result.limits.len() != limits.len() {
            return b.held_headers.clone();
        }
        headers::rate_limit_headers(self.config.response.headers, &limits, &result)
    }

    /// The stream is gone: a reservation not settled yet is settled as the
    /// request got (no response: refunded, if so configured; an event
    /// stream: its usage if seen, else the reservation).
    pub(super) fn on_stream_gone(&self, host: &impl Host, id: u32) {
        let Some(mut b) = self.budgets.borrow_mut().remove(&id) else {
            return;
        };
        let refund = b.cost().is_some_and(|c| c.refund_on_error);
        let actual = match std::mem::replace(&mut b.response, Response::Done) {
            Response::Done | Response::Cut => return,
            Response::NotYet if refund => 0,
            Response::NotYet | Response::Json(_) => b.unreported(0),
            Response::Sse(gate) => gate.usage.unwrap_or_else(|| b.unreported(gate.deltas)),
        };
        self.settle(host, id, &mut b, actual);
    }
}
