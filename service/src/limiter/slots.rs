//! Checks whose limits live in several Redis Cluster slots: decided one
//! slot at a time, and refunded when another slot denies (see
//! `docs/design-notes.md`, "Subjects per limit").

use meshlimit_protocol::{Check, CheckResult, Limit, LimitStatus, Receipt, Settlement};

use super::{parse_reply, receipts, split_clock, Limiter, LimiterError};
use crate::keys;

impl Limiter {
    /// A check whose limits live in different Cluster slots (a route cap
    /// `by: []` and a per-client limit, say) cannot be one script run. Each
    /// slot's limits are decided by their own run, all at once; if any run
    /// denies, the runs that charged are refunded, so a denied request
    /// still charges nothing. What is lost is only the atomicity between
    /// the slots: for the time of one round trip, a request that is then
    /// denied holds units of the other slots' counters, which can make a
    /// concurrent request on those counters be denied (never admitted over
    /// the limit). On one Redis or behind Sentinel every check is one run.
    pub(super) async fn check_across_slots(
        &self,
        check: &Check,
    ) -> Result<CheckResult, LimiterError> {
        let groups = by_slot(&check.limits, &check.subject);
        // A reservation with an id has each run's charge recorded in that
        // run's slot, by the run's first limit, as `forget_ask` finds it
        // (no lease is granted across slots, so nothing else is).
        let recorded = super::lost::record_id(check).filter(|_| check.receipt);
        let runs = futures_util::future::join_all(groups.iter().map(|(slot, members)| {
            // Each limit carries its own subject from here on (the refund
            // needs it without the check).
            let limits: Vec<Limit> = members
                .iter()
                .filter_map(|&i| check.limits.get(i))
                .map(|limit| Limit {
                    subject: Some(limit.subject_in(check).to_string()),
                    ..limit.clone()
                })
                .collect();
            self.decide_part(check, *slot, limits, recorded)
        }))
        .await;
        let allowed = runs
            .iter()
            .all(|r| matches!(r, Ok((_, result)) if result.allowed));
        if !allowed {
            // Give back what the runs that admitted charged. A run that
            // recorded its charge is given back by its record, once: its
            // caller may name the check lost too.
            let refunds = runs.iter().filter_map(|run| {
                let (limits, result) = run.as_ref().ok()?;
                result.allowed.then_some(async move {
                    match recorded {
                        Some(id) => self
                            .forget_part(&check.subject, limits, id, 0)
                            .await
                            .map(drop),
                        None => self.refund(limits, result).await,
                    }
                })
            });
            for refund in futures_util::future::join_all(refunds).await {
                if let Err(e) = refund {
                    tracing::warn!(error = %e, "could not refund a check denied in another slot");
                }
            }
        }
        let mut statuses: Vec<Option<LimitStatus>> = vec![None; check.limits.len()];
        let mut receipts_of: Vec<Option<Receipt>> = vec![None; check.limits.len()];
        for (run, (_, members)) in runs.into_iter().zip(&groups) {
            let (limits, result) = run?;
            // Every admitted run's receipts, asked for or not: meshlimitd
            // gives back by them what an abandoned check was charged (the
            // API sends its caller only those it asked for).
            for (&i, receipt) in members.iter().zip(result.receipts.into_iter().flatten()) {
                if let Some(slot) = receipts_of.get_mut(i) {
                    *slot = Some(receipt);
                }
            }
            for ((&i, mut status), limit) in members.iter().zip(result.limits).zip(&limits) {
                if !allowed && result.allowed && status.allowed {
                    // Refunded: what remains is as before the charge.
                    status.remaining = (status.remaining + limit.cost).min(status.limit);
                }
                if let Some(slot) = statuses.get_mut(i) {
                    *slot = Some(status);
                }
            }
        }
        let limits = statuses.into_iter().flatten().collect::<Vec<_>>();
        if limits.len() != check.limits.len() {
            return Err(LimiterError::Reply("a limit was not decided".into()));
        }
        let receipts = allowed
            .then(|| receipts_of.into_iter().collect::<Option<Vec<_>>>())
            .flatten();
        Ok(CheckResult {
            allowed,
            limits,
            receipts,
            leased: 0,
        })
    }

    /// Decides the limits of `check` that live in `slot` (each carrying
    /// its own subject) in one run: what it charged, and where; recorded
    /// under `record` when set.
    async fn decide_part(
        &self,
        check: &Check,
        slot: u16,
        limits: Vec<Limit>,
        record: Option<u64>,
    ) -> Result<(Vec<Limit>, CheckResult), LimiterError> {
        let mut invocation = self.scripts.check.prepare_invoke();
        let nonce = self.add_fixed_args(&mut invocation);
        let part = Check {
            subject: check.subject.clone(),
            limits: limits.clone(),
            receipt: check.receipt,
            lease: None,
            trace: None,
            id: record.unwrap_or(0),
        };
        // No lease: a check spread over slots is decided per request.
        // Epochs for the receipts asked; a refund when another slot
        // denies follows its charge by a round trip, and goes without.
        // Recorded when `record` is set (the part's id; no receipt, no id).
        let grant = self.grant_key(&part);
        let follow = super::follow(&part, grant.is_some());
        invocation
            .arg(0)
            .arg(1)
            .arg(u8::from(follow.grant))
            .arg(follow.epochs as u8);
        self.add_limits(&mut invocation, &part, &limits);
        self.add_follow(&mut invocation, &part, &limits, grant);
        let what = super::script_label(std::iter::once(check));
        let values = self.run(slot, &invocation, what).await?;
        let (clock, reply) = split_clock(&values)?;
        let mut result = parse_reply(&part, reply)?;
        let epochs = super::epochs(&part, reply);
        result.receipts = receipts(&result, clock, &nonce, &epochs);
        Ok((limits, result))
    }

    /// Undoes the charge of one [`Limiter::check_across_slots`] run: a
    /// settlement of what it charged at 0 units used.
    async fn refund(&self, limits: &[Limit], result: &CheckResult) -> Result<(), LimiterError> {
        let mut refund = Settlement {
            subject: String::new(),
            limits: Vec::new(),
            actual: Vec::new(),
            receipts: Vec::new(),
            id: 0,
        };
        let receipts = result.receipts.iter().flatten();
        for ((limit, status), receipt) in limits.iter().zip(&result.limits).zip(receipts) {
            if !status.allowed {
                continue; // a shadow limit that did not fit was not charged
            }
            // Settled against the limit the run applied (a live override).
            refund.limits.push(Limit {
                requests: status.limit,
                ..limit.clone()
            });
            refund.actual.push(0);
            refund.receipts.push(receipt.clone());
        }
        self.settle(&refund).await.map(drop)
    }
}

/// `limits` grouped by the Cluster slot of their subjects (`subject` for
/// those without their own), each group's members in order, the groups in
/// the order of their first member: how a check spread over slots is run,
/// and how its records are found again.
pub(super) fn by_slot(limits: &[Limit], subject: &str) -> Vec<(u16, Vec<usize>)> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, limit) in limits.iter().enumerate() {
        let slot = keys::tag_slot(&keys::subject_tag(limit.subject_or(subject)));
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups
}
