//! Stage 1 of `decide`: the request's `scope: local` rules, counted in
//! this Envoy's shared data, or spent from this worker's draw on them
//! (`local_draws`). A local deny costs no call; a request admitted by
//! local rules alone is a hit (`hit`), as a lease hit is.

use std::rc::Rc;

use meshlimit_protocol::CheckResult;

use super::decide::Outcome;
use super::decision_log::Source;
use super::hit::{HitHeaders, Scope};
use super::local_draws::{self, LocalDraws, Spend};
use super::{Step, Stream, Worker};
use crate::check::{Applied, Check};
use crate::decision;
use crate::host::Host;
use crate::stats::Stat;

impl Worker {
    /// The request's local rules at `clock` (the time, and whether it is
    /// the worker's last read, reused: only a check that may be drawn for
    /// gets one). Their admitted result (to report with the global one),
    /// or `None` when it has none. (A request they admit and the global
    /// rules deny still used its local quota.)
    pub(super) fn local_rules(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        (now, reused): (u64, bool),
        check: &Rc<Check>,
    ) -> Outcome<Option<CheckResult>> {
        if check.local.is_empty() {
            return Outcome::Next(None);
        }
        self.decide_local_rules(host, stream, (now, reused), check)
    }

    /// [`Worker::local_rules`] of a check that has some: out of line, so
    /// that a check without stays short.
    #[inline(never)]
    fn decide_local_rules(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        (now, reused): (u64, bool),
        check: &Rc<Check>,
    ) -> Outcome<Option<CheckResult>> {
        if let Some(applied) = local_draws::drawable(check) {
            return Outcome::Decided(self.local_draw(host, stream, (now, reused), check, applied));
        }
        let mut decided = self
            .guard
            .local_limiter(host, now)
            .check(host, &check.local, now);
        self.fleet_switch.obey(host, now, &mut decided.result);
        self.count_local(host, now, check, &decided.result);
        if decided.result.allowed && check.global.is_empty() && check.tokens.is_none() {
            if let Some(headers) = local_hit(check, &decided.result) {
                return Outcome::Decided(self.admit_hit(stream, headers));
            }
        }
        if !decided.result.allowed || check.global.is_empty() {
            let verdict = decision::verdict(&self.config, &check.local, &decided.result);
            return Outcome::Decided(stream.apply(verdict));
        }
        Outcome::Next(Some(decided.result))
    }

    /// A check of one local limit alone: from the worker's draw when it
    /// holds units (no hostcall), else counted in shared data, drawing
    /// more for the next requests when the counter has room.
    fn local_draw(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        (mut now, reused): (u64, bool),
        check: &Rc<Check>,
        applied: &Applied,
    ) -> Step {
        let mut fresh = !reused;
        let limiter = self.guard.local_limiter(host, now);
        let fingerprint = limiter.fingerprint(applied);
        let mut spend = self
            .local_draws
            .spend(fingerprint, applied.cost, now, reused);
        if spend == Spend::NeedsClock {
            now = self.hits.clock.read(host);
            fresh = true;
            spend = self
                .local_draws
                .spend(fingerprint, applied.cost, now, false);
        }
        let want = match spend {
            Spend::Hit {
                remaining,
                reset_after_ms,
            } => {
                if let Some(hits) = self.local_draws.count_hit() {
                    self.metrics.add(host, Stat::LocalAllowed, hits as usize);
                }
                self.rule_stats.admitted(host, applied, remaining);
                self.decision_log.admitted(
                    now,
                    Source::Local,
                    std::slice::from_ref(applied),
                    remaining,
                );
                let headers = HitHeaders {
                    check: Rc::clone(check),
                    scope: Scope::Local,
                    top: 0,
                    remaining,
                    reset_after_ms,
                };
                return self.admit_hit(stream, headers);
            }
            Spend::Miss { want } => want,
            Spend::NeedsClock => 0,
        };
        if !fresh {
            // A miss counts in shared data: on a fresh read.
            now = self.hits.clock.read(host);
        }
        let (mut decided, drawn) = limiter.check_drawing(host, &check.local, now, |left| {
            LocalDraws::draw_size(want, applied.cost, left)
        });
        self.fleet_switch.obey(host, now, &mut decided.result);
        self.count_local(host, now, check, &decided.result);
        if let Some(status) = decided
            .result
            .limits
            .first()
            .filter(|s| decided.result.allowed && s.allowed)
        {
            let replaced =
                self.local_draws
                    .record((fingerprint, check), (want, drawn), status, now);
            self.give_back_draws(host, now, replaced.into_iter());
        }
        match local_hit(check, &decided.result).filter(|_| decided.result.allowed) {
            // The units drawn are the client's still: they count as left.
            Some(mut headers) => {
                headers.remaining = headers.remaining.saturating_add(drawn);
                self.admit_hit(stream, headers)
            }
            None => {
                let verdict = decision::verdict(&self.config, &check.local, &decided.result);
                stream.apply(verdict)
            }
        }
    }

    /// Shadow denials and the local stats of a decision in shared data.
    fn count_local(&self, host: &impl Host, now: u64, check: &Check, result: &CheckResult) {
        self.guard
            .count_shadow(host, &self.metrics, now, &check.local, result);
        self.rule_stats.result(host, &check.local, result, false);
        self.decision_log
            .result(now, Source::Local, &check.local, result);
        let stat = if result.allowed {
            Stat::LocalAllowed
        } else {
            Stat::LocalDenied
        };
        self.metrics.bump(host, stat);
    }

    /// The root's tick: draws that idled or expired go back to their
    /// counters, and the draw hits to their stat.
    pub(super) fn local_draws_tick(&self, host: &impl Host) {
        let hits = self.local_draws.take_hits();
        if hits > 0 {
            self.metrics.add(host, Stat::LocalAllowed, hits as usize);
        }
        let now = self.hits.clock.read(host);
        let back = self.local_draws.tick(now);
        self.give_back_draws(host, now, back.into_iter());
    }

    /// The worker is going away: its hits counted, and every draw given
    /// back, idle or not.
    pub(super) fn give_back_every_local_draw(&self, host: &impl Host) {
        self.local_draws_tick(host);
        let now = self.hits.clock.read(host);
        let back = self.local_draws.take_all();
        self.give_back_draws(host, now, back.into_iter());
    }

    fn give_back_draws(
        &self,
        host: &impl Host,
        now: u64,
        back: impl Iterator<Item = local_draws::GiveBack>,
    ) {
        let limiter = self.guard.local_limiter(host, now);
        for (check, units, charged_ms) in back {
            if let Some(applied) = local_draws::drawable(&check) {
                limiter.give_back(host, applied, units, charged_ms, now);
            }
        }
    }
}

/// The headers of a request local rules alone admitted: the most
/// constraining status's.
fn local_hit(check: &Rc<Check>, result: &CheckResult) -> Option<HitHeaders> {
    let top = crate::headers::most_constraining_index(result)?;
    let status = result.limits.get(top)?;
    Some(HitHeaders {
        check: Rc::clone(check),
        scope: Scope::Local,
        top,
        remaining: status.remaining,
        reset_after_ms: status.reset_after_ms,
    })
}
