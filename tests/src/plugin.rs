//! The filter's plugin configuration for tests, the bench and the soak:
//! one builder instead of JSON text written (and edited with `replace`) in
//! every file.
//!
//! ```
//! use meshlimit_testbed::plugin::PluginConfig;
//! use serde_json::json;
//! let config = PluginConfig::new()
//!     .failure_mode("deny")
//!     .limits(json!([{"name": "per-hour", "requests": 5, "window": "1h"}]))
//!     .build();
//! assert!(config.contains("per-hour"));
//! ```

use serde_json::{json, Value};

/// The `api` rule's limit in the usual configuration, per minute.
pub const USUAL_LIMIT: u64 = 20;

/// A plugin configuration, built up from the tests' usual one.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginConfig {
    value: Value,
}

impl Default for PluginConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl PluginConfig {
    /// The tests' usual configuration: meshlimitd's cluster with a generous
    /// timeout (so that a loaded CI machine does not turn global decisions
    /// into, correct but different, fallback decisions; tests about failures
    /// stop the service instead), clients by `x-api-key` or else their
    /// address behind one trusted proxy, and one rule `api` on every path:
    /// `per-minute`, [`USUAL_LIMIT`] a minute.
    pub fn new() -> Self {
        PluginConfig {
            value: json!({
                "service": {"cluster": "meshlimit", "authority": "meshlimitd", "timeout": "1s"},
                "client_id": {"headers": ["x-api-key"], "when_missing": "client_address", "trusted_hops": 1},
                "rules": [{
                    "name": "api",
                    "match": {"path_prefix": "/"},
                    "limits": [{"name": "per-minute", "requests": USUAL_LIMIT, "window": "60s"}]
                }]
            }),
        }
    }

    /// Sets a top-level field (`response`, `group_commit`, `breaker`, ...).
    pub fn set(mut self, field: &str, value: Value) -> Self {
        self.value[field] = value;
        self
    }

    /// Sets one field of a top-level object (e.g. `service`, `timeout`).
    pub fn set_in(mut self, object: &str, field: &str, value: Value) -> Self {
        self.value[object][field] = value;
        self
    }

    pub fn client_id(self, client_id: Value) -> Self {
        self.set("client_id", client_id)
    }

    pub fn failure_mode(self, mode: &str) -> Self {
        self.set("failure_mode", json!(mode))
    }

    /// Sets a field of the `api` rule (`shadow`, `cost`, `scope`, ...).
    pub fn rule_field(mut self, field: &str, value: Value) -> Self {
        self.value["rules"][0][field] = value;
        self
    }

    /// The `api` rule's limits.
    pub fn limits(self, limits: Value) -> Self {
        self.rule_field("limits", limits)
    }

    /// Sets a field of the `api` rule's first limit.
    pub fn limit_field(mut self, field: &str, value: Value) -> Self {
        self.value["rules"][0]["limits"][0][field] = value;
        self
    }

    /// Replaces every rule.
    pub fn rules(self, rules: Value) -> Self {
        self.set("rules", rules)
    }

    /// The JSON text, as Envoy's `configuration` carries it.
    pub fn build(&self) -> String {
        serde_json::to_string_pretty(&self.value).unwrap_or_default()
    }
}

impl From<PluginConfig> for String {
    fn from(config: PluginConfig) -> String {
        config.build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usual_config_is_one_the_filter_accepts() {
        let config = PluginConfig::new()
            .failure_mode("allow")
            .set("group_commit", json!({"enabled": false}))
            .rule_field("shadow", json!(true))
            .limit_field("algorithm", json!("sliding_window_log"));
        let parsed = meshlimit::config::parse(config.build().as_bytes());
        assert!(parsed.is_ok(), "{parsed:?}");
    }

    #[test]
    fn fields_land_where_they_belong() {
        let bad = PluginConfig::new().limit_field("burts", json!(5)).build();
        let e = meshlimit::config::parse(bad.as_bytes()).unwrap_err();
        assert_eq!(e.field, "rules[0].limits[0].burts");
    }
}
