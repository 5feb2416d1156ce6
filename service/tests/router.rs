//! meshlimitd's HTTP fronts in process (`tower::ServiceExt::oneshot`), for
//! what is decided before Redis is asked: who may call, what a call may
//! hold, and how each refusal is answered. The Redis behind it is never
//! reached (an address nothing listens on); what needs Redis is tested
//! against a real redis-server in the other files.

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use meshlimitd::api;
use meshlimitd::app::{AppState, Limits};
use meshlimitd::backend::{Mode, Options};
use meshlimitd::limiter::Limiter;
use meshlimitd::metrics::Metrics;
use tower::ServiceExt;

const PROXY_TOKEN: &str = "proxy-token-0123456789";
const ADMIN_TOKEN: &str = "admin-token-0123456789";

/// The router over a Redis nobody answers at, with or without tokens.
fn router(proxy_token: Option<&str>, admin_token: Option<&str>) -> Router {
    let metrics = Metrics::new();
    let options = Options {
        mode: Mode::Standalone,
        // Port 1 on loopback: refused at once, never a real server.
        urls: vec!["redis://127.0.0.1:1".into()],
        sentinel_master: None,
        ca_pem: None,
        client_pem: None,
        timeout: Duration::from_millis(50),
        response_timeout: Duration::from_millis(50),
    };
    let limiter = Limiter::new(&options, "test".into(), metrics.clone()).unwrap();
    let limits = Limits {
        max_in_flight: 4,
        queue_timeout: Duration::from_millis(50),
        request_timeout: Duration::from_millis(200),
    };
    let state = AppState::new(limiter, metrics, limits)
        .with_auth_token(proxy_token.map(String::from))
        .with_admin_tokens(
            admin_token.map(|t| meshlimitd::app::admin_tokens(t.as_bytes()).unwrap()),
        );
    api::router(state, 64 * 1024)
}

/// Sends one request through the router; its status and body.
async fn send(
    router: Router,
    method: &str,
    uri: &str,
    authorization: Option<&str>,
    body: &str,
) -> (StatusCode, String) {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(a) = authorization {
        request = request.header("authorization", a);
    }
    let response = router
        .oneshot(request.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

const CHECK: &str = r#"{"checks":[{"subject":"s","limits":[{"name":"api/m","requests":10,"window_ms":60000,"algorithm":"fixed_window"}]}]}"#;

#[tokio::test]
async fn a_check_without_the_shared_token_is_refused_before_anything_is_read() {
    let r = router(Some(PROXY_TOKEN), None);
    let (status, body) = send(r.clone(), "POST", "/v1/check", None, CHECK).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(body.contains("shared token"), "{body}");
    let wrong = format!("Bearer {ADMIN_TOKEN}");
    let (status, _) = send(r.clone(), "POST", "/v1/check", Some(&wrong), CHECK).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "the admin token is not the proxies'"
    );
    // With the token it gets past authorization, to Redis, which is away.
    let right = format!("Bearer {PROXY_TOKEN}");
    let (status, body) = send(r, "POST", "/v1/check", Some(&right), CHECK).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
}

#[tokio::test]
async fn malformed_and_out_of_bounds_checks_are_the_callers_mistake() {
    let r = router(None, None);
    let (status, body) = send(r.clone(), "POST", "/v1/check", None, "{not json").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("malformed check request"), "{body}");
    let (status, body) = send(r.clone(), "POST", "/v1/check", None, r#"{"checks":[]}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("at least one check"), "{body}");
    let zero = CHECK.replace(r#""requests":10"#, r#""requests":0"#);
    let (status, body) = send(r.clone(), "POST", "/v1/check", None, &zero).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("checks[0].limits[0].requests"), "{body}");
    let huge = "x".repeat(100 * 1024);
    let (status, _) = send(r, "POST", "/v1/check", None, &huge).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn the_admin_api_is_off_without_its_token_and_refuses_the_wrong_one() {
    let uri = "/v1/overrides/api/per-minute?subject=hdr:x-api-key:a";
    let off = router(Some(PROXY_TOKEN), None);
    let (status, body) = send(off, "GET", uri, None, "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body.contains("admin API is off"), "{body}");

    let on = router(Some(PROXY_TOKEN), Some(ADMIN_TOKEN));
    let proxy = format!("Bearer {PROXY_TOKEN}");
    for method in ["GET", "DELETE"] {
        let (status, body) = send(on.clone(), method, uri, Some(&proxy), "").await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method}: {body}");
        assert!(body.contains("admin token"), "{body}");
    }
    let put = r#"{"subject":"hdr:x-api-key:a","requests":40}"#;
    let (status, _) = send(on.clone(), "PUT", "/v1/overrides/api/per-minute", None, put).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn admin_calls_are_validated_before_redis_is_asked() {
    let r = router(None, Some(ADMIN_TOKEN));
    let admin = format!("Bearer {ADMIN_TOKEN}");
    let path = "/v1/overrides/api/per-minute";
    for (body, says) in [
        (r#"{"subject":"s","requests":0}"#, "requests: from 1"),
        (r#"{"subject":"","requests":5}"#, "subject: 1 to"),
        (
            r#"{"subject":"s","requests":5,"ttl_seconds":0}"#,
            "ttl_seconds",
        ),
        (
            r#"{"subject":"s","requests":5,"extra":1}"#,
            "malformed override",
        ),
    ] {
        let (status, answer) = send(r.clone(), "PUT", path, Some(&admin), body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert!(answer.contains(says), "{body}: {answer}");
    }
    let (status, answer) = send(
        r.clone(),
        "GET",
        "/v1/overrides/api/per-minute",
        Some(&admin),
        "",
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "no subject: {answer}");
    // A valid call reaches Redis, which is away: 503, not 5xx of its own.
    let (status, answer) = send(
        r,
        "PUT",
        path,
        Some(&admin),
        r#"{"subject":"s","requests":5}"#,
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{answer}");
    assert!(answer.contains("redis"), "{answer}");
}

#[tokio::test]
async fn health_is_up_and_readiness_follows_redis() {
    let r = router(None, None);
    assert_eq!(
        send(r.clone(), "GET", "/healthz", None, "").await.0,
        StatusCode::OK
    );
    let (status, body) = send(r.clone(), "GET", "/readyz", None, "").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let (status, body) = send(r, "GET", "/metrics", None, "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("meshlimitd_"), "{body}");
}
