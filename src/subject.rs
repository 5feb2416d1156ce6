//! What a limit counts by: a request's attributes (the limit's `by`) made
//! into the subject of its counter.
//!
//! Each attribute value becomes a part tagged with its kind and name, the
//! same way client ids are (`hdr:x-tenant:acme`, `qry:tenant:acme`,
//! `host:api.example.com`, `path:/v1/search`, `method:GET`,
//! `peer:spiffe://cluster.local/ns/shop/sa/checkout`, `jwt:sub:alice`),
//! so a value can never pass for another kind's. A value that is not UTF-8
//! is hex under a prefix of its own (`hdrx:`), a long one a SHA-256
//! (`hdr#:`). Several parts are joined with `|`, each with `%` and `|`
//! escaped first, so the joined text splits back one way only: two
//! different tuples never share a counter. `by: []` is `*`, one counter
//! for every request the rule matches. A subject longer than
//! [`MAX_PLAIN_SUBJECT`] bytes becomes `by#:` + its SHA-256: bounded,
//! whatever the client sends.
//!
//! Trust: `peer_identity` comes from the TLS handshake and `jwt:` from a
//! payload `jwt_authn` verified; headers, query parameters and the host are
//! whatever the client typed, so a limit that must not be dodged counts by
//! the former.

use std::cell::OnceCell;

use crate::client_id::{self, Identity, MAX_PLAIN_SUBJECT};
use crate::config::{Attribute, Config, LimitConfig};
use crate::host::{HeaderValue, RequestView};

/// The subject of `by: []`.
pub const EVERYONE: &str = "*";

/// A limit's subject for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    /// As keys and overrides spell it.
    pub encoded: String,
    /// Where the bare value of a one-attribute `by` starts in `encoded`
    /// (no copy per request: only static overrides read it).
    bare_at: Option<usize>,
}

impl Subject {
    /// The bare value of a one-attribute `by` sent as text (`acme` for
    /// `hdr:x-tenant:acme`), which static overrides may name instead.
    pub fn plain(&self) -> Option<&str> {
        self.bare_at.and_then(|i| self.encoded.get(i..))
    }
}

/// Why a limit has no subject for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// The request lacks this attribute (absent, empty, or sent twice).
    Attribute(Attribute),
    /// No client id, and `client_id.when_missing` is `reject`.
    ClientId,
}

/// The request's attributes, each read at most once, and only when a
/// matched limit counts by it.
pub struct Facts<'r, R: RequestView> {
    config: &'r Config,
    req: &'r R,
    method: &'r str,
    /// `:path` as sent (query parameters are read from it).
    raw_path: &'r str,
    /// Normalised, without query.
    path: &'r str,
    client: OnceCell<Identity>,
    host: OnceCell<String>,
}

impl<'r, R: RequestView> Facts<'r, R> {
    pub fn new(
        config: &'r Config,
        req: &'r R,
        method: &'r str,
        raw_path: &'r str,
        path: &'r str,
    ) -> Self {
        Facts {
            config,
            req,
            method,
            raw_path,
            path,
            client: OnceCell::new(),
            host: OnceCell::new(),
        }
    }

    /// The client id, if the request has one (identified once).
    pub fn client(&self) -> &Identity {
        self.client
            .get_or_init(|| client_id::identify(&self.config.client_id, self.req, self.raw_path))
    }

    /// The client id, if a limit needed it (else it was never read).
    pub fn known_client(&self) -> Option<&Identity> {
        self.client.get()
    }

    /// The subject of `limit`'s counter for this request.
    pub fn subject_for(&self, limit: &LimitConfig) -> Result<Subject, Missing> {
        match limit.by.as_slice() {
            [] => Ok(Subject {
                encoded: EVERYONE.to_string(),
                bare_at: None,
            }),
            [one] => {
                let (encoded, bare_at) = self.part(one)?;
                Ok(Subject { encoded, bare_at })
            }
            many => {
                let mut joined = String::new();
                for (k, attribute) in many.iter().enumerate() {
                    if k > 0 {
                        joined.push('|');
                    }
                    let (part, _) = self.part(attribute)?;
                    for c in part.chars() {
                        match c {
                            '%' => joined.push_str("%25"),
                            '|' => joined.push_str("%7C"),
                            c => joined.push(c),
                        }
                    }
                }
                // A subject that waits for a body field is bounded once
                // the field is in (`with_body`).
                if joined.len() > MAX_PLAIN_SUBJECT && !awaits_body(&joined) {
                    joined = format!("by#:{}", client_id::sha256_hex(joined.as_bytes()));
                }
                Ok(Subject {
                    encoded: joined,
                    bare_at: None,
                })
            }
        }
    }

    /// One attribute as a tagged part, and where its bare value starts
    /// in it (when the value is spelled as it came, not hex or a digest).
    fn part(&self, attribute: &Attribute) -> Result<(String, Option<usize>), Missing> {
        let missing = || Missing::Attribute(attribute.clone());
        let tagged = |kind: &str, name: Option<&str>, value: &[u8]| {
            if value.is_empty() {
                return Err(missing());
            }
            let part = client_id::tagged(kind, name, value);
            let bare_at = part.len().checked_sub(value.len());
            let as_sent = bare_at.is_some_and(|i| part.as_bytes().get(i..) == Some(value));
            Ok((part, bare_at.filter(|_| as_sent)))
        };
        match attribute {
            Attribute::Client => match self.client() {
                Identity::Subject(s) => {
                    let bare_at = s.len().saturating_sub(client_id::bare_value(s).len());
                    Ok((s.clone(), Some(bare_at)))
                }
                Identity::Reject => Err(Missing::ClientId),
            },
            Attribute::Header(name) => match self.req.header(name) {
                HeaderValue::Once(v) => tagged("hdr", Some(name), &v),
                HeaderValue::Absent | HeaderValue::Repeated => Err(missing()),
            },
            Attribute::Query(name) => match client_id::query_param(self.raw_path, name) {
                Some(v) => tagged("qry", Some(name), &v),
                None => Err(missing()),
            },
            Attribute::Host => {
                let host = self
                    .host
                    .get_or_init(|| crate::rules::request_host(self.req));
                tagged("host", None, host.as_bytes())
            }
            Attribute::Path => tagged("path", None, self.path.as_bytes()),
            Attribute::Method => tagged("method", None, self.method.as_bytes()),
            Attribute::PeerIdentity => {
                match self
                    .req
                    .property(&["connection", "uri_san_peer_certificate"])
                {
                    Some(v) => tagged("peer", None, &v),
                    None => Err(missing()),
                }
            }
            // Read with the body: a placeholder until then.
            Attribute::Json(path) => Ok((body_placeholder(path), None)),
            Attribute::Jwt(claim) => {
                let jwt = &self.config.jwt;
                let path = [
                    "metadata",
                    "filter_metadata",
                    jwt.filter.as_str(),
                    jwt.payload_in_metadata.as_str(),
                    claim.as_str(),
                ];
                match self.req.property(&path) {
                    Some(v) => tagged("jwt", Some(claim), &v),
                    None => Err(missing()),
                }
            }
        }
    }
}

/// An attribute's name as configured (`header:x-tenant`), for logs and
/// deny bodies.
pub fn attribute_name(attribute: &Attribute) -> String {
    match attribute {
        Attribute::Client => "client".into(),
        Attribute::Header(n) => format!("header:{n}"),
        Attribute::Query(n) => format!("query:{n}"),
        Attribute::Host => "host".into(),
        Attribute::Path => "path".into(),
        Attribute::Method => "method".into(),
        Attribute::PeerIdentity => "peer_identity".into(),
        Attribute::Jwt(c) => format!("jwt:{c}"),
        Attribute::Json(p) => format!("json:{p}"),
    }
}

/// Where a body field's part goes in a subject until the body is read.
fn body_placeholder(path: &str) -> String {
    format!("\u{1}json:{path}\u{1}")
}

/// Whether a subject waits for body fields (see [`with_body`]).
pub fn awaits_body(subject: &str) -> bool {
    subject.contains('\u{1}')
}

/// `subject` of a limit counted `by`, with each body field's part put in
/// from the request's JSON `body` (`json:model:gpt-4o`: a string as it
/// is, a number or boolean as JSON writes it). `Err` names the first
/// field the body lacks (absent, null, an object or a list), as a missing
/// attribute. Bounded as [`Facts::subject_for`] bounds a subject.
pub fn with_body(
    subject: &str,
    by: &[Attribute],
    body: Option<&serde_json::Value>,
) -> Result<String, Missing> {
    let joined = by.len() > 1;
    let mut out = subject.to_string();
    for attribute in by {
        let Attribute::Json(path) = attribute else {
            continue;
        };
        let value = body
            .and_then(|b| path.split('.').try_fold(b, |v, key| v.get(key)))
            .and_then(|v| match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Number(n) => Some(n.to_string()),
                serde_json::Value::Bool(b) => Some(b.to_string()),
                _ => None,
            })
            .filter(|v| !v.is_empty())
            .ok_or_else(|| Missing::Attribute(attribute.clone()))?;
        let part = client_id::tagged("json", Some(path), value.as_bytes());
        let part = if joined {
            part.replace('%', "%25").replace('|', "%7C")
        } else {
            part
        };
        out = out.replace(&body_placeholder(path), &part);
    }
    if out.len() > MAX_PLAIN_SUBJECT {
        out = format!("by#:{}", client_id::sha256_hex(out.as_bytes()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeRequest;
    use std::collections::HashSet;

    fn config(by: &str) -> Config {
        crate::config::parse(
            format!(
                r#"{{"client_id":{{"headers":["x-api-key"]}},
                    "rules":[{{"name":"r","limits":[{{"name":"l","requests":5,"window":"1m","by":{by}}}]}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn subject(by: &str, req: &FakeRequest, path: &str) -> Result<Subject, Missing> {
        let cfg = config(by);
        let normalised = crate::rules::request_path(path).into_owned();
        let facts = Facts::new(&cfg, req, "GET", path, &normalised);
        facts.subject_for(&cfg.rules[0].limits[0])
    }

    fn encoded(by: &str, req: &FakeRequest, path: &str) -> String {
        subject(by, req, path).unwrap().encoded
    }

    #[test]
    fn each_kind_is_tagged() {
        let req = FakeRequest::default()
            .with_header("x-api-key", b"k1")
            .with_header("x-tenant", b"acme")
            .with_header(":authority", b"API.example.com:8443")
            .with_property(
                &["connection", "uri_san_peer_certificate"],
                b"spiffe://td/ns/a/sa/b",
            )
            .with_property(
                &[
                    "metadata",
                    "filter_metadata",
                    "envoy.filters.http.jwt_authn",
                    "jwt_payload",
                    "sub",
                ],
                b"alice",
            );
        let p = "/v1/./items?tenant=t9";
        assert_eq!(encoded(r#"["client"]"#, &req, p), "hdr:x-api-key:k1");
        assert_eq!(
            encoded(r#"["header:X-Tenant"]"#, &req, p),
            "hdr:x-tenant:acme"
        );
        assert_eq!(encoded(r#"["query:tenant"]"#, &req, p), "qry:tenant:t9");
        assert_eq!(encoded(r#"["host"]"#, &req, p), "host:api.example.com");
        assert_eq!(encoded(r#"["path"]"#, &req, p), "path:/v1/items");
        assert_eq!(encoded(r#"["method"]"#, &req, p), "method:GET");
        assert_eq!(
            encoded(r#"["peer_identity"]"#, &req, p),
            "peer:spiffe://td/ns/a/sa/b"
        );
        assert_eq!(encoded(r#"["jwt:sub"]"#, &req, p), "jwt:sub:alice");
        assert_eq!(encoded("[]", &req, p), "*");
        assert_eq!(
            encoded(r#"["header:x-tenant","path"]"#, &req, p),
            "hdr:x-tenant:acme|path:/v1/items"
        );
        let s = subject(r#"["header:x-tenant"]"#, &req, p).unwrap();
        assert_eq!(s.plain(), Some("acme"));
        let c = subject(r#"["client"]"#, &req, p).unwrap();
        assert_eq!(c.plain(), Some("k1"));
    }

    #[test]
    fn joined_parts_stay_apart() {
        // "a|path:/x" as one tenant must not read as tenant "a" + path.
        let tricky = FakeRequest::default().with_header("x-tenant", b"a|path:/x");
        let plain = FakeRequest::default().with_header("x-tenant", b"a");
        let by = r#"["header:x-tenant","path"]"#;
        let one = encoded(by, &tricky, "/y");
        let two = encoded(by, &plain, "/x");
        assert_ne!(one, two);
        assert_eq!(one, "hdr:x-tenant:a%7Cpath:/x|path:/y");
        let percent = FakeRequest::default().with_header("x-tenant", b"a%7Cpath:/x");
        assert_ne!(encoded(by, &percent, "/y"), one);
    }

    #[test]
    fn missing_attributes_are_named() {
        let req = FakeRequest::default()
            .with_header("x-tenant", b"a")
            .with_header("x-tenant", b"b")
            .with_header("x-empty", b"");
        for (by, attribute) in [
            (
                r#"["header:x-tenant"]"#,
                Attribute::Header("x-tenant".into()),
            ),
            (r#"["header:x-empty"]"#, Attribute::Header("x-empty".into())),
            (r#"["peer_identity"]"#, Attribute::PeerIdentity),
            (r#"["jwt:sub"]"#, Attribute::Jwt("sub".into())),
            (r#"["query:t"]"#, Attribute::Query("t".into())),
        ] {
            assert_eq!(
                subject(by, &req, "/?t=1&t=2"),
                Err(Missing::Attribute(attribute)),
                "{by}"
            );
        }
    }

    #[test]
    fn subjects_are_bounded() {
        let big = vec![b'v'; 10_000];
        let req = FakeRequest::default()
            .with_header("x-a", &big)
            .with_header("x-b", b"\xff\xfe");
        let one = encoded(r#"["header:x-a"]"#, &req, "/");
        assert!(one.starts_with("hdr#:x-a:") && one.len() <= MAX_PLAIN_SUBJECT);
        let two = encoded(r#"["header:x-a","path"]"#, &req, "/");
        assert!(two.len() <= MAX_PLAIN_SUBJECT, "{two}");
        assert_eq!(encoded(r#"["header:x-b"]"#, &req, "/"), "hdrx:x-b:fffe");
        // Two parts that fit alone, too long together.
        let long_path = format!("/{}", "p".repeat(200));
        let req = req.with_header("x-c", &[b'c'; 200]);
        let joined = encoded(r#"["header:x-c","path"]"#, &req, &long_path);
        assert!(
            joined.starts_with("by#:") && joined.len() == 4 + 64,
            "{joined}"
        );
    }

    #[test]
    fn distinct_tuples_get_distinct_subjects() {
        let values: [&[u8]; 6] = [b"a", b"a|", b"|a", b"a%7C", b"%", b"a|path:/"];
        let mut seen = HashSet::new();
        for v in values {
            for path in ["/", "/a", "/a|"] {
                let req = FakeRequest::default().with_header("x-t", v);
                assert!(seen.insert(encoded(r#"["header:x-t","path"]"#, &req, path)));
            }
        }
    }
}
