//! Reservations' receipts and their settlements (token budgets): the
//! difference between reserved and used units, charged or given back where
//! the reservation was charged.

use meshlimit_protocol::{CheckResult, Receipt, Settlement};

use super::{Limiter, LimiterError};
use crate::keys;
use crate::script::calendar_arg;

impl Limiter {
    /// Applies a settlement (see [`meshlimit_protocol::Settlement`]): one
    /// run per Cluster slot of its limits (one run off a Cluster). Returns
    /// what each limit has left.
    pub async fn settle(&self, settlement: &Settlement) -> Result<Vec<u64>, LimiterError> {
        Ok(self.apply_settlement(settlement).await?.0)
    }

    /// Applies a settlement with an id: whether it was applied now (not
    /// found applied before, see [`Settlement::id`]).
    pub(super) async fn settle_once(&self, settlement: &Settlement) -> Result<bool, LimiterError> {
        Ok(!self.apply_settlement(settlement).await?.1)
    }

    /// What each limit has left, and whether the settlement's id was found
    /// applied before (nothing was done).
    async fn apply_settlement(
        &self,
        settlement: &Settlement,
    ) -> Result<(Vec<u64>, bool), LimiterError> {
        let n = settlement.limits.len();
        if settlement.actual.len() != n || settlement.receipts.len() != n {
            return Err(LimiterError::Reply(
                "a settlement needs one actual and one receipt per limit".into(),
            ));
        }
        let groups = if self.backend.is_cluster() {
            super::slots::by_slot(&settlement.limits, &settlement.subject)
        } else {
            vec![(0, (0..n).collect())]
        };
        let runs = futures_util::future::join_all(groups.iter().map(|(slot, members)| {
            let invocation = self.settle_invocation(settlement, members);
            async move { self.run(*slot, &invocation, "settle").await }
        }))
        .await;
        let (mut remaining, mut seen_before) = (vec![0u64; n], false);
        for (run, (_, members)) in runs.into_iter().zip(&groups) {
            let values = run?;
            let Some((values, [not_given, repeated])) = values
                .split_last_chunk::<2>()
                .filter(|(values, _)| values.len() == members.len())
            else {
                return Err(LimiterError::Reply(format!(
                    "{} values, expected {}",
                    values.len(),
                    members.len() + 2
                )));
            };
            self.metrics
                .returns_on_lost_counters((*not_given).max(0) as u64);
            if *repeated == 1 {
                self.metrics.settlement_repeated();
                seen_before = true;
            }
            for (&i, &v) in members.iter().zip(values) {
                if let Some(slot) = remaining.get_mut(i) {
                    *slot = v.max(0) as u64;
                }
            }
        }
        Ok((remaining, seen_before))
    }

    /// The `SETTLE` run of `settlement`'s limits at `members` (one slot's).
    fn settle_invocation<'a>(
        &'a self,
        settlement: &Settlement,
        members: &[usize],
    ) -> redis::ScriptInvocation<'a> {
        let mut invocation = self.scripts.settle.prepare_invoke();
        invocation
            .arg(&self.clock_key)
            .arg(if self.overrides { "1" } else { "0" })
            .arg(if settlement.id != 0 { "1" } else { "0" });
        for &i in members {
            let (Some(limit), Some(actual), Some(receipt)) = (
                settlement.limits.get(i),
                settlement.actual.get(i),
                settlement.receipts.get(i),
            ) else {
                continue;
            };
            invocation
                .key(keys::limit_key(
                    &self.prefix,
                    &keys::subject_tag(limit.subject_or(&settlement.subject)),
                    limit,
                ))
                .arg(limit.algorithm.short_name())
                .arg(limit.requests)
                .arg(limit.window_ms)
                .arg(limit.cost)
                .arg(*actual)
                .arg(limit.capacity())
                .arg(calendar_arg(limit))
                .arg(receipt.clock_us)
                .arg(&receipt.nonce)
                .arg(receipt.place)
                .arg(receipt.epoch);
        }
        // Their override keys, then their epoch keys, in the same
        // order (see settle.lua).
        let tags: Vec<String> = members
            .iter()
            .filter_map(|&i| settlement.limits.get(i))
            .map(|limit| keys::subject_tag(limit.subject_or(&settlement.subject)))
            .collect();
        if self.overrides {
            for (&i, tag) in members.iter().zip(&tags) {
                if let Some(limit) = settlement.limits.get(i) {
                    invocation.key(keys::override_key(&self.prefix, tag, &limit.name));
                }
            }
        }
        for tag in &tags {
            invocation.key(keys::epoch_key(&self.prefix, tag));
        }
        if settlement.id != 0 {
            // Its mark, in this run's slot (each run marks its own).
            let tag = tags.first().map_or("", String::as_str);
            invocation.key(keys::settled_key(&self.prefix, tag, settlement.id));
        }
        invocation
    }
}

/// Where an admitted check's limits were charged (a reservation's
/// receipt): the run's clock and nonce, each limit's place in the run and
/// its subject's epoch (`epochs`, in the limits' order). None for a
/// denied check (it charged nothing).
pub(super) fn receipts(
    result: &CheckResult,
    clock: i64,
    nonce: &str,
    epochs: &[u64],
) -> Option<Vec<Receipt>> {
    result.allowed.then(|| {
        (1..=result.limits.len())
            .map(|place| Receipt {
                clock_us: clock.max(0) as u64,
                nonce: nonce.to_string(),
                place: place as u32,
                epoch: epochs.get(place - 1).copied().unwrap_or(0),
                units: 0,
                mac: String::new(),
            })
            .collect()
    })
}
