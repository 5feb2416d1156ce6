//! The proxy-wasm glue: moves bytes between Envoy and the host-independent
//! decision logic, and nothing else.
//!
//! Every hostcall goes through `proxy_wasm::hostcalls` (which returns
//! `Result`), never through the SDK's trait helpers, which `unwrap()`: a
//! panic would trap the VM and break every later request on this worker.
//!
//! Two ways to ask meshlimitd: a stream calls for its own check, or, with
//! group commit, streams queue their checks and the worker's root context
//! sends them in batches (the call then belongs to the long-lived root, not
//! to a stream that may end first) and acts for each paused stream through
//! `set_effective_context`. Both end in [`verdict_after_call`].

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use log::{error, info, warn};
use meshlimit_protocol::{CheckRequest, CheckResult};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use crate::abi;
use crate::batch::{Batcher, Enqueued};
use crate::breaker::{Breaker, Gate, Transition};
use crate::config::{self, Config, FailureMode};
use crate::decision::{
    self, Applied, DenyResponse, PendingCheck, Plan, RejectReason, ServiceError, Verdict,
};
use crate::deny_cache::DenyCache;
use crate::headers::Headers;
use crate::host::{RequestView, SharedStore, StoreError};
use crate::local::{self, LocalLimiter};
use crate::stats;
use crate::throttle::LogThrottle;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root { context_id, worker: None })
    });
}}

/// Interval between two log lines about the same kind of trouble.
const LOG_EVERY_MS: u64 = 10_000;
/// How often a worker re-reads the shared seed.
const SEED_REFRESH_MS: u64 = 10_000;

/// Metric ids, defined once per configuration.
struct Metrics {
    allowed: Option<u32>,
    denied: Option<u32>,
    local_allowed: Option<u32>,
    local_denied: Option<u32>,
    fallback_allowed: Option<u32>,
    fallback_denied: Option<u32>,
    fallback_uncounted: Option<u32>,
    shadow_denied: Option<u32>,
    deny_cache_hits: Option<u32>,
    deny_cache_evictions: Option<u32>,
    breaker_opened: Option<u32>,
    breaker_open: Option<u32>,
    rejected_no_client_id: Option<u32>,
    rejected_invalid_cost: Option<u32>,
    rejected_cost_above_capacity: Option<u32>,
    batches: Option<u32>,
    batched_checks: Option<u32>,
    batch_overflow: Option<u32>,
    service_errors: Vec<(&'static str, Option<u32>)>,
}

fn counter(name: &str) -> Option<u32> {
    match hostcalls::define_metric(MetricType::Counter, name) {
        Ok(id) => Some(id),
        Err(e) => {
            warn!("cannot define stat {name}: {e:?}");
            None
        }
    }
}

fn bump(metric: Option<u32>) {
    add(metric, 1);
}

fn add(metric: Option<u32>, n: usize) {
    if let Some(id) = metric {
        let _ = hostcalls::increment_metric(id, n as i64);
    }
}

/// Decisions counted while handling one answer, published to the stats
/// once (when dropped) instead of one hostcall per check.
struct Tally<'a> {
    metrics: &'a Metrics,
    allowed: usize,
    denied: usize,
}

impl<'a> Tally<'a> {
    fn new(metrics: &'a Metrics) -> Self {
        Tally {
            metrics,
            allowed: 0,
            denied: 0,
        }
    }

    fn decided(&mut self, allowed: bool) {
        if allowed {
            self.allowed += 1;
        } else {
            self.denied += 1;
        }
    }
}

impl Drop for Tally<'_> {
    fn drop(&mut self) {
        if self.allowed > 0 {
            add(self.metrics.allowed, self.allowed);
        }
        if self.denied > 0 {
            add(self.metrics.denied, self.denied);
        }
    }
}

impl Metrics {
    fn define() -> Self {
        Metrics {
            allowed: counter(stats::REQUESTS_ALLOWED),
            denied: counter(stats::REQUESTS_DENIED),
            local_allowed: counter(stats::LOCAL_ALLOWED),
            local_denied: counter(stats::LOCAL_DENIED),
            fallback_allowed: counter(stats::FALLBACK_ALLOWED),
            fallback_denied: counter(stats::FALLBACK_DENIED),
            fallback_uncounted: counter(stats::FALLBACK_UNCOUNTED),
            shadow_denied: counter(stats::SHADOW_DENIED),
            deny_cache_hits: counter(stats::DENY_CACHE_HITS),
            deny_cache_evictions: counter(stats::DENY_CACHE_EVICTIONS),
            breaker_opened: counter(stats::BREAKER_OPENED),
            breaker_open: hostcalls::define_metric(MetricType::Gauge, stats::BREAKER_OPEN).ok(),
            rejected_no_client_id: counter(stats::REJECTED_NO_CLIENT_ID),
            rejected_invalid_cost: counter(stats::REJECTED_INVALID_COST),
            rejected_cost_above_capacity: counter(stats::REJECTED_COST_ABOVE_CAPACITY),
            batches: counter(stats::BATCHES),
            batched_checks: counter(stats::BATCHED_CHECKS),
            batch_overflow: counter(stats::BATCH_OVERFLOW),
            service_errors: stats::SERVICE_ERROR_KINDS
                .iter()
                .map(|kind| (*kind, counter(&stats::service_error(kind))))
                .collect(),
        }
    }

    fn service_error(&self, kind: &str) {
        if let Some((_, id)) = self.service_errors.iter().find(|(k, _)| *k == kind) {
            bump(*id);
        }
    }
}

/// A check waiting in (or sent in) a batch, and the paused stream it is for.
struct Queued {
    context_id: u32,
    check: PendingCheck,
    /// The admitted decision of the request's `scope: local` rules.
    local: Option<CheckResult>,
}

/// What every context of this worker shares: the configuration, counters,
/// log throttles and, with group commit, the batches.
struct Worker {
    config: Config,
    metrics: Metrics,
    fallback_log: LogThrottle,
    error_log: LogThrottle,
    shadow_log: LogThrottle,
    /// The fingerprint seed shared through shared data, re-read now and
    /// then so that workers that raced to create it converge.
    seed: Cell<Option<(u64, u64)>>,
    seed_read_ms: Cell<u64>,
    /// Group commit: the queue and the calls in flight.
    batcher: Option<RefCell<Batcher<Queued>>>,
    /// The root's shared queue: enqueueing to it wakes the root.
    wake_queue: Cell<Option<u32>>,
    /// When each batch call went out, by token.
    batch_started: RefCell<HashMap<u32, u64>>,
    /// RateLimit headers for streams the root admitted, by context id.
    decided_headers: RefCell<HashMap<u32, Headers>>,
    /// Whether any rule matches on the method (else it is not read).
    rules_match_methods: bool,
    /// The millisecond in which this worker last found the breaker closed.
    /// Within that millisecond the shared state is not read again: a
    /// hostcall per request saved, and another worker's opening is seen at
    /// most a millisecond later. This worker's own failures clear it.
    breaker_closed_at: Cell<Option<u64>>,
}

impl Worker {
    fn seed(&self, now: u64) -> (u64, u64) {
        match self.seed.get() {
            Some(seed) if now < self.seed_read_ms.get() + SEED_REFRESH_MS => seed,
            _ => {
                let seed = local::shared_seed(&HostStore, fresh_seed()).unwrap_or((0, 0));
                self.seed.set(Some(seed));
                self.seed_read_ms.set(now);
                seed
            }
        }
    }

    fn breaker(&self) -> Breaker<'static, HostStore> {
        Breaker {
            config: self.config.breaker,
            store: &HostStore,
        }
    }

    fn deny_cache(&self, now: u64) -> Option<DenyCache<'static, HostStore>> {
        (self.config.deny_cache_slots > 0).then(|| DenyCache {
            slots: self.config.deny_cache_slots,
            seed: self.seed(now),
            store: &HostStore,
        })
    }

    /// Whether a check may call meshlimitd now (see `breaker_closed_at`).
    fn gate(&self, now: u64) -> Gate {
        if self.breaker_closed_at.get() == Some(now) {
            return Gate::Call;
        }
        let gate = self.breaker().gate(now, self.config.service.timeout_ms);
        self.breaker_closed_at
            .set((gate == Gate::Call).then_some(now));
        gate
    }

    /// Reports a call's outcome to the breaker, and says what changed.
    fn record_call(&self, success: bool, now: u64) {
        if !success {
            self.breaker_closed_at.set(None);
        }
        match self.breaker().record(success, now) {
            Transition::None => {}
            Transition::Opened { for_ms } => {
                bump(self.metrics.breaker_opened);
                if let Some(id) = self.metrics.breaker_open {
                    let _ = hostcalls::record_metric(id, 1);
                }
                warn!(
                    "breaker open: meshlimitd failing; deciding by failure_mode {:?} without calling for {for_ms}ms",
                    self.config.failure_mode
                );
            }
            Transition::Closed => {
                if let Some(id) = self.metrics.breaker_open {
                    let _ = hostcalls::record_metric(id, 0);
                }
                info!("breaker closed: meshlimitd answers again; limits are global again");
            }
        }
    }
}

// ---- the root context: configuration, and group commit's batches ----

struct Root {
    context_id: u32,
    worker: Option<Rc<Worker>>,
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(e) => {
                error!("cannot read the plugin configuration: {e:?}");
                return false;
            }
        };
        let config = match config::parse(&bytes) {
            Ok(config) => config,
            Err(e) => {
                // One line naming the field; Envoy then refuses the config.
                error!("{e}");
                return false;
            }
        };
        info!(
            "configured {} rule(s), service cluster \"{}\", failure_mode {:?}, group commit {}",
            config.rules.len(),
            config.service.cluster,
            config.failure_mode,
            if config.group_commit.is_some() {
                "on"
            } else {
                "off"
            }
        );
        let batcher = config.group_commit.map(|c| RefCell::new(Batcher::new(c)));
        // One queue per worker: each worker's streams wake their own root.
        let wake_queue = if batcher.is_some() {
            let name = format!("meshlimit.batch.{:x}", fresh_seed().0);
            match hostcalls::register_shared_queue(&name) {
                Ok(id) => Some(id),
                Err(e) => {
                    warn!("cannot register the group-commit queue ({e:?}); calling per request");
                    None
                }
            }
        } else {
            None
        };
        let rules_match_methods = config.rules.iter().any(|r| !r.methods.is_empty());
        self.worker = Some(Rc::new(Worker {
            config,
            metrics: Metrics::define(),
            fallback_log: LogThrottle::new(LOG_EVERY_MS),
            error_log: LogThrottle::new(LOG_EVERY_MS),
            shadow_log: LogThrottle::new(LOG_EVERY_MS),
            seed: Cell::new(None),
            seed_read_ms: Cell::new(0),
            batcher: if wake_queue.is_some() { batcher } else { None },
            wake_queue: Cell::new(wake_queue),
            batch_started: RefCell::new(HashMap::new()),
            decided_headers: RefCell::new(HashMap::new()),
            rules_match_methods,
            breaker_closed_at: Cell::new(None),
        }));
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        // The queue only carries wake-ups; the checks are in the batcher.
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        self.flush(now_ms());
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None, so an unconfigured plugin gets a stream
        // that does nothing (Envoy does not send traffic to it anyway).
        Some(Box::new(Stream {
            context_id,
            worker: self.worker.clone(),
            in_flight: None,
            response_headers: Vec::new(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        let Some(worker) = self.worker.clone() else {
            return;
        };
        let batch = worker
            .batcher
            .as_ref()
            .and_then(|b| b.borrow_mut().answered(token));
        let Some(batch) = batch else {
            return;
        };
        let started = worker
            .batch_started
            .borrow_mut()
            .remove(&token)
            .unwrap_or(0);
        let splits: Vec<_> = batch
            .iter()
            .map(|q| q.check.split(&worker.config))
            .collect();
        let expected: Vec<usize> = splits.iter().map(|(_, global)| global.len()).collect();
        let (status, body) = read_call_response(headers, body_size, batch.len());
        let now = now_ms();
        let timed_out = timed_out(&worker, started, now);
        let answers = decision::read_batch_answer(status, body.as_deref(), &expected, timed_out);
        match &answers {
            Ok(_) => worker.record_call(true, now),
            Err(e) if trips_breaker(e) => worker.record_call(false, now),
            Err(_) => {}
        }
        // The checks that queued meanwhile go out before this batch's
        // streams are resumed: meshlimitd and Redis work on the next batch
        // while this worker forwards the admitted requests, instead of
        // waiting for it to finish.
        self.flush(now);
        let mut tally = Tally::new(&worker.metrics);
        for (i, (queued, split)) in batch.into_iter().zip(&splits).enumerate() {
            let outcome = match &answers {
                Ok(results) => results
                    .get(i)
                    .cloned()
                    .ok_or_else(|| ServiceError::BadBody("missing result".into())),
                Err(e) => Err(e.clone()),
            };
            let verdict = verdict_after_call(
                &worker,
                &mut tally,
                now,
                &queued.check,
                split,
                queued.local.as_ref(),
                outcome,
            );
            // A stream reset meanwhile is gone: nothing to act on.
            act_for(&worker, queued.context_id, verdict);
        }
    }
}

impl Root {
    /// Sends every batch that is due, as the root (the calls outlive any
    /// one stream).
    fn flush(&self, now: u64) {
        let Some(worker) = self.worker.clone() else {
            return;
        };
        let Some(batcher) = worker.batcher.as_ref() else {
            return;
        };
        loop {
            let Some(batch) = batcher.borrow_mut().take_batch(now) else {
                return;
            };
            // After acting for streams, calls must again belong to the root.
            let _ = hostcalls::set_effective_context(self.context_id);
            let request = CheckRequest {
                checks: batch
                    .iter()
                    .flat_map(|q| q.check.to_request(&worker.config).checks)
                    .collect(),
            };
            let dispatched = serde_json::to_vec(&request)
                .map_err(|e| ServiceError::BadBody(e.to_string()))
                .and_then(|body| dispatch(&worker, &body));
            match dispatched {
                Ok(token) => {
                    bump(worker.metrics.batches);
                    add(worker.metrics.batched_checks, batch.len());
                    worker.batch_started.borrow_mut().insert(token, now);
                    batcher.borrow_mut().sent(token, batch);
                }
                Err(e) => {
                    worker.record_call(false, now);
                    let mut tally = Tally::new(&worker.metrics);
                    for queued in batch {
                        let verdict = verdict_after_call(
                            &worker,
                            &mut tally,
                            now,
                            &queued.check,
                            &queued.check.split(&worker.config),
                            queued.local.as_ref(),
                            Err(e.clone()),
                        );
                        act_for(&worker, queued.context_id, verdict);
                    }
                }
            }
        }
    }
}

// ---- decisions shared by streams and the root ----

/// Shadow rules: what they would have denied is counted and logged, never
/// enforced.
fn count_shadow(worker: &Worker, subject: &str, result: &CheckResult) {
    if decision::shadow_denials(result) == 0 {
        return;
    }
    bump(worker.metrics.shadow_denied);
    if let Some(skipped) = worker.shadow_log.allow(now_ms()) {
        let shown: String = subject.chars().take(64).collect();
        info!(
            "shadow rule would deny {shown:?} ({skipped} more shadow denials since the last line)"
        );
    }
}

/// The verdict for a request whose global limits were decided (by
/// meshlimitd or a fallback) after its local ones admitted it.
fn with_local(
    config: &Config,
    local_limits: &[Applied<'_>],
    local: Option<&CheckResult>,
    global_limits: &[Applied<'_>],
    global: &CheckResult,
) -> Verdict {
    match local {
        None => decision::verdict(config, global_limits, global),
        Some(local) => {
            // failure_mode allow reports no global statuses.
            let global_limits = if global.limits.is_empty() {
                &[][..]
            } else {
                global_limits
            };
            let (applied, result) =
                decision::combine((local_limits, local), (global_limits, global));
            decision::verdict(config, &applied, &result)
        }
    }
}

/// Whether a failed call says meshlimitd is unhealthy. A 4xx says our
/// request was wrong, which no amount of waiting fixes.
fn trips_breaker(e: &ServiceError) -> bool {
    !matches!(e, ServiceError::BadStatus(s) if *s < 500)
}

/// What a request gets once its call was answered, or failed. The caller
/// has already told the breaker (once per call, not per check). `split` is
/// `check.split(config)`, resolved once by the caller.
fn verdict_after_call(
    worker: &Worker,
    tally: &mut Tally<'_>,
    now: u64,
    check: &PendingCheck,
    split: &(Vec<Applied<'_>>, Vec<Applied<'_>>),
    local: Option<&CheckResult>,
    outcome: Result<CheckResult, ServiceError>,
) -> Verdict {
    let config = &worker.config;
    let (local_limits, limits) = split;
    let decided = match outcome {
        Ok(result) => {
            tally.decided(result.allowed);
            count_shadow(worker, &check.subject, &result);
            if let Some(cache) = worker.deny_cache(now) {
                let evicted = decision::remember_denials(check, limits, &result, &cache, now);
                add(worker.metrics.deny_cache_evictions, evicted);
            }
            result
        }
        Err(e) => match fallback(worker, now, check, limits, Some(&e)) {
            Ok(result) => result,
            Err(verdict) => return verdict,
        },
    };
    with_local(config, local_limits, local, limits, &decided)
}

/// Decides the global limits without meshlimitd, as `failure_mode` says,
/// and says so in the stats and (at most once per interval) in the log.
/// `why` is the failed call, or `None` when the open breaker skipped the
/// call. A decided result, or for `failure_mode: deny` the configured deny.
fn fallback(
    worker: &Worker,
    now: u64,
    check: &PendingCheck,
    limits: &[Applied<'_>],
    why: Option<&ServiceError>,
) -> Result<CheckResult, Verdict> {
    if let Some(e) = why {
        worker.metrics.service_error(e.kind());
    }
    let config = &worker.config;
    let decided = match config.failure_mode {
        FailureMode::Allow => Ok(CheckResult {
            allowed: true,
            limits: Vec::new(),
        }),
        FailureMode::Deny => Err(decision::failure_deny(config)),
        FailureMode::Local => {
            // Each Envoy enforces its share of the global limit.
            let scaled: Vec<config::LimitConfig> =
                limits.iter().map(|a| a.limit.for_fallback()).collect();
            let scaled_applied: Vec<Applied<'_>> = limits
                .iter()
                .zip(&scaled)
                .map(|(a, limit)| Applied { limit, ..*a })
                .collect();
            let decided = LocalLimiter::new(config.local.slots, worker.seed(now)).check(
                &HostStore,
                &check.subject,
                &scaled_applied,
                now,
            );
            if decided.degraded {
                bump(worker.metrics.fallback_uncounted);
            }
            count_shadow(worker, &check.subject, &decided.result);
            Ok(decided.result)
        }
    };
    let allowed = matches!(&decided, Ok(r) if r.allowed);
    bump(if allowed {
        worker.metrics.fallback_allowed
    } else {
        worker.metrics.fallback_denied
    });
    if let Some(skipped) = worker.fallback_log.allow(now) {
        let why = why.map_or_else(|| "breaker open".to_string(), ToString::to_string);
        warn!(
            "{why}; deciding by failure_mode {:?} (this one: {}; {skipped} fallback decisions since the last line)",
            config.failure_mode,
            if allowed { "allowed" } else { "denied" }
        );
    }
    decided
}

/// Sends a check request to meshlimitd from the current context.
fn dispatch(worker: &Worker, body: &[u8]) -> Result<u32, ServiceError> {
    let service = &worker.config.service;
    hostcalls::dispatch_http_call(
        &service.cluster,
        vec![
            (":method", "POST"),
            (":path", meshlimit_protocol::CHECK_PATH),
            (":authority", &service.authority),
            ("content-type", "application/json"),
        ],
        Some(body),
        vec![],
        Duration::from_millis(service.timeout_ms),
    )
    .map_err(|e| {
        // Typically an unknown cluster, or no healthy meshlimitd.
        if let Some(skipped) = worker.error_log.allow(now_ms()) {
            warn!(
                "cannot dispatch to cluster \"{}\": {e:?} ({skipped} similar lines suppressed)",
                service.cluster
            );
        }
        ServiceError::Connection
    })
}

/// The status and body of the dispatched call's response. No headers: the
/// call failed (timeout or reset) and Envoy has no response to read; asking
/// for one anyway would be an error status.
fn read_call_response(
    headers: usize,
    body_size: usize,
    checks: usize,
) -> (Option<u32>, Option<Vec<u8>>) {
    let status = if headers > 0 {
        abi::call_response_header(":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok())
    } else {
        None
    };
    // Read one byte more than we accept, so an oversized body is seen as
    // oversized rather than as truncated JSON.
    let max = decision::MAX_ANSWER_BYTES.saturating_mul(checks.max(1)) + 1;
    let body = if status.is_some() && body_size > 0 {
        abi::call_response_body(body_size.min(max))
    } else {
        None
    };
    (status, body)
}

/// Envoy's timer and the wall clock we read can disagree by a millisecond
/// or two: no answer after 90% of the timeout is a timeout.
fn timed_out(worker: &Worker, started_ms: u64, now: u64) -> bool {
    now.saturating_sub(started_ms) * 10 >= worker.config.service.timeout_ms * 9
}

/// Carries out a verdict for a paused stream from another context (the
/// root, after a batch). False when the stream is gone.
fn act_for(worker: &Worker, context_id: u32, verdict: Verdict) -> bool {
    if hostcalls::set_effective_context(context_id).is_err() {
        return false;
    }
    match verdict {
        Verdict::Allow { headers } => {
            worker
                .decided_headers
                .borrow_mut()
                .insert(context_id, headers);
            let _ = hostcalls::resume_http_request();
        }
        Verdict::Deny(deny) => send_deny(&deny),
    }
    true
}

fn send_deny(deny: &DenyResponse) {
    let headers: Vec<(&str, &str)> = deny
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if let Err(e) = hostcalls::send_http_response(deny.status, headers, Some(deny.body.as_bytes()))
    {
        warn!("cannot send the {} response: {e:?}", deny.status);
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

fn request_header_text(name: &str) -> String {
    match hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name) {
        Ok(Some(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
        _ => String::new(),
    }
}

/// The request, as the decision logic sees it.
struct HostRequest;

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn source_address(&self) -> Option<String> {
        hostcalls::get_property(vec!["source", "address"])
            .ok()
            .flatten()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    }
}

/// proxy-wasm shared data (one per VM id, shared by all workers).
struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        hostcalls::get_shared_data(key).map_err(|_| StoreError::Failed)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|e| match e {
            Status::CasMismatch => StoreError::CasMismatch,
            _ => StoreError::Failed,
        })
    }
}

fn fresh_seed() -> (u64, u64) {
    use std::hash::BuildHasher;
    // RandomState draws its keys from WASI random_get.
    let state = std::collections::hash_map::RandomState::new();
    (
        state.hash_one(0x6d65_7368_u64),
        state.hash_one(0x6c69_6d69_u64),
    )
}

// ---- one HTTP stream ----

/// A check this stream sent itself and waits for.
struct InFlight {
    check: PendingCheck,
    started_ms: u64,
    /// The admitted decision of the request's `scope: local` rules, to
    /// report together with the global one.
    local: Option<CheckResult>,
}

struct Stream {
    context_id: u32,
    worker: Option<Rc<Worker>>,
    in_flight: Option<InFlight>,
    /// RateLimit headers to add to the upstream's response.
    response_headers: Headers,
}

impl Context for Stream {
    fn on_http_call_response(&mut self, _token: u32, headers: usize, body_size: usize, _: usize) {
        let (Some(worker), Some(in_flight)) = (self.worker.clone(), self.in_flight.take()) else {
            return;
        };
        let (status, body) = read_call_response(headers, body_size, 1);
        let split = in_flight.check.split(&worker.config);
        let now = now_ms();
        let timed_out = timed_out(&worker, in_flight.started_ms, now);
        let outcome = decision::read_answer(status, body.as_deref(), split.1.len(), timed_out);
        match &outcome {
            Ok(_) => worker.record_call(true, now),
            Err(e) if trips_breaker(e) => worker.record_call(false, now),
            Err(_) => {}
        }
        let verdict = verdict_after_call(
            &worker,
            &mut Tally::new(&worker.metrics),
            now,
            &in_flight.check,
            &split,
            in_flight.local.as_ref(),
            outcome,
        );
        self.apply(verdict, true);
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(worker) = self.worker.clone() else {
            return Action::Continue;
        };
        // Most configs match on paths only: skip a hostcall when no rule
        // looks at the method.
        let method = if worker.rules_match_methods {
            request_header_text(":method")
        } else {
            String::new()
        };
        let path = request_header_text(":path");
        let check = match decision::plan(&worker.config, &HostRequest, &method, &path) {
            Plan::Pass => return Action::Continue,
            Plan::Reject(deny, why) => {
                bump(match why {
                    RejectReason::NoClientId => worker.metrics.rejected_no_client_id,
                    RejectReason::InvalidCost => worker.metrics.rejected_invalid_cost,
                    RejectReason::CostAboveCapacity => worker.metrics.rejected_cost_above_capacity,
                });
                send_deny(&deny);
                return Action::Pause;
            }
            Plan::Check(check) => check,
        };
        let now = now_ms();
        let config = &worker.config;
        let (local_limits, global_limits) = check.split(config);
        // Local rules first: a local deny needs no call at all. (A request
        // they admit and the global rules deny still used its local quota.)
        let local = if local_limits.is_empty() {
            None
        } else {
            let decided = LocalLimiter::new(config.local.slots, worker.seed(now)).check(
                &HostStore,
                &check.subject,
                &local_limits,
                now,
            );
            count_shadow(&worker, &check.subject, &decided.result);
            bump(if decided.result.allowed {
                worker.metrics.local_allowed
            } else {
                worker.metrics.local_denied
            });
            if !decided.result.allowed || global_limits.is_empty() {
                let verdict = decision::verdict(config, &local_limits, &decided.result);
                return self.apply(verdict, false);
            }
            Some(decided.result)
        };
        if let Some(cache) = worker.deny_cache(now) {
            if let Some(verdict) =
                decision::cached_deny(config, &check.subject, &global_limits, &cache, now)
            {
                bump(worker.metrics.deny_cache_hits);
                return self.apply(verdict, false);
            }
        }
        match worker.gate(now) {
            Gate::Skip => {
                let verdict = match fallback(&worker, now, &check, &global_limits, None) {
                    Ok(result) => with_local(
                        config,
                        &local_limits,
                        local.as_ref(),
                        &global_limits,
                        &result,
                    ),
                    Err(verdict) => verdict,
                };
                self.apply(verdict, false)
            }
            Gate::Call | Gate::Probe if worker.batcher.is_some() => {
                self.enqueue(&worker, now, check, local)
            }
            Gate::Call | Gate::Probe => self.ask_service(&worker, now, check, local),
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let mut headers = std::mem::take(&mut self.response_headers);
        if let Some(worker) = &self.worker {
            if let Some(decided) = worker.decided_headers.borrow_mut().remove(&self.context_id) {
                headers.extend(decided);
            }
        }
        for (name, value) in headers {
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, &name, &value);
        }
        Action::Continue
    }
}

impl Drop for Stream {
    /// A stream that ends while its check is queued leaves the batch; one
    /// already sent is skipped when the answer comes (its context is gone).
    fn drop(&mut self) {
        if let Some(worker) = &self.worker {
            let id = self.context_id;
            worker.decided_headers.borrow_mut().remove(&id);
            if let Some(batcher) = &worker.batcher {
                if let Ok(mut b) = batcher.try_borrow_mut() {
                    let _ = b.withdraw(|q| q.context_id == id);
                }
            }
        }
    }
}

impl Stream {
    /// Calls meshlimitd for this request alone.
    fn ask_service(
        &mut self,
        worker: &Worker,
        now: u64,
        check: PendingCheck,
        local: Option<CheckResult>,
    ) -> Action {
        let dispatched = serde_json::to_vec(&check.to_request(&worker.config))
            .map_err(|e| ServiceError::BadBody(e.to_string()))
            .and_then(|body| dispatch(worker, &body));
        match dispatched {
            Ok(_token) => {
                self.in_flight = Some(InFlight {
                    check,
                    started_ms: now,
                    local,
                });
                Action::Pause
            }
            Err(e) => {
                worker.record_call(false, now);
                let split = check.split(&worker.config);
                let verdict = verdict_after_call(
                    worker,
                    &mut Tally::new(&worker.metrics),
                    now,
                    &check,
                    &split,
                    local.as_ref(),
                    Err(e),
                );
                self.apply(verdict, false)
            }
        }
    }

    /// Group commit: queues the check for the root to send in a batch.
    fn enqueue(
        &mut self,
        worker: &Worker,
        now: u64,
        check: PendingCheck,
        local: Option<CheckResult>,
    ) -> Action {
        let (Some(batcher), Some(queue)) = (worker.batcher.as_ref(), worker.wake_queue.get())
        else {
            return self.ask_service(worker, now, check, local);
        };
        let queued = Queued {
            context_id: self.context_id,
            check,
            local,
        };
        let outcome = batcher.borrow_mut().enqueue(queued, now);
        match outcome {
            Enqueued::Wait => Action::Pause,
            Enqueued::Wake => {
                if hostcalls::enqueue_shared_queue(queue, Some(b"w")).is_ok() {
                    return Action::Pause;
                }
                // The root cannot be woken: call for this check ourselves.
                let mut b = batcher.borrow_mut();
                b.wake_failed();
                let id = self.context_id;
                let mine = b.withdraw(|q| q.context_id == id);
                drop(b);
                match mine {
                    Some(q) => self.ask_service(worker, now, q.check, q.local),
                    None => Action::Pause,
                }
            }
            Enqueued::Refused(q) => {
                // Too many queued: decide by failure_mode, and count it.
                bump(worker.metrics.batch_overflow);
                let verdict = verdict_after_call(
                    worker,
                    &mut Tally::new(&worker.metrics),
                    now,
                    &q.check,
                    &q.check.split(&worker.config),
                    q.local.as_ref(),
                    Err(ServiceError::Connection),
                );
                self.apply(verdict, false)
            }
        }
    }

    /// Carries out a verdict. `resume` says the request was paused.
    fn apply(&mut self, verdict: Verdict, resume: bool) -> Action {
        match verdict {
            Verdict::Allow { headers } => {
                self.response_headers = headers;
                if resume {
                    let _ = hostcalls::resume_http_request();
                }
                Action::Continue
            }
            Verdict::Deny(deny) => {
                send_deny(&deny);
                Action::Pause
            }
        }
    }
}
