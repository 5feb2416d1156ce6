//! Every Envoy configuration the project ships is valid for Envoy 1.40, and
//! the docker-compose files are the templates rendered, not hand copies.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::process::Command;

use meshlimit_testbed::procs::TempDir;
use meshlimit_testbed::render::{indent_block, render, template, PLUGIN_CONFIG_INDENT};
use meshlimit_testbed::tools;
use meshlimit_testbed::topology::{default_plugin_config, validate_envoy_config};
use meshlimit_testbed::{Topology, TopologyOptions};

/// Where the compose Envoys find the wasm (mounted by docker-compose.yml).
const COMPOSE_WASM: &str = "/etc/meshlimit/meshlimit.wasm";
/// What the compose replicas replace with the generated shared token when
/// they start (docker-compose.yml).
const COMPOSE_TOKEN_PLACEHOLDER: &str = "@MESHLIMIT_SHARED_TOKEN@";

/// The usual plugin configuration with the shared token's placeholder
/// (put in as text, so the file stays as written).
fn compose_plugin_config() -> String {
    let usual = default_plugin_config();
    let service = r#""authority": "meshlimitd","#;
    assert!(usual.contains(service), "{usual}");
    usual.replacen(
        service,
        &format!(r#"{service} "auth_token": "{COMPOSE_TOKEN_PLACEHOLDER}","#),
        1,
    )
}

fn compose_configs() -> BTreeMap<String, String> {
    let base = |admin: &str, listen: &str| {
        BTreeMap::from([
            ("ADMIN_HOST", "0.0.0.0".to_string()),
            ("ADMIN_PORT", admin.to_string()),
            ("LISTEN_HOST", "0.0.0.0".to_string()),
            ("LISTEN_PORT", listen.to_string()),
        ])
    };
    let mut out = BTreeMap::new();
    out.insert(
        "upstream.yaml".to_string(),
        render(&template("upstream.yaml"), &base("9901", "8000")),
    );
    for i in 1..=2 {
        let mut vars = base("9901", "10000");
        vars.extend([
            ("REPLICA_NAME", format!("replica-{i}")),
            ("WASM_PATH", COMPOSE_WASM.to_string()),
            (
                "PLUGIN_CONFIG",
                indent_block(&compose_plugin_config(), PLUGIN_CONFIG_INDENT),
            ),
            ("MESHLIMITD_DISCOVERY", "STRICT_DNS".into()),
            ("MESHLIMITD_HOST", "meshlimitd".into()),
            ("MESHLIMITD_PORT", "8080".into()),
            ("UPSTREAM_DISCOVERY", "STRICT_DNS".into()),
            ("UPSTREAM_HOST", "upstream".into()),
            ("UPSTREAM_PORT", "8000".into()),
        ]);
        out.insert(
            format!("replica-{i}.yaml"),
            render(&template("replica.yaml"), &vars),
        );
    }
    let mut vars = base("9901", "10000");
    vars.extend([
        ("REPLICA_DISCOVERY", "STRICT_DNS".into()),
        ("REPLICA_1_HOST", "replica-1".into()),
        ("REPLICA_1_PORT", "10000".into()),
        ("REPLICA_2_HOST", "replica-2".into()),
        ("REPLICA_2_PORT", "10000".into()),
    ]);
    out.insert(
        "front.yaml".to_string(),
        render(&template("front.yaml"), &vars),
    );
    out
}

#[test]
fn every_template_renders_to_a_config_envoy_accepts() {
    let t = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        start_service: false,
        ..TopologyOptions::default()
    });
    let dir = TempDir::new("validate");
    for (name, config) in [
        ("front", t.front_config()),
        ("replica", t.replica_config(1)),
        ("upstream", t.upstream_config()),
    ] {
        let (ok, out) = validate_envoy_config(&config, dir.path(), name);
        assert!(ok, "{name}.yaml rejected by envoy --mode validate:\n{out}");
    }
}

#[test]
fn compose_configs_match_templates() {
    let dir = tools::root().join("envoy/compose");
    let update = std::env::var_os("UPDATE_COMPOSE_CONFIGS").is_some();
    if update {
        std::fs::create_dir_all(&dir).unwrap();
    }
    for (name, rendered) in compose_configs() {
        let path = dir.join(&name);
        if update {
            std::fs::write(&path, &rendered).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == rendered,
            "envoy/compose/{name} differs from its template; run `make compose-configs`"
        );
    }
}

#[test]
fn compose_envoy_files_pass_envoy_validate() {
    let dir = TempDir::new("compose-validate");
    let wasm = tools::wasm().display().to_string();
    for (name, config) in compose_configs() {
        // The only change: the wasm path inside the container becomes the
        // local build, since validation loads the module and runs its
        // on_configure. Hostnames of STRICT_DNS clusters are not resolved.
        let local = config.replace(COMPOSE_WASM, &wasm);
        let (ok, out) = validate_envoy_config(&local, dir.path(), name.trim_end_matches(".yaml"));
        assert!(ok, "envoy/compose/{name} rejected:\n{out}");
    }
}

/// docker-compose.yml is a Compose Specification file (no `version:`)
/// that builds everything from source, the wasm in Dockerfile.wasm's
/// `envoy` stage (no Rust needed on the host), with a healthcheck on
/// every service. `docker-compose config` (Debian's, 1.29) validates it
/// offline; no Docker engine runs here, so the images are not built.
#[test]
fn docker_compose_file_is_valid() {
    let compose = tools::root().join("docker-compose.yml");
    let config = |args: &[&str]| {
        let out = Command::new("docker-compose")
            .arg("-f")
            .arg(&compose)
            .arg("config")
            .args(args)
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run docker-compose ({e}); `scripts/setup.sh` installs Debian's docker-compose")
            });
        assert!(
            out.status.success(),
            "docker-compose config failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let normalized = config(&[]);
    let services = config(&["--services"]);
    let count = services.lines().count();
    assert_eq!(count, 7, "{services}");
    // Every long-running service; the one-shot `secret` job has none.
    assert_eq!(
        normalized.matches("healthcheck:").count(),
        count - 1,
        "every service has a healthcheck:\n{normalized}"
    );
    let text = std::fs::read_to_string(&compose).unwrap();
    assert!(
        !text.lines().any(|l| l.starts_with("version:")),
        "the Compose Specification has no `version:`"
    );
    assert!(
        !text.contains("target/wasm32-wasip1"),
        "the wasm is built in Docker, not mounted from the host"
    );
    for needle in [
        "envoyproxy/envoy:v1.40-latest",
        "redis:7",
        "dockerfile: Dockerfile.wasm",
        "target: envoy",
        "build: .",
        "docker compose up --build",
        // Secure by default: a generated shared token, required by
        // meshlimitd and put in the replicas' plugin configuration.
        "MESHLIMITD_AUTH_TOKEN_FILE: /run/meshlimit/token",
        "condition: service_completed_successfully",
        COMPOSE_TOKEN_PLACEHOLDER,
    ] {
        assert!(
            text.contains(needle),
            "docker-compose.yml should use {needle}"
        );
    }
}
