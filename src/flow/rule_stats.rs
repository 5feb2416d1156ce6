//! Stats per rule and limit: which rule is denying, and how close each
//! limit is to its quota. Defined at configure time, five per configured
//! limit and three more per limit of a token budget (so their number is
//! bounded by the configuration, never by traffic), named `meshlimit.rule.<rule>.limit.<limit>.<outcome>` so that
//! Envoy's `stats_tags` (or Istio's tag extraction) turn `rule` and
//! `limit` into labels: `envoy/replica.yaml` ships the two tag regexes,
//! and Prometheus sees `meshlimit_rule_limit_allowed{rule, limit}`.
//!
//! A busy client's lease hits and local draws decide with no hostcall, so
//! counts are kept in the worker's memory and added to the stats in bulk:
//! every [`FLUSH_EVERY`] records, and on every root tick (or at once when
//! the worker has no tick).

use std::cell::{Cell, RefCell};

use meshlimit_protocol::CheckResult;

use crate::check::Applied;
use crate::config::Config;
use crate::host::Host;
use crate::stats::MetricKind;

/// What one decision did to one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// The request was admitted.
    Allowed = 0,
    /// This limit refused the request.
    Denied = 1,
    /// This shadow limit would have refused it (it did not).
    ShadowDenied = 2,
    /// Decided without meshlimitd (the fallback), either way.
    Fallback = 3,
    /// Admitted with less than a tenth of the limit left.
    NearLimit = 4,
    /// Token budgets only, in units: reserved before the request went on,
    /// settled at the usage, given back unused.
    TokensReserved = 5,
    TokensSettled = 6,
    TokensRefunded = 7,
}

/// Events every limit has; the token events follow them.
const REQUEST_EVENTS: usize = 5;

/// The outcomes' stat names (the last part) and meanings: the one home of
/// both.
pub(crate) const EVENTS: [(Event, &str, &str); 8] = [
    (Event::Allowed, "allowed", "requests admitted on this limit"),
    (Event::Denied, "denied", "requests this limit refused"),
    (
        Event::ShadowDenied,
        "shadow_denied",
        "requests this shadow limit would have refused",
    ),
    (
        Event::Fallback,
        "fallback",
        "decisions on this limit made without meshlimitd",
    ),
    (
        Event::NearLimit,
        "near_limit",
        "requests admitted with less than a tenth of the limit left",
    ),
    (
        Event::TokensReserved,
        "tokens_reserved",
        "token budgets: units reserved before requests went on",
    ),
    (
        Event::TokensSettled,
        "tokens_settled",
        "token budgets: units settled at the usage responses reported",
    ),
    (
        Event::TokensRefunded,
        "tokens_refunded",
        "token budgets: reserved units given back unused",
    ),
];

/// Records kept in memory before they are added to the stats.
const FLUSH_EVERY: u32 = 64;

/// The stat name of `outcome` on the limit `rule/limit`: dots in the names
/// become `_`, since the tag regexes split on them.
pub(crate) fn stat_name(qualified_name: &str, outcome: &str) -> String {
    let (rule, limit) = qualified_name
        .split_once('/')
        .unwrap_or((qualified_name, ""));
    let clean = |s: &str| s.replace('.', "_");
    format!(
        "meshlimit.rule.{}.limit.{}.{outcome}",
        clean(rule),
        clean(limit)
    )
}

/// Each configured limit's stats, and the counts not yet added to them.
pub(super) struct RuleStats {
    ids: Vec<[Option<u32>; 8]>,
    pending: RefCell<Vec<[u64; 8]>>,
    unflushed: Cell<u32>,
    /// The root's tick runs, and flushes (else every record is added at
    /// once).
    ticking: Cell<bool>,
}

impl RuleStats {
    /// Defines the stats of every limit of `config`, in its order.
    pub(super) fn define(host: &impl Host, config: &Config) -> RuleStats {
        let ids: Vec<[Option<u32>; 8]> = config
            .rules
            .iter()
            .flat_map(|r| {
                let tokens = matches!(r.cost, crate::config::Cost::Tokens(_));
                r.limits.iter().map(move |limit| (limit, tokens))
            })
            .map(|(limit, tokens)| {
                EVENTS.map(|(event, name, _)| {
                    let defined = tokens || (event as usize) < REQUEST_EVENTS;
                    defined
                        .then(|| {
                            host.define_metric(
                                MetricKind::Counter,
                                &stat_name(&limit.qualified_name, name),
                            )
                        })
                        .flatten()
                })
            })
            .collect();
        let pending = RefCell::new(vec![[0; 8]; ids.len()]);
        RuleStats {
            ids,
            pending,
            unflushed: Cell::new(0),
            ticking: Cell::new(false),
        }
    }

    /// Whether the root's tick runs (it flushes the counts).
    pub(super) fn set_ticking(&self, ticking: bool) {
        self.ticking.set(ticking);
    }

    /// Counts `event` on `applied`'s limit.
    pub(super) fn count(&self, host: &impl Host, applied: &Applied, event: Event) {
        self.add(host, applied, event, 1);
    }

    /// Counts `units` of a token event on each token-priced limit of
    /// `limits`.
    pub(super) fn tokens(&self, host: &impl Host, limits: &[Applied], event: Event, units: u64) {
        for applied in limits.iter().filter(|a| a.tokens) {
            if units > 0 {
                self.add(host, applied, event, units);
            }
        }
    }

    /// Adds `n` to `event` on `applied`'s limit.
    fn add(&self, host: &impl Host, applied: &Applied, event: Event, n: u64) {
        let slot = applied.limit.stats.0;
        if let Some(counts) = self.pending.borrow_mut().get_mut(slot) {
            if let Some(count) = counts.get_mut(event as usize) {
                *count += n;
            }
        }
        let unflushed = self.unflushed.get() + 1;
        if unflushed >= FLUSH_EVERY || !self.ticking.get() {
            self.flush(host);
        } else {
            self.unflushed.set(unflushed);
        }
    }

    /// Counts a decided result on its limits (`limits`, in the result's
    /// order); `fallback` when the fallback decided it.
    pub(super) fn result(
        &self,
        host: &impl Host,
        limits: &[Applied],
        result: &CheckResult,
        fallback: bool,
    ) {
        for (i, applied) in limits.iter().enumerate() {
            let status = result.limits.get(i);
            let refused = status.is_some_and(|s| !s.allowed);
            if fallback {
                self.count(host, applied, Event::Fallback);
            }
            // Shadow in the configuration, or by the fleet-wide switch.
            if applied.shadow || status.is_some_and(|s| s.shadow) {
                if refused {
                    self.count(host, applied, Event::ShadowDenied);
                }
            } else if refused {
                self.count(host, applied, Event::Denied);
            }
            if result.allowed {
                let remaining = status.map_or(u64::MAX, |s| s.remaining);
                self.admitted(host, applied, remaining);
            }
        }
    }

    /// Counts a request admitted on `applied` with `remaining` left.
    pub(super) fn admitted(&self, host: &impl Host, applied: &Applied, remaining: u64) {
        self.count(host, applied, Event::Allowed);
        if remaining.saturating_mul(10) < applied.limit.requests {
            self.count(host, applied, Event::NearLimit);
        }
    }

    /// Adds the counts kept in memory to the stats.
    #[cold]
    #[inline(never)]
    pub(super) fn flush(&self, host: &impl Host) {
        self.unflushed.set(0);
        let mut pending = self.pending.borrow_mut();
        for (counts, ids) in pending.iter_mut().zip(&self.ids) {
            for (n, id) in counts.iter_mut().zip(ids) {
                if *n > 0 {
                    if let Some(id) = id {
                        host.increment_metric(*id, *n);
                    }
                    *n = 0;
                }
            }
        }
    }
}
