//! Rate-limited logging: an outage must produce a few informative lines,
//! not one per request.

use std::cell::Cell;

/// Lets one line through per interval and counts the ones it held back.
#[derive(Debug)]
pub struct LogThrottle {
    interval_ms: u64,
    next_ms: Cell<u64>,
    suppressed: Cell<u64>,
}

impl LogThrottle {
    pub fn new(interval_ms: u64) -> Self {
        LogThrottle {
            interval_ms,
            next_ms: Cell::new(0),
            suppressed: Cell::new(0),
        }
    }

    /// `Some(n)` when a line may be logged now, `n` being how many were
    /// suppressed since the last one.
    pub fn allow(&self, now_ms: u64) -> Option<u64> {
        if now_ms < self.next_ms.get() {
            self.suppressed.set(self.suppressed.get() + 1);
            return None;
        }
        self.next_ms.set(now_ms.saturating_add(self.interval_ms));
        Some(self.suppressed.replace(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_a_count_of_the_rest() {
        let t = LogThrottle::new(10_000);
        assert_eq!(t.allow(1_000), Some(0));
        assert_eq!(t.allow(2_000), None);
        assert_eq!(t.allow(10_999), None);
        assert_eq!(t.allow(11_000), Some(2));
        assert_eq!(t.allow(11_001), None);
    }
}
