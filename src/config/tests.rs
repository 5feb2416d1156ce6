//! Unit and property tests of the configuration parser, compiled only
//! under `#[cfg(test)]` (see `config/mod.rs`).

use super::*;

const MINIMAL: &str =
    r#"{"rules":[{"name":"api","limits":[{"name":"per-minute","requests":100,"window":"60s"}]}]}"#;

fn parse_str(s: &str) -> Result<Config, ConfigError> {
    parse(s.as_bytes())
}

fn rejects(json: &str, field: &str, problem_part: &str) {
    let e = parse_str(json).expect_err("config should be rejected");
    assert_eq!(e.field, field, "wrong field in {e}");
    assert!(
        e.problem.contains(problem_part),
        "problem {:?} should mention {:?}",
        e.problem,
        problem_part
    );
}

#[test]
fn minimal_config_gets_documented_defaults() {
    let c = parse_str(MINIMAL).unwrap();
    assert_eq!(c.service.cluster, "meshlimit");
    assert_eq!(c.service.authority, "meshlimitd");
    assert_eq!(c.service.timeout_ms, 20);
    assert_eq!(c.client_id.when_missing, WhenMissing::ClientAddress);
    assert!(c.client_id.headers.is_empty());
    assert_eq!(c.failure_mode, FailureMode::Local);
    assert_eq!(c.response.status, 429);
    assert_eq!(c.response.headers, HeaderStyle::Draft);
    assert_eq!(c.local.slots, 4096);
    assert_eq!(
        c.breaker,
        BreakerConfig {
            failures: 5,
            open_ms: 250,
            max_open_ms: 2_000
        }
    );
    assert_eq!(c.deny_cache_slots, 4096);
    let leases = c.leases.unwrap();
    assert_eq!(
        (
            leases.interval_ms,
            leases.max_units,
            leases.slots,
            leases.share
        ),
        (2_000, 10_000, 4096, 2)
    );
    let off = parse_str(
            r#"{"group_commit":{"enabled":false},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        )
        .unwrap();
    assert_eq!(off.group_commit, None, "one call per request");
    assert_eq!(
        c.group_commit,
        Some(crate::batch::BatchConfig {
            max_batch: 64,
            max_age_ms: 0,
            max_queued: 1024,
            max_in_flight: 4
        })
    );
    rejects(
        r#"{"group_commit":{"enabled":true,"max_batch":0},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "group_commit.max_batch",
        "between 1",
    );
    let rule = &c.rules[0];
    assert_eq!(rule.matcher.path, PathMatch::Prefix("/".into()));
    assert!(rule.matcher.methods.is_empty());
    assert_eq!(rule.limits[0].window_ms, 60_000);
    assert_eq!(rule.limits[0].qualified_name, "api/per-minute");
    assert_eq!(rule.limits[0].algorithm, Algorithm::FixedWindow);
}

#[test]
fn full_design_example_parses() {
    let json = r#"{
          "service": {"cluster": "meshlimit", "authority": "meshlimitd", "timeout": "25ms"},
          "client_id": {"headers": ["X-Api-Key", "x-client-id"], "when_missing": "reject"},
          "rules": [
            {"name": "api", "match": {"path_prefix": "/api/", "methods": ["get", "POST"]},
             "limits": [{"name": "per-minute", "requests": 100, "window": "60s", "algorithm": "fixed_window"}]}
          ],
          "failure_mode": "deny",
          "response": {"status": 429, "body": "slow down\n", "headers": "x-ratelimit"},
          "local": {"slots": 64}
        }"#;
    let c = parse_str(json).unwrap();
    assert_eq!(c.client_id.headers, vec!["x-api-key", "x-client-id"]);
    assert_eq!(c.rules[0].matcher.methods, vec!["GET", "POST"]);
    assert_eq!(c.failure_mode, FailureMode::Deny);
    assert_eq!(c.response.headers, HeaderStyle::XRatelimit);
    assert_eq!(c.service.timeout_ms, 25);
}

#[test]
fn each_header_style_is_read_by_its_name() {
    for (name, style) in [
        ("draft", HeaderStyle::Draft),
        ("ratelimit", HeaderStyle::RateLimitOnly),
        ("x-ratelimit", HeaderStyle::XRatelimit),
        ("none", HeaderStyle::None),
    ] {
        let json = MINIMAL.replacen(
            '{',
            &format!(r#"{{"response": {{"headers": "{name}"}},"#),
            1,
        );
        assert_eq!(parse_str(&json).unwrap().response.headers, style, "{name}");
    }
    let wrong = MINIMAL.replacen('{', r#"{"response": {"headers": "rate-limit"},"#, 1);
    let e = parse_str(&wrong).unwrap_err();
    assert_eq!(e.field, "response.headers", "{e}");
}

#[test]
fn empty_config_is_rejected() {
    assert!(parse(b"").unwrap_err().problem.contains("empty"));
    assert!(parse(b"  \n").unwrap_err().problem.contains("empty"));
    rejects("{}", "rules", "required");
    rejects(r#"{"rules":[]}"#, "rules", "at least one");
}

#[test]
fn unknown_fields_are_named_with_their_path() {
    rejects(
        r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":1,"window":"1s","burts":3}]}]}"#,
        "rules[0].limits[0].burts",
        "unknown field `burts`",
    );
    rejects(
        r#"{"servce":{},"rules":[]}"#,
        "servce",
        "unknown field `servce`",
    );
    rejects(
        r#"{"service":{"timeout_ms":20},"rules":[]}"#,
        "service.timeout_ms",
        "unknown field `timeout_ms`",
    );
}

#[test]
fn zero_and_negative_limits_are_rejected() {
    rejects(
        r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":0,"window":"1s"}]}]}"#,
        "rules[0].limits[0].requests",
        "at least 1",
    );
    rejects(
        r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":-5,"window":"1s"}]}]}"#,
        "rules[0].limits[0].requests",
        "invalid value",
    );
}

#[test]
fn bad_durations_are_rejected() {
    rejects(
        r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":1,"window":"60"}]}]}"#,
        "rules[0].limits[0].window",
        "no unit",
    );
    rejects(
        r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":1,"window":"0s"}]}]}"#,
        "rules[0].limits[0].window",
        "between",
    );
    rejects(
        r#"{"service":{"timeout":"fast"},"rules":[{"name":"api","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "service.timeout",
        "must start with",
    );
}

#[test]
fn rules_without_limits_and_duplicates_are_rejected() {
    rejects(
        r#"{"rules":[{"name":"api"}]}"#,
        "rules[0].limits",
        "at least one limit",
    );
    rejects(
        r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]},{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "rules[1].name",
        "duplicate rule name",
    );
    rejects(
        r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"},{"name":"m","requests":2,"window":"1h"}]}]}"#,
        "rules[0].limits[1].name",
        "duplicate limit name",
    );
}

#[test]
fn names_that_could_move_a_hash_slot_are_rejected() {
    rejects(
        r#"{"rules":[{"name":"a{b}","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "rules[0].name",
        "may only contain",
    );
}

#[test]
fn every_algorithm_parses_and_burst_is_token_bucket_only() {
    let c = parse_str(
        r#"{"rules":[{"name":"a","limits":[
              {"name":"fw","requests":1,"window":"1s","algorithm":"fixed_window"},
              {"name":"swl","requests":1,"window":"1s","algorithm":"sliding_window_log"},
              {"name":"swc","requests":1,"window":"1s","algorithm":"sliding_window_counter"},
              {"name":"tb","requests":10,"window":"1s","algorithm":"token_bucket","burst":3}]}]}"#,
    )
    .unwrap();
    assert_eq!(c.rules[0].limits[3].capacity(), 3);
    assert_eq!(c.rules[0].limits[0].capacity(), 1);
    rejects(
        r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s","burst":2}]}]}"#,
        "rules[0].limits[0].burst",
        "only token_bucket",
    );
    rejects(
        r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s","algorithm":"token_bucket","burst":0}]}]}"#,
        "rules[0].limits[0].burst",
        "at least 1",
    );
}

#[test]
fn cost_is_fixed_or_from_a_bounded_header() {
    let c = parse_str(
            r#"{"rules":[
              {"name":"a","cost":5,"limits":[{"name":"m","requests":10,"window":"1s"}]},
              {"name":"b","cost":{"header":"X-Cost","max":100},"shadow":true,"limits":[{"name":"m","requests":10,"window":"1s"}]}]}"#,
        )
        .unwrap();
    assert_eq!(c.rules[0].cost, Cost::Fixed(5));
    assert!(!c.rules[0].shadow);
    assert_eq!(
        c.rules[1].cost,
        Cost::Header {
            name: "x-cost".into(),
            default: 1,
            max: 100
        }
    );
    assert!(c.rules[1].shadow);
    rejects(
        r#"{"rules":[{"name":"a","cost":0,"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "rules[0].cost",
        "at least 1",
    );
    rejects(
        r#"{"rules":[{"name":"a","cost":{"header":"x-cost","max":10,"default":11},"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "rules[0].cost.default",
        "between 1 and max",
    );
}

/// A token cost: where the usage is, what is reserved, and each mistake
/// named by its field.
/// A configuration of one rule, `llm`, priced by `cost`.
fn token_rule(cost: &str) -> String {
    format!(
        r#"{{"rules":[{{"name":"llm","cost":{cost},"limits":[{{"name":"t","requests":1000,"window":"60s"}}]}}]}}"#
    )
}

#[test]
fn token_costs_are_read_and_each_mistake_named() {
    let rule = token_rule;
    let c = parse_str(&rule(
        r#"{"reserve":{"request_json":"max_tokens","default":100,"max":4000},
            "response":{"json":"usage.total_tokens","header":"X-Usage"}}"#,
    ))
    .unwrap();
    let Cost::Tokens(t) = &c.rules[0].cost else {
        panic!("a token cost")
    };
    assert_eq!(t.mode, TokenMode::Reserve);
    assert_eq!(t.max_body_bytes, 1 << 20);
    assert!(t.refund_on_error);
    assert_eq!(t.usage.header.as_deref(), Some("x-usage"));
    assert_eq!(
        t.usage.json,
        Some(crate::tokens::usage::UsageExpr::single(
            "usage.total_tokens"
        ))
    );
    assert_eq!(
        t.reserve,
        Reserve::RequestJson {
            path: vec!["max_tokens".into()],
            default: 100,
            max: 4000,
            prompt_bytes_per_token: 4,
            ask_stream_usage: false,
        }
    );
    let after = parse_str(&rule(
        r#"{"mode":"after","response":{"sse_json":"usage.total_tokens"}}"#,
    ));
    assert!(matches!(&after.unwrap().rules[0].cost, Cost::Tokens(t) if t.mode == TokenMode::After));
    for (cost, field, problem) in [
        (
            r#"{"response":{}}"#,
            "rules[0].cost.response",
            "json, sse_json or header",
        ),
        (
            r#"{"response":{"json":"usage..total"},"reserve":5}"#,
            "rules[0].cost.response.json",
            "dotted JSON path",
        ),
        (
            r#"{"response":{"json":"a"}}"#,
            "rules[0].cost.reserve",
            "needs a reservation",
        ),
        (
            r#"{"response":{"json":"a"},"mode":"after","reserve":5}"#,
            "rules[0].cost.reserve",
            "remove reserve",
        ),
        (
            r#"{"response":{"json":"a"},"reserve":0}"#,
            "rules[0].cost.reserve",
            "between 1",
        ),
        (
            r#"{"response":{"json":"a"},"reserve":{"request_json":"m","default":9,"max":5}}"#,
            "rules[0].cost.reserve.default",
            "between 1 and max",
        ),
        (
            r#"{"response":{"json":"a"},"reserve":5,"max_body_bytes":10}"#,
            "rules[0].cost.max_body_bytes",
            "between 1024",
        ),
        (
            r#"{"response":{"jsn":"a"},"reserve":5}"#,
            "rules[0].cost.response.jsn",
            "unknown field `jsn`",
        ),
        (
            r#"{"response":{"header":"bad header"},"reserve":5}"#,
            "rules[0].cost.response.header",
            "not a valid header name",
        ),
        (
            r#"{"response":{"json":"a"},"reserve":5,"mode":"later"}"#,
            "rules[0].cost.mode",
            "unknown variant",
        ),
    ] {
        rejects(&rule(cost), field, problem);
    }
    rejects(
        r#"{"rules":[{"name":"llm","scope":"local","cost":{"response":{"json":"a"},"reserve":5},"limits":[{"name":"t","requests":1000,"window":"60s"}]}]}"#,
        "rules[0].scope",
        "must be global",
    );
}

#[test]
fn usage_providers_and_weighted_sums_are_read_and_checked() {
    let rule = token_rule;
    // A provider names both shapes; a path given as well wins.
    let anthropic = parse_str(&rule(
        r#"{"reserve":5,"response":{"provider":"anthropic","json":[{"path":"usage.input_tokens"},{"path":"usage.output_tokens","weight":5}]}}"#,
    ))
    .unwrap();
    let Cost::Tokens(t) = &anthropic.rules[0].cost else {
        panic!("a token cost")
    };
    let weights: Vec<u64> = t
        .usage
        .json
        .as_ref()
        .unwrap()
        .terms
        .iter()
        .map(|t| t.weight)
        .collect();
    assert_eq!(weights, [1, 5]);
    assert_eq!(
        t.usage.sse_json,
        Some(crate::tokens::usage::Provider::Anthropic.sse())
    );
    for (cost, field, problem) in [
        (
            r#"{"response":{"json":["a.b", {"path":"a..c", "weight":2}]},"reserve":5}"#,
            "rules[0].cost.response.json[1]",
            "dotted JSON path",
        ),
        (
            r#"{"response":{"json":[{"path":"a", "weight":0}]},"reserve":5}"#,
            "rules[0].cost.response.json[0].weight",
            "from 1 to 1000",
        ),
        (
            r#"{"response":{"json":[]},"reserve":5}"#,
            "rules[0].cost.response.json",
            "1 to 8 paths",
        ),
        (
            r#"{"response":{"provider":"mistral"},"reserve":5}"#,
            "rules[0].cost.response.provider",
            "unknown variant",
        ),
    ] {
        rejects(&rule(cost), field, problem);
    }
}

#[test]
fn unknown_algorithms_are_named() {
    rejects(
        r#"{"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s","algorithm":"leaky"}]}]}"#,
        "rules[0].limits[0].algorithm",
        "unknown variant `leaky`",
    );
}

#[test]
fn enum_fields_name_their_choices() {
    rejects(
        r#"{"failure_mode":"open","rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "failure_mode",
        "expected one of `local`, `allow`, `deny`",
    );
    rejects(
        r#"{"response":{"headers":"ietf"},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "response.headers",
        "`draft`",
    );
}

#[test]
fn statuses_and_headers_are_checked() {
    rejects(
        r#"{"response":{"status":200},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "response.status",
        "4xx or 5xx",
    );
    for grpc_status in [0, 17] {
        rejects(
            &format!(
                r#"{{"response":{{"grpc_status":{grpc_status}}},"rules":[{{"name":"a","limits":[{{"name":"m","requests":1,"window":"1s"}}]}}]}}"#
            ),
            "response.grpc_status",
            "RESOURCE_EXHAUSTED",
        );
    }
    rejects(
        r#"{"client_id":{"reject_status":302},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "client_id.reject_status",
        "4xx",
    );
    rejects(
        r#"{"client_id":{"headers":["x api"]},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "client_id.headers[0]",
        "not a valid header name",
    );
    rejects(
        r#"{"client_id":{"query_params":["key","a=b"]},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "client_id.query_params[1]",
        "not a usable parameter name",
    );
    rejects(
        r#"{"rules":[{"name":"a","match":{"path_prefix":"api"},"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "rules[0].match.path_prefix",
        "start with",
    );
}

#[test]
fn fallback_share_comes_from_the_rule_or_the_replica_count() {
    let c = parse_str(
            r#"{"local":{"expected_replicas":4},"rules":[
              {"name":"a","limits":[{"name":"m","requests":20,"window":"1s"}]},
              {"name":"b","fallback_share":0.5,"limits":[{"name":"m","requests":21,"window":"1s","algorithm":"token_bucket","burst":9}]},
              {"name":"c","scope":"local","limits":[{"name":"m","requests":3,"window":"1s"}]}]}"#,
        )
        .unwrap();
    assert_eq!(c.rules[0].limits[0].fallback_requests(), 5);
    assert_eq!(c.rules[1].limits[0].fallback_requests(), 11);
    assert_eq!(c.rules[1].limits[0].for_fallback().burst, Some(5));
    assert_eq!(c.rules[2].scope, Scope::Local);
    assert_eq!(c.rules[0].scope, Scope::Global);
    let minimal = parse_str(MINIMAL).unwrap();
    assert_eq!(
        minimal.rules[0].limits[0].fallback_requests(),
        100,
        "default share is 1"
    );
    rejects(
        r#"{"rules":[{"name":"a","fallback_share":1.5,"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "rules[0].fallback_share",
        "at most 1",
    );
    rejects(
        r#"{"rules":[{"name":"a","scope":"local","fallback_share":0.5,"limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "rules[0].fallback_share",
        "never falls back",
    );
    rejects(
        r#"{"rules":[{"name":"a","scope":"everywhere","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "rules[0].scope",
        "expected `global` or `local`",
    );
}

#[test]
fn breaker_settings_are_checked() {
    rejects(
        r#"{"breaker":{"failures":0},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "breaker.failures",
        "between 1",
    );
    rejects(
        r#"{"breaker":{"open":"5s","max_open":"1s"},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "breaker.max_open",
        "at least breaker.open",
    );
    let c = parse_str(
            r#"{"deny_cache":{"slots":0},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        )
        .unwrap();
    assert_eq!(c.deny_cache_slots, 0);
}

#[test]
fn malformed_json_is_reported_without_panicking() {
    let e = parse(b"{\"rules\": [").unwrap_err();
    assert!(e.to_string().starts_with("invalid meshlimit configuration"));
    assert!(parse(&[0xff, 0xfe, 0x00]).is_err());
}

#[test]
fn error_line_names_the_field() {
    let e = parse_str(
        r#"{"rules":[{"name":"api","limits":[{"name":"m","requests":0,"window":"1s"}]}]}"#,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid meshlimit configuration: field `rules[0].limits[0].requests`: must be at least 1"
    );
}

mod proptests {
    use super::*;
    use proptest::prelude::*;

    /// Arbitrary JSON values, nested a few levels.
    fn json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            "\\PC{0,12}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                prop::collection::btree_map(
                    prop::sample::select(vec![
                        "rules",
                        "name",
                        "limits",
                        "requests",
                        "window",
                        "algorithm",
                        "service",
                        "timeout",
                        "cost",
                        "shadow",
                        "burst",
                        "match",
                        "client_id",
                        "x"
                    ])
                    .prop_map(String::from),
                    inner,
                    0..4
                )
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_are_parsed_or_refused_with_a_message(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            if let Err(e) = parse(&bytes) {
                prop_assert!(!e.to_string().is_empty());
            }
        }

        #[test]
        fn arbitrary_json_is_parsed_or_refused_never_a_panic(value in json()) {
            let bytes = serde_json::to_vec(&value).unwrap();
            let _ = parse(&bytes);
        }

        #[test]
        fn valid_limits_keep_their_values(
            name in "[a-z][a-z0-9_.-]{0,20}",
            requests in 1u64..1_000_000,
            secs in 1u64..86_400,
            algorithm in prop::sample::select(vec!["fixed_window", "sliding_window_log", "sliding_window_counter", "token_bucket"]),
        ) {
            // Valid: a sliding log holds at most MAX_SLIDING_LOG_REQUESTS.
            prop_assume!(
                algorithm != "sliding_window_log"
                    || requests <= meshlimit_protocol::bounds::MAX_SLIDING_LOG_REQUESTS
            );
            let json = format!(r#"{{"rules":[{{"name":"{name}","limits":[{{"name":"l","requests":{requests},"window":"{secs}s","algorithm":"{algorithm}"}}]}}]}}"#);
            let c = parse(json.as_bytes()).unwrap();
            let l = &c.rules[0].limits[0];
            prop_assert_eq!(l.requests, requests);
            prop_assert_eq!(l.window_ms, secs * 1000);
            prop_assert_eq!(l.algorithm.as_str(), algorithm);
            prop_assert_eq!(&l.qualified_name, &format!("{name}/l"));
        }
    }
}

#[test]
fn the_shared_token_is_checked_at_load() {
    let with = |token: &str| {
        parse_str(&format!(
            r#"{{"service":{{"auth_token":"{token}"}},"rules":[{{"name":"api","limits":[{{"name":"m","requests":1,"window":"1s"}}]}}]}}"#
        ))
    };
    assert_eq!(
        with("0123456789abcdef")
            .unwrap()
            .service
            .authorization
            .as_deref(),
        Some("Bearer 0123456789abcdef")
    );
    for bad in ["short", "has a space in it!!", &"x".repeat(257)] {
        let e = with(bad).unwrap_err();
        assert_eq!(e.field, "service.auth_token", "{bad}");
    }
    assert_eq!(parse_str(MINIMAL).unwrap().service.authorization, None);
}

#[test]
fn match_conditions_are_read_and_checked() {
    let rule = |m: &str| {
        parse_str(&format!(
            r#"{{"rules":[{{"name":"r","match":{m},"limits":[{{"name":"l","requests":1,"window":"1s"}}]}}]}}"#
        ))
    };
    let c = rule(
        r#"{"hosts":["API.example.com","*.example.org"],"path":{"exact":"/login"},"methods":["post"],
            "headers":[{"name":"X-Plan","in":["pro","team"]},{"name":"x-beta","present":true}]}"#,
    )
    .unwrap();
    let m = &c.rules[0].matcher;
    assert_eq!(
        m.hosts,
        [
            HostPattern::Exact("api.example.com".into()),
            HostPattern::Subdomains(".example.org".into())
        ]
    );
    assert_eq!(m.path, PathMatch::Exact("/login".into()));
    assert_eq!(m.methods, ["POST"]);
    assert_eq!(m.headers[0].name, "x-plan");
    assert_eq!(
        m.headers[0].test,
        HeaderTest::In(vec!["pro".into(), "team".into()])
    );
    assert_eq!(m.headers[1].test, HeaderTest::Present);
    assert_eq!(
        rule("{}").unwrap().rules[0].matcher.path,
        PathMatch::Prefix("/".into())
    );
    let rejects_match = |m: &str, field: &str, part: &str| {
        let e = rule(m).expect_err(m);
        assert_eq!(e.field, field, "{m}: {e}");
        assert!(e.problem.contains(part), "{m}: {e}");
    };
    rejects_match(
        r#"{"path_prefix":"/a","path":{"prefix":"/b"}}"#,
        "rules[0].match.path",
        "not both",
    );
    rejects_match(r#"{"path":{}}"#, "rules[0].match.path", "exactly one");
    rejects_match(
        r#"{"path":{"exact":"login"}}"#,
        "rules[0].match.path.exact",
        "'/'",
    );
    rejects_match(
        r#"{"hosts":["bad host"]}"#,
        "rules[0].match.hosts[0]",
        "host name",
    );
    rejects_match(
        r#"{"hosts":["*."]}"#,
        "rules[0].match.hosts[0]",
        "host name",
    );
    rejects_match(
        r#"{"headers":[{"name":"x","exact":"a","prefix":"b"}]}"#,
        "rules[0].match.headers[0]",
        "exactly one",
    );
    rejects_match(
        r#"{"headers":[{"name":"x","present":false}]}"#,
        "rules[0].match.headers[0]",
        "take true",
    );
    rejects_match(
        r#"{"headers":[{"name":"x y","present":true}]}"#,
        "rules[0].match.headers[0].name",
        "header name",
    );
    rejects_match(
        r#"{"headers":[{"name":"x","in":[]}]}"#,
        "rules[0].match.headers[0].in",
        "at least one",
    );
    rejects_match(
        r#"{"headers":[{"name":"x","regex":"a"}]}"#,
        "rules[0].match.headers[0].regex",
        "unknown field",
    );
}

/// A config with one limit whose extra fields are `fields` (JSON members).
fn with_limit(fields: &str) -> String {
    format!(r#"{{"rules":[{{"name":"api","limits":[{{"name":"m","requests":10{fields}}}]}}]}}"#)
}

#[test]
fn by_lists_attributes_and_names_the_bad_one() {
    let c = parse_str(&with_limit(
        r#","window":"1m","by":["client","header:X-Tenant","query:t","host","path","method","peer_identity","jwt:sub"]"#,
    ))
    .unwrap();
    assert_eq!(
        c.rules[0].limits[0].by,
        [
            Attribute::Client,
            Attribute::Header("x-tenant".into()),
            Attribute::Query("t".into()),
            Attribute::Host,
            Attribute::Path,
            Attribute::Method,
            Attribute::PeerIdentity,
            Attribute::Jwt("sub".into()),
        ]
    );
    let default = parse_str(MINIMAL).unwrap();
    assert_eq!(default.rules[0].limits[0].by, [Attribute::Client]);
    assert_eq!(default.rules[0].limits[0].missing, MissingAttribute::Skip);
    let empty = parse_str(&with_limit(r#","window":"1m","by":[]"#)).unwrap();
    assert!(empty.rules[0].limits[0].by.is_empty());
    let at = "rules[0].limits[0].by[1]";
    rejects(
        &with_limit(r#","window":"1m","by":["client","cookie:x"]"#),
        at,
        "unknown attribute \"cookie:x\"",
    );
    rejects(
        &with_limit(r#","window":"1m","by":["host","host"]"#),
        at,
        "listed twice",
    );
    rejects(
        &with_limit(r#","window":"1m","by":["host","header:a b"]"#),
        at,
        "not a valid header name",
    );
    rejects(
        &with_limit(r#","window":"1m","by":["host","jwt:"]"#),
        at,
        "unknown attribute",
    );
    rejects(
        &with_limit(r#","window":"1m","by":["a","b","c","d","e","f","g","h","i"]"#),
        "rules[0].limits[0].by",
        "at most 8",
    );
    rejects(
        &with_limit(r#","window":"1m","missing":"ignore""#),
        "rules[0].limits[0].missing",
        "skip",
    );
}

#[test]
fn calendar_limits_take_a_unit_and_an_offset() {
    let c = parse_str(&with_limit(r#","calendar":"month","utc_offset":"+02:00""#)).unwrap();
    let l = &c.rules[0].limits[0];
    assert_eq!(
        l.calendar,
        Some(meshlimit_protocol::Calendar {
            unit: meshlimit_protocol::CalendarUnit::Month,
            utc_offset_minutes: 120
        })
    );
    assert_eq!(l.window_ms, 31 * 86_400_000);
    let minus = parse_str(&with_limit(r#","calendar":"day","utc_offset":"-05:30""#)).unwrap();
    assert_eq!(
        minus.rules[0].limits[0]
            .calendar
            .map(|c| c.utc_offset_minutes),
        Some(-330)
    );
    let at = |f: &str| format!("rules[0].limits[0].{f}");
    rejects(
        &with_limit(r#","calendar":"day","window":"1d""#),
        &at("window"),
        "remove `window`",
    );
    rejects(&with_limit(""), &at("window"), "missing");
    for bad in ["+2:00", "02:00", "+15:00", "+01:60", "UTC"] {
        rejects(
            &with_limit(&format!(r#","calendar":"week","utc_offset":"{bad}""#)),
            &at("utc_offset"),
            "+HH:MM",
        );
    }
    rejects(
        &with_limit(r#","window":"1m","utc_offset":"+01:00""#),
        &at("utc_offset"),
        "only a calendar",
    );
    rejects(
        &with_limit(r#","calendar":"day","algorithm":"token_bucket""#),
        &at("calendar"),
        "fixed windows",
    );
    rejects(
        &with_limit(r#","calendar":"year""#),
        &at("calendar"),
        "month",
    );
}

#[test]
fn static_overrides_are_checked_like_the_limit() {
    let c = parse_str(&with_limit(
        r#","window":"1m","overrides":[{"subjects":["partner-a","hdr:x-api-key:b"],"requests":500}]"#,
    ))
    .unwrap();
    let l = &c.rules[0].limits[0];
    assert_eq!(
        l.override_for("hdr:x-api-key:partner-a", Some("partner-a")),
        Some(500)
    );
    assert_eq!(l.override_for("hdr:x-api-key:b", Some("b")), Some(500));
    assert_eq!(l.override_for("hdr:x-api-key:c", Some("c")), None);
    let raised = l.with_requests(500);
    assert_eq!((raised.requests, raised.fallback_requests()), (500, 500));
    rejects(
        &with_limit(r#","window":"1m","overrides":[{"subjects":["a"],"requests":0}]"#),
        "rules[0].limits[0].overrides[0].requests",
        "at least 1",
    );
    rejects(
        &with_limit(r#","window":"1m","overrides":[{"subjects":[],"requests":5}]"#),
        "rules[0].limits[0].overrides[0].subjects",
        "at least one",
    );
    rejects(
        &with_limit(r#","window":"1m","overrides":[{"subject":"a","requests":5}]"#),
        "rules[0].limits[0].overrides[0].subject",
        "unknown field",
    );
}

#[test]
fn the_jwt_source_has_envoys_defaults() {
    let c = parse_str(MINIMAL).unwrap();
    assert_eq!(c.jwt.filter, "envoy.filters.http.jwt_authn");
    assert_eq!(c.jwt.payload_in_metadata, "jwt_payload");
    rejects(
        r#"{"jwt":{"payload_in_metadata":""},"rules":[{"name":"a","limits":[{"name":"m","requests":1,"window":"1s"}]}]}"#,
        "jwt.payload_in_metadata",
        "1 to 256",
    );
}

#[test]
fn a_body_field_counts_only_where_the_body_is_read() {
    let token_rule_by = |by: &str, cost: &str| {
        format!(
            r#"{{"rules":[{{"name":"llm","cost":{cost},
                "limits":[{{"name":"tokens","requests":1000,"window":"1m","by":{by}}}]}}]}}"#
        )
    };
    let reads_body = r#"{"reserve":{"request_json":"max_tokens","default":10,"max":100},"response":{"provider":"openai"}}"#;
    let c = parse_str(&token_rule_by(r#"["client","json:model"]"#, reads_body)).unwrap();
    assert_eq!(
        c.rules[0].limits[0].by,
        vec![Attribute::Client, Attribute::Json("model".into())]
    );
    let at = "rules[0].limits[0].by[1]";
    for (cost, problem) in [
        ("1", "needs the rule's cost to read the request body"),
        (
            r#"{"mode":"after","response":{"provider":"openai"}}"#,
            "needs the rule's cost to read the request body",
        ),
        (
            r#"{"reserve":50,"response":{"provider":"openai"}}"#,
            "needs the rule's cost to read the request body",
        ),
    ] {
        rejects(
            &token_rule_by(r#"["client","json:model"]"#, cost),
            at,
            problem,
        );
    }
    for bad in ["json:", "json:a..b", "json:a b", "json:{x}"] {
        rejects(
            &token_rule_by(&format!(r#"["client","{bad}"]"#), reads_body),
            at,
            "a dotted path",
        );
    }
}

#[test]
fn streams_ask_for_their_usage_on_openai_routes_by_default() {
    let rule = token_rule;
    // Elsewhere when told.
    for (cost, asks) in [
        (
            r#"{"reserve":{"request_json":"max_tokens","default":1,"max":9},"response":{"provider":"openai"}}"#,
            true,
        ),
        (
            r#"{"reserve":{"request_json":"max_tokens","default":1,"max":9,"ask_stream_usage":false},"response":{"provider":"openai"}}"#,
            false,
        ),
        (
            r#"{"reserve":{"request_json":"max_tokens","default":1,"max":9},"response":{"provider":"anthropic"}}"#,
            false,
        ),
        (
            r#"{"reserve":{"request_json":"max_tokens","default":1,"max":9,"ask_stream_usage":true},"response":{"sse_json":"usage.total_tokens"}}"#,
            true,
        ),
    ] {
        let c = parse_str(&rule(cost)).unwrap();
        let Cost::Tokens(t) = &c.rules[0].cost else {
            panic!("a token cost")
        };
        assert_eq!(t.asks_stream_usage(), asks, "{cost}");
    }
}
