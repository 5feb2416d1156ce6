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
