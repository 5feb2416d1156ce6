//! Runs checks on Redis.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshlimit_protocol::{Check, CheckResult, Limit, LimitStatus};
use redis::Script;

use crate::backend::{self, Backend};

use crate::keys;
use crate::metrics::Metrics;
use crate::script;
use crate::throttle::AtMostEvery;

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

/// Shared, cheap-to-clone handle on Redis and the scripts.
#[derive(Clone)]
pub struct Limiter {
    backend: Backend,
    script: Script,
    /// Several checks per run (see [`Limiter::check_batch`]).
    many: Script,
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

/// Consecutive Redis failures after which calls fail fast.
const UNHEALTHY_AFTER: u32 = 3;
/// How long calls fail fast before one is let through again.
const UNHEALTHY_FOR: Duration = Duration::from_millis(200);

/// A small breaker in front of Redis: when it keeps failing (a black-holed
/// host times out every call), answer 503 at once instead of making every
/// caller wait for the Redis timeout.
#[derive(Default)]
struct Health {
    failures: std::sync::atomic::AtomicU32,
    /// Milliseconds since `epoch` until which calls fail fast.
    fail_fast_until: AtomicU64,
    epoch: std::sync::OnceLock<Instant>,
}

impl Health {
    fn now_ms(&self) -> u64 {
        self.epoch.get_or_init(Instant::now).elapsed().as_millis() as u64
    }

    fn fail_fast(&self) -> bool {
        self.now_ms() < self.fail_fast_until.load(Ordering::Relaxed)
    }

    fn record(&self, ok: bool) {
        if ok {
            self.failures.store(0, Ordering::Relaxed);
        } else if self.failures.fetch_add(1, Ordering::Relaxed) + 1 >= UNHEALTHY_AFTER {
            let until = self.now_ms() + UNHEALTHY_FOR.as_millis() as u64;
            self.fail_fast_until.store(until, Ordering::Relaxed);
        }
    }
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
            script: Script::new(script::CHECK),
            many: Script::new(script::CHECK_MANY),
            nonce: Arc::new((instance_id(), AtomicU64::new(0))),
            prefix,
            timeout,
            metrics,
            health: Arc::new(Health::default()),
            script_loaded: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            script_load: Arc::default(),
        })
    }

    /// Decides one check atomically (all of its limits or none).
    pub async fn check(&self, check: &Check) -> Result<CheckResult, LimiterError> {
        let mut invocation = self.script.prepare_invoke();
        invocation.arg(self.next_nonce());
        self.add_limits(&mut invocation, check);
        let values = self.run(slot_of(check), &invocation).await?;
        parse_reply(check, &values)
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
        // Groups of indices into `checks`, each group in request order.
        let groups: Vec<Vec<usize>> = if self.backend.is_cluster() {
            let mut group_of: std::collections::HashMap<&str, usize> = Default::default();
            let mut groups: Vec<Vec<usize>> = Vec::new();
            for (i, check) in checks.iter().enumerate() {
                let g = *group_of.entry(&check.subject).or_insert_with(|| {
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
        let mut invocation = self.many.prepare_invoke();
        invocation.arg(self.next_nonce()).arg(checks.len());
        for check in checks {
            invocation.arg(check.limits.len());
            self.add_limits(&mut invocation, check);
        }
        // On a Cluster the checks of one run share a subject, hence a slot.
        let slot = checks.first().map_or(0, |c| slot_of(c));
        let values = self.run(slot, &invocation).await?;
        let mut rest = values.as_slice();
        let mut results = Vec::with_capacity(checks.len());
        for check in checks {
            let n = (1 + script::REPLY_PER_LIMIT * check.limits.len()).min(rest.len());
            let (mine, after) = rest.split_at(n);
            results.push(parse_reply(check, mine)?);
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

    /// A check's keys and per-limit arguments, as the scripts take them.
    fn add_limits(&self, invocation: &mut redis::ScriptInvocation<'_>, check: &Check) {
        let tag = keys::subject_tag(&check.subject);
        for limit in &check.limits {
            invocation
                .key(keys::limit_key(&self.prefix, &tag, limit))
                .arg(limit.algorithm.short_name())
                .arg(limit.requests)
                .arg(limit.window_ms)
                .arg(limit.cost)
                .arg(limit.capacity())
                .arg(u8::from(limit.shadow));
        }
    }

    /// Runs a script invocation with the timeout, the health check and the
    /// metrics every run gets.
    async fn run(
        &self,
        slot: u16,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<Vec<i64>, LimiterError> {
        if self.health.fail_fast() {
            self.metrics.redis_error(LimiterError::Unhealthy.kind());
            return Err(LimiterError::Unhealthy);
        }
        let started = Instant::now();
        let reply = tokio::time::timeout(
            self.timeout,
            self.backend.invoke::<Vec<i64>>(slot, invocation),
        )
        .await;
        self.metrics.observe_redis(started.elapsed());
        let values = match reply {
            Err(_) => {
                self.backend.timed_out().await;
                Err(LimiterError::Timeout(self.timeout))
            }
            Ok(Err(e)) => Err(LimiterError::Redis(e)),
            Ok(Ok(values)) => Ok(values),
        }
        .inspect_err(|e| self.metrics.redis_error(e.kind()));
        // On a Cluster one node's failures say nothing of the others (the
        // cluster backend pauses a failing node on its own): failing fast
        // for all would turn one dead node into everyone's fallback.
        if !self.backend.is_cluster() {
            self.health.record(values.is_ok());
        }
        values
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
                this.backend.load(&this.script).await?;
                this.backend.load(&this.many).await
            };
            if let Ok(Ok(())) = tokio::time::timeout(this.timeout, load).await {
                this.script_loaded.store(true, Ordering::Relaxed);
            }
        });
    }

    /// Round trip to Redis, for readiness.
    pub async fn ping(&self) -> Result<(), LimiterError> {
        let reply = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(250)),
            self.backend.query::<String>(&redis::cmd("PING")),
        )
        .await;
        match reply {
            Err(_) => Err(LimiterError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(e.into()),
            Ok(Ok(_)) => Ok(()),
        }
    }
}

/// The Cluster slot of a check's keys (all share its subject's tag).
fn slot_of(check: &Check) -> u16 {
    keys::tag_slot(&keys::subject_tag(&check.subject))
}

/// Distinguishes this process's nonces from other meshlimitd instances'.
fn instance_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::process::id())
}

/// Why `limit` can never admit a request of its cost, if it cannot.
fn impossible(limit: &Limit) -> Option<String> {
    (limit.cost > limit.capacity()).then(|| {
        format!(
            "cost {} exceeds the capacity {} of limit {}",
            limit.cost,
            limit.capacity(),
            limit.name
        )
    })
}

fn parse_reply(check: &Check, values: &[i64]) -> Result<CheckResult, LimiterError> {
    let per = script::REPLY_PER_LIMIT;
    let expected = 1 + per * check.limits.len();
    if values.len() != expected {
        return Err(LimiterError::Reply(format!(
            "{} values, expected {expected}",
            values.len()
        )));
    }
    let allowed = values.first() == Some(&1);
    let limits = check
        .limits
        .iter()
        .zip(values.get(1..).unwrap_or_default().chunks_exact(per))
        .map(|(limit, v)| {
            let reason = impossible(limit);
            let ok = v[0] == 1 && reason.is_none();
            LimitStatus {
                allowed: ok,
                limit: limit.requests,
                remaining: v[1].max(0) as u64,
                reset_after_ms: v[2].max(0) as u64,
                // Waiting never helps a request that can never fit.
                retry_after_ms: if ok || reason.is_some() {
                    0
                } else {
                    v[3].max(0) as u64
                },
                shadow: limit.shadow,
                reason,
            }
        })
        .collect();
    Ok(CheckResult { allowed, limits })
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshlimit_protocol::Limit;

    use meshlimit_protocol::Algorithm;

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
                })
                .collect(),
        }
    }

    #[test]
    fn reply_maps_to_statuses() {
        let r = parse_reply(&check(2, 1), &[0, 1, 3, 400, 0, 0, 0, 900, 900]).unwrap();
        assert!(!r.allowed);
        assert_eq!(r.limits[0].remaining, 3);
        assert_eq!(r.limits[0].retry_after_ms, 0);
        assert!(!r.limits[1].allowed);
        assert_eq!(r.limits[1].retry_after_ms, 900);
    }

    #[test]
    fn impossible_costs_carry_a_reason() {
        let r = parse_reply(&check(1, 11), &[0, 0, 10, 0, 5]).unwrap();
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
