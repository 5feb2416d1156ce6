//! The configuration's sections other than rules: the service, the
//! client id, JWT claims, leases, group commit, the breaker, responses.

use super::*;

pub(super) fn validate_jwt(raw: RawJwt) -> Result<JwtSource, ConfigError> {
    for (f, v) in [
        ("jwt.filter", &raw.filter),
        ("jwt.payload_in_metadata", &raw.payload_in_metadata),
    ] {
        if v.is_empty() || v.len() > 256 {
            return Err(err(f, "must be 1 to 256 characters"));
        }
    }
    Ok(JwtSource {
        filter: raw.filter,
        payload_in_metadata: raw.payload_in_metadata,
    })
}

/// Quota leases: `None` when off. A lease takes at most half of what is
/// left divided by `local.expected_replicas`, so every replica can still
/// get its share and the last units are decided one by one.
pub(super) fn validate_leases(
    raw: RawLeases,
    expected_replicas: u32,
) -> Result<Option<LeaseConfig>, ConfigError> {
    within(&ranges::LEASE_MAX_UNITS, raw.max_units)?;
    let interval_ms =
        duration::parse_millis(&raw.interval).map_err(|e| err("leases.interval", e.to_string()))?;
    if !(100..=60_000).contains(&interval_ms) {
        return Err(err("leases.interval", "must be between 100ms and 60s"));
    }
    within(&ranges::LEASE_SLOTS, raw.slots)?;
    Ok(raw.enabled.then_some(LeaseConfig {
        slots: raw.slots,
        max_units: raw.max_units,
        interval_ms,
        share: 2 * u64::from(expected_replicas),
    }))
}

pub(super) fn validate_group_commit(
    raw: RawGroupCommit,
) -> Result<Option<crate::batch::BatchConfig>, ConfigError> {
    within(&ranges::MAX_BATCH, raw.max_batch)?;
    within(&ranges::MAX_QUEUED, raw.max_queued)?;
    within(&ranges::MAX_CALLS_IN_FLIGHT, raw.max_calls_in_flight)?;
    let max_age_ms = duration::parse_millis(&raw.max_queue_age)
        .map_err(|e| err("group_commit.max_queue_age", e.to_string()))?;
    if max_age_ms > 1_000 {
        return Err(err("group_commit.max_queue_age", "must be at most 1s"));
    }
    Ok(raw.enabled.then_some(crate::batch::BatchConfig {
        max_batch: raw.max_batch,
        max_age_ms,
        max_queued: raw.max_queued,
        max_in_flight: raw.max_calls_in_flight,
    }))
}

pub(super) fn validate_decision_log(
    raw: RawDecisionLog,
) -> Result<Option<DecisionLogConfig>, ConfigError> {
    if !(0.0..=1.0).contains(&raw.sample) {
        return Err(err(
            "decision_log.sample",
            "must be between 0 (off) and 1 (every decision)",
        ));
    }
    // Rounded up: a small share is never 0, which would mean off.
    let sample_ppm = (raw.sample * 1e6).ceil() as u32;
    Ok((sample_ppm > 0).then_some(DecisionLogConfig {
        sample_ppm,
        denied_only: raw.denied_only,
        level: raw.level,
    }))
}

pub(super) fn validate_breaker(raw: RawBreaker) -> Result<BreakerConfig, ConfigError> {
    within(&ranges::BREAKER_FAILURES, raw.failures)?;
    let open_ms =
        duration::parse_millis(&raw.open).map_err(|e| err("breaker.open", e.to_string()))?;
    let max_open_ms = duration::parse_millis(&raw.max_open)
        .map_err(|e| err("breaker.max_open", e.to_string()))?;
    if open_ms == 0 || open_ms > 600_000 {
        return Err(err("breaker.open", "must be between 1ms and 10m"));
    }
    if max_open_ms < open_ms || max_open_ms > 600_000 {
        return Err(err(
            "breaker.max_open",
            "must be at least breaker.open and at most 10m",
        ));
    }
    Ok(BreakerConfig {
        failures: raw.failures,
        open_ms,
        max_open_ms,
    })
}

pub(super) fn validate_service(raw: RawService) -> Result<ServiceConfig, ConfigError> {
    if raw.cluster.trim().is_empty() {
        return Err(err("service.cluster", "must not be empty"));
    }
    if raw.authority.trim().is_empty() {
        return Err(err("service.authority", "must not be empty"));
    }
    let timeout_ms =
        duration::parse_millis(&raw.timeout).map_err(|e| err("service.timeout", e.to_string()))?;
    if timeout_ms == 0 || timeout_ms > MAX_TIMEOUT_MS {
        return Err(err(
            "service.timeout",
            format!("must be between 1ms and {}s", MAX_TIMEOUT_MS / 1000),
        ));
    }
    let authorization = match raw.auth_token {
        None => None,
        Some(token)
            if (16..=256).contains(&token.len()) && token.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Some(format!("Bearer {token}"))
        }
        Some(_) => {
            return Err(err(
                "service.auth_token",
                "must be 16 to 256 visible ASCII characters (the secret in meshlimitd's --auth-token-file)",
            ));
        }
    };
    Ok(ServiceConfig {
        cluster: raw.cluster,
        authority: raw.authority,
        timeout_ms,
        authorization,
    })
}

pub(super) fn validate_client_id(raw: RawClientId) -> Result<ClientIdConfig, ConfigError> {
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (i, h) in raw.headers.iter().enumerate() {
        let lower = h.trim().to_ascii_lowercase();
        if lower.is_empty() || !lower.bytes().all(is_header_name_byte) {
            return Err(err(
                format!("client_id.headers[{i}]"),
                format!("\"{h}\" is not a valid header name"),
            ));
        }
        headers.push(lower);
    }
    for (i, name) in raw.query_params.iter().enumerate() {
        // Names are compared after decoding, so most text will do; not
        // what could never appear as a name, nor the ':' that ends the name
        // in a subject (`qry:<name>:<value>` must stay one-to-one).
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains(['&', '=', '#', ':']) {
            return Err(err(
                format!("client_id.query_params[{i}]"),
                format!(
                    "\"{name}\" is not a usable parameter name (1 to {MAX_NAME_LEN} characters, none of '&', '=', '#', ':')"
                ),
            ));
        }
    }
    within(&ranges::REJECT_STATUS, raw.reject_status)?;
    within(&ranges::TRUSTED_HOPS, raw.trusted_hops)?;
    within(&ranges::IPV6_PREFIX, raw.ipv6_prefix)?;
    Ok(ClientIdConfig {
        headers,
        query_params: raw.query_params,
        when_missing: raw.when_missing,
        trusted_hops: raw.trusted_hops,
        ipv6_prefix: raw.ipv6_prefix,
        reject_status: raw.reject_status,
    })
}

pub(super) fn validate_response(raw: RawResponse) -> Result<ResponseConfig, ConfigError> {
    within(&ranges::RESPONSE_STATUS, raw.status)?;
    if raw.body.len() > 64 * 1024 {
        return Err(err("response.body", "must be at most 64 KiB"));
    }
    within(&ranges::GRPC_STATUS, raw.grpc_status)?;
    Ok(ResponseConfig {
        status: raw.status,
        body: raw.body,
        headers: raw.headers,
        grpc_status: raw.grpc_status,
    })
}
