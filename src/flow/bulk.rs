//! A count that reaches its stat in bulk: a hostcall per request is a
//! tenth of what a lease hit or a local draw costs, so hits are added
//! [`EVERY`] at a time, and on every root tick (the stat is at most a tick
//! behind).

use std::cell::Cell;

/// Hits added to their stat at a time.
const EVERY: u64 = 64;

/// Hits not yet added to their stat.
#[derive(Default)]
pub(super) struct BulkCount(Cell<u64>);

impl BulkCount {
    /// Counts one; the count to add to the stat now, if any.
    pub(super) fn count(&self) -> Option<u64> {
        let n = self.0.get() + 1;
        if n >= EVERY {
            self.0.set(0);
            Some(n)
        } else {
            self.0.set(n);
            None
        }
    }

    /// What is not yet added (the tick adds it).
    pub(super) fn take(&self) -> u64 {
        self.0.replace(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_handed_over_every_64_and_on_demand() {
        let bulk = BulkCount::default();
        let handed: Vec<u64> = (0..130).filter_map(|_| bulk.count()).collect();
        assert_eq!(handed, [64, 64]);
        assert_eq!(bulk.take(), 2);
        assert_eq!(bulk.take(), 0);
    }
}
