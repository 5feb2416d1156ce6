//! Receipts that cannot be forged: a MAC over where a check was charged,
//! for whom, on which limit and for how many units.
//!
//! A settlement gives units back (a lease's unused part, a reservation's
//! refund) wherever its receipts point. Unsigned, anyone who reaches the
//! check API could give back another subject's units by naming them, or
//! claim a larger reservation than was charged. With a secret, each
//! receipt carries `units` (what that run charged on the limit: the
//! check's cost and its lease) and a MAC over them, the run's clock,
//! nonce and place, the subject's epoch, the subject and the limit's
//! name, algorithm, window and calendar. A settlement whose receipts do not verify, or that
//! reserves more than they cover, is refused as a whole, before Redis.
//!
//! The key is derived from the proxies' shared token
//! (`--auth-token-file`), which every meshlimitd of a fleet has: a receipt
//! signed by one instance is settled by any other. Rotating the token
//! voids the receipts outstanding: their returns are refused, the units
//! stay charged until their windows end (never more admitted).

use hmac::{Hmac, KeyInit, Mac};
use meshlimit_protocol::{
    Check, CheckOutcome, CheckRequest, CheckResponse, CheckResult, Limit, Receipt, Settlement,
};
use sha2::Sha256;

/// What the receipt key is derived for: never the token itself, so a MAC
/// tells nothing of the token.
const KEY_LABEL: &[u8] = b"meshlimit receipts v1";
/// Bytes of the MAC kept (128 bits), hex in the receipt.
const MAC_BYTES: usize = 16;

/// Signs and verifies receipts with the fleet's key.
#[derive(Clone)]
pub struct ReceiptKey {
    /// HMAC-SHA256 keyed with the fleet's key, cloned for each MAC.
    keyed: Hmac<Sha256>,
}

impl std::fmt::Debug for ReceiptKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReceiptKey(..)")
    }
}

/// Why a settlement's receipts were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forged {
    /// `receipts[i]` was not signed by this fleet for this subject and limit.
    NotSigned(usize),
    /// `limits[i].cost` is more than `receipts[i]` covers.
    TooMany { place: usize, covered: u64 },
}

impl std::fmt::Display for Forged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Forged::NotSigned(i) => write!(
                f,
                "receipts[{i}]: not signed by this fleet for this subject and limit"
            ),
            Forged::TooMany { place, covered } => write!(
                f,
                "limits[{place}].cost: more than receipts[{place}] covers ({covered})"
            ),
        }
    }
}

/// Whether the caller gets `result`'s receipts: it asked for them (a
/// reservation), or it was granted a lease (returned by them). An
/// admitted check's result carries receipts all the same, for meshlimitd
/// to give back what it was charged should its caller give up on the
/// answer (`give_back`); those are neither signed nor sent.
pub fn for_the_caller(check: &Check, result: &CheckResult) -> bool {
    check.receipt || result.leased > 0
}

/// Takes out of a call's answer the receipts its caller did not ask for
/// (see [`for_the_caller`]).
pub fn keep_the_callers(request: &CheckRequest, response: &mut CheckResponse) {
    for (check, outcome) in request.checks.iter().zip(response.results.iter_mut()) {
        if let CheckOutcome::Decided(result) = outcome {
            if !for_the_caller(check, result) {
                result.receipts = None;
            }
        }
    }
}

impl ReceiptKey {
    /// The key of a fleet whose proxies share `token`.
    pub fn from_token(token: &str) -> Result<Self, hmac::digest::InvalidLength> {
        let mut derive = Hmac::<Sha256>::new_from_slice(token.as_bytes())?;
        derive.update(KEY_LABEL);
        let key = derive.finalize().into_bytes();
        Ok(ReceiptKey {
            keyed: Hmac::<Sha256>::new_from_slice(&key)?,
        })
    }

    /// Signs the receipts of an admitted check's result: each covers its
    /// limit's cost and the lease granted with it.
    pub fn sign(&self, check: &Check, result: &mut CheckResult) {
        let leased = result.leased;
        let Some(receipts) = result.receipts.as_mut() else {
            return;
        };
        for receipt in receipts {
            let place = receipt.place as usize;
            let Some(limit) = place.checked_sub(1).and_then(|i| check.limits.get(i)) else {
                continue;
            };
            receipt.units = limit.cost.saturating_add(leased);
            receipt.mac = hex::encode(self.mac(&check.subject, limit, receipt));
        }
    }

    /// Whether every receipt of `settlement` was signed by this fleet for
    /// its subject and limit, and covers what the settlement reserves.
    pub fn verify(&self, settlement: &Settlement) -> Result<(), Forged> {
        for (i, (limit, receipt)) in settlement
            .limits
            .iter()
            .zip(&settlement.receipts)
            .enumerate()
        {
            let expected = self.mac(&settlement.subject, limit, receipt);
            let presented = hex::decode(&receipt.mac).unwrap_or_default();
            if !super::auth::same_secret(&presented, &expected) {
                return Err(Forged::NotSigned(i));
            }
            if limit.cost > receipt.units {
                return Err(Forged::TooMany {
                    place: i,
                    covered: receipt.units,
                });
            }
        }
        Ok(())
    }

    /// The MAC of `receipt` for `limit` of a check of `subject`: every
    /// field length-prefixed, so no two receipts encode alike.
    fn mac(&self, subject: &str, limit: &Limit, receipt: &Receipt) -> [u8; MAC_BYTES] {
        let mut mac = self.keyed.clone();
        let calendar = limit
            .calendar
            .as_ref()
            .map(|c| c.key_suffix())
            .unwrap_or_default();
        for field in [
            limit.subject_or(subject).as_bytes(),
            limit.name.as_bytes(),
            limit.algorithm.short_name().as_bytes(),
            calendar.as_bytes(),
            receipt.nonce.as_bytes(),
        ] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        for number in [
            limit.window_ms,
            receipt.clock_us,
            u64::from(receipt.place),
            receipt.epoch,
            receipt.units,
        ] {
            mac.update(&number.to_be_bytes());
        }
        let mut out = [0u8; MAC_BYTES];
        for (o, b) in out.iter_mut().zip(mac.finalize().into_bytes()) {
            *o = b;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshlimit_protocol::{Algorithm, CheckRequest};

    fn check(subject: &str, cost: u64) -> Check {
        let body = format!(
            r#"{{"checks":[{{"subject":"{subject}","limits":[
                {{"name":"api/minute","algorithm":"fixed_window","requests":100,"window_ms":60000,"cost":{cost}}},
                {{"name":"api/day","algorithm":"fixed_window","requests":1000,"window_ms":86400000,"cost":1}}]}}]}}"#
        );
        let mut request: CheckRequest = serde_json::from_str(&body).unwrap();
        request.checks.remove(0)
    }

    fn admitted(leased: u64) -> CheckResult {
        CheckResult {
            allowed: true,
            limits: Vec::new(),
            leased,
            receipts: Some(
                (1..=2)
                    .map(|place| Receipt {
                        clock_us: 1_700_000_000_000_000,
                        nonce: "ab.1".into(),
                        place,
                        epoch: 0,
                        units: 0,
                        mac: String::new(),
                    })
                    .collect(),
            ),
        }
    }

    /// The settlement a filter sends back for `check`'s receipts.
    fn settlement(check: &Check, cost: u64, receipts: &[Receipt]) -> Settlement {
        Settlement {
            subject: check.subject.clone(),
            limits: check
                .limits
                .iter()
                .map(|l| Limit { cost, ..l.clone() })
                .collect(),
            actual: vec![0; check.limits.len()],
            receipts: receipts.to_vec(),
            id: 0,
        }
    }

    #[test]
    fn a_signed_receipt_settles_what_it_covers_and_no_more() {
        let key = ReceiptKey::from_token("0123456789abcdef").unwrap();
        let alice = check("alice", 5);
        let mut result = admitted(40);
        key.sign(&alice, &mut result);
        let receipts = result.receipts.unwrap();
        assert_eq!(receipts[0].units, 45);
        assert_eq!(receipts[1].units, 41);
        assert_eq!(receipts[0].mac.len(), 2 * MAC_BYTES);
        // The lease's 40 units given back: covered on both limits.
        assert_eq!(key.verify(&settlement(&alice, 40, &receipts)), Ok(()));
        assert_eq!(
            key.verify(&settlement(&alice, 42, &receipts)),
            Err(Forged::TooMany {
                place: 1,
                covered: 41
            })
        );
    }

    #[test]
    fn a_receipt_cannot_be_moved_to_another_subject_limit_or_amount() {
        let key = ReceiptKey::from_token("0123456789abcdef").unwrap();
        let alice = check("alice", 1);
        let mut result = admitted(40);
        key.sign(&alice, &mut result);
        let receipts = result.receipts.unwrap();
        // Another subject.
        let bob = check("bob", 1);
        assert_eq!(
            key.verify(&settlement(&bob, 10, &receipts)),
            Err(Forged::NotSigned(0))
        );
        // Another limit: the receipts swapped between the two limits.
        let swapped = [receipts[1].clone(), receipts[0].clone()];
        assert_eq!(
            key.verify(&settlement(&alice, 10, &swapped)),
            Err(Forged::NotSigned(0))
        );
        // A larger amount claimed, or the window changed.
        let mut inflated = receipts.clone();
        inflated[0].units = 1_000_000;
        assert_eq!(
            key.verify(&settlement(&alice, 10, &inflated)),
            Err(Forged::NotSigned(0))
        );
        let mut hourly = settlement(&alice, 10, &receipts);
        hourly.limits[0].window_ms = 3_600_000;
        assert_eq!(key.verify(&hourly), Err(Forged::NotSigned(0)));
        // Unsigned, or signed by another fleet.
        let mut unsigned = receipts.clone();
        unsigned[0].mac.clear();
        assert_eq!(
            key.verify(&settlement(&alice, 10, &unsigned)),
            Err(Forged::NotSigned(0))
        );
        let other = ReceiptKey::from_token("fedcba9876543210").unwrap();
        assert_eq!(
            other.verify(&settlement(&alice, 10, &receipts)),
            Err(Forged::NotSigned(0))
        );
        assert_eq!(alice.limits[0].algorithm, Algorithm::FixedWindow);
    }
}
