//! Calls to meshlimitd: a request's own (group commit off, or the root
//! cannot be woken), a request's check queued for the root's batches, and
//! the root sending what is due.

use meshlimit_protocol::CheckResult;

use super::outbox::{Job, Queue, Queued};
use super::{profile, InFlight, Step, Stream, Worker};
use crate::check::Check;
use crate::decision::ServiceError;
use crate::host::Host;
use crate::stats::Stat;

impl Worker {
    /// Calls meshlimitd for this request alone, from its callback: only
    /// the request waits for the answer.
    pub(super) fn ask_service(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        now: u64,
        check: Check,
        local: Option<CheckResult>,
    ) -> Step {
        let dispatched = self.outbox.send_check(
            host,
            &self.config.service,
            stream.context_id,
            (&check, stream.trace.as_deref()),
            now,
        );
        match dispatched {
            Ok(token) => {
                stream.in_flight = Some(Box::new(InFlight {
                    token,
                    check,
                    started_ms: now,
                    local,
                }));
                Step::Pause
            }
            Err(e) => {
                self.guard.record_call(host, &self.metrics, false, now);
                self.conclude(host, stream, now, &check, local.as_ref(), Err(e))
            }
        }
    }

    /// Queues the check for the root to send (in a batch, with group
    /// commit on).
    pub(super) fn enqueue(
        &self,
        host: &impl Host,
        stream: &mut Stream,
        now: u64,
        check: Check,
        local: Option<CheckResult>,
    ) -> Step {
        self.awaiting.borrow_mut().insert(stream.context_id);
        let queued = Queued {
            context_id: stream.context_id,
            job: Job::Admit {
                check,
                local,
                trace: stream.trace.take(),
            },
        };
        let outcome = self.outbox.queue(host, queued, now);
        let paused = if profile::SKIP_PAUSE {
            // Its answer will find it gone, and act on nothing.
            self.awaiting.borrow_mut().remove(&stream.context_id);
            Step::Continue
        } else {
            Step::Pause
        };
        match outcome {
            Queue::Queued => paused,
            // The root cannot be woken: call for this check ourselves.
            Queue::NoWake(Queued {
                job:
                    Job::Admit {
                        check,
                        local,
                        trace,
                    },
                ..
            }) => {
                self.awaiting.borrow_mut().remove(&stream.context_id);
                stream.trace = trace;
                self.ask_service(host, stream, now, check, local)
            }
            Queue::Refused(Queued {
                job: Job::Admit { check, local, .. },
                ..
            }) => {
                // Too many queued: decide by failure_mode, and count it.
                self.awaiting.borrow_mut().remove(&stream.context_id);
                self.metrics.bump(host, Stat::BatchOverflow);
                self.conclude(
                    host,
                    stream,
                    now,
                    &check,
                    local.as_ref(),
                    Err(ServiceError::Connection),
                )
            }
            Queue::NoWake(_) | Queue::Refused(_) => paused,
        }
    }

    /// Sends every batch that is due, as the root (the calls outlive any
    /// one stream).
    pub(super) fn flush(&self, host: &impl Host, now: u64) {
        self.send_batches(host, now, false);
    }

    /// The root's tick: sends the deferred jobs (and whatever is queued
    /// with them), then every batch that is due.
    pub(super) fn flush_deferred(&self, host: &impl Host, now: u64) {
        self.send_batches(host, now, true);
    }

    /// Sends the outbox's due calls, as the root, until none is due.
    pub(super) fn send_batches(&self, host: &impl Host, now: u64, deferred: bool) {
        while let Some(batch) = self.outbox.take(now, deferred) {
            let checks = batch.iter().filter(|q| q.check().is_some()).count();
            match self.outbox.send(host, &self.config.service, batch, now) {
                // With group commit off, a call of one job is no batch.
                Ok(_) if self.outbox.batching() => {
                    self.metrics.bump(host, Stat::Batches);
                    self.metrics.add(host, Stat::BatchedChecks, checks);
                }
                Ok(_) => {}
                Err((batch, e)) => {
                    self.guard.record_call(host, &self.metrics, false, now);
                    self.settle_batch(host, now, &batch, Err(e));
                }
            }
        }
    }
}
