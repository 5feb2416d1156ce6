//! `meshlimitd validate`: checks configuration before anything loads it,
//! with the parsers and the messages of the parts that will:
//!
//! - `plugin-config FILE`: the filter's plugin configuration, by the
//!   filter's own parser (the `meshlimit` crate, compiled natively): JSON
//!   as Envoy's `configuration` carries it, or YAML, or an Istio
//!   `WasmPlugin` manifest (its `spec.pluginConfig`). The message of a
//!   refused configuration is the line the filter logs when Envoy hands it
//!   the same one.
//! - `rls-config DIR`: a directory of envoyproxy/ratelimit-style YAML
//!   files, as `--rls-config-dir` loads them (the message is the one
//!   meshlimitd refuses to start with).
//!
//! Each returns the line to print: a summary when the configuration is
//! accepted, the reason when it is not.

use std::path::Path;

use serde_json::Value;

/// Checks a plugin configuration file.
pub fn plugin_config(file: &Path) -> Result<String, String> {
    let shown = file.display();
    let text = std::fs::read_to_string(file).map_err(|e| format!("{shown}: cannot read: {e}"))?;
    let json = plugin_config_json(file, &text).map_err(|e| format!("{shown}: {e}"))?;
    match meshlimit::config::parse(json.as_bytes()) {
        Ok(config) => Ok(format!(
            "{shown}: ok: {} rule(s), service cluster \"{}\"",
            config.rules.len(),
            config.service.cluster
        )),
        Err(e) => Err(format!("{shown}: {e}")),
    }
}

/// The JSON the filter would be given: the file itself when it is JSON,
/// else the YAML's, or the `spec.pluginConfig` of the one WasmPlugin among
/// its documents (a RequestAuthentication may sit beside it).
fn plugin_config_json(file: &Path, text: &str) -> Result<String, String> {
    let yaml = file.extension().is_some_and(|e| e == "yaml" || e == "yml");
    if !yaml {
        return Ok(text.to_string());
    }
    use serde::Deserialize;
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).map_err(|e| format!("not YAML: {e}"))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    let is_plugin = |v: &Value| v.get("kind").and_then(Value::as_str) == Some("WasmPlugin");
    let plugins: Vec<&Value> = docs.iter().filter(|v| is_plugin(v)).collect();
    let config = match (plugins.as_slice(), docs.as_slice()) {
        ([plugin], _) => plugin
            .pointer("/spec/pluginConfig")
            .cloned()
            .ok_or("a WasmPlugin without spec.pluginConfig")?,
        ([], [only]) => only.clone(),
        ([], _) => return Err("several YAML documents, none a WasmPlugin".into()),
        (_, _) => return Err(format!("{} WasmPlugins: give one per file", plugins.len())),
    };
    serde_json::to_string(&config).map_err(|e| e.to_string())
}

/// Checks a rate limit service configuration directory.
pub fn rls_config(dir: &Path) -> Result<String, String> {
    let domains = crate::rls::config::Domains::load_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(format!(
        "{}: ok: {} domain(s)",
        dir.display(),
        domains.domain_count()
    ))
}

/// `meshlimitd probe`: whether the meshlimitd listening on `addr` is ready
/// (`GET /readyz` answers 200), for a container healthcheck in an image
/// with no shell or HTTP client.
pub fn probe(addr: std::net::SocketAddr) -> Result<String, String> {
    use std::io::{Read, Write};
    let timeout = std::time::Duration::from_secs(2);
    // A wildcard listener is reached on loopback.
    let addr = match addr.ip() {
        ip if ip.is_unspecified() => {
            let loopback: std::net::IpAddr = if ip.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            };
            std::net::SocketAddr::new(loopback, addr.port())
        }
        _ => addr,
    };
    let mut conn = std::net::TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("{addr}: cannot connect: {e}"))?;
    let _ = conn.set_read_timeout(Some(timeout));
    conn.write_all(b"GET /readyz HTTP/1.0\r\nhost: meshlimitd\r\n\r\n")
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut answer = Vec::new();
    let _ = conn.take(4096).read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    let status = answer.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(format!("{addr}: ready"))
    } else {
        Err(format!("{addr}: not ready: {status}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> (tempdir::Dir, std::path::PathBuf) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join(name);
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    /// A directory removed when dropped (no dependency for one test file).
    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let path = std::env::temp_dir()
                    .join(format!("meshlimitd-validate-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&path).unwrap();
                Dir(path)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    const GOOD: &str = r#"{"rules": [{"name": "api", "limits": [{"name": "m", "requests": 5, "window": "60s"}]}]}"#;

    #[test]
    fn a_plugin_config_in_json_yaml_or_a_wasmplugin_is_checked_by_the_filters_parser() {
        let (_d, json) = file("c.json", GOOD);
        assert!(plugin_config(&json)
            .unwrap()
            .ends_with("ok: 1 rule(s), service cluster \"meshlimit\""));
        let (_d, yaml) = file(
            "c.yaml",
            "rules:\n- name: api\n  limits: [{name: m, requests: 5, window: 60s}]\n",
        );
        assert!(plugin_config(&yaml).unwrap().contains("ok: 1 rule(s)"));
        let (_d, plugin) = file(
            "p.yaml",
            "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\nspec:\n  pluginConfig:\n    rules:\n    - name: api\n      limits: [{name: m, requests: 5, window: 60s}]\n",
        );
        assert!(plugin_config(&plugin).unwrap().contains("ok: 1 rule(s)"));
    }

    #[test]
    fn a_refused_plugin_config_says_what_the_filter_would_log() {
        let bad = GOOD.replace("\"requests\"", "\"requets\"");
        let (_d, json) = file("bad.json", &bad);
        let message = plugin_config(&json).unwrap_err();
        let filter = meshlimit::config::parse(bad.as_bytes()).unwrap_err();
        assert_eq!(message, format!("{}: {filter}", json.display()));
        assert!(message.contains("rules[0].limits[0].requets"), "{message}");
        let (_d, missing) = file("nowhere.json", "");
        std::fs::remove_file(&missing).unwrap();
        assert!(plugin_config(&missing).unwrap_err().contains("cannot read"));
    }

    #[test]
    fn an_rls_config_directory_is_loaded_as_the_server_loads_it() {
        let (dir, _) = file(
            "edge.yaml",
            "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n",
        );
        assert!(rls_config(&dir.0).unwrap().ends_with("ok: 1 domain(s)"));
        std::fs::write(dir.0.join("bad.yaml"), "domain: bad\ndescriptors:\n  - key: user\n    rate_limit: { unit: fortnight, requests_per_unit: 5 }\n").unwrap();
        let refused = rls_config(&dir.0).unwrap_err();
        let server = crate::rls::config::Domains::load_dir(&dir.0).err().unwrap();
        assert_eq!(refused, format!("{}: {server}", dir.0.display()));
    }
}
