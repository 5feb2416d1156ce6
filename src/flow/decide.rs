//! How a planned check is decided: an explicit sequence of stages, each
//! of which either decides the request (a [`Step`]) or hands the next
//! stage what it learned.
//!
//! 1. `Worker::local_rules` (`local_rules.rs`): `scope: local` rules,
//!    from this worker's draw or this Envoy's shared data (a local deny
//!    costs no call).
//! 2. [`Worker::leased_units`]: units meshlimitd already charged to this
//!    Envoy (a hit costs no call, and comes before the deny cache: a deny
//!    cached on another request does not make those units any less this
//!    client's).
//! 3. [`Worker::cached_deny`]: a deny remembered until its retry time.
//! 4. The breaker's gate: open, [`Worker::without_meshlimitd`] decides by
//!    `failure_mode`; else [`Worker::call`] asks meshlimitd.
//!
//! A new way to decide is a new stage here, with its state in a component
//! of its own.

use std::rc::Rc;

use meshlimit_protocol::CheckResult;

use super::decision_log::Source;
use super::leases::{self, Lookup};
use super::local_draws;
use super::rule_stats::Event;
use super::{profile, with_local, Step, Stream, Worker};
use crate::check::Check;
use crate::decision;
use crate::host::Host;
use crate::shared::breaker::Gate;
use crate::stats::Stat;

/// What a stage says: the request is decided, or the next stage goes on
/// with what this one learned.
pub(super) enum Outcome<T> {
    Decided(Step),
    Next(T),
}

/// The value a stage handed on, or the step it decided (returned).
macro_rules! next {
    ($stage:expr) => {
        match $stage {
            Outcome::Decided(step) => return step,
            Outcome::Next(value) => value,
        }
    };
}

/// What the lease stage learned on a miss: the clock, read afresh if the
/// reused one would not do, and the lease the call should ask for.
pub(super) struct LeaseMiss {
    now: u64,
    ask: Option<crate::check::LeaseTicket>,
}

impl Worker {
    /// Decides a planned check, stage after stage (see the module doc).
    /// `check` may be shared with the plan memo: it is copied only when a
    /// call needs one of its own (a busy client's hits copy nothing).
    pub(super) fn decide(&self, host: &impl Host, stream: &mut Stream, check: Rc<Check>) -> Step {
        // A hit from the worker's draw may decide on the last clock read
        // (see `clock`); anything else reads the clock.
        let reused = if check.local.is_empty() || local_draws::drawable(&check).is_some() {
            self.hits.clock.reuse()
        } else {
            None
        };
        let now = match reused {
            Some(then) => then,
            None => self.hits.clock.read(host),
        };
        let local = next!(self.local_rules(host, stream, (now, reused.is_some()), &check));
        let LeaseMiss { now, ask } = next!(self.leased_units(
            host,
            stream,
            (now, reused.is_some()),
            &check,
            local.as_ref()
        ));
        next!(self.cached_deny(host, stream, now, &check));
        match self.guard.gate(host, now) {
            Gate::Skip => self.without_meshlimitd(host, stream, now, &check, local.as_ref()),
            Gate::Call | Gate::Probe => self.call(host, stream, now, check, local, ask),
        }
    }

    /// Stage 2: units leased to this Envoy. `clock`: the time, and whether
    /// it is the worker's last read, reused (a miss reads it afresh).
    fn leased_units(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        (now, reused): (u64, bool),
        check: &Rc<Check>,
        local: Option<&CheckResult>,
    ) -> Outcome<LeaseMiss> {
        let mut lookup = self.lease_hit(host, now, reused, stream.context_id, check);
        let now = match (&lookup, reused) {
            (Lookup::NeedsClock, _) => {
                let now = self.hits.clock.read(host);
                lookup = self.lease_hit(host, now, false, stream.context_id, check);
                now
            }
            // A miss goes on to calls and caches: on a fresh read.
            (Lookup::Miss(_), true) => self.hits.clock.read(host),
            _ => now,
        };
        match lookup {
            Lookup::Hit {
                remaining,
                reset_after_ms,
            } => Outcome::Decided(self.lease_admit(
                stream,
                Rc::clone(check),
                local,
                remaining,
                reset_after_ms,
            )),
            Lookup::Miss(ask) => Outcome::Next(LeaseMiss { now, ask }),
            Lookup::NeedsClock => Outcome::Next(LeaseMiss { now, ask: None }),
        }
    }

    /// Stage 3: a deny remembered from an earlier answer.
    #[inline(never)]
    pub(super) fn cached_deny(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        now: u64,
        check: &Check,
    ) -> Outcome<()> {
        if self.fleet_switch.shadow(host, now) {
            // Nothing is refused fleet-wide: meshlimitd decides (in shadow).
            return Outcome::Next(());
        }
        let Some(cache) = self.guard.deny_cache(host, now) else {
            return Outcome::Next(());
        };
        match decision::cached_deny(&self.config, check, &cache, now) {
            Some((verdict, limit)) => {
                self.metrics.bump(host, Stat::DenyCacheHits);
                self.rule_stats.count(host, limit, Event::Denied);
                self.decision_log
                    .uncounted(now, Source::Cache, &check.global, false, Some(limit));
                Outcome::Decided(stream.apply(verdict))
            }
            None => Outcome::Next(()),
        }
    }

    /// Stage 4, breaker open: decided by `failure_mode`, without a call.
    #[inline(never)]
    fn without_meshlimitd(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        now: u64,
        check: &Check,
        local: Option<&CheckResult>,
    ) -> Step {
        let verdict = match self.fallback(host, now, check, None) {
            Ok(result) => {
                let verdict = with_local(&self.config, check, local, &result);
                let place = self.fallback_place(now);
                self.on_admitted(host, stream.context_id, check, &result, &verdict, place);
                verdict
            }
            Err(verdict) => verdict,
        };
        stream.apply(verdict)
    }

    /// Stage 4, breaker closed (or probing): meshlimitd decides. A check
    /// whose answer matters after its request (a lease granted, a
    /// reservation to give back) leaves from the root, group commit or not
    /// (see `outbox`); another, with group commit off, from the stream.
    #[inline(never)]
    fn call(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        now: u64,
        check: Rc<Check>,
        local: Option<CheckResult>,
        ask: Option<crate::check::LeaseTicket>,
    ) -> Step {
        if profile::SKIP_CALL {
            let result = leases::hit_result(&check, 0, 0);
            return stream.apply(with_local(&self.config, &check, local.as_ref(), &result));
        }
        let mut check = Rc::unwrap_or_clone(check);
        check.lease = ask;
        if check.tokens.is_some() {
            // Named if its answer is lost: what it reserved goes back.
            check.id = self.lease_book.next_lease_id();
        }
        if self.outbox.batching() || check.answer_outlives_request() {
            self.enqueue(host, stream, now, check, local)
        } else {
            self.ask_service(host, stream, now, check, local)
        }
    }
}
