//! Runs checks on Redis.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshlimit_protocol::{Check, CheckResult, Limit};
use redis::Script;

use crate::backend::{self, Backend};

use crate::keys;
use crate::metrics::Metrics;
use crate::script;
use crate::throttle::AtMostEvery;

mod health;
pub use fleet::StoredSwitch;
use health::Health;
pub use health::RedisMemory;
mod fleet;
mod lost;
mod reply;
pub use lost::lost_ask_of;
use reply::{epochs, follow, lease_args, parse_reply, split_clock, wants_receipts};
mod overrides;
mod settle;
mod slots;

pub use overrides::Override;
use settle::receipts;

/// How long a script run slower than `--redis-timeout-ms` is still
/// awaited (the connections' response timeout): long enough for the
/// stalls a healthy Redis has (a fork, a slow fsync, a failover's pause),
/// short enough that a Redis that stopped answering holds a few seconds
/// of runs at most (and fewer once the health check fails fast).
pub const LATE_ANSWERS_AWAITED: Duration = Duration::from_secs(5);

/// Why Redis could not decide a check. Every variant becomes a 503, which
/// tells the filter to fall back.
#[derive(Debug, thiserror::Error)]
pub enum LimiterError {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis configuration: {0}")]
    Config(#[from] backend::ConfigError),
    #[error("redis returned an unexpected reply: {0}")]
    Reply(String),
    #[error("redis is unhealthy (recent calls failed); retrying shortly")]
    Unhealthy,
    /// One failure reported for each check of a script run that failed.
    #[error("{message}")]
    Shared { kind: &'static str, message: String },
}

impl LimiterError {
    /// Label for the error metric.
    pub fn kind(&self) -> &'static str {
        match self {
            LimiterError::Timeout(_) => "timeout",
            // A connection's own response timeout (redis-rs), before the
            // I/O errors it is one of: Redis was slow, not unreachable.
            LimiterError::Redis(e) if e.is_timeout() => "timeout",
            LimiterError::Redis(e) if e.is_io_error() || e.is_connection_dropped() => "connection",
            LimiterError::Redis(e) if e.kind() == redis::ErrorKind::AuthenticationFailed => "auth",
            LimiterError::Redis(_) => "command",
            LimiterError::Reply(_) => "reply",
            LimiterError::Unhealthy => "unhealthy",
            LimiterError::Config(_) => "config",
            LimiterError::Shared { kind, .. } => kind,
        }
    }

    /// The same failure, for another check of the same failed run.
    fn share(&self) -> LimiterError {
        match self {
            LimiterError::Timeout(d) => LimiterError::Timeout(*d),
            LimiterError::Unhealthy => LimiterError::Unhealthy,
            LimiterError::Reply(why) => LimiterError::Reply(why.clone()),
            other => LimiterError::Shared {
                kind: other.kind(),
                message: other.to_string(),
            },
        }
    }
}

/// The scripts, each made (source and SHA-1) once and shared: a `Script`
/// holds its source, so a copy per request (axum clones the state for
/// each) would copy tens of kilobytes each time.
struct Scripts {
    check: Script,
    /// Several checks per run (see [`Limiter::check_batch`]).
    many: Script,
    /// Reservations settled, and refunds of checks spread over several
    /// Cluster slots (see [`Limiter::settle`]).
    settle: Script,
    overrides: Script,
}

/// Shared, cheap-to-clone handle on Redis and the scripts.
#[derive(Clone)]
pub struct Limiter {
    backend: Backend,
    scripts: Arc<Scripts>,
    /// Live overrides are read by every decision (admin API on).
    overrides: bool,
    /// Test hook: the key whose value (ms) shifts the scripts' clock; ""
    /// in production.
    clock_key: String,
    /// Makes sorted-set members unique across calls and instances.
    nonce: Arc<(u64, AtomicU64)>,
    prefix: String,
    timeout: Duration,
    metrics: Metrics,
    health: Arc<Health>,
    /// Set once the script is known to be in Redis' cache.
    script_loaded: Arc<std::sync::atomic::AtomicBool>,
    /// Background script loads, at most one a second (on `health`'s clock).
    script_load: Arc<AtMostEvery>,
}

impl Limiter {
    /// Does not touch the network: the first command connects, and a lost
    /// connection is re-established, so meshlimitd starts and keeps running
    /// while Redis is away (see [`backend`]).
    pub fn new(
        options: &backend::Options,
        prefix: String,
        metrics: Metrics,
    ) -> Result<Self, LimiterError> {
        let backend = Backend::new(options)?;
        let timeout = options.timeout;
        Ok(Limiter {
            backend,
            scripts: Arc::new(Scripts {
                check: Script::new(script::CHECK),
                many: Script::new(script::CHECK_MANY),
                settle: Script::new(script::SETTLE),
                overrides: Script::new(script::OVERRIDE),
            }),
            overrides: false,
            clock_key: String::new(),
            nonce: Arc::new((instance_id(), AtomicU64::new(0))),
            prefix,
            timeout,
            metrics,
            health: Arc::new(Health::default()),
            script_loaded: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            script_load: Arc::default(),
        })
    }

    /// Reads live overrides in every decision (the admin API is on).
    pub fn with_overrides(mut self, on: bool) -> Self {
        self.overrides = on;
        self
    }

    /// Test hook: shifts the scripts' clock by the value (milliseconds) of
    /// Redis key `key`, so that tests can cross calendar edges without
    /// waiting. Refused on a Cluster (the key would live in another slot).
    pub fn with_test_clock(mut self, key: Option<String>) -> Result<Self, &'static str> {
        if let Some(key) = key {
            if self.backend.is_cluster() {
                return Err("the test clock hook is not available on a Cluster");
            }
            self.clock_key = key;
        }
        Ok(self)
    }

    /// Decides one check atomically (all of its limits or none).
    pub async fn check(&self, check: &Check) -> Result<CheckResult, LimiterError> {
        let Some(slot) = self.slot_of(check) else {
            return self.check_across_slots(check).await;
        };
        let mut invocation = self.scripts.check.prepare_invoke();
        let nonce = self.next_nonce();
        let grant = self.grant_key(check);
        for arg in script::check_args(
            &nonce,
            self.overrides,
            &self.clock_key,
            lease_args(check),
            follow(check, grant.is_some()),
        ) {
            invocation.arg(arg);
        }
        self.add_limits(&mut invocation, check, &check.limits);
        self.add_follow(&mut invocation, check, &check.limits, grant);
        let values = self.run(slot, &invocation, script_label([check])).await?;
        let (clock, reply) = split_clock(&values)?;
        let mut result = parse_reply(check, reply)?;
        if wants_receipts(check, &result) {
            result.receipts = receipts(&result, clock, &nonce, &epochs(check, reply));
        }
        Ok(result)
    }

    /// Decides a batch of checks, answers in order. Each check is decided
    /// on its own and atomically, as by [`Limiter::check`], but many share
    /// one script run: the checks for one Redis node (on a Cluster, those
    /// of one subject, which share a slot) go in a single `CHECK_MANY`, and
    /// the runs for different nodes go out together, pipelined. A run costs
    /// Redis (and this process) a command to parse and a script call to set
    /// up whatever it decides, so a batch of 64 checks costs far less than
    /// 64 runs. A run that fails fails only its own checks: on a Cluster
    /// with a node down, the checks of the other nodes keep their decisions
    /// (already charged in Redis, never to be charged again elsewhere).
    pub async fn check_batch(&self, checks: &[Check]) -> Vec<Result<CheckResult, LimiterError>> {
        // Groups of indices into `checks`, each group in request order: on
        // a Cluster one per slot, and a check spread over several slots
        // alone (decided by `check`, slot by slot).
        let groups: Vec<Vec<usize>> = if self.backend.is_cluster() {
            let mut group_of: std::collections::HashMap<u16, usize> = Default::default();
            let mut groups: Vec<Vec<usize>> = Vec::new();
            for (i, check) in checks.iter().enumerate() {
                let Some(slot) = self.slot_of(check) else {
                    groups.push(vec![i]);
                    continue;
                };
                let g = *group_of.entry(slot).or_insert_with(|| {
                    groups.push(Vec::new());
                    groups.len() - 1
                });
                if let Some(group) = groups.get_mut(g) {
                    group.push(i);
                }
            }
            groups
        } else {
            vec![(0..checks.len()).collect()]
        };
        let decided = futures_util::future::join_all(groups.iter().map(|group| {
            let members: Vec<&Check> = group.iter().filter_map(|&i| checks.get(i)).collect();
            async move { self.check_many(&members).await }
        }))
        .await;
        let mut results: Vec<Option<Result<CheckResult, LimiterError>>> =
            (0..checks.len()).map(|_| None).collect();
        for (group, decided) in groups.iter().zip(decided) {
            match decided {
                Ok(decided) => {
                    for (&i, result) in group.iter().zip(decided) {
                        if let Some(slot) = results.get_mut(i) {
                            *slot = Some(Ok(result));
                        }
                    }
                }
                Err(e) => {
                    for &i in group {
                        if let Some(slot) = results.get_mut(i) {
                            *slot = Some(Err(e.share()));
                        }
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(LimiterError::Reply("a check was not answered".into())))
            })
            .collect()
    }

    /// One `CHECK_MANY` run for checks that share a Redis node.
    async fn check_many(&self, checks: &[&Check]) -> Result<Vec<CheckResult>, LimiterError> {
        if let [one] = checks {
            return Ok(vec![self.check(one).await?]);
        }
        let mut invocation = self.scripts.many.prepare_invoke();
        let nonce = self.add_fixed_args(&mut invocation);
        invocation.arg(checks.len());
        for check in checks {
            let (want, share) = lease_args(check);
            let grant = self.grant_key(check);
            let follow = follow(check, grant.is_some());
            invocation
                .arg(check.limits.len())
                .arg(want)
                .arg(share)
                .arg(u8::from(follow.grant))
                .arg(follow.epochs as u8);
            self.add_limits(&mut invocation, check, &check.limits);
            self.add_follow(&mut invocation, check, &check.limits, grant);
        }
        // On a Cluster the checks of one run share a slot.
        let slot = checks
            .first()
            .and_then(|c| self.slot_of(c))
            .unwrap_or_default();
        let what = script_label(checks.iter().copied());
        let values = self.run(slot, &invocation, what).await?;
        let (clock, mut rest) = split_clock(&values)?;
        let mut results = Vec::with_capacity(checks.len());
        for (c, check) in checks.iter().enumerate() {
            let n =
                (script::REPLY_HEAD + script::REPLY_PER_LIMIT * check.limits.len()).min(rest.len());
            let (mine, after) = rest.split_at(n);
            let mut result = parse_reply(check, mine)?;
            if wants_receipts(check, &result) {
                let nonce = format!("{nonce}.{}", c + 1);
                result.receipts = receipts(&result, clock, &nonce, &epochs(check, mine));
            }
            results.push(result);
            rest = after;
        }
        if !rest.is_empty() {
            return Err(LimiterError::Reply(format!(
                "{} values too many",
                rest.len()
            )));
        }
        Ok(results)
    }

    /// Makes sorted-set members unique across runs and instances.
    fn next_nonce(&self) -> String {
        let seq = self.nonce.1.fetch_add(1, Ordering::Relaxed);
        format!("{:x}.{seq:x}", self.nonce.0)
    }

    /// The arguments before the limits: nonce, overrides, test clock. The
    /// nonce, for receipts.
    fn add_fixed_args(&self, invocation: &mut redis::ScriptInvocation<'_>) -> String {
        let nonce = self.next_nonce();
        invocation
            .arg(&nonce)
            .arg(u8::from(self.overrides))
            .arg(&self.clock_key);
        nonce
    }

    /// The key of the record of what `check` was charged, when it asks
    /// for a lease or reserves with an id (see
    /// [`meshlimit_protocol::LeaseAsk::id`], [`meshlimit_protocol::Check::id`]):
    /// beside its first limit's counter, in the run's slot.
    fn grant_key(&self, check: &Check) -> Option<String> {
        let id = lost::record_id(check)?;
        let first = check.limits.first()?;
        Some(keys::grant_key(
            &self.prefix,
            &keys::subject_tag(first.subject_in(check)),
            id,
        ))
    }

    /// Keys and per-limit arguments of `limits` (of `check`), as the
    /// scripts take them: the counters, then (with overrides) the
    /// override keys.
    fn add_limits(
        &self,
        invocation: &mut redis::ScriptInvocation<'_>,
        check: &Check,
        limits: &[Limit],
    ) {
        let tags: Vec<String> = limits
            .iter()
            .map(|l| keys::subject_tag(l.subject_in(check)))
            .collect();
        for (limit, tag) in limits.iter().zip(&tags) {
            invocation.key(keys::limit_key(&self.prefix, tag, limit));
            for arg in script::limit_args(limit) {
                invocation.arg(arg);
            }
        }
        if self.overrides {
            for (limit, tag) in limits.iter().zip(&tags) {
                invocation.key(keys::override_key(&self.prefix, tag, &limit.name));
            }
        }
    }

    /// The keys after `limits`' counters and override keys, as
    /// [`follow`] says: one epoch key per limit, then the grant record.
    fn add_follow(
        &self,
        invocation: &mut redis::ScriptInvocation<'_>,
        check: &Check,
        limits: &[Limit],
        grant: Option<String>,
    ) {
        if follow(check, grant.is_some()).epochs.declared() {
            for limit in limits {
                let tag = keys::subject_tag(limit.subject_in(check));
                invocation.key(keys::epoch_key(&self.prefix, &tag));
            }
        }
        if let Some(key) = grant {
            invocation.key(key);
        }
    }

    /// The Cluster slot of every key of `check`, or `None` when its limits'
    /// subjects live in several slots. Always `Some` off a Cluster (where
    /// the slot means nothing).
    fn slot_of(&self, check: &Check) -> Option<u16> {
        if !self.backend.is_cluster() {
            return Some(0);
        }
        let mut slots = check
            .limits
            .iter()
            .map(|l| keys::tag_slot(&keys::subject_tag(l.subject_in(check))));
        let first = slots.next().unwrap_or_default();
        slots.all(|s| s == first).then_some(first)
    }

    /// Runs a script on the node of `slot`, with the health check and the
    /// metrics every run gets; `what` names it in
    /// `meshlimitd_script_duration_seconds` (see [`script_label`]).
    ///
    /// A run slower than `--redis-timeout-ms` counts as a Redis failure
    /// then (the error metric, the health check, a Sentinel master asked
    /// for again, a Cluster master's own connection rested) but is still
    /// awaited, up to [`LATE_ANSWERS_AWAITED`]: the script runs in Redis
    /// anyway, and only its answer says what it charged. Its caller has
    /// usually given up by then (its own deadline answers it; see
    /// `api::decide_within`), and what the run charged for that caller
    /// goes back (`app::give_back`); a caller still waiting gets the
    /// decision. Dropped at the timeout, as before, a plain check's unit
    /// stayed charged with nobody told: a unit per stalled request, also
    /// counted by the caller's fallback.
    async fn run(
        &self,
        slot: u16,
        invocation: &redis::ScriptInvocation<'_>,
        what: &'static str,
    ) -> Result<Vec<i64>, LimiterError> {
        if self.health.fail_fast() {
            self.metrics.redis_error(LimiterError::Unhealthy.kind());
            return Err(LimiterError::Unhealthy);
        }
        let started = Instant::now();
        let invoke = self.backend.invoke::<Vec<i64>>(slot, invocation);
        tokio::pin!(invoke);
        let (reply, in_time) = match tokio::time::timeout(self.timeout, &mut invoke).await {
            Ok(reply) => (reply, true),
            Err(_) => {
                self.metrics
                    .redis_error(LimiterError::Timeout(self.timeout).kind());
                self.record_health(false);
                // Side by side: the run may hold what `timed_out` takes (a
                // Sentinel connection being made holds its slot).
                let (_, late) = tokio::join!(
                    self.backend.timed_out(slot),
                    tokio::time::timeout(LATE_ANSWERS_AWAITED, &mut invoke)
                );
                let late = late.unwrap_or_else(|_| {
                    Err(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "no answer within the time late answers are awaited",
                    )))
                });
                self.metrics.late_script_answer(late.is_ok());
                (late, false)
            }
        };
        self.metrics.observe_redis(started.elapsed());
        self.metrics.observe_script(what, started.elapsed());
        let values = reply.map_err(LimiterError::Redis);
        if in_time {
            if let Err(e) = &values {
                self.metrics.redis_error(e.kind());
            }
            self.record_health(values.is_ok());
        }
        values
    }

    /// On a Cluster one node's failures say nothing of the others (the
    /// cluster backend pauses a failing node on its own): failing fast
    /// for all would turn one dead node into everyone's fallback.
    fn record_health(&self, ok: bool) {
        if !self.backend.is_cluster() {
            self.health.record(ok);
        }
    }

    /// Loads the scripts before batches, so that their runs go out in
    /// request order instead of each retrying after its own NOSCRIPT. (A
    /// Redis that lost its script cache is handled by each run's reload;
    /// only the order of that one batch is then arbitrary.) It never makes
    /// a batch wait: while it has not succeeded, a load is started in the
    /// background at most once a second, so a dead Cluster node (which
    /// fails every `SCRIPT LOAD`, sent to every master) costs the batches
    /// of the live nodes nothing.
    pub async fn prepare_batch(&self) {
        if self.script_loaded.load(Ordering::Relaxed) || self.health.fail_fast() {
            return;
        }
        if !self.script_load.claim(self.health.now_ms(), 1_000) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let load = async {
                this.backend.load(&this.scripts.check).await?;
                this.backend.load(&this.scripts.many).await
            };
            if let Ok(Ok(())) = tokio::time::timeout(this.timeout, load).await {
                this.script_loaded.store(true, Ordering::Relaxed);
            }
        });
    }

    /// Round trip to Redis, for readiness.
    /// Masters of a Redis Cluster that refuse every command while any
    /// master is down (`cluster-require-full-coverage yes`), counted in
    /// `meshlimitd_redis_cluster_full_coverage_required`.
    pub async fn full_coverage_required(&self) -> Vec<String> {
        let requiring = self.backend.full_coverage_required().await;
        self.metrics.full_coverage_required(requiring.len());
        requiring
    }
}

/// How a check run is labelled in `meshlimitd_script_duration_seconds`:
/// the algorithm of its limits when they share one (`fixed_window`, ...),
/// else `mixed`. Settlements and overrides are labelled so themselves.
pub(crate) fn script_label<'a>(checks: impl IntoIterator<Item = &'a Check>) -> &'static str {
    let mut algorithms = checks
        .into_iter()
        .flat_map(|c| c.limits.iter().map(|l| l.algorithm));
    match algorithms.next() {
        Some(first) if algorithms.all(|a| a == first) => first.as_str(),
        Some(_) => "mixed",
        None => "none",
    }
}

/// Distinguishes this process's nonces from other meshlimitd instances'.
fn instance_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshlimit_protocol::Limit;

    use meshlimit_protocol::Algorithm;

    /// redis-rs reports a connection's response timeout as an I/O error of
    /// kind `TimedOut` (service/tests/cluster_retry.rs checks it against a
    /// real Redis): a slow Redis, counted as a timeout, not as a lost
    /// connection, which would send an operator after the network.
    #[test]
    fn a_redis_response_timeout_is_counted_as_a_timeout() {
        let late = |kind| {
            LimiterError::Redis(redis::RedisError::from(std::io::Error::new(
                kind,
                "timed out",
            )))
        };
        assert_eq!(late(std::io::ErrorKind::TimedOut).kind(), "timeout");
        assert_eq!(
            late(std::io::ErrorKind::ConnectionRefused).kind(),
            "connection"
        );
        assert_eq!(late(std::io::ErrorKind::TimedOut).share().kind(), "timeout");
    }

    fn check(n: usize, cost: u64) -> Check {
        Check {
            subject: "s".into(),
            limits: (0..n)
                .map(|i| Limit {
                    name: format!("r/l{i}"),
                    requests: 10,
                    window_ms: 1000,
                    algorithm: Algorithm::FixedWindow,
                    cost,
                    burst: None,
                    shadow: false,
                    subject: None,
                    calendar: None,
                })
                .collect(),
            receipt: false,
            lease: None,
            trace: None,
            id: 0,
        }
    }

    #[test]
    fn reply_maps_to_statuses() {
        let r = parse_reply(
            &check(2, 1),
            &[0, 0, 1, 3, 400, 0, 10, 0, 0, 0, 900, 900, 10, 0],
        )
        .unwrap();
        assert!(!r.allowed);
        assert_eq!(r.limits[0].remaining, 3);
        assert_eq!(r.limits[0].retry_after_ms, 0);
        assert!(!r.limits[1].allowed);
        assert_eq!(r.limits[1].retry_after_ms, 900);
    }

    #[test]
    fn impossible_costs_carry_a_reason() {
        let r = parse_reply(&check(1, 11), &[0, 0, 0, 10, 0, 5, 10, 0]).unwrap();
        assert_eq!(
            r.limits[0].reason.as_deref(),
            Some("cost 11 exceeds the capacity 10 of limit r/l0")
        );
        assert_eq!(r.limits[0].retry_after_ms, 0);
    }

    #[test]
    fn short_replies_are_errors() {
        assert!(parse_reply(&check(2, 1), &[1, 1, 3]).is_err());
    }
}
