//! Checks the wire shape and builds the [`Config`] the filter runs with.
//! Every refusal names the field by its path.

use std::collections::HashSet;
use std::rc::Rc;

use meshlimit_protocol::bounds::{self, LimitField};

use super::duration;
use super::ranges::{self, Range};
use super::raw::*;
use super::{
    err, Attribute, BreakerConfig, ClientIdConfig, Config, ConfigError, Cost, DecisionLogConfig,
    HeaderCondition, HeaderTest, HostPattern, JwtSource, LeaseConfig, LimitConfig, LocalConfig,
    Match, PathMatch, Reserve, ResponseConfig, Rule, Scope, ServiceConfig, StaticOverride,
    TokenCost, TokenMode, UsageSource,
};

mod cost;
mod rule;
mod sections;

use cost::*;
use rule::*;
use sections::*;

/// Parts per million, so the config stays `Eq`.
const PPM: f64 = 1_000_000.0;

/// Bounds that keep a typo from becoming an outage.
const MAX_TIMEOUT_MS: u64 = 60_000;

const MAX_NAME_LEN: usize = bounds::MAX_NAME_LEN;

const MAX_COST: u64 = bounds::MAX_COST;

/// Nothing when `value` lies within `range`; else the refusal that names
/// the field and its range.
fn within(range: &Range, value: impl TryInto<u64>) -> Result<(), ConfigError> {
    // A value too large for a u64 is beyond every range.
    if range.contains(value.try_into().unwrap_or(u64::MAX)) {
        Ok(())
    } else {
        Err(err(range.path, range.problem()))
    }
}

pub(super) fn config(raw: RawConfig) -> Result<Config, ConfigError> {
    let service = validate_service(raw.service)?;
    let client_id = validate_client_id(raw.client_id)?;
    let raw_rules = raw
        .rules
        .ok_or_else(|| err("rules", "missing: at least one rule is required"))?;
    if raw_rules.is_empty() {
        return Err(err("rules", "must contain at least one rule"));
    }
    within(&ranges::EXPECTED_REPLICAS, raw.local.expected_replicas)?;
    let default_share_ppm = (PPM / f64::from(raw.local.expected_replicas)).ceil() as u64;
    let mut rule_names = HashSet::new();
    let mut rules = Vec::with_capacity(raw_rules.len());
    for (i, raw_rule) in raw_rules.into_iter().enumerate() {
        let rule = validate_rule(i, raw_rule, default_share_ppm)?;
        if !rule_names.insert(rule.name.clone()) {
            return Err(err(
                format!("rules[{i}].name"),
                format!("duplicate rule name \"{}\"", rule.name),
            ));
        }
        rules.push(rule);
    }
    // Each limit's stats, in the order of the configuration.
    for (i, limit) in rules
        .iter_mut()
        .flat_map(|r| r.limits.iter_mut())
        .enumerate()
    {
        if let Some(limit) = std::rc::Rc::get_mut(limit) {
            limit.stats = crate::config::StatSlot(i);
        }
    }
    let response = validate_response(raw.response)?;
    within(&ranges::LOCAL_SLOTS, raw.local.slots)?;
    let breaker = validate_breaker(raw.breaker)?;
    within(&ranges::DENY_CACHE_SLOTS, raw.deny_cache.slots)?;
    Ok(Config {
        service,
        client_id,
        rules,
        failure_mode: raw.failure_mode,
        response,
        local: LocalConfig {
            slots: raw.local.slots,
        },
        breaker,
        deny_cache_slots: raw.deny_cache.slots,
        group_commit: validate_group_commit(raw.group_commit)?,
        leases: validate_leases(raw.leases, raw.local.expected_replicas)?,
        jwt: validate_jwt(raw.jwt)?,
        allow_on_headers_stop_iteration: raw.allow_on_headers_stop_iteration,
        decision_log: validate_decision_log(raw.decision_log)?,
    })
}

fn is_header_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Names become part of Redis keys and header values: keep them plain.
fn check_name(field: String, name: &str) -> Result<(), ConfigError> {
    if bounds::is_plain_name(name) {
        return Ok(());
    }
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(err(
            field,
            format!("must be 1 to {MAX_NAME_LEN} characters long"),
        ));
    }
    Err(err(
        field,
        format!("\"{name}\" may only contain letters, digits, '-', '_' and '.'"),
    ))
}
