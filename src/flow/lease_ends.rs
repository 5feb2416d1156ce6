//! Leases ended early, as every worker of the Envoy hears of them.
//!
//! meshlimitd refuses a lease's renewal only when the client is over a
//! limit lowered since the grant (a live override, above all), and a
//! call refused at a quota below the configured one says the same. The
//! worker that hears it ends the lease in its slot (`Leases::revoke`), but the
//! draws other workers hold live in their own memory, and a hit reads no
//! shared data: they would go on admitting under the old limit until spent
//! (in halves, a draw can be half the lease). So the ending worker counts
//! it in one shared-data word, and every worker reads that word at most
//! every [`READ_EVERY_MS`] on its lease hits; when it moved, the worker
//! puts every draw it holds back in its slot (the ended lease takes its
//! draws' units back, to be given back; a live one simply lends them again
//! on the next hit). Ends are rare, so putting back every draw costs
//! nothing that matters; the read costs one shared-data copy a tenth of a
//! second per busy worker.

use std::cell::Cell;

use meshlimit_protocol::CheckResult;

use super::Worker;
use crate::check::Check;
use crate::host::Host;
use crate::shared::lease::Leases;
use crate::shared::store::{le_word, le_words, retry_on_conflict, SharedStore};
use crate::stats::Stat;

/// How often a worker holding draws reads whether a lease ended.
pub(crate) const READ_EVERY_MS: u64 = 100;

pub(super) struct LeaseEnds {
    /// Its shared-data key (the plugin instance's).
    key: String,
    /// The count of ends this worker last saw.
    seen: Cell<u64>,
    /// When it reads the count next.
    next_read_ms: Cell<u64>,
}

impl LeaseEnds {
    pub(super) fn new(key: &str) -> LeaseEnds {
        LeaseEnds {
            key: key.to_string(),
            seen: Cell::new(0),
            next_read_ms: Cell::new(0),
        }
    }

    /// A lease was ended: counted for the other workers. This worker has
    /// already dealt with its own draw of it.
    pub(super) fn announce(&self, store: &impl SharedStore) {
        let counted = retry_on_conflict(|| {
            let (bytes, cas) = store.get(&self.key)?;
            let count = bytes
                .as_deref()
                .and_then(|b| le_word(b, 0))
                .unwrap_or(0)
                .wrapping_add(1);
            store.set(&self.key, &le_words(&[count]), cas)?;
            Ok(count)
        });
        if let Ok(count) = counted {
            // Its other draws are not of the ended lease.
            self.seen.set(count);
        }
    }

    /// Whether a lease ended since this worker last looked (read at most
    /// every [`READ_EVERY_MS`]; the first read only learns the count).
    pub(super) fn heard(&self, store: &impl SharedStore, now: u64) -> bool {
        if now < self.next_read_ms.get() {
            return false;
        }
        let first = self.next_read_ms.get() == 0;
        self.next_read_ms
            .set(now.saturating_add(READ_EVERY_MS).max(1));
        let Ok((Some(bytes), _)) = store.get(&self.key) else {
            return false;
        };
        let count = le_word(&bytes, 0).unwrap_or(0);
        let moved = count != self.seen.get();
        self.seen.set(count);
        moved && !first
    }
}

impl Worker {
    /// meshlimitd refused `check` over a limit lowered since its lease was
    /// granted: a renewal (a check of cost 0 is refused only over a limit),
    /// or a call at a quota below the configured one (see
    /// [`refused_below_its_configured_limit`]). The lease ends: no worker draws from it again, every worker's
    /// draws go back to it (this one's now, the others' within
    /// `lease_ends::READ_EVERY_MS`), and its owner gives back what is left
    /// on its tick, so the client's next request calls and meets the lower
    /// limit.
    pub(super) fn end_lease(&self, host: &impl Host, now: u64, check: &Check) {
        let Some(leases) = self.leases(host, now) else {
            return;
        };
        // Its place as the check's lease asked or drew it.
        let Some(place) = check
            .lease
            .map(|t| t.place)
            .or_else(|| check.place.0.get().map(|(_, place)| place))
        else {
            return;
        };
        if !leases.revoke(place, now) {
            return;
        }
        self.metrics.bump(host, Stat::LeasesEnded);
        // This worker's draws now, the others' at their next read.
        self.lease_book.ends.announce(host);
        self.put_back_every_draw(&leases);
        // Its owner looks at it on the next tick (this worker, when it
        // installed it).
        super::leases::look_at_next_tick(&mut self.lease_book.records.borrow_mut(), place.slot);
    }

    /// Puts every draw this worker holds back in its slot: a lease ended
    /// early takes back what its draws had left.
    #[cold]
    #[inline(never)]
    pub(super) fn put_back_every_draw<H: Host>(&self, leases: &Leases<'_, H>) {
        let draws = self.lease_book.observer.borrow_mut().take_all_draws();
        self.put_back_draws(leases, draws);
    }
}

/// Whether meshlimitd refused `check` on a limit it applied lower than
/// the one configured (a live override lowered it): units this Envoy
/// leased under the configured limit must not go on admitting.
pub(super) fn refused_below_its_configured_limit(check: &Check, result: &CheckResult) -> bool {
    !result.allowed
        && check
            .global
            .iter()
            .zip(&result.limits)
            .any(|(a, status)| !status.allowed && status.limit < a.limit.requests)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeStore;

    #[test]
    fn a_worker_hears_an_end_another_announced_at_its_next_read() {
        let store = FakeStore::default();
        let (a, b) = (LeaseEnds::new("k"), LeaseEnds::new("k"));
        assert!(!b.heard(&store, 1_000), "nothing yet");
        a.announce(&store);
        assert!(!a.heard(&store, 1_000), "its own end");
        assert!(!b.heard(&store, 1_050), "not read again so soon");
        assert!(b.heard(&store, 1_100));
        assert!(!b.heard(&store, 1_200), "once");
    }

    #[test]
    fn an_end_before_a_workers_first_read_is_not_heard_as_new() {
        let store = FakeStore::default();
        let (a, b) = (LeaseEnds::new("k"), LeaseEnds::new("k"));
        a.announce(&store);
        // A worker that holds no draws yet has none to put back.
        assert!(!b.heard(&store, 5));
        a.announce(&store);
        assert!(b.heard(&store, 200));
    }
}
