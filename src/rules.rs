//! Which rules apply to a request.

use crate::config::Rule;

/// Rules matching `method` and `path` (query string ignored), in config
/// order. A request may match several; every limit of each applies.
pub fn matching<'a>(rules: &'a [Rule], method: &str, path: &str) -> Vec<&'a Rule> {
    let path = path.split(['?', '#']).next().unwrap_or(path);
    rules
        .iter()
        .filter(|r| path.starts_with(r.path_prefix.as_str()))
        .filter(|r| r.methods.is_empty() || r.methods.iter().any(|m| m == method))
        .collect()
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
