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
        let mut proc = Proc::spawn(
            "redis",
            Command::new(tools::redis_server())
                .args(["--bind", host, "--port", &REDIS_PORT.to_string()])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .arg("--dir")
                .arg(dir),
            dir,
        );
        let addr = format!("{host}:{REDIS_PORT}");
        wait_until(&mut proc, "answering PING", Duration::from_secs(10), || {
            ping(&addr)
        });
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
        let addr = format!("{host}:{MESHLIMITD_PORT}");
        let mut proc = Proc::spawn(
            "meshlimitd",
            Command::new(binary)
                .args(["--listen", &addr, "--redis-url", redis_url])
                .args(extra),
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
}
