//! Which rules apply to a request.

use crate::config::{HeaderCondition, HeaderTest, HostPattern, JwtSource, Match, PathMatch, Rule};
use crate::host::{HeaderValue, RequestView};

/// Rules whose every condition `req` meets (query string ignored, the path
/// [normalised](normalize), the host without its port), in config order. A
/// request may match several; every limit of each applies.
#[cfg(test)]
pub fn matching<'a>(
    rules: &'a [Rule],
    jwt: &JwtSource,
    req: &impl RequestView,
    method: &str,
    path: &str,
) -> Vec<&'a Rule> {
    matching_path(rules, jwt, req, method, &request_path(path))
}

/// The path rules match and limits count by: without query or fragment,
/// [normalised](normalize).
pub fn request_path(path: &str) -> std::borrow::Cow<'_, str> {
    normalize(path.split(['?', '#']).next().unwrap_or(path))
}

/// [`matching`] for a path already made a [`request_path`].
pub fn matching_path<'a>(
    rules: &'a [Rule],
    jwt: &JwtSource,
    req: &impl RequestView,
    method: &str,
    path: &str,
) -> Vec<&'a Rule> {
    let mut host: Option<String> = None;
    rules
        .iter()
        .filter(|r| path_matches(&r.matcher, path))
        .filter(|r| r.matcher.methods.is_empty() || r.matcher.methods.iter().any(|m| m == method))
        .filter(|r| {
            r.matcher.hosts.is_empty() || {
                let host = host.get_or_insert_with(|| request_host(req));
                r.matcher.hosts.iter().any(|p| host_matches(p, host))
            }
        })
        .filter(|r| headers_match(&r.matcher, req))
        .filter(|r| claims_match(&r.matcher, jwt, req))
        .collect()
}

fn path_matches(m: &Match, path: &str) -> bool {
    match &m.path {
        PathMatch::Prefix(p) => path.starts_with(p.as_str()),
        PathMatch::Exact(p) => path == p,
    }
}

/// `:authority`, lower-case, without port or trailing dot ("" if absent).
pub(crate) fn request_host(req: &impl RequestView) -> String {
    let raw = match req.header(":authority") {
        HeaderValue::Once(v) => String::from_utf8_lossy(&v).to_ascii_lowercase(),
        _ => return String::new(),
    };
    let host = match raw.strip_prefix('[') {
        // [v6]:port
        Some(rest) => rest.split(']').next().unwrap_or(rest).to_string(),
        None => raw
            .rsplit_once(':')
            .map_or(raw.as_str(), |(h, _)| h)
            .to_string(),
    };
    host.trim_end_matches('.').to_string()
}

fn host_matches(pattern: &HostPattern, host: &str) -> bool {
    match pattern {
        HostPattern::Exact(h) => host == h,
        HostPattern::Subdomains(suffix) => {
            host.len() > suffix.len() && host.ends_with(suffix.as_str())
        }
    }
}

/// Every header condition of `m`; a header sent twice, or empty, counts
/// as absent (see [`crate::config::HeaderCondition`]): what a limit's `by`
/// sees as missing, a rule's `match` sees as absent, so a rule that
/// requires a header never finds it missing.
fn headers_match(m: &Match, req: &impl RequestView) -> bool {
    m.headers.iter().all(|c| {
        let value = match req.header(&c.name) {
            HeaderValue::Once(v) if !v.is_empty() => Some(v),
            HeaderValue::Once(_) | HeaderValue::Absent | HeaderValue::Repeated => None,
        };
        holds(c, value)
    })
}

/// Every claim condition of `m`, on the payload `jwt_authn` verified (read
/// from the host only for rules that have claim conditions).
fn claims_match(m: &Match, jwt: &JwtSource, req: &impl RequestView) -> bool {
    m.claims.iter().all(|c| {
        let path = [
            "metadata",
            "filter_metadata",
            jwt.filter.as_str(),
            jwt.payload_in_metadata.as_str(),
            c.name.as_str(),
        ];
        holds(c, req.property(&path))
    })
}

fn holds(c: &HeaderCondition, value: Option<Vec<u8>>) -> bool {
    match (&c.test, value) {
        (HeaderTest::Absent, v) => v.is_none(),
        (HeaderTest::Present, v) => v.is_some(),
        (_, None) => false,
        (HeaderTest::Exact(want), Some(v)) => v == want.as_bytes(),
        (HeaderTest::Prefix(want), Some(v)) => v.starts_with(want.as_bytes()),
        (HeaderTest::In(wants), Some(v)) => wants.iter().any(|w| v == w.as_bytes()),
    }
}

/// The path as an upstream reads it, so that no spelling of it slips past
/// a rule: escapes of unreserved characters decoded (`%61` is `a`), empty
/// segments (`//`) and `.` segments dropped, `..` segments resolved, never
/// above the root (RFC 3986, 6.2.2). An escaped `/` (`%2F`) stays escaped,
/// as Envoy and most servers keep it. Paths that need none of this, the
/// usual case, are returned as they are.
pub fn normalize(path: &str) -> std::borrow::Cow<'_, str> {
    let plain = !path.contains("//") && !path.contains("/.") && !path.contains('%');
    if plain {
        return std::borrow::Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    // A trailing slash (or a trailing dot segment) names a directory.
    if out.is_empty()
        || decoded.ends_with('/')
        || decoded.ends_with("/.")
        || decoded.ends_with("/..")
    {
        out.push('/');
    }
    std::borrow::Cow::Owned(out)
}

/// `%XX` escapes of unreserved characters (letters, digits, `-._~`)
/// decoded; every other escape, and malformed ones, left as they are.
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = crate::percent::escaped_byte(bytes, i)
            .filter(|c| c.is_ascii_alphanumeric() || b"-._~".contains(c));
        match decoded {
            Some(c) => {
                out.push(char::from(c));
                i += 3;
            }
            None => {
                // Copy up to the next '%' whole (keeps UTF-8 intact).
                let next = bytes
                    .get(i + 1..)
                    .and_then(|rest| rest.iter().position(|&c| c == b'%'))
                    .map_or(bytes.len(), |p| i + 1 + p);
                out.push_str(path.get(i..next).unwrap_or_default());
                i = next;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HeaderCondition, HostPattern};
    use crate::host::fake::FakeRequest;

    fn rule(name: &str, prefix: &str, methods: &[&str]) -> Rule {
        Rule {
            name: name.into(),
            matcher: crate::config::Match {
                hosts: Vec::new(),
                path: PathMatch::Prefix(prefix.into()),
                methods: methods.iter().map(|m| m.to_string()).collect(),
                headers: Vec::new(),
                claims: Vec::new(),
            },
            limits: Vec::new(),
            cost: crate::config::Cost::Fixed(1),
            shadow: false,
            scope: crate::config::Scope::Global,
        }
    }

    fn jwt() -> JwtSource {
        JwtSource {
            filter: "envoy.filters.http.jwt_authn".into(),
            payload_in_metadata: "payload".into(),
        }
    }

    /// Plans chosen by a claim of the verified token: absent without a
    /// token (or without the claim), and never read from a header.
    #[test]
    fn claim_conditions_read_the_verified_payload() {
        let plan = |name: &str, test: HeaderTest| {
            let mut r = rule(name, "/", &[]);
            r.matcher.claims = vec![HeaderCondition {
                name: "plan".into(),
                test,
            }];
            r
        };
        let rules = vec![
            plan("pro", HeaderTest::Exact("pro".into())),
            plan("none", HeaderTest::Absent),
        ];
        let claim = [
            "metadata",
            "filter_metadata",
            "envoy.filters.http.jwt_authn",
            "payload",
            "plan",
        ];
        let pro = FakeRequest::default().with_property(&claim, b"pro");
        assert_eq!(names(&matching(&rules, &jwt(), &pro, "GET", "/")), ["pro"]);
        let forged = FakeRequest::default().with_header("plan", b"pro");
        assert_eq!(
            names(&matching(&rules, &jwt(), &forged, "GET", "/")),
            ["none"]
        );
    }

    /// The names of the rules a request without headers matches.
    fn matched(rules: &[Rule], method: &str, path: &str) -> Vec<String> {
        names(&matching(
            rules,
            &jwt(),
            &FakeRequest::default(),
            method,
            path,
        ))
    }

    fn names(rules: &[&Rule]) -> Vec<String> {
        rules.iter().map(|r| r.name.clone()).collect()
    }

    #[test]
    fn prefix_and_method_both_must_match() {
        let rules = vec![
            rule("api", "/api/", &["GET", "POST"]),
            rule("all", "/", &[]),
            rule("admin", "/admin", &["DELETE"]),
        ];
        assert_eq!(matched(&rules, "GET", "/api/x"), ["api", "all"]);
        assert_eq!(matched(&rules, "PUT", "/api/x"), ["all"]);
        assert_eq!(matched(&rules, "GET", "/admin"), ["all"]);
        assert_eq!(matched(&rules, "DELETE", "/admin/1"), ["all", "admin"]);
    }

    /// A rule on `/api/` must not be bypassed by a path the upstream reads
    /// as the same one (where the proxy does not normalise paths itself).
    #[test]
    fn paths_are_matched_as_the_upstream_reads_them() {
        let rules = vec![rule("api", "/api/", &[])];
        for path in [
            "//api/x",
            "/api//x",
            "/./api/x",
            "/x/../api/x",
            "/%61pi/x",
            "/%2e/api/x",
            "/api/./x?q=1",
        ] {
            assert_eq!(matched(&rules, "GET", path), ["api"], "{path}");
        }
        for path in ["/apix", "/ap%69", "/../", "/%2Fapi/x"] {
            assert!(
                matching(&rules, &jwt(), &FakeRequest::default(), "GET", path).is_empty(),
                "{path}"
            );
        }
        assert_eq!(normalize("/a/b/../../../c"), "/c", "never above the root");
        assert_eq!(normalize("/api/%7Euser"), "/api/~user");
        assert_eq!(normalize("/plain/path"), "/plain/path");
    }

    #[test]
    fn query_string_does_not_change_the_match() {
        let rules = vec![rule("exact", "/api/v1", &[])];
        assert_eq!(matched(&rules, "GET", "/api/v1?x=/other"), ["exact"]);
        assert!(matching(
            &rules,
            &jwt(),
            &FakeRequest::default(),
            "GET",
            "/?p=/api/v1"
        )
        .is_empty());
    }

    fn with(rule_: Rule, f: impl FnOnce(&mut Match)) -> Rule {
        let mut r = rule_;
        f(&mut r.matcher);
        r
    }

    #[test]
    fn hosts_exact_and_subdomains() {
        let rules = vec![
            with(rule("exact", "/", &[]), |m| {
                m.hosts = vec![HostPattern::Exact("api.example.com".into())]
            }),
            with(rule("subs", "/", &[]), |m| {
                m.hosts = vec![HostPattern::Subdomains(".example.com".into())]
            }),
        ];
        let at = |host: &[u8]| {
            let req = FakeRequest::default().with_header(":authority", host);
            names(&matching(&rules, &jwt(), &req, "GET", "/"))
        };
        assert_eq!(at(b"api.example.com"), ["exact", "subs"]);
        assert_eq!(at(b"API.Example.com:8443"), ["exact", "subs"]);
        assert_eq!(at(b"www.example.com"), ["subs"]);
        assert!(at(b"example.com").is_empty(), "not the domain itself");
        assert!(at(b"evil-example.com").is_empty());
        assert!(matched(&rules, "GET", "/").is_empty());
    }

    #[test]
    fn exact_paths_match_only_themselves() {
        let rules = vec![with(rule("login", "/", &[]), |m| {
            m.path = PathMatch::Exact("/login".into())
        })];
        let at = |p: &str| matched(&rules, "POST", p);
        assert_eq!(at("/login"), ["login"]);
        assert_eq!(at("/login?next=/"), ["login"]);
        assert_eq!(at("//login"), ["login"], "normalised first");
        assert!(at("/login/x").is_empty() && at("/logins").is_empty());
    }

    #[test]
    fn header_conditions_and_repeats() {
        let cond = |name: &str, test: HeaderTest| HeaderCondition {
            name: name.into(),
            test,
        };
        let rules = vec![
            with(rule("free", "/", &[]), |m| {
                m.headers = vec![cond("x-plan", HeaderTest::Exact("free".into()))]
            }),
            with(rule("paid", "/", &[]), |m| {
                m.headers = vec![cond(
                    "x-plan",
                    HeaderTest::In(vec!["pro".into(), "team".into()]),
                )]
            }),
            with(rule("none", "/", &[]), |m| {
                m.headers = vec![cond("x-plan", HeaderTest::Absent)]
            }),
            with(rule("beta", "/", &[]), |m| {
                m.headers = vec![
                    cond("x-beta", HeaderTest::Present),
                    cond("user-agent", HeaderTest::Prefix("curl/".into())),
                ]
            }),
        ];
        let plan = |values: &[&[u8]]| {
            let mut req = FakeRequest::default();
            for v in values {
                req = req.with_header("x-plan", v);
            }
            names(&matching(&rules, &jwt(), &req, "GET", "/"))
        };
        assert_eq!(plan(&[b"free"]), ["free"]);
        assert_eq!(plan(&[b"team"]), ["paid"]);
        assert_eq!(plan(&[]), ["none"]);
        assert!(plan(&[b"gold"]).is_empty());
        // Both plans at once: ambiguous, counted as no plan.
        assert_eq!(plan(&[b"free", b"pro"]), ["none"]);
        let beta = |value: &[u8]| {
            let req = FakeRequest::default()
                .with_header("x-beta", value)
                .with_header("user-agent", b"curl/8.0")
                .with_header("x-plan", b"free");
            names(&matching(&rules, &jwt(), &req, "GET", "/"))
        };
        assert_eq!(beta(b"1"), ["free", "beta"]);
        // Empty is absent, as a limit's `by` sees it.
        assert_eq!(beta(b""), ["free"]);
    }
}
