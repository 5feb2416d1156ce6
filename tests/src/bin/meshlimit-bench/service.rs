//! Row 6: meshlimitd alone over gRPC, and redis-benchmark running the
//! check script (the Redis ceiling).

use std::process::Command;

use meshlimit_testbed::services::REDIS_PORT;

use crate::load::{CONNECTIONS, SECONDS};

/// `ShouldRateLimit` calls per second on meshlimitd's gRPC port, as fast
/// as 8 connections with 8 calls in flight each get answers, for
/// [`SECONDS`]: one descriptor, the same script as 6.
pub(crate) fn grpc_load(addr: &str) -> f64 {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use std::sync::atomic::{AtomicU64, Ordering};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("cannot start a runtime: {e}"));
    let answered = std::sync::Arc::new(AtomicU64::new(0));
    let request = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: "bench-grpc".into(),
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    };
    let url = format!("http://{addr}");
    runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(SECONDS);
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let channel = tonic::transport::Endpoint::from_shared(url.clone())
                .unwrap_or_else(|e| panic!("bad address {url}: {e}"))
                .connect()
                .await
                .unwrap_or_else(|e| panic!("cannot reach the rate limit service at {url}: {e}"));
            for _ in 0..8 {
                let mut client = RateLimitServiceClient::new(channel.clone());
                let (request, answered) = (request.clone(), answered.clone());
                tasks.push(tokio::spawn(async move {
                    while tokio::time::Instant::now() < deadline {
                        if client.should_rate_limit(request.clone()).await.is_ok() {
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }));
            }
        }
        for task in tasks {
            let _ = task.await;
        }
    });
    answered.load(Ordering::Relaxed) as f64 / SECONDS as f64
}

pub(crate) fn redis_benchmark(host: &str, sha: &str) -> f64 {
    let out = Command::new("redis-benchmark")
        .args([
            "-h",
            host,
            "-p",
            &REDIS_PORT.to_string(),
            "-c",
            &CONNECTIONS.to_string(),
            "-n",
            "200000",
            "-q",
        ])
        .args(["evalsha", sha, "1", "ml:{e:bench6}:api/hour:fw:3600000"])
        // As meshlimitd lays them out (no test clock, no lease), for the
        // limit of the check meshlimitd is measured with.
        .args(meshlimitd::script::check_args(
            "nonce",
            false,
            "",
            (0, 1),
            meshlimitd::script::Follow::default(),
        ))
        .args(meshlimitd::script::limit_args(&meshlimit_protocol::Limit {
            name: "api/hour".into(),
            requests: 1_000_000_000,
            window_ms: 3_600_000,
            algorithm: meshlimit_protocol::Algorithm::FixedWindow,
            cost: 1,
            burst: None,
            shadow: false,
            subject: None,
            calendar: None,
        }))
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-benchmark: {e}"));
    // "evalsha ...: 51234.56 requests per second, p50=..."
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    text.lines()
        .filter_map(|l| {
            l.split(": ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
        })
        .next_back()
        .unwrap_or(0.0)
}
