//! The demo and test topology: clients -> front Envoy (round robin) ->
//! replica Envoys running meshlimit.wasm -> upstream, with the replicas
//! asking meshlimitd, which keeps the counters in Redis.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::fake::{Behavior, FakeService};
use crate::http::{self, Response};
use crate::late::LateProxy;
use crate::procs::{wait_until, Proc, TempDir};
use crate::render::{self, indent_block, render, PLUGIN_CONFIG_INDENT};
use crate::services::{self, unique_host, Meshlimitd, RedisCluster, RedisServer};
use crate::tools;

/// Fixed ports; each topology has its own loopback address, so these never
/// collide between topologies.
pub const FRONT_PORT: u16 = 10000;
pub const UPSTREAM_PORT: u16 = 10010;
pub use crate::services::{MESHLIMITD_PORT, REDIS_PORT};
const ADMIN_BASE: u16 = 19900;

pub struct TopologyOptions {
    /// JSON plugin configuration for every replica.
    pub plugin_config: String,
    /// Number of replica Envoys (each with the filter).
    pub replicas: usize,
    /// Whether to start the round-robin front Envoy.
    pub front: bool,
    /// Worker threads per replica (2 exercises shared data across workers).
    pub replica_workers: u32,
    /// Whether to start meshlimitd (and Redis) at all.
    pub start_service: bool,
    /// A misbehaving stand-in to run at meshlimitd's address instead.
    pub fake: Option<Behavior>,
    /// Extra meshlimitd flags.
    pub meshlimitd_args: Vec<String>,
    /// Environment variables of meshlimitd.
    pub meshlimitd_env: Vec<(String, String)>,
    /// Run meshlimitd on a 3-master, 3-replica Redis Cluster instead of one
    /// Redis.
    pub redis_cluster: bool,
    /// Another build of the filter for these replicas (else
    /// [`tools::wasm`]): the bench compares two builds side by side.
    pub wasm: Option<std::path::PathBuf>,
    /// A fake LLM ([`crate::llm`]) as the upstream instead of Envoy's
    /// direct response.
    pub llm: bool,
    /// The replicas' Wasm PluginConfig sets
    /// `allow_on_headers_stop_iteration` (so should the plugin
    /// configuration): a request whose token reservation is in its body
    /// holds its headers until decided.
    pub hold_headers: bool,
    /// Serve Envoy's rate limit service (gRPC, on [`GRPC_PORT`]) with the
    /// envoyproxy/ratelimit configuration files of this directory.
    pub rls_config_dir: Option<PathBuf>,
    /// meshlimitd requires the shared token ([`SHARED_TOKEN`], by
    /// `--auth-token-file`) and every replica's plugin configuration
    /// carries it (`service.auth_token`), as the shipped manifests do:
    /// receipts are then signed, and settlements verified.
    pub shared_token: bool,
    /// The replicas reach meshlimitd through a [`LateProxy`] (on
    /// [`LATE_PROXY_PORT`]) that can hold its answers back
    /// ([`Topology::late`]).
    pub late_answers: bool,
    /// The replicas' meshlimit cluster speaks HTTP/1.1: replica.yaml's
    /// `typed_extension_protocol_options` (HTTP/2) left out, to compare.
    pub meshlimitd_http1: bool,
}

/// The shared token of topologies with [`TopologyOptions::shared_token`].
pub const SHARED_TOKEN: &str = "meshlimit-testbed-shared-token";

/// meshlimitd's gRPC port (the rate limit service), when it serves one.
pub const GRPC_PORT: u16 = 18081;

/// Where the replicas reach meshlimitd with [`TopologyOptions::late_answers`].
pub const LATE_PROXY_PORT: u16 = 18082;

impl Default for TopologyOptions {
    fn default() -> Self {
        TopologyOptions {
            plugin_config: default_plugin_config(),
            replicas: 2,
            front: true,
            replica_workers: 2,
            start_service: true,
            fake: None,
            meshlimitd_args: Vec::new(),
            meshlimitd_env: Vec::new(),
            redis_cluster: false,
            wasm: None,
            llm: false,
            hold_headers: false,
            rls_config_dir: None,
            shared_token: false,
            late_answers: false,
            meshlimitd_http1: false,
        }
    }
}

/// `envoy/plugin-config.json`, the configuration the demo runs.
pub fn default_plugin_config() -> String {
    render::template("plugin-config.json")
}

pub struct Topology {
    pub host: String,
    pub dir: TempDir,
    pub options: TopologyOptions,
    redis: Option<RedisServer>,
    pub cluster: Option<RedisCluster>,
    meshlimitd: Option<Meshlimitd>,
    upstream: Option<Proc>,
    pub llm: Option<crate::llm::FakeLlm>,
    replicas: Vec<Proc>,
    front: Option<Proc>,
    fake: Option<FakeService>,
    late: Option<LateProxy>,
}

impl Topology {
    pub fn start(options: TopologyOptions) -> Topology {
        let host = unique_host();
        let mut t = Topology {
            dir: TempDir::new("topology"),
            host,
            options,
            redis: None,
            cluster: None,
            meshlimitd: None,
            upstream: None,
            llm: None,
            replicas: Vec::new(),
            front: None,
            fake: None,
            late: None,
        };
        if let Some(behavior) = t.options.fake.clone() {
            t.fake = Some(FakeService::start(&t.meshlimitd_addr(), behavior));
        } else if t.options.start_service {
            if t.options.redis_cluster {
                t.cluster = Some(RedisCluster::start(&t.host, t.dir.path(), 3));
            } else {
                t.start_redis();
            }
            t.start_meshlimitd();
        }
        if t.options.late_answers {
            t.late = Some(LateProxy::start(
                &t.addr(LATE_PROXY_PORT),
                &t.meshlimitd_addr(),
            ));
        }
        let wait_healthy =
            t.options.start_service && !matches!(t.options.fake, Some(Behavior::Unhealthy));
        if t.options.llm {
            t.llm = Some(crate::llm::FakeLlm::start(&t.addr(UPSTREAM_PORT)));
        } else {
            let upstream = t.start_envoy("upstream", &t.upstream_config(), 1);
            t.upstream = Some(upstream);
        }
        for i in 1..=t.options.replicas {
            let config = t.replica_config(i);
            let mut replica =
                t.start_envoy(&format!("replica-{i}"), &config, t.options.replica_workers);
            if wait_healthy {
                t.wait_sees_meshlimitd(i, &mut replica);
            }
            t.replicas.push(replica);
        }
        if t.options.front {
            let front = t.start_envoy("front", &t.front_config(), 1);
            t.front = Some(front);
        }
        t
    }

    // ---- addresses ----

    pub fn addr(&self, port: u16) -> String {
        format!("{}:{port}", self.host)
    }

    /// Where clients send requests: the front, or the only replica.
    pub fn entry(&self) -> String {
        if self.options.front {
            self.addr(FRONT_PORT)
        } else {
            self.replica_addr(1)
        }
    }

    pub fn replica_addr(&self, i: usize) -> String {
        self.addr(FRONT_PORT + i as u16)
    }

    pub fn replica_admin(&self, i: usize) -> String {
        self.addr(ADMIN_BASE + i as u16)
    }

    pub fn meshlimitd_addr(&self) -> String {
        self.addr(MESHLIMITD_PORT)
    }

    /// Holds meshlimitd's answers back this long on their way to the
    /// replicas (0: none); needs [`TopologyOptions::late_answers`].
    pub fn late(&self, delay: Duration) {
        self.late
            .as_ref()
            .expect("the topology has no late proxy: set late_answers")
            .delay(delay);
    }

    // ---- configs ----

    pub fn base_vars(&self, admin_port: u16, listen_port: u16) -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            ("ADMIN_HOST", self.host.clone()),
            ("ADMIN_PORT", admin_port.to_string()),
            ("LISTEN_HOST", self.host.clone()),
            ("LISTEN_PORT", listen_port.to_string()),
        ])
    }

    pub fn upstream_config(&self) -> String {
        render(
            &render::template("upstream.yaml"),
            &self.base_vars(ADMIN_BASE + 10, UPSTREAM_PORT),
        )
    }

    pub fn replica_config(&self, i: usize) -> String {
        self.replica_config_with(i, &self.options.plugin_config)
    }

    pub fn replica_config_with(&self, i: usize, plugin_config: &str) -> String {
        let mut vars = self.base_vars(ADMIN_BASE + i as u16, FRONT_PORT + i as u16);
        vars.extend([
            ("REPLICA_NAME", format!("replica-{i}")),
            (
                "WASM_PATH",
                self.options
                    .wasm
                    .clone()
                    .unwrap_or_else(tools::wasm)
                    .display()
                    .to_string(),
            ),
            (
                "PLUGIN_CONFIG",
                indent_block(&self.with_token(plugin_config), PLUGIN_CONFIG_INDENT),
            ),
            ("MESHLIMITD_DISCOVERY", "STATIC".into()),
            ("MESHLIMITD_HOST", self.host.clone()),
            (
                "MESHLIMITD_PORT",
                if self.options.late_answers {
                    LATE_PROXY_PORT
                } else {
                    MESHLIMITD_PORT
                }
                .to_string(),
            ),
            ("UPSTREAM_DISCOVERY", "STATIC".into()),
            ("UPSTREAM_HOST", self.host.clone()),
            ("UPSTREAM_PORT", UPSTREAM_PORT.to_string()),
        ]);
        let mut config = render(&render::template("replica.yaml"), &vars);
        if self.options.meshlimitd_http1 {
            config = without_http2_options(&config);
        }
        if self.options.hold_headers {
            return config.replacen(
                "failure_policy: FAIL_RELOAD\n",
                "failure_policy: FAIL_RELOAD\n                allow_on_headers_stop_iteration: true\n",
                1,
            );
        }
        config
    }

    pub fn front_config(&self) -> String {
        let mut vars = self.base_vars(ADMIN_BASE, FRONT_PORT);
        vars.extend([
            ("REPLICA_DISCOVERY", "STATIC".into()),
            ("REPLICA_1_HOST", self.host.clone()),
            ("REPLICA_1_PORT", (FRONT_PORT + 1).to_string()),
            ("REPLICA_2_HOST", self.host.clone()),
            ("REPLICA_2_PORT", (FRONT_PORT + 2).to_string()),
        ]);
        render(&render::template("front.yaml"), &vars)
    }

    // ---- processes ----

    /// Starts an Envoy from a rendered config. `name` picks its admin port:
    /// `front`, `upstream`, or `replica-N` (admin on 19900 + N).
    pub fn start_envoy(&self, name: &str, config: &str, workers: u32) -> Proc {
        self.start_envoy_with(name, config, workers, &[])
    }

    /// As [`Topology::start_envoy`], with more command-line `args`.
    pub fn start_envoy_with(&self, name: &str, config: &str, workers: u32, args: &[&str]) -> Proc {
        let path = self.dir.path().join(format!("{name}.yaml"));
        write(&path, config);
        let mut proc = Proc::spawn(
            name,
            Command::new(tools::envoy())
                .arg("-c")
                .arg(&path)
                .args(["--disable-hot-restart", "--log-level", "info"])
                .args(["--concurrency", &workers.to_string()])
                .args(args),
            self.dir.path(),
        );
        let admin = match name {
            "front" => self.addr(ADMIN_BASE),
            "upstream" => self.addr(ADMIN_BASE + 10),
            _ => {
                let i: u16 = name.trim_start_matches("replica-").parse().unwrap_or(1);
                self.addr(ADMIN_BASE + i)
            }
        };
        wait_until(&mut proc, "ready", Duration::from_secs(30), || {
            http::get(&admin, "/ready", &[]).is_ok_and(|r| r.status == 200)
        });
        proc
    }

    /// Starts replica `i` from `config` (a variant of
    /// [`Topology::replica_config`]: another listener, more filters) and
    /// waits until it sees meshlimitd healthy. The caller keeps the process.
    pub fn start_replica(&self, i: usize, config: &str) -> Proc {
        let mut replica = self.start_envoy(&format!("replica-{i}"), config, 1);
        self.wait_sees_meshlimitd(i, &mut replica);
        replica
    }

    /// Envoy counts meshlimitd unhealthy until its first health check
    /// passes; calls made before then are fallbacks. A test that starts
    /// replica `i` from a config of its own with [`Topology::start_envoy`]
    /// waits here before its first request, or races the health check.
    pub fn wait_sees_meshlimitd(&self, i: usize, replica: &mut Proc) {
        let admin = self.replica_admin(i);
        wait_until(
            replica,
            "seeing meshlimitd healthy",
            Duration::from_secs(15),
            || meshlimitd_healthy(&admin),
        );
    }

    /// `plugin_config` with the shared token in `service.auth_token`, when
    /// the topology has one (a configuration that is no JSON object is
    /// left as it is: the test is about that).
    fn with_token(&self, plugin_config: &str) -> String {
        if !self.options.shared_token {
            return plugin_config.to_string();
        }
        match serde_json::from_str::<serde_json::Value>(plugin_config) {
            Ok(mut config) if config.is_object() => {
                config["service"]["auth_token"] = SHARED_TOKEN.into();
                serde_json::to_string_pretty(&config).unwrap_or_default()
            }
            _ => plugin_config.to_string(),
        }
    }

    pub fn start_redis(&mut self) {
        self.redis = Some(RedisServer::start(&self.host, self.dir.path()));
    }

    pub fn stop_redis(&mut self) {
        self.redis.take();
    }

    pub fn start_meshlimitd(&mut self) {
        let (url, mut extra) = match &self.cluster {
            Some(c) => (c.seeds(), vec!["--redis-mode", "cluster"]),
            None => (format!("redis://{}", self.addr(REDIS_PORT)), Vec::new()),
        };
        extra.extend(self.options.meshlimitd_args.iter().map(String::as_str));
        let token_file = self.dir.path().join("shared-token");
        let token_file = token_file.display().to_string();
        if self.options.shared_token {
            std::fs::write(&token_file, SHARED_TOKEN)
                .unwrap_or_else(|e| panic!("{token_file}: {e}"));
            extra.extend(["--auth-token-file", token_file.as_str()]);
        }
        let grpc = self.options.rls_config_dir.as_ref().map(|dir| {
            [
                "--grpc-listen".to_string(),
                self.addr(GRPC_PORT),
                "--rls-config-dir".to_string(),
                dir.display().to_string(),
            ]
        });
        extra.extend(grpc.iter().flatten().map(String::as_str));
        self.meshlimitd = Some(Meshlimitd::start_with_env(
            &tools::meshlimitd(),
            &self.host,
            &url,
            self.dir.path(),
            &extra,
            &self.options.meshlimitd_env,
        ));
    }

    /// The meshlimitd process handle, e.g. to signal it or wait for it.
    pub fn meshlimitd_proc(&mut self) -> Option<&mut Proc> {
        self.meshlimitd.as_mut().map(|m| &mut m.proc)
    }

    /// The upstream Envoy's process id.
    pub fn upstream_pid(&self) -> Option<u32> {
        self.upstream.as_ref().and_then(Proc::pid)
    }

    /// Process ids of the replicas (for pinning, memory).
    pub fn replica_pids(&self) -> Vec<u32> {
        self.replicas.iter().filter_map(Proc::pid).collect()
    }

    /// The Redis process id, e.g. to SIGSTOP it (a black hole).
    pub fn redis_pid(&self) -> Option<u32> {
        self.redis.as_ref().and_then(|r| r.pid())
    }

    /// Resident memory of replica `i`'s Envoy process, in KiB.
    pub fn replica_rss_kib(&self, i: usize) -> u64 {
        crate::procs::rss_kib(self.replicas.get(i - 1).and_then(Proc::pid))
    }

    /// Waits until every replica's health check sees meshlimitd again.
    pub fn wait_meshlimitd_healthy(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        for i in 1..=self.options.replicas {
            while !meshlimitd_healthy(&self.replica_admin(i)) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "replica-{i} never saw meshlimitd healthy"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The meshlimitd process, e.g. to signal it.
    pub fn meshlimitd_pid(&self) -> Option<u32> {
        self.meshlimitd.as_ref().and_then(|m| m.proc.pid())
    }

    pub fn stop_meshlimitd(&mut self) {
        self.meshlimitd.take();
    }

    /// Output of a process by name, for failure messages.
    pub fn logs(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    // ---- traffic and stats ----

    pub fn get(&self, path: &str, headers: &[(&str, &[u8])]) -> Response {
        let entry = self.entry();
        http::get(&entry, path, headers)
            .unwrap_or_else(|e| panic!("request to {entry}{path} failed: {e}"))
    }

    /// A filter stat (`meshlimit.requests_allowed`, ...) of replica `i`.
    pub fn stat(&self, i: usize, name: &str) -> u64 {
        let full = format!("wasmcustom.{name}");
        http::envoy_stats(&self.replica_admin(i), "^wasmcustom\\.")
            .into_iter()
            .find(|(k, _)| *k == full)
            .map_or(0, |(_, v)| v)
    }

    /// Why requests were decided without meshlimitd's answer, for failure
    /// messages: per replica, every nonzero failed-call, queue-overflow and
    /// breaker stat, and the meshlimit cluster's upstream errors.
    pub fn fallback_causes(&self) -> String {
        (1..=self.options.replicas)
            .map(|i| {
                let mut causes: Vec<String> =
                    http::envoy_stats(&self.replica_admin(i), "^wasmcustom\\.meshlimit\\.")
                        .into_iter()
                        .filter(|(k, v)| {
                            *v > 0
                                && ["service_errors", "batch_overflow", "breaker_opened", "fallback"]
                                    .iter()
                                    .any(|c| k.contains(c))
                        })
                        .map(|(k, v)| format!("{}={v}", k.trim_start_matches("wasmcustom.")))
                        .collect();
                causes.extend(
                    http::envoy_stats(
                        &self.replica_admin(i),
                        "^cluster\\.meshlimit\\.(upstream_rq_(timeout|pending_overflow|5xx)|upstream_cx_(connect_fail|connect_timeout|overflow)|health_check\\.failure)$",
                    )
                    .into_iter()
                    .filter(|(_, v)| *v > 0)
                    .map(|(k, v)| format!("{k}={v}")),
                );
                format!("replica {i}: [{}]", causes.join(", "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The stat summed over every replica.
    pub fn stat_total(&self, name: &str) -> u64 {
        (1..=self.options.replicas)
            .map(|i| self.stat(i, name))
            .sum()
    }

    /// Requests decided by the local fallback (allowed or denied) on every
    /// replica: each one a decision meshlimitd did not make.
    pub fn fallback_decisions(&self) -> u64 {
        self.stat_total("meshlimit.fallback_allowed") + self.stat_total("meshlimit.fallback_denied")
    }

    /// Requests admitted from quota leases, on every replica. The filter
    /// adds them to the stat on each tick (every 250 ms by default), so
    /// this first waits for one.
    pub fn lease_hits(&self) -> u64 {
        std::thread::sleep(Duration::from_millis(300));
        self.stat_total("meshlimit.lease_hits")
    }

    /// Requests decided with the global count: by meshlimitd's answer, or
    /// from a lease meshlimitd granted (see [`Topology::lease_hits`]).
    pub fn globally_allowed(&self) -> u64 {
        self.lease_hits() + self.stat_total("meshlimit.requests_allowed")
    }

    /// Requests replica `i` received from downstream.
    pub fn replica_requests(&self, i: usize) -> u64 {
        http::envoy_stats(
            &self.replica_admin(i),
            "^http\\.ingress\\.downstream_rq_total$",
        )
        .first()
        .map_or(0, |(_, v)| *v)
    }

    /// Runs `redis-cli` against this topology's Redis.
    pub fn redis_cli(&self, args: &[&str]) -> String {
        services::cli(&self.host, args)
    }

    /// The fixed-window count of limit `limit` (`rule/limit`) for the
    /// client with API key `client`, as Redis holds it (0 when none).
    pub fn key_count(&self, limit: &str, client: &str) -> u64 {
        let keys = self.redis_cli(&["--scan", "--pattern", "ml:*"]);
        // The hash tag of a short, plain subject (service/src/keys.rs).
        let tag = format!("{{e:hdr:x-api-key:{client}}}");
        keys.lines()
            .find(|k| k.contains(limit) && k.contains(&tag) && !k.ends_with(":ovr"))
            .map_or(0, |k| {
                self.redis_cli(&["GET", k]).trim().parse().unwrap_or(0)
            })
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Front first, so no client request reaches a half-stopped system.
        self.front.take();
        self.replicas.clear();
        self.fake.take();
        self.late.take();
        self.upstream.take();
        self.meshlimitd.take();
        self.redis.take();
        self.cluster.take();
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

fn meshlimitd_healthy(admin: &str) -> bool {
    http::envoy_stats(admin, "^cluster\\.meshlimit\\.membership_healthy$")
        .first()
        .is_some_and(|(_, v)| *v > 0)
}

/// Runs `envoy --mode validate` on a config text; returns (ok, output).
pub fn validate_envoy_config(config: &str, dir: &Path, name: &str) -> (bool, String) {
    let path: PathBuf = dir.join(format!("{name}.yaml"));
    write(&path, config);
    let out = Command::new(tools::envoy())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run envoy: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `config` without the meshlimit cluster's HTTP/2 options (the lines from
/// `typed_extension_protocol_options:` to `http2_protocol_options: {}`):
/// the cluster as it was over HTTP/1.1.
fn without_http2_options(config: &str) -> String {
    let lines: Vec<&str> = config.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim() == "typed_extension_protocol_options:");
    let end = lines
        .iter()
        .position(|l| l.trim() == "http2_protocol_options: {}");
    match (start, end) {
        (Some(start), Some(end)) if start < end => {
            let mut kept: Vec<&str> = lines[..start].to_vec();
            kept.extend_from_slice(&lines[end + 1..]);
            kept.join("\n") + "\n"
        }
        _ => panic!("replica.yaml's meshlimit cluster has no HTTP/2 options to leave out"),
    }
}
