//! `make bench`: what meshlimit costs per request, side by side in one run,
//! reported as ratios to bare Envoy. Writes docs/benchmarks.md and
//! docs/benchmarks.svg.
//!
//! Configurations (each Envoy with one worker, in front of the same kind of
//! upstream Envoy answering 200):
//!  1. Envoy alone;
//!  2. Envoy with its built-in local_ratelimit (in-process token bucket);
//!  3. meshlimit, global, every request allowed, group commit off (a call
//!     and a script each);
//!  4. meshlimit, global, the client over its limit (the deny cache answers);
//!  5. meshlimit with Redis down and the breaker open (local fallback);
//!  6. meshlimitd alone, checks/s over HTTP, beside redis-benchmark running
//!     the same script with EVALSHA (the Redis ceiling);
//!  7. meshlimit, global, group commit, one hot client;
//!  8. meshlimit, global, group commit, 1000 clients (each request's id
//!     drawn at random, in a query parameter, by the same single oha);
//!  9. as 7, the request matched by three rules with header conditions (a
//!     plan, a route cap `by: []`, a tenant limit `by` a header and the
//!     path): what mesh policies cost over 7's single rule.
//! 10. as 7, a token budget; 11. Envoy's native ratelimit filter asking
//!     meshlimitd over gRPC.
//! 12. to 18. Envoy answering itself (`direct_response`, no upstream),
//!     so that the filter's cost is most of what is measured: bare Envoy,
//!     a do-nothing Rust wasm filter that reads the client id as the
//!     benched configuration does (`x-api-key`, else `:path` for the
//!     Zipf mix's `key` parameter: the practical limit of any wasm filter
//!     deciding by the client; tests/noop-filter), and meshlimit's
//!     default (quota leases) beside leases off, for one hot client and
//!     for 1000 clients whose request rates follow a Zipf distribution
//!     (a few clients send most requests, as real traffic has).
//! 19. and 20. a `scope: local` rule (decided from the Envoy's own shared
//!     data, no call at all) for one hot client and the Zipf mix: a local
//!     decision must cost no more than a lease hit.
//! 21. as 10, the client's budget spent: refused at the headers, before
//!     anything goes upstream, which must cost no more than any other
//!     deny (4); 22. as 4, the same POST as 21: any deny of that request
//!     at its headers (its body unread, its HTTP/1.1 connection closed).
//!
//! Runs are interleaved (1..5, 1..5, ...) and repeated; medians are
//! reported. The throughput targets against the do-nothing filter are
//! read from pairs run side by side instead (`full::TARGET_PAIRS`, run in
//! the pairs' rows' forks: more Envoys of the same rows, see
//! `fleet::FORKS`), each row's run right after a few seconds of its own
//! load (`full::WARM_SECONDS`): the median of the pairs' ratios.
//! The load generator is oha.
//!
//! `MESHLIMIT_BENCH_AB=<builds, separated by :>` (`make bench-ab`) prices a change to
//! the hit path: see `ab`.
//!
//! `MESHLIMIT_COMPARE_WASM=<path to another build>` adds configurations 3
//! and 7 run with that build, interleaved with the others in the same run
//! (e.g. main before a change against the change), and writes the report to
//! target/bench-compare.md instead of docs/.
//!
//! One module per job: `full` runs `make bench` and `report` writes it;
//! `ab`, `profile`, `perf` and `timers` are the focused runs; `rows`,
//! `envoys` and `configs` say what a row is, starts and runs; `load`
//! drives oha; `machine` pins and reads CPUs; `counted` reads what an
//! Envoy's stats say a row measured; `service` loads meshlimitd and Redis
//! alone.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod ab;
mod configs;
mod counted;
mod envoys;
mod fleet;
mod full;
mod load;
mod machine;
mod perf;
mod profile;
mod report;
mod rows;
mod service;
mod timers;

fn main() {
    meshlimit_testbed::procs::stop_all_on_panic();
    machine::cores();
    if std::env::var_os("MESHLIMIT_BENCH_PROFILE").is_some() {
        return profile::profile();
    }
    if let Some(other) = std::env::var_os("MESHLIMIT_BENCH_AB") {
        // Empty: this build beside the do-nothing filter alone.
        return ab::ab(
            std::env::split_paths(&other)
                .filter(|p| !p.as_os_str().is_empty())
                .collect(),
        );
    }
    full::bench();
}
