//! A background job started at most once per interval, by whichever task
//! gets there first.

use std::sync::atomic::{AtomicU64, Ordering};

/// Lets one caller in per interval; the others, and the same caller again
/// too soon, are told to skip. Lock-free: a compare-and-swap on the time of
/// the last start decides between callers that arrive together.
#[derive(Debug, Default)]
pub struct AtMostEvery {
    /// When the job was last started (ms of the caller's clock; 0: never).
    last_ms: AtomicU64,
}

impl AtMostEvery {
    /// True when the caller may start the job now (`now_ms` on the same
    /// clock for every call), false when it ran less than `every_ms` ago or
    /// another caller just claimed this turn.
    pub fn claim(&self, now_ms: u64, every_ms: u64) -> bool {
        let last = self.last_ms.load(Ordering::Relaxed);
        if last != 0 && now_ms < last.saturating_add(every_ms) {
            return false;
        }
        // 0 means "never": a claim at time 0 is stored as 1.
        self.last_ms
            .compare_exchange(last, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_claim_per_interval() {
        let gate = AtMostEvery::default();
        assert!(gate.claim(0, 1_000), "the first call always runs");
        assert!(!gate.claim(500, 1_000));
        assert!(!gate.claim(1_000, 1_000), "0 was stored as 1");
        assert!(gate.claim(1_001, 1_000));
        assert!(!gate.claim(2_000, 1_000));
        assert!(gate.claim(2_001, 1_000));
    }
}
