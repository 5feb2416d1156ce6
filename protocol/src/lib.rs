//! The check API between the meshlimit filter and `meshlimitd`.
//!
//! `POST /v1/check` takes a [`CheckRequest`] and answers a [`CheckResponse`].
//! Both sides depend on this crate so the two cannot drift: the filter
//! serializes what the service deserializes, field for field.
//!
//! A request is a batch of [`Check`]s: one per HTTP request when the filter
//! calls per request, many when group commit coalesces the checks of
//! concurrent requests into one call. Each check is decided on its own and
//! atomically: all of its limits admit the request, or none of them
//! consumes quota. One check's bad input never costs another check its
//! decision: meshlimitd answers a check it cannot decide with a
//! [`CheckFailure`] in its place in the batch. [`bounds`] holds what makes
//! a limit valid, for both sides.
//!
//! Rolling upgrades: both sides ignore fields they do not know, so a newer
//! peer may add optional fields without breaking an older one.
//!
//! This crate does no I/O and knows nothing of proxy-wasm or tokio.

// Tests may unwrap and index: a failing test should panic loudly.
#![cfg_attr(
    test,
    allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

use serde::{Deserialize, Serialize};

pub mod bounds;
pub mod calendar;
pub mod trace;

pub use calendar::{Calendar, CalendarUnit};

/// Path of the check endpoint on `meshlimitd`.
pub const CHECK_PATH: &str = "/v1/check";

/// Request header with the caller's timeout for the call, in milliseconds:
/// meshlimitd starts no work the caller will not wait for.
pub const TIMEOUT_HEADER: &str = "x-meshlimit-timeout-ms";

/// A batch of checks, decided independently of each other, and of
/// settlements of earlier reservations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckRequest {
    #[serde(default)]
    pub checks: Vec<Check>,
    /// Settlements of earlier checks whose cost was a reservation (token
    /// budgets: the cost is known only after the response). They travel in
    /// the same calls as checks; answered in [`CheckResponse::settled`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settlements: Vec<Settlement>,
    /// Lease asks whose answers never came (the call timed out, or failed
    /// while its scripts may have run): what they were granted goes back,
    /// once (see [`LeaseAsk::id`]). Nothing is answered for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost: Vec<LostAsk>,
}

/// A lease ask, or a reservation (see [`Check::id`]), whose answer was
/// lost: the check it came with (its subject and limits, as sent) and its
/// id. What goes back is what the script recorded, whatever costs the
/// limits name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostAsk {
    pub subject: String,
    pub limits: Vec<Limit>,
    pub id: u64,
}

/// The actual cost of a check admitted earlier with a reserved one: the
/// difference is charged or given back, in the very counters (and windows)
/// the reservation was charged to, whatever the limit's state now. A
/// settlement is never refused for the limit being exhausted: the units
/// were spent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settlement {
    /// The reserved check's subject.
    pub subject: String,
    /// The reserved check's limits, each with its reserved units as `cost`.
    pub limits: Vec<Limit>,
    /// Units actually used, one per limit.
    pub actual: Vec<u64>,
    /// Where the reservation was charged, one per limit (the check's
    /// [`CheckResult::receipts`]).
    pub receipts: Vec<Receipt>,
    /// Makes the settlement safe to send again (0: none). meshlimitd
    /// applies a settlement with an id once: a second one with the same
    /// id and subject, within a minute (`bounds::SETTLEMENT_ID_MS`),
    /// changes nothing. The filter gives its lease returns ids, so that a
    /// return whose call failed (perhaps applied, perhaps lost) is sent
    /// again rather than lost.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub id: u64,
}

/// Where one limit of an admitted check was charged: the run's clock, its
/// nonce and the limit's place in the run. A settlement finds the window,
/// or the sliding log's members, from it.
///
/// When meshlimitd has a shared secret (`--auth-token-file`), a receipt
/// also says how many units it covers and carries a MAC over all of it,
/// the subject and the limit: a settlement can then give back only what a
/// real check of that very subject and limit was charged. Callers keep
/// receipts as they came; older peers ignore the two fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    pub clock_us: u64,
    pub nonce: String,
    pub place: u32,
    /// The epoch of the subject's counters when that run charged them (0:
    /// unknown, as on a sliding log, which needs none). Redis that lost
    /// the counters since (a restart) has another, and a return or refund
    /// on this receipt gives nothing back: the counter of the same name is
    /// a new one that never held these units.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
    /// Units charged on the limit by that run (its cost and its lease):
    /// a settlement of this receipt reserves at most these.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub units: u64,
    /// The MAC meshlimitd put on the receipt (hex), empty without a secret.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
}

/// One HTTP request's worth of limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// Who is being limited (the client id as the filter derived it, e.g.
    /// `hdr:x-api-key:abc` or `ip:10.0.0.1`), for every limit that names no
    /// subject of its own. Untrusted client input: the service escapes or
    /// hashes it before it becomes part of a key.
    pub subject: String,
    /// Every limit that applies to the request; all are decided together.
    pub limits: Vec<Limit>,
    /// Ask for [`CheckResult::receipts`]: the check's cost is a
    /// reservation that a [`Settlement`] will adjust.
    #[serde(default, skip_serializing_if = "is_false")]
    pub receipt: bool,
    /// Ask for a quota lease: besides the request's own cost, charge up to
    /// `units` more on every limit, for this Envoy to admit later requests
    /// of the same check without calling (see [`LeaseAsk`]). Granted units
    /// come back in [`CheckResult::leased`], with receipts to return what
    /// goes unused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseAsk>,
    /// The trace context of the request this check decides, as a W3C
    /// `traceparent` value (see [`trace`]): meshlimitd's span for the
    /// check is its child. Client input, parsed strictly; a malformed one
    /// is ignored, never an error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
    /// A reservation's id (random, per caller), 0 for none. With an id
    /// and [`Check::receipt`], the script that charges the reservation
    /// records what it charged on each limit, for a short while, under the
    /// id, as it does a lease's grant (see [`LeaseAsk::id`]): if the answer
    /// is lost, the caller names the check in [`CheckRequest::lost`] and
    /// the reservation goes back, exactly once; one named lost before its
    /// script ran is charged nothing.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub id: u64,
}

/// A quota lease asked with a check: at most `units` more units on every
/// limit, and never more than what remains of the tightest limit, after
/// the request, divided by `share` (so the last units of a window are
/// decided one by one, and no replica holds what another needs). Only
/// when the request is admitted; never on a sliding log, whose members
/// carry times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseAsk {
    pub units: u64,
    pub share: u64,
    /// The ask's id (random, per caller), 0 for none. With an id, the
    /// script that grants the lease also records the grant, for a short
    /// while, under the id: if its answer is lost, the caller names the
    /// ask in [`CheckRequest::lost`] and the grant goes back, exactly once
    /// (a record given back is marked, and an ask named lost before its
    /// script ran is charged nothing: its caller decided the request without
    /// meshlimitd).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub id: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn default_cost() -> u64 {
    1
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One limit to apply to a subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limit {
    /// Stable name of the limit, `rule/limit`; part of the counter's key, so
    /// two rules never share a counter by accident.
    pub name: String,
    /// Requests (cost units) admitted per window.
    pub requests: u64,
    /// Window length in milliseconds.
    pub window_ms: u64,
    pub algorithm: Algorithm,
    /// Units this request takes from the limit (rules may weigh requests).
    #[serde(default = "default_cost")]
    pub cost: u64,
    /// `token_bucket` only: how many units may be spent at once (the
    /// bucket's capacity); `requests` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// Decided and counted, but never the reason a check is denied.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shadow: bool,
    /// Whose counter this limit spends when it is not the check's
    /// subject: a limit counted `by` other attributes than the client
    /// (`hdr:x-tenant:acme|path:/api`, or `*` for one counter for everyone).
    /// Untrusted, like the check's subject.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// `fixed_window` only: windows on calendar edges (a day, a week, a
    /// month at a UTC offset) instead of `window_ms`-long ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calendar: Option<Calendar>,
}

impl Limit {
    /// The most units one request can ever take from this limit.
    pub fn capacity(&self) -> u64 {
        bounds::capacity(self.algorithm, self.requests, self.burst)
    }

    /// The subject whose counter this limit spends in `check`.
    pub fn subject_in<'a>(&'a self, check: &'a Check) -> &'a str {
        self.subject_or(&check.subject)
    }

    /// The limit's own subject, or `default` (the subject of the check or
    /// settlement it belongs to).
    pub fn subject_or<'a>(&'a self, default: &'a str) -> &'a str {
        self.subject.as_deref().unwrap_or(default)
    }
}

/// Counting algorithm of a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Counter per aligned window; cheap, but allows up to 2x the limit
    /// around a window edge.
    FixedWindow,
    /// Sorted set of admitted requests; exact.
    SlidingWindowLog,
    /// Current and previous window weighted by overlap; constant memory.
    SlidingWindowCounter,
    /// GCRA; one timestamp per key.
    TokenBucket,
}

/// How long units leased on a limit of an algorithm may be spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseLife {
    /// Until the window they were charged to resets (the answer's
    /// `reset_after_ms`): a fixed window.
    UntilReset,
    /// Until the end of the window the run's clock is in: a sliding
    /// counter, whose current window holds them.
    UntilWindowEnd,
    /// One lease interval from the grant, and never past the time the
    /// bucket is full again (the answer's `reset_after_ms`): a token
    /// bucket, whose units belong to no window. Spent later, leased units
    /// would come on top of a full bucket: more than `burst` at once.
    OneInterval,
    /// Never leased: a sliding log's members carry their times.
    NotLeased,
}

impl Algorithm {
    /// Every algorithm, in declaration order. Adding one is a checklist the
    /// compiler and the tests walk: [`Algorithm::position`] (and every
    /// other `match` on it) stops compiling, `every_algorithm_is_listed_once`
    /// fails until it is in here, and then meshlimitd's test
    /// `every_algorithm_has_a_branch_in_every_script` and the filter's
    /// `every_algorithm_has_a_fallback` fail until the Lua scripts and the
    /// fallback implement it.
    pub const ALL: [Algorithm; 4] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
        Algorithm::TokenBucket,
    ];

    /// Its place in [`Algorithm::ALL`].
    pub fn position(self) -> usize {
        match self {
            Algorithm::FixedWindow => 0,
            Algorithm::SlidingWindowLog => 1,
            Algorithm::SlidingWindowCounter => 2,
            Algorithm::TokenBucket => 3,
        }
    }

    /// How long units leased on it may be spent.
    pub fn lease_life(self) -> LeaseLife {
        match self {
            Algorithm::FixedWindow => LeaseLife::UntilReset,
            Algorithm::SlidingWindowCounter => LeaseLife::UntilWindowEnd,
            Algorithm::TokenBucket => LeaseLife::OneInterval,
            Algorithm::SlidingWindowLog => LeaseLife::NotLeased,
        }
    }

    /// Short name used in keys and logs.
    pub fn short_name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingWindowLog => "swl",
            Algorithm::SlidingWindowCounter => "swc",
            Algorithm::TokenBucket => "tb",
        }
    }

    /// The name as it appears in configuration and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindowLog => "sliding_window_log",
            Algorithm::SlidingWindowCounter => "sliding_window_counter",
            Algorithm::TokenBucket => "token_bucket",
        }
    }
}

/// Answers to a [`CheckRequest`], in the same order as its checks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResponse {
    pub results: Vec<CheckOutcome>,
    /// One per [`CheckRequest::settlements`], in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settled: Vec<SettleOutcome>,
    /// The fleet-wide enforcement switch as meshlimitd last read it, when
    /// it has one (its admin API is on): the filter's own decisions (a
    /// cached deny, the fallback, `scope: local` rules) obey it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<Enforcement>,
}

/// The fleet-wide enforcement switch (meshlimitd's admin API,
/// `PUT /v1/enforcement`): in `shadow`, every limit is decided and
/// counted but none refuses a request, everywhere, until it is switched
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    Enforce,
    Shadow,
    /// A value a newer meshlimitd may send: read as `enforce`.
    #[serde(other)]
    Unknown,
}

/// What became of one settlement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SettleOutcome {
    /// Applied; what each limit has left now.
    Settled {
        remaining: Vec<u64>,
    },
    Failed(CheckFailure),
}

/// The answer for one check: its decision, or why it has none.
///
/// On the wire the two are told apart by their fields (`allowed` and
/// `limits`, or `error` and `kind`), as `#[serde(untagged)]` would, but
/// read in one pass: an untagged enum buffers every result and tries each
/// variant in turn, which made reading a batch's answer the filter's most
/// expensive step per request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum CheckOutcome {
    Decided(CheckResult),
    Failed(CheckFailure),
}

impl<'de> Deserialize<'de> for CheckOutcome {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        /// Every field either variant has; others are ignored.
        #[derive(Deserialize)]
        struct Either {
            allowed: Option<bool>,
            limits: Option<Vec<LimitStatus>>,
            error: Option<String>,
            kind: Option<FailureKind>,
            receipts: Option<Vec<Receipt>>,
            #[serde(default)]
            leased: u64,
        }
        let e = Either::deserialize(de)?;
        match (e.allowed, e.limits, e.error, e.kind) {
            (Some(allowed), Some(limits), _, _) => Ok(CheckOutcome::Decided(CheckResult {
                allowed,
                limits,
                receipts: e.receipts,
                leased: e.leased,
            })),
            (_, _, Some(error), Some(kind)) => {
                Ok(CheckOutcome::Failed(CheckFailure { error, kind }))
            }
            _ => Err(serde::de::Error::custom(
                "a result needs `allowed` and `limits`, or `error` and `kind`",
            )),
        }
    }
}

/// Why meshlimitd did not decide one check of a batch (the others were
/// decided as usual). Nothing was charged for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckFailure {
    pub error: String,
    pub kind: FailureKind,
}

/// What kept a check from being decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The check breaks a rule of the API ([`bounds`], subject length).
    Invalid,
    /// The Redis node holding its counters did not answer.
    Unavailable,
}

/// The decision for one [`Check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    /// True when every enforced (non-shadow) limit admitted the request and
    /// all were charged.
    pub allowed: bool,
    /// One status per limit of the check, in the same order.
    pub limits: Vec<LimitStatus>,
    /// With [`Check::receipt`] or a granted lease, when admitted: where
    /// each limit was charged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipts: Option<Vec<Receipt>>,
    /// Units leased with [`Check::lease`], charged on every limit beyond
    /// the request's cost (the statuses' `remaining` is after them).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub leased: u64,
}

/// State of one limit after the decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitStatus {
    /// Whether this limit alone would admit the request.
    pub allowed: bool,
    /// The limit's capacity per window.
    pub limit: u64,
    /// Units left in the current window after this decision.
    pub remaining: u64,
    /// Milliseconds until the window's quota is fully restored.
    pub reset_after_ms: u64,
    /// Milliseconds until a request of the same cost could be admitted by this
    /// limit; 0 when allowed.
    pub retry_after_ms: u64,
    /// Echo of [`Limit::shadow`]: this status never denies the check.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shadow: bool,
    /// Why a request can never be admitted (its cost exceeds the capacity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Body of every non-200 answer from `meshlimitd`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

impl CheckResult {
    /// The status that headers should report: the limit with the least
    /// remaining quota (the IETF RateLimit draft says to report the most
    /// constraining one); on a deny, the denying limit whose retry is latest.
    /// Shadow limits never count: they do not decide, so they do not speak.
    pub fn most_constraining(&self) -> Option<&LimitStatus> {
        let enforced = self.limits.iter().filter(|s| !s.shadow);
        if self.allowed {
            enforced.min_by_key(|s| (s.remaining, std::cmp::Reverse(s.reset_after_ms)))
        } else {
            enforced
                .filter(|s| !s.allowed)
                .max_by_key(|s| s.retry_after_ms)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_algorithm_is_listed_once() {
        for (i, a) in Algorithm::ALL.iter().enumerate() {
            assert_eq!(a.position(), i, "{a:?} out of place in Algorithm::ALL");
            let json = serde_json::to_string(a).unwrap();
            assert_eq!(json, format!("\"{}\"", a.as_str()));
        }
    }

    fn status(allowed: bool, remaining: u64, reset: u64, retry: u64) -> LimitStatus {
        LimitStatus {
            allowed,
            limit: 10,
            remaining,
            reset_after_ms: reset,
            retry_after_ms: retry,
            shadow: false,
            reason: None,
        }
    }

    #[test]
    fn request_round_trips_with_default_cost() {
        let json = r#"{"checks":[{"subject":"s","limits":[{"name":"api/m","requests":5,"window_ms":60000,"algorithm":"fixed_window"}]}]}"#;
        let req: CheckRequest = serde_json::from_str(json).unwrap();
        assert_eq!(req.checks[0].limits[0].cost, 1);
        assert!(!req.checks[0].limits[0].shadow);
        assert_eq!(req.checks[0].limits[0].algorithm, Algorithm::FixedWindow);
        let again: CheckRequest =
            serde_json::from_str(&serde_json::to_string(&req).unwrap()).unwrap();
        assert_eq!(req, again);
    }

    /// Rolling upgrades: a newer peer's extra fields are ignored; what the
    /// fields mean (an algorithm's name) is still checked.
    #[test]
    fn unknown_fields_are_ignored_and_unknown_algorithms_rejected() {
        let req: CheckRequest = serde_json::from_str(r#"{"checks":[],"x":1}"#).unwrap();
        assert!(req.checks.is_empty());
        let bad_algo = r#"{"checks":[{"subject":"s","limits":[{"name":"a","requests":1,"window_ms":1,"algorithm":"leaky"}]}]}"#;
        assert!(serde_json::from_str::<CheckRequest>(bad_algo).is_err());
        let newer = r#"{"results":[{"allowed":true,"limits":[{"allowed":true,"limit":1,"remaining":0,"reset_after_ms":1,"retry_after_ms":0,"tokens":7}],"grant":{"units":3}}],"server":"v9"}"#;
        let answer: CheckResponse = serde_json::from_str(newer).unwrap();
        assert!(matches!(&answer.results[0], CheckOutcome::Decided(r) if r.allowed));
    }

    #[test]
    fn a_check_that_was_not_decided_says_why() {
        let json = r#"{"results":[{"allowed":false,"limits":[]},{"error":"checks[1].subject: too long","kind":"invalid"},{"error":"node down","kind":"unavailable"}]}"#;
        let answer: CheckResponse = serde_json::from_str(json).unwrap();
        assert!(matches!(answer.results[0], CheckOutcome::Decided(_)));
        assert!(
            matches!(&answer.results[1], CheckOutcome::Failed(f) if f.kind == FailureKind::Invalid)
        );
        assert!(
            matches!(&answer.results[2], CheckOutcome::Failed(f) if f.kind == FailureKind::Unavailable)
        );
        assert_eq!(serde_json::to_string(&answer).unwrap(), json);
        assert!(serde_json::from_str::<CheckResponse>(r#"{"results":[{"error":"x"}]}"#).is_err());
    }

    /// Read in one pass (not untagged), with the same verdicts.
    #[test]
    fn results_are_told_apart_by_their_fields() {
        let read = |json: &str| serde_json::from_str::<CheckOutcome>(json);
        assert!(
            matches!(read(r#"{"allowed":false,"limits":[],"x":[1,{"y":2}]}"#), Ok(CheckOutcome::Decided(r)) if !r.allowed)
        );
        assert!(matches!(
            read(r#"{"kind":"invalid","error":"e"}"#),
            Ok(CheckOutcome::Failed(_))
        ));
        for bad in [
            r#"{"allowed":true}"#,
            r#"{"limits":[]}"#,
            r#"{"error":"e"}"#,
            "[]",
            r#"{"kind":"other","error":"e"}"#,
        ] {
            assert!(read(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn all_algorithm_names_parse() {
        for name in [
            "fixed_window",
            "sliding_window_log",
            "sliding_window_counter",
            "token_bucket",
        ] {
            let a: Algorithm = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(a.as_str(), name);
        }
    }

    #[test]
    fn most_constraining_on_allow_is_least_remaining() {
        let r = CheckResult {
            allowed: true,
            limits: vec![status(true, 7, 1000, 0), status(true, 2, 60000, 0)],
            receipts: None,
            leased: 0,
        };
        assert_eq!(r.most_constraining().unwrap().remaining, 2);
    }

    #[test]
    fn shadow_limits_are_never_most_constraining() {
        let mut shadow = status(false, 0, 9000, 9000);
        shadow.shadow = true;
        let r = CheckResult {
            allowed: true,
            limits: vec![shadow, status(true, 4, 1000, 0)],
            receipts: None,
            leased: 0,
        };
        assert_eq!(r.most_constraining().unwrap().remaining, 4);
    }

    #[test]
    fn capacity_is_burst_for_token_buckets() {
        let mut l: Limit = serde_json::from_str(
            r#"{"name":"a","requests":10,"window_ms":1000,"algorithm":"token_bucket","burst":3}"#,
        )
        .unwrap();
        assert_eq!(l.capacity(), 3);
        l.burst = None;
        assert_eq!(l.capacity(), 10);
    }

    #[test]
    fn most_constraining_on_deny_is_latest_denying_limit() {
        let r = CheckResult {
            allowed: false,
            limits: vec![
                status(true, 3, 1000, 0),
                status(false, 0, 5000, 5000),
                status(false, 0, 900, 900),
            ],
            receipts: None,
            leased: 0,
        };
        assert_eq!(r.most_constraining().unwrap().retry_after_ms, 5000);
    }
}
