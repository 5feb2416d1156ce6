//! Redis Cluster, with each node's failure kept to that node's checks.
//!
//! redis-rs' cluster connection follows MOVED and ASK and refreshes its
//! slot map after a failover, but while it recovers from one node's
//! failure it holds up every request it carries, whichever node they are
//! for: with a master killed under traffic, checks of the live masters
//! timed out too, meshlimitd answered 503, and the proxies' breakers
//! opened (thousands of fallback decisions for clients whose masters never
//! failed).
//!
//! So a script run first goes straight to the master that holds its slot,
//! on a connection of that master's own (the slot map comes from
//! `CLUSTER SLOTS`); a dead master fails only the runs sent to it. Whatever
//! that path cannot settle (a redirect during a resharding, a node that is
//! down or unknown, a failover in progress) goes through redis-rs' cluster
//! connection, and the slot map is read again in the background.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{
    ConnectionAddr, ConnectionInfo, FromRedisValue, RedisError, RedisResult, ScriptInvocation,
};
use tokio::sync::Mutex;

use crate::throttle::AtMostEvery;

/// Slots in a Redis Cluster.
const SLOTS: usize = 16_384;
/// How long a node whose direct connection failed is left to the cluster
/// connection before it is tried directly again.
const NODE_PAUSE: Duration = Duration::from_secs(1);
/// Least time between two reads of the slot map.
const REFRESH_EVERY: Duration = Duration::from_millis(500);

pub struct Cluster {
    builder: Mutex<Option<ClusterClientBuilder>>,
    client: Mutex<Option<redis::cluster::ClusterClient>>,
    /// redis-rs' connection: redirects, failovers, and anything else.
    connection: Mutex<Option<ClusterConnection>>,
    /// How to reach one node: the first seed's settings (password, TLS).
    seed: ConnectionInfo,
    certs: Option<redis::TlsCertificates>,
    /// Which master holds each slot (shared with background refreshes).
    map: Arc<RwLock<SlotMap>>,
    /// Connections straight to masters, by address.
    direct: Mutex<HashMap<String, Direct>>,
    /// Background slot-map reads, at most one per `REFRESH_EVERY`.
    refresh: AtMostEvery,
    epoch: Instant,
    /// `--redis-timeout-ms`: connecting, and reading the slot map.
    timeout: Duration,
    /// How long a direct connection awaits a run's answer (see
    /// `backend::Options::response_timeout`).
    response_timeout: Duration,
}

#[derive(Default)]
struct SlotMap {
    /// `owner[slot]` indexes `masters`; `u16::MAX` for no known owner.
    owner: Vec<u16>,
    masters: Vec<(String, u16)>,
}

enum Direct {
    Up(MultiplexedConnection),
    /// Being connected since then (by another run, which does not hold
    /// the lock meanwhile: a node that accepts but never answers must not
    /// hold up the runs for other nodes). A run cut short by its deadline
    /// leaves this behind; it is retried once it is stale.
    Connecting(Instant),
    /// Failed to connect or answer: left to the cluster connection until.
    Paused(Instant),
}

impl Cluster {
    pub fn new(
        builder: ClusterClientBuilder,
        seed: ConnectionInfo,
        certs: Option<redis::TlsCertificates>,
        timeout: Duration,
        response_timeout: Duration,
    ) -> Cluster {
        Cluster {
            builder: Mutex::new(Some(builder)),
            client: Mutex::new(None),
            connection: Mutex::new(None),
            seed,
            certs,
            map: Arc::new(RwLock::new(SlotMap::default())),
            direct: Mutex::new(HashMap::new()),
            refresh: AtMostEvery::default(),
            epoch: Instant::now(),
            timeout,
            response_timeout,
        }
    }

    /// Runs a script whose keys live in `slot`: on its master's own
    /// connection when it can, else through the cluster connection.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        slot: u16,
        invocation: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        if let Some((addr, mut conn)) = self.direct_for(slot).await {
            match invocation.invoke_async(&mut conn).await {
                Ok(value) => return Ok(value),
                // The node refused before running it: the cluster
                // connection follows the redirect.
                Err(e) if refused_before_running(&e) => self.refresh_soon(),
                // No answer: it may have run. Sending it again could run
                // it twice (one check charged twice), so the check fails
                // (its caller falls back), and the next runs for this
                // node go through the cluster connection meanwhile.
                Err(e) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => {
                    self.pause(&addr).await;
                    self.refresh_soon();
                    return Err(e);
                }
                Err(e) => return Err(e),
            }
        }
        let mut conn = self.connection().await?;
        invocation.invoke_async(&mut conn).await
    }

    /// redis-rs' cluster connection, connecting on first use (and reading
    /// the slot map then).
    pub async fn connection(&self) -> RedisResult<ClusterConnection> {
        let mut slot = self.connection.lock().await;
        if let Some(conn) = slot.as_ref() {
            return Ok(conn.clone());
        }
        let mut client = self.client.lock().await;
        if client.is_none() {
            if let Some(builder) = self.builder.lock().await.take() {
                *client = Some(builder.build()?);
            }
        }
        let Some(c) = client.as_ref() else {
            return Err(RedisError::from((
                redis::ErrorKind::Client,
                "cluster client unavailable",
            )));
        };
        let conn = tokio::time::timeout(self.patience(), c.get_async_connection())
            .await
            .map_err(|_| {
                RedisError::from((redis::ErrorKind::Io, "timed out connecting to the cluster"))
            })??;
        *slot = Some(conn.clone());
        drop(slot);
        self.refresh(conn.clone()).await;
        Ok(conn)
    }

    fn patience(&self) -> Duration {
        self.timeout.max(Duration::from_millis(250))
    }

    /// A run for `slot` got no answer within `--redis-timeout-ms` (it is
    /// still awaited on its connection): the slot's master is left to the
    /// cluster connection for a while, and the slot map read again, as
    /// when a direct run fails.
    pub async fn timed_out(&self, slot: u16) {
        if let Some((host, port)) = self.master_of(slot) {
            self.pause(&format!("{host}:{port}")).await;
            self.refresh_soon();
        }
    }

    /// The master the slot map names for `slot`.
    fn master_of(&self, slot: u16) -> Option<(String, u16)> {
        let map = self.map.read().ok()?;
        let owner = *map.owner.get(usize::from(slot))?;
        map.masters.get(usize::from(owner)).cloned()
    }

    /// The master of `slot` and a connection to it, if the map names one
    /// and it is not paused.
    async fn direct_for(&self, slot: u16) -> Option<(String, MultiplexedConnection)> {
        let (host, port) = self.master_of(slot)?;
        let addr = format!("{host}:{port}");
        {
            let mut direct = self.direct.lock().await;
            match direct.get(&addr) {
                Some(Direct::Up(conn)) => return Some((addr, conn.clone())),
                Some(Direct::Connecting(since)) if since.elapsed() < 2 * self.patience() => {
                    return None
                }
                Some(Direct::Paused(until)) if Instant::now() < *until => return None,
                _ => {}
            }
            // One attempt at a time; the node's other runs go through the
            // cluster connection until it is up.
            direct.insert(addr.clone(), Direct::Connecting(Instant::now()));
        }
        let opened = self.open(&host, port).await;
        let mut direct = self.direct.lock().await;
        match opened {
            Ok(conn) => {
                direct.insert(addr.clone(), Direct::Up(conn.clone()));
                Some((addr, conn))
            }
            Err(_) => {
                direct.insert(addr, Direct::Paused(Instant::now() + NODE_PAUSE));
                None
            }
        }
    }

    /// The masters that run with `cluster-require-full-coverage yes`
    /// (Redis' default): while any master is down, they refuse every
    /// command, so the clients of live masters fall back too. Masters
    /// that do not say (`CONFIG` renamed or refused) are left out.
    pub async fn full_coverage_required(&self) -> Vec<String> {
        if self.connection().await.is_err() {
            return Vec::new();
        }
        let masters = match self.map.read() {
            Ok(map) => map.masters.clone(),
            Err(_) => return Vec::new(),
        };
        let mut requiring = Vec::new();
        for (host, port) in masters {
            let Ok(mut conn) = self.open(&host, port).await else {
                continue;
            };
            let mut config_get = redis::cmd("CONFIG");
            config_get.arg("GET").arg("cluster-require-full-coverage");
            // Readiness waits for this: a node slow to answer says nothing.
            let reply = tokio::time::timeout(
                self.patience(),
                config_get.query_async::<Vec<String>>(&mut conn),
            )
            .await;
            if reply.is_ok_and(|r| r.is_ok_and(|r| r.get(1).is_some_and(|v| v == "yes"))) {
                requiring.push(format!("{host}:{port}"));
            }
        }
        requiring
    }

    async fn open(&self, host: &str, port: u16) -> RedisResult<MultiplexedConnection> {
        let addr = match self.seed.addr() {
            ConnectionAddr::TcpTls { insecure, .. } => ConnectionAddr::TcpTls {
                host: host.to_string(),
                port,
                insecure: *insecure,
                tls_params: None,
            },
            _ => ConnectionAddr::Tcp(host.to_string(), port),
        };
        let info = self.seed.clone().set_addr(addr);
        let client = match &self.certs {
            Some(certs) => redis::Client::build_with_tls(info, certs.clone())?,
            None => redis::Client::open(info)?,
        };
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.patience()))
            .set_response_timeout(Some(self.response_timeout));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    async fn pause(&self, addr: &str) {
        self.direct.lock().await.insert(
            addr.to_string(),
            Direct::Paused(Instant::now() + NODE_PAUSE),
        );
    }

    /// Reads the slot map again in the background, at most every
    /// `REFRESH_EVERY`.
    fn refresh_soon(&self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        if !self.refresh.claim(now, REFRESH_EVERY.as_millis() as u64) {
            return;
        }
        let Ok(conn) = self.connection.try_lock().map(|c| c.clone()) else {
            return;
        };
        let Some(conn) = conn else {
            return;
        };
        let (map, patience) = (self.map.clone(), self.patience());
        tokio::spawn(async move {
            if let Some(ranges) = read_slots(conn, patience).await {
                install(&map, &ranges);
            }
        });
    }

    async fn refresh(&self, conn: ClusterConnection) {
        if let Some(ranges) = read_slots(conn, self.patience()).await {
            install(&self.map, &ranges);
        }
    }
}

/// Whether a failed direct run should go through the cluster connection:
/// a redirect or a slot in transition (the cluster connection follows
/// them), a replica or a loading node: refusals Redis gives before it runs
/// a script, so the run cannot happen twice. Not a node that did not
/// answer (it may have run the script; issue 35, item 8:
/// `service/tests/cluster_retry.rs`). Not CLUSTERDOWN: the cluster
/// connection would only wait and retry past the caller's deadline; the
/// check fails now and the caller decides it by its fallback (with
/// `cluster-require-full-coverage no`, the live masters never answer it).
fn refused_before_running(e: &RedisError) -> bool {
    e.redirect_node().is_some()
        || matches!(
            e.code(),
            Some("MOVED" | "ASK" | "TRYAGAIN" | "READONLY" | "LOADING")
        )
}

/// `CLUSTER SLOTS` through the cluster connection.
async fn read_slots(
    mut conn: ClusterConnection,
    patience: Duration,
) -> Option<Vec<(u16, u16, String, u16)>> {
    let reply = tokio::time::timeout(
        patience,
        redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async::<redis::Value>(&mut conn),
    )
    .await
    .ok()?
    .ok()?;
    Some(slot_ranges(&reply))
}

/// Replaces the slot map with `ranges`.
fn install(map: &RwLock<SlotMap>, ranges: &[(u16, u16, String, u16)]) {
    let mut masters: Vec<(String, u16)> = Vec::new();
    let mut owner = vec![u16::MAX; SLOTS];
    for (start, end, host, port) in ranges {
        let index = match masters.iter().position(|(h, p)| h == host && p == port) {
            Some(i) => i,
            None => {
                masters.push((host.clone(), *port));
                masters.len() - 1
            }
        };
        let index = u16::try_from(index).unwrap_or(u16::MAX);
        for slot in usize::from(*start)..=usize::from(*end) {
            if let Some(o) = owner.get_mut(slot) {
                *o = index;
            }
        }
    }
    if let Ok(mut m) = map.write() {
        *m = SlotMap { owner, masters };
    }
}

/// `(first slot, last slot, master host, master port)` of each range in a
/// `CLUSTER SLOTS` reply; ranges it cannot read are left out.
fn slot_ranges(reply: &redis::Value) -> Vec<(u16, u16, String, u16)> {
    let redis::Value::Array(ranges) = reply else {
        return Vec::new();
    };
    ranges
        .iter()
        .filter_map(|range| {
            let redis::Value::Array(fields) = range else {
                return None;
            };
            let int = |v: Option<&redis::Value>| match v {
                Some(redis::Value::Int(i)) => u16::try_from(*i).ok(),
                _ => None,
            };
            let (start, end) = (int(fields.first())?, int(fields.get(1))?);
            let redis::Value::Array(master) = fields.get(2)? else {
                return None;
            };
            let host = match master.first()? {
                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                redis::Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let port = int(master.get(1))?;
            Some((start, end, host, port))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;

    fn node(host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(b"id".to_vec()),
        ])
    }

    #[test]
    fn the_slot_map_is_read_from_cluster_slots() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                node("10.0.0.2", 7001),
            ]),
            Value::Array(vec![Value::Int(1)]),
            Value::Int(3),
        ]);
        let ranges = slot_ranges(&reply);
        assert_eq!(
            ranges,
            vec![
                (0, 5460, "10.0.0.1".to_string(), 7000),
                (5461, 16383, "10.0.0.2".to_string(), 7001)
            ]
        );
        let map = RwLock::new(SlotMap::default());
        install(&map, &ranges);
        let m = map.read().unwrap();
        assert_eq!(
            m.masters[usize::from(m.owner[100])],
            ("10.0.0.1".to_string(), 7000)
        );
        assert_eq!(
            m.masters[usize::from(m.owner[16383])],
            ("10.0.0.2".to_string(), 7001)
        );
        assert_eq!(slot_ranges(&Value::Nil), vec![]);
    }
}
