//! Mesh policies end to end: rules that select requests by more than a
//! path, limits that count by request attributes, live overrides,
//! calendar windows, and identities from mTLS and verified JWTs.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::time::Duration;

use common::*;
use meshlimit_testbed::{Topology, TopologyOptions};

/// Plans chosen by a header the auth layer sets: `x-plan: free` gets 5 a
/// minute, `pro` 50, no header the default 2; through two replicas, so the
/// counts are global. A client sending both plan headers gets the default:
/// a header sent twice counts as absent.
#[test]
fn plans_are_rules_selected_by_a_header() {
    let plan = |name: &str, condition: Value, requests: u64| {
        json!({"name": name, "match": {"headers": [condition]},
               "limits": [{"name": "per-minute", "requests": requests, "window": "60s"}]})
    };
    let t = topology(
        PluginConfig::new()
            .rules(json!([
                plan("free", json!({"name": "x-plan", "exact": "free"}), 5),
                plan("pro", json!({"name": "x-plan", "exact": "pro"}), 50),
                plan("default", json!({"name": "x-plan", "absent": true}), 2),
            ]))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(20));
    let with_plan = |id: &str, plans: &[&str]| {
        let mut headers = key(id);
        for p in plans {
            headers.push(("x-plan", p.as_bytes().to_vec()));
        }
        headers
    };
    assert_eq!(burst(&t, &with_plan("f", &["free"]), 8), (5, 3));
    assert_eq!(burst(&t, &with_plan("p", &["pro"]), 55), (50, 5));
    assert_eq!(burst(&t, &with_plan("n", &[]), 4), (2, 2));
    assert_eq!(
        burst(&t, &with_plan("both", &["free", "pro"]), 4),
        (2, 2),
        "both plans at once: the default's 2"
    );
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(
        keys.contains("default/per-minute") && keys.contains("pro/per-minute"),
        "{keys}"
    );
    assert_no_vm_panics(&t);
}

/// A cap for a route whatever the client, on an exact path and a host.
#[test]
fn rules_match_hosts_and_exact_paths() {
    let t = single_replica(
        PluginConfig::new()
            .rules(json!([{
                "name": "login",
                "match": {"hosts": ["*.test"], "path": {"exact": "/login"}, "methods": ["GET"]},
                "limits": [{"name": "per-minute", "requests": 3, "window": "60s"}]
            }]))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(10));
    // The test client sends `host: meshlimit.test`.
    let login = |path: &str| t.get(path, &[("x-api-key", b"c")]).status;
    let statuses: Vec<u16> = (0..4).map(|_| login("/login")).collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(login("/login/other"), 200, "not the exact path");
    assert_eq!(login("/logins"), 200);
    let other_host = http_get_with_host(&t, "other.example", "/login");
    assert_eq!(other_host, 200, "another host is not limited");
}

fn http_get_with_host(t: &meshlimit_testbed::Topology, host: &str, path: &str) -> u16 {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(t.entry()).unwrap();
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nhost: {host}\r\nx-api-key: c\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = conn.read_to_string(&mut out);
    out.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn status(t: &Topology, path: &str, headers: &[(&str, &[u8])]) -> u16 {
    t.get(path, headers).status
}

/// `by: []`: one counter for the route, whoever calls: three clients
/// through two replicas, concurrently, get exactly 30 in total.
#[test]
fn a_route_cap_counts_every_client_together() {
    let t = topology(
        PluginConfig::new()
            .limit_field("requests", json!(30))
            .limit_field("by", json!([]))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(20));
    let allowed = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for id in ["a", "b", "c"] {
            let (t, allowed) = (&t, &allowed);
            s.spawn(move || {
                for _ in 0..15 {
                    match send(t, &key(id)).status {
                        200 => {
                            allowed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        429 => {}
                        other => panic!("status {other}"),
                    }
                }
            });
        }
    });
    assert_eq!(allowed.into_inner(), 30);
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert_eq!(keys.lines().count(), 1, "one counter: {keys}");
    assert_no_vm_panics(&t);
}

/// `by: ["header:x-tenant", "path"]`: per tenant per route; a request
/// without the tenant header is not counted on that limit, and says so.
#[test]
fn limits_count_by_a_tenant_and_a_route_together() {
    let t = single_replica(
        PluginConfig::new()
            .limit_field("requests", json!(3))
            .limit_field("by", json!(["header:x-tenant", "path"]))
            .build(),
    );
    wait_for_fresh_window(Duration::from_secs(10));
    let count = |tenant: Option<&[u8]>, path: &str| {
        let headers: Vec<(&str, &[u8])> = tenant.map(|v| ("x-tenant", v)).into_iter().collect();
        (0..4).filter(|_| status(&t, path, &headers) == 200).count()
    };
    assert_eq!(count(Some(b"acme"), "/a"), 3);
    assert_eq!(count(Some(b"acme"), "/b"), 3, "another route");
    assert_eq!(count(Some(b"umbrella"), "/a"), 3, "another tenant");
    assert_eq!(
        count(Some(b"acme"), "/a/../a"),
        0,
        "the same route, spelled otherwise"
    );
    assert_eq!(count(None, "/a"), 4, "no tenant: not counted");
    assert_eq!(t.stat(1, "meshlimit.skipped_missing_attribute"), 4);
    assert_no_vm_panics(&t);
}

/// The admin token of [`with_admin_api`]'s meshlimitd.
const ADMIN_TOKEN: &str = "admin-0123456789-secret";

/// A topology as `options` say, its meshlimitd with the admin API on
/// ([`ADMIN_TOKEN`]); the directory holds the token's file.
fn with_admin_api(mut options: TopologyOptions) -> (Topology, meshlimit_testbed::procs::TempDir) {
    let dir = meshlimit_testbed::procs::TempDir::new("admin-token");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, ADMIN_TOKEN).unwrap();
    options.meshlimitd_args.extend([
        "--admin-token-file".into(),
        token_file.display().to_string(),
    ]);
    (Topology::start(options), dir)
}

/// A live override through meshlimitd's admin API: a client exhausted at
/// 20 gets 20 more on both replicas once it is raised to 40 (cached
/// denials end within a second); deleting it restores 20; an override
/// that expires stops applying; a wrong admin token gets 401 and changes
/// nothing.
#[test]
fn a_live_override_applies_on_every_replica() {
    let (t, _dir) = with_admin_api(TopologyOptions {
        plugin_config: PluginConfig::new().build(),
        ..TopologyOptions::default()
    });
    let token = ADMIN_TOKEN;
    wait_for_fresh_window(Duration::from_secs(25));
    let admin = |method: &str, body: &str, token: &str| {
        let path = if method == "PUT" {
            "/v1/overrides/api/per-minute".to_string()
        } else {
            "/v1/overrides/api/per-minute?subject=hdr%3Ax-api-key%3Apartner".to_string()
        };
        let auth = format!("Bearer {token}");
        meshlimit_testbed::http::request(
            &t.meshlimitd_addr(),
            method,
            &path,
            &[("authorization", auth.as_bytes())],
            body.as_bytes(),
        )
        .unwrap()
    };
    let on = |replica: usize, n: usize| {
        (0..n)
            .filter(|_| {
                meshlimit_testbed::http::get(
                    &t.replica_addr(replica),
                    "/api",
                    &[("x-api-key", b"partner")],
                )
                .unwrap()
                .status
                    == 200
            })
            .count()
    };
    assert_eq!(burst(&t, &key("partner"), 21), (20, 1));
    let raise = r#"{"subject":"hdr:x-api-key:partner","requests":40}"#;
    let r = admin("PUT", raise, "wrong-token-0123456789");
    assert_eq!(r.status, 401);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(on(1, 1) + on(2, 1), 0, "a wrong token changed nothing");
    let r = admin("PUT", raise, token);
    assert_eq!(r.status, 200, "{}", r.body);
    std::thread::sleep(Duration::from_millis(1_100));
    // Replica 1 may lease units it does not use before the client moves
    // to replica 2; they come back once the client idles there (an
    // interval, 2 s, then a tick of 250 ms): docs/leases.md, "What is
    // exact".
    let first = on(1, 10);
    std::thread::sleep(Duration::from_millis(2_500));
    assert_eq!(first + on(2, 10), 20, "20 more, on both replicas");
    assert_eq!(on(1, 1) + on(2, 1), 0, "and no more");
    assert_eq!(admin("DELETE", "", token).status, 204);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(on(1, 1) + on(2, 1), 0, "back to 20");
    let brief = r#"{"subject":"hdr:x-api-key:partner","requests":41,"ttl_seconds":2}"#;
    assert_eq!(admin("PUT", brief, token).status, 200);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(on(1, 1), 1, "the 41st");
    std::thread::sleep(Duration::from_millis(2_000));
    let r = admin("GET", "", token);
    assert_eq!(r.status, 404, "expired: {}", r.body);
    assert_eq!(on(2, 2), 0);
    assert_no_vm_panics(&t);
}

/// A monthly quota at +02:00, a minute before a leap-day month end (the
/// script's clock shifted by meshlimitd's test hook): the deny's
/// Retry-After and RateLimit count to the real reset, and one second after
/// it the quota is whole, for March's 31 days.
#[test]
fn a_calendar_month_resets_at_the_real_month_end() {
    let t = Topology::start(TopologyOptions {
        plugin_config: PluginConfig::new()
            .limits(json!([{"name": "monthly", "requests": 3, "calendar": "month", "utc_offset": "+02:00"}]))
            .build(),
        replicas: 1,
        front: false,
        meshlimitd_args: vec!["--test-clock-offset-key".into(), "ml:test:clock".into()],
        ..TopologyOptions::default()
    });
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    // 2028-02-29T23:59:30+02:00: 30 s before March starts at +02:00.
    let feb_end_minus_30s: i64 = 1_835_474_370_000;
    let set_clock = |at: i64| {
        t.redis_cli(&["SET", "ml:test:clock", &(at - now_ms()).to_string()]);
    };
    set_clock(feb_end_minus_30s);
    let statuses: Vec<u16> = (0..3).map(|_| send(&t, &key("m")).status).collect();
    assert_eq!(statuses, [200, 200, 200]);
    let denied = send(&t, &key("m"));
    assert_eq!(denied.status, 429);
    let retry: i64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!((29..=31).contains(&retry), "retry-after {retry}");
    let ratelimit = denied.header("ratelimit").unwrap();
    let t_secs: i64 = ratelimit.rsplit("t=").next().unwrap().parse().unwrap();
    assert!(
        ratelimit.starts_with("\"api/monthly\";r=0;") && (29..=31).contains(&t_secs),
        "{ratelimit}"
    );
    set_clock(feb_end_minus_30s + 31_000);
    // A cached deny is trusted for a second.
    std::thread::sleep(Duration::from_millis(1_100));
    let march = send(&t, &key("m"));
    assert_eq!(march.status, 200);
    let ratelimit = march.header("ratelimit").unwrap();
    let t_secs: i64 = ratelimit.rsplit("t=").next().unwrap().parse().unwrap();
    let march_secs = 31 * 86_400 - 1;
    assert!(
        (t_secs - march_secs).abs() <= 2,
        "{ratelimit}: March (+02:00) has 31 days"
    );
    assert!(ratelimit.contains(";r=2;"), "{ratelimit}");
    assert_no_vm_panics(&t);
}

/// Redis and meshlimitd, with `plugin` for the replicas a test starts
/// itself (with a listener or filters of its own).
fn service_only(plugin: String) -> Topology {
    Topology::start(TopologyOptions {
        plugin_config: plugin,
        replicas: 0,
        front: false,
        ..TopologyOptions::default()
    })
}

/// Replica `i`'s usual config with its listener behind TLS: a server
/// certificate from `pki`, client certificates asked for (not required, so
/// that a caller without one reaches the filter) and checked against the CA.
fn mtls_replica_config(t: &Topology, i: usize, pki: &meshlimit_testbed::tls::Pki) -> String {
    let tls = format!(
        r#"    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: false
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{ filename: {cert} }}
              private_key: {{ filename: {key} }}
            validation_context:
              trusted_ca: {{ filename: {ca} }}
      filters:"#,
        cert = pki.path("replica.pem"),
        key = pki.path("replica.key"),
        ca = pki.path("ca.pem"),
    );
    let config = t.replica_config(i);
    assert!(config.contains("    filter_chains:\n    - filters:"));
    config.replacen("    filter_chains:\n    - filters:", &tls, 1)
}

/// A request over TLS with curl to replica `replica`: the status,
/// presenting client certificate `cert` (`<cert>.pem`/`.key`) if given,
/// with `headers`.
fn curl_status(
    t: &Topology,
    replica: usize,
    pki: &meshlimit_testbed::tls::Pki,
    path: &str,
    cert: Option<&str>,
    headers: &[&str],
) -> u16 {
    let addr = t.replica_addr(replica);
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-sS", "-o", "/dev/null", "-w", "%{http_code}"])
        .args(["--cacert", &pki.path("ca.pem")])
        .arg(format!("https://{addr}{path}"));
    if let Some(name) = cert {
        cmd.args(["--cert", &pki.path(&format!("{name}.pem"))])
            .args(["--key", &pki.path(&format!("{name}.key"))]);
    }
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run curl (scripts/setup.sh installs it): {e}"));
    let code = String::from_utf8_lossy(&out.stdout);
    code.trim()
        .parse()
        .unwrap_or_else(|_| panic!("curl: {code} {}", String::from_utf8_lossy(&out.stderr)))
}

/// Service-to-service limits keyed by the caller's mesh identity: the URI
/// SAN of its client certificate, through two replicas with mutual TLS
/// (calls alternate between them, so the counts are global). Two callers
/// get their own counters; a header claiming an identity changes nothing;
/// a caller without a certificate is not counted on a limit that skips it
/// and is refused by one configured to refuse.
#[test]
fn peer_identity_counts_per_calling_workload() {
    let plugin = PluginConfig::new()
        .rules(json!([
            {"name": "per-caller", "match": {"path": {"prefix": "/pay"}},
             "limits": [{"name": "per-second", "requests": 3, "window": "60s", "by": ["peer_identity"]}]},
            {"name": "strict", "match": {"path": {"prefix": "/strict"}},
             "limits": [{"name": "per-second", "requests": 3, "window": "60s", "by": ["peer_identity"],
                         "missing": "reject"}]}
        ]))
        .build();
    let t = service_only(plugin);
    let pki = meshlimit_testbed::tls::Pki::new(t.dir.path());
    pki.issue("replica", &format!("subjectAltName=IP:{}", t.host));
    for sa in ["checkout", "cart"] {
        pki.issue(
            sa,
            &format!("subjectAltName=URI:spiffe://cluster.local/ns/shop/sa/{sa}\nextendedKeyUsage=clientAuth"),
        );
    }
    let _replicas: Vec<_> = (1..=2)
        .map(|i| t.start_replica(i, &mtls_replica_config(&t, i, &pki)))
        .collect();
    wait_for_fresh_window(Duration::from_secs(15));
    // Calls alternate between the two replicas: the counts are global.
    let calls = |cert: Option<&str>, path: &str, headers: &[&str]| -> Vec<u16> {
        (0..4)
            .map(|i| curl_status(&t, 1 + i % 2, &pki, path, cert, headers))
            .collect()
    };
    assert_eq!(calls(Some("checkout"), "/pay", &[]), [200, 200, 200, 429]);
    // Claiming checkout's identity in headers does not borrow its counter.
    let claims = [
        "x-forwarded-client-cert: By=spiffe://x;URI=spiffe://cluster.local/ns/shop/sa/cart",
        "x-spiffe-id: spiffe://cluster.local/ns/shop/sa/cart",
    ];
    assert_eq!(calls(Some("cart"), "/pay", &claims), [200, 200, 200, 429]);
    assert_eq!(
        calls(None, "/pay", &claims),
        [200, 200, 200, 200],
        "no certificate: not counted"
    );
    let both = |stat: &str| t.stat(1, stat) + t.stat(2, stat);
    assert_eq!(both("meshlimit.skipped_missing_attribute"), 4);
    assert_eq!(
        calls(None, "/strict", &[])[0],
        403,
        "refused where configured"
    );
    assert_eq!(both("meshlimit.rejected_missing_attribute"), 4);
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(
        keys.contains("peer:spiffe://cluster.local/ns/shop/sa/checkout")
            && keys.contains("sa/cart}"),
        "{keys}"
    );
}

/// Base64url without padding (JWT segments).
fn b64url(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// An HS256 JWT for `claims`, signed with `secret` by the openssl command.
fn hs256_jwt(secret: &[u8], claims: &Value) -> String {
    use std::io::Write;
    let signing_input = format!(
        "{}.{}",
        b64url(br#"{"alg":"HS256","typ":"JWT","kid":"k1"}"#),
        b64url(claims.to_string().as_bytes())
    );
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let mut child = std::process::Command::new("openssl")
        .args([
            "dgst",
            "-sha256",
            "-mac",
            "HMAC",
            "-macopt",
            &format!("hexkey:{hex}"),
            "-binary",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("openssl runs (scripts/setup.sh installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(signing_input.as_bytes())
        .unwrap();
    let mac = child.wait_with_output().unwrap().stdout;
    assert_eq!(mac.len(), 32, "openssl HMAC-SHA256");
    format!("{signing_input}.{}", b64url(&mac))
}

/// Limits keyed by a verified JWT claim, plans chosen by another: Envoy's
/// `jwt_authn` (local JWKS, HS256 tokens signed here) writes the payload
/// to metadata; the filter counts by `jwt:sub` and picks the plan from the
/// `plan` claim. Two subjects get their own counters and plans; a header
/// named like the claim changes nothing; a token with a bad signature is
/// refused by `jwt_authn` and never counted.
#[test]
fn a_verified_jwt_claim_keys_the_counter() {
    let secret = b"meshlimit-test-hmac-key-32-bytes";
    let jwks = json!({"keys": [{"kty": "oct", "kid": "k1", "alg": "HS256", "k": b64url(secret)}]});
    let plan = |name: &str, condition: Value, requests: u64| {
        json!({"name": name, "match": {"claims": [condition]},
               "limits": [{"name": "per-sub", "requests": requests, "window": "60s", "by": ["jwt:sub"]}]})
    };
    let plugin = PluginConfig::new()
        .rules(json!([
            plan("pro", json!({"name": "plan", "exact": "pro"}), 5),
            plan("api", json!({"name": "plan", "absent": true}), 3),
        ]))
        .build();
    let t = service_only(plugin);
    let jwt_filter = format!(
        r#"          http_filters:
          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                test:
                  issuer: meshlimit-test
                  local_jwks: {{ inline_string: '{jwks}' }}
                  payload_in_metadata: jwt_payload
              rules:
              - match: {{ prefix: "/" }}
                requires: {{ provider_name: test }}
"#
    );
    let config = t
        .replica_config(1)
        .replacen("          http_filters:\n", &jwt_filter, 1);
    let _replica = t.start_replica(1, &config);
    wait_for_fresh_window(Duration::from_secs(15));
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3_600;
    let token = |sub: &str, key: &[u8]| {
        hs256_jwt(
            key,
            &json!({"iss": "meshlimit-test", "sub": sub, "exp": exp}),
        )
    };
    let calls = |token: &str| -> Vec<u16> {
        let auth = format!("Bearer {token}");
        (0..4)
            .map(|_| status(&t, "/api", &[("authorization", auth.as_bytes())]))
            .collect()
    };
    assert_eq!(calls(&token("alice", secret)), [200, 200, 200, 429]);
    assert_eq!(calls(&token("bob", secret)), [200, 200, 200, 429]);
    assert_eq!(
        calls(&token("mallory", b"not-the-key-at-all-not-the-key!!")),
        [401, 401, 401, 401],
        "a forged token stops at jwt_authn"
    );
    let keys = t.redis_cli(&["--scan", "--pattern", "ml:*"]);
    assert!(
        keys.contains("{e:jwt:sub:alice}") && keys.contains("{e:jwt:sub:bob}"),
        "{keys}"
    );
    assert!(!keys.contains("mallory"), "{keys}");
}

/// A live override lowered under a busy client served from leases (1,000
/// a minute, leased from its first requests; lowered to 100 when it has
/// used 200): meshlimitd refuses every call at once; the Envoy admits at
/// most what it held when the override came (units charged under the old
/// limit) before the first refusal, which ends the lease, and within a
/// tick (250 ms) every worker refuses the client. (Before, the Envoy spent
/// every unit it held, and its renewals granted before the override: 360
/// more requests in one run.) The filter's side:
/// `flow::tests::leases::a_refused_renewal_ends_the_lease`,
/// `a_lease_another_worker_ended_takes_back_this_workers_draw`.
#[test]
fn a_lowered_live_override_reaches_a_leased_client_within_what_its_envoy_held() {
    let (t, _dir) = with_admin_api(TopologyOptions {
        plugin_config: PluginConfig::new()
            .limits(json!([{"name": "per-minute", "requests": 1000, "window": "60s"}]))
            .build(),
        replicas: 1,
        front: false,
        ..TopologyOptions::default()
    });
    wait_for_fresh_window(Duration::from_secs(25));
    let status = || {
        meshlimit_testbed::http::get(&t.replica_addr(1), "/api", &[("x-api-key", b"abuser")])
            .unwrap()
            .status
    };
    assert!((0..200).all(|_| status() == 200));
    // Units leased to this Envoy and not spent: the ones decided by a
    // call were not leased (hits are counted on the tick, so not read).
    let leased = t.stat(1, "meshlimit.lease_units");
    let called = t.stat(1, "meshlimit.requests_allowed");
    assert!(leased > 0, "the client is served from leases");
    let held = leased - (200 - called);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = meshlimit_testbed::http::request(
        &t.meshlimitd_addr(),
        "PUT",
        "/v1/overrides/api/per-minute",
        &[("authorization", auth.as_bytes())],
        br#"{"subject":"hdr:x-api-key:abuser","requests":100}"#,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    // Refused once the first call meets the lower limit, on any worker.
    let admitted = (0..=held).take_while(|_| status() == 200).count() as u64;
    assert!(
        admitted <= held,
        "{admitted} admitted after the override, {held} held"
    );
    assert!(t.stat(1, "meshlimit.leases_ended") >= 1);
    // The other workers' draws go back within a tenth of a second by
    // their clocks, which a hit reads every 15 hits at least and the
    // root's tick every 250 ms.
    std::thread::sleep(Duration::from_millis(350));
    let later: Vec<u16> = (0..100).map(|_| status()).collect();
    assert!(later.iter().all(|&s| s == 429), "{later:?}");
    // Its refusals show the quota that refuses it.
    let r = meshlimit_testbed::http::get(&t.replica_addr(1), "/api", &[("x-api-key", b"abuser")])
        .unwrap();
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"api/per-minute\";q=100;w=60")
    );
    assert_no_vm_panics(&t);
}
