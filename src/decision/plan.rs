//! The first phase: what a request needs, read from its headers and the
//! configuration alone (nothing, a rejection, or a [`Check`]), and the
//! reservation read from its body.

use std::rc::Rc;

use crate::check::{Applied, Check};
use crate::client_id::Identity;
use crate::config::{Config, Cost, MissingAttribute, Reserve, Rule, Scope, TokenCost, TokenMode};
use crate::headers;
use crate::host::{HeaderValue, RequestView};
use crate::reply::DenyResponse;
use crate::rules;
use crate::subject::{self, Facts, Missing};
use crate::tokens;

/// What a request needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// No rule matches, or every matching limit lacks an attribute it
    /// counts by (`skipped` of them): the filter stays out of the way.
    Pass { skipped: u32 },
    /// Refused before any check, for the reason given.
    Reject(DenyResponse, RejectReason),
    /// Decide these limits for this subject. Shared: a busy client's
    /// requests reuse one plan (`crate::plan_memo`) without copying it.
    Check(Rc<Check>),
}

/// Why a request was refused without a check (each has its own stat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// No client id and `when_missing: reject`.
    NoClientId,
    /// The cost header is not a whole number within bounds.
    InvalidCost,
    /// The request's cost exceeds a limit's capacity: it could never fit.
    CostAboveCapacity,
    /// A limit with `missing: reject` lacks an attribute it counts by.
    MissingAttribute,
}

pub fn plan(cfg: &Config, req: &impl RequestView, method: &str, path: &str) -> Plan {
    let normalised = rules::request_path(path);
    let matched = rules::matching_path(&cfg.rules, &cfg.jwt, req, method, &normalised);
    if matched.is_empty() {
        return Plan::Pass { skipped: 0 };
    }
    let facts = Facts::new(cfg, req, method, path, &normalised);
    let (mut local, mut global) = (Vec::new(), Vec::new());
    let mut skipped = 0;
    let mut tokens = None;
    for rule in matched {
        if let Cost::Tokens(t) = &rule.cost {
            tokens.get_or_insert_with(|| t.clone());
        }
        let cost = match request_cost(rule, req) {
            Ok(cost) => cost,
            Err(body) => return Plan::Reject(plain(400, body), RejectReason::InvalidCost),
        };
        for limit in &rule.limits {
            let subject = match facts.subject_for(limit) {
                Ok(subject) => subject,
                Err(Missing::ClientId) => {
                    return Plan::Reject(
                        plain(
                            cfg.client_id.reject_status,
                            missing_client_id(&cfg.client_id),
                        ),
                        RejectReason::NoClientId,
                    )
                }
                Err(Missing::Attribute(_)) if limit.missing == MissingAttribute::Skip => {
                    skipped += 1;
                    continue;
                }
                Err(Missing::Attribute(attribute)) => {
                    let body = format!(
                        "missing {} for limit {}\n",
                        subject::attribute_name(&attribute),
                        limit.qualified_name
                    );
                    return Plan::Reject(plain(403, body), RejectReason::MissingAttribute);
                }
            };
            let limit = match limit.override_for(&subject.encoded, subject.plain()) {
                Some(requests) => Rc::new(limit.with_requests(requests)),
                None => limit.clone(),
            };
            let applied = Applied {
                limit,
                cost,
                shadow: rule.shadow,
                subject: subject.encoded,
                tokens: matches!(rule.cost, Cost::Tokens(_)),
            };
            if let Some(deny) = above_capacity(cfg, &applied) {
                return Plan::Reject(deny, RejectReason::CostAboveCapacity);
            }
            match rule.scope {
                Scope::Local => local.push(applied),
                Scope::Global => global.push(applied),
            }
        }
    }
    let Some(first) = local.first().or(global.first()) else {
        // Every limit lacked an attribute it counts by.
        return Plan::Pass { skipped };
    };
    let subject = match facts.known_client() {
        Some(Identity::Subject(client)) => client.clone(),
        _ => first.subject.clone(),
    };
    Plan::Check(Rc::new(Check {
        subject,
        local,
        global,
        skipped,
        tokens,
        prompt: 0,
        usage_asked_for_client: false,
        lease: None,
        id: 0,
        place: Default::default(),
        hit_policy: Default::default(),
    }))
}

/// The deny for a request whose cost exceeds an enforced limit's
/// capacity: waiting would never help, so it says why instead of a retry
/// time.
fn above_capacity(cfg: &Config, a: &Applied) -> Option<DenyResponse> {
    let limit = &a.limit;
    if a.cost <= limit.capacity() || a.shadow {
        return None;
    }
    let mut deny = plain(
        cfg.response.status,
        format!(
            "request cost {} exceeds the capacity {} of limit {}\n",
            a.cost,
            limit.capacity(),
            limit.qualified_name
        ),
    );
    deny.headers.push((
        "retry-after",
        headers::retry_after_secs(limit.window_ms).to_string(),
    ));
    Some(deny)
}

/// Prices `check`'s token-priced limits from the request's body (the
/// client's `max_tokens`, bounded by the configuration), and completes
/// the subjects of limits counted by a body field (`json:model`); `body`
/// is `None` when the request has none, or more than `max_body_bytes` of
/// it. The limits skipped for lacking their field, or the deny when the
/// reservation can never fit or a limit with `missing: reject` lacks it.
pub fn reserve_from_body(
    cfg: &Config,
    check: &mut Check,
    body: Option<&[u8]>,
    body_size: usize,
) -> Result<u32, (DenyResponse, RejectReason)> {
    let value = body.and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok());
    let skipped = subjects_from_body(check, value.as_ref())?;
    let Some(TokenCost {
        reserve:
            Reserve::RequestJson {
                path,
                default,
                max,
                prompt_bytes_per_token,
                ..
            },
        ..
    }) = check.reserves_from_body()
    else {
        return Ok(skipped);
    };
    let completion = value
        .as_ref()
        .and_then(|v| tokens::json::number_at(v, path))
        .map_or(*default, |n| n.clamp(1, *max));
    // The prompt, from the body's size (read or not): a client cannot
    // make it smaller than what it sends.
    let prompt = match *prompt_bytes_per_token {
        0 => 0,
        per => (body_size as u64).div_ceil(per),
    };
    let units = completion
        .saturating_add(prompt)
        .min(meshlimit_protocol::bounds::MAX_COST);
    check.prompt = prompt.min(units);
    check.reserve(units);
    match check.token_limits().find_map(|a| above_capacity(cfg, a)) {
        Some(deny) => Err((deny, RejectReason::CostAboveCapacity)),
        None => Ok(skipped),
    }
}

/// Puts body fields in the subjects that wait for them (limits counted
/// `by` a `json:` attribute), as [`plan`] does with the other attributes:
/// a limit whose field the body lacks is skipped, or refused with
/// `missing: reject`; a static override for the completed subject
/// applies. The limits skipped.
fn subjects_from_body(
    check: &mut Check,
    body: Option<&serde_json::Value>,
) -> Result<u32, (DenyResponse, RejectReason)> {
    if !check
        .global
        .iter()
        .any(|a| subject::awaits_body(&a.subject))
    {
        return Ok(0);
    }
    let mut skipped = 0;
    let mut kept = Vec::with_capacity(check.global.len());
    for mut a in std::mem::take(&mut check.global) {
        if !subject::awaits_body(&a.subject) {
            kept.push(a);
            continue;
        }
        match subject::with_body(&a.subject, &a.limit.by, body) {
            Ok(subject) => {
                if let Some(requests) = a.limit.override_for(&subject, None) {
                    a.limit = Rc::new(a.limit.with_requests(requests));
                }
                a.subject = subject;
                kept.push(a);
            }
            Err(Missing::Attribute(_)) if a.limit.missing == MissingAttribute::Skip => {
                skipped += 1;
            }
            Err(missing) => {
                let name = match &missing {
                    Missing::Attribute(attribute) => subject::attribute_name(attribute),
                    Missing::ClientId => "client".into(),
                };
                let body = format!("missing {name} for limit {}\n", a.limit.qualified_name);
                return Err((plain(403, body), RejectReason::MissingAttribute));
            }
        }
    }
    check.global = kept;
    if subject::awaits_body(&check.subject) {
        if let Some(first) = check.global.first() {
            check.subject = first.subject.clone();
        }
    }
    check.skipped += skipped;
    Ok(skipped)
}

/// The body of a `when_missing: reject` deny: where to put the id.
fn missing_client_id(cfg: &crate::config::ClientIdConfig) -> String {
    let mut ways = Vec::new();
    if !cfg.headers.is_empty() {
        ways.push(format!("one of these headers: {}", cfg.headers.join(", ")));
    }
    if !cfg.query_params.is_empty() {
        ways.push(format!(
            "one of these query parameters (once): {}",
            cfg.query_params.join(", ")
        ));
    }
    format!("missing client id: send {}\n", ways.join(", or "))
}

fn plain(status: u32, body: String) -> DenyResponse {
    DenyResponse {
        status,
        headers: vec![("content-type", "text/plain".into())],
        body,
        grpc_status: crate::reply::grpc_status_of(status),
    }
}

/// The rule's cost for this request, or the reason the cost header is
/// unusable.
fn request_cost(rule: &Rule, req: &impl RequestView) -> Result<u64, String> {
    match &rule.cost {
        Cost::Fixed(n) => Ok(*n),
        Cost::Header { name, default, max } => {
            let invalid =
                || format!("invalid {name} header: must be a whole number from 1 to {max}\n");
            match req.header(name) {
                HeaderValue::Absent => Ok(*default),
                // Two costs: which one would the client want counted?
                HeaderValue::Repeated => Err(invalid()),
                HeaderValue::Once(raw) => std::str::from_utf8(&raw)
                    .ok()
                    .and_then(|t| t.trim().parse::<u64>().ok())
                    .filter(|n| (1..=*max).contains(n))
                    .ok_or_else(invalid),
            }
        }
        // What is reserved before the response says what was used.
        Cost::Tokens(t) => Ok(match (t.mode, &t.reserve) {
            (TokenMode::After, _) => 1,
            (TokenMode::Reserve, Reserve::Fixed(n)) => *n,
            (TokenMode::Reserve, Reserve::RequestJson { default, .. }) => *default,
        }),
    }
}
