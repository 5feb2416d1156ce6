//! envoyproxy/ratelimit's configuration format: YAML files, each a
//! `domain` with nested `descriptors`, read into [`Domains`] that the gRPC
//! server matches requests against.
//!
//! ```yaml
//! domain: messaging
//! descriptors:
//!   - key: message_type
//!     value: marketing
//!     descriptors:
//!       - key: to_number          # no value: one counter per number
//!         rate_limit: { unit: day, requests_per_unit: 5 }
//!   - key: to_number
//!     rate_limit: { unit: day, requests_per_unit: 100, algorithm: sliding_window_counter }
//! ```
//!
//! A request's descriptor (a list of entries) matches the node reached by
//! following its entries level by level, the most specific node first at
//! each level: the exact value, then the longest `value` ending in `*` that
//! prefixes it, then the key without a value. Only a node at the
//! descriptor's own depth can limit it. `algorithm` is meshlimit's
//! extension (default `fixed_window`, as envoyproxy/ratelimit counts).
//! Every mistake is refused with the file and the path of the field.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use meshlimit_protocol::{bounds, Algorithm};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// A time unit of `rate_limit.unit`, any case as envoyproxy/ratelimit reads
/// it, with its lengths: a month is 30 days, a year 365, and windows are
/// aligned to multiples of their length since the epoch, as there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

/// The longest window of a rate limit here: a year and a day. (The wasm
/// filter's limits stop at 31 days, where a typo like `"60d"` is more
/// likely than a quota; envoyproxy/ratelimit's files have yearly ones.)
pub const MAX_WINDOW_MS: u64 = 366 * 86_400_000;

impl Unit {
    fn parse(name: &str) -> Result<Unit, String> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            other => {
                return Err(format!(
                    "unknown unit {other:?}: second, minute, hour, day, week, month or year"
                ))
            }
        })
    }

    pub fn millis(self) -> u64 {
        match self {
            Unit::Second => 1_000,
            Unit::Minute => 60_000,
            Unit::Hour => 3_600_000,
            Unit::Day => 86_400_000,
            Unit::Week => 7 * 86_400_000,
            Unit::Month => 30 * 86_400_000,
            Unit::Year => 365 * 86_400_000,
        }
    }

    /// The `RateLimitResponse.RateLimit.Unit` enum value (SECOND = 1 ...).
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    domain: String,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: String,
    value: Option<String>,
    rate_limit: Option<RawRateLimit>,
    #[serde(default)]
    shadow_mode: bool,
    /// Accepted for compatibility; meshlimitd's metrics are per domain.
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    unit: Option<String>,
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<RawReplace>,
    unit_multiplier: Option<u64>,
    algorithm: Option<Algorithm>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    name: String,
}

/// What a matched descriptor is limited by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RateLimit {
    /// Never limited, never counted (`unlimited: true`).
    Unlimited,
    /// Every request over (`requests_per_unit: 0`, a block list).
    Blocked {
        unit: Unit,
        multiplier: u64,
    },
    Limited(Limited),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limited {
    /// The counter's name in Redis keys: stable across reloads while the
    /// node's place (domain, keys, values) stays the same.
    pub id: String,
    /// Its stats' key as envoyproxy/ratelimit names it: the domain, then
    /// each level's `key` or `key_value`, joined by `.`.
    pub stat_key: std::sync::Arc<str>,
    pub requests: u64,
    pub unit: Unit,
    pub multiplier: u64,
    pub algorithm: Algorithm,
}

impl Limited {
    pub fn window_ms(&self) -> u64 {
        self.unit.millis() * self.multiplier
    }
}

/// A rate limit as a node carries it, with its `name` and `replaces`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLimit {
    pub limit: RateLimit,
    pub name: Option<String>,
    pub replaces: Vec<String>,
}

/// How a node's `value` matches an entry's value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ValueMatch {
    Exact(String),
    Prefix(String),
    Any,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    key: String,
    value: ValueMatch,
    limit: Option<NodeLimit>,
    shadow: bool,
    children: Vec<Node>,
}

/// What a request's descriptor matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched<'a> {
    pub limit: &'a NodeLimit,
    pub shadow: bool,
}

/// Every domain, from every file of a directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Domains {
    domains: HashMap<String, Vec<Node>>,
}

/// A file refused: which, where in it, why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {path}: {problem}")]
pub struct ConfigError {
    pub file: String,
    pub path: String,
    pub problem: String,
}

impl Domains {
    /// Reads every `*.yaml` / `*.yml` file of `dir` (through symlinks, so a
    /// swapped symlink is read anew). One bad file refuses them all: the
    /// caller keeps its last good configuration.
    pub fn load_dir(dir: &Path) -> Result<Domains, ConfigError> {
        let fail = |file: &str, problem: String| ConfigError {
            file: file.to_string(),
            path: ".".into(),
            problem,
        };
        let shown = dir.display().to_string();
        let entries = std::fs::read_dir(dir).map_err(|e| fail(&shown, e.to_string()))?;
        let mut files: BTreeMap<String, String> = BTreeMap::new();
        for entry in entries {
            let path = entry.map_err(|e| fail(&shown, e.to_string()))?.path();
            let is_yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
            let name = path.display().to_string();
            let hidden = path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'));
            if !is_yaml || hidden {
                continue;
            }
            let text = std::fs::read_to_string(&path).map_err(|e| fail(&name, e.to_string()))?;
            files.insert(name, text);
        }
        Domains::from_files(&files)
    }

    /// Reads files given as (name, text): each one domain.
    pub fn from_files(files: &BTreeMap<String, String>) -> Result<Domains, ConfigError> {
        let mut domains = HashMap::new();
        for (file, text) in files {
            let at = |path: &str, problem: String| ConfigError {
                file: file.clone(),
                path: if path.is_empty() {
                    ".".into()
                } else {
                    path.into()
                },
                problem,
            };
            let de = serde_norway::Deserializer::from_str(text);
            let raw: RawFile = serde_path_to_error::deserialize(de)
                .map_err(|e| at(&e.path().to_string(), e.into_inner().to_string()))?;
            if raw.domain.is_empty() {
                return Err(at("domain", "must not be empty".into()));
            }
            if domains.contains_key(&raw.domain) {
                return Err(at(
                    "domain",
                    format!("domain {:?} is defined by another file too", raw.domain),
                ));
            }
            let nodes = nodes(&raw.domain, &raw.descriptors, "descriptors", &[], &at)?;
            domains.insert(raw.domain, nodes);
        }
        Ok(Domains { domains })
    }

    /// The limit a descriptor's entries match in `domain`, if any.
    pub fn lookup<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched<'a>> {
        let mut level = self.domains.get(domain)?;
        let mut found = None;
        for (depth, (key, value)) in entries.iter().enumerate() {
            let node = best(level, key, value)?;
            if depth + 1 == entries.len() {
                found = node.limit.as_ref().map(|limit| Matched {
                    limit,
                    shadow: node.shadow,
                });
            }
            level = &node.children;
        }
        found
    }

    pub fn domain_count(&self) -> usize {
        self.domains.len()
    }
}

/// The most specific node of `level` for one entry.
fn best<'a>(level: &'a [Node], key: &str, value: &str) -> Option<&'a Node> {
    let mut prefix: Option<(&Node, usize)> = None;
    let mut any = None;
    for node in level.iter().filter(|n| n.key == key) {
        match &node.value {
            ValueMatch::Exact(v) if v == value => return Some(node),
            ValueMatch::Prefix(p)
                if value.starts_with(p.as_str()) && prefix.is_none_or(|(_, len)| p.len() > len) =>
            {
                prefix = Some((node, p.len()));
            }
            ValueMatch::Any => any = any.or(Some(node)),
            _ => {}
        }
    }
    prefix.map(|(n, _)| n).or(any)
}

type At<'a> = dyn Fn(&str, String) -> ConfigError + 'a;

fn nodes(
    domain: &str,
    raw: &[RawDescriptor],
    path: &str,
    parents: &[String],
    at: &At<'_>,
) -> Result<Vec<Node>, ConfigError> {
    let mut out: Vec<Node> = Vec::with_capacity(raw.len());
    for (i, d) in raw.iter().enumerate() {
        let here = format!("{path}[{i}]");
        if d.key.is_empty() {
            return Err(at(&format!("{here}.key"), "must not be empty".into()));
        }
        let value = match d.value.as_deref() {
            None | Some("") => ValueMatch::Any,
            Some(v) => match v.strip_suffix('*') {
                Some(prefix) => ValueMatch::Prefix(prefix.to_string()),
                None => ValueMatch::Exact(v.to_string()),
            },
        };
        if out.iter().any(|n| n.key == d.key && n.value == value) {
            return Err(at(
                &here,
                format!("a second descriptor for key {:?} with this value", d.key),
            ));
        }
        // The node's place: what names its counter.
        let mut place = parents.to_vec();
        place.push(match &d.value {
            Some(v) if !v.is_empty() => format!("{}={v}", d.key),
            _ => d.key.clone(),
        });
        let limit = match &d.rate_limit {
            None => None,
            Some(r) => Some(node_limit(
                domain,
                &place,
                r,
                &format!("{here}.rate_limit"),
                at,
            )?),
        };
        out.push(Node {
            key: d.key.clone(),
            value,
            limit,
            shadow: d.shadow_mode,
            children: nodes(
                domain,
                &d.descriptors,
                &format!("{here}.descriptors"),
                &place,
                at,
            )?,
        });
    }
    Ok(out)
}

fn node_limit(
    domain: &str,
    place: &[String],
    r: &RawRateLimit,
    path: &str,
    at: &At<'_>,
) -> Result<NodeLimit, ConfigError> {
    let field = |f: &str| format!("{path}.{f}");
    let replaces = r.replaces.iter().map(|x| x.name.clone()).collect();
    if r.unlimited {
        if r.unit.is_some() || r.requests_per_unit.is_some() {
            return Err(at(
                &field("unlimited"),
                "an unlimited rate_limit has no unit or requests_per_unit".into(),
            ));
        }
        return Ok(NodeLimit {
            limit: RateLimit::Unlimited,
            name: r.name.clone(),
            replaces,
        });
    }
    let unit = match &r.unit {
        Some(u) => Unit::parse(u).map_err(|e| at(&field("unit"), e))?,
        None => return Err(at(&field("unit"), "missing".into())),
    };
    let requests = r
        .requests_per_unit
        .ok_or_else(|| at(&field("requests_per_unit"), "missing".into()))?;
    let multiplier = r.unit_multiplier.unwrap_or(1);
    if multiplier == 0 {
        return Err(at(&field("unit_multiplier"), "must be at least 1".into()));
    }
    let limit = if requests == 0 {
        RateLimit::Blocked { unit, multiplier }
    } else {
        let algorithm = r.algorithm.unwrap_or(Algorithm::FixedWindow);
        let window_ms = unit.millis().saturating_mul(multiplier);
        if window_ms > MAX_WINDOW_MS {
            return Err(at(
                &field("unit_multiplier"),
                "the window (unit x unit_multiplier) must be at most 366 days".into(),
            ));
        }
        // The other numbers by the rules every limit follows.
        let checked_window = window_ms.min(bounds::MAX_WINDOW_MS);
        bounds::check_limit(requests, checked_window, algorithm, None).map_err(|e| {
            let name = match e.field {
                bounds::LimitField::Requests => "requests_per_unit",
                bounds::LimitField::Window => "unit_multiplier",
                bounds::LimitField::Burst => "algorithm",
            };
            at(&field(name), e.problem)
        })?;
        let mut hash = Sha256::new();
        hash.update(domain.as_bytes());
        for part in place {
            hash.update([0]);
            hash.update(part.as_bytes());
        }
        let digest = hash.finalize();
        let stat_key = std::iter::once(domain.to_string())
            .chain(place.iter().map(|p| p.replacen('=', "_", 1)))
            .collect::<Vec<_>>()
            .join(".");
        RateLimit::Limited(Limited {
            id: format!("rls.{}", hex::encode(digest.get(..8).unwrap_or_default())),
            stat_key: stat_key.into(),
            requests,
            unit,
            multiplier,
            algorithm,
        })
    };
    Ok(NodeLimit {
        limit,
        name: r.name.clone(),
        replaces,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domains(yaml: &str) -> Domains {
        let files = BTreeMap::from([("test.yaml".to_string(), yaml.to_string())]);
        Domains::from_files(&files).unwrap()
    }

    fn refused(yaml: &str) -> ConfigError {
        let files = BTreeMap::from([("bad.yaml".to_string(), yaml.to_string())]);
        Domains::from_files(&files).unwrap_err()
    }

    fn requests(d: &Domains, domain: &str, entries: &[(&str, &str)]) -> Option<u64> {
        match &d.lookup(domain, entries)?.limit.limit {
            RateLimit::Limited(l) => Some(l.requests),
            RateLimit::Blocked { .. } => Some(0),
            RateLimit::Unlimited => Some(u64::MAX),
        }
    }

    /// envoyproxy/ratelimit's README examples 2 to 4: nesting, keys
    /// without a value, the most specific match, matching at the
    /// descriptor's own depth only.
    #[test]
    fn descriptors_match_the_most_specific_node_at_their_depth() {
        let d = domains(
            r#"
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: { unit: day, requests_per_unit: 5 }
  - key: to_number
    rate_limit: { unit: day, requests_per_unit: 100 }
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 10 }
  - key: remote_address
    value: 50.0.0.5
    rate_limit: { unit: second, requests_per_unit: 0 }
  - key: path
    value: /api/*
    rate_limit: { unit: minute, requests_per_unit: 7 }
  - key: path
    value: /api/admin*
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: key
    value: value
    rate_limit: { unit: second, requests_per_unit: 300 }
"#,
        );
        let m = "messaging";
        assert_eq!(
            requests(
                &d,
                m,
                &[("message_type", "marketing"), ("to_number", "2061111111")]
            ),
            Some(5)
        );
        assert_eq!(requests(&d, m, &[("to_number", "2061111111")]), Some(100));
        assert_eq!(
            requests(&d, m, &[("message_type", "marketing")]),
            None,
            "a placeholder"
        );
        assert_eq!(
            requests(&d, m, &[("message_type", "other"), ("to_number", "1")]),
            None
        );
        assert_eq!(requests(&d, m, &[("remote_address", "50.0.0.1")]), Some(10));
        assert_eq!(
            requests(&d, m, &[("remote_address", "50.0.0.5")]),
            Some(0),
            "key and value first"
        );
        assert_eq!(requests(&d, m, &[("path", "/api/x")]), Some(7));
        assert_eq!(
            requests(&d, m, &[("path", "/api/admin/x")]),
            Some(1),
            "the longest prefix"
        );
        assert_eq!(requests(&d, m, &[("path", "/other")]), None);
        assert_eq!(
            requests(&d, m, &[("key", "value"), ("subkey", "v")]),
            None,
            "deeper than the config"
        );
        assert_eq!(requests(&d, "other-domain", &[("to_number", "1")]), None);
    }

    #[test]
    fn counters_are_named_by_their_place_and_survive_a_reload() {
        let yaml = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n  - key: b\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n";
        let id = |d: &Domains, key: &str| match &d.lookup("d", &[(key, "x")]).unwrap().limit.limit {
            RateLimit::Limited(l) => l.id.clone(),
            _ => panic!("limited"),
        };
        let (one, two) = (domains(yaml), domains(yaml));
        assert_eq!(id(&one, "a"), id(&two, "a"));
        assert_ne!(id(&one, "a"), id(&one, "b"));
        assert!(id(&one, "a").starts_with("rls.") && id(&one, "a").len() == 20);
    }

    #[test]
    fn units_multipliers_algorithms_unlimited_and_shadow_are_read() {
        let d = domains(
            r#"
domain: d
descriptors:
  - key: a
    rate_limit: { unit: MINUTE, requests_per_unit: 10, unit_multiplier: 5, algorithm: sliding_window_counter }
  - key: b
    shadow_mode: true
    rate_limit: { unit: week, requests_per_unit: 1 }
  - key: c
    rate_limit: { unlimited: true, name: everything }
  - key: y
    rate_limit: { unit: Year, requests_per_unit: 1000 }
"#,
        );
        let y = d.lookup("d", &[("y", "1")]).unwrap();
        let RateLimit::Limited(year) = &y.limit.limit else {
            panic!()
        };
        assert_eq!(year.window_ms(), 365 * 86_400_000);
        let a = d.lookup("d", &[("a", "1")]).unwrap();
        let RateLimit::Limited(l) = &a.limit.limit else {
            panic!()
        };
        assert_eq!(
            (l.window_ms(), l.algorithm),
            (300_000, Algorithm::SlidingWindowCounter)
        );
        assert!(d.lookup("d", &[("b", "1")]).unwrap().shadow);
        let c = d.lookup("d", &[("c", "1")]).unwrap();
        assert_eq!(c.limit.limit, RateLimit::Unlimited);
        assert_eq!(c.limit.name.as_deref(), Some("everything"));
    }

    #[test]
    fn every_mistake_names_its_file_and_field() {
        let cases = [
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: minute }\n", "descriptors[0].rate_limit.requests_per_unit", "missing"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: year, requests_per_unit: 1, unit_multiplier: 2 }\n", "descriptors[0].rate_limit.unit_multiplier", "366 days"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n", "descriptors[0].rate_limit.unit", "unknown unit"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limt: { unit: minute, requests_per_unit: 1 }\n", "descriptors[0].rate_limt", "unknown field"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: day, requests_per_unit: 1, unit_multiplier: 400 }\n", "descriptors[0].rate_limit.unit_multiplier", "366 days"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: day, requests_per_unit: 20000, algorithm: sliding_window_log }\n", "descriptors[0].rate_limit.requests_per_unit", "sliding_window_log"),
            ("domain: d\ndescriptors:\n  - key: a\n  - key: a\n", "descriptors[1]", "a second descriptor"),
            ("domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: ''\n", "descriptors[0].descriptors[0].key", "must not be empty"),
            ("domain: ''\n", "domain", "must not be empty"),
            ("descriptors: []\n", ".", "missing field `domain`"),
        ];
        for (yaml, path, problem) in cases {
            let e = refused(yaml);
            assert_eq!(e.file, "bad.yaml");
            assert_eq!(e.path, path, "{yaml}: {e}");
            assert!(e.problem.contains(problem), "{yaml}: {e}");
        }
    }
}
