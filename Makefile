# meshlimit: every target does its own set-up (scripts/setup.sh is idempotent).
CARGO ?= cargo
WASM := target/wasm32-wasip1/release/meshlimit.wasm
MESHLIMITD := target/release/meshlimitd

.PHONY: all setup build test unit e2e lint fmt demo compose-configs clean accuracy

all: build

setup:
	@bash scripts/setup.sh

## build: the filter (wasm) and meshlimitd, optimized.
build: setup
	$(CARGO) build --release --target wasm32-wasip1 -p meshlimit
	$(CARGO) build --release -p meshlimitd
	@ls -l $(WASM) $(MESHLIMITD)

## lint: formatting and clippy (the filter and protocol crates deny unwrap, expect, panic).
lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --release --target wasm32-wasip1 -p meshlimit -- -D warnings

## test: lint, unit tests, meshlimitd on a real redis-server, end to end with real Envoy.
test: build lint
	$(CARGO) test --workspace --no-fail-fast

## demo: starts Redis, meshlimitd and four Envoys on loopback and shows the limit at work.
demo: build
	$(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-demo

## compose-configs: re-renders deploy/compose/*.yaml from the templates in envoy/.
compose-configs:
	UPDATE_COMPOSE_CONFIGS=1 $(CARGO) test -p meshlimit-testbed --test configs compose_configs_match_templates

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean

## accuracy: replays traffic traces through meshlimitd on a real Redis; writes docs/accuracy.md.
accuracy: build
	$(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-accuracy
