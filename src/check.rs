//! A request's check: whose quota it spends, and which limits apply, with
//! the request's cost on each.
//!
//! Built once per request by [`crate::decision::plan`] and already split
//! into the limits this Envoy decides alone (`scope: local` rules) and the
//! global ones that meshlimitd decides. The limits are shared with the
//! configuration (`Rc`), so a paused request carries no copies of it, and
//! nothing downstream resolves or splits the check again.

use std::cell::{Cell, OnceCell};
use std::rc::Rc;

use meshlimit_protocol::bounds;
use meshlimit_protocol::{
    CheckRequest, LeaseAsk, LeaseLife, Limit, LimitStatus, Receipt, Settlement,
};

use crate::config::{LimitConfig, Reserve, TokenCost, TokenMode};
use crate::shared::lease::Place;

/// A limit that applies to a request, and the request's cost on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The limit, with a static override for this subject already applied.
    pub limit: Rc<LimitConfig>,
    pub cost: u64,
    /// From a shadow rule: decided and counted, never enforced.
    pub shadow: bool,
    /// Whose counter it spends (see [`crate::subject`]).
    pub subject: String,
    /// Priced by a token budget: `cost` is a reservation, settled from the
    /// response.
    pub tokens: bool,
}

impl Applied {
    /// The limit as meshlimitd's check API carries it, within a check
    /// whose subject is `check_subject` (a limit of that subject names
    /// none of its own: the usual case travels as before).
    pub fn to_wire(&self, check_subject: &str) -> Limit {
        Limit {
            name: self.limit.qualified_name.clone(),
            requests: self.limit.requests,
            window_ms: self.limit.window_ms,
            algorithm: self.limit.algorithm,
            cost: self.cost,
            burst: self.limit.burst,
            shadow: self.shadow,
            subject: (self.subject != check_subject).then(|| self.subject.clone()),
            calendar: self.limit.calendar,
        }
    }

    /// The status of this limit in a request admitted without meshlimitd's
    /// word on it (a lease, a fallback that could not count).
    pub fn admitted(&self, remaining: u64, reset_after_ms: u64) -> LimitStatus {
        LimitStatus {
            allowed: true,
            limit: self.limit.requests,
            remaining,
            reset_after_ms,
            retry_after_ms: 0,
            shadow: self.shadow,
            reason: None,
        }
    }

    /// The same limit at this Envoy's share, for a fallback decision.
    pub fn for_fallback(&self) -> Applied {
        Applied {
            limit: Rc::new(self.limit.for_fallback()),
            ..self.clone()
        }
    }
}

/// What a request needs decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The client id when a limit counts by it, else the first limit's
    /// subject: what logs show, and the subject of every limit on the wire
    /// that names none.
    pub subject: String,
    /// Limits of `scope: local` rules: counted in this Envoy, never called for.
    pub local: Vec<Applied>,
    /// Limits decided by meshlimitd, or by `failure_mode` when it cannot be
    /// asked.
    pub global: Vec<Applied>,
    /// Matched limits not counted: the request lacks an attribute of
    /// their `by`.
    pub skipped: u32,
    /// How the token-priced limits reserve and settle (the first matching
    /// token-priced rule's settings), when any limit is.
    pub tokens: Option<Rc<TokenCost>>,
    /// Token budgets: the part of the reservation that stands for the
    /// prompt (estimated from the request body's size): a stream's
    /// deltas have the rest, and a response that reports no usage is
    /// charged at least the prompt and what it streamed.
    pub prompt: u64,
    /// The filter made the streamed request ask for its usage, which the
    /// client had not: the model's usage event is for the budget alone,
    /// and does not reach a client that did not ask for it.
    pub usage_asked_for_client: bool,
    /// The lease this check asks for with its call, if any.
    pub lease: Option<LeaseTicket>,
    /// A reservation's id, given when its call is made (0: none; only
    /// token-priced checks get one): if the answer is lost, the check is
    /// named in a later call and what its script charged goes back (see
    /// `meshlimit_protocol::Check::id`).
    pub id: u64,
    /// Where its lease lives, once looked up, and the seed that placed it
    /// (see [`Check::lease_place`]).
    pub place: Derived<Cell<Option<SeededPlace>>>,
    /// Its `RateLimit-Policy` value as a lease hit reports it (see
    /// [`crate::headers::add_admitted`]), once made.
    pub hit_policy: Derived<OnceCell<String>>,
}

/// A lease's place, and the fingerprint seed it was computed with.
pub type SeededPlace = ((u64, u64), Place);

/// Values computed from the rest of a struct and kept beside it, so that
/// a check a busy client's requests share is hashed and formatted once,
/// not once a request. Not part of the value: any two compare equal, and
/// a clone keeps them (they are still true of the copy, whose limits and
/// subjects are the same: only costs and the lease ask change on a copy).
#[derive(Debug, Clone, Default)]
pub struct Derived<T>(pub T);

impl<T> PartialEq for Derived<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<T> Eq for Derived<T> {}

/// A lease asked with a check's call (see `crate::shared::lease`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTicket {
    /// Where the lease will live.
    pub place: Place,
    /// Units asked for, and the share that bounds them.
    pub want: u64,
    pub share: u64,
    /// When the ask was made: the lease's life is counted from here (a
    /// little before meshlimitd's clock, so it never outlives its window).
    pub asked_ms: u64,
    /// Asked before the check's lease ran out (a renewal, for no request):
    /// its grant replaces the lease, whose units left go back.
    pub renewal: bool,
    /// The ask's id (see `LeaseAsk::id`): named in a later call if the
    /// answer is lost, so that its grant goes back.
    pub id: u64,
}

/// What makes a check's lease: for each global limit, what its counter in
/// Redis is made of (its name, quota, window, algorithm, burst and
/// calendar), its subject and whether it is shadow (hashed into the
/// lease's fingerprint on every busy request, so only these: the rest of a
/// limit's definition, such as its `by` list or static overrides, shows in
/// the subject and the quota).
pub struct LeaseIdentity<'a>(pub &'a [Applied]);

impl std::hash::Hash for LeaseIdentity<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        for a in self.0 {
            let l = &a.limit;
            l.qualified_name.hash(h);
            (l.requests, l.window_ms, l.burst, l.algorithm).hash(h);
            l.calendar.hash(h);
            a.subject.hash(h);
            a.shadow.hash(h);
        }
    }
}

impl Check {
    /// Its lease's place for the fingerprint seed `seed`, computed by
    /// `place` the first time (and again if the seed changed).
    pub fn lease_place(&self, seed: (u64, u64), place: impl FnOnce() -> Place) -> Place {
        match self.place.0.get() {
            Some((s, p)) if s == seed => p,
            _ => {
                let p = place();
                self.place.0.set(Some((seed, p)));
                p
            }
        }
    }

    /// The check as one entry of a call: the global limits only.
    pub fn to_wire(&self) -> meshlimit_protocol::Check {
        meshlimit_protocol::Check {
            subject: self.subject.clone(),
            limits: self
                .global
                .iter()
                .map(|a| a.to_wire(&self.subject))
                .collect(),
            receipt: self.tokens.is_some(),
            lease: self.lease.filter(|t| t.want > 0).map(|t| LeaseAsk {
                units: t.want,
                share: t.share,
                id: t.id,
            }),
            trace: None,
            id: self.id,
        }
    }

    /// Whether its answer matters once its request has ended: it asks for
    /// a lease (granted units serve later requests) or reserves tokens
    /// (given back if the request is gone).
    pub fn answer_outlives_request(&self) -> bool {
        self.tokens.is_some() || self.lease.is_some_and(|t| t.want > 0)
    }

    /// The token-priced limits (all global).
    pub fn token_limits(&self) -> impl Iterator<Item = &Applied> + Clone {
        self.global.iter().filter(|a| a.tokens)
    }

    /// Whether the reservation is read from the request's body.
    pub fn reserves_from_body(&self) -> Option<&TokenCost> {
        self.tokens.as_deref().filter(|t| {
            t.mode == TokenMode::Reserve && matches!(t.reserve, Reserve::RequestJson { .. })
        })
    }

    /// Sets the units the token-priced limits reserve.
    pub fn reserve(&mut self, units: u64) {
        for a in self.global.iter_mut().filter(|a| a.tokens) {
            a.cost = units;
        }
    }

    /// The units the token-priced limits reserve.
    pub fn reserved(&self) -> u64 {
        self.token_limits().map(|a| a.cost).next().unwrap_or(0)
    }

    /// A further reservation of `units` on the token-priced limits only (a
    /// stream that outgrew what it reserved).
    pub fn top_up(&self, units: u64) -> Check {
        let mut global: Vec<Applied> = self.token_limits().cloned().collect();
        for a in &mut global {
            a.cost = units;
        }
        Check {
            subject: self.subject.clone(),
            local: Vec::new(),
            global,
            skipped: 0,
            tokens: self.tokens.clone(),
            prompt: 0,
            usage_asked_for_client: false,
            lease: None,
            id: 0,
            place: Derived::default(),
            hit_policy: Derived::default(),
        }
    }

    /// The cost of each request on a check that can be leased: every
    /// global limit counted in Redis by a fixed window, a sliding counter
    /// or a token bucket (a sliding log's members carry times), at one
    /// cost; no token budget (its cost is settled afterwards).
    pub fn lease_cost(&self) -> Option<u64> {
        let cost = self.global.first()?.cost;
        let leasable = self.tokens.is_none()
            && self.global.iter().all(|a| {
                a.cost == cost
                    && !a.tokens
                    && a.limit.algorithm.lease_life() != LeaseLife::NotLeased
            });
        leasable.then_some(cost)
    }

    /// The return of `units` leased units unused, charged where `receipts`
    /// say: a settlement at 0 of a reservation of `units` on every global
    /// limit.
    pub fn lease_return(&self, units: u64, receipts: &[Receipt]) -> Settlement {
        self.settle(self.global.iter(), units, 0, receipts)
    }

    /// The settlement of a reservation of `units` charged where `receipts`
    /// say (one per token-priced limit), for `actual` units used.
    pub fn settlement(&self, units: u64, actual: u64, receipts: &[Receipt]) -> Settlement {
        self.settle(self.token_limits(), units, actual, receipts)
    }

    /// A reservation of `units` on `limits`, charged where `receipts` say,
    /// settled at `actual` units used.
    fn settle<'a>(
        &self,
        limits: impl Iterator<Item = &'a Applied>,
        units: u64,
        actual: u64,
        receipts: &[Receipt],
    ) -> Settlement {
        let limits: Vec<Limit> = limits
            .map(|a| Limit {
                cost: units,
                ..a.to_wire(&self.subject)
            })
            .collect();
        Settlement {
            subject: self.subject.clone(),
            // A usage past what one settlement may carry is charged at that
            // bound, never sent whole to be refused (which would leave only
            // the reservation charged).
            actual: limits
                .iter()
                .map(|l| actual.min(bounds::max_settled(l.algorithm)))
                .collect(),
            limits,
            receipts: receipts.to_vec(),
            id: 0,
        }
    }

    /// The body of a call for this check alone.
    pub fn to_request(&self) -> CheckRequest {
        CheckRequest {
            checks: vec![self.to_wire()],
            settlements: Vec::new(),
            lost: Vec::new(),
        }
    }

    /// Every limit, local ones first (the order of a combined result).
    pub fn all(&self) -> Vec<Applied> {
        self.local.iter().chain(&self.global).cloned().collect()
    }
}
