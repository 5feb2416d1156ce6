//! The accepted values of the configuration's bounded integer fields, in
//! one place: the validator refuses what lies outside them (naming the
//! field and the range), and the JSON Schema publishes them
//! (`reference::json_schema`), so an editor or a CI check refuses what
//! Envoy would refuse at load.

use meshlimit_protocol::bounds;

/// An integer field's path and the values it accepts, both ends included.
pub(crate) struct Range {
    pub(crate) path: &'static str,
    pub(crate) min: u64,
    pub(crate) max: u64,
    /// Said after the range when a value is refused, in parentheses.
    pub(crate) hint: &'static str,
}

impl Range {
    pub(crate) fn contains(&self, value: u64) -> bool {
        (self.min..=self.max).contains(&value)
    }

    /// What a refusal says.
    pub(crate) fn problem(&self) -> String {
        let range = format!("must be between {} and {}", self.min, self.max);
        if self.hint.is_empty() {
            range
        } else {
            format!("{range} ({})", self.hint)
        }
    }
}

/// Shared-data tables: at least a few slots, at most a million (each is
/// shared data every Envoy holds; docs/memory.md).
const MIN_SLOTS: u64 = 16;
const MAX_SLOTS: u64 = 1 << 20;

const fn range(path: &'static str, min: u64, max: u64, hint: &'static str) -> Range {
    Range {
        path,
        min,
        max,
        hint,
    }
}

pub(crate) const TRUSTED_HOPS: Range = range("client_id.trusted_hops", 0, 16, "");
pub(crate) const REJECT_STATUS: Range = range(
    "client_id.reject_status",
    400,
    499,
    "a 4xx status, e.g. 400 or 401",
);
pub(crate) const IPV6_PREFIX: Range = range(
    "client_id.ipv6_prefix",
    1,
    128,
    "bits of an IPv6 address that name one client; 64 is one site",
);
pub(crate) const EXPECTED_REPLICAS: Range = range("local.expected_replicas", 1, 10_000, "");
pub(crate) const LOCAL_SLOTS: Range = range("local.slots", MIN_SLOTS, MAX_SLOTS, "");
pub(crate) const MAX_BATCH: Range = range("group_commit.max_batch", 1, 1024, "");
pub(crate) const MAX_QUEUED: Range = range("group_commit.max_queued", 1, 100_000, "");
pub(crate) const MAX_CALLS_IN_FLIGHT: Range = range("group_commit.max_calls_in_flight", 1, 64, "");
pub(crate) const LEASE_MAX_UNITS: Range = range("leases.max_units", 1, bounds::MAX_LEASE_UNITS, "");
pub(crate) const LEASE_SLOTS: Range = range("leases.slots", MIN_SLOTS, MAX_SLOTS, "");
pub(crate) const RESPONSE_STATUS: Range = range(
    "response.status",
    400,
    599,
    "a 4xx or 5xx status; 429 is the standard one",
);
pub(crate) const GRPC_STATUS: Range = range(
    "response.grpc_status",
    1,
    16,
    "a gRPC status code; 8, RESOURCE_EXHAUSTED, is the standard one",
);
pub(crate) const DENY_CACHE_SLOTS: Range =
    range("deny_cache.slots", 0, MAX_SLOTS, "0 turns the cache off");
pub(crate) const BREAKER_FAILURES: Range = range("breaker.failures", 1, 1000, "");

/// Every range, for the schema and the docs (native builds only).
#[cfg(not(target_arch = "wasm32"))]
pub(crate) const ALL: &[&Range] = &[
    &TRUSTED_HOPS,
    &REJECT_STATUS,
    &IPV6_PREFIX,
    &EXPECTED_REPLICAS,
    &LOCAL_SLOTS,
    &MAX_BATCH,
    &MAX_QUEUED,
    &MAX_CALLS_IN_FLIGHT,
    &LEASE_MAX_UNITS,
    &LEASE_SLOTS,
    &RESPONSE_STATUS,
    &GRPC_STATUS,
    &DENY_CACHE_SLOTS,
    &BREAKER_FAILURES,
];
