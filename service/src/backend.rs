//! The Redis deployments meshlimitd runs on: a standalone Redis, a Redis
//! Cluster, or a master found through Redis Sentinel.
//!
//! Every backend connects lazily (meshlimitd starts and answers 503 while
//! Redis is away) and recovers by itself: the standalone connection manager
//! reconnects; the cluster client follows MOVED and ASK and refreshes its
//! slot map; the sentinel backend asks the sentinels for the master again
//! after a connection error or a READONLY reply (a failover happened).
//! One check's keys share a hash tag, so in a cluster each script run goes
//! to exactly one node.

use std::sync::Arc;
use std::time::Duration;

use crate::cluster::Cluster;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::ClusterClientBuilder;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    Cmd, FromRedisValue, IntoConnectionInfo, RedisError, RedisResult, Script, ScriptInvocation,
    TlsMode,
};
use tokio::sync::Mutex;

/// How to reach Redis.
#[derive(Debug, Clone, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// One Redis (`--redis-url redis://host:6379`).
    Standalone,
    /// Redis Cluster (`--redis-url` lists seed nodes, comma-separated).
    Cluster,
    /// The master of `--sentinel-master`, found through the sentinels in
    /// `--redis-url` (comma-separated).
    Sentinel,
}

#[derive(Debug, Clone)]
pub struct Options {
    pub mode: Mode,
    pub urls: Vec<String>,
    pub sentinel_master: Option<String>,
    /// PEM CA certificate for `rediss://` URLs (otherwise the system's roots).
    pub ca_pem: Option<Vec<u8>>,
    /// PEM certificate and key meshlimitd presents to Redis (mutual TLS,
    /// for a Redis with `tls-auth-clients yes`).
    pub client_pem: Option<(Vec<u8>, Vec<u8>)>,
    /// `--redis-timeout-ms`: how long connecting may take (at least
    /// 100 ms), and how long a script run may take before it counts as a
    /// failure (see `Limiter::run`).
    pub timeout: Duration,
    /// How long a connection awaits a command's answer before it gives up
    /// on it. Longer than `timeout`: a script that ran slow is still
    /// awaited, so that what it charged for a caller who gave up on it is
    /// known and goes back (`crate::limiter::LATE_ANSWERS_AWAITED`).
    pub response_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--redis-url is empty")]
    NoUrl,
    #[error("--redis-mode sentinel needs --sentinel-master")]
    NoSentinelMaster,
    #[error("with --redis-mode sentinel, TLS files (--redis-ca-file, --redis-client-cert) need rediss:// sentinel URLs")]
    SentinelTlsFilesWithoutTls,
    #[error("with --redis-mode sentinel, use rediss:// for every sentinel or for none")]
    SentinelMixedTls,
    #[error("standalone mode takes one --redis-url, got {0}")]
    TooManyUrls(usize),
    #[error("invalid Redis URL: {0}")]
    Url(#[from] RedisError),
}

/// A cheap-to-clone handle on the configured Redis.
#[derive(Clone)]
pub enum Backend {
    Standalone(ConnectionManager),
    Cluster(Arc<Cluster>),
    Sentinel(Arc<SentinelMaster>),
}

pub struct SentinelMaster {
    sentinel: Mutex<SentinelClient>,
    connection: Mutex<Option<MultiplexedConnection>>,
    timeout: Duration,
    response_timeout: Duration,
}

/// The CA and client certificate to use, if any was given (otherwise
/// `rediss://` trusts the system's roots and presents no certificate).
fn tls_certs(options: &Options) -> Option<redis::TlsCertificates> {
    if options.ca_pem.is_none() && options.client_pem.is_none() {
        return None;
    }
    Some(redis::TlsCertificates {
        client_tls: options
            .client_pem
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: options.ca_pem.clone(),
    })
}

/// The sentinels' client. With `rediss://` sentinel URLs, TLS everywhere:
/// to the sentinels and to the master they name, with the given CA and
/// client certificate for both (Redis' `tls-replication yes` setups).
fn sentinel_client(options: &Options, master: &str) -> Result<SentinelClient, ConfigError> {
    let secure = options
        .urls
        .iter()
        .filter(|u| u.starts_with("rediss://"))
        .count();
    if secure == 0 {
        // Refuse rather than silently connect without the files.
        if tls_certs(options).is_some() {
            return Err(ConfigError::SentinelTlsFilesWithoutTls);
        }
        return Ok(SentinelClient::build(
            options.urls.clone(),
            master,
            None,
            SentinelServerType::Master,
        )?);
    }
    if secure != options.urls.len() {
        return Err(ConfigError::SentinelMixedTls);
    }
    let mut sentinels = Vec::with_capacity(options.urls.len());
    let mut auth = None;
    for url in &options.urls {
        let info = url.as_str().into_connection_info()?;
        let settings = info.redis_settings();
        if auth.is_none() {
            auth = Some((
                settings.username().map(String::from),
                settings.password().map(String::from),
            ));
        }
        sentinels.push(info.addr().clone());
    }
    let mut builder = SentinelClientBuilder::new(sentinels, master, SentinelServerType::Master)?
        .set_client_to_redis_tls_mode(TlsMode::Secure);
    // The sentinels' credentials come from their URLs, as without TLS.
    if let Some((username, password)) = auth {
        if let Some(u) = username {
            builder = builder.set_client_to_sentinel_username(u);
        }
        if let Some(p) = password {
            builder = builder.set_client_to_sentinel_password(p);
        }
    }
    if let Some(certs) = tls_certs(options) {
        builder = builder
            .set_client_to_redis_certificates(certs.clone())
            .set_client_to_sentinel_certificates(certs);
    }
    Ok(builder.build()?)
}

impl Backend {
    pub fn new(options: &Options) -> Result<Backend, ConfigError> {
        let first = options.urls.first().ok_or(ConfigError::NoUrl)?;
        match options.mode {
            Mode::Standalone => {
                if options.urls.len() > 1 {
                    return Err(ConfigError::TooManyUrls(options.urls.len()));
                }
                let client = match tls_certs(options) {
                    Some(certs) => redis::Client::build_with_tls(first.as_str(), certs)?,
                    None => redis::Client::open(first.as_str())?,
                };
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(options.timeout.max(Duration::from_millis(100))))
                    .set_response_timeout(Some(options.response_timeout))
                    // Reconnect quickly and give up quickly: a caller waiting
                    // on a reconnect loop is past the filter's timeout. The
                    // next command after a failure starts a new attempt.
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(10))
                    .set_max_delay(Duration::from_millis(200));
                Ok(Backend::Standalone(
                    ConnectionManager::new_lazy_with_config(client, config)?,
                ))
            }
            Mode::Cluster => {
                let mut builder =
                    ClusterClientBuilder::new(options.urls.iter().map(String::as_str))
                        .connection_timeout(options.timeout.max(Duration::from_millis(100)))
                        .response_timeout(options.response_timeout);
                if let Some(certs) = tls_certs(options) {
                    builder = builder.certs(certs);
                }
                let seed = first.as_str().into_connection_info()?;
                Ok(Backend::Cluster(Arc::new(Cluster::new(
                    builder,
                    seed,
                    tls_certs(options),
                    options.timeout,
                    options.response_timeout,
                ))))
            }
            Mode::Sentinel => {
                let master = options
                    .sentinel_master
                    .clone()
                    .ok_or(ConfigError::NoSentinelMaster)?;
                let sentinel = sentinel_client(options, &master)?;
                Ok(Backend::Sentinel(Arc::new(SentinelMaster {
                    sentinel: Mutex::new(sentinel),
                    connection: Mutex::new(None),
                    timeout: options.timeout,
                    response_timeout: options.response_timeout,
                })))
            }
        }
    }

    /// Runs a script invocation (EVALSHA, loading the script on NOSCRIPT)
    /// whose keys live in cluster slot `slot`.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        slot: u16,
        invocation: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        match self {
            Backend::Standalone(conn) => invocation.invoke_async(&mut conn.clone()).await,
            Backend::Cluster(cluster) => cluster.invoke(slot, invocation).await,
            Backend::Sentinel(master) => {
                let mut conn = master.connection().await?;
                let result = invocation.invoke_async(&mut conn).await;
                master.after(&result).await;
                result
            }
        }
    }

    /// A run for `slot` got no answer within `--redis-timeout-ms` (it is
    /// still awaited). A Sentinel master that went silent (stopped,
    /// partitioned, powered off) never fails a call, it only lets it time
    /// out: the cached connection is dropped here, so the next call asks
    /// the sentinels which master to use. A Cluster master's own
    /// connection is left to the cluster connection for a while, as when
    /// it fails.
    pub async fn timed_out(&self, slot: u16) {
        match self {
            Backend::Sentinel(master) => *master.connection.lock().await = None,
            Backend::Cluster(cluster) => cluster.timed_out(slot).await,
            Backend::Standalone(_) => {}
        }
    }

    /// Whether keys with different hash tags may live on different nodes.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Backend::Cluster(_))
    }

    /// On a Redis Cluster, the masters with `cluster-require-full-coverage
    /// yes` (see [`Cluster::full_coverage_required`]); none elsewhere.
    pub async fn full_coverage_required(&self) -> Vec<String> {
        match self {
            Backend::Cluster(cluster) => cluster.full_coverage_required().await,
            _ => Vec::new(),
        }
    }

    /// Loads a script into the script cache (every node, for a cluster).
    pub async fn load(&self, script: &Script) -> RedisResult<()> {
        match self {
            Backend::Standalone(conn) => script.load_async(&mut conn.clone()).await.map(drop),
            Backend::Cluster(cluster) => {
                // redis-rs sends SCRIPT LOAD to every master.
                let mut conn = cluster.connection().await?;
                script.load_async(&mut conn).await.map(drop)
            }
            Backend::Sentinel(master) => {
                let mut conn = master.connection().await?;
                let result = script.load_async(&mut conn).await.map(drop);
                master.after(&result).await;
                result
            }
        }
    }

    /// A pipeline whose keys share one slot. (Not one code path with
    /// [`Backend::query`]: on a Cluster, redis-rs routes a pipeline by its
    /// first key, but a lone command by the command itself: PING must
    /// succeed on every node.)
    pub async fn query_pipe<T: FromRedisValue>(&self, pipe: &redis::Pipeline) -> RedisResult<T> {
        match self {
            Backend::Standalone(conn) => pipe.query_async(&mut conn.clone()).await,
            Backend::Cluster(cluster) => {
                let mut conn = cluster.connection().await?;
                pipe.query_async(&mut conn).await
            }
            Backend::Sentinel(master) => {
                let mut conn = master.connection().await?;
                let result = pipe.query_async(&mut conn).await;
                master.after(&result).await;
                result
            }
        }
    }

    /// A command (PING for readiness).
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Backend::Standalone(conn) => cmd.query_async(&mut conn.clone()).await,
            Backend::Cluster(cluster) => {
                let mut conn = cluster.connection().await?;
                cmd.query_async(&mut conn).await
            }
            Backend::Sentinel(master) => {
                let mut conn = master.connection().await?;
                let result = cmd.query_async(&mut conn).await;
                master.after(&result).await;
                result
            }
        }
    }
}

impl SentinelMaster {
    async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        let mut slot = self.connection.lock().await;
        if let Some(conn) = slot.as_ref() {
            return Ok(conn.clone());
        }
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(self.response_timeout));
        // Bounded as a whole: the slot stays locked meanwhile, and a run
        // that outlives its timeout is still awaited (`Limiter::run`).
        let connect = async {
            let client = self.sentinel.lock().await.async_get_client().await?;
            client
                .get_multiplexed_async_connection_with_config(&config)
                .await
        };
        let conn = tokio::time::timeout(self.timeout.max(Duration::from_millis(250)), connect)
            .await
            .map_err(|_| {
                RedisError::from((
                    redis::ErrorKind::Io,
                    "timed out finding or connecting to the master",
                ))
            })??;
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// After a failover the old master refuses writes (READONLY) or is
    /// gone: forget it, so the next call asks the sentinels again.
    async fn after<T>(&self, result: &RedisResult<T>) {
        if let Err(e) = result {
            let readonly = e.code() == Some("READONLY");
            if readonly || e.is_io_error() || e.is_connection_dropped() || e.is_timeout() {
                *self.connection.lock().await = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(mode: Mode) -> Options {
        Options {
            mode,
            urls: vec!["redis://127.0.0.1:1".into()],
            sentinel_master: Some("m".into()),
            ca_pem: None,
            client_pem: None,
            timeout: Duration::from_millis(50),
            response_timeout: Duration::from_millis(50),
        }
    }

    #[test]
    fn sentinel_tls_follows_the_urls_and_never_ignores_files() {
        let mut o = options(Mode::Sentinel);
        assert!(Backend::new(&o).is_ok());
        o.ca_pem = Some(b"pem".to_vec());
        assert!(matches!(
            Backend::new(&o),
            Err(ConfigError::SentinelTlsFilesWithoutTls)
        ));
        o.ca_pem = None;
        o.urls = vec!["rediss://127.0.0.1:1".into(), "redis://127.0.0.1:2".into()];
        assert!(matches!(
            Backend::new(&o),
            Err(ConfigError::SentinelMixedTls)
        ));
        o.urls = vec![
            "rediss://u:p@127.0.0.1:1".into(),
            "rediss://127.0.0.1:2".into(),
        ];
        assert!(Backend::new(&o).is_ok());
    }

    #[test]
    fn a_client_certificate_alone_still_builds_tls_settings() {
        let mut o = options(Mode::Standalone);
        assert!(tls_certs(&o).is_none());
        o.client_pem = Some((b"cert".to_vec(), b"key".to_vec()));
        let certs = tls_certs(&o).expect("client certificate");
        assert!(certs.root_cert.is_none(), "system roots");
        assert!(certs.client_tls.is_some());
    }
}
