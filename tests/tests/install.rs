//! The install path as an operator follows it: every command of the
//! Istio quickstart (docs/istio.md) and of the README's compose section is
//! run here when it can run without a cluster or a Docker engine (a
//! kustomization rendered, a configuration validated by the built
//! meshlimitd, the compose file checked), and every other one is known to
//! need a cluster: a command added to the docs must be either.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::PathBuf;
use std::process::Command;

use meshlimit_testbed::tools;

/// The commands of a markdown file's `sh` blocks, comments and
/// continuation lines joined.
fn commands(doc: &str) -> Vec<String> {
    let text = std::fs::read_to_string(tools::root().join(doc)).unwrap();
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_sh = !in_sh && line.trim() == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = line.split(" #").next().unwrap_or_default().trim();
        if code.is_empty() || code.starts_with('#') {
            continue;
        }
        pending.push_str(code.trim_end_matches('\\').trim());
        if code.ends_with('\\') {
            pending.push(' ');
        } else {
            out.push(std::mem::take(&mut pending));
        }
    }
    out
}

fn kubectl() -> PathBuf {
    let venv = tools::root().join(".venv/bin/kubectl");
    if Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_ok()
    {
        PathBuf::from("kubectl")
    } else {
        assert!(
            venv.exists(),
            "kubectl is missing: scripts/setup.sh installs it (make test runs setup)"
        );
        venv
    }
}

fn meshlimitd() -> PathBuf {
    let built = tools::root().join("target/release/meshlimitd");
    assert!(
        built.exists(),
        "{} is missing: `make build` builds it",
        built.display()
    );
    built
}

/// Runs `program args` in the repository; its stdout, or the failure.
fn run(program: &PathBuf, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .current_dir(tools::root())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    assert!(
        out.status.success(),
        "{} {}: {}{}",
        program.display(),
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Commands that need a cluster (or a Docker engine), by their start.
const NEEDS_A_CLUSTER: [&str; 6] = [
    "kubectl label ",
    "kubectl -n ",
    "GW=",
    "kubectl create ",
    // Tested with a stand-in kubectl in deploy/test_manifests.py.
    "deploy/shared-token.sh",
    "curl ",
];

/// Runs what can run of `command`; false when it needs a cluster.
fn walk(command: &str) -> bool {
    let words: Vec<&str> = command.split_whitespace().collect();
    match words.as_slice() {
        ["kubectl", "apply", "-k", dir] | ["kubectl", "kustomize", dir] => {
            // What `apply -k` would send: rendered, and not empty.
            let rendered = run(&kubectl(), &["kustomize", dir]);
            assert!(rendered.contains("kind: "), "{dir} renders nothing");
            true
        }
        ["meshlimitd", "validate", what, path] => {
            let line = run(&meshlimitd(), &["validate", what, path]);
            assert!(line.contains(": ok: "), "{command}: {line}");
            true
        }
        ["docker", "compose", "up", ..] => {
            let compose = PathBuf::from("docker-compose");
            run(&compose, &["-f", "docker-compose.yml", "config", "--quiet"]);
            true
        }
        _ => {
            assert!(
                NEEDS_A_CLUSTER.iter().any(|p| command.starts_with(p)),
                "a command the install test does not know: {command:?} (run it here, or list it as needing a cluster)"
            );
            false
        }
    }
}

#[test]
fn the_istio_quickstart_runs_every_command_that_needs_no_cluster() {
    let all = commands("docs/istio.md");
    let ran: Vec<&String> = all.iter().filter(|c| walk(c)).collect();
    // Render base and gateway, validate the gateway's plugin config.
    assert!(ran.len() >= 3, "ran {ran:?} of {all:?}");
    assert!(ran.iter().any(|c| c.starts_with("meshlimitd validate")));
}

#[test]
fn the_readmes_install_commands_run_here_too() {
    let ran = commands("README.md")
        .into_iter()
        .filter(|c| {
            c.starts_with("kubectl") || c.starts_with("docker") || c.starts_with("meshlimitd")
        })
        .filter(|c| walk(c))
        .count();
    assert!(ran >= 3, "the README's kubectl and compose commands");
}

/// What every proxy loads: the release module stays under the size the
/// README promises (`make bench` reports it too), so that growth is caught
/// by the change that causes it.
#[test]
fn the_filter_module_stays_under_one_mib() {
    let wasm = tools::wasm();
    let bytes = std::fs::metadata(&wasm)
        .unwrap_or_else(|e| {
            panic!(
                "cannot read {}: {e} (`make build` makes it)",
                wasm.display()
            )
        })
        .len();
    assert!(
        bytes < tools::WASM_MAX_BYTES,
        "{} is {} KiB, over the {} KiB the README promises",
        wasm.display(),
        bytes / 1024,
        tools::WASM_MAX_BYTES / 1024
    );
}
