use std::net::SocketAddr;
use std::time::Duration;

use axum::serve::ListenerExt;
use clap::Parser;
use meshlimitd::api;
use meshlimitd::app::{self, AppState};
use meshlimitd::backend;
use meshlimitd::limiter::Limiter;
use meshlimitd::metrics::Metrics;
use meshlimitd::traces::{TraceSettings, Traces};
use meshlimitd::validate;
use tracing::{error, info, warn};

/// meshlimitd: decides meshlimit's rate limits on Redis.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Address to listen on (port 0 picks a free port; the chosen address is logged).
    #[arg(long, env = "MESHLIMITD_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Redis URL(s), comma-separated: one for standalone
    /// (redis://user:pass@host:6379/0, or rediss:// for TLS), seed nodes for
    /// a cluster, sentinels for sentinel mode.
    #[arg(
        long,
        env = "MESHLIMITD_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// standalone, cluster or sentinel.
    #[arg(
        long,
        env = "MESHLIMITD_REDIS_MODE",
        value_enum,
        default_value = "standalone"
    )]
    redis_mode: backend::Mode,
    /// With --redis-mode sentinel: the name of the monitored master.
    #[arg(long, env = "MESHLIMITD_SENTINEL_MASTER")]
    sentinel_master: Option<String>,
    /// PEM file of the CA that signed Redis' TLS certificate (rediss://).
    #[arg(long, env = "MESHLIMITD_REDIS_CA_FILE")]
    redis_ca_file: Option<std::path::PathBuf>,
    /// PEM certificate meshlimitd presents to Redis (mutual TLS); needs
    /// --redis-client-key.
    #[arg(
        long,
        env = "MESHLIMITD_REDIS_CLIENT_CERT",
        requires = "redis_client_key"
    )]
    redis_client_cert: Option<std::path::PathBuf>,
    /// PEM private key of --redis-client-cert.
    #[arg(
        long,
        env = "MESHLIMITD_REDIS_CLIENT_KEY",
        requires = "redis_client_cert"
    )]
    redis_client_key: Option<std::path::PathBuf>,
    /// A file holding a shared secret: checks must then carry
    /// `authorization: Bearer <secret>` (the filter's `service.auth_token`),
    /// or get 401. For deployments where more than the proxies can reach
    /// meshlimitd (see docs/security.md).
    #[arg(long, env = "MESHLIMITD_AUTH_TOKEN_FILE")]
    auth_token_file: Option<std::path::PathBuf>,
    /// A file holding the admin API's credentials (secrets other than
    /// --auth-token-file's): one secret, or one `<id> <secret>` a line so
    /// that the log names who made each change. Turns on live overrides
    /// (`/v1/overrides/...`, see docs/policies.md), the fleet-wide
    /// enforcement switch (`/v1/enforcement`) and usage reads
    /// (`/v1/usage/...`, docs/operators.md). Give every instance the same
    /// setting. Off by default.
    #[arg(long, env = "MESHLIMITD_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<std::path::PathBuf>,
    /// Test hook, never for production: the scripts' clock is Redis TIME
    /// plus the value (milliseconds) of this Redis key, so tests cross
    /// calendar edges without waiting. Not available on a Cluster.
    #[arg(long, env = "MESHLIMITD_TEST_CLOCK_OFFSET_KEY", hide = true)]
    test_clock_offset_key: Option<String>,
    /// Prefix of every key meshlimitd writes (must not contain '{' or '}').
    #[arg(long, env = "MESHLIMITD_KEY_PREFIX", default_value = "ml:")]
    key_prefix: String,
    /// Largest accepted request body; larger ones get 413.
    #[arg(long, env = "MESHLIMITD_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Time a Redis script run may take before it counts as a failure
    /// (its caller's own deadline answers the caller; the run is still
    /// awaited, so what it charged for a caller who gave up goes back).
    #[arg(long, env = "MESHLIMITD_REDIS_TIMEOUT_MS", default_value_t = 50)]
    redis_timeout_ms: u64,
    /// Checks decided at once; more wait for a slot (see --queue-timeout-ms).
    #[arg(long, env = "MESHLIMITD_MAX_IN_FLIGHT", default_value_t = 1024)]
    max_in_flight: usize,
    /// How long a check may wait for a slot before a 503 "overloaded".
    #[arg(long, env = "MESHLIMITD_QUEUE_TIMEOUT_MS", default_value_t = 20)]
    queue_timeout_ms: u64,
    /// Deadline for a whole request, queueing included (then 503).
    #[arg(long, env = "MESHLIMITD_REQUEST_TIMEOUT_MS", default_value_t = 200)]
    request_timeout_ms: u64,
    /// Also serve Envoy's rate limit service API
    /// (`envoy.service.ratelimit.v3`, gRPC) on this address, for Envoy's
    /// native `ratelimit` filter; needs --rls-config-dir. Off by default.
    #[arg(long, env = "MESHLIMITD_GRPC_LISTEN", requires = "rls_config_dir")]
    grpc_listen: Option<SocketAddr>,
    /// A directory of envoyproxy/ratelimit configuration files (`*.yaml`),
    /// watched: a change is applied within a second, a bad file is refused
    /// (logged with its field) and the last good configuration kept.
    #[arg(long, env = "MESHLIMITD_RLS_CONFIG_DIR", requires = "grpc_listen")]
    rls_config_dir: Option<std::path::PathBuf>,
    /// An OTLP/gRPC endpoint (`http://otel-collector:4317`): every check
    /// of a traced request then makes a span there, a child of the
    /// request's span (docs/operators.md). Off by default. The exporter
    /// also reads the standard `OTEL_EXPORTER_OTLP_*` and `OTEL_BSP_*`
    /// variables (headers, TLS, batching).
    #[arg(long, env = "MESHLIMITD_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// With --otlp-endpoint: the share (0 to 1) of checks of untraced
    /// requests that start a trace of their own.
    #[arg(long, env = "MESHLIMITD_OTLP_ROOT_SAMPLE_RATIO", default_value_t = 0.0)]
    otlp_root_sample_ratio: f64,
    /// Log format: text or json.
    #[arg(long, env = "MESHLIMITD_LOG_FORMAT", default_value = "text")]
    log_format: String,
    /// Without one, meshlimitd serves.
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Checks configuration without starting anything: exits 0 and prints
    /// a summary when it is accepted, 1 and the reason when it is not.
    #[command(subcommand)]
    Validate(Validate),
    /// Exits 0 when the meshlimitd listening on --listen is ready (GET
    /// /readyz answers 200): a healthcheck for an image with no shell.
    Probe,
}

#[derive(clap::Subcommand, Debug)]
enum Validate {
    /// The filter's plugin configuration (JSON, YAML, or an Istio
    /// WasmPlugin manifest), by the filter's own parser: the message is
    /// the line the filter would log.
    PluginConfig { file: std::path::PathBuf },
    /// A directory of rate limit service configuration files (YAML), as
    /// --rls-config-dir loads them.
    RlsConfig { dir: std::path::PathBuf },
}

/// Runs a command other than serving; the process's exit code.
fn command(command: &Command, args: &Args) -> i32 {
    let outcome = match command {
        Command::Validate(Validate::PluginConfig { file }) => validate::plugin_config(file),
        Command::Validate(Validate::RlsConfig { dir }) => validate::rls_config(dir),
        Command::Probe => validate::probe(args.listen),
    };
    match outcome {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(line) => {
            eprintln!("{line}");
            1
        }
    }
}

#[tokio::main]
async fn main() {
    // rediss:// uses rustls; select its crypto provider once, explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    if let Some(c) = &args.command {
        std::process::exit(command(c, &args));
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("MESHLIMITD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if args.log_format == "json" {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init();
    } else {
        // Colours only on a terminal: a log file or a pod's log would
        // carry the escape codes.
        tracing_subscriber::fmt()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .with_env_filter(filter)
            .init();
    }
    if let Err(e) = run(args).await {
        error!("{e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), String> {
    if args.key_prefix.contains(['{', '}']) {
        return Err(
            "--key-prefix must not contain '{' or '}' (they would pick a Redis Cluster slot)"
                .into(),
        );
    }
    let metrics = Metrics::new();
    let limiter = Limiter::new(
        &backend_options(&args)?,
        args.key_prefix.clone(),
        metrics.clone(),
    )
    .map_err(|e| format!("invalid Redis settings: {e}"))?
    .with_test_clock(args.test_clock_offset_key.clone())
    .map_err(|e| format!("--test-clock-offset-key: {e}"))?;
    if let Some(key) = &args.test_clock_offset_key {
        warn!("test clock hook on: the scripts' clock is shifted by Redis key {key}");
    }
    // A first PING, so a wrong password or address shows in the log at
    // once (meshlimitd keeps running and retrying; /readyz says why).
    match limiter.ping().await {
        Ok(()) => {
            info!("redis reachable ({:?} mode)", args.redis_mode);
            let requiring = limiter.full_coverage_required().await;
            if !requiring.is_empty() {
                warn!("{}", api::coverage_warning(&requiring));
            }
        }
        Err(e) => error!(
            "redis not usable yet ({:?} mode): {e}; answering 503 until it is",
            args.redis_mode
        ),
    }
    let limits = app::Limits {
        max_in_flight: args.max_in_flight.max(1),
        queue_timeout: Duration::from_millis(args.queue_timeout_ms),
        request_timeout: Duration::from_millis(args.request_timeout_ms.max(1)),
    };
    let (auth_token, admin_tokens) = tokens(&args)?;
    if auth_token.is_some() {
        info!("checks require the shared token; receipts are signed, and settlements verified");
    } else {
        warn!(
            "the check API is open (no --auth-token-file): whoever reaches this port can spend, give back or read any client's quota; the shipped manifests set a token"
        );
    }
    if let Some(admin) = &admin_tokens {
        let ids: Vec<&str> = admin.iter().map(|t| t.id.as_str()).collect();
        info!(
            "admin API on (credentials: {}): live overrides and the enforcement switch are read by every decision",
            ids.join(", ")
        );
    }
    let traces = match &args.otlp_endpoint {
        Some(endpoint) => {
            let settings = TraceSettings {
                endpoint: endpoint.clone(),
                root_ratio: args.otlp_root_sample_ratio,
            };
            let traces = Traces::start(&settings).map_err(|e| e.to_string())?;
            info!("traces on: spans of traced requests' checks go to {endpoint} (OTLP/gRPC)");
            Some(traces)
        }
        None => None,
    };
    let state = AppState::new(limiter, metrics, limits)
        .with_auth_token(auth_token)
        .with_admin_tokens(admin_tokens)
        .with_traces(traces.clone());
    // The fleet-wide switch, read from Redis (with the admin API on).
    tokio::spawn(
        state
            .fleet
            .clone()
            .refresh_forever(state.limiter.clone(), state.metrics.clone()),
    );
    let served = serve(&args, state).await;
    if let Some(traces) = traces {
        // Flushing blocks: off the runtime's workers, which the exporter's
        // gRPC client needs meanwhile.
        let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
    }
    served
}

/// A flag's file, read whole (`None`: the flag is not set).
fn read_file(flag: &str, path: &Option<std::path::PathBuf>) -> Result<Option<Vec<u8>>, String> {
    path.as_ref()
        .map(|p| std::fs::read(p).map_err(|e| format!("cannot read {flag} {}: {e}", p.display())))
        .transpose()
}

/// How to reach Redis, from the flags (TLS files read).
fn backend_options(args: &Args) -> Result<backend::Options, String> {
    let ca_pem = read_file("--redis-ca-file", &args.redis_ca_file)?;
    let client_pem = match (
        read_file("--redis-client-cert", &args.redis_client_cert)?,
        read_file("--redis-client-key", &args.redis_client_key)?,
    ) {
        (Some(cert), Some(key)) => Some((cert, key)),
        _ => None,
    };
    Ok(backend::Options {
        mode: args.redis_mode.clone(),
        urls: args
            .redis_url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(String::from)
            .collect(),
        sentinel_master: args.sentinel_master.clone(),
        ca_pem,
        client_pem,
        timeout: Duration::from_millis(args.redis_timeout_ms.max(1)),
        response_timeout: Duration::from_millis(args.redis_timeout_ms)
            .max(meshlimitd::limiter::LATE_ANSWERS_AWAITED),
    })
}

/// The proxies' shared token and the admin credentials, when their
/// files are given; no admin secret may be the proxies' token.
fn tokens(args: &Args) -> Result<(Option<String>, Option<Vec<app::AdminToken>>), String> {
    let auth_token = read_file("--auth-token-file", &args.auth_token_file)?
        .map(|bytes| app::auth_token(&bytes).map_err(|e| format!("--auth-token-file: {e}")))
        .transpose()?;
    let admin_tokens = read_file("--admin-token-file", &args.admin_token_file)?
        .map(|bytes| app::admin_tokens(&bytes).map_err(|e| format!("--admin-token-file: {e}")))
        .transpose()?;
    if let (Some(auth), Some(admin)) = (&auth_token, &admin_tokens) {
        if admin.iter().any(|t| t.has_secret(auth)) {
            return Err("--admin-token-file must hold other secrets than --auth-token-file".into());
        }
    }
    Ok((auth_token, admin_tokens))
}

/// Serves the HTTP API (and the gRPC service, when configured) until a
/// signal stops both.
async fn serve(args: &Args, state: AppState) -> Result<(), String> {
    // Both servers stop on the same signal.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let grpc = match (&args.grpc_listen, &args.rls_config_dir) {
        (Some(addr), Some(dir)) => {
            Some(grpc_server(*addr, dir, state.clone(), stopped.clone()).await?)
        }
        _ => None,
    };
    let app = api::router(state, args.max_body_bytes);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let local = listener
        .local_addr()
        .map_err(|e| format!("cannot read the listening address: {e}"))?;
    info!(
        "meshlimitd listening on {local}, redis {}",
        args.redis_url
            .split(',')
            .map(redact)
            .collect::<Vec<_>>()
            .join(",")
    );
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop.send(true);
    });
    // TCP_NODELAY: an answer goes out when it is written. Over HTTP/2 an
    // answer and the frames around it (window updates, settings acks) are
    // small writes on one connection, which Nagle's algorithm would hold
    // back for the caller's delayed ACK: tens of milliseconds, past the
    // filter's 20 ms timeout.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY on a connection: {e}");
        }
    });
    let mut http_stopped = stopped.clone();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = http_stopped.changed().await;
        })
        .await
        .map_err(|e| format!("server error: {e}"))?;
    if let Some(grpc) = grpc {
        let _ = tokio::time::timeout(meshlimitd::rls::server::DRAIN, grpc).await;
    }
    info!("meshlimitd stopped");
    Ok(())
}

/// Starts the rate limit service (gRPC, with `grpc.health.v1`) on `addr`
/// with the configuration of `dir`, watched; the task ends when `stopped`
/// says so.
async fn grpc_server(
    addr: SocketAddr,
    dir: &std::path::Path,
    state: AppState,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
    use meshlimitd::rls::{reload, server::RlsService};
    let loaded = reload::load(dir);
    state.metrics.rls_config_load(loaded.is_ok());
    let loaded = loaded.map_err(|e| format!("--rls-config-dir: {e}"))?;
    let config = loaded.current.clone();
    tokio::spawn(reload::watch(
        dir.to_path_buf(),
        loaded,
        Duration::from_secs(1),
        state.metrics.clone(),
    ));
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<RateLimitServiceServer<RlsService>>()
        .await;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr} (--grpc-listen): {e}"))?;
    let incoming = listener;
    info!("rate limit service (gRPC) listening on {addr}");
    let service = RateLimitServiceServer::new(RlsService { state, config });
    Ok(tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(service)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(incoming),
                async move {
                    let _ = stopped.changed().await;
                },
            )
            .await;
        if let Err(e) = served {
            error!("rate limit service (gRPC) stopped: {e}");
        }
    }))
}

/// Hides a password in a Redis URL before it reaches a log line.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    info!("shutting down: finishing in-flight checks");
}
