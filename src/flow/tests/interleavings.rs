//! Random interleavings of everything that can happen to the workers of
//! one Envoy (two VMs, one shared data): requests of a few clients on
//! either, each root's wake-ups, answers in any order (right, lost, 503,
//! malformed, short of a result, every number at `u64::MAX`), streams
//! reset at any point, time passing (each root ticking as Envoy's timer
//! makes it; a call answered past its timeout is heard as lost, as Envoy
//! gives up on it); with leases, group commit on or off, two limits, a
//! `scope: local` rule, `failure_mode: deny`, or a token budget (request
//! bodies, responses paused for their settlement). The answers come from
//! [`FakeMeshlimitd`] (a counter per limit and window, charged whether or
//! not its answer arrives), so that, whatever the order:
//!
//! - no callback panics (these tests build with overflow checks, so an
//!   arithmetic overflow the release build would wrap is caught here);
//! - the flow acts only on a stream that waits for it, of its own worker,
//!   and once;
//! - no stream is stranded: once every call is answered and the root has
//!   run, every paused request still alive was resumed or replied to, and
//!   every paused response resumed;
//! - with no call failing, or with `failure_mode: deny`, no client is
//!   admitted more requests, over both workers, than meshlimitd charged it
//!   units (leases included, drawn by either worker): nothing goes on that
//!   meshlimitd did not count;
//! - and the other way, with every answer right or lost, the run within
//!   one minute, and every lost ask named: every unit charged was
//!   admitted, given back (a lease returned, a reservation settled below
//!   it, what a lost ask was granted), or is the own cost of a request that
//!   left while it waited or whose answer was lost: no leased unit is kept
//!   from its client;
//! - whatever failed, every admission is a unit meshlimitd charged or a
//!   decision the fallback made and counted (`fallback_allowed`);
//! - whatever failed, the units admitted, given back and counted dropped
//!   from the lease slots (`lease_units_dropped`) are never more than
//!   meshlimitd charged and the fallback admitted: a unit is counted
//!   lost only if nothing else became of it;
//! - and, whatever failed, the flow heals: with meshlimitd right from then
//!   on, a client that keeps asking on one worker is served from a lease
//!   again within a few requests (limits large enough to lease).
//!
//! Each was seen failing on a flow broken for it (a failed call left
//! paused; a lease hit that spends half a unit; a fallback admission
//! counted as a denial; a failed settlement that leaves its response
//! paused; a lease return one unit short; a lost ask never named; and,
//! on main, a lease on two windows dropped when the shorter ended; a
//! slot counting a live lease's units as dropped; and, on main, asks
//! shrunk to nothing by lost answers never sent again).
//! `PROPTEST_CASES=20000` runs more (about 2 minutes).

use std::collections::{HashMap, HashSet};

use meshlimit_protocol::{CheckRequest, CheckResponse};
use proptest::prelude::*;

use super::*;

use super::fake_meshlimitd::FakeMeshlimitd;

const CLIENTS: [&str; 3] = ["a", "b", "c"];
/// Workers of one Envoy: each its own VM (flow state), all one shared
/// data (the fake host's store), as Envoy's worker threads.
const WORKERS: usize = 2;
const WINDOW_MS: u64 = 60_000;

/// How the model answers a call.
#[derive(Debug, Clone, Copy)]
enum Reply {
    /// As meshlimitd would: exact counters, leases granted from them.
    Right,
    /// No answer: a timeout or reset (Envoy calls back with no headers).
    Lost,
    /// A 503, as meshlimitd sends when Redis is away.
    Unavailable,
    /// A 200 whose body is not an answer.
    Malformed,
    /// The model's answer with every number at `u64::MAX` (a meshlimitd
    /// gone wrong, or not meshlimitd at all).
    Extreme,
    /// The model's answer with one result fewer than the checks.
    Short,
}

#[derive(Debug, Clone)]
enum Op {
    /// A request of a client, on a worker.
    Request(usize, usize),
    /// A worker's root is woken.
    Wake(usize),
    /// A worker's root ticks.
    Tick(usize),
    /// Answers the `n`th call still unanswered (modulo their number).
    Answer(usize, Reply),
    /// The `n`th stream still alive gets its response (if admitted) and
    /// ends, or is reset (if it waits).
    End(usize),
    /// The `n`th stream whose request body is due sends it, whole
    /// (token budgets).
    Body(usize),
    /// The `n`th stream admitted gets its response headers, or, once they
    /// went on, its response body, whole (token budgets).
    Respond(usize),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..CLIENTS.len(), 0..WORKERS).prop_map(|(c, w)| Op::Request(c, w)),
        3 => (0..WORKERS).prop_map(Op::Wake),
        1 => (0..WORKERS).prop_map(Op::Tick),
        5 => (any::<usize>(), reply()).prop_map(|(n, r)| Op::Answer(n, r)),
        3 => any::<usize>().prop_map(Op::End),
        3 => any::<usize>().prop_map(Op::Body),
        3 => any::<usize>().prop_map(Op::Respond),
        2 => prop_oneof![Just(1u64), Just(40), Just(300), Just(2_500)].prop_map(Op::Advance),
    ]
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        12 => Just(Reply::Right),
        1 => Just(Reply::Lost),
        1 => Just(Reply::Unavailable),
        1 => Just(Reply::Malformed),
        1 => Just(Reply::Extreme),
        1 => Just(Reply::Short),
    ]
}

/// Every number in `value` set to `u64::MAX`.
fn extreme(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Number(n) => *n = u64::MAX.into(),
        serde_json::Value::Array(items) => items.iter_mut().for_each(extreme),
        serde_json::Value::Object(fields) => fields.values_mut().for_each(extreme),
        _ => {}
    }
}

/// Where a stream stands, as the test saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Its request body is due (token budgets): the client's turn.
    AwaitingBody,
    Waiting,
    Admitted,
    Refused,
    /// Its response headers are paused (a token budget settling).
    ResponseHeld,
    /// Its response headers went on; its body is due.
    ResponseOpen,
    /// Its response's end is paused until its settlement is answered.
    ResponseWaiting,
    /// Its response went out whole.
    Responded,
}

struct Live {
    stream: Stream,
    client: usize,
    /// The worker whose VM holds the stream.
    worker: usize,
    fate: Fate,
}

struct Run {
    /// The host, and the worker being driven (`current`).
    h: Harness,
    current: usize,
    /// The other workers, each in its place (`None`: the one in `h`).
    parked: Vec<Option<Worker>>,
    /// Which worker sent each call (its answer goes back to that VM).
    sender: HashMap<u32, usize>,
    model: FakeMeshlimitd,
    streams: HashMap<u32, Live>,
    answered: HashSet<u32>,
    admitted: [u64; CLIENTS.len()],
    /// A call failed (lost, 503, malformed): the fallback may have
    /// decided, and admits by its own local counters.
    faults: bool,
    setup: Setup,
    /// Requests per client whose stream ended while they waited: a check
    /// meshlimitd charged for a client that left is not given back.
    left_waiting: [u64; CLIENTS.len()],
    /// The window the run began in.
    window: u64,
    /// Units per client of the checks whose answers were lost: the
    /// request's own cost stays charged (the fallback decided it); only
    /// leased and reserved units go back.
    lost_costs: [u64; CLIENTS.len()],
    /// An answer came back unreadable or short (or a 503): what it
    /// charged cannot be accounted for.
    garbled: bool,
}

/// The configurations tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    OneLimit,
    /// A second, shorter limit on the same rule (the tighter decides).
    TwoLimits,
    /// A `scope: local` rule before the global one.
    WithLocalRule,
    /// `failure_mode: deny`: nothing meshlimitd did not charge goes on.
    FailClosed,
    /// A token budget: a reservation read from the body, settled from the
    /// response's usage before the response ends.
    Tokens,
}

impl Run {
    fn new(limit: u64, group_commit: bool, setup: Setup) -> Run {
        let (extra, rules) = match setup {
            Setup::OneLimit => (
                "",
                format!(
                    r#"{{"name": "api", "match": {{"path_prefix": "/api/"}},
                "limits": [{{"name": "m", "requests": {limit}, "window": "60s"}}]}}"#
                ),
            ),
            Setup::TwoLimits => (
                "",
                format!(
                    r#"{{"name": "api", "match": {{"path_prefix": "/api/"}},
                "limits": [{{"name": "s", "requests": {}, "window": "1s"}},
                           {{"name": "m", "requests": {limit}, "window": "60s"}}]}}"#,
                    limit.div_ceil(4)
                ),
            ),
            Setup::WithLocalRule => (
                "",
                format!(
                    r#"{{"name": "edge", "scope": "local",
                "limits": [{{"name": "s", "requests": 4, "window": "1s"}}]}},
                {{"name": "api", "limits": [{{"name": "m", "requests": {limit}, "window": "60s"}}]}}"#
                ),
            ),
            Setup::FailClosed => (
                r#""failure_mode": "deny","#,
                format!(
                    r#"{{"name": "api",
                "limits": [{{"name": "m", "requests": {limit}, "window": "60s"}}]}}"#
                ),
            ),
            Setup::Tokens => (
                "",
                format!(
                    r#"{{"name": "llm", "match": {{"path_prefix": "/v1/"}},
                "cost": {{"reserve": {{"request_json": "max_tokens", "default": 50, "max": 500}},
                          "response": {{"json": "usage.total_tokens"}}}},
                "limits": [{{"name": "tokens", "requests": {}, "window": "60s"}}]}}"#,
                    limit * 100
                ),
            ),
        };
        let config = format!(
            r#"{{{extra} "leases": {{"interval": "1s"}}, "group_commit": {{"enabled": {group_commit}}},
                "client_id": {{"headers": ["x-api-key"], "when_missing": "reject"}},
                "rules": [{rules}]}}"#
        );
        let config = || crate::config::parse(config.as_bytes()).unwrap();
        let h = harness_with(config());
        // Begin at the start of a window: most runs end within it.
        let start = h.host.now.get().div_ceil(WINDOW_MS) * WINDOW_MS + 1;
        h.host.now.set(start);
        let parked = (0..WORKERS)
            .map(|w| (w > 0).then(|| Worker::new(&h.host, config(), ROOT)))
            .collect();
        Run {
            h,
            current: 0,
            parked,
            sender: HashMap::new(),
            model: FakeMeshlimitd::default(),
            streams: HashMap::new(),
            answered: HashSet::new(),
            admitted: [0; CLIENTS.len()],
            faults: false,
            setup,
            left_waiting: [0; CLIENTS.len()],
            window: start / WINDOW_MS,
            lost_costs: [0; CLIENTS.len()],
            garbled: false,
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Request(client, worker) => {
                self.switch(worker);
                let tokens = self.setup == Setup::Tokens;
                let (stream, step) = if tokens {
                    self.h.post(CLIENTS[client])
                } else {
                    self.h.request(CLIENTS[client])
                };
                let id = stream.context_id;
                // A token budget's headers go on; its body is read first.
                let fate = if tokens && step == Step::Continue {
                    Fate::AwaitingBody
                } else {
                    Fate::Waiting
                };
                let live = Live {
                    stream,
                    client,
                    worker,
                    fate,
                };
                self.streams.insert(id, live);
                if fate == Fate::Waiting {
                    self.decided_by_step(id, step);
                }
            }
            Op::Body(n) => {
                let Some(id) = self.nth_in(n, &[Fate::AwaitingBody]) else {
                    return;
                };
                self.switch(self.streams[&id].worker);
                let live = self.streams.get_mut(&id).unwrap();
                live.fate = Fate::Waiting;
                let tokens = 10 + 37 * (n % 12);
                let body = format!(r#"{{"max_tokens": {tokens}}}"#);
                let step = self.h.request_body(&mut live.stream, body.as_bytes(), true);
                self.decided_by_step(id, step);
            }
            Op::Respond(n) => {
                let Some(id) = self.nth_in(n, &[Fate::Admitted, Fate::ResponseOpen]) else {
                    return;
                };
                self.switch(self.streams[&id].worker);
                let live = self.streams.get_mut(&id).unwrap();
                live.fate = if live.fate == Fate::Admitted {
                    let go_on =
                        self.h
                            .response_headers(&mut live.stream, "200", "application/json");
                    if go_on {
                        Fate::ResponseOpen
                    } else {
                        Fate::ResponseHeld
                    }
                } else {
                    let usage = format!(r#"{{"usage":{{"total_tokens":{}}}}}"#, 5 * (n % 50));
                    let (_, go_on) = self.h.response_body(&live.stream, usage.as_bytes(), true);
                    if go_on {
                        Fate::Responded
                    } else {
                        Fate::ResponseWaiting
                    }
                };
            }
            Op::Wake(worker) => {
                self.switch(worker);
                self.h.wake();
            }
            Op::Tick(worker) => {
                self.switch(worker);
                self.h.tick();
            }
            Op::Answer(n, reply) => {
                let mut open = self.unanswered();
                if open.is_empty() {
                    return;
                }
                open.sort_unstable();
                let token = open[n % open.len()];
                self.answer(token, reply);
            }
            Op::End(n) => {
                let mut alive: Vec<u32> = self.streams.keys().copied().collect();
                if alive.is_empty() {
                    return;
                }
                alive.sort_unstable();
                self.end(alive[n % alive.len()]);
            }
            Op::Advance(ms) => self.pass(ms),
        }
        self.collect_acted();
        self.note_senders();
    }

    /// Stream `id` gets its response (if admitted) and ends, or is reset
    /// (if it waits).
    fn end(&mut self, id: u32) {
        self.switch(self.streams[&id].worker);
        let mut live = self.streams.remove(&id).unwrap();
        if live.fate == Fate::Waiting {
            self.left_waiting[live.client] += 1;
        }
        if live.fate == Fate::Admitted && self.setup != Setup::Tokens {
            self.h.host.enter(id);
            self.h
                .worker
                .on_response_headers(&self.h.host, &mut live.stream);
        }
        self.h.end(&live.stream);
    }

    /// After whatever came before, meshlimitd right from now on: a client
    /// that keeps asking on one worker is served from a lease again within
    /// a few requests, without a call. Nothing that failed may leave a
    /// worker calling for every request for good (seen: asks that lost
    /// answers had shrunk to nothing were never sent again, so never
    /// answered). The requests come 260 ms apart, within the `scope:
    /// local` rule's 4 a second.
    fn heals(&mut self, client: usize, worker: usize) {
        const REQUESTS: usize = 48;
        for _ in 0..REQUESTS {
            self.apply(&Op::Request(client, worker));
            let id = self.h.next_context;
            if self.streams[&id].stream.hit {
                self.end(id);
                return;
            }
            self.apply(&Op::Wake(worker));
            for token in self.unanswered() {
                self.answer(token, Reply::Right);
            }
            if self.streams.contains_key(&id) {
                self.end(id);
            }
            self.pass(260);
        }
        panic!(
            "{REQUESTS} requests of client {} on worker {worker}, every call answered: none from a lease",
            CLIENTS[client]
        );
    }

    /// Drives worker `w` from now on; the calls the current one sent are
    /// noted as its own first.
    fn switch(&mut self, w: usize) {
        self.note_senders();
        if w == self.current {
            return;
        }
        let next = self.parked[w].take().unwrap();
        let last = std::mem::replace(&mut self.h.worker, next);
        self.parked[self.current] = Some(last);
        self.current = w;
    }

    /// Calls sent since last noted are the current worker's.
    fn note_senders(&mut self) {
        for call in self.h.host.sent.borrow().iter() {
            self.sender.entry(call.token).or_insert(self.current);
        }
    }

    /// `ms` pass, and each worker's root ticks as Envoy's timer makes it
    /// (every tick period the flow asked for).
    fn pass(&mut self, ms: u64) {
        let period = u64::from(self.h.host.tick_ms.get().unwrap_or(250)).max(1);
        let mut left = ms;
        while left > 0 {
            let step = left.min(period);
            self.h.advance(step);
            left -= step;
            if step == period {
                for w in 0..WORKERS {
                    self.switch(w);
                    self.h.tick();
                    self.collect_acted();
                }
            }
        }
    }

    /// The `n`th (modulo their number) live stream in one of `fates`.
    fn nth_in(&self, n: usize, fates: &[Fate]) -> Option<u32> {
        let mut ids: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, l)| fates.contains(&l.fate))
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids.get(n % ids.len().max(1)).copied()
    }

    fn unanswered(&self) -> Vec<u32> {
        self.h
            .host
            .sent
            .borrow()
            .iter()
            .map(|c| c.token)
            .filter(|t| !self.answered.contains(t))
            .collect()
    }

    /// Call `token` comes back where the SDK sends it: to the stream whose
    /// own call it is, to the root, or nowhere (its context ended).
    fn answer(&mut self, token: u32, reply: Reply) {
        self.note_senders();
        self.switch(self.sender[&token]);
        self.answered.insert(token);
        let Some(to) = self.h.host.answer_goes_to(token) else {
            return;
        };
        let (body, deadline) = self
            .h
            .host
            .sent
            .borrow()
            .iter()
            .find(|c| c.token == token)
            .map(|c| (c.body.clone(), c.sent_ms + c.timeout_ms))
            .unwrap();
        // Past its timeout Envoy gave up on the call: whatever meshlimitd
        // did, the worker hears of it as lost.
        let reply = match reply {
            Reply::Right if self.h.host.now.get() >= deadline => Reply::Lost,
            reply => reply,
        };
        let (status, body) = match reply {
            Reply::Right => (Some(200), self.model.answer(&body, self.h.host.now.get())),
            Reply::Lost => {
                // The scripts ran; the answer never came back.
                self.model.answer(&body, self.h.host.now.get());
                let request: CheckRequest = serde_json::from_slice(&body).unwrap();
                for check in &request.checks {
                    let client = CLIENTS
                        .iter()
                        .position(|c| check.subject.ends_with(&format!(":{c}")));
                    if let Some(i) = client {
                        self.lost_costs[i] += check.limits.first().map_or(1, |l| l.cost);
                    }
                }
                (None, String::new())
            }
            Reply::Unavailable => (Some(503), r#"{"error":"unavailable"}"#.to_string()),
            Reply::Malformed => (Some(200), r#"{"results":[{"allowed":"#.to_string()),
            Reply::Extreme => {
                let right = self.model.answer(&body, self.h.host.now.get());
                let mut answer: serde_json::Value = serde_json::from_str(&right).unwrap();
                extreme(&mut answer);
                (Some(200), answer.to_string())
            }
            Reply::Short => {
                let right = self.model.answer(&body, self.h.host.now.get());
                let mut answer: CheckResponse = serde_json::from_str(&right).unwrap();
                answer.results.pop();
                (Some(200), serde_json::to_string(&answer).unwrap())
            }
        };
        if !matches!(reply, Reply::Right) {
            self.faults = true;
        }
        if !matches!(reply, Reply::Right | Reply::Lost) {
            self.garbled = true;
        }
        self.h.host.respond(status, &body);
        self.h.host.enter(to);
        let headers = usize::from(status.is_some());
        let owner = self
            .streams
            .get(&to)
            .is_some_and(|l| self.h.worker.owns_call(&l.stream, token));
        if owner {
            let live = self.streams.get_mut(&to).unwrap();
            let step =
                self.h
                    .worker
                    .on_call_answer(&self.h.host, &mut live.stream, headers, body.len());
            self.decided_by_step(to, step);
        } else {
            self.h
                .worker
                .on_batch_answer(&self.h.host, token, headers, body.len());
        }
        self.collect_acted();
        self.note_senders();
    }

    /// A callback's own step for stream `id` (not through the host).
    fn decided_by_step(&mut self, id: u32, step: Step) {
        match step {
            Step::Pause => {}
            Step::Continue => self.decide(id, Fate::Admitted),
            Step::Reply(_) => self.decide(id, Fate::Refused),
        }
    }

    fn decide(&mut self, id: u32, fate: Fate) {
        let live = self
            .streams
            .get_mut(&id)
            .unwrap_or_else(|| panic!("the flow acted on stream {id}, which is not alive"));
        assert_eq!(
            live.worker, self.current,
            "worker {} acted on stream {id} of worker {}",
            self.current, live.worker
        );
        assert_eq!(
            live.fate,
            Fate::Waiting,
            "stream {id} was decided twice ({:?}, then {fate:?})",
            live.fate
        );
        live.fate = fate;
        if fate == Fate::Admitted {
            self.admitted[live.client] += 1;
        }
    }

    /// What the root (or a callback) did to streams through the host.
    fn collect_acted(&mut self) {
        for acted in self.h.host.take_acted() {
            match acted {
                Acted::Resumed(id) => self.decide(id, Fate::Admitted),
                Acted::Replied(id, _) => self.decide(id, Fate::Refused),
                Acted::ResumedResponse(id) => {
                    let live = self.streams.get_mut(&id).unwrap_or_else(|| {
                        panic!("the flow resumed the response of {id}, which is not alive")
                    });
                    assert_eq!(live.worker, self.current, "another worker resumed {id}");
                    live.fate = match live.fate {
                        Fate::ResponseHeld => Fate::ResponseOpen,
                        Fate::ResponseWaiting => Fate::Responded,
                        other => panic!("the response of {id} was resumed when {other:?}"),
                    };
                }
            }
        }
    }

    /// Every call answered (rightly, or as lost while `faults`), the root
    /// woken and ticked, time passing, until nothing is left to answer.
    /// A second at a time, so that idle leases go back on the ticks; done
    /// when three rounds in a row had nothing to answer.
    fn drain(&mut self) {
        let mut quiet = 0;
        for _ in 0..64 {
            for w in 0..WORKERS {
                self.switch(w);
                self.h.wake();
                self.collect_acted();
            }
            self.note_senders();
            let open = self.unanswered();
            quiet = if open.is_empty() { quiet + 1 } else { 0 };
            if quiet == 3 {
                break;
            }
            for token in open {
                self.answer(token, Reply::Right);
            }
            self.pass(1_000);
        }
        assert!(self.unanswered().is_empty(), "calls kept coming");
    }

    /// The sum of `units` over the subjects of `client`.
    fn of_client(&self, units: &HashMap<String, u64>, client: &str) -> u64 {
        units
            .iter()
            .filter(|(subject, _)| subject.ends_with(&format!(":{client}")))
            .map(|(_, n)| n)
            .sum()
    }

    fn check(&self) {
        for (id, live) in &self.streams {
            assert!(
                !matches!(
                    live.fate,
                    Fate::Waiting | Fate::ResponseHeld | Fate::ResponseWaiting
                ),
                "stream {id} was stranded ({:?})",
                live.fate
            );
        }
        let charged = |client: &str| self.of_client(&self.model.charged, client);
        if self.setup == Setup::Tokens {
            // Units are tokens there, not requests: liveness is checked.
            return;
        }
        if self.faults && self.setup != Setup::FailClosed {
            // Whatever failed, an admission is a unit meshlimitd charged or
            // a decision the fallback made and counted.
            let admitted: u64 = self.admitted.iter().sum();
            let charged: u64 = CLIENTS.iter().map(|c| charged(c)).sum();
            let fallback = self.h.stat("fallback_allowed");
            assert!(
                admitted <= charged + fallback,
                "{admitted} admitted, {charged} charged, {fallback} by the fallback"
            );
        } else {
            for (client, admitted) in CLIENTS.iter().zip(self.admitted) {
                let charged = charged(client);
                assert!(
                    admitted <= charged,
                    "client {client}: {admitted} admitted, {charged} charged"
                );
            }
        }
        // Units counted dropped were charged and neither admitted nor given
        // back: never more than that (fallback admissions charged nothing).
        let dropped = self.h.stat("lease_units_dropped")
            + std::iter::once(&self.h.worker)
                .chain(self.parked.iter().flatten())
                .map(|w| w.lease_book.dropped.get())
                .sum::<u64>();
        let admitted: u64 = self.admitted.iter().sum();
        let returned: u64 = CLIENTS
            .iter()
            .map(|c| self.of_client(&self.model.returned, c))
            .sum();
        let charged_all: u64 = CLIENTS.iter().map(|c| charged(c)).sum();
        let fallback = self.h.stat("fallback_allowed");
        assert!(
            admitted + returned + dropped <= charged_all + fallback,
            "{admitted} admitted, {returned} given back, {dropped} dropped, \
             {charged_all} charged, {fallback} by the fallback"
        );
        let within_the_window = self.h.host.now.get() / WINDOW_MS == self.window;
        // A worker names its lost asks in its next call that succeeds, or
        // on a tick once its breaker is closed: with no traffic after an
        // outage, they wait (their units until the window ends).
        let lost_unnamed = std::iter::once(&self.h.worker)
            .chain(self.parked.iter().flatten())
            .any(|w| w.lease_book.oldest_lost_ms().is_some());
        if !self.garbled && within_the_window && !lost_unnamed {
            // And the other way: a unit charged was used, given back, or
            // charged for a request that left while it waited or whose
            // answer was lost.
            for (i, client) in CLIENTS.iter().enumerate() {
                let charged = charged(client);
                let returned = self.of_client(&self.model.returned, client);
                let accounted =
                    self.admitted[i] + returned + self.left_waiting[i] + self.lost_costs[i];
                assert!(
                    charged <= accounted,
                    "client {client}: {charged} charged, {} admitted, {returned} given back, \
                     {} left waiting, {} lost",
                    self.admitted[i],
                    self.left_waiting[i],
                    self.lost_costs[i]
                );
            }
        }
        if !self.faults {
            assert_eq!(self.h.fallbacks(), 0, "nothing failed");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        // More with PROPTEST_CASES (e.g. 20000) when hunting.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(256),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn no_interleaving_strands_a_stream_or_admits_an_uncharged_request(
        limit in prop_oneof![Just(3u64), Just(40), Just(1_000)],
        group_commit in any::<bool>(),
        setup in prop_oneof![
            Just(Setup::OneLimit),
            Just(Setup::TwoLimits),
            Just(Setup::WithLocalRule),
            Just(Setup::FailClosed),
            Just(Setup::Tokens),
        ],
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut run = Run::new(limit, group_commit, setup);
        for op in &ops {
            run.apply(op);
        }
        run.drain();
        run.check();
        if limit == 1_000 && setup != Setup::Tokens {
            for worker in 0..WORKERS {
                run.heals(worker, worker);
            }
        }
    }
}
