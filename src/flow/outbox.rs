//! The outbox: every call a worker sends to meshlimitd, and which context
//! sends it.
//!
//! Why the context matters: proxy-wasm's Rust SDK files a call under the
//! context whose callback dispatched it and hands the answer to that
//! context alone, whatever `set_effective_context` said; once that context
//! is deleted, the answer is dropped. So a call whose answer must outlive
//! the request that caused it (a lease grant, a reservation to give back,
//! a renewal, a return, a settlement, a top-up) leaves from a root
//! callback: it is queued here, the root is woken through the worker's
//! shared queue (or its tick comes), and the root sends it. With group
//! commit on, queued jobs share calls (see [`crate::batch`]); with it off,
//! each goes in a call of its own, at once.
//!
//! Two kinds of call leave from a stream's callback, and their answers go
//! to that stream: a plain check that only its request waits for (group
//! commit off), and, when the root cannot be woken, a job its stream's
//! response waits for. The second kind is kept here by token, with the
//! stream, and forgotten when the stream ends.
//!
//! Every call is owned by the root on Envoy's side (the effective context
//! when it is dispatched): Envoy cancels a stream's calls when it ends and
//! never answers them, which would leave the SDK's entry for good.

use std::cell::RefCell;

use log::warn;
use meshlimit_protocol::{CheckRequest, Settlement};

use crate::batch::{BatchConfig, Batcher, Enqueued};
use crate::check::Check;
use crate::config::{Config, ServiceConfig};
use crate::context_map::ContextMap;
use crate::decision::ServiceError;
use crate::host::{Call, Host};
use crate::shared::keys;
use crate::throttle::LogThrottle;
use crate::trace_context::TraceContext;
use meshlimit_protocol::CheckResult;

/// With group commit off: one job a call, each sent as soon as it is
/// queued; at most this many calls out at once, then jobs wait for a
/// free one (bounded memory, and no more than group commit allows queued).
const ONE_A_CALL: BatchConfig = BatchConfig {
    max_batch: 1,
    max_age_ms: 0,
    max_queued: 1024,
    max_in_flight: 1024,
};

/// Interval between two log lines about calls that cannot be sent.
const LOG_EVERY_MS: u64 = 10_000;

/// Work waiting in (or sent in) a call, and the context it is for.
pub(super) struct Queued {
    pub(super) context_id: u32,
    pub(super) job: Job,
}

/// What a queued item asks of meshlimitd.
pub(super) enum Job {
    /// Decide a paused request.
    Admit {
        check: Check,
        /// The admitted decision of the request's `scope: local` rules.
        local: Option<CheckResult>,
        /// The request's trace context, forwarded with the check.
        trace: Option<Box<TraceContext>>,
    },
    /// Reserve more for a stream that outgrew its reservation.
    TopUp { check: Check },
    /// Settle a finished request's reservations.
    Settle { settlements: Vec<Settlement> },
    /// Ask for the next lease of a check whose lease runs low (a check of
    /// cost 0: no request waits on it).
    Renew { check: Check },
    /// Give back leased units left unused (settlements at 0).
    Return { settlements: Vec<Settlement> },
    /// Name lease asks whose answers were lost: their grants go back.
    Lost {
        asks: Vec<meshlimit_protocol::LostAsk>,
    },
}

impl Queued {
    /// The check it carries, if any.
    pub(super) fn check(&self) -> Option<&Check> {
        match &self.job {
            Job::Admit { check, .. } | Job::TopUp { check } | Job::Renew { check } => Some(check),
            Job::Settle { .. } | Job::Return { .. } | Job::Lost { .. } => None,
        }
    }

    /// The trace context of the request it decides, if any.
    fn trace(&self) -> Option<&TraceContext> {
        match &self.job {
            Job::Admit { trace, .. } => trace.as_deref(),
            _ => None,
        }
    }

    /// The check as it goes on the wire, with its request's trace context.
    fn to_wire(&self) -> Option<meshlimit_protocol::Check> {
        let mut wire = self.check()?.to_wire();
        wire.trace = self.trace().map(TraceContext::traceparent);
        Some(wire)
    }

    pub(super) fn settlements(&self) -> &[Settlement] {
        match &self.job {
            Job::Settle { settlements } | Job::Return { settlements } => settlements,
            _ => &[],
        }
    }

    /// The lost asks it names, if any.
    pub(super) fn lost(&self) -> &[meshlimit_protocol::LostAsk] {
        match &self.job {
            Job::Lost { asks, .. } => asks,
            _ => &[],
        }
    }
}

/// What became of a job handed to [`Outbox::queue`].
pub(super) enum Queue {
    /// Queued: the root sends it.
    Queued,
    /// Too many jobs wait: here it is back, to decide without meshlimitd.
    Refused(Queued),
    /// The root cannot be woken: here it is back (see [`Outbox::send_from`]).
    NoWake(Queued),
}

/// A call sent from a stream's callback: its answer goes to that stream.
struct FromStream {
    context_id: u32,
    jobs: Vec<Queued>,
}

/// The worker's calls: jobs waiting for the root, and calls in flight.
pub(super) struct Outbox {
    /// Jobs waiting for a call, and the root's calls in flight.
    batcher: RefCell<Batcher<Queued>>,
    /// Group commit is on: requests' checks share calls too.
    batching: bool,
    /// The root's shared queue: enqueueing to it wakes the root.
    wake_queue: Option<u32>,
    root_context_id: u32,
    /// When each call went out, by token.
    started: RefCell<ContextMap<u64>>,
    /// Jobs sent from a stream's callback, by token.
    from_streams: RefCell<ContextMap<FromStream>>,
    dispatch_log: LogThrottle,
}

impl Outbox {
    /// The outbox of a worker whose root context is `root_context_id`.
    pub(super) fn new(host: &impl Host, config: &Config, root_context_id: u32) -> Outbox {
        // One queue per worker: each worker's streams wake their own root.
        let wake_queue = host.register_queue(&keys::wake_queue(host.random_seed().0));
        if wake_queue.is_none() {
            warn!("cannot register the worker's wake-up queue; calls leave from requests' callbacks, and answers may be lost with them");
        }
        Outbox {
            batcher: RefCell::new(Batcher::new(config.group_commit.unwrap_or(ONE_A_CALL))),
            batching: config.group_commit.is_some() && wake_queue.is_some(),
            wake_queue,
            root_context_id,
            started: RefCell::default(),
            from_streams: RefCell::default(),
            dispatch_log: LogThrottle::new(LOG_EVERY_MS),
        }
    }

    /// Whether requests' checks share calls (group commit on, and the
    /// root can be woken).
    pub(super) fn batching(&self) -> bool {
        self.batching
    }

    /// Queues a job for the root to send, and wakes the root if it must.
    pub(super) fn queue(&self, host: &impl Host, queued: Queued, now: u64) -> Queue {
        let Some(wake_queue) = self.wake_queue else {
            return Queue::NoWake(queued);
        };
        let outcome = self.batcher.borrow_mut().enqueue(queued, now);
        match outcome {
            Enqueued::Wait => Queue::Queued,
            Enqueued::Refused(queued) => Queue::Refused(queued),
            Enqueued::Wake if host.enqueue(wake_queue) => Queue::Queued,
            Enqueued::Wake => {
                let mut batcher = self.batcher.borrow_mut();
                batcher.wake_failed();
                match batcher.withdraw_last() {
                    Some(queued) => Queue::NoWake(queued),
                    None => Queue::Queued,
                }
            }
        }
    }

    /// Puts a job no request waits on aside, for the next call with room
    /// or the root's tick; gives it back when too many wait already.
    pub(super) fn defer(&self, queued: Queued) -> Option<Queued> {
        self.batcher.borrow_mut().defer(queued).err()
    }

    /// The next jobs the root should send: a batch that is due, or with
    /// `deferred`, the deferred jobs too (the tick).
    pub(super) fn take(&self, now: u64, deferred: bool) -> Option<Vec<Queued>> {
        let mut batcher = self.batcher.borrow_mut();
        if deferred {
            batcher.take_deferred().or_else(|| batcher.take_batch(now))
        } else {
            batcher.take_batch(now)
        }
    }

    /// Sends `jobs` in one call as the root (the root's callback runs).
    /// The jobs back with the error when it cannot be sent.
    pub(super) fn send(
        &self,
        host: &impl Host,
        service: &ServiceConfig,
        jobs: Vec<Queued>,
        now: u64,
    ) -> Result<u32, (Vec<Queued>, ServiceError)> {
        // After acting for streams, calls must belong to the root again.
        host.set_effective_context(self.root_context_id);
        match self.dispatch_jobs(host, service, &jobs, now) {
            Ok(token) => {
                self.started.borrow_mut().insert(token, now);
                self.batcher.borrow_mut().sent(token, jobs);
                Ok(token)
            }
            Err(e) => Err((jobs, e)),
        }
    }

    /// Sends `jobs` in one call from the callback of context `context_id`
    /// that runs now (the root could not be woken, and a response waits on
    /// them): the answer goes to that context while it lives.
    pub(super) fn send_from(
        &self,
        host: &impl Host,
        service: &ServiceConfig,
        context_id: u32,
        jobs: Vec<Queued>,
        now: u64,
    ) -> Result<(), ServiceError> {
        host.set_effective_context(self.root_context_id);
        let sent = self.dispatch_jobs(host, service, &jobs, now);
        host.set_effective_context(context_id);
        let token = sent?;
        self.started.borrow_mut().insert(token, now);
        self.from_streams
            .borrow_mut()
            .insert(token, FromStream { context_id, jobs });
        Ok(())
    }

    /// Sends one check, for the stream whose callback runs now, as the
    /// root (so that Envoy never cancels it); the answer goes to the
    /// stream. The stream keeps the token and when it was sent.
    pub(super) fn send_check(
        &self,
        host: &impl Host,
        service: &ServiceConfig,
        context_id: u32,
        (check, trace): (&Check, Option<&TraceContext>),
        now: u64,
    ) -> Result<u32, ServiceError> {
        host.set_effective_context(self.root_context_id);
        let mut request = check.to_request();
        for wire in &mut request.checks {
            wire.trace = trace.map(TraceContext::traceparent);
        }
        let dispatched = serde_json::to_vec(&request)
            .map_err(|e| ServiceError::BadBody(e.to_string()))
            .and_then(|body| self.dispatch(host, service, &body, trace, now));
        host.set_effective_context(context_id);
        dispatched
    }

    /// The jobs call `token` carried and when it went out, once it is
    /// answered (or failed); `None` for a call the outbox does not hold.
    pub(super) fn answered(&self, token: u32) -> Option<(Vec<Queued>, u64)> {
        let jobs = self.batcher.borrow_mut().answered(token).or_else(|| {
            self.from_streams
                .borrow_mut()
                .remove(&token)
                .map(|f| f.jobs)
        })?;
        let started = self.started.borrow_mut().remove(&token).unwrap_or(0);
        Some((jobs, started))
    }

    /// Stream `context_id` ended: its check still queued leaves, and the
    /// calls sent from its callbacks are forgotten (the SDK drops their
    /// answers with the context).
    pub(super) fn forget_stream(&self, context_id: u32) {
        if let Ok(mut b) = self.batcher.try_borrow_mut() {
            let _ =
                b.withdraw(|q| q.context_id == context_id && matches!(q.job, Job::Admit { .. }));
        }
        let mut started = self.started.borrow_mut();
        self.from_streams.borrow_mut().retain(|token, sent| {
            let theirs = sent.context_id == context_id;
            if theirs {
                started.remove(token);
            }
            !theirs
        });
    }

    /// No call is out and no job waits (every answer came back).
    pub(super) fn is_idle(&self) -> bool {
        let b = self.batcher.borrow();
        b.queued() == 0
            && b.calls_in_flight() == 0
            && self.started.borrow().is_empty()
            && self.from_streams.borrow().is_empty()
    }

    /// Sends the checks and settlements of `jobs` in one call.
    fn dispatch_jobs(
        &self,
        host: &impl Host,
        service: &ServiceConfig,
        jobs: &[Queued],
        now: u64,
    ) -> Result<u32, ServiceError> {
        let request = CheckRequest {
            checks: jobs.iter().filter_map(Queued::to_wire).collect(),
            settlements: jobs
                .iter()
                .flat_map(|q| q.settlements().iter().cloned())
                .collect(),
            lost: jobs.iter().flat_map(|q| q.lost().iter().cloned()).collect(),
        };
        serde_json::to_vec(&request)
            .map_err(|e| ServiceError::BadBody(e.to_string()))
            .and_then(|body| {
                let trace = jobs.iter().find_map(Queued::trace);
                self.dispatch(host, service, &body, trace, now)
            })
    }

    /// Sends a check request to meshlimitd from the current context.
    fn dispatch(
        &self,
        host: &impl Host,
        service: &ServiceConfig,
        body: &[u8],
        trace: Option<&TraceContext>,
        now: u64,
    ) -> Result<u32, ServiceError> {
        host.dispatch(&Call {
            cluster: &service.cluster,
            authority: &service.authority,
            path: meshlimit_protocol::CHECK_PATH,
            body,
            timeout_ms: service.timeout_ms,
            authorization: service.authorization.as_deref(),
            trace,
        })
        .map_err(|e| {
            // Typically an unknown cluster, or no healthy meshlimitd.
            if let Some(skipped) = self.dispatch_log.allow(now) {
                warn!(
                    "cannot dispatch to cluster \"{}\": {e} ({skipped} similar lines suppressed)",
                    service.cluster
                );
            }
            ServiceError::Connection
        })
    }
}
