//! Units charged for an answer that does not reach its caller, given back.
//!
//! Three ways an admitted check's lease (or reservation) can be charged in
//! Redis with no caller holding it: the caller gave up before the
//! decision finished (its deadline passed: [`give_back`]); the decision
//! finished late, and its answer might arrive after the caller gave up
//! ([`withhold_leases`]: the answer goes without its lease); or the answer
//! left and was lost on the way (the caller names the ask in its next
//! call: [`forget_all`]). A check that asked its lease with an id has its
//! grant recorded by the script (see `limiter::lost`), and every one of
//! these gives it back through that record, in a settlement whose id is
//! the ask's: whichever comes first gives the units back, the others find
//! it applied.
//! A check without an id is given back by its receipts, as before ids.

use meshlimit_protocol::{Check, CheckOutcome, CheckRequest, LostAsk, Receipt, Settlement};
use tracing::warn;

use super::decide::{settle_all, Decided};
use super::AppState;
use crate::limiter::lost_ask_of;

/// Units to give back for one check.
pub enum GiveBack {
    /// By its receipts: a settlement at its `actual`.
    Settle(Settlement),
    /// By its grant record: all the record says, less `keep` units on
    /// every limit (the request's own cost when the request was answered).
    Forget { ask: LostAsk, keep: u64 },
}

/// What a call's admitted checks were granted or reserved, once its
/// caller no longer waits for the answer (its deadline passed while the
/// scripts ran): the caller decides those requests without meshlimitd,
/// so a lease or reservation charged for it would only keep units from
/// every other replica until its window ends, and the request's own cost
/// would count it twice (by the caller's fallback, and in Redis). Each
/// admitted check is given back all it was charged, its cost and its
/// lease: by its grant record when it named its ask, else by its
/// receipts (every admitted result has them; those the caller did not
/// ask for are signed here, as the settlement is verified like any
/// other). Returns the units given back.
pub async fn give_back(state: &AppState, request: &CheckRequest, decided: &Decided) -> u64 {
    let Decided::Answered(response) = decided else {
        return 0;
    };
    let give: Vec<GiveBack> = request
        .checks
        .iter()
        .zip(&response.results)
        .filter_map(|(check, outcome)| match outcome {
            CheckOutcome::Decided(result) if result.allowed => {
                // Recorded (a lease granted, or a reservation, with an
                // id): by the record, which its caller may name too.
                if result.leased > 0 || check.receipt {
                    if let Some(ask) = lost_ask_of(check) {
                        return Some(GiveBack::Forget { ask, keep: 0 });
                    }
                }
                let mut signed = result.clone();
                if let Some(key) = &state.receipt_key {
                    key.sign(check, &mut signed);
                }
                Some(GiveBack::Settle(charged(
                    check,
                    result.leased,
                    signed.receipts?,
                    false,
                )))
            }
            _ => None,
        })
        .collect();
    let units = apply(state, &give).await;
    state.metrics.abandoned_given_back(units);
    units
}

/// Takes back the leases of a call decided late (after half the caller's
/// budget): its answer may well reach the caller after the caller's own
/// timeout (which began before meshlimitd read the call, and ends when
/// Envoy says so), and a grant in a lost answer is charged to nobody. So
/// a late answer carries no lease: each admitted check's `leased` is 0
/// (its statuses' `remaining` counts those units again; the answer then
/// keeps only the receipts its check asked for). Returns what
/// gives the leased units back, to be applied after the answer has gone
/// (the request's own cost stays charged).
pub fn withhold_leases(request: &CheckRequest, decided: &mut Decided) -> Vec<GiveBack> {
    let Decided::Answered(response) = decided else {
        return Vec::new();
    };
    let mut give = Vec::new();
    for (check, outcome) in request.checks.iter().zip(response.results.iter_mut()) {
        let CheckOutcome::Decided(result) = outcome else {
            continue;
        };
        if !result.allowed || result.leased == 0 {
            continue;
        }
        let Some(receipts) = result.receipts.clone() else {
            continue;
        };
        let leased = std::mem::take(&mut result.leased);
        // A leasable check has one cost on every limit.
        let cost = check.limits.first().map_or(0, |l| l.cost);
        give.push(match lost_ask_of(check) {
            Some(ask) => GiveBack::Forget { ask, keep: cost },
            None => GiveBack::Settle(charged(check, leased, receipts, true)),
        });
        for status in &mut result.limits {
            status.remaining = status.remaining.saturating_add(leased).min(status.limit);
        }
    }
    give
}

/// The settlement of what `check` was charged (its cost and `leased`
/// units) where `receipts` say: given back whole, or all but the
/// request's own cost when `keep_cost` (its request was answered).
fn charged(check: &Check, leased: u64, receipts: Vec<Receipt>, keep_cost: bool) -> Settlement {
    Settlement {
        subject: check.subject.clone(),
        limits: check
            .limits
            .iter()
            .map(|l| meshlimit_protocol::Limit {
                cost: l.cost + leased,
                ..l.clone()
            })
            .collect(),
        actual: check
            .limits
            .iter()
            .map(|l| if keep_cost { l.cost } else { 0 })
            .collect(),
        receipts,
        id: 0,
    }
}

/// Gives back what each lost ask was granted, once: the units.
pub async fn forget_all(state: &AppState, lost: &[LostAsk]) -> u64 {
    let give: Vec<GiveBack> = lost
        .iter()
        .enumerate()
        .filter_map(|(i, ask)| match super::validate::validate_lost(i, ask) {
            Ok(()) => Some(GiveBack::Forget {
                ask: ask.clone(),
                keep: 0,
            }),
            Err(reason) => {
                state.metrics.check_failure("invalid");
                if let Some(suppressed) = state.error_log.allow() {
                    warn!(%reason, suppressed, "refused a lost ask");
                }
                None
            }
        })
        .collect();
    apply(state, &give).await
}

/// The pauses between attempts at a lost ask's give-back: 25 ms, then
/// four times longer each, the last 1.6 s (all within the grant record's
/// ten seconds).
const FORGET_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(25);
const FORGET_RETRY_LAST: std::time::Duration = std::time::Duration::from_millis(1_600);

/// Applies give-backs: the units given back in all (on each check's
/// first limit). Those given back by grant records are counted apart
/// (`meshlimitd_lost_ask_units_given_back_total`).
pub async fn apply(state: &AppState, give: &[GiveBack]) -> u64 {
    let settlements: Vec<Settlement> = give
        .iter()
        .filter_map(|g| match g {
            GiveBack::Settle(s) => Some(s.clone()),
            GiveBack::Forget { .. } => None,
        })
        .collect();
    let forgets = futures_util::future::join_all(give.iter().filter_map(|g| match g {
        GiveBack::Forget { ask, keep } => Some(async move {
            // Tried again when Redis fails (a stall, a failover): a give-back
            // is applied once whatever the attempts (its settlement's id).
            let mut pause = FORGET_RETRY_FIRST;
            loop {
                match state.limiter.forget_ask(ask, *keep).await {
                    Ok(units) => break units,
                    Err(_) if pause <= FORGET_RETRY_LAST => {
                        tokio::time::sleep(pause).await;
                        pause *= 4;
                    }
                    Err(e) => {
                        if let Some(suppressed) = state.error_log.allow() {
                            warn!(error = %e, suppressed, "cannot give back a lost ask's grant; it stays charged until its window ends");
                        }
                        break 0;
                    }
                }
            }
        }),
        GiveBack::Settle(_) => None,
    }));
    let (forgotten, settled) = tokio::join!(forgets, settle_all(state, &settlements));
    let forgotten: u64 = forgotten.iter().sum();
    state.metrics.lost_asks_given_back(forgotten);
    let mut units = forgotten;
    for (settlement, outcome) in settlements.iter().zip(settled) {
        if let meshlimit_protocol::SettleOutcome::Settled { .. } = outcome {
            units += settlement
                .limits
                .first()
                .zip(settlement.actual.first())
                .map_or(0, |(l, actual)| l.cost.saturating_sub(*actual));
        }
    }
    units
}
