//! Fills `${NAME}` placeholders in the templates of `envoy/`. The tests,
//! the demo and the docker-compose files all come from the same templates,
//! so what is tested is what is shipped.

use std::collections::BTreeMap;

/// Replaces every `${KEY}`; panics on a placeholder left unfilled, so a
/// template and its callers cannot drift apart silently.
pub fn render(template: &str, vars: &BTreeMap<&str, String>) -> String {
    let mut out = template.to_string();
    for (k, v) in vars {
        out = out.replace(&format!("${{{k}}}"), v);
    }
    if let Some(pos) = out.find("${") {
        let rest = &out[pos..];
        let end = rest.find('}').map_or(rest.len(), |e| e + 1);
        panic!("template placeholder {} was not filled", &rest[..end]);
    }
    out
}

/// The plugin configuration as a YAML block scalar body, indented to sit
/// under `value: |` in `replica.yaml`.
pub fn indent_block(json: &str, spaces: usize) -> String {
    let pad = " ".repeat(spaces);
    json.trim()
        .lines()
        .enumerate()
        .map(|(i, l)| {
            if i == 0 {
                l.to_string()
            } else {
                format!("{pad}{l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Indentation of `${PLUGIN_CONFIG}` in `envoy/replica.yaml`.
pub const PLUGIN_CONFIG_INDENT: usize = 20;

pub fn template(name: &str) -> String {
    let path = crate::tools::root().join("envoy").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of replica.yaml that shape every request whatever the
    /// filters: the connection manager's settings (from its stat prefix to
    /// its route table) and the response headers the route adds.
    fn listener_settings(replica: &str) -> Vec<&str> {
        let lines: Vec<&str> = replica.lines().map(str::trim).collect();
        let start = lines
            .iter()
            .position(|l| *l == "stat_prefix: ingress")
            .unwrap();
        let end = lines.iter().position(|l| *l == "route_config:").unwrap();
        let added = lines
            .iter()
            .position(|l| *l == "response_headers_to_add:")
            .unwrap();
        let mut settings: Vec<&str> = lines[start..end].to_vec();
        settings.extend(&lines[added..added + 2]);
        settings.retain(|l| !l.starts_with('#'));
        settings
    }

    /// `make bench` compares filters: its baselines and the native
    /// ratelimit filter's Envoy must run the replica's listener, or the
    /// ratios measure the listeners too (they did: the baseline once
    /// lacked path normalisation and the replica's response header, which
    /// cost Envoy about 0.5 µs a request).
    #[test]
    fn compared_envoys_share_the_replica_listener() {
        let replica = template("replica.yaml");
        let settings = listener_settings(&replica);
        assert!(settings.contains(&"normalize_path: true"), "{settings:?}");
        for name in ["bench-baseline.yaml", "native-ratelimit.yaml"] {
            let other = template(name);
            let lines: Vec<&str> = other.lines().map(str::trim).collect();
            for setting in &settings {
                assert!(
                    lines.contains(setting),
                    "{name} lacks `{setting}` (replica.yaml has it)"
                );
            }
        }
    }

    #[test]
    fn fills_every_placeholder() {
        let vars = BTreeMap::from([("A", "1".to_string()), ("B", "two".to_string())]);
        assert_eq!(render("x ${A} y ${B} ${A}", &vars), "x 1 y two 1");
    }

    #[test]
    #[should_panic(expected = "${C}")]
    fn refuses_to_leave_a_placeholder() {
        render("${C}", &BTreeMap::new());
    }
}
