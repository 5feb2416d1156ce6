//! Refusals decided at an HTTP/2 request's headers, answered a little
//! later, while nothing goes upstream.
//!
//! A budget the deny cache knows to be spent can be refused at the
//! headers, before the body is read. Over HTTP/1.1 the refusal goes at
//! once (Envoy closes the connection after it, and the client reads its
//! 429). Over HTTP/2 and HTTP/3 a stream answered while its client is
//! still uploading is reset, and clients report the reset rather than the
//! 429; letting the headers go on instead (and refusing once the body is
//! in) sends them upstream. So the stream is paused at its headers (Envoy
//! then stops it whole, body and all, with nothing upstream) and answered
//! on the root's tick at least [`DEFER_MS`] later, when a client's upload
//! of a prompt is over: the model sees nothing of it.

use std::cell::RefCell;

use crate::context_map::ContextMap;
use crate::reply::DenyResponse;

/// How long a refusal waits, at least, for its client's upload to end.
pub(super) const DEFER_MS: u64 = 50;

/// Refusals waiting for the tick, by stream.
#[derive(Default)]
pub(super) struct DeferredDenies {
    waiting: RefCell<ContextMap<(u64, DenyResponse)>>,
}

impl DeferredDenies {
    /// Stream `id` is refused with `deny` from `now` + [`DEFER_MS`] on.
    pub(super) fn defer(&self, id: u32, now: u64, deny: DenyResponse) {
        self.waiting
            .borrow_mut()
            .insert(id, (now.saturating_add(DEFER_MS), deny));
    }

    /// Stream `id` ended (its client left): nothing to answer.
    pub(super) fn forget(&self, id: u32) {
        self.waiting.borrow_mut().remove(&id);
    }

    /// The refusals due at `now`, taken.
    pub(super) fn due(&self, now: u64) -> Vec<(u32, DenyResponse)> {
        let mut waiting = self.waiting.borrow_mut();
        if waiting.is_empty() {
            return Vec::new();
        }
        let due: Vec<u32> = waiting
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(id, _)| *id)
            .collect();
        due.into_iter()
            .filter_map(|id| waiting.remove(&id).map(|(_, deny)| (id, deny)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deny() -> DenyResponse {
        DenyResponse {
            status: 429,
            headers: Default::default(),
            body: String::new(),
            grpc_status: 8,
        }
    }

    #[test]
    fn a_refusal_is_due_after_its_wait_and_forgotten_with_its_stream() {
        let d = DeferredDenies::default();
        d.defer(7, 1_000, deny());
        d.defer(8, 1_000, deny());
        assert!(d.due(1_000 + DEFER_MS - 1).is_empty());
        d.forget(8);
        let due = d.due(1_000 + DEFER_MS);
        assert_eq!(due.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [7]);
        assert!(d.due(5_000).is_empty());
    }
}
