//! Token budgets on the request path: reserve before the request goes
//! upstream, follow the response, settle when it ends (see
//! `docs/tokens.md` and [`crate::tokens`] for the pure parts).
//!
//! A token-priced request's check carries its reservation as its cost and
//! asks for receipts. Once admitted, the stream gets a [`Budget`], kept
//! by the worker (the root's answers update it too). The response is
//! never paused while it streams: an event stream's events pass as they
//! come, and only the events that would exceed the reservation wait for
//! a top-up; the response's end (or, with usage in a header, its headers)
//! waits for the settlement, so the next request sees the units freed.

use super::rule_stats::Event;
use log::info;
use meshlimit_protocol::CheckResult;

use super::budget::{global_place, Budget, Held, Response};
use super::{Job, Queue, Queued, Step, Stream, Worker};
use crate::check::Check;
use crate::config::FailureMode;
use crate::decision::{self, ServiceError, Verdict};
use crate::headers::Headers;
use crate::host::Host;
use crate::stats::Stat;
use crate::tokens::budget::{Ledger, Place, Reservation};
use crate::tokens::sse::{SseGate, CUT_EVENTS};

/// The fewest units a top-up asks for: a stream reserving 1 (mode
/// `after`'s unit, or a small `max_tokens`) that keeps producing would
/// otherwise call meshlimitd once per token. What a top-up does not use is
/// given back with the settlement; when a whole one no longer fits, the
/// stream takes what is left.
const MIN_TOP_UP: u64 = 64;

impl Worker {
    /// Where a fallback decision charged (nowhere with `failure_mode:
    /// allow`).
    pub(super) fn fallback_place(&self, now: u64) -> Option<Place> {
        (self.config.failure_mode == FailureMode::Local).then_some(Place::Local { at_ms: now })
    }

    /// A check was decided: an admitted token-priced request gets its
    /// budget.
    pub(super) fn on_admitted(
        &self,
        host: &impl Host,
        context_id: u32,
        check: &Check,
        result: &CheckResult,
        verdict: &Verdict,
        place: Option<Place>,
    ) {
        if check.tokens.is_none() || !matches!(verdict, Verdict::Allow { .. }) {
            return;
        }
        let units = check.reserved();
        self.metrics.add(host, Stat::TokensReserved, units as usize);
        self.rule_stats
            .tokens(host, &check.global, Event::TokensReserved, units);
        let statuses = check
            .global
            .iter()
            .zip(&result.limits)
            .filter(|(a, _)| a.tokens)
            .map(|(_, s)| s.clone())
            .collect();
        let ledger = Ledger {
            reservations: vec![Reservation {
                units,
                place: place.unwrap_or(Place::Unrecorded),
            }],
        };
        self.budgets.borrow_mut().insert(
            context_id,
            Budget {
                check: check.clone(),
                ledger,
                // A stream that outgrows a small reservation tops up in
                // chunks, not a script run per token.
                step: units.max(MIN_TOP_UP),
                statuses,
                response: Response::NotYet,
                topping_up: false,
                exhausted: false,
                unbounded: false,
                held: Held::No,
                held_headers: Vec::new(),
                body_left: None,
            },
        );
    }

    /// A chunk of the request body: a reservation read from the body is
    /// decided once it is all in (or past `max_body_bytes`).
    pub fn on_request_body(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        size: usize,
        end_of_stream: bool,
    ) -> Step {
        self.hold.body_came(stream.context_id);
        let Some(max) = stream
            .awaiting_body
            .as_ref()
            .and_then(|c| c.reserves_from_body())
            .map(|t| t.max_body_bytes)
        else {
            return Step::Continue;
        };
        if !end_of_stream && size <= max {
            // Envoy buffers it; the upstream sees none of it yet.
            return Step::Pause;
        }
        let Some(check) = stream.awaiting_body.take() else {
            return Step::Continue;
        };
        let body = (size <= max).then(|| host.request_body(size)).flatten();
        self.decide_with_body(host, stream, *check, body.as_deref(), size)
    }

    /// Decides a check whose reservation (and body fields) are read from
    /// the request's `body` (`None`: none, or past `max_body_bytes`) of
    /// `size` bytes.
    #[inline(never)]
    pub(super) fn decide_with_body(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        mut check: Check,
        body: Option<&[u8]>,
        size: usize,
    ) -> Step {
        match decision::reserve_from_body(&self.config, &mut check, body, size) {
            Ok(skipped) => {
                self.metrics
                    .add(host, Stat::SkippedMissingAttribute, skipped as usize);
            }
            Err((deny, why)) => {
                self.metrics.bump(
                    host,
                    match why {
                        decision::RejectReason::MissingAttribute => Stat::RejectedMissingAttribute,
                        _ => Stat::RejectedCostAboveCapacity,
                    },
                );
                return Step::Reply(deny);
            }
        }
        if check.global.is_empty() && check.local.is_empty() {
            // Every limit lacked the body field it counts by.
            return Step::Continue;
        }
        if let Some(asked) = check
            .reserves_from_body()
            .filter(|t| t.asks_stream_usage())
            .and(body)
            .and_then(crate::tokens::json::asking_stream_usage)
        {
            // Without it the model reports no usage for the stream, and
            // the stream would be charged an estimate.
            if host.replace_request_body(size, &asked) {
                check.usage_asked_for_client = true;
                self.metrics.bump(host, Stat::StreamUsageAsked);
            }
        }
        self.decide(host, stream, std::rc::Rc::new(check))
    }

    /// The response's headers: how its usage will be read. False when the
    /// headers wait for the settlement (usage in a header).
    pub(super) fn token_response_headers(
        &self,
        host: &impl Host,
        context_id: u32,
        headers: &mut Headers,
    ) -> bool {
        let Some(mut b) = self.budgets.borrow_mut().remove(&context_id) else {
            return true;
        };
        let go_on = self.read_response_headers(host, context_id, &mut b, headers);
        self.budgets.borrow_mut().insert(context_id, b);
        go_on
    }

    fn read_response_headers(
        &self,
        host: &impl Host,
        context_id: u32,
        b: &mut Budget,
        headers: &mut Headers,
    ) -> bool {
        let Some(cost) = b.check.tokens.clone() else {
            return true;
        };
        let status = host
            .response_header(":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok())
            .unwrap_or(0);
        if status >= 500 {
            // The upstream failed: nothing was produced.
            let actual = if cost.refund_on_error {
                0
            } else {
                b.ledger.reserved()
            };
            self.settle(host, context_id, b, actual);
            return true;
        }
        let reported = cost
            .usage
            .header
            .as_deref()
            .and_then(|h| host.response_header(h))
            .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok());
        if let Some(actual) = reported {
            // Known before the headers go: they wait for the settlement
            // and report what is left after it.
            if self.settle(host, context_id, b, actual) {
                b.held = Held::Headers;
                b.held_headers = std::mem::take(headers);
                return false;
            }
            return true;
        }
        b.body_left = host
            .response_header("content-length")
            .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok());
        let content_type = host
            .response_header("content-type")
            .unwrap_or_default()
            .to_ascii_lowercase();
        b.response = if content_type.starts_with(b"text/event-stream") {
            // The gate may take the usage event out, or end the stream at
            // the budget: the body the client gets is not the length the
            // upstream framed (Envoy then frames it itself: chunked).
            if b.body_left.is_some() {
                host.remove_response_header("content-length");
            }
            SseGate::new(cost.usage.sse_json.clone(), cost.max_body_bytes)
                .hiding_usage_event(b.check.usage_asked_for_client)
                .into()
        } else if cost.usage.json.is_some() {
            Response::Json(Some(Vec::new()))
        } else {
            let actual = b.unreported(0);
            self.settle(host, context_id, b, actual);
            Response::Done
        };
        true
    }

    /// A chunk of the response body. False when its end waits for the
    /// settlement (or a top-up).
    pub fn on_response_body(
        &self,
        host: &impl Host,
        stream: &Stream,
        size: usize,
        end_of_stream: bool,
    ) -> bool {
        if stream.hit {
            return true;
        }
        let id = stream.context_id;
        let Some(mut b) = self.budgets.borrow_mut().remove(&id) else {
            return true;
        };
        let end_of_stream = b.body_ends(size, end_of_stream);
        let response = std::mem::replace(&mut b.response, Response::Done);
        let go_on = match response {
            Response::NotYet | Response::Done => {
                b.response = response;
                true
            }
            Response::Cut => {
                if size > 0 {
                    host.replace_response_body(size, b"");
                }
                b.response = Response::Cut;
                true
            }
            Response::Json(bytes) => self.json_chunk(host, id, &mut b, bytes, size, end_of_stream),
            Response::Sse(gate) => self.sse_chunk(host, id, &mut b, gate, size, end_of_stream),
        };
        self.budgets.borrow_mut().insert(id, b);
        go_on
    }

    fn json_chunk(
        &self,
        host: &impl Host,
        id: u32,
        b: &mut Budget,
        mut bytes: Option<Vec<u8>>,
        size: usize,
        end_of_stream: bool,
    ) -> bool {
        let (max, usage) = match b.cost() {
            Some(c) => (c.max_body_bytes, c.usage.json.clone()),
            None => return true,
        };
        if let Some(read) = bytes.as_mut() {
            // Each chunk is read as it passes: nothing is buffered.
            if read.len() + size > max {
                bytes = None;
            } else if let Some(chunk) = host.response_body(size) {
                read.extend_from_slice(&chunk);
            }
        }
        if !end_of_stream {
            b.response = Response::Json(bytes);
            return true;
        }
        let actual = bytes
            .as_deref()
            .and_then(|body| usage.as_ref()?.read_body(body))
            .unwrap_or_else(|| b.unreported(0));
        if self.settle(host, id, b, actual) {
            b.held = Held::End;
            return false;
        }
        true
    }

    fn sse_chunk(
        &self,
        host: &impl Host,
        id: u32,
        b: &mut Budget,
        mut gate: SseGate,
        size: usize,
        end_of_stream: bool,
    ) -> bool {
        let chunk = host.response_body(size).unwrap_or_default();
        let mut passed = gate.push(&chunk, b.room(gate.deltas));
        if end_of_stream && !passed.blocked {
            let rest = gate.finish(b.room(gate.deltas));
            passed.bytes.extend(rest.bytes);
            passed.blocked = rest.blocked;
        }
        let mut out = passed.bytes;
        let mut cut = false;
        if passed.blocked {
            if b.exhausted {
                out.extend_from_slice(CUT_EVENTS);
                cut = true;
            } else if !b.topping_up {
                let step = b.step;
                self.top_up(host, id, b, step);
                if b.exhausted {
                    // Decided at once (no call possible) and no room.
                    out.extend_from_slice(CUT_EVENTS);
                    cut = true;
                }
            }
        }
        if out != chunk {
            host.replace_response_body(size, &out);
        }
        if cut {
            self.cut(host, id, b, &mut gate);
            return true;
        }
        let waiting = passed.blocked && end_of_stream;
        let usage = gate.usage;
        let seen = gate.deltas;
        b.response = Response::Sse(gate);
        if waiting {
            // The last events wait for the top-up in flight.
            b.held = Held::End;
            return false;
        }
        if end_of_stream {
            let actual = usage.unwrap_or_else(|| b.unreported(seen));
            if self.settle(host, id, b, actual) {
                b.held = Held::End;
                return false;
            }
        }
        true
    }

    /// Ends an event stream at its budget: what it delivered is settled.
    pub(super) fn cut(&self, host: &impl Host, id: u32, b: &mut Budget, gate: &mut SseGate) {
        gate.discard();
        self.metrics.bump(host, Stat::StreamsCut);
        let delivered = gate.deltas;
        if let Some(skipped) = self.cut_log.allow(host.now_ms()) {
            let shown: String = b.check.subject.chars().take(64).collect();
            info!(
                "token budget spent: ended {shown:?}'s stream after {delivered} deltas ({skipped} more since the last line)"
            );
        }
        self.settle(host, id, b, delivered);
        b.response = Response::Cut;
    }

    /// Asks for `units` more for a stream (answered in [`Self::on_top_up`]).
    pub(super) fn top_up(&self, host: &impl Host, id: u32, b: &mut Budget, units: u64) {
        let mut check = b.check.top_up(units);
        check.id = self.lease_book.next_lease_id();
        b.topping_up = true;
        let job = Job::TopUp {
            check: check.clone(),
        };
        if let Err(e) = self.send_job(host, id, job) {
            self.apply_top_up(host, id, b, &check, Err(e));
        }
    }

    /// A top-up's outcome, into the budget.
    fn apply_top_up(
        &self,
        host: &impl Host,
        id: u32,
        b: &mut Budget,
        check: &Check,
        outcome: Result<CheckResult, ServiceError>,
    ) {
        b.topping_up = false;
        let now = host.now_ms();
        let (result, place) = match outcome {
            Ok(result) => {
                let place = global_place(check, &result);
                (result, place)
            }
            Err(e) => match self.fallback(host, now, check, Some(&e)) {
                Ok(result) => (result, self.fallback_place(now)),
                Err(_) => {
                    b.exhausted = true;
                    return;
                }
            },
        };
        let units = check.reserved();
        if result.allowed {
            match place {
                Some(place) => {
                    self.metrics.add(host, Stat::TokensReserved, units as usize);
                    self.rule_stats
                        .tokens(host, &check.global, Event::TokensReserved, units);
                    b.ledger.reservations.push(Reservation { units, place });
                }
                None => b.unbounded = true,
            }
            return;
        }
        // No room for a whole step: take what is left, then stop.
        let left = result
            .limits
            .iter()
            .filter(|s| !s.shadow)
            .map(|s| s.remaining)
            .min()
            .unwrap_or(0);
        if left > 0 && left < units {
            self.top_up(host, id, b, left);
        } else {
            b.exhausted = true;
        }
    }

    /// meshlimitd answered a top-up (or its call failed).
    pub(super) fn on_top_up(
        &self,
        host: &impl Host,
        id: u32,
        check: &Check,
        outcome: Result<CheckResult, ServiceError>,
    ) {
        let Some(mut b) = self.budgets.borrow_mut().remove(&id) else {
            // The stream is gone: what the top-up charged goes back.
            if let Ok(result) = &outcome {
                self.give_back(host, id, check, result);
            }
            return;
        };
        self.apply_top_up(host, id, &mut b, check, outcome);
        if b.held == Held::End && !b.topping_up && host.set_effective_context(id) {
            self.finish_held(host, id, &mut b);
        }
        self.budgets.borrow_mut().insert(id, b);
    }

    /// Sends a top-up, a settlement or a return: queued for the root,
    /// which sends it (in the worker's next batch with group commit on).
    /// `id` is the context whose callback runs now.
    pub(super) fn send_job(&self, host: &impl Host, id: u32, job: Job) -> Result<(), ServiceError> {
        let now = host.now_ms();
        let queued = Queued {
            context_id: id,
            job,
        };
        match self.outbox.queue(host, queued, now) {
            Queue::Queued => Ok(()),
            Queue::Refused(_) => {
                self.metrics.bump(host, Stat::BatchOverflow);
                Err(ServiceError::Connection)
            }
            // The root cannot be woken: a response may be waiting on this
            // job, so it goes now, from this callback.
            Queue::NoWake(queued) => self
                .outbox
                .send_from(host, &self.config.service, id, vec![queued], now)
                .inspect_err(|_| self.guard.record_call(host, &self.metrics, false, now)),
        }
    }
}
