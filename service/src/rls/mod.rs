//! meshlimitd as an Envoy rate limit service: `envoy.service.ratelimit.v3`
//! `RateLimitService/ShouldRateLimit` over gRPC (`--grpc-listen`), with
//! envoyproxy/ratelimit's configuration format (`--rls-config-dir`), on
//! the same limiter, scripts and Redis as the HTTP check API.
//!
//! - [`config`]: the YAML files, read into [`config::Domains`].
//! - [`server`]: a request's descriptors to one check (all or nothing, in
//!   one script run), and its answer to per-descriptor statuses.
//! - [`reload`]: the directory watched, a bad file refused with the last
//!   good configuration kept.
//!
//! See `docs/rls.md` for what maps to what and what differs from
//! envoyproxy/ratelimit.

pub mod config;
pub mod reload;
pub mod server;
