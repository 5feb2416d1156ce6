//! The Envoy stats the filter defines, declared once: name, kind and
//! meaning. [`crate::flow`] defines every one of them at configure time from
//! [`Stat::ALL`]; the README's table lists them (a test checks it does).
//! Envoy shows them under `wasmcustom.` (e.g.
//! `wasmcustom.meshlimit.requests_denied`) and exports them to Prometheus
//! as `meshlimit_*`.

/// What kind of Envoy metric a stat is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
}

/// A stat's declaration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatDef {
    pub name: &'static str,
    pub kind: MetricKind,
    pub help: &'static str,
}

/// Every stat the filter keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stat {
    RequestsAllowed,
    RequestsDenied,
    LocalAllowed,
    LocalDenied,
    FallbackAllowed,
    FallbackDenied,
    FallbackUncounted,
    ShadowDenied,
    DenyCacheHits,
    DenyCacheEvictions,
    BreakerOpened,
    BreakerOpen,
    Batches,
    BatchedChecks,
    BatchOverflow,
    RejectedNoClientId,
    RejectedInvalidCost,
    RejectedCostAboveCapacity,
    RejectedMissingAttribute,
    SkippedMissingAttribute,
    ServiceErrorTimeout,
    ServiceErrorConnection,
    ServiceErrorUnavailable,
    ServiceErrorBadStatus,
    ServiceErrorBadBody,
    ServiceErrorInvalidCheck,
    TokensReserved,
    TokensSettled,
    TokensRefunded,
    StreamsCut,
    StreamUsageAsked,
    SettlementsFailed,
    LeaseGrants,
    LeaseUnits,
    LeaseReturns,
    LeaseReturnsUnconfirmed,
    LeaseUnitsDropped,
    AnswersLost,
    LeaseAsksLost,
    ReservationsLost,
    LeaseHits,
    LeaseRenewals,
    LeasesEnded,
    Version,
}

impl Stat {
    /// Every stat, in declaration order (`stat as usize` is its position).
    pub const ALL: [Stat; 44] = [
        Stat::RequestsAllowed,
        Stat::RequestsDenied,
        Stat::LocalAllowed,
        Stat::LocalDenied,
        Stat::FallbackAllowed,
        Stat::FallbackDenied,
        Stat::FallbackUncounted,
        Stat::ShadowDenied,
        Stat::DenyCacheHits,
        Stat::DenyCacheEvictions,
        Stat::BreakerOpened,
        Stat::BreakerOpen,
        Stat::Batches,
        Stat::BatchedChecks,
        Stat::BatchOverflow,
        Stat::RejectedNoClientId,
        Stat::RejectedInvalidCost,
        Stat::RejectedCostAboveCapacity,
        Stat::RejectedMissingAttribute,
        Stat::SkippedMissingAttribute,
        Stat::ServiceErrorTimeout,
        Stat::ServiceErrorConnection,
        Stat::ServiceErrorUnavailable,
        Stat::ServiceErrorBadStatus,
        Stat::ServiceErrorBadBody,
        Stat::ServiceErrorInvalidCheck,
        Stat::TokensReserved,
        Stat::TokensSettled,
        Stat::TokensRefunded,
        Stat::StreamsCut,
        Stat::StreamUsageAsked,
        Stat::SettlementsFailed,
        Stat::LeaseGrants,
        Stat::LeaseUnits,
        Stat::LeaseReturns,
        Stat::LeaseReturnsUnconfirmed,
        Stat::LeaseUnitsDropped,
        Stat::AnswersLost,
        Stat::LeaseAsksLost,
        Stat::ReservationsLost,
        Stat::LeaseHits,
        Stat::LeaseRenewals,
        Stat::LeasesEnded,
        Stat::Version,
    ];

    /// Name, kind and meaning: the one home of each.
    pub fn def(self) -> StatDef {
        use MetricKind::{Counter, Gauge};
        let (name, kind, help) = match self {
            Stat::RequestsAllowed => (
                "meshlimit.requests_allowed",
                Counter,
                "decisions made from meshlimitd's answer: allowed",
            ),
            Stat::RequestsDenied => (
                "meshlimit.requests_denied",
                Counter,
                "decisions made from meshlimitd's answer: denied",
            ),
            Stat::LocalAllowed => (
                "meshlimit.local_allowed",
                Counter,
                "decisions of scope: local rules (never a call): allowed",
            ),
            Stat::LocalDenied => (
                "meshlimit.local_denied",
                Counter,
                "decisions of scope: local rules (never a call): denied",
            ),
            Stat::FallbackAllowed => (
                "meshlimit.fallback_allowed",
                Counter,
                "decisions made without meshlimitd, by failure_mode: allowed",
            ),
            Stat::FallbackDenied => (
                "meshlimit.fallback_denied",
                Counter,
                "decisions made without meshlimitd, by failure_mode: denied",
            ),
            Stat::FallbackUncounted => (
                "meshlimit.fallback_uncounted",
                Counter,
                "local fallback decisions admitted uncounted because shared data failed",
            ),
            Stat::ShadowDenied => (
                "meshlimit.shadow_denied",
                Counter,
                "requests a shadow rule would have denied (they were not)",
            ),
            Stat::DenyCacheHits => (
                "meshlimit.deny_cache_hits",
                Counter,
                "requests denied by the deny cache without calling meshlimitd",
            ),
            Stat::DenyCacheEvictions => (
                "meshlimit.deny_cache_evictions",
                Counter,
                "live deny-cache entries overwritten by another client's: the cache is too small",
            ),
            Stat::BreakerOpened => (
                "meshlimit.breaker_opened",
                Counter,
                "times the circuit breaker opened",
            ),
            Stat::BreakerOpen => (
                "meshlimit.breaker_open",
                Gauge,
                "1 while the breaker is open, 0 once it closed again",
            ),
            Stat::Batches => (
                "meshlimit.batches",
                Counter,
                "group commit: calls that carried a batch",
            ),
            Stat::BatchedChecks => (
                "meshlimit.batched_checks",
                Counter,
                "group commit: checks those calls carried",
            ),
            Stat::BatchOverflow => (
                "meshlimit.batch_overflow",
                Counter,
                "group commit: checks refused because the queue was full (decided by failure_mode)",
            ),
            Stat::RejectedNoClientId => (
                "meshlimit.rejected_no_client_id",
                Counter,
                "requests refused by when_missing: reject",
            ),
            Stat::RejectedInvalidCost => (
                "meshlimit.rejected_invalid_cost",
                Counter,
                "requests refused for an unusable cost header (400)",
            ),
            Stat::RejectedCostAboveCapacity => (
                "meshlimit.rejected_cost_above_capacity",
                Counter,
                "requests refused for a cost above a limit's capacity",
            ),
            Stat::RejectedMissingAttribute => (
                "meshlimit.rejected_missing_attribute",
                Counter,
                "requests refused (403): a limit with `missing: reject` lacked an attribute of its `by`",
            ),
            Stat::SkippedMissingAttribute => (
                "meshlimit.skipped_missing_attribute",
                Counter,
                "limits not counted for a request that lacked an attribute of their `by`",
            ),
            Stat::ServiceErrorTimeout => (
                "meshlimit.service_errors.timeout",
                Counter,
                "failed calls: no answer in time",
            ),
            Stat::ServiceErrorConnection => (
                "meshlimit.service_errors.connection",
                Counter,
                "failed calls: no connection to any meshlimitd",
            ),
            Stat::ServiceErrorUnavailable => (
                "meshlimit.service_errors.unavailable",
                Counter,
                "failed calls: meshlimitd cannot reach Redis (503)",
            ),
            Stat::ServiceErrorBadStatus => (
                "meshlimit.service_errors.bad_status",
                Counter,
                "failed calls: another status",
            ),
            Stat::ServiceErrorBadBody => (
                "meshlimit.service_errors.bad_body",
                Counter,
                "failed calls: a 200 whose body is not a valid answer",
            ),
            Stat::ServiceErrorInvalidCheck => (
                "meshlimit.service_errors.invalid_check",
                Counter,
                "checks meshlimitd refused on their own (the rest of their batch was decided)",
            ),
            Stat::TokensReserved => (
                "meshlimit.tokens_reserved",
                Counter,
                "units token-priced requests reserved before they were forwarded (top-ups included)",
            ),
            Stat::TokensSettled => (
                "meshlimit.tokens_settled",
                Counter,
                "units token-priced requests used, as their responses reported (or as settled without a report)",
            ),
            Stat::TokensRefunded => (
                "meshlimit.tokens_refunded",
                Counter,
                "reserved units given back at settlement (reserved more than used, upstream errors)",
            ),
            Stat::StreamsCut => (
                "meshlimit.streams_cut",
                Counter,
                "event streams ended at their budget with a final rate_limited event and [DONE]",
            ),
            Stat::StreamUsageAsked => (
                "meshlimit.stream_usage_asked",
                Counter,
                "streamed requests whose body was made to ask for their usage (`stream_options.include_usage`), which the client had not",
            ),
            Stat::SettlementsFailed => (
                "meshlimit.settlements_failed",
                Counter,
                "settlements meshlimitd could not apply (its reservation stands: never over budget)",
            ),
            Stat::LeaseGrants => (
                "meshlimit.lease_grants",
                Counter,
                "quota leases this Envoy got from meshlimitd and keeps in shared data",
            ),
            Stat::LeaseUnits => (
                "meshlimit.lease_units",
                Counter,
                "units those leases held (charged in Redis before any request used them)",
            ),
            Stat::LeaseRenewals => (
                "meshlimit.lease_renewals",
                Counter,
                "renewals asked: calls for a lease running low, that no request waits on",
            ),
            Stat::LeasesEnded => (
                "meshlimit.leases_ended",
                Counter,
                "leases ended before their time because meshlimitd refused their renewal (the client is over a limit lowered since the grant, such as by a live override): their units go back, and the client's next request meets the lower limit",
            ),
            Stat::Version => (
                "meshlimit.version",
                Gauge,
                "the filter's version as one number, major * 10000 + minor * 100 + patch (0.1.0 is 100)",
            ),
            Stat::LeaseReturns => (
                "meshlimit.lease_returns",
                Counter,
                "leased units given back unused (a lease that expired early or went idle)",
            ),
            Stat::LeaseReturnsUnconfirmed => (
                "meshlimit.lease_returns_unconfirmed",
                Counter,
                "leased units given back without meshlimitd confirming it (refused as invalid, or their calls kept failing for ten seconds: a return whose call failed, or that meshlimitd could not apply, is sent again, with its id, once a call succeeds): perhaps given back, perhaps still charged until their window ends",
            ),
            Stat::LeaseUnitsDropped => (
                "meshlimit.lease_units_dropped",
                Counter,
                "leased units dropped from shared data before their owner could give them back, while a window still counted them (a longer limit's, a sliding window's, a token bucket's): an ended lease's when workers' ticks came more than two window boundaries late, or one abandoned for 2 s past its end; they stay charged until those windows end (fewer admitted, never more)",
            ),
            Stat::AnswersLost => (
                "meshlimit.answers_lost",
                Counter,
                "checks whose call's answer was lost (a timeout, a 503, a failed connection): decided by failure_mode; what meshlimitd charged for one it answered 503 in time is given back, and so is a lease asked or a reservation made with one (see lease_asks_lost, reservations_lost), while a plain check whose answer left meshlimitd and came too late may stay charged a unit",
            ),
            Stat::LeaseAsksLost => (
                "meshlimit.lease_asks_lost",
                Counter,
                "lease asks whose answer was lost (a timeout, a 503, a failed connection), named in a later call so that their grants go back",
            ),
            Stat::ReservationsLost => (
                "meshlimit.reservations_lost",
                Counter,
                "token reservations (and top-ups) whose answer was lost (a timeout, a 503, a failed connection), named in a later call so that what they reserved goes back (the fallback reserved and settled them)",
            ),
            Stat::LeaseHits => (
                "meshlimit.lease_hits",
                Counter,
                "requests decided from a lease, without a call",
            ),
        };
        StatDef { name, kind, help }
    }
}

/// The filter's version (the workspace's) as [`Stat::Version`] reports it.
pub fn version_number() -> u64 {
    let mut parts = env!("CARGO_PKG_VERSION")
        .split(['.', '-'])
        .map(|p| p.parse::<u64>().unwrap_or(0));
    let mut next = || parts.next().unwrap_or(0).min(99);
    let (major, minor, patch) = (next(), next(), next());
    major * 10_000 + minor * 100 + patch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_every_stat_in_order_with_unique_names() {
        for (i, stat) in Stat::ALL.iter().enumerate() {
            assert_eq!(*stat as usize, i, "{stat:?}");
        }
        let mut names: Vec<_> = Stat::ALL.iter().map(|s| s.def().name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Stat::ALL.len());
        assert!(names.iter().all(|n| n.starts_with("meshlimit.")));
    }

    #[test]
    fn the_readme_lists_every_stat() {
        let readme = include_str!("../docs/behaviour.md");
        for stat in Stat::ALL {
            let name = stat.def().name;
            let last = name.rsplit(['.']).next().unwrap_or(name);
            assert!(
                readme.contains(last),
                "docs/behaviour.md does not list {name}"
            );
        }
    }
}
