//! meshlimitd: the stateless check service behind the meshlimit filter.
//!
//! Any instance can answer any request: all state is in Redis, changed only
//! by the scripts in [`script`]. See `api` for the HTTP contract and `keys`
//! for the key layout.

pub mod admin;
pub mod api;
pub mod app;
pub mod backend;
pub mod cluster;
pub mod fleet;
pub mod keys;
pub mod limiter;
pub mod metrics;
pub mod rls;
pub mod script;
pub mod throttle;
pub mod traces;
pub mod validate;
