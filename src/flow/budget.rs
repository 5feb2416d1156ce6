//! A token-priced request's state once admitted: its reservations, how
//! far its response got, and what of the response waits for a call. The
//! worker keeps one per stream (see `tokens`, which moves it along).

use meshlimit_protocol::{CheckResult, LimitStatus};

use crate::check::Check;
use crate::config::{TokenCost, TokenMode};
use crate::headers::Headers;
use crate::tokens::budget::{Ledger, Place};
use crate::tokens::sse::SseGate;

/// One admitted token-priced request.
pub(super) struct Budget {
    pub(super) check: Check,
    pub(super) ledger: Ledger,
    /// What a top-up asks for: the first reservation's size.
    pub(super) step: u64,
    /// The token-priced limits' statuses after the first reservation.
    pub(super) statuses: Vec<LimitStatus>,
    pub(super) response: Response,
    pub(super) topping_up: bool,
    /// The budget had no room for a top-up: the next held event cuts.
    pub(super) exhausted: bool,
    /// A top-up was admitted without a reservation (`failure_mode:
    /// allow`): the stream is no longer bounded.
    pub(super) unbounded: bool,
    pub(super) held: Held,
    /// RateLimit headers held with the response headers.
    pub(super) held_headers: Headers,
    /// Bytes of the response body still to come by its `content-length`
    /// (see [`Budget::body_ends`]).
    pub(super) body_left: Option<u64>,
}

/// Where the response is.
pub(super) enum Response {
    NotYet,
    /// A JSON body, read up to `max_body_bytes` (`None` above it).
    Json(Option<Vec<u8>>),
    Sse(SseGate),
    /// Ended at the budget: what the upstream sends now is dropped.
    Cut,
    /// Settled.
    Done,
}

/// What of the response waits for this stream's pending call.
#[derive(PartialEq, Eq)]
pub(super) enum Held {
    No,
    Headers,
    /// Its last chunk (and whatever it still holds back).
    End,
}

impl Budget {
    /// Whether a response chunk of `size` bytes ends the body for the
    /// client. Envoy's HTTP/1 codec hands the body on, then its end in an
    /// empty chunk of its own; a client reading by `content-length` has
    /// the whole response with the chunk that completes the length, so
    /// that chunk is the end that waits for the settlement.
    pub(super) fn body_ends(&mut self, size: usize, end_of_stream: bool) -> bool {
        let Some(left) = self.body_left.as_mut() else {
            return end_of_stream;
        };
        let had = *left;
        *left = left.saturating_sub(size as u64);
        end_of_stream || (had > 0 && *left == 0)
    }

    pub(super) fn cost(&self) -> Option<&TokenCost> {
        self.check.tokens.as_deref()
    }

    /// Deltas an event stream may still pass; `None` when unbounded. The
    /// prompt's part of the reservation is the prompt's.
    pub(super) fn room(&self, passed: u64) -> Option<u64> {
        let reserve = self.cost().is_some_and(|c| c.mode == TokenMode::Reserve);
        (reserve && !self.unbounded).then(|| {
            self.ledger
                .reserved()
                .saturating_sub(self.check.prompt)
                .saturating_sub(passed)
        })
    }

    /// What a response that reports no usage settles at: the reservation,
    /// or the prompt and the deltas `seen` when they are more (mode
    /// `after`: those, at least the unit it holds). Never the deltas
    /// alone: the prompt was sent.
    pub(super) fn unreported(&self, seen: u64) -> u64 {
        let sent = self.check.prompt.saturating_add(seen);
        match self.cost().map(|c| c.mode) {
            Some(TokenMode::After) => sent.max(1),
            _ => self.ledger.reserved().max(sent),
        }
    }
}

/// Where an admitted check's token-priced limits were charged, by
/// meshlimitd's receipts.
pub(super) fn global_place(check: &Check, result: &CheckResult) -> Option<Place> {
    check.tokens.as_ref()?;
    let receipts = result.receipts.as_deref().unwrap_or_default();
    Some(Place::Global(
        check
            .global
            .iter()
            .zip(receipts)
            .filter(|(a, _)| a.tokens)
            .map(|(_, r)| r.clone())
            .collect(),
    ))
}

impl From<SseGate> for Response {
    fn from(gate: SseGate) -> Self {
        Response::Sse(gate)
    }
}
