//! Handles on a real `redis-server` and a real `meshlimitd`, each on a
//! loopback address of its own.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::http;
use crate::procs::{wait_until, Proc};
use crate::tools;

pub const REDIS_PORT: u16 = 16379;
pub const MESHLIMITD_PORT: u16 = 18080;

/// A loopback address no other topology of any test process uses, so fixed
/// port numbers never collide between tests running in parallel.
pub fn unique_host() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    format!("127.{}.{}.{}", 20 + pid % 200, (n / 200) % 256, 2 + n % 200)
}

pub struct RedisServer {
    pub host: String,
    proc: Proc,
}

impl RedisServer {
    pub fn start(host: &str, dir: &Path) -> RedisServer {
        Self::start_with(host, dir, REDIS_PORT, &[])
    }

    /// A redis-server on `port` with extra arguments (e.g. `--requirepass`).
    /// Ready once its port accepts connections.
    pub fn start_with(host: &str, dir: &Path, port: u16, extra: &[&str]) -> RedisServer {
        let mut proc = Proc::spawn(
            &format!("redis-{port}"),
            Command::new(tools::redis_server())
                .args(["--bind", host, "--port", &port.to_string()])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .arg("--dir")
                .arg(dir)
                .args(extra),
            dir,
        );
        let addr = format!("{host}:{port}");
        wait_until(
            &mut proc,
            "accepting connections",
            Duration::from_secs(10),
            || TcpStream::connect(&addr).is_ok(),
        );
        RedisServer {
            host: host.to_string(),
            proc,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://{}:{REDIS_PORT}", self.host)
    }

    pub fn stop(&mut self) {
        self.proc.stop();
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(&self.host, args)
    }
}

pub fn cli(host: &str, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", host, "-p", &REDIS_PORT.to_string()])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-cli: {e}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ping(addr: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

pub struct Meshlimitd {
    pub addr: String,
    pub proc: Proc,
}

impl Meshlimitd {
    /// Starts `binary` (the release build by default) and waits for /healthz.
    pub fn start(host: &str, redis_url: &str, dir: &Path, extra: &[&str]) -> Meshlimitd {
        Self::start_binary(&tools::meshlimitd(), host, redis_url, dir, extra)
    }

    pub fn start_binary(
        binary: &Path,
        host: &str,
        redis_url: &str,
        dir: &Path,
        extra: &[&str],
    ) -> Meshlimitd {
        Self::start_with_env(binary, host, redis_url, dir, extra, &[])
    }

    /// As [`Meshlimitd::start_binary`], with environment variables set.
    pub fn start_with_env(
        binary: &Path,
        host: &str,
        redis_url: &str,
        dir: &Path,
        extra: &[&str],
        env: &[(String, String)],
    ) -> Meshlimitd {
        let addr = format!("{host}:{MESHLIMITD_PORT}");
        let mut proc = Proc::spawn(
            "meshlimitd",
            Command::new(binary)
                .args(["--listen", &addr, "--redis-url", redis_url])
                .args(extra)
                .envs(env.iter().map(|(k, v)| (k, v))),
            dir,
        );
        wait_until(&mut proc, "healthy", Duration::from_secs(10), || {
            http::get(&addr, "/healthz", &[]).is_ok_and(|r| r.status == 200)
        });
        Meshlimitd { addr, proc }
    }
}

/// A real redis-server and a meshlimitd binary in front of it, on a
/// loopback address of their own: the fixture of meshlimitd's own tests.
pub struct Standalone {
    pub redis: RedisServer,
    pub service: Meshlimitd,
    pub dir: crate::procs::TempDir,
}

impl Standalone {
    pub fn start(binary: &Path, extra: &[&str]) -> Standalone {
        let dir = crate::procs::TempDir::new("meshlimitd");
        let host = unique_host();
        let redis = RedisServer::start(&host, dir.path());
        let service = Meshlimitd::start_binary(binary, &host, &redis.url(), dir.path(), extra);
        Standalone {
            redis,
            service,
            dir,
        }
    }

    /// POSTs `body` to meshlimitd's check API.
    pub fn post_check(&self, body: &serde_json::Value) -> http::Response {
        let bytes = serde_json::to_vec(body).unwrap_or_default();
        http::request(&self.service.addr, "POST", "/v1/check", &[], &bytes)
            .unwrap_or_else(|e| panic!("POST /v1/check to {}: {e}", self.service.addr))
    }

    /// The answer of a check call meshlimitd must accept (200).
    pub fn check(&self, body: &serde_json::Value) -> serde_json::Value {
        let r = self.post_check(body);
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str(&r.body)
            .unwrap_or_else(|e| panic!("meshlimitd's answer is not JSON ({e}): {}", r.body))
    }
}

/// A node of a [`RedisCluster`], as `CLUSTER NODES` describes it.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// Slot ranges served (masters only).
    pub slots: Vec<(u16, u16)>,
}

/// A real Redis Cluster: `masters` masters with one replica each, joined
/// with `redis-cli --cluster create`. Ports 17001.. (their cluster bus is
/// port + 10000, which must stay below 65536). Settings from the design
/// notes: a 1 s node timeout and replica validity factor 0, so a replica
/// takes over in about 3 s after its master dies.
pub struct RedisCluster {
    pub host: String,
    nodes: Vec<(u16, Proc)>,
}

pub const CLUSTER_BASE_PORT: u16 = 17001;

impl RedisCluster {
    pub fn start(host: &str, dir: &Path, masters: u16) -> RedisCluster {
        let mut nodes = Vec::new();
        for port in CLUSTER_BASE_PORT..CLUSTER_BASE_PORT + 2 * masters {
            let node_dir = dir.join(format!("node-{port}"));
            std::fs::create_dir_all(&node_dir)
                .unwrap_or_else(|e| panic!("cannot create {}: {e}", node_dir.display()));
            let mut proc = Proc::spawn(
                &format!("redis-{port}"),
                Command::new(tools::redis_server())
                    .args(["--bind", host, "--port", &port.to_string()])
                    .args([
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                    ])
                    .args([
                        "--cluster-node-timeout",
                        "1000",
                        "--cluster-replica-validity-factor",
                        "0",
                    ])
                    // As docs/operators.md recommends for meshlimit: the
                    // live masters keep answering while a dead one's slots
                    // wait for their failover (with the default `yes`,
                    // every node refuses every command until then).
                    .args(["--cluster-require-full-coverage", "no"])
                    // On loopback a node's outgoing address is 127.0.0.1;
                    // it must announce the address clients can reach.
                    .args(["--cluster-announce-ip", host])
                    .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                    .arg("--dir")
                    .arg(&node_dir),
                dir,
            );
            let addr = format!("{host}:{port}");
            wait_until(&mut proc, "answering PING", Duration::from_secs(10), || {
                ping(&addr)
            });
            nodes.push((port, proc));
        }
        let addrs: Vec<String> = nodes.iter().map(|(p, _)| format!("{host}:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli --cluster create: {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster {
            host: host.to_string(),
            nodes,
        };
        cluster.wait_ok(Duration::from_secs(20));
        cluster
    }

    /// Waits until every live node says `cluster_state:ok` and agrees.
    pub fn wait_ok(&self, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let ok = self
                .nodes
                .iter()
                .filter(|(p, _)| ping(&format!("{}:{p}", self.host)))
                .all(|(p, _)| {
                    self.cli(*p, &["cluster", "info"])
                        .contains("cluster_state:ok")
                });
            if ok {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "cluster not ok after {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Seed URLs for meshlimitd, comma-separated.
    pub fn seeds(&self) -> String {
        self.nodes
            .iter()
            .map(|(p, _)| format!("redis://{}:{p}", self.host))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-h", &self.host, "-p", &port.to_string()])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli: {e}"));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A live node's port, to ask cluster-wide questions.
    fn any_live(&self) -> u16 {
        self.nodes
            .iter()
            .map(|(p, _)| *p)
            .find(|p| ping(&format!("{}:{p}", self.host)))
            .unwrap_or(CLUSTER_BASE_PORT)
    }

    pub fn keyslot(&self, key: &str) -> u16 {
        self.cli(self.any_live(), &["cluster", "keyslot", key])
            .trim()
            .parse()
            .unwrap_or(u16::MAX)
    }

    pub fn nodes(&self) -> Vec<ClusterNode> {
        self.cli(self.any_live(), &["cluster", "nodes"])
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let port = f.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
                let flags = f.get(2)?;
                if flags.contains("fail") {
                    return None;
                }
                let slots = f
                    .iter()
                    .skip(8)
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| {
                        let (a, b) = s.split_once('-').unwrap_or((s, s));
                        Some((a.parse().ok()?, b.parse().ok()?))
                    })
                    .collect();
                Some(ClusterNode {
                    id: (*f.first()?).to_string(),
                    port,
                    master: flags.contains("master"),
                    slots,
                })
            })
            .collect()
    }

    /// The master serving `slot` now.
    pub fn master_of(&self, slot: u16) -> Option<ClusterNode> {
        self.nodes()
            .into_iter()
            .find(|n| n.master && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
    }

    /// Kills a node outright (SIGKILL), like a crashed host, and waits
    /// until its process is gone.
    pub fn kill(&self, port: u16) {
        let Some(pid) = self
            .nodes
            .iter()
            .find(|(p, _)| *p == port)
            .and_then(|(_, proc)| proc.pid())
        else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while ping(&format!("{}:{port}", self.host)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
