//! What a request costs: a fixed number, a header, or tokens (reserved,
//! then settled from the response).

use super::*;
use crate::tokens::usage::{Provider, Term, UsageExpr};

/// The most a token cost may reserve per request (a bound on what one
/// request can hold of a budget).
pub(super) const MAX_RESERVE: u64 = MAX_COST;

pub(super) fn validate_cost(i: usize, raw: Option<serde_json::Value>) -> Result<Cost, ConfigError> {
    let at = |f: &str| {
        if f.is_empty() {
            format!("rules[{i}].cost")
        } else {
            format!("rules[{i}].cost.{f}")
        }
    };
    /// Reads one shape of the cost, naming the field a problem is in.
    fn read<T: serde::de::DeserializeOwned>(
        value: serde_json::Value,
        at: &dyn Fn(&str) -> String,
    ) -> Result<T, ConfigError> {
        serde_path_to_error::deserialize(value).map_err(|e| {
            let field = e.path().to_string();
            let field = if field == "." { String::new() } else { field };
            err(at(&field), e.into_inner().to_string())
        })
    }
    let Some(value) = raw else {
        return Ok(Cost::Fixed(1));
    };
    if !value.is_object() {
        let n = value.as_u64().ok_or_else(|| {
            err(
                at(""),
                "a whole number, {\"header\": ...} or {\"response\": ...}",
            )
        })?;
        return match n {
            0 => Err(err(at(""), "must be at least 1")),
            n if n > MAX_COST => Err(err(at(""), format!("must be at most {MAX_COST}"))),
            n => Ok(Cost::Fixed(n)),
        };
    }
    if value.get("response").is_some() {
        return validate_token_cost(read::<RawTokenCost>(value, &at)?, &at);
    }
    let h: RawCostHeader = read(value, &at)?;
    let name = h.header.trim().to_ascii_lowercase();
    if name.is_empty() || !name.bytes().all(is_header_name_byte) {
        return Err(err(
            at("header"),
            format!("\"{}\" is not a valid header name", h.header),
        ));
    }
    if h.max == 0 || h.max > MAX_COST {
        return Err(err(at("max"), format!("must be between 1 and {MAX_COST}")));
    }
    if h.default == 0 || h.default > h.max {
        return Err(err(at("default"), "must be between 1 and max"));
    }
    Ok(Cost::Header {
        name,
        default: h.default,
        max: h.max,
    })
}

pub(super) fn validate_token_cost(
    raw: RawTokenCost,
    at: &dyn Fn(&str) -> String,
) -> Result<Cost, ConfigError> {
    let usage = validate_usage(&raw.response, at)?;
    match (raw.mode, raw.reserve.is_some()) {
        // Reserving one unit and settling after is mode "after".
        (TokenMode::Reserve, false) => {
            return Err(err(
                at("reserve"),
                "mode \"reserve\" needs a reservation: a number, or {\"request_json\": ..., \"default\": ..., \"max\": ...}",
            ))
        }
        (TokenMode::After, true) => {
            return Err(err(
                at("reserve"),
                "mode \"after\" holds one unit per request and reserves nothing: remove reserve",
            ))
        }
        _ => {}
    }
    // OpenAI's chat completions report a stream's usage only when asked;
    // other providers' requests would be refused with the field added.
    let openai = raw.response.provider == Some(crate::tokens::usage::Provider::Openai);
    let reserve = validate_reserve(raw.reserve, openai, at)?;
    if !(1024..=16 << 20).contains(&raw.max_body_bytes) {
        return Err(err(
            at("max_body_bytes"),
            "must be between 1024 and 16777216",
        ));
    }
    Ok(Cost::Tokens(Rc::new(TokenCost {
        reserve,
        usage,
        mode: raw.mode,
        max_body_bytes: raw.max_body_bytes as usize,
        refund_on_error: raw.refund_on_error,
    })))
}

/// A dotted JSON path (`usage.total_tokens`), named `field` for errors.
fn json_path(
    at: &dyn Fn(&str) -> String,
    field: &str,
    p: &str,
) -> Result<Vec<String>, ConfigError> {
    let parts: Vec<String> = p.split('.').map(str::to_string).collect();
    if p.len() > 256 || parts.iter().any(String::is_empty) || parts.len() > 8 {
        return Err(err(
            at(field),
            format!("\"{p}\" is not a dotted JSON path (like usage.total_tokens)"),
        ));
    }
    Ok(parts)
}

/// Terms a usage may sum, at most.
const MAX_USAGE_TERMS: usize = 8;
/// The largest weight of a term.
const MAX_USAGE_WEIGHT: u64 = 1000;

/// A usage path, or a weighted sum of them.
fn usage_expr(
    at: &dyn Fn(&str) -> String,
    field: &str,
    raw: &RawUsagePaths,
) -> Result<UsageExpr, ConfigError> {
    let single = matches!(raw, RawUsagePaths::One(_));
    let raw_terms: Vec<(&str, u64)> = match raw {
        RawUsagePaths::One(p) => vec![(p.as_str(), 1)],
        RawUsagePaths::Sum(terms) => terms
            .iter()
            .map(|t| match t {
                RawTerm::Path(p) => (p.as_str(), 1),
                RawTerm::Weighted(w) => (w.path.as_str(), w.weight),
            })
            .collect(),
    };
    if raw_terms.is_empty() || raw_terms.len() > MAX_USAGE_TERMS {
        return Err(err(at(field), format!("1 to {MAX_USAGE_TERMS} paths")));
    }
    let mut terms = Vec::with_capacity(raw_terms.len());
    for (i, (path, weight)) in raw_terms.into_iter().enumerate() {
        let here = if single {
            field.to_string()
        } else {
            format!("{field}[{i}]")
        };
        if !(1..=MAX_USAGE_WEIGHT).contains(&weight) {
            return Err(err(
                at(&format!("{here}.weight")),
                format!("from 1 to {MAX_USAGE_WEIGHT}"),
            ));
        }
        terms.push(Term {
            path: json_path(at, &here, path)?,
            weight,
        });
    }
    Ok(UsageExpr { terms })
}

/// Where a response reports its usage: at least one place.
fn validate_usage(raw: &RawUsage, at: &dyn Fn(&str) -> String) -> Result<UsageSource, ConfigError> {
    let json = match &raw.json {
        Some(paths) => Some(usage_expr(at, "response.json", paths)?),
        None => raw.provider.map(Provider::json),
    };
    let sse_json = match &raw.sse_json {
        Some(paths) => Some(usage_expr(at, "response.sse_json", paths)?),
        None => raw.provider.map(Provider::sse),
    };
    let usage = UsageSource {
        json,
        sse_json,
        header: match &raw.header {
            None => None,
            Some(h) => {
                let name = h.trim().to_ascii_lowercase();
                if name.is_empty() || !name.bytes().all(is_header_name_byte) {
                    return Err(err(
                        at("response.header"),
                        format!("\"{h}\" is not a valid header name"),
                    ));
                }
                Some(name)
            }
        },
    };
    if usage.json.is_none() && usage.sse_json.is_none() && usage.header.is_none() {
        return Err(err(
            at("response"),
            "name where the usage is: provider, json, sse_json or header",
        ));
    }
    Ok(usage)
}

/// What a request reserves: a fixed number (1 when absent, mode `after`),
/// or a number read from its body within bounds.
fn validate_reserve(
    raw: Option<RawReserve>,
    openai: bool,
    at: &dyn Fn(&str) -> String,
) -> Result<Reserve, ConfigError> {
    Ok(match raw {
        None => Reserve::Fixed(1),
        Some(RawReserve::Fixed(n)) if (1..=MAX_RESERVE).contains(&n) => Reserve::Fixed(n),
        Some(RawReserve::Fixed(_)) => {
            return Err(err(
                at("reserve"),
                format!("must be between 1 and {MAX_RESERVE}"),
            ))
        }
        Some(RawReserve::Request(r)) => {
            if r.max == 0 || r.max > MAX_RESERVE {
                return Err(err(
                    at("reserve.max"),
                    format!("must be between 1 and {MAX_RESERVE}"),
                ));
            }
            if r.default == 0 || r.default > r.max {
                return Err(err(at("reserve.default"), "must be between 1 and max"));
            }
            if r.prompt_bytes_per_token > 64 {
                return Err(err(
                    at("reserve.prompt_bytes_per_token"),
                    "must be between 0 (the prompt is not reserved) and 64",
                ));
            }
            Reserve::RequestJson {
                path: json_path(at, "reserve.request_json", &r.request_json)?,
                default: r.default,
                max: r.max,
                prompt_bytes_per_token: r.prompt_bytes_per_token,
                ask_stream_usage: r.ask_stream_usage.unwrap_or(openai),
            }
        }
    })
}
