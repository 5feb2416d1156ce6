//! A request whose reservation is in its body (token budgets), at its
//! headers: what goes upstream before the body decides it.

use std::rc::Rc;

use super::{decide, Step, Stream, Worker};
use crate::check::Check;
use crate::host::Host;

impl Worker {
    /// The headers of a request whose reservation is in its body (not yet
    /// in): held, refused from the deny cache, or let go while the body
    /// waits.
    #[inline(never)]
    pub(super) fn await_body(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        check: Rc<Check>,
    ) -> Step {
        if check
            .reserves_from_body()
            .is_some_and(|c| c.asks_stream_usage())
        {
            // The body may grow when it is read (a stream made to ask
            // for its usage): the length it had must not go upstream.
            // Envoy then frames the body itself (chunked over HTTP/1.1).
            host.remove_request_header("content-length");
        }
        // The reservation is in the body: decide once it is in. The
        // headers wait too where Envoy allows it (see `hold`): a denied
        // request then never reaches the upstream. Else they go on (a
        // paused stream would get no body callbacks) and the body
        // waits, so the upstream sees nothing it could act on.
        let now = self.hits.clock.read(host);
        if self.hold.hold(stream.context_id, now) {
            // Nothing goes on before the body decides it (a cached
            // deny included: answered once the body is in, a refusal
            // never cuts a client's upload short).
            stream.awaiting_body = Some(Box::new(Rc::unwrap_or_clone(check)));
            return Step::Pause;
        }
        // The headers would go on: a budget the deny cache knows to be
        // spent is refused here instead. Over HTTP/1 at once (a refusal
        // before the upload ends closes the connection, and the client
        // reads its 429). Over HTTP/2 Envoy resets a stream answered
        // mid-upload, which clients report as a stream error rather than
        // the 429: the refusal waits for the root's tick, the stream
        // stopped whole meanwhile (see `deferred_deny`); without a tick,
        // the body decides.
        let multiplexed = matches!(
            host.property(&["request", "protocol"]).as_deref(),
            Some(b"HTTP/2" | b"HTTP/3")
        );
        if !multiplexed || self.lease_book.ticking {
            if let decide::Outcome::Decided(step) = self.cached_deny(host, stream, now, &check) {
                return match step {
                    Step::Reply(deny) if multiplexed => {
                        self.deferred.defer(stream.context_id, now, deny);
                        Step::Pause
                    }
                    step => step,
                };
            }
        }
        stream.awaiting_body = Some(Box::new(Rc::unwrap_or_clone(check)));
        Step::Continue
    }
}
