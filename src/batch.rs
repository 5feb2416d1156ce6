//! Group commit: the checks of concurrent requests on one Envoy worker,
//! coalesced into one call to meshlimitd.
//!
//! When no call is in flight a check goes out at once (no added latency at
//! low load). While one is in flight, new checks queue; they go out together
//! when it returns, or earlier when the queue reaches `max_batch` checks or
//! its oldest check is `max_age_ms` old (then several calls are in flight,
//! up to `max_in_flight`). With `max_age_ms` 0 (the default) a check waits
//! only while every call slot is busy: the checks that arrive in one pass
//! of the worker's event loop still go out together (the root is woken
//! once, after them), and at saturation the slots stay busy, so batches
//! grow by themselves. Beyond `max_queued` checks a new one is refused, and
//! the caller decides it by `failure_mode`. Each check is still decided on
//! its own and atomically by meshlimitd; only the round trip is shared.
//!
//! A job no request waits on (a lease renewal asked well before the lease
//! runs out) may be deferred instead: it wakes nobody, rides the next batch
//! that goes out with room for it, and otherwise goes when the root's tick
//! asks for the deferred ones ([`Batcher::take_deferred`]). Many such jobs
//! then share one call instead of one call each.
//!
//! This is the policy alone; [`crate::flow`] owns the calls and the queue.

use std::collections::VecDeque;

use crate::context_map::ContextMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    pub max_batch: usize,
    pub max_age_ms: u64,
    pub max_queued: usize,
    /// Calls in flight at once.
    pub max_in_flight: usize,
}

/// What the caller should do after queueing a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued<T> {
    /// Queued; ask the root context to flush (it may send at once).
    Wake,
    /// Queued behind a call in flight; nothing to do.
    Wait,
    /// The queue is full: here it is back, decide it without meshlimitd.
    Refused(T),
}

/// Checks waiting for a call, and the calls in flight.
#[derive(Debug)]
pub struct Batcher<T> {
    config: BatchConfig,
    queue: VecDeque<(u64, T)>,
    /// Jobs that wait for a batch to ride, or for the tick.
    deferred: VecDeque<T>,
    in_flight: ContextMap<Vec<T>>,
    /// A wake-up is already on its way to the root context.
    wake_pending: bool,
}

impl<T> Batcher<T> {
    pub fn new(config: BatchConfig) -> Self {
        Batcher {
            config,
            queue: VecDeque::new(),
            deferred: VecDeque::new(),
            in_flight: ContextMap::default(),
            wake_pending: false,
        }
    }

    /// Jobs waiting, deferred ones included.
    pub fn queued(&self) -> usize {
        self.queue.len() + self.deferred.len()
    }

    pub fn calls_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    pub fn enqueue(&mut self, item: T, now_ms: u64) -> Enqueued<T> {
        if self.queue.len() >= self.config.max_queued {
            return Enqueued::Refused(item);
        }
        self.queue.push_back((now_ms, item));
        if !self.wake_pending && self.should_send(now_ms) {
            self.wake_pending = true;
            Enqueued::Wake
        } else {
            Enqueued::Wait
        }
    }

    /// Queues a job that no request waits on, to go with the next batch
    /// or the tick's ([`Batcher::take_deferred`]); it wakes nobody. `Err`
    /// gives it back when `max_queued` jobs wait already (bounded on their
    /// own: they never make a request's check be refused).
    pub fn defer(&mut self, item: T) -> Result<(), T> {
        if self.deferred.len() >= self.config.max_queued {
            return Err(item);
        }
        self.deferred.push_back(item);
        Ok(())
    }

    fn should_send(&self, now_ms: u64) -> bool {
        if self.queue.is_empty() || self.in_flight.len() >= self.config.max_in_flight {
            return false;
        }
        self.in_flight.is_empty()
            || self.queue.len() >= self.config.max_batch
            || self
                .queue
                .front()
                .is_some_and(|(at, _)| now_ms.saturating_sub(*at) >= self.config.max_age_ms)
    }

    /// The next batch to send, if one is due (the root context calls this
    /// when woken and after every answer). The wake-up is consumed.
    pub fn take_batch(&mut self, now_ms: u64) -> Option<Vec<T>> {
        self.wake_pending = false;
        if !self.should_send(now_ms) {
            return None;
        }
        Some(self.next_batch())
    }

    /// The deferred jobs' batch, when there are any and a call slot is free
    /// (the root's tick calls this until it returns `None`). Checks queued
    /// meanwhile go first.
    pub fn take_deferred(&mut self) -> Option<Vec<T>> {
        if self.deferred.is_empty() || self.in_flight.len() >= self.config.max_in_flight {
            return None;
        }
        Some(self.next_batch())
    }

    /// Up to `max_batch` jobs: the queued checks first, then deferred jobs
    /// riding along in the room left.
    fn next_batch(&mut self) -> Vec<T> {
        let n = self.queue.len().min(self.config.max_batch);
        let mut batch: Vec<T> = self.queue.drain(..n).map(|(_, item)| item).collect();
        let room = self.config.max_batch.saturating_sub(batch.len());
        let n = self.deferred.len().min(room);
        batch.extend(self.deferred.drain(..n));
        batch
    }

    /// The wake-up could not be sent: the next enqueue must try again.
    pub fn wake_failed(&mut self) {
        self.wake_pending = false;
    }

    /// Takes a queued (not yet sent) check back, e.g. because its stream
    /// ended or it must be decided elsewhere.
    pub fn withdraw(&mut self, mut which: impl FnMut(&T) -> bool) -> Option<T> {
        if let Some(pos) = self.queue.iter().position(|(_, item)| which(item)) {
            return self.queue.remove(pos).map(|(_, item)| item);
        }
        let pos = self.deferred.iter().position(which)?;
        self.deferred.remove(pos)
    }

    /// Takes back the check queued last (its wake-up could not be sent,
    /// and it must be decided elsewhere).
    pub fn withdraw_last(&mut self) -> Option<T> {
        self.queue.pop_back().map(|(_, item)| item)
    }

    /// Records a batch sent as call `token`.
    pub fn sent(&mut self, token: u32, batch: Vec<T>) {
        self.in_flight.insert(token, batch);
    }

    /// The batch answered by call `token`.
    pub fn answered(&mut self, token: u32) -> Option<Vec<T>> {
        self.in_flight.remove(&token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batcher() -> Batcher<u32> {
        Batcher::new(BatchConfig {
            max_batch: 3,
            max_age_ms: 5,
            max_queued: 6,
            max_in_flight: 2,
        })
    }

    #[test]
    fn an_idle_batcher_sends_at_once() {
        let mut b = batcher();
        assert_eq!(b.enqueue(1, 0), Enqueued::Wake);
        assert_eq!(b.take_batch(0), Some(vec![1]));
    }

    #[test]
    fn checks_queue_behind_a_call_and_go_out_together() {
        let mut b = batcher();
        b.enqueue(1, 0);
        let first = b.take_batch(0).unwrap();
        b.sent(7, first);
        assert_eq!(b.enqueue(2, 1), Enqueued::Wait);
        assert_eq!(b.enqueue(3, 1), Enqueued::Wait);
        assert_eq!(
            b.take_batch(1),
            None,
            "a call is in flight and the caps are not reached"
        );
        assert_eq!(b.answered(7), Some(vec![1]));
        assert_eq!(b.take_batch(2), Some(vec![2, 3]));
    }

    #[test]
    fn a_full_batch_or_an_old_check_goes_out_while_a_call_is_in_flight() {
        let mut b = batcher();
        b.enqueue(1, 0);
        let first = b.take_batch(0).unwrap();
        b.sent(1, first);
        b.enqueue(2, 1);
        b.enqueue(3, 1);
        assert_eq!(b.enqueue(4, 1), Enqueued::Wake, "max_batch reached");
        let second = b.take_batch(1).unwrap();
        assert_eq!(second, vec![2, 3, 4]);
        b.sent(2, second);
        // Two calls in flight: the cap; an old check waits for an answer.
        b.enqueue(5, 2);
        assert_eq!(b.take_batch(100), None);
        b.answered(1);
        assert_eq!(b.take_batch(100), Some(vec![5]));
    }

    #[test]
    fn age_alone_triggers_a_send() {
        let mut b = batcher();
        b.enqueue(1, 0);
        let first = b.take_batch(0).unwrap();
        b.sent(1, first);
        assert_eq!(b.enqueue(2, 10), Enqueued::Wait);
        assert_eq!(
            b.enqueue(3, 15),
            Enqueued::Wake,
            "the oldest queued check is 5 ms old"
        );
        assert_eq!(b.take_batch(15), Some(vec![2, 3]));
    }

    #[test]
    fn with_no_queue_age_checks_queue_only_while_every_slot_is_busy() {
        let mut b = Batcher::new(BatchConfig {
            max_batch: 3,
            max_age_ms: 0,
            max_queued: 6,
            max_in_flight: 2,
        });
        b.enqueue(1, 0);
        let first = b.take_batch(0).unwrap();
        b.sent(1, first);
        assert_eq!(b.enqueue(2, 0), Enqueued::Wake, "a slot is free");
        assert_eq!(b.enqueue(3, 0), Enqueued::Wait, "already waking");
        let second = b.take_batch(0).unwrap();
        assert_eq!(second, vec![2, 3], "everything queued meanwhile goes");
        b.sent(2, second);
        assert_eq!(b.enqueue(4, 0), Enqueued::Wait, "both slots busy");
        assert_eq!(b.take_batch(0), None);
        b.answered(2);
        assert_eq!(b.take_batch(0), Some(vec![4]));
    }

    #[test]
    fn a_full_queue_refuses() {
        let mut b = batcher();
        b.enqueue(0, 0);
        let first = b.take_batch(0).unwrap();
        b.sent(1, first);
        let second = {
            for i in 1..=3 {
                b.enqueue(i, 0);
            }
            b.take_batch(0).unwrap()
        };
        b.sent(2, second);
        for i in 0..6 {
            assert_ne!(b.enqueue(10 + i, 0), Enqueued::Refused(10 + i));
        }
        assert_eq!(b.enqueue(99, 0), Enqueued::Refused(99));
        assert_eq!(b.queued(), 6);
        assert_eq!(b.withdraw(|i| *i == 12), Some(12));
        assert_eq!(b.withdraw(|i| *i == 12), None);
        assert_eq!(b.queued(), 5);
    }

    #[test]
    fn deferred_jobs_ride_the_next_batch_or_go_at_the_tick() {
        let mut b = batcher();
        assert_eq!(b.defer(1), Ok(()));
        assert_eq!(b.take_batch(0), None, "a deferred job alone wakes nobody");
        assert_eq!(b.enqueue(2, 0), Enqueued::Wake);
        assert_eq!(
            b.take_batch(0),
            Some(vec![2, 1]),
            "it rides, after the checks"
        );
        // Three deferred jobs: the tick sends them, max_batch at a time.
        for i in 3..=6 {
            b.defer(i).unwrap();
        }
        assert_eq!(b.take_deferred(), Some(vec![3, 4, 5]));
        b.sent(1, vec![]);
        assert_eq!(b.take_deferred(), Some(vec![6]));
        b.sent(2, vec![]);
        assert_eq!(b.take_deferred(), None, "nothing left");
        b.defer(7).unwrap();
        assert_eq!(b.take_deferred(), None, "every call slot is busy");
        b.answered(1);
        assert_eq!(b.take_deferred(), Some(vec![7]));
        // Bounded on their own: a request's check still queues.
        for i in 10..16 {
            b.defer(i).unwrap();
        }
        assert_eq!(b.defer(99), Err(99));
        assert_ne!(b.enqueue(98, 0), Enqueued::Refused(98));
        assert_eq!(b.withdraw(|i| *i == 12), Some(12));
    }

    #[test]
    fn one_wake_at_a_time() {
        let mut b = batcher();
        assert_eq!(b.enqueue(1, 0), Enqueued::Wake);
        assert_eq!(
            b.enqueue(2, 0),
            Enqueued::Wait,
            "a wake-up is already on its way"
        );
        assert_eq!(b.take_batch(0), Some(vec![1, 2]));
    }
}
