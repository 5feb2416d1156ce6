//! meshlimitd and Redis' own ways to be safe and available: AUTH, TLS, and
//! Sentinel failover, against real redis-server processes.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use meshlimit_testbed::http;
use meshlimit_testbed::procs::{wait_until, Proc, TempDir};
use meshlimit_testbed::services::{unique_host, Meshlimitd, RedisServer};
use meshlimit_testbed::tls::Pki;
use meshlimit_testbed::tools;

const CHECK: &[u8] = br#"{"checks":[{"subject":"s","limits":[{"name":"a/m","requests":1000,"window_ms":60000,"algorithm":"fixed_window"}]}]}"#;

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshlimitd"))
}

fn check_status(addr: &str) -> u16 {
    http::request(addr, "POST", "/v1/check", &[], CHECK).map_or(0, |r| r.status)
}

#[test]
fn a_wrong_password_is_a_clear_error_and_a_failing_readyz_not_a_crash() {
    let dir = TempDir::new("auth");
    let host = unique_host();
    // The default user needs a password, and an ACL user may only touch
    // meshlimit's keys and run what meshlimitd needs.
    let _redis = RedisServer::start_with(
        &host,
        dir.path(),
        16379,
        &[
            "--requirepass",
            "s3cret",
            "--user",
            "meshlimit",
            "on",
            ">limiter-pw",
            "~ml:*",
            "+@all",
        ],
    );
    let mut wrong = Meshlimitd::start_binary(
        binary(),
        &host,
        &format!("redis://:nope@{host}:16379"),
        dir.path(),
        &[],
    );
    std::thread::sleep(Duration::from_millis(300));
    let ready = http::get(&wrong.addr, "/readyz", &[]).unwrap();
    assert_eq!(ready.status, 503);
    assert!(
        ready.body.to_lowercase().contains("pass") || ready.body.contains("AUTH"),
        "{}",
        ready.body
    );
    assert_eq!(check_status(&wrong.addr), 503);
    assert!(wrong.proc.alive(), "keeps running, retrying");
    let log = wrong.proc.output();
    assert!(
        log.contains("redis not usable yet"),
        "the startup log says why:\n{log}"
    );
    assert!(
        !log.contains("s3cret") && !log.contains(":nope@"),
        "no password in the log:\n{log}"
    );
    drop(wrong);
    let right = Meshlimitd::start_binary(
        binary(),
        &host,
        &format!("redis://meshlimit:limiter-pw@{host}:16379"),
        dir.path(),
        &[],
    );
    assert_eq!(http::get(&right.addr, "/readyz", &[]).unwrap().status, 200);
    assert_eq!(
        check_status(&right.addr),
        200,
        "an ACL user with a password works"
    );
    assert!(
        !right.proc.output().contains("limiter-pw"),
        "no password in the log"
    );
}

/// A redis-server on `host:port` that speaks TLS only, with the
/// certificates of [`private_ca`] in `d`, and `extra` settings.
fn tls_redis(d: &Path, host: &str, port: u16, extra: &[&str]) -> Proc {
    spawn_listening(
        &format!("redis-tls-{port}"),
        Command::new(tools::redis_server())
            .args([
                "--bind",
                host,
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
            ])
            .args([
                "--tls-cert-file",
                "redis.pem",
                "--tls-key-file",
                "redis.key",
            ])
            .args([
                "--tls-ca-cert-file",
                "ca.pem",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(extra)
            .current_dir(d),
        d,
        &format!("{host}:{port}"),
        "listening for TLS",
    )
}

/// Starts `cmd` and waits until it accepts connections on `addr`
/// (`what`: the log line that says so, for the failure message).
fn spawn_listening(name: &str, cmd: &mut Command, dir: &Path, addr: &str, what: &str) -> Proc {
    let mut proc = Proc::spawn(name, cmd, dir);
    wait_until(&mut proc, what, Duration::from_secs(10), || {
        std::net::TcpStream::connect(addr).is_ok()
    });
    proc
}

/// A CA (ca.pem, ca.key) and a server certificate it signed for `host`
/// (redis.pem, redis.key), in `d`.
fn private_ca(d: &Path, host: &str) -> Pki {
    let pki = Pki::new(d);
    pki.issue("redis", &format!("subjectAltName=IP:{host}"));
    pki
}

#[test]
fn tls_with_a_private_ca_and_a_client_certificate() {
    let dir = TempDir::new("tls");
    let host = unique_host();
    let d = dir.path();
    let pki = private_ca(d, &host);
    let _redis = tls_redis(d, &host, 16380, &["--tls-auth-clients", "no"]);
    let ca = d.join("ca.pem");
    let service = Meshlimitd::start_binary(
        binary(),
        &host,
        &format!("rediss://{host}:16380"),
        d,
        &["--redis-ca-file", ca.to_str().unwrap()],
    );
    assert_eq!(
        http::get(&service.addr, "/readyz", &[]).unwrap().status,
        200,
        "{}",
        service.proc.output()
    );
    assert_eq!(check_status(&service.addr), 200);
    // Without the CA the certificate is not trusted.
    drop(service);
    let untrusting =
        Meshlimitd::start_binary(binary(), &host, &format!("rediss://{host}:16380"), d, &[]);
    assert_eq!(
        http::get(&untrusting.addr, "/readyz", &[]).unwrap().status,
        503
    );
    drop(untrusting);

    // Mutual TLS: a Redis that demands a client certificate signed by the CA.
    pki.issue("client", "extendedKeyUsage=clientAuth");
    let _mtls = tls_redis(d, &host, 16381, &["--tls-auth-clients", "yes"]);
    let mtls_addr = format!("{host}:16381");
    let url = format!("rediss://{mtls_addr}");
    let (cert, key) = (d.join("client.pem"), d.join("client.key"));
    let no_cert = Meshlimitd::start_binary(
        binary(),
        &host,
        &url,
        d,
        &["--redis-ca-file", ca.to_str().unwrap()],
    );
    assert_eq!(
        http::get(&no_cert.addr, "/readyz", &[]).unwrap().status,
        503,
        "Redis refuses a client without a certificate"
    );
    drop(no_cert);
    let with_cert = Meshlimitd::start_binary(
        binary(),
        &host,
        &url,
        d,
        &[
            "--redis-ca-file",
            ca.to_str().unwrap(),
            "--redis-client-cert",
            cert.to_str().unwrap(),
            "--redis-client-key",
            key.to_str().unwrap(),
        ],
    );
    assert_eq!(
        http::get(&with_cert.addr, "/readyz", &[]).unwrap().status,
        200,
        "{}",
        with_cert.proc.output()
    );
    assert_eq!(check_status(&with_cert.addr), 200);
}

fn sentinel(host: &str, dir: &Path, port: u16, master_port: u16) -> Proc {
    let conf = dir.join(format!("sentinel-{port}.conf"));
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind {host}\nprotected-mode no\ndir {}\n\
             sentinel announce-ip {host}\n\
             sentinel monitor mymaster {host} {master_port} 2\n\
             sentinel down-after-milliseconds mymaster 1000\n\
             sentinel failover-timeout mymaster 5000\n",
            dir.display()
        ),
    )
    .unwrap();
    spawn_listening(
        &format!("sentinel-{port}"),
        Command::new(tools::redis_server())
            .arg(&conf)
            .arg("--sentinel"),
        dir,
        &format!("{host}:{port}"),
        "accepting connections",
    )
}

#[test]
fn sentinel_failover_is_followed_without_a_restart() {
    sentinel_failover("-KILL", 16381);
}

/// A master that goes silent (stopped, partitioned, powered off) rather
/// than refusing connections: every call times out instead of failing, so
/// the cached connection to it must be dropped on timeouts too, or
/// meshlimitd keeps answering 503 until TCP gives up.
#[test]
fn a_silent_sentinel_master_is_replaced_too() {
    sentinel_failover("-STOP", 16391);
}

/// Starts a master (on `port`), a replica and three sentinels, ends the
/// master with `signal`, and waits for checks to be decided again.
fn sentinel_failover(signal: &str, port: u16) {
    let (replica_port, sentinel_port) = (port + 1, port + 10_000);
    let dir = TempDir::new("sentinel");
    let host = unique_host();
    let d = dir.path();
    let master_dir = d.join("master");
    let replica_dir = d.join("replica");
    std::fs::create_dir_all(&master_dir).unwrap();
    std::fs::create_dir_all(&replica_dir).unwrap();
    let mut master =
        RedisServer::start_with(&host, &master_dir, port, &["--replica-announce-ip", &host]);
    // On loopback a node's outgoing address is 127.0.0.1, not its own:
    // each announces the address it listens on.
    let _replica = RedisServer::start_with(
        &host,
        &replica_dir,
        replica_port,
        &[
            "--replicaof",
            &host,
            &port.to_string(),
            "--replica-announce-ip",
            &host,
        ],
    );
    let _sentinels: Vec<Proc> = (0..3)
        .map(|i| sentinel(&host, d, sentinel_port + i, port))
        .collect();
    std::thread::sleep(Duration::from_millis(1_500));
    let urls: Vec<String> = (0..3)
        .map(|i| format!("redis://{host}:{}", sentinel_port + i))
        .collect();
    let service = Meshlimitd::start_binary(
        binary(),
        &host,
        &urls.join(","),
        d,
        &["--redis-mode", "sentinel", "--sentinel-master", "mymaster"],
    );
    assert_eq!(
        check_status(&service.addr),
        200,
        "{}",
        service.proc.output()
    );
    let killed = Instant::now();
    if let Some(pid) = master.pid() {
        let _ = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status();
    }
    let mut statuses = Vec::new();
    loop {
        let s = check_status(&service.addr);
        statuses.push(s);
        assert!(s == 200 || s == 503, "only decisions or fast 503s: {s}");
        if s == 200 && statuses.len() > 1 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "never failed over"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "sentinel failover ({signal}): checks global again {} ms after the master died",
        killed.elapsed().as_millis()
    );
    if let Some(pid) = master.pid() {
        let _ = Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .status();
    }
    master.stop();
}

#[test]
fn sentinel_over_tls_finds_and_uses_the_master_over_tls() {
    let dir = TempDir::new("sentinel-tls");
    let host = unique_host();
    let d = dir.path();
    private_ca(d, &host);
    // A master and a sentinel that listen on TLS only; the sentinel talks
    // to the master over TLS too.
    let _master = tls_redis(
        d,
        &host,
        16382,
        &["--tls-auth-clients", "no", "--tls-replication", "yes"],
    );
    let conf = d.join("sentinel-tls.conf");
    std::fs::write(
        &conf,
        format!(
            "port 0\ntls-port 16383\nbind {host}\nprotected-mode no\ndir {}\n\
             tls-cert-file redis.pem\ntls-key-file redis.key\ntls-ca-cert-file ca.pem\n\
             tls-auth-clients no\ntls-replication yes\n\
             sentinel announce-ip {host}\n\
             sentinel monitor mymaster {host} 16382 1\n",
            d.display()
        ),
    )
    .unwrap();
    let sentinel_addr = format!("{host}:16383");
    let _sentinel = spawn_listening(
        "sentinel-tls",
        Command::new(tools::redis_server())
            .arg(&conf)
            .arg("--sentinel")
            .current_dir(d),
        d,
        &sentinel_addr,
        "sentinel listening for TLS",
    );
    let ca = d.join("ca.pem");
    let service = Meshlimitd::start_binary(
        binary(),
        &host,
        &format!("rediss://{sentinel_addr}"),
        d,
        &[
            "--redis-mode",
            "sentinel",
            "--sentinel-master",
            "mymaster",
            "--redis-ca-file",
            ca.to_str().unwrap(),
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while http::get(&service.addr, "/readyz", &[]).unwrap().status != 200 {
        assert!(
            Instant::now() < deadline,
            "not ready over TLS: {}",
            service.proc.output()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(check_status(&service.addr), 200);
}
