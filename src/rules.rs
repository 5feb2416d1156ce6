//! Which rules apply to a request.

use crate::config::Rule;

/// Rules matching `method` and `path` (query string ignored, the path
/// [normalised](normalize)), in config order. A request may match several;
/// every limit of each applies.
pub fn matching<'a>(rules: &'a [Rule], method: &str, path: &str) -> Vec<&'a Rule> {
    let path = path.split(['?', '#']).next().unwrap_or(path);
    let path = normalize(path);
    rules
        .iter()
        .filter(|r| path.starts_with(r.path_prefix.as_str()))
        .filter(|r| r.methods.is_empty() || r.methods.iter().any(|m| m == method))
        .collect()
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

    fn rule(name: &str, prefix: &str, methods: &[&str]) -> Rule {
        Rule {
            name: name.into(),
            path_prefix: prefix.into(),
            methods: methods.iter().map(|m| m.to_string()).collect(),
            limits: Vec::new(),
            cost: crate::config::Cost::Fixed(1),
            shadow: false,
            scope: crate::config::Scope::Global,
        }
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
        assert_eq!(names(&matching(&rules, "GET", "/api/x")), ["api", "all"]);
        assert_eq!(names(&matching(&rules, "PUT", "/api/x")), ["all"]);
        assert_eq!(names(&matching(&rules, "GET", "/admin")), ["all"]);
        assert_eq!(
            names(&matching(&rules, "DELETE", "/admin/1")),
            ["all", "admin"]
        );
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
            assert_eq!(names(&matching(&rules, "GET", path)), ["api"], "{path}");
        }
        for path in ["/apix", "/ap%69", "/../", "/%2Fapi/x"] {
            assert!(matching(&rules, "GET", path).is_empty(), "{path}");
        }
        assert_eq!(normalize("/a/b/../../../c"), "/c", "never above the root");
        assert_eq!(normalize("/api/%7Euser"), "/api/~user");
        assert_eq!(normalize("/plain/path"), "/plain/path");
    }

    #[test]
    fn query_string_does_not_change_the_match() {
        let rules = vec![rule("exact", "/api/v1", &[])];
        assert_eq!(
            names(&matching(&rules, "GET", "/api/v1?x=/other")),
            ["exact"]
        );
        assert!(matching(&rules, "GET", "/?p=/api/v1").is_empty());
    }
}
