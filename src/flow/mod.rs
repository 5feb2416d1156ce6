//! The request path, as plain Rust over [`Host`].
//!
//! One [`Worker`] per Envoy worker thread holds what its contexts share (the
//! configuration, stats ids, log throttles and, with group commit, the
//! batches); one [`Stream`] per HTTP request holds that request's state.
//! The proxy-wasm glue (`crate::wasm`) calls one method per callback and
//! carries out the [`Step`] it returns:
//!
//! - [`Worker::on_request_headers`]: plan the check, then in this order:
//!   `scope: local` rules (a local deny costs no call), the deny cache (a
//!   cached deny costs no call), the breaker (open: decide by
//!   `failure_mode`, no call), then queue the check for the worker's next
//!   batch (group commit) or call for it alone.
//! - [`Worker::on_call_answer`] for a stream's own call, and
//!   [`Worker::on_batch_answer`] for a batch the root sent; a missing or
//!   unusable answer is a [`ServiceError`] and goes to the fallback.
//! - [`Worker::on_wake`] when a stream woke the root: send due batches.
//! - [`Worker::on_response_headers`] adds the RateLimit headers;
//!   [`Worker::on_stream_end`] forgets a stream that ends early.
//!
//! Group commit: streams queue their checks and wake their worker's root
//! through a shared queue; the root owns the calls (a call must outlive any
//! one stream) and acts for each paused stream through
//! `set_effective_context`. Both paths end in `verdict_after_call`. Calls
//! whose answers matter after their request (renewals, returns,
//! settlements, top-ups, checks that ask for a lease or reserve) leave
//! from the root with group commit off too: see `outbox`.

mod answer;
mod ask_backoff;
mod body_priced;
mod budget;
mod bulk;
mod calls;
mod clock;
mod closing;
mod decide;
mod decision_log;
mod deferred_deny;
mod fleet_switch;
mod guard;
mod hit;
mod hold;
mod lease_book;
mod lease_ends;
mod leased_remaining;
mod leases;
mod local_draws;
mod local_rules;
mod metrics;
pub(crate) mod observer;
mod outbox;
pub(crate) mod profile;
mod returns;
mod rule_stats;
mod settle;
#[cfg(test)]
mod tests;
mod tokens;

use std::cell::RefCell;
use std::rc::Rc;

use log::{info, warn};
use meshlimit_protocol::CheckResult;

use crate::check::Check;
use crate::config::Config;
use crate::context_map::{ContextMap, ContextSet};
use crate::decision::{self, DenyResponse, Plan, RejectReason, Verdict};
use crate::headers::Headers;
use crate::host::{Host, Request};
use crate::shared::keys;
use crate::stats::Stat;
use crate::throttle::LogThrottle;
use crate::trace_context::TraceContext;
use guard::Guard;
use hold::HeaderHold;
use lease_book::LeaseBook;
use metrics::Metrics;
use outbox::{Job, Outbox, Queue, Queued};

/// The root's tick when only held headers or local draws need it (leases
/// off).
const HOLD_TICK_MS: u32 = 250;

/// Interval between two log lines about the same kind of trouble.
const LOG_EVERY_MS: u64 = 10_000;

/// What the glue does next with the current stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Forward the request (resuming it if it was paused).
    Continue,
    /// Keep it paused: its check is queued or in flight.
    Pause,
    /// Answer it locally with this response; it goes no further.
    Reply(DenyResponse),
}

/// Carries out `step` for the current stream; true when the request goes
/// on now. `paused` says the request is paused (it must be resumed).
pub fn perform(host: &impl Host, step: Step, paused: bool) -> bool {
    match step {
        Step::Continue => {
            if paused {
                host.resume_request();
            }
            true
        }
        Step::Pause => false,
        Step::Reply(reply) => {
            send_reply(host, &reply);
            false
        }
    }
}

/// Answers the current stream with `reply`. Out of line, with the other
/// paths a lease hit never takes, so that the hit's code stays short; not
/// `#[cold]`: under abuse, replies from the deny cache are most requests.
#[inline(never)]
fn send_reply(host: &impl Host, reply: &DenyResponse) {
    // A gRPC client reads the HTTP status as UNAVAILABLE, and retries: it
    // gets a gRPC status instead (one more hostcall, on replies only).
    let grpc = crate::reply::is_grpc(host.request_headers().first("content-type"));
    let sent = if grpc {
        host.send_grpc_reply(reply)
    } else {
        host.send_reply(reply)
    };
    if !sent {
        warn!("cannot send the {} response", reply.status);
    }
}

/// One HTTP request's state. The check a stream calls for or prices from
/// its body is boxed: most streams are hits that hold neither, and a
/// stream of 640 bytes (natively; 96 with the boxes) made every request's
/// allocation a large one.
pub struct Stream {
    pub context_id: u32,
    /// The check this stream called for itself, while the call is out.
    in_flight: Option<Box<InFlight>>,
    /// RateLimit headers to add to the upstream's response.
    response_headers: Headers,
    /// A check whose reservation is read from the request body, while the
    /// body comes in.
    awaiting_body: Option<Box<Check>>,
    /// Admitted without a call (a lease hit, or `scope: local` rules
    /// alone): it was never queued, called for, resumed by the root or
    /// priced in tokens, so the worker's tables of such streams hold
    /// nothing of it (a busy client's every request skips reading them).
    hit: bool,
    /// A hit's RateLimit headers, made with its response (see `hit`).
    hit_headers: Option<hit::HitHeaders>,
    /// The trace context the request came with, for its check call.
    trace: Option<Box<TraceContext>>,
}

/// A check a stream sent itself and waits for.
struct InFlight {
    token: u32,
    check: Check,
    started_ms: u64,
    /// The admitted decision of the request's `scope: local` rules, to
    /// report together with the global one.
    local: Option<CheckResult>,
}

/// What every context of one worker shares.
pub struct Worker {
    config: Config,
    metrics: Metrics,
    /// The root context: batches are sent as the root.
    root_context_id: u32,
    fallback_log: LogThrottle,
    error_log: LogThrottle,
    /// Streams ended at their token budget.
    cut_log: LogThrottle,
    /// Every call to meshlimitd, and which context sends it.
    outbox: Outbox,
    /// Requests held at their headers until their body decides them.
    hold: HeaderHold,
    /// HTTP/2 requests refused at their headers, answered on the tick.
    deferred: deferred_deny::DeferredDenies,
    /// The breaker's gate, the deny cache, the shared seed, shadow counts.
    guard: Guard,
    /// RateLimit headers for streams the root admitted, by context id.
    decided_headers: RefCell<ContextMap<Headers>>,
    /// Streams whose check went to the batcher and that have not ended:
    /// an answer for a stream not in here finds it gone (Envoy may still
    /// accept its context id), and acts on nothing.
    awaiting: RefCell<ContextSet>,
    /// Token-priced streams' reservations and response state, by context
    /// id (the root's answers update them too).
    budgets: RefCell<ContextMap<budget::Budget>>,
    /// Leases this worker installed, its observer, hits, ids, tick.
    lease_book: LeaseBook,
    /// The last check planned, for the next request planned from the same
    /// inputs (a busy client's).
    plan_memo: RefCell<crate::plan_memo::PlanMemo>,
    /// The clock hits may reuse, and where their headers are written.
    hits: hit::Hits,
    /// Units this worker drew ahead from `scope: local` counters.
    local_draws: local_draws::LocalDraws,
    /// Stats per rule and limit, and the counts not yet added to them.
    rule_stats: rule_stats::RuleStats,
    /// Why each (sampled) decision was made, when `decision_log` is on.
    decision_log: decision_log::DecisionLog,
    /// The fleet-wide enforcement switch, as last heard.
    fleet_switch: fleet_switch::FleetSwitch,
    /// Whether the worker is going away (its configuration replaced).
    closing: closing::Closing,
}

impl Worker {
    /// A worker for `config`, whose root context is `root_context_id`.
    pub fn new(host: &impl Host, mut config: Config, root_context_id: u32) -> Worker {
        if profile::SKIP_HEADERS {
            // The profiling build that makes no RateLimit headers.
            config.response.headers = crate::config::HeaderStyle::None;
        }
        info!(
            "meshlimit {}: configured {} rule(s), service cluster \"{}\", failure_mode {:?}, group commit {}",
            env!("CARGO_PKG_VERSION"),
            config.rules.len(),
            config.service.cluster,
            config.failure_mode,
            if config.group_commit.is_some() {
                "on"
            } else {
                "off"
            }
        );
        let outbox = Outbox::new(host, &config, root_context_id);
        let keys = instance_keys(host, &config);
        let fleet_switch = fleet_switch::FleetSwitch::new(keys.fleet_switch());
        let lease_ends_key = keys.lease_ends().to_string();
        let guard = Guard::new(&config, keys);
        let metrics = Metrics::define(host);
        metrics.set(host, Stat::Version, crate::stats::version_number());
        // The root's tick gives leased and drawn units back, and checks
        // that held headers get their bodies (see `hold`).
        let has_local = config
            .rules
            .iter()
            .any(|r| r.scope == crate::config::Scope::Local);
        let tick_ms = lease_book::tick_ms(config.leases)
            .or((has_local || config.allow_on_headers_stop_iteration).then_some(HOLD_TICK_MS));
        let lease_book = LeaseBook::new(host, config.leases, tick_ms, &lease_ends_key);
        // Without the tick, drawn units would not go back once idle.
        let local_draws = local_draws::LocalDraws::new(lease_book.ticking);
        let rule_stats = rule_stats::RuleStats::define(host, &config);
        rule_stats.set_ticking(lease_book.ticking);
        let hold = HeaderHold::new(config.allow_on_headers_stop_iteration);
        let decision_log = decision_log::DecisionLog::new(&config, host.random_seed().1);
        Worker {
            metrics,
            config,
            root_context_id,
            fallback_log: LogThrottle::new(LOG_EVERY_MS),
            error_log: LogThrottle::new(LOG_EVERY_MS),
            cut_log: LogThrottle::new(LOG_EVERY_MS),
            outbox,
            hold,
            deferred: deferred_deny::DeferredDenies::default(),
            guard,
            decided_headers: RefCell::default(),
            awaiting: RefCell::default(),
            budgets: RefCell::default(),
            lease_book,
            plan_memo: RefCell::default(),
            hits: hit::Hits::default(),
            local_draws,
            rule_stats,
            decision_log,
            fleet_switch,
            closing: closing::Closing::default(),
        }
    }

    /// The state of a new stream.
    pub fn stream(&self, context_id: u32) -> Stream {
        Stream {
            context_id,
            in_flight: None,
            response_headers: Vec::new(),
            awaiting_body: None,
            hit: false,
            hit_headers: None,
            trace: None,
        }
    }

    /// Whether call `token` is the stream's own check (else it is a call
    /// the stream sent for its worker: a top-up or a settlement).
    pub fn owns_call(&self, stream: &Stream, token: u32) -> bool {
        stream.in_flight.as_ref().is_some_and(|f| f.token == token)
    }

    /// The request's headers are in: decide, or start deciding.
    /// `end_of_stream`: the request has no body.
    pub fn on_request_headers(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        end_of_stream: bool,
    ) -> Step {
        // Every header in one hostcall: the path, the method, the id and
        // cost headers are then read without crossing into Envoy again,
        // and a repeated header is seen as such.
        if profile::SKIP_READ {
            return Step::Continue;
        }
        let request = Request::read(host);
        if profile::SKIP_PLAN {
            return Step::Continue;
        }
        let (method, path) = (request.text(":method"), request.text(":path"));
        let planned = self
            .plan_memo
            .borrow_mut()
            .plan(&self.config, &request, &method, &path);
        let check = match planned {
            Plan::Pass { skipped } => {
                self.metrics
                    .add(host, Stat::SkippedMissingAttribute, skipped as usize);
                return Step::Continue;
            }
            Plan::Reject(deny, why) => {
                self.metrics.bump(
                    host,
                    match why {
                        RejectReason::NoClientId => Stat::RejectedNoClientId,
                        RejectReason::InvalidCost => Stat::RejectedInvalidCost,
                        RejectReason::CostAboveCapacity => Stat::RejectedCostAboveCapacity,
                        RejectReason::MissingAttribute => Stat::RejectedMissingAttribute,
                    },
                );
                return Step::Reply(deny);
            }
            Plan::Check(check) => check,
        };
        self.metrics
            .add(host, Stat::SkippedMissingAttribute, check.skipped as usize);
        // Read now, with the headers at hand: the call, if one is made,
        // is sent later (from the body, or by the root).
        stream.trace = TraceContext::read(request.headers()).map(Box::new);
        if profile::SKIP_DECIDE {
            return Step::Continue;
        }
        if check.reserves_from_body().is_some() && !end_of_stream {
            return self.await_body(host, stream, check);
        }
        if check.reserves_from_body().is_some() {
            // No body at all: the reservation's default, and no body field.
            return self.decide_with_body(host, stream, Rc::unwrap_or_clone(check), None, 0);
        }
        self.decide(host, stream, check)
    }

    /// The upstream's response headers are in: add the RateLimit headers.
    /// False when the response must wait (a token budget settling first).
    pub fn on_response_headers(&self, host: &impl Host, stream: &mut Stream) -> bool {
        if stream.hit {
            if let Some(hit) = stream.hit_headers.take() {
                self.add_hit_headers(host, &hit);
            }
            for (name, value) in std::mem::take(&mut stream.response_headers) {
                host.add_response_header(name, &value);
            }
            return true;
        }
        self.on_decided_response_headers(host, stream)
    }

    /// The response of a request decided otherwise than as a hit.
    #[inline(never)]
    fn on_decided_response_headers(&self, host: &impl Host, stream: &mut Stream) -> bool {
        let mut headers = std::mem::take(&mut stream.response_headers);
        if let Some(decided) = self.decided_headers.borrow_mut().remove(&stream.context_id) {
            headers.extend(decided);
        }
        let go_on = self.token_response_headers(host, stream.context_id, &mut headers);
        for (name, value) in headers {
            host.add_response_header(name, &value);
        }
        go_on
    }

    /// The stream is gone. A check still queued leaves the batch; one
    /// already sent is skipped when the answer comes (its context is gone).
    /// A reservation not settled yet is settled as the request got
    /// (`on_stream_gone`).
    pub fn on_stream_end(&self, host: &impl Host, stream: &Stream) {
        if stream.hit {
            return;
        }
        let id = stream.context_id;
        self.decided_headers.borrow_mut().remove(&id);
        self.awaiting.borrow_mut().remove(&id);
        self.hold.forget(id);
        self.deferred.forget(id);
        self.outbox.forget_stream(id);
        self.on_stream_gone(host, id);
    }

    /// The root's tick: held headers whose bodies never came go on, then
    /// leased units idle or expired go back (see `leases`).
    pub fn on_tick(&self, host: &impl Host) {
        if self.closing.started() {
            return self.finish_closing(host, true);
        }
        if self.hold.unproven() {
            for id in self.hold.overdue(host.now_ms()) {
                if host.set_effective_context(id) {
                    host.resume_request();
                }
            }
            host.set_effective_context(self.root_context_id);
        }
        let due = self.deferred.due(host.now_ms());
        if !due.is_empty() {
            for (id, deny) in due {
                self.act_for(host, id, Verdict::Deny(deny));
            }
            host.set_effective_context(self.root_context_id);
        }
        self.name_lost_on_tick(host);
        self.lease_tick(host);
        self.local_draws_tick(host);
        self.rule_stats.flush(host);
    }

    /// A stream woke the root: send every batch that is due.
    pub fn on_wake(&self, host: &impl Host) {
        self.flush(host, host.now_ms());
    }

    /// Carries out a verdict for a paused stream from another context (the
    /// root, after a batch). False when the stream is gone.
    fn act_for(&self, host: &impl Host, context_id: u32, verdict: Verdict) -> bool {
        if !host.set_effective_context(context_id) {
            return false;
        }
        match verdict {
            Verdict::Allow { headers } => {
                self.decided_headers
                    .borrow_mut()
                    .insert(context_id, headers);
                host.resume_request();
            }
            Verdict::Deny(deny) => {
                perform(host, Step::Reply(deny), true);
            }
        }
        true
    }
}

/// This plugin instance's shared-data keys: namespaced by what tells it
/// from another meshlimit plugin in the same proxy (see `shared::keys`).
fn instance_keys(host: &impl Host, config: &Config) -> keys::Keys {
    let name = host.property(&["plugin_name"]).unwrap_or_default();
    let root_id = host.property(&["plugin_root_id"]).unwrap_or_default();
    let id = keys::instance_id(&name, &root_id, &config.service.cluster);
    info!(
        "shared data under meshlimit.{id} (plugin \"{}\", root id \"{}\", cluster \"{}\")",
        String::from_utf8_lossy(&name),
        String::from_utf8_lossy(&root_id),
        config.service.cluster
    );
    keys::Keys::new(&id)
}

impl Stream {
    /// The step for a verdict reached while the stream's own callback runs.
    fn apply(&mut self, verdict: Verdict) -> Step {
        match verdict {
            Verdict::Allow { headers } => {
                self.response_headers = headers;
                Step::Continue
            }
            Verdict::Deny(deny) => Step::Reply(deny),
        }
    }
}

/// The verdict for a request whose global limits were decided (by
/// meshlimitd or a fallback) after its local ones admitted it.
fn with_local(
    config: &Config,
    check: &Check,
    local: Option<&CheckResult>,
    global: &CheckResult,
) -> Verdict {
    match local {
        None => decision::verdict(config, &check.global, global),
        Some(local) => {
            // failure_mode allow reports no global statuses.
            let global_limits = if global.limits.is_empty() {
                &[][..]
            } else {
                &check.global[..]
            };
            let (applied, result) =
                decision::combine((&check.local, local), (global_limits, global));
            decision::verdict(config, &applied, &result)
        }
    }
}
