//! One request's reservations, and how its usage is split among them.
//!
//! A request reserves once before it is forwarded and may top up during
//! a stream; each reservation was charged on its own (in meshlimitd, with
//! receipts that say where, or in this Envoy's fallback counters), so each
//! is settled on its own, in the counters and windows it was charged to.

use meshlimit_protocol::Receipt;

/// Where a reservation was charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// By meshlimitd: one receipt per token-priced limit.
    Global(Vec<Receipt>),
    /// By this Envoy's fallback counters, at this time.
    Local { at_ms: u64 },
    /// Nowhere (`failure_mode: allow` admitted it): nothing to settle.
    Unrecorded,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub units: u64,
    pub place: Place,
}

/// Every reservation of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    pub reservations: Vec<Reservation>,
}

impl Ledger {
    /// Units reserved in all.
    pub fn reserved(&self) -> u64 {
        self.reservations.iter().map(|r| r.units).sum()
    }

    /// `actual` split among the reservations, in order: each takes up to
    /// what it reserved; the last also takes what exceeds them all.
    pub fn split(&self, actual: u64) -> Vec<u64> {
        let mut left = actual;
        let last = self.reservations.len().saturating_sub(1);
        self.reservations
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let share = if i == last { left } else { left.min(r.units) };
                left -= share;
                share
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(units: &[u64]) -> Ledger {
        Ledger {
            reservations: units
                .iter()
                .map(|&units| Reservation {
                    units,
                    place: Place::Local { at_ms: 0 },
                })
                .collect(),
        }
    }

    #[test]
    fn usage_fills_reservations_in_order_and_the_last_takes_any_excess() {
        let l = ledger(&[500, 200]);
        assert_eq!(l.reserved(), 700);
        assert_eq!(l.split(0), [0, 0]);
        assert_eq!(l.split(300), [300, 0]);
        assert_eq!(l.split(600), [500, 100]);
        assert_eq!(l.split(900), [500, 400]);
        assert_eq!(ledger(&[]).split(5), Vec::<u64>::new());
    }
}
