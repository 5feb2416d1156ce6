//! The plugin configurations the rows run.

use meshlimit_testbed::plugin::PluginConfig;
use serde_json::json;

/// The benched configuration: the filter's default timeout, clients by
/// `x-api-key`, `requests` an hour.
pub(crate) fn per_hour(requests: u64) -> PluginConfig {
    PluginConfig::new()
        .set("service", json!({"timeout": "20ms"}))
        .client_id(json!({"headers": ["x-api-key"]}))
        .rule_field("match", json!({}))
        .limits(json!([{"name": "hour", "requests": requests, "window": "1h"}]))
}

/// Every request allowed.
pub(crate) fn allow_all() -> PluginConfig {
    per_hour(1_000_000_000)
}

/// Three rules with header conditions, all matching the benched request
/// (`x-api-key: bench`, `x-plan: pro`, `x-tenant: acme`): a plan, a route
/// cap counted for everyone, and a tenant-per-route limit.
pub(crate) fn three_rules() -> String {
    let big = 1_000_000_000u64;
    allow_all()
        .rules(json!([
            {"name": "pro", "match": {"headers": [{"name": "x-plan", "exact": "pro"}]},
             "limits": [{"name": "hour", "requests": big, "window": "1h"}]},
            {"name": "route", "match": {"path": {"prefix": "/"}, "headers": [{"name": "x-api-key", "present": true}]},
             "limits": [{"name": "hour", "requests": big, "window": "1h", "by": []}]},
            {"name": "tenant", "match": {"headers": [{"name": "x-tenant", "in": ["acme", "umbrella"]}]},
             "limits": [{"name": "hour", "requests": big, "window": "1h", "by": ["header:x-tenant", "path"]}]}
        ]))
        .build()
}

/// A token budget on a chat route: each request reserves its body's
/// `max_tokens` and settles at the usage the JSON response reports.
pub(crate) fn token_budget() -> String {
    token_budget_of(1_000_000_000)
}

/// Row 21: a budget of 1,000 tokens an hour, spent by the warm-up's first
/// request (the fake model reports 1,000 used): every request after is
/// refused at its headers, from the deny cache.
pub(crate) fn spent_token_budget() -> String {
    token_budget_of(1_000)
}

fn token_budget_of(tokens: u64) -> String {
    per_hour(tokens)
        .rule_field(
            "cost",
            json!({"reserve": {"request_json": "max_tokens", "default": 100, "max": 1000},
                   "response": {"json": "usage.total_tokens"}}),
        )
        .build()
}

/// Row 3: every request its own call (group commit off). Leases are on by default and would
/// decide a hot client's requests without one (from when they landed until
/// December 2026 this row did, at 0.00 to 0.01 calls per request).
pub(crate) fn one_call_each() -> String {
    leases_off(allow_all().set("group_commit", json!({"enabled": false})))
}

/// Leases off (group commit, as before leases).
pub(crate) fn leases_off(config: PluginConfig) -> String {
    config.set("leases", json!({"enabled": false})).build()
}
