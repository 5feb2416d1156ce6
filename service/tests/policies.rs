//! Mesh policies in meshlimitd, against real Redis: limits counted by
//! subjects of their own (one check, several counters), calendar windows
//! (with the test clock hook, across a leap day and a month end), live
//! overrides through the admin API, and, on a real Redis Cluster, checks
//! whose counters live in several slots (decided slot by slot, refunded on
//! a deny).

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use meshlimit_protocol::{Calendar, CalendarUnit};
use meshlimit_testbed::http;
use meshlimit_testbed::procs::{eventually, TempDir};
use meshlimit_testbed::services::{unique_host, Meshlimitd, RedisCluster, Standalone};
use serde_json::{json, Value};

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshlimitd"))
}

fn decide(addr: &str, subject: &str, limits: &[Value]) -> Value {
    let body =
        serde_json::to_vec(&json!({"checks": [{"subject": subject, "limits": limits}]})).unwrap();
    let r = http::request(addr, "POST", "/v1/check", &[], &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    v["results"][0].clone()
}

fn allowed(v: &Value) -> bool {
    v["allowed"] == json!(true)
}

fn limit(name: &str, requests: u64, subject: Option<&str>) -> Value {
    let mut l = json!({"name": name, "requests": requests, "window_ms": 60_000, "algorithm": "fixed_window"});
    if let Some(s) = subject {
        l["subject"] = json!(s);
    }
    l
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A route cap (`*`) and a per-client limit in one check: the cap counts
/// everyone, the client limit each client, and a denied request charges
/// neither.
#[test]
fn limits_with_their_own_subjects_share_one_decision() {
    let f = Standalone::start(binary(), &[]);
    let addr = &f.service.addr;
    let limits = |cap: u64| {
        [
            limit("route/cap", cap, Some("*")),
            limit("route/per-client", 2, None),
        ]
    };
    let a: Vec<bool> = (0..3)
        .map(|_| allowed(&decide(addr, "a", &limits(3))))
        .collect();
    assert_eq!(a, [true, true, false], "a: its own 2");
    let b: Vec<bool> = (0..2)
        .map(|_| allowed(&decide(addr, "b", &limits(3))))
        .collect();
    assert_eq!(b, [true, false], "b: the cap's last unit");
    // b's denied request charged nothing: with a higher cap it has 1 left.
    let more = decide(addr, "b", &limits(10));
    assert!(allowed(&more));
    assert_eq!(more["limits"][1]["remaining"], json!(0));
    assert_eq!(
        f.redis
            .cli(&["GET", "ml:{e:%2A}:route/cap:fw:60000"])
            .trim(),
        "4"
    );
}

/// The script's calendar edges are the protocol crate's, at a leap day and
/// a year end, with a UTC offset; a monthly quota exhausted before a month
/// end is whole again one second after it, for the new month's length.
#[test]
fn calendar_windows_end_on_the_real_month_end() {
    let f = Standalone::start(binary(), &["--test-clock-offset-key", "ml:test:clock"]);
    let addr = &f.service.addr;
    let monthly = Calendar {
        unit: CalendarUnit::Month,
        utc_offset_minutes: 120,
    };
    let limit = |requests: u64, cal: &Calendar| {
        json!({"name": format!("api/{}", cal.key_suffix().replace('+', "p").replace('-', "m")), "requests": requests,
               "window_ms": cal.unit.max_len_ms(), "algorithm": "fixed_window",
               "calendar": cal})
    };
    // Shift the script's clock so that it reads `at` (Unix ms).
    let set_clock = |at: i64| {
        f.redis
            .cli(&["SET", "ml:test:clock", &(at - now_ms()).to_string()]);
    };
    // 2028-02-29T23:59:00+02:00, one minute before March at +02:00.
    let leap_evening: i64 = 1_835_474_340_000;
    let cases = [
        (monthly, leap_evening),
        (
            Calendar {
                unit: CalendarUnit::Day,
                utc_offset_minutes: -300,
            },
            leap_evening,
        ),
        (
            Calendar {
                unit: CalendarUnit::Week,
                utc_offset_minutes: 0,
            },
            leap_evening,
        ),
        // 2027-12-31T23:00Z: the year rolls over at UTC.
        (
            Calendar {
                unit: CalendarUnit::Month,
                utc_offset_minutes: 0,
            },
            1_830_294_000_000,
        ),
    ];
    for (cal, at) in cases {
        set_clock(at);
        let v = decide(
            addr,
            &format!("cal-{}", cal.key_suffix()),
            &[limit(5, &cal)],
        );
        let expected = cal.window(at as u64).1 as i64 - at;
        let reset = v["limits"][0]["reset_after_ms"].as_i64().unwrap();
        assert!(
            (reset - expected).abs() < 1_000,
            "{cal:?}: reset {reset} ms, the window ends in {expected} ms"
        );
    }
    // Exhaust February's quota a minute before its end...
    set_clock(leap_evening);
    let l = [limit(3, &monthly)];
    let feb: Vec<bool> = (0..4).map(|_| allowed(&decide(addr, "edge", &l))).collect();
    assert_eq!(feb, [true, true, true, false]);
    let denied = decide(addr, "edge", &l);
    let retry = denied["limits"][0]["retry_after_ms"].as_i64().unwrap();
    assert!((59_000..=60_000).contains(&retry), "retry {retry}");
    // ...and one second into March (+02:00) it is whole, for 31 days.
    set_clock(leap_evening + 61_000);
    let march = decide(addr, "edge", &l);
    assert!(allowed(&march));
    assert_eq!(march["limits"][0]["remaining"], json!(2));
    let reset = march["limits"][0]["reset_after_ms"].as_i64().unwrap();
    let march_len = 31 * 86_400_000 - 1_000;
    assert!((reset - march_len).abs() < 1_000, "reset {reset}");
}

const ADMIN_TOKEN: &str = "admin-secret-0123456789";

/// meshlimitd with its admin API on, behind [`ADMIN_TOKEN`] (in a file of
/// the directory returned, which must outlive it).
fn with_admin_api(tag: &str) -> (Standalone, TempDir) {
    let dir = TempDir::new(tag);
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, ADMIN_TOKEN).unwrap();
    let f = Standalone::start(
        binary(),
        &["--admin-token-file", token_file.to_str().unwrap()],
    );
    (f, dir)
}

fn admin(addr: &str, method: &str, path: &str, token: &str, body: &str) -> http::Response {
    let auth = format!("Bearer {token}");
    http::request(
        addr,
        method,
        path,
        &[
            ("authorization", auth.as_bytes()),
            ("content-type", b"application/json"),
        ],
        body.as_bytes(),
    )
    .unwrap()
}

/// A live override raises a client's limit at once, shows in the answer,
/// ends when deleted or expired; a wrong token changes nothing.
#[test]
fn live_overrides_apply_at_once_and_end_when_told() {
    let (f, _dir) = with_admin_api("admin");
    // Its counts are in one fixed window of a minute: start early in one
    // (Redis and this process share the clock), or a minute's edge
    // restores the quota midway.
    let into_minute = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() % 60_000) as u64;
    if into_minute > 50_000 {
        std::thread::sleep(Duration::from_millis(60_300 - into_minute));
    }
    let token = ADMIN_TOKEN;
    let addr = &f.service.addr;
    let l = [limit("api/per-minute", 3, None)];
    let n = |k: usize| {
        (0..k)
            .filter(|_| allowed(&decide(addr, "hdr:x-api-key:partner-a", &l)))
            .count()
    };
    assert_eq!(n(5), 3);
    let path = "/v1/overrides/api/per-minute";
    let put = r#"{"subject":"hdr:x-api-key:partner-a","requests":6}"#;
    // A wrong token: 401, nothing stored.
    let r = admin(addr, "PUT", path, "wrong-token-0123456789", put);
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(n(1), 0);
    let r = admin(addr, "PUT", path, token, put);
    assert_eq!(r.status, 200, "{}", r.body);
    let shown: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(shown["requests"], json!(6));
    // Three more at once, and the answer reports the new limit.
    let v = decide(addr, "hdr:x-api-key:partner-a", &l);
    assert!(allowed(&v));
    assert_eq!(v["limits"][0]["limit"], json!(6));
    assert_eq!(n(3), 2);
    let q = format!("{path}?subject=hdr%3Ax-api-key%3Apartner-a");
    let r = admin(addr, "GET", &q, token, "");
    assert_eq!(r.status, 200, "{}", r.body);
    // Another client keeps the configured limit.
    let other: Vec<bool> = (0..4)
        .map(|_| allowed(&decide(addr, "hdr:x-api-key:b", &l)))
        .collect();
    assert_eq!(other, [true, true, true, false]);
    // Deleted: back to 3 (already 6 spent).
    assert_eq!(admin(addr, "DELETE", &q, token, "").status, 204);
    assert_eq!(admin(addr, "GET", &q, token, "").status, 404);
    assert_eq!(n(1), 0);
    // An override with a one-second life stops applying by itself.
    let short = r#"{"subject":"hdr:x-api-key:partner-a","requests":100,"ttl_seconds":1}"#;
    assert_eq!(admin(addr, "PUT", path, token, short).status, 200);
    assert_eq!(n(1), 1);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(n(1), 0, "expired");
    // Bad input is refused with the field named.
    let r = admin(addr, "PUT", path, token, r#"{"subject":"x","requests":0}"#);
    assert_eq!(r.status, 400);
    assert!(r.body.contains("requests"), "{}", r.body);
    let r = admin(addr, "PUT", "/v1/overrides/a%7Bb/c", token, put);
    assert_eq!(r.status, 400, "{}", r.body);
}

/// Without `--admin-token-file` there is no admin API at all.
#[test]
fn the_admin_api_is_off_unless_configured() {
    let f = Standalone::start(binary(), &[]);
    let r = admin(
        &f.service.addr,
        "PUT",
        "/v1/overrides/api/m",
        "anything-0123456789",
        r#"{"subject":"s","requests":5}"#,
    );
    assert_eq!(r.status, 404, "{}", r.body);
}

/// A real 3-master Redis Cluster and a meshlimitd deciding on it (with
/// `extra` arguments), stopped in that order.
struct OnCluster {
    service: Meshlimitd,
    cluster: RedisCluster,
    _dir: TempDir,
}

impl OnCluster {
    fn start(tag: &str, extra: &[&str]) -> OnCluster {
        let dir = TempDir::new(tag);
        let host = unique_host();
        let cluster = RedisCluster::start(&host, dir.path(), 3);
        let mut args = vec!["--redis-mode", "cluster"];
        args.extend_from_slice(extra);
        let service =
            Meshlimitd::start_binary(binary(), &host, &cluster.seeds(), dir.path(), &args);
        OnCluster {
            service,
            cluster,
            _dir: dir,
        }
    }

    /// Every node's port.
    fn ports(&self) -> Vec<u16> {
        self.cluster
            .seeds()
            .split(',')
            .filter_map(|s| s.rsplit(':').next()?.parse().ok())
            .collect()
    }

    /// The value of `key`, wherever its slot lives.
    fn get(&self, key: &str) -> String {
        let port = self.ports().first().copied().unwrap();
        self.cluster
            .cli(port, &["-c", "GET", key])
            .trim()
            .to_string()
    }

    /// The route cap's counter and `client`'s, of limits named
    /// `<prefix>/cap` and `<prefix>/client` (fixed windows of a minute).
    fn counters(&self, prefix: &str, client: &str) -> [i64; 2] {
        let tag = meshlimitd::keys::subject_tag;
        [
            format!("ml:{{{}}}:{prefix}/cap:fw:60000", tag("*")),
            format!("ml:{{{}}}:{prefix}/client:fw:60000", tag(client)),
        ]
        .map(|k| self.get(&k).parse::<i64>().unwrap_or(0))
    }
}

/// Subjects (`prefix` and a number) whose counters are not in the slot of
/// the route cap's (`*`).
fn clients_off_the_caps_slot(prefix: &str, n: usize) -> Vec<String> {
    let slot = |s: &str| meshlimitd::keys::tag_slot(&meshlimitd::keys::subject_tag(s));
    (0..100)
        .map(|i| format!("{prefix}{i}"))
        .filter(|c| slot(c) != slot("*"))
        .take(n)
        .collect()
}

/// On a Redis Cluster, a check whose counters live in different slots is
/// decided slot by slot; when one slot denies, what the others charged is
/// given back, for every algorithm of the per-client limit.
#[test]
fn a_check_across_cluster_slots_charges_nothing_when_denied() {
    let on = OnCluster::start("xslot", &[]);
    let addr = &on.service.addr;
    let clients = clients_off_the_caps_slot("c", 4);
    for algorithm in [
        "fixed_window",
        "sliding_window_counter",
        "sliding_window_log",
        "token_bucket",
    ] {
        let cap = json!({"name": format!("{algorithm}/cap"), "requests": 3, "window_ms": 60_000,
                         "algorithm": "fixed_window", "subject": "*"});
        let per = json!({"name": format!("{algorithm}/client"), "requests": 1, "window_ms": 60_000,
                         "algorithm": algorithm});
        let both = [cap.clone(), per.clone()];
        let c = |i: usize| clients[i].as_str();
        assert!(allowed(&decide(addr, c(0), &both)), "{algorithm}");
        // The client's own limit denies: the cap's charge is given back...
        assert!(!allowed(&decide(addr, c(0), &both)), "{algorithm}");
        assert!(allowed(&decide(addr, c(1), &both)), "{algorithm}");
        assert!(
            allowed(&decide(addr, c(2), &both)),
            "{algorithm}: the cap had room"
        );
        // ...and the cap denies: the client's charge is given back.
        let denied = decide(addr, c(3), &both);
        assert!(!allowed(&denied), "{algorithm}");
        assert_eq!(denied["limits"][1]["remaining"], json!(1), "{algorithm}");
        let alone = decide(addr, c(3), std::slice::from_ref(&per));
        assert!(allowed(&alone), "{algorithm}: {alone}");
    }
    // A reservation across slots gets a receipt per limit (one per run),
    // and its settlement finds each counter in its own slot.
    let cap = json!({"name": "budget/cap", "requests": 100, "window_ms": 60_000,
                     "algorithm": "fixed_window", "subject": "*", "cost": 50});
    let per = json!({"name": "budget/client", "requests": 100, "window_ms": 60_000,
                     "algorithm": "fixed_window", "cost": 50});
    let body = json!({"checks": [{"subject": clients[0], "limits": [cap, per], "receipt": true}]});
    let r = http::request(
        addr,
        "POST",
        "/v1/check",
        &[],
        &serde_json::to_vec(&body).unwrap(),
    )
    .unwrap();
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let receipts = v["results"][0]["receipts"].clone();
    assert_ne!(receipts[0]["nonce"], receipts[1]["nonce"], "{v}");
    let settle = json!({"checks": [], "settlements": [{"subject": clients[0], "limits": [cap, per],
                                                      "actual": [10, 10], "receipts": receipts}]});
    let r = http::request(
        addr,
        "POST",
        "/v1/check",
        &[],
        &serde_json::to_vec(&settle).unwrap(),
    )
    .unwrap();
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["settled"][0]["remaining"], json!([90, 90]), "{v}");
}

/// Waits, when less than 20 s of the current minute is left, for the next
/// one: a test reading fixed one-minute windows then reads them all in one.
fn start_early_in_a_minute() {
    let into_minute = now_ms().rem_euclid(60_000);
    if into_minute > 40_000 {
        std::thread::sleep(Duration::from_millis((60_000 - into_minute) as u64 + 100));
    }
}

/// A reservation whose limits live in several Cluster slots (a route cap
/// `*` and a per-client budget) is decided by one run per slot; each run
/// records what it charged in its own slot, so a reservation whose answer
/// was lost goes back whole and once, like one decided by a single run
/// (issue 35). One that was denied (its other slot's charge refunded at
/// once) gives nothing more when named; one named before its runs is
/// charged nothing.
#[test]
fn a_lost_reservation_across_cluster_slots_goes_back_exactly_once() {
    let on = OnCluster::start("xslot-lost", &[]);
    let addr = &on.service.addr;
    let client = clients_off_the_caps_slot("lost", 1).remove(0);
    // Every read of the two counters must fall in one minute's window (a
    // CI run read [50, 0] across a minute's end): the test takes seconds.
    start_early_in_a_minute();
    let limits = |cap: u64, cost: u64| {
        json!([
            {"name": "lost/cap", "requests": cap, "window_ms": 60_000,
             "algorithm": "fixed_window", "subject": "*", "cost": cost},
            {"name": "lost/client", "requests": 10_000, "window_ms": 60_000,
             "algorithm": "fixed_window", "cost": cost}
        ])
    };
    let post = |body: Value| {
        let r = http::request(addr, "POST", "/v1/check", &[], body.to_string().as_bytes()).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str::<Value>(&r.body).unwrap()
    };
    let reserve = |id: u64, cap: u64, cost: u64| {
        post(
            json!({"checks": [{"subject": client, "limits": limits(cap, cost),
                                "receipt": true, "id": id}]}),
        )["results"][0]
            .clone()
    };
    let name_lost = |id: u64| {
        // Named with costs it was never charged: the records decide.
        post(json!({"lost": [{"subject": client, "limits": limits(10_000, 9_000), "id": id}]}));
    };
    let counters = || on.counters("lost", &client);
    // Give-backs are applied after the answer.
    let settled =
        |expected: [i64; 2]| eventually(Duration::from_secs(5), || counters() == expected);

    // Admitted, its answer lost: named three times, given back once.
    assert!(allowed(&reserve(31, 10_000, 300)));
    assert_eq!(counters(), [300, 300]);
    for _ in 0..3 {
        name_lost(31);
    }
    settled([0, 0]);
    assert_eq!(counters(), [0, 0], "given back whole, once");

    // Denied by the cap: the client's charge was refunded at once, and
    // naming it lost gives nothing more.
    assert!(allowed(&reserve(40, 100, 50)));
    assert!(!allowed(&reserve(41, 100, 60)));
    assert_eq!(counters(), [50, 50]);
    name_lost(41);
    std::thread::sleep(Duration::from_millis(200));
    settled([50, 50]);
    assert_eq!(
        counters(),
        [50, 50],
        "a denied reservation had nothing left to give"
    );

    // Named before its runs: its caller decided without meshlimitd, and
    // the runs charge nothing.
    name_lost(50);
    let marked = |k: String| on.get(&k) == "lost";
    eventually(Duration::from_secs(5), || {
        use meshlimitd::keys::{grant_key, subject_tag};
        marked(grant_key("ml:", &subject_tag("*"), 50))
            && marked(grant_key("ml:", &subject_tag(&client), 50))
    });
    assert!(!allowed(&reserve(50, 10_000, 20)));
    assert_eq!(counters(), [50, 50], "charged nothing");
}

/// A plain check whose limits live in several Cluster slots, whose caller
/// gave up while its runs were held up (every master paused): the caller
/// decided that request by its fallback, so what each run charged goes
/// back, as it does for a check decided by one run. On the old code a
/// check spread over slots had no receipts unless it asked for them, and
/// kept its unit on every limit.
#[test]
fn a_plain_check_across_cluster_slots_whose_caller_gave_up_goes_back() {
    // meshlimitd's own Redis timeout (50 ms) is shorter than the stall:
    // its runs are still awaited (`Limiter::run`).
    let on = OnCluster::start("xslot-abandoned", &[]);
    let addr = &on.service.addr;
    let clients = clients_off_the_caps_slot("gave-up", 2);
    // The warm-up's unit and the final read must fall in one minute's
    // window (the test takes about 7 s).
    start_early_in_a_minute();
    let both = [
        limit("gave-up/cap", 1000, Some("*")),
        limit("gave-up/client", 1000, None),
    ];
    // The scripts are loaded on every master, as on a running meshlimitd.
    assert!(allowed(&decide(addr, &clients[0], &both)));
    for port in on.ports() {
        on.cluster.cli(port, &["CLIENT", "PAUSE", "300", "WRITE"]);
    }
    let body = json!({"checks": [{"subject": clients[1], "limits": both}]});
    let r = http::request(
        addr,
        "POST",
        "/v1/check",
        &[("x-meshlimit-timeout-ms", b"50")],
        body.to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    let counters = || on.counters("gave-up", &clients[1]);
    // The runs go on once the pause ends (meshlimitd waits for Redis
    // longer than its caller did, and than its Redis timeout); what they
    // charged goes back (the cap keeps the warm-up's unit).
    eventually(Duration::from_secs(5), || {
        http::get(addr, "/metrics", &[]).is_ok_and(|r| {
            r.body
                .contains("meshlimitd_abandoned_units_given_back_total 1")
        })
    });
    assert_eq!(counters(), [1, 0], "only the warm-up is charged");
}

/// A token bucket's units are measured in its emission interval, which a
/// live override changes: a return or settlement counted at the
/// configured limit's interval gave back up to ten times what was charged
/// under a tenfold override, refilling the whole bucket (issue 35, item 3).
/// Settlements now read the override as decisions do.
#[test]
fn a_settlement_under_a_live_override_gives_back_what_was_charged() {
    let (f, _dir) = with_admin_api("admin-settle");
    let token = ADMIN_TOKEN;
    let addr = &f.service.addr;
    let subject = "hdr:x-api-key:big";
    let bucket = |cost: u64| {
        json!({"name": "llm/tokens", "requests": 100, "window_ms": 600_000,
               "algorithm": "token_bucket", "cost": cost})
    };
    let put = format!(r#"{{"subject":"{subject}","requests":1000}}"#);
    let r = admin(addr, "PUT", "/v1/overrides/llm/tokens", token, &put);
    assert_eq!(r.status, 200, "{}", r.body);
    // 500 of the raised 1000 spent, then 100 reserved.
    let spent = decide(addr, subject, &[bucket(500)]);
    assert!(allowed(&spent), "{spent}");
    let body = serde_json::to_vec(&json!({"checks": [{"subject": subject,
        "limits": [bucket(100)], "receipt": true}]}))
    .unwrap();
    let r = http::request(addr, "POST", "/v1/check", &[], &body).unwrap();
    let reserved: Value = serde_json::from_str(&r.body).unwrap();
    let reserved = &reserved["results"][0];
    assert!(allowed(reserved), "{reserved}");
    assert_eq!(reserved["limits"][0]["remaining"], json!(400), "{reserved}");
    // All 100 given back: 500 left, not a full bucket.
    let body = serde_json::to_vec(&json!({"checks": [], "settlements": [{
        "subject": subject, "limits": [bucket(100)], "actual": [0],
        "receipts": reserved["receipts"]}]}))
    .unwrap();
    let r = http::request(addr, "POST", "/v1/check", &[], &body).unwrap();
    let settled: Value = serde_json::from_str(&r.body).unwrap();
    let left = settled["settled"][0]["remaining"][0].as_i64().unwrap();
    assert!((499..=500).contains(&left), "{left} left: {settled}");
}
