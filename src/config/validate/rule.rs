//! A rule: its match, its limits (`by`, calendars) and its cost.

use super::*;

/// Longest `by` list: each attribute is a part of every key.
pub(super) const MAX_BY: usize = 8;

/// A limit's `by`: attribute names, each once.
pub(super) fn validate_by(
    field: &dyn Fn(&str) -> String,
    list: &[String],
) -> Result<Vec<Attribute>, ConfigError> {
    if list.len() > MAX_BY {
        return Err(err(field("by"), format!("at most {MAX_BY} attributes")));
    }
    let mut out = Vec::with_capacity(list.len());
    for (k, name) in list.iter().enumerate() {
        let at = || field(&format!("by[{k}]"));
        let named = |prefix: &str| name.strip_prefix(prefix).map(str::trim);
        let attribute = match name.as_str() {
            "client" => Attribute::Client,
            "host" => Attribute::Host,
            "path" => Attribute::Path,
            "method" => Attribute::Method,
            "peer_identity" => Attribute::PeerIdentity,
            _ => {
                if let Some(h) = named("header:") {
                    let h = h.to_ascii_lowercase();
                    if h.is_empty() || !h.bytes().all(is_header_name_byte) {
                        return Err(err(at(), format!("\"{name}\": not a valid header name")));
                    }
                    Attribute::Header(h)
                } else if let Some(q) = named("query:").filter(|q| !q.is_empty()) {
                    Attribute::Query(q.to_string())
                } else if let Some(c) = named("jwt:").filter(|c| !c.is_empty() && c.len() <= 256) {
                    Attribute::Jwt(c.to_string())
                } else if let Some(p) = named("json:") {
                    let plain = |s: &str| {
                        !s.is_empty()
                            && s.bytes()
                                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                    };
                    if p.len() > 256 || !p.split('.').all(plain) {
                        return Err(err(
                            at(),
                            format!("\"{name}\": a dotted path of letters, digits, '_' and '-' (json:model, json:metadata.team)"),
                        ));
                    }
                    Attribute::Json(p.to_string())
                } else {
                    return Err(err(
                        at(),
                        format!("unknown attribute \"{name}\": one of client, header:NAME, query:NAME, host, path, method, peer_identity, jwt:CLAIM, json:PATH"),
                    ));
                }
            }
        };
        if out.contains(&attribute) {
            return Err(err(at(), format!("\"{name}\" is listed twice")));
        }
        out.push(attribute);
    }
    Ok(out)
}

/// A limit's `calendar` and `utc_offset` (`+02:00`, `-05:30`, `Z`).
pub(super) fn validate_calendar(
    field: &dyn Fn(&str) -> String,
    l: &RawLimit,
) -> Result<Option<meshlimit_protocol::Calendar>, ConfigError> {
    let Some(unit) = l.calendar else {
        if l.utc_offset.is_some() {
            return Err(err(field("utc_offset"), "only a calendar limit has one"));
        }
        return Ok(None);
    };
    if l.algorithm != meshlimit_protocol::Algorithm::FixedWindow {
        return Err(err(
            field("calendar"),
            format!(
                "calendar windows are fixed windows, not {}",
                l.algorithm.as_str()
            ),
        ));
    }
    let minutes = match l.utc_offset.as_deref() {
        None | Some("Z") | Some("z") => 0,
        Some(text) => parse_utc_offset(text).ok_or_else(|| {
            err(
                field("utc_offset"),
                format!("\"{text}\": write +HH:MM or -HH:MM, from -14:00 to +14:00"),
            )
        })?,
    };
    Ok(Some(meshlimit_protocol::Calendar {
        unit,
        utc_offset_minutes: minutes,
    }))
}

/// `+02:00` as 120 minutes; `None` unless `±HH:MM` within ±14:00.
pub(super) fn parse_utc_offset(text: &str) -> Option<i32> {
    let (sign, rest) = match text.as_bytes().first()? {
        b'+' => (1, text.get(1..)?),
        b'-' => (-1, text.get(1..)?),
        _ => return None,
    };
    let (h, m) = rest.split_once(':')?;
    if h.len() != 2 || m.len() != 2 {
        return None;
    }
    let (h, m): (i32, i32) = (h.parse().ok()?, m.parse().ok()?);
    let minutes = sign * (h * 60 + m);
    (m < 60 && minutes.abs() <= meshlimit_protocol::calendar::MAX_OFFSET_MINUTES).then_some(minutes)
}

pub(super) fn validate_rule(
    i: usize,
    raw: RawRule,
    default_share_ppm: u64,
) -> Result<Rule, ConfigError> {
    check_name(format!("rules[{i}].name"), &raw.name)?;
    let share_ppm = fallback_share(i, &raw, default_share_ppm)?;
    let matcher = validate_match(i, raw.matcher)?;
    if raw.limits.is_empty() {
        return Err(err(
            format!("rules[{i}].limits"),
            "a rule needs at least one limit",
        ));
    }
    let mut limit_names = HashSet::new();
    let mut limits = Vec::with_capacity(raw.limits.len());
    for (j, l) in raw.limits.into_iter().enumerate() {
        if !limit_names.insert(l.name.clone()) {
            return Err(err(
                format!("rules[{i}].limits[{j}].name"),
                format!(
                    "duplicate limit name \"{}\" in rule \"{}\"",
                    l.name, raw.name
                ),
            ));
        }
        limits.push(Rc::new(validate_limit(i, j, &raw.name, l, share_ppm)?));
    }
    let cost = validate_cost(i, raw.cost)?;
    // A body field is read only where the body is: a rule whose cost
    // reserves from it.
    let reads_body = matches!(&cost, Cost::Tokens(t)
        if t.mode == TokenMode::Reserve && matches!(t.reserve, Reserve::RequestJson { .. }));
    for (j, limit) in limits.iter().enumerate() {
        let json = limit
            .by
            .iter()
            .position(|a| matches!(a, Attribute::Json(_)));
        if let (Some(k), false) = (json, reads_body) {
            return Err(err(
                format!("rules[{i}].limits[{j}].by[{k}]"),
                "a json: attribute needs the rule's cost to read the request body (cost.reserve.request_json, mode reserve)",
            ));
        }
    }
    if matches!(cost, Cost::Tokens(_)) && raw.scope == Scope::Local {
        return Err(err(
            format!("rules[{i}].scope"),
            "a token-priced rule must be global: its settlement is a call",
        ));
    }
    Ok(Rule {
        name: raw.name,
        matcher,
        limits,
        cost,
        shadow: raw.shadow,
        scope: raw.scope,
    })
}

/// The share of a global rule's limits this Envoy enforces while it falls
/// back (parts per million).
fn fallback_share(i: usize, raw: &RawRule, default_share_ppm: u64) -> Result<u64, ConfigError> {
    match raw.fallback_share {
        None => Ok(default_share_ppm),
        Some(_) if raw.scope == Scope::Local => Err(err(
            format!("rules[{i}].fallback_share"),
            "a local rule never falls back; fallback_share only applies to global rules",
        )),
        Some(share) if share > 0.0 && share <= 1.0 => Ok((share * PPM).round() as u64),
        Some(_) => Err(err(
            format!("rules[{i}].fallback_share"),
            "must be greater than 0 and at most 1",
        )),
    }
}

/// Limit `j` of rule `i` (named `rule`).
fn validate_limit(
    i: usize,
    j: usize,
    rule: &str,
    l: RawLimit,
    share_ppm: u64,
) -> Result<LimitConfig, ConfigError> {
    let field = |f: &str| format!("rules[{i}].limits[{j}].{f}");
    check_name(field("name"), &l.name)?;
    let calendar = validate_calendar(&field, &l)?;
    let window_ms = match (&l.window, calendar) {
        (Some(_), Some(_)) => {
            return Err(err(
                field("window"),
                "a calendar limit's window is its calendar unit; remove `window`",
            ))
        }
        (None, Some(c)) => c.unit.max_len_ms(),
        (Some(w), None) => {
            duration::parse_millis(w).map_err(|e| err(field("window"), e.to_string()))?
        }
        (None, None) => {
            return Err(err(
                field("window"),
                "missing: every limit needs a `window` (or a `calendar`)",
            ))
        }
    };
    let check_numbers = |requests: u64, at: &str| {
        bounds::check_limit(requests, window_ms, l.algorithm, l.burst).map_err(|e| {
            let name = match e.field {
                LimitField::Requests => at,
                LimitField::Window => "window",
                LimitField::Burst => "burst",
            };
            err(field(name), e.problem)
        })
    };
    check_numbers(l.requests, "requests")?;
    let by = match &l.by {
        None => vec![Attribute::Client],
        Some(list) => validate_by(&field, list)?,
    };
    let mut overrides = Vec::with_capacity(l.overrides.len());
    for (k, o) in l.overrides.iter().enumerate() {
        check_numbers(o.requests, &format!("overrides[{k}].requests"))?;
        if o.subjects.is_empty() || o.subjects.iter().any(String::is_empty) {
            return Err(err(
                field(&format!("overrides[{k}].subjects")),
                "list at least one subject, none empty",
            ));
        }
        overrides.push(StaticOverride {
            subjects: o.subjects.clone(),
            requests: o.requests,
        });
    }
    Ok(LimitConfig {
        qualified_name: format!("{rule}/{}", l.name),
        name: l.name,
        requests: l.requests,
        window_ms,
        algorithm: l.algorithm,
        burst: l.burst,
        by,
        missing: l.missing,
        overrides,
        calendar,
        share_ppm,
        // Numbered once every rule is read (`super::config`).
        stats: crate::config::StatSlot::default(),
    })
}

pub(super) fn validate_match(i: usize, raw: RawMatch) -> Result<Match, ConfigError> {
    let at = |f: &str| format!("rules[{i}].match.{f}");
    let slash = |field: String, p: String| {
        if p.starts_with('/') {
            Ok(p)
        } else {
            Err(err(field, "must start with '/'"))
        }
    };
    let path = match (raw.path_prefix, raw.path) {
        (Some(_), Some(_)) => {
            return Err(err(at("path"), "give either path_prefix or path, not both"));
        }
        (Some(prefix), None) => PathMatch::Prefix(slash(at("path_prefix"), prefix)?),
        (None, None) => PathMatch::Prefix("/".into()),
        (
            None,
            Some(RawPath {
                exact: Some(e),
                prefix: None,
            }),
        ) => PathMatch::Exact(slash(at("path.exact"), e)?),
        (
            None,
            Some(RawPath {
                exact: None,
                prefix: Some(p),
            }),
        ) => PathMatch::Prefix(slash(at("path.prefix"), p)?),
        (None, Some(_)) => {
            return Err(err(at("path"), "needs exactly one of exact or prefix"));
        }
    };
    let mut methods = Vec::with_capacity(raw.methods.len());
    for (j, m) in raw.methods.iter().enumerate() {
        let upper = m.trim().to_ascii_uppercase();
        if upper.is_empty() || !upper.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(err(
                at(&format!("methods[{j}]")),
                format!("\"{m}\" is not an HTTP method"),
            ));
        }
        methods.push(upper);
    }
    let mut hosts = Vec::with_capacity(raw.hosts.len());
    for (j, h) in raw.hosts.iter().enumerate() {
        let lower = h.trim().to_ascii_lowercase();
        let (pattern, name) = match lower.strip_prefix("*.") {
            Some(rest) => (
                HostPattern::Subdomains(format!(".{rest}")),
                rest.to_string(),
            ),
            None => (HostPattern::Exact(lower.clone()), lower.clone()),
        };
        let valid = !name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
        if !valid {
            return Err(err(
                at(&format!("hosts[{j}]")),
                format!("\"{h}\" is not a host name (or *.domain for its subdomains)"),
            ));
        }
        hosts.push(pattern);
    }
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (j, h) in raw.headers.into_iter().enumerate() {
        let name = h.name.trim().to_ascii_lowercase();
        if name.is_empty() || !name.bytes().all(is_header_name_byte) {
            return Err(err(
                at(&format!("headers[{j}].name")),
                format!("\"{}\" is not a valid header name", h.name),
            ));
        }
        let test = condition_test(&at(&format!("headers[{j}]")), h)?;
        headers.push(HeaderCondition { name, test });
    }
    let mut claims = Vec::with_capacity(raw.claims.len());
    for (j, c) in raw.claims.into_iter().enumerate() {
        let name = c.name.trim().to_string();
        if name.is_empty() || name.len() > 256 {
            return Err(err(
                at(&format!("claims[{j}].name")),
                "a claim name of 1 to 256 characters",
            ));
        }
        let test = condition_test(&at(&format!("claims[{j}]")), c)?;
        claims.push(HeaderCondition { name, test });
    }
    Ok(Match {
        hosts,
        path,
        methods,
        headers,
        claims,
    })
}

/// The one test of a header or claim condition at `at`.
pub(super) fn condition_test(at: &str, c: RawHeaderMatch) -> Result<HeaderTest, ConfigError> {
    Ok(match (c.exact, c.prefix, c.one_of, c.present, c.absent) {
        (Some(v), None, None, None, None) => HeaderTest::Exact(v),
        (None, Some(v), None, None, None) => HeaderTest::Prefix(v),
        (None, None, Some(vs), None, None) if !vs.is_empty() => HeaderTest::In(vs),
        (None, None, Some(_), None, None) => {
            return Err(err(format!("{at}.in"), "must list at least one value"));
        }
        (None, None, None, Some(true), None) => HeaderTest::Present,
        (None, None, None, None, Some(true)) => HeaderTest::Absent,
        (None, None, None, Some(false), None) | (None, None, None, None, Some(false)) => {
            return Err(err(
                at,
                "present and absent take true (use the other one for false)",
            ));
        }
        _ => {
            return Err(err(
                at,
                "needs exactly one of exact, prefix, in, present, absent",
            ));
        }
    })
}
