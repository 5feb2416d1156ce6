//! The clock a busy client's lease hits decide by: the worker's last read,
//! reused for at most [`READ_EVERY`]` - 1` hits in a row.
//!
//! A hit crosses into Envoy for the request's headers, the two RateLimit
//! headers and the clock. Measured side by side (`make bench-ab`), the
//! clock's crossing was a third of what a hit costs over the do-nothing
//! filter on a machine whose hostcalls are slow, and most of the gap to
//! it. What a hit needs the time for: whether its worker's draw is still
//! live (its window not over), how busy the client is, and `t=` in
//! `RateLimit`. A draw's units were charged in Redis to their window, so
//! the one thing a stale clock can get wrong is spending them after that
//! window ended. Hence:
//!
//! - The clock is read again after at most `READ_EVERY - 1` reuses, on
//!   every root tick, and by every request that does more than spend its
//!   worker's draw (a draw from the slot, a call, the deny cache, local
//!   rules): a reused time is never older than the worker's last
//!   [`READ_EVERY`] requests.
//! - A draw within [`NEAR_EXPIRY_MS`] of its expiry, by the reused time,
//!   is decided on a fresh read.
//!
//! Together: a draw's units can serve requests after their window ended
//! only if the reused time is more than [`NEAR_EXPIRY_MS`] behind, which
//! needs the worker's event loop to have stalled that long (its tick runs
//! every 250 ms at most) between two requests, and then at most
//! `READ_EVERY - 1` of them, each charged in Redis to the window before
//! (docs/leases.md). A reused time is never ahead of the real one, so
//! `t=` is never shorter than the real wait.

use std::cell::Cell;

use crate::host::Host;

/// Hits decided on one read of the clock, at most.
pub(super) const READ_EVERY: u32 = 16;

/// A draw this close to its expiry by a reused time is decided on a fresh
/// read (four times the longest tick period).
pub(super) const NEAR_EXPIRY_MS: u64 = 1_000;

/// A worker's last clock read, and the hits decided on it since.
#[derive(Default)]
pub(super) struct HitClock {
    last_ms: Cell<u64>,
    reused: Cell<u32>,
}

impl HitClock {
    /// Reads the host's clock (one hostcall), and keeps the time for the
    /// next hits.
    pub(super) fn read(&self, host: &impl Host) -> u64 {
        let now = host.now_ms();
        self.last_ms.set(now);
        self.reused.set(0);
        now
    }

    /// The last read, for one more hit, while fewer than `READ_EVERY - 1`
    /// hits used it; `None` when the clock must be read (never read yet).
    pub(super) fn reuse(&self) -> Option<u64> {
        let (last, reused) = (self.last_ms.get(), self.reused.get());
        if last == 0 || reused.saturating_add(1) >= READ_EVERY {
            return None;
        }
        self.reused.set(reused + 1);
        Some(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;

    #[test]
    fn a_read_serves_at_most_fifteen_hits_after_it() {
        let host = FakeHost::default();
        let clock = HitClock::default();
        assert_eq!(clock.reuse(), None, "never read");
        let read = clock.read(&host);
        host.now.set(read + 5_000);
        for _ in 1..READ_EVERY {
            assert_eq!(clock.reuse(), Some(read));
        }
        assert_eq!(clock.reuse(), None, "read again");
        assert_eq!(clock.read(&host), read + 5_000);
        assert_eq!(clock.reuse(), Some(read + 5_000));
    }
}
