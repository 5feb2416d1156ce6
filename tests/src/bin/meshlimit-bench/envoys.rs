//! Starting the Envoys the rows measure: meshlimit's topologies, the
//! baselines, and either answering itself.

use meshlimit_testbed::procs::Proc;
use meshlimit_testbed::render::{render, template};
use meshlimit_testbed::tools;
use meshlimit_testbed::topology::{FRONT_PORT, UPSTREAM_PORT};
use meshlimit_testbed::{Topology, TopologyOptions};

pub(crate) fn meshlimit_topology(config: &str) -> Topology {
    meshlimit_topology_with(config, None)
}

pub(crate) fn meshlimit_topology_with(config: &str, wasm: Option<std::path::PathBuf>) -> Topology {
    Topology::start(TopologyOptions {
        plugin_config: config.into(),
        replicas: 1,
        front: false,
        replica_workers: 1,
        wasm,
        ..TopologyOptions::default()
    })
}

/// The other build `MESHLIMIT_COMPARE_WASM` names, if any.
pub(crate) fn compare_wasm() -> Option<std::path::PathBuf> {
    std::env::var_os("MESHLIMIT_COMPARE_WASM").map(std::path::PathBuf::from)
}

/// An Envoy config that answers every request itself (`direct_response`)
/// instead of routing to the upstream.
pub(crate) fn answering_itself(config: &str) -> String {
    let route = "route: { cluster: upstream }";
    assert!(config.contains(route), "the template has no upstream route");
    config.replace(
        route,
        r#"direct_response: { status: 200, body: { inline_string: "ok\n" } }"#,
    )
}

/// The do-nothing wasm filter (tests/noop-filter), as an HTTP filter of
/// envoy/bench-baseline.yaml: the same runtime and VM settings as
/// meshlimit's in envoy/replica.yaml.
pub(crate) fn noop_filter() -> String {
    let wasm = tools::root().join("target/wasm32-wasip1/release/meshlimit_bench_noop.wasm");
    assert!(
        wasm.exists(),
        "{} is missing: `make bench` builds it (cargo build --release --target wasm32-wasip1 -p meshlimit-bench-noop)",
        wasm.display()
    );
    format!(
        r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: noop
                root_id: noop
                vm_config:
                  vm_id: noop
                  runtime: envoy.wasm.runtime.v8
                  code:
                    local: {{ filename: {} }}"#,
        wasm.display()
    )
}

/// An Envoy from envoy/bench-baseline.yaml (replica `i` of `base`, admin on
/// 19900 + i) with `filters` as its HTTP filters, routing to the upstream
/// or, with `answering`, answering every request itself. The process and
/// its listener's address.
pub(crate) fn baseline_envoy(
    base: &Topology,
    i: u16,
    filters: &str,
    answering: bool,
) -> (Proc, String) {
    let mut vars = base.base_vars(19_900 + i, FRONT_PORT + i);
    vars.insert("UPSTREAM_HOST", base.host.clone());
    vars.insert("UPSTREAM_PORT", UPSTREAM_PORT.to_string());
    vars.insert("HTTP_FILTERS", filters.to_string());
    vars.insert("REPLICA_NAME", format!("baseline-{i}"));
    let mut config = render(&template("bench-baseline.yaml"), &vars);
    if answering {
        config = answering_itself(&config);
    }
    (
        base.start_envoy(&format!("replica-{i}"), &config, 1),
        base.addr(FRONT_PORT + i),
    )
}

/// A meshlimit topology whose one replica answers requests itself.
pub(crate) fn meshlimit_answering(config: &str) -> (Topology, Proc) {
    meshlimit_answering_with(config, None)
}

/// The same, running the filter build `wasm` (None: the project's).
pub(crate) fn meshlimit_answering_with(
    config: &str,
    wasm: Option<std::path::PathBuf>,
) -> (Topology, Proc) {
    meshlimit_answering_over(config, wasm, false)
}

/// As [`meshlimit_answering_with`], its meshlimit cluster over HTTP/1.1
/// when `cluster_http1` (replica.yaml's is HTTP/2).
pub(crate) fn meshlimit_answering_over(
    config: &str,
    wasm: Option<std::path::PathBuf>,
    cluster_http1: bool,
) -> (Topology, Proc) {
    let t = Topology::start(TopologyOptions {
        plugin_config: config.into(),
        replicas: 0,
        front: false,
        replica_workers: 1,
        wasm,
        meshlimitd_http1: cluster_http1,
        ..TopologyOptions::default()
    });
    let replica = t.start_replica(1, &answering_itself(&t.replica_config(1)));
    (t, replica)
}
