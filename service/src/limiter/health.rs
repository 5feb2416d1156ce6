//! Redis' health as meshlimitd sees it: a small breaker that makes calls
//! fail fast while Redis keeps failing, `PING` for `/readyz`, and what
//! Redis says of its memory for the alerts.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Limiter, LimiterError};

/// Consecutive Redis failures after which calls fail fast.
const UNHEALTHY_AFTER: u32 = 3;
/// How long calls fail fast before one is let through again.
const UNHEALTHY_FOR: Duration = Duration::from_millis(200);

/// A small breaker in front of Redis: when it keeps failing (a black-holed
/// host times out every call), answer 503 at once instead of making every
/// caller wait for the Redis timeout.
#[derive(Default)]
pub(super) struct Health {
    failures: AtomicU32,
    /// Milliseconds since `epoch` until which calls fail fast.
    fail_fast_until: AtomicU64,
    epoch: std::sync::OnceLock<Instant>,
}

impl Health {
    pub(super) fn now_ms(&self) -> u64 {
        self.epoch.get_or_init(Instant::now).elapsed().as_millis() as u64
    }

    pub(super) fn fail_fast(&self) -> bool {
        self.now_ms() < self.fail_fast_until.load(Ordering::Relaxed)
    }

    pub(super) fn record(&self, ok: bool) {
        if ok {
            self.failures.store(0, Ordering::Relaxed);
        } else if self.failures.fetch_add(1, Ordering::Relaxed) + 1 >= UNHEALTHY_AFTER {
            let until = self.now_ms() + UNHEALTHY_FOR.as_millis() as u64;
            self.fail_fast_until.store(until, Ordering::Relaxed);
        }
    }
}

impl Limiter {
    /// Redis' memory and evictions (`INFO memory`, `INFO stats`), for the
    /// alerts on a Redis near `maxmemory` or evicting keys: an evicted
    /// counter hands its clients fresh quota, silently. On a Cluster, of
    /// the node the connection reaches. `None` when Redis does not answer
    /// in time.
    pub async fn redis_memory(&self) -> Option<RedisMemory> {
        let info = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(250)),
            self.backend
                .query::<String>(redis::cmd("INFO").arg("memory").arg("stats")),
        )
        .await
        .ok()?
        .ok()?;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        Some(RedisMemory {
            used_bytes: field("used_memory")?,
            max_bytes: field("maxmemory").unwrap_or(0),
            evicted_keys: field("evicted_keys").unwrap_or(0),
        })
    }

    /// Whether Redis answered lately: fewer consecutive failures than make
    /// calls fail fast (what `meshlimitd_redis_healthy` exports).
    pub fn redis_healthy(&self) -> bool {
        self.health.failures.load(Ordering::Relaxed) < UNHEALTHY_AFTER
    }

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

/// What Redis says of its memory (see [`Limiter::redis_memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisMemory {
    pub used_bytes: u64,
    /// 0: no limit.
    pub max_bytes: u64,
    /// Keys evicted since Redis started.
    pub evicted_keys: u64,
}
