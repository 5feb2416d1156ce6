//! Lease asks after a lost answer: smaller, then none.
//!
//! A lease is charged in Redis by the script that grants it. When the
//! grant's answer never reaches the filter (the call timed out, or
//! meshlimitd answered 503 at the caller's deadline while the script ran
//! on), the units are charged to nobody: meshlimitd gives back what a
//! decision its caller gave up on had leased, but an answer lost after it
//! left meshlimitd is given back by no one, and holds the units until
//! their window ends. So after each such failure this worker halves what
//! it asks for, and after [`MAX_HALVINGS`] in a row it asks for nothing
//! (each request calls). Asks grow back as calls are answered again: one
//! halving back for each answered call, all of them for an answered ask.
//! Answered calls without an ask must count, since asks that fell to
//! nothing are never sent, so never answered: leasing would end on the
//! worker for good.

use std::cell::Cell;

use crate::decision::ServiceError;

/// Halvings before asks stop altogether.
pub(crate) const MAX_HALVINGS: u32 = 6;

#[derive(Default)]
pub(super) struct AskBackoff {
    halvings: Cell<u32>,
}

impl AskBackoff {
    /// What to ask for instead of `want` (0: no ask).
    pub(super) fn size(&self, want: u64) -> u64 {
        match self.halvings.get() {
            h if h > MAX_HALVINGS => 0,
            h => want >> h,
        }
    }

    /// A call came back answered (with an ask or not): the way to
    /// meshlimitd works again, and asks grow back by one halving.
    pub(super) fn call_answered(&self) {
        self.halvings.set(self.halvings.get().saturating_sub(1));
    }

    /// A call that carried an ask came back (or failed) with `outcome`.
    pub(super) fn answered<T>(&self, outcome: &Result<T, ServiceError>) {
        match outcome {
            Ok(_) => self.halvings.set(0),
            // The script may have run, and its grant is lost.
            Err(ServiceError::Timeout | ServiceError::Unavailable) => {
                self.halvings
                    .set((self.halvings.get() + 1).min(MAX_HALVINGS + 1));
            }
            // Refused, or never sent: nothing was granted.
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_lost_answer_halves_the_ask_then_none_until_one_is_answered() {
        let b = AskBackoff::default();
        assert_eq!(b.size(64), 64);
        b.answered::<()>(&Err(ServiceError::Timeout));
        assert_eq!(b.size(64), 32);
        b.answered::<()>(&Err(ServiceError::Unavailable));
        assert_eq!(b.size(64), 16);
        b.answered::<()>(&Err(ServiceError::Connection));
        assert_eq!(b.size(64), 16, "nothing was sent: nothing lost");
        for _ in 0..10 {
            b.answered::<()>(&Err(ServiceError::Timeout));
        }
        assert_eq!(b.size(1_000_000), 0, "no ask at all");
        b.answered(&Ok(()));
        assert_eq!(b.size(64), 64);
    }

    #[test]
    fn asks_that_fell_to_nothing_grow_back_with_each_answered_call() {
        let b = AskBackoff::default();
        for _ in 0..10 {
            b.answered::<()>(&Err(ServiceError::Timeout));
        }
        assert_eq!(b.size(1 << 20), 0);
        b.call_answered();
        assert_eq!(b.size(1 << 20), 1 << (20 - MAX_HALVINGS));
        b.call_answered();
        assert_eq!(b.size(1 << 20), 1 << (20 - MAX_HALVINGS + 1));
        for _ in 0..10 {
            b.call_answered();
        }
        assert_eq!(b.size(64), 64, "never beyond the whole ask");
    }
}
