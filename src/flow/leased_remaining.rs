//! What a request decided by a call reports as remaining on a leased
//! check: meshlimitd's count, plus the units its Envoy holds in the
//! check's leases, as a lease hit reports (see docs/leases.md, "Headers").
//!
//! meshlimitd's remaining counts every lease's units as gone: they were
//! charged when granted. A request that found its lease spent calls with
//! the renewal the lease asked for in the same batch, the renewal first;
//! meshlimitd runs the renewal's script, then the request's. Without this,
//! that request read low by the renewal's units, and the hits after it
//! one high (the renewal's grant counted the request's unit as still
//! there).

use meshlimit_protocol::CheckResult;

use super::Worker;
use crate::check::{Check, LeaseIdentity};
use crate::host::Host;

impl Worker {
    /// An admitted request's statuses count the units this Envoy holds in
    /// the check's leases, as a hit's `RateLimit` does: meshlimitd's
    /// remaining counts none of them (they were charged when granted). A
    /// grant in this answer is one; a renewal granted just before in the
    /// same batch (its script ran before this request's) is another, and
    /// its slot then learns this fresher remaining (see
    /// [`Leases::heard`]). Read only when this worker installed a lease
    /// in the check's slot: a check never leased costs no read.
    pub(super) fn count_leased_units(
        &self,
        host: &impl Host,
        now: u64,
        check: &Check,
        result: &mut CheckResult,
    ) {
        if !result.allowed || check.lease_cost().is_none() {
            return;
        }
        let Some(leases) = self.leases(host, now) else {
            return;
        };
        let Some(fresh) = result.limits.iter().map(|s| s.remaining).min() else {
            return;
        };
        let place = check.lease_place(leases.seed, || {
            leases.place(&LeaseIdentity(&check.global), &check.subject)
        });
        let installed_here = self
            .lease_book
            .records
            .borrow()
            .iter()
            .any(|r| r.slot == place.slot);
        if !installed_here {
            return;
        }
        if let Some(held) = leases.heard(place, fresh, now) {
            for status in &mut result.limits {
                status.remaining = status.remaining.saturating_add(held).min(status.limit);
            }
        }
    }
}
