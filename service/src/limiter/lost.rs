//! Lease asks and reservations whose answers were lost: what their scripts
//! charged goes back, exactly once.
//!
//! A check that asks for a lease with an id, or reserves with one (a token
//! budget's, `Check::id`), has what it was charged recorded by the script
//! that admits it (`decide.lua`: `<units charged on each limit> <clock>
//! <nonce>` under the grant key, for ten seconds). When the answer never reaches
//! its caller (a timeout, a reset, meshlimitd's own 503 while the script
//! ran on), the caller names the ask in its next call, and meshlimitd
//! gives back what the record says, in a settlement whose id is the
//! ask's: meshlimitd applies a settlement's id once, so a second naming,
//! meshlimitd's own give-back of the same decision, or a give-back tried
//! again after its Redis call failed (perhaps applied) gives nothing more.
//! An ask named before its script ran finds no record, and marks it
//! `lost` (only if it is still missing): the script then charges nothing
//! (its caller decided the request without meshlimitd). What goes back is
//! what the record says each limit was charged, never what the naming
//! claims.

use meshlimit_protocol::{Check, Limit, LostAsk, Receipt, Settlement};

use super::{Limiter, LimiterError};
use crate::keys;

/// How long a `lost` mark lives (as long as a grant's record).
const LOST_MARK_MS: u64 = meshlimit_protocol::bounds::GRANT_RECORD_MS;

impl Limiter {
    /// Gives back what the lost ask `lost` was granted, if it was and
    /// nothing gave it back yet, less `keep` units on every limit (the
    /// request's own, when it was answered): the units given back on its
    /// first limit.
    pub async fn forget_ask(&self, lost: &LostAsk, keep: u64) -> Result<u64, LimiterError> {
        // On a Cluster, a check whose limits live in several slots was
        // decided by one run per slot, each recording its own charge in
        // its own slot (`check_across_slots`): each part goes back by its
        // own record, once.
        let groups = if self.backend.is_cluster() {
            super::slots::by_slot(&lost.limits, &lost.subject)
        } else {
            vec![(0, (0..lost.limits.len()).collect())]
        };
        let mut first = None;
        for (_, members) in groups {
            let limits: Vec<Limit> = members
                .iter()
                .filter_map(|&i| lost.limits.get(i))
                .map(|l| Limit {
                    subject: Some(l.subject_or(&lost.subject).to_string()),
                    ..l.clone()
                })
                .collect();
            let units = self
                .forget_part(&lost.subject, &limits, lost.id, keep)
                .await?;
            first.get_or_insert(units);
        }
        Ok(first.unwrap_or(0))
    }

    /// [`Limiter::forget_ask`] for `limits` (each with its own subject),
    /// all in one slot, whose run recorded its charge under `id` by the
    /// first of them: the units given back on that one.
    pub(super) async fn forget_part(
        &self,
        subject: &str,
        limits: &[Limit],
        id: u64,
        keep: u64,
    ) -> Result<u64, LimiterError> {
        let Some(first) = limits.first() else {
            return Ok(0);
        };
        let key = keys::grant_key(
            &self.prefix,
            &keys::subject_tag(first.subject_or(subject)),
            id,
        );
        // A record, a mark, or nothing yet: marked lost if still missing,
        // and read again if the script wrote it meanwhile.
        let mut record = None;
        for _ in 0..2 {
            let mut read = redis::pipe();
            read.cmd("GET").arg(&key);
            let (found,): (Option<String>,) = self.query_timed(&read).await?;
            if found.is_some() {
                record = found;
                break;
            }
            let mut mark = redis::pipe();
            mark.cmd("SET")
                .arg(&key)
                .arg("lost")
                .arg("NX")
                .arg("PX")
                .arg(LOST_MARK_MS);
            let (marked,): (Option<String>,) = self.query_timed(&mark).await?;
            if marked.is_some() {
                return Ok(0);
            }
        }
        let Some((units, clock_us, nonce)) = record.as_deref().and_then(parse_record) else {
            return Ok(0);
        };
        // What the record says each limit was charged: never what the
        // naming claims.
        let Some(units) = per_limit(&units, limits.len()) else {
            return Ok(0);
        };
        let settlement = Settlement {
            subject: subject.to_string(),
            limits: limits
                .iter()
                .zip(&units)
                .map(|(l, units)| Limit {
                    cost: *units,
                    ..l.clone()
                })
                .collect(),
            actual: units.iter().map(|u| keep.min(*u)).collect(),
            receipts: (1..=limits.len())
                .map(|place| Receipt {
                    clock_us,
                    nonce: nonce.to_string(),
                    place: place as u32,
                    // The record itself is the proof: it lives beside the
                    // counters, and is lost with them.
                    epoch: 0,
                    units: 0,
                    mac: String::new(),
                })
                .collect(),
            // Applied once, whoever gives it back and however often.
            id,
        };
        if self.settle_once(&settlement).await? {
            let first = units.first().copied().unwrap_or(0);
            Ok(first.saturating_sub(keep))
        } else {
            Ok(0)
        }
    }
}

/// The lost ask that names `check`'s lease ask (its own decision, given
/// back by meshlimitd), if it asked with an id.
pub fn lost_ask_of(check: &Check) -> Option<LostAsk> {
    let id = record_id(check)?;
    Some(LostAsk {
        subject: check.subject.clone(),
        limits: check.limits.clone(),
        id,
    })
}

/// The id `check`'s script records its charge under, if any: a lease
/// ask's (with units), or a reservation's (see `Check::id`).
pub(crate) fn record_id(check: &Check) -> Option<u64> {
    let ask = check.lease.filter(|a| a.units > 0).map(|a| a.id);
    ask.or(check.receipt.then_some(check.id))
        .filter(|id| *id != 0)
}

/// A record: the units its check was charged on each limit (cost and
/// lease; one figure for every limit in records of older meshlimitds),
/// the run's clock and the check's nonce; `None` for a `lost` mark.
fn parse_record(record: &str) -> Option<(Vec<u64>, u64, &str)> {
    let mut parts = record.split(' ');
    let units = parts
        .next()?
        .split(',')
        .map(|u| u.parse().ok())
        .collect::<Option<Vec<u64>>>()?;
    let clock_us = parts.next()?.parse().ok()?;
    let nonce = parts.next().filter(|n| !n.is_empty())?;
    parts.next().is_none().then_some((units, clock_us, nonce))
}

/// The units each of `limits` limits was charged, by a record's figures:
/// one for all, or one each; `None` when they do not match the limits.
fn per_limit(units: &[u64], limits: usize) -> Option<Vec<u64>> {
    match units {
        [all] => Some(vec![*all; limits]),
        each if each.len() == limits => Some(each.to_vec()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_read_whole_and_marks_are_not_records() {
        assert_eq!(
            parse_record("41 1700000000000000 ab.1.2"),
            Some((vec![41], 1_700_000_000_000_000, "ab.1.2"))
        );
        assert_eq!(
            parse_record("300,1,0 17 n"),
            Some((vec![300, 1, 0], 17, "n"))
        );
        for bad in [
            "lost",
            "",
            "41",
            "41 x n",
            "41 1 ",
            "41 1 n extra",
            "4,,1 1 n",
            "4,x 1 n",
            "-1 1 n",
        ] {
            assert_eq!(parse_record(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_records_figures_are_one_for_all_limits_or_one_each() {
        assert_eq!(per_limit(&[5], 3), Some(vec![5, 5, 5]));
        assert_eq!(per_limit(&[300, 1], 2), Some(vec![300, 1]));
        assert_eq!(per_limit(&[300, 1], 3), None);
        assert_eq!(per_limit(&[], 1), None);
    }
}
