//! Every process `make bench` measures, started once for the run, and
//! the rows they make (see the crate doc).

use std::collections::BTreeMap;

use meshlimit_testbed::procs::{Proc, TempDir};
use meshlimit_testbed::render::{render, template};
use meshlimit_testbed::topology::{FRONT_PORT, GRPC_PORT, UPSTREAM_PORT};
use meshlimit_testbed::{Topology, TopologyOptions};
use serde_json::json;

use crate::configs::{
    allow_all, leases_off, one_call_each, per_hour, spent_token_budget, three_rules, token_budget,
};
use crate::envoys::{
    baseline_envoy, compare_wasm, meshlimit_answering, meshlimit_topology, meshlimit_topology_with,
    noop_filter,
};
use crate::rows::{direct_row, replica_target, zipf_urls, Target, MANY_CLIENTS};

/// Every process the bench starts, for as long as the run lasts.
pub(crate) struct Fleet {
    base: Topology,
    bare: Proc,
    bare_addr: String,
    lrl: Proc,
    lrl_addr: String,
    pub(crate) global: Topology,
    deny: Topology,
    down: Topology,
    grouped_hot: Topology,
    grouped_many: Topology,
    policies: Topology,
    tokens: Topology,
    tokens_spent: Topology,
    pub(crate) native: Topology,
    native_envoy: Proc,
    /// Envoys answering themselves (rows 12 to 20).
    direct: Vec<DirectEnvoy>,
    /// More processes of the target pairs' rows (see [`FORKS`]): for each
    /// fork, the rows' indices into the targets and their Envoys.
    forks: Vec<Vec<(usize, DirectEnvoy)>>,
    compared: Vec<Topology>,
    _rls_dir: TempDir,
    zipf_dir: TempDir,
}

/// Envoy's own local_ratelimit, never denying: what an in-process token
/// bucket costs (row 2).
const LOCAL_RATELIMIT: &str = r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: local_rl
              token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
              filter_enabled: { default_value: { numerator: 100, denominator: HUNDRED } }
              filter_enforced: { default_value: { numerator: 100, denominator: HUNDRED } }"#;

impl Fleet {
    pub(crate) fn start() -> Fleet {
        // 1 and 2: baselines from envoy/bench-baseline.yaml.
        let base = Topology::start(TopologyOptions {
            replicas: 0,
            front: false,
            start_service: false,
            ..TopologyOptions::default()
        });
        let (bare, bare_addr) = baseline_envoy(&base, 3, "", false);
        let (lrl, lrl_addr) = baseline_envoy(&base, 4, LOCAL_RATELIMIT, false);
        // 3, 4, 5: meshlimit in envoy/replica.yaml. Group commit is the
        // default; 3 turns it off to show the cost of one call per request.
        let global = meshlimit_topology(&one_call_each());
        let deny = meshlimit_topology(&per_hour(1).build());
        let mut down = meshlimit_topology(&allow_all().build());
        down.stop_redis();
        let (native, native_envoy, rls_dir) = native_ratelimit();
        let compared: Vec<Topology> = compare_wasm()
            .map(|wasm| {
                vec![
                    meshlimit_topology_with(&one_call_each(), Some(wasm.clone())),
                    meshlimit_topology_with(&allow_all().build(), Some(wasm)),
                ]
            })
            .unwrap_or_default();
        let direct = answering_themselves(&base);
        let forks = (0..FORKS)
            .map(|fork| forked_pair_rows(&base, fork))
            .collect();
        Fleet {
            bare,
            bare_addr,
            lrl,
            lrl_addr,
            global,
            deny,
            down,
            grouped_hot: meshlimit_topology(&allow_all().build()),
            grouped_many: meshlimit_topology(&many_clients().build()),
            policies: meshlimit_topology(&three_rules()),
            tokens: token_topology(token_budget()),
            tokens_spent: token_topology(spent_token_budget()),
            native,
            native_envoy,
            direct,
            forks,
            compared,
            base,
            _rls_dir: rls_dir,
            zipf_dir: TempDir::new("bench-zipf"),
        }
    }

    /// The rows, in the order of the crate doc (row 6 is meshlimitd alone,
    /// measured apart), then the compare build's.
    pub(crate) fn targets(&self) -> Vec<Target> {
        let mut targets = vec![
            self.baseline_row("1. Envoy alone", &self.bare, &self.bare_addr, 3),
            self.baseline_row("2. Envoy + local_ratelimit", &self.lrl, &self.lrl_addr, 4),
            replica_target(
                "3. meshlimit, global, one call per request",
                &self.global,
                &[],
            ),
            replica_target("4. meshlimit, over limit (deny cache)", &self.deny, &[]),
            replica_target("5. meshlimit, Redis down, breaker open", &self.down, &[]),
            replica_target(
                "7. meshlimit, global, group commit, one hot client",
                &self.grouped_hot,
                &[],
            ),
            Target {
                url: format!(
                    "http://{}/{MANY_CLIENTS}",
                    self.grouped_many.replica_addr(1)
                ),
                many_clients: true,
                ..replica_target(
                    "8. meshlimit, global, group commit, 1000 clients",
                    &self.grouped_many,
                    &[],
                )
            },
            replica_target(
                "9. as 7, three rules with header conditions",
                &self.policies,
                &["x-plan: pro", "x-tenant: acme"],
            ),
            Target {
                url: format!("http://{}/v1/chat/completions", self.tokens.replica_addr(1)),
                post: Some(CHAT_BODY),
                ..replica_target(
                    "10. as 7, a token budget (non-streamed: reserve, settle)",
                    &self.tokens,
                    &[],
                )
            },
            Target {
                url: format!("http://{}/api", self.native.replica_addr(1)),
                pid: self.native_envoy.pid().unwrap_or(0),
                ..replica_target(
                    "11. Envoy's native ratelimit filter, meshlimitd over gRPC",
                    &self.native,
                    &["x-user: bench"],
                )
            },
        ];
        targets.extend(self.direct_rows());
        targets.push(Target {
            url: format!(
                "http://{}/v1/chat/completions",
                self.tokens_spent.replica_addr(1)
            ),
            post: Some(CHAT_BODY),
            // The fake model reports 1,000 tokens used: the first
            // request spends the budget whole, and the deny cache knows it.
            ..replica_target(
                "21. as 10, the budget spent: refused at the headers",
                &self.tokens_spent,
                &["x-llm-tokens: 1000"],
            )
        });
        // The same POST refused by a request limit from the deny cache:
        // what refusing this request costs at its headers, whatever
        // refuses it, beside which row 21's own cost is read.
        targets.push(Target {
            url: format!("http://{}/v1/chat/completions", self.deny.replica_addr(1)),
            post: Some(CHAT_BODY),
            ..replica_target("22. as 4, the POST of 21", &self.deny, &[])
        });
        for (topology, name) in self.compared.iter().zip([
            "3'. as 3, with the compare build",
            "7'. as 7, with the compare build",
        ]) {
            targets.push(replica_target(name, topology, &[]));
        }
        targets
    }

    fn baseline_row(&self, name: &'static str, envoy: &Proc, addr: &str, i: u16) -> Target {
        Target {
            url: format!("http://{addr}/"),
            ..direct_row(name, addr, self.base.addr(19_900 + i), envoy.pid())
        }
    }

    /// Rows 12 to 20: Envoy answering itself, the Zipf rows with their
    /// URLs drawn from a file.
    fn direct_rows(&self) -> Vec<Target> {
        DIRECT_ROWS
            .iter()
            .zip(&self.direct)
            .map(|(row, envoy)| self.direct_target(row, envoy))
            .collect()
    }

    fn direct_target(&self, (name, _, zipf): &DirectRow, envoy: &DirectEnvoy) -> Target {
        let DirectEnvoy {
            pid, addr, admin, ..
        } = envoy;
        Target {
            many_clients: *zipf,
            urls_file: zipf.then(|| {
                let dir = self.zipf_dir.path().join(addr.replace([':', '.'], "-"));
                let _ = std::fs::create_dir_all(&dir);
                zipf_urls(&dir, &format!("http://{addr}/"))
            }),
            ..direct_row(name, addr, admin.clone(), *pid)
        }
    }

    /// The target pairs' rows in each fork (see [`FORKS`]), by their
    /// indices into [`Fleet::targets`].
    pub(crate) fn fork_targets(&self) -> Vec<BTreeMap<usize, Target>> {
        self.forks
            .iter()
            .map(|fork| {
                fork.iter()
                    .filter_map(|(i, envoy)| {
                        let row = DIRECT_ROWS.get(i.checked_sub(FIRST_DIRECT)?)?;
                        Some((*i, self.direct_target(row, envoy)))
                    })
                    .collect()
            })
            .collect()
    }

    /// The processes beside the Envoys under test: upstreams, meshlimitd,
    /// Redis, and this one (the fake model of the token row).
    pub(crate) fn support_pids(&self) -> Vec<Option<u32>> {
        let topologies = [
            &self.base,
            &self.global,
            &self.deny,
            &self.down,
            &self.grouped_hot,
            &self.grouped_many,
            &self.policies,
            &self.tokens,
            &self.tokens_spent,
            &self.native,
        ];
        topologies
            .into_iter()
            .chain(self.direct.iter().filter_map(|d| d.topology.as_ref()))
            .chain(
                self.forks
                    .iter()
                    .flatten()
                    .filter_map(|(_, d)| d.topology.as_ref()),
            )
            .chain(&self.compared)
            .flat_map(|t| [t.upstream_pid(), t.meshlimitd_pid(), t.redis_pid()])
            .chain([Some(std::process::id())])
            .collect()
    }

    /// The processes behind the configurations whose CPU is split by
    /// process (3 and 7).
    pub(crate) fn watched(&self, i: usize) -> Vec<(&'static str, Option<u32>)> {
        let topo = match i {
            2 => &self.global,
            5 => &self.grouped_hot,
            _ => return Vec::new(),
        };
        vec![
            ("Envoy with meshlimit", topo.replica_pids().first().copied()),
            ("upstream Envoy", topo.upstream_pid()),
            ("meshlimitd", topo.meshlimitd_pid()),
            ("redis-server", topo.redis_pid()),
        ]
    }
}

/// Clients by `x-api-key` or the `key` query parameter (the Zipf mix and
/// row 8).
fn many_clients() -> meshlimit_testbed::plugin::PluginConfig {
    allow_all().client_id(json!({"headers": ["x-api-key"], "query_params": ["key"]}))
}

/// A `scope: local` rule: decided from the Envoy's own shared data.
fn local(config: meshlimit_testbed::plugin::PluginConfig) -> String {
    config.rule_field("scope", json!("local")).build()
}

/// The rows answering themselves: name, what runs the filter (None: bare
/// Envoy, Some(None): the do-nothing filter, Some(Some(config)): meshlimit
/// with that plugin config), and whether the row is the Zipf mix.
type DirectRow = (&'static str, Option<Option<fn() -> String>>, bool);
const DIRECT_ROWS: [DirectRow; 9] = [
    ("12. Envoy alone, answering itself", None, false),
    (
        "13. a do-nothing Rust wasm filter reading the client id, answering itself",
        Some(None),
        false,
    ),
    (
        "14. meshlimit's default (leases), one hot client, answering itself",
        Some(Some(|| allow_all().build())),
        false,
    ),
    (
        "15. as 14, leases off",
        Some(Some(|| leases_off(allow_all()))),
        false,
    ),
    ("16. as 13, the Zipf mix of 1000 clients", Some(None), true),
    (
        "17. meshlimit's default (leases), the Zipf mix of 1000 clients, answering itself",
        Some(Some(|| many_clients().build())),
        true,
    ),
    (
        "18. as 17, leases off",
        Some(Some(|| leases_off(many_clients()))),
        true,
    ),
    (
        "19. a `scope: local` rule (no call), one hot client, answering itself",
        Some(Some(|| local(allow_all()))),
        false,
    ),
    (
        "20. as 19, the Zipf mix of 1000 clients",
        Some(Some(|| local(many_clients()))),
        true,
    ),
];

/// An Envoy answering itself, and what it runs in.
struct DirectEnvoy {
    /// meshlimit's topology (meshlimitd, Redis), None for the baselines.
    topology: Option<Topology>,
    /// None when another row's Envoy is measured again (13 and 16).
    _envoy: Option<Proc>,
    pid: Option<u32>,
    addr: String,
    admin: String,
}

impl DirectEnvoy {
    /// meshlimit with plugin config `config`, in a topology of its own.
    fn meshlimit(config: &str) -> DirectEnvoy {
        let (t, envoy) = meshlimit_answering(config);
        DirectEnvoy {
            pid: envoy.pid(),
            _envoy: Some(envoy),
            addr: t.replica_addr(1),
            admin: t.replica_admin(1),
            topology: Some(t),
        }
    }
}

/// Starts the Envoys of [`DIRECT_ROWS`]: bare and the do-nothing filter
/// once each (13 and 16 are the same Envoy), meshlimit's in topologies of
/// their own.
fn answering_themselves(base: &Topology) -> Vec<DirectEnvoy> {
    let mut rows: Vec<DirectEnvoy> = Vec::new();
    for (_, filter, _) in DIRECT_ROWS {
        let row = match filter {
            None => {
                let (envoy, addr) = baseline_envoy(base, 5, "", true);
                DirectEnvoy {
                    topology: None,
                    pid: envoy.pid(),
                    _envoy: Some(envoy),
                    addr,
                    admin: base.addr(19_905),
                }
            }
            Some(None) => match rows.iter().find(|r| r.admin == base.addr(19_906)) {
                Some(noop) => DirectEnvoy {
                    topology: None,
                    _envoy: None,
                    pid: noop.pid,
                    addr: noop.addr.clone(),
                    admin: noop.admin.clone(),
                },
                None => {
                    let (envoy, addr) = baseline_envoy(base, 6, &noop_filter(), true);
                    DirectEnvoy {
                        topology: None,
                        pid: envoy.pid(),
                        _envoy: Some(envoy),
                        addr,
                        admin: base.addr(19_906),
                    }
                }
            },
            Some(Some(config)) => DirectEnvoy::meshlimit(&config()),
        };
        rows.push(row);
    }
    rows
}

/// Processes of the target pairs' rows beyond the first: Envoys of one
/// build and configuration run at different speeds for as long as they
/// live (two of one build read 31 and 38 µs of CPU a request in one run,
/// each in every round; a do-nothing filter's copies, 25 and 29), so a
/// target read from one process of each row reads the luck of two
/// processes. Each fork starts the pairs' rows again, and the extra pairs
/// take the forks in turn (as JMH forks a JVM per run of a benchmark).
/// Eight, one extra pair each: with two forks (four pairs each), one slow
/// Envoy of a row took four of the eleven pairs with it, and the median
/// with them (one busy client read 0.92 in one whole run and 0.86 in the
/// next, a fork's meshlimit Envoy at 30,000 requests/s against 35,000).
pub(crate) const FORKS: u16 = 8;

/// The baseline index of fork `fork`'s do-nothing filter (its admin port
/// 19900 plus it, its listener 10000 plus it): 7 on, past the rows' (3 to
/// 6), skipping 10, the upstream's.
fn fork_index(fork: u16) -> u16 {
    let i = 7 + fork;
    if i >= 10 {
        i + 1
    } else {
        i
    }
}

/// The index of row 12, the first answering itself, in the targets.
const FIRST_DIRECT: usize = 10;

/// Fork `fork`'s Envoys of the target pairs' rows (the do-nothing filter
/// once, for 13 and 16), each with its index into the targets.
fn forked_pair_rows(base: &Topology, fork: u16) -> Vec<(usize, DirectEnvoy)> {
    let (noop, addr) = baseline_envoy(base, fork_index(fork), &noop_filter(), true);
    let mut noop = Some(noop);
    let noop_pid = noop.as_ref().and_then(Proc::pid);
    let mut rows = Vec::new();
    for i in crate::full::PAIR_ROWS {
        let Some((_, Some(filter), _)) = i
            .checked_sub(FIRST_DIRECT)
            .and_then(|row| DIRECT_ROWS.get(row))
        else {
            continue;
        };
        let envoy = match filter {
            None => DirectEnvoy {
                topology: None,
                _envoy: noop.take(),
                pid: noop_pid,
                addr: addr.clone(),
                admin: base.addr(19_900 + fork_index(fork)),
            },
            Some(config) => DirectEnvoy::meshlimit(&config()),
        };
        rows.push((i, envoy));
    }
    rows
}

/// Row 11: Envoy's native ratelimit filter asking meshlimitd over gRPC,
/// with the rate limit configuration directory it reads.
fn native_ratelimit() -> (Topology, Proc, TempDir) {
    let rls_dir = TempDir::new("bench-rls");
    std::fs::write(
        rls_dir.path().join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 1000000000 }\n",
    )
    .unwrap_or_else(|e| panic!("cannot write the rate limit configuration: {e}"));
    let native = Topology::start(TopologyOptions {
        replicas: 0,
        front: false,
        rls_config_dir: Some(rls_dir.path().to_path_buf()),
        ..TopologyOptions::default()
    });
    let mut vars = native.base_vars(19_901, FRONT_PORT + 1);
    vars.extend([
        ("REPLICA_NAME", "native".to_string()),
        ("RLS_HOST", native.host.clone()),
        ("RLS_PORT", GRPC_PORT.to_string()),
        ("UPSTREAM_HOST", native.host.clone()),
        ("UPSTREAM_PORT", UPSTREAM_PORT.to_string()),
        ("FAILURE_MODE_DENY", "false".to_string()),
    ]);
    let envoy = native.start_envoy(
        "replica-1",
        &render(&template("native-ratelimit.yaml"), &vars),
        1,
    );
    (native, envoy, rls_dir)
}

/// The chat request of the token rows (10, 21): 200 tokens reserved.
const CHAT_BODY: &str =
    r#"{"model":"bench","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}"#;

/// A token row's topology. Its upstream is the fake model
/// (tests/src/llm.rs), in this process: Envoy's direct_response answers
/// before a request body is in, and a token budget reads its reservation
/// from the body.
fn token_topology(plugin_config: String) -> Topology {
    Topology::start(TopologyOptions {
        plugin_config,
        replicas: 1,
        front: false,
        replica_workers: 1,
        llm: true,
        ..TopologyOptions::default()
    })
}
