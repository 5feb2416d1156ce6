//! Prometheus metrics of meshlimitd, served on `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

mod limits;
mod ratelimit;
pub use limits::MAX_LIMITS;
pub use ratelimit::RlsEvent;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScriptLabel {
    algorithm: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: u16,
}

/// Seconds: 50us .. 100ms. Loopback Redis answers in tens of
/// microseconds; anything near the filter's timeout (20ms default) is
/// trouble.
const REDIS_BUCKETS: [f64; 11] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1,
];

/// Handles on every metric; clones share the same series.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    decisions: Family<ResultLabel, Counter>,
    redis_errors: Family<KindLabel, Counter>,
    redis_latency: Histogram,
    script_duration: Family<ScriptLabel, Histogram>,
    responses: Family<StatusLabel, Counter>,
    check_failures: Family<KindLabel, Counter>,
    abandoned_given_back: Counter,
    late_script_answers: Family<ResultLabel, Counter>,
    late_leases_withheld: Counter,
    lost_asks_given_back: Counter,
    returns_on_lost_counters: Counter,
    settlements_repeated: Counter,
    full_coverage_required: Gauge,
    redis_healthy: Gauge,
    fleet_shadow: Gauge,
    /// Redis' used memory, maxmemory and evicted keys (`INFO`).
    redis_memory: [Gauge; 3],
    overloaded: Counter,
    unauthorized: Counter,
    rls_responses: Family<KindLabel, Counter>,
    rls_shadow_over_limit: Counter,
    limits: limits::LimitDecisions,
    rls_config_loads: Family<ResultLabel, Counter>,
    rls_descriptors: ratelimit::DescriptorStats,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        // meshlimitd's own metrics under its prefix; the rate limit
        // service's per-descriptor ones under envoyproxy/ratelimit's names.
        let mut root = Registry::default();
        let rls_descriptors = ratelimit::DescriptorStats::register(&mut root);
        let registry = root.sub_registry_with_prefix("meshlimitd");
        let limits = limits::LimitDecisions::register(registry, MAX_LIMITS);
        let rls_config_loads = Family::<ResultLabel, Counter>::default();
        registry.register(
            "rls_config_loads",
            "Rate limit service configuration loads (at start and on change), by result: success or error (the last good one stays)",
            rls_config_loads.clone(),
        );
        // meshlimitd_build_info{version="..."} 1: the workspace's version.
        registry.register(
            "build",
            "meshlimitd's version (the workspace's: the filter's and the images')",
            prometheus_client::metrics::info::Info::new(vec![(
                "version".to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            )]),
        );
        let decisions = Family::<ResultLabel, Counter>::default();
        registry.register(
            "decisions",
            "Checks decided, by result (allowed or denied)",
            decisions.clone(),
        );
        let redis_errors = Family::<KindLabel, Counter>::default();
        registry.register(
            "redis_errors",
            "Failed Redis calls, by kind (timeout, connection, command, reply, unhealthy)",
            redis_errors.clone(),
        );
        // 50us .. ~100ms: loopback Redis answers in tens of microseconds;
        // anything near the filter's timeout (20ms default) is trouble.
        let redis_latency = Histogram::new(REDIS_BUCKETS);
        registry.register(
            "redis_latency_seconds",
            "Time of one script run on Redis",
            redis_latency.clone(),
        );
        let responses = Family::<StatusLabel, Counter>::default();
        registry.register(
            "check_responses",
            "Answers to /v1/check, by HTTP status",
            responses.clone(),
        );
        // Every known series exists from the start, at 0: alert expressions
        // over rate() work before the first error, not only after it.
        for result in ["allowed", "denied"] {
            let _ = decisions.get_or_create(&ResultLabel { result });
        }
        for kind in ["timeout", "connection", "command", "reply", "unhealthy"] {
            let _ = redis_errors.get_or_create(&KindLabel { kind });
        }
        let check_failures = Family::<KindLabel, Counter>::default();
        registry.register(
            "check_failures",
            "Checks and settlements of a batch answered with an error of their own, by kind (invalid, unavailable, forged: a settlement's receipts not signed by this fleet); the batch's others were decided",
            check_failures.clone(),
        );
        for kind in ["invalid", "unavailable", "forged"] {
            let _ = check_failures.get_or_create(&KindLabel { kind });
        }
        let overloaded = Counter::default();
        registry.register(
            "overloaded",
            "Checks refused with 503 because too many were in flight",
            overloaded.clone(),
        );
        // The same buckets as redis_latency, by what the run decided.
        let script_duration = Family::<ScriptLabel, Histogram>::new_with_constructor(
            script_histogram as fn() -> Histogram,
        );
        registry.register(
            "script_duration_seconds",
            "Script runs on Redis, by algorithm (of a check run whose limits share one; mixed otherwise; settle, overrides)",
            script_duration.clone(),
        );
        let redis_memory: [Gauge; 3] = Default::default();
        for (name, help, gauge) in [
            ("redis_used_memory_bytes", "Redis' used_memory (INFO memory), read when scraped", &redis_memory[0]),
            ("redis_maxmemory_bytes", "Redis' maxmemory (0: no limit), read when scraped", &redis_memory[1]),
            ("redis_evicted_keys", "Keys Redis evicted since it started (INFO stats): an evicted counter hands its clients fresh quota", &redis_memory[2]),
        ] {
            registry.register(name, help, gauge.clone());
        }
        let redis_healthy = Gauge::default();
        registry.register(
            "redis_healthy",
            "1 while Redis answers this meshlimitd's calls, 0 after consecutive failures (its checks answer 503: every caller falls back)",
            redis_healthy.clone(),
        );
        let fleet_shadow = Gauge::default();
        registry.register(
            "enforcement_shadow",
            "1 while the fleet-wide enforcement switch is in shadow (PUT /v1/enforcement): nothing is refused anywhere",
            fleet_shadow.clone(),
        );
        let full_coverage_required = Gauge::default();
        registry.register(
            "redis_cluster_full_coverage_required",
            "Redis Cluster masters with cluster-require-full-coverage yes: while any master is down they refuse every command, and every client falls back (set it to no)",
            full_coverage_required.clone(),
        );
        let abandoned_given_back = Counter::default();
        registry.register(
            "abandoned_units_given_back",
            "Units given back because their decision finished after its caller gave up (requests' costs, leases, reservations)",
            abandoned_given_back.clone(),
        );
        let late_script_answers = Family::<ResultLabel, Counter>::default();
        registry.register(
            "late_script_answers",
            "Script runs slower than --redis-timeout-ms (each also counted in redis_errors as a timeout), still awaited: answered (what they charged for callers who gave up goes back) or unanswered (the connection gave up on them too, and what they charged stays)",
            late_script_answers.clone(),
        );
        for result in ["answered", "unanswered"] {
            let _ = late_script_answers.get_or_create(&ResultLabel { result });
        }
        let late_leases_withheld = Counter::default();
        registry.register(
            "late_lease_units_withheld",
            "Leased units given back instead of sent: their decision took over half the caller's budget, and its answer could arrive after the caller gave up",
            late_leases_withheld.clone(),
        );
        let lost_asks_given_back = Counter::default();
        registry.register(
            "lost_ask_units_given_back",
            "Units given back for lease asks and reservations whose answers were lost, as their callers named them (or as meshlimitd gave them up itself)",
            lost_asks_given_back.clone(),
        );
        let returns_on_lost_counters = Counter::default();
        registry.register(
            "return_units_on_lost_counters",
            "Units a lease return or refund did not give back: its receipt is older than its subject's counters (Redis lost them since: a restart, an eviction), which never held them",
            returns_on_lost_counters.clone(),
        );
        let settlements_repeated = Counter::default();
        registry.register(
            "settlements_repeated",
            "Settlements (lease returns) sent again with an id already applied: they changed nothing (their first answer was lost)",
            settlements_repeated.clone(),
        );
        let unauthorized = Counter::default();
        registry.register(
            "unauthorized",
            "Checks refused with 401: missing or wrong shared token (--auth-token-file)",
            unauthorized.clone(),
        );
        let rls_responses = Family::<KindLabel, Counter>::default();
        registry.register(
            "rls_responses",
            "Answers of the rate limit service (gRPC), by kind (ok, over_limit, invalid, unavailable, unauthenticated)",
            rls_responses.clone(),
        );
        for kind in [
            "ok",
            "over_limit",
            "invalid",
            "unavailable",
            "unauthenticated",
        ] {
            let _ = rls_responses.get_or_create(&KindLabel { kind });
        }
        let rls_shadow_over_limit = Counter::default();
        registry.register(
            "rls_shadow_over_limit",
            "Descriptors in shadow_mode that were over their limit (answered OK)",
            rls_shadow_over_limit.clone(),
        );
        Metrics {
            overloaded,
            abandoned_given_back,
            late_script_answers,
            late_leases_withheld,
            lost_asks_given_back,
            returns_on_lost_counters,
            settlements_repeated,
            full_coverage_required,
            redis_healthy,
            fleet_shadow,
            redis_memory,
            unauthorized,
            rls_responses,
            rls_shadow_over_limit,
            registry: Arc::new(root),
            limits,
            rls_descriptors,
            rls_config_loads,
            decisions,
            redis_errors,
            redis_latency,
            script_duration,
            responses,
            check_failures,
        }
    }

    /// A check answered with an error of its own (`invalid`, `unavailable`).
    pub fn check_failure(&self, kind: &'static str) {
        self.check_failures.get_or_create(&KindLabel { kind }).inc();
    }

    pub fn decision(&self, allowed: bool) {
        let result = if allowed { "allowed" } else { "denied" };
        self.decisions.get_or_create(&ResultLabel { result }).inc();
    }

    /// A decided check's limits: their names (`rule/limit`), statuses, and
    /// whether the check was admitted.
    pub fn limit_decisions<'a>(
        &self,
        limits: impl Iterator<Item = (&'a str, &'a meshlimit_protocol::LimitStatus)>,
        admitted: bool,
    ) {
        for (name, status) in limits {
            self.limits.record(name, status, admitted);
        }
    }

    /// A descriptor's stats under envoyproxy/ratelimit's names: `hits` of
    /// `event` on the descriptor whose stats' key is `stat_key`.
    pub fn rls_descriptor(&self, stat_key: &str, event: RlsEvent, hits: u64) {
        self.rls_descriptors.add(stat_key, event, hits);
    }

    /// A rate limit service configuration load, and whether it succeeded.
    pub fn rls_config_load(&self, ok: bool) {
        let result = if ok { "success" } else { "error" };
        self.rls_config_loads
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    pub fn redis_error(&self, kind: &'static str) {
        self.redis_errors.get_or_create(&KindLabel { kind }).inc();
    }

    pub fn observe_redis(&self, elapsed: Duration) {
        self.redis_latency.observe(elapsed.as_secs_f64());
    }

    /// A script run, by what it decided (see `limiter::script_label`).
    pub fn observe_script(&self, algorithm: &'static str, elapsed: Duration) {
        self.script_duration
            .get_or_create(&ScriptLabel { algorithm })
            .observe(elapsed.as_secs_f64());
    }

    pub fn overloaded(&self) {
        self.overloaded.inc();
    }

    pub fn unauthorized(&self) {
        self.unauthorized.inc();
    }

    /// Whether the fleet-wide switch is in shadow.
    pub fn fleet_shadow(&self, shadow: bool) {
        self.fleet_shadow.set(i64::from(shadow));
    }

    /// Whether Redis answers this meshlimitd (read when scraped).
    pub fn redis_healthy(&self, healthy: bool) {
        self.redis_healthy.set(i64::from(healthy));
    }

    /// Redis' memory and evictions, as read when scraped.
    pub fn redis_memory(&self, memory: &crate::limiter::RedisMemory) {
        let values = [memory.used_bytes, memory.max_bytes, memory.evicted_keys];
        for (gauge, value) in self.redis_memory.iter().zip(values) {
            gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
        }
    }

    /// How many Cluster masters require full coverage (last read).
    pub fn full_coverage_required(&self, masters: usize) {
        self.full_coverage_required.set(masters as i64);
    }

    /// Units given back for a decision its caller no longer waited for.
    pub fn late_leases_withheld(&self, units: u64) {
        self.late_leases_withheld.inc_by(units);
    }

    pub fn lost_asks_given_back(&self, units: u64) {
        self.lost_asks_given_back.inc_by(units);
    }

    /// Units of returns refused: their counters were lost since.
    pub fn returns_on_lost_counters(&self, units: u64) {
        self.returns_on_lost_counters.inc_by(units);
    }

    /// A settlement whose id was applied before (it changed nothing).
    pub fn settlement_repeated(&self) {
        self.settlements_repeated.inc();
    }

    /// A run slower than the Redis timeout ended: `answered` or not.
    pub fn late_script_answer(&self, answered: bool) {
        let result = if answered { "answered" } else { "unanswered" };
        self.late_script_answers
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    pub fn abandoned_given_back(&self, units: u64) {
        self.abandoned_given_back.inc_by(units);
    }

    /// An answer of the rate limit service (gRPC), by kind.
    pub fn rls_response(&self, kind: &'static str) {
        self.rls_responses.get_or_create(&KindLabel { kind }).inc();
    }

    /// Shadow-mode descriptors found over their limit.
    pub fn rls_shadow_over_limit(&self, n: u64) {
        if n > 0 {
            self.rls_shadow_over_limit.inc_by(n);
        }
    }

    pub fn response(&self, status: u16) {
        self.responses.get_or_create(&StatusLabel { status }).inc();
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Buckets of a script run's duration: those of `redis_latency`.
fn script_histogram() -> Histogram {
    Histogram::new(REDIS_BUCKETS)
}
