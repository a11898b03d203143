//! The connection to Redis: the [`RedisBackend`] with a connection per
//! runtime slot, the primary found directly or through Sentinel, every call
//! followed by `WAIT` for the replicas it must reach, and the checks at
//! connect (durability settings, replication role).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, Cmd, FromRedisValue, IntoConnectionInfo,
    TlsCertificates,
};

use crate::store::api::{Replicas, StoreError};

use super::backend::{replicas_seen, unavailable, Calls};

use super::scripts::*;
use super::sentinel::Sentinels;

/// How long after a failed connection or call the next connect waits.
pub(super) const BACKOFF: Duration = Duration::from_millis(200);

/// Where the primary is.
pub(super) enum Source {
    Direct(Client),
    /// Asked of the Sentinels at every connect.
    Sentinel(Sentinels),
}

/// How to reach Redis and how much to wait for its replicas.
pub struct Options<'a> {
    /// `redis+sentinel://`: the Sentinels and the master name.
    pub sentinel: Option<&'a crate::config::Sentinel>,
    /// Replaces the URL's password.
    pub password: Option<&'a crate::config::Secret>,
    /// TLS (`rediss://`): the CA and client certificate, if given.
    pub pem: Option<crate::tls::StorePem>,
    /// Bounds connects and every command.
    pub timeout: Duration,
    /// Replicas a change must reach (`None`: one while a replica is online).
    pub replicas_to_wait: Option<u32>,
}

/// One runtime's connection, with the replicas its primary reported
/// online when it connected (or more seen since): without a setting, a
/// change on it waits for one of them, if any. Kept per connection, so that
/// a runtime reconnecting to a primary with none online does not stop the
/// waits of calls still out on another runtime's older connection.
#[derive(Clone)]
pub(super) struct Conn {
    pub(super) c: MultiplexedConnection,
    pub(super) online: Arc<AtomicU32>,
}

/// A Redis connection that reconnects (with backoff) after failures.
pub struct RedisBackend {
    pub(super) source: Source,
    /// One connection per runtime (the main one and each worker's): a
    /// multiplexed connection's driver task lives on the runtime that
    /// connected it, and a call from another thread would cost two hops.
    pub(super) conns: dashmap::DashMap<usize, Arc<tokio::sync::Mutex<Option<Conn>>>>,
    pub(super) session: AtomicU64,
    pub(super) last_failure: Mutex<Option<Instant>>,
    pub(super) timeout: Duration,
    /// `store_replicas_to_wait`, if set.
    pub(super) replicas_to_wait: Option<u32>,
    /// The last answered call's replicas, wanted in the high half and
    /// confirmed in the low; `u64::MAX` when there is none
    /// (`FenceStore::replicas`).
    pub(super) last_wait: AtomicU64,
    /// Calls failed for too few confirmations, since start.
    pub(super) failed_waits: AtomicU64,
    pub(super) keys: Keyspace,
    pub(super) scripts: Scripts,
}

/// A failed connect: refused (wrong password or user, a certificate that
/// does not check out) or unavailable.
pub(super) fn connect_failed(e: redis::RedisError, what: &str) -> StoreError {
    // The cluster client flattens a node's refusal into its own error's
    // text ("Failed to create initial connections - ... AuthenticationFailed").
    let text = e.to_string();
    let auth = matches!(e.kind(), redis::ErrorKind::AuthenticationFailed)
        || e.code()
            .is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH" || c == "NOPERM")
        || ["AuthenticationFailed", "WRONGPASS"]
            .iter()
            .any(|w| text.contains(w));
    if auth || crate::tls::certificate_refused(&e) {
        StoreError::Refused(format!("{what}: {e}"))
    } else {
        StoreError::Unavailable(format!("{what}: {e}"))
    }
}

impl RedisBackend {
    /// `url`: `redis://host:port/db` or `rediss://` (TLS, with the CA and
    /// client certificate if given), or the `redis+sentinel://` URL that
    /// `sentinel` was parsed from. Connects lazily.
    pub fn new(url: &str, o: Options<'_>) -> Result<Self, String> {
        let source = match o.sentinel {
            Some(s) => Source::Sentinel(Sentinels::new(s, o.password)?),
            None => {
                let mut info = url
                    .into_connection_info()
                    .map_err(|e| format!("not a Redis URL: {e}"))?;
                if let Some(pw) = o.password {
                    let settings = info.redis_settings().clone().set_password(pw.expose());
                    info = info.set_redis_settings(settings);
                }
                Source::Direct(
                    match o.pem {
                        Some(pem) => Client::build_with_tls(
                            info,
                            TlsCertificates {
                                client_tls: pem.client.map(|(client_cert, client_key)| {
                                    ClientTlsConfig {
                                        client_cert,
                                        client_key,
                                    }
                                }),
                                root_cert: pem.ca,
                            },
                        ),
                        None => Client::open(info),
                    }
                    .map_err(|e| e.to_string())?,
                )
            }
        };
        Ok(Self {
            source,
            conns: dashmap::DashMap::new(),
            session: AtomicU64::new(0),
            last_wait: AtomicU64::new(u64::MAX),
            failed_waits: AtomicU64::new(0),
            last_failure: Mutex::new(None),
            timeout: o.timeout,
            replicas_to_wait: o.replicas_to_wait,
            keys: Keyspace::lone(),
            scripts: Scripts::new(),
        })
    }

    /// Replicas a call on `conn` waits for.
    pub(super) fn replicas_wanted(&self, conn: &Conn) -> u32 {
        self.replicas_to_wait
            .unwrap_or_else(|| conn.online.load(Ordering::Relaxed).min(1))
    }

    /// Replicas seen online by a later read: every live connection waits
    /// for them from then on. The count of a connection never goes down
    /// (a failed wait drops the connections; a new one counts afresh).
    pub(super) fn saw_replicas(&self, online: u32) {
        let slots: Vec<_> = self.conns.iter().map(|s| s.value().clone()).collect();
        for slot in slots {
            // A slot that is being connected (its lock held through a
            // backoff and a connect) gets a count of its own: no wait
            // for it here.
            if let Ok(slot) = slot.try_lock() {
                if let Some(c) = slot.as_ref() {
                    c.online.fetch_max(online, Ordering::Relaxed);
                }
            }
        }
    }

    /// `WAIT`'s own timeout: half the store timeout, so that the reply
    /// (too few replicas) arrives before the call itself times out.
    pub(super) fn wait_ms(&self) -> u64 {
        (self.timeout.as_millis() as u64 / 2).max(1)
    }

    /// This runtime's connection slot (see [`crate::slot::slot`]).
    pub(super) fn slot(&self) -> Arc<tokio::sync::Mutex<Option<Conn>>> {
        let slot = crate::slot::slot();
        // A read lock on the usual path; the entry (a write lock) only the
        // first time a runtime calls.
        if let Some(s) = self.conns.get(&slot) {
            return s.value().clone();
        }
        self.conns.entry(slot).or_default().value().clone()
    }

    pub(super) async fn connection(&self) -> Result<Conn, StoreError> {
        let slot = self.slot();
        let mut slot = slot.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        // Back off after a failure instead of hammering a server that is
        // down: the call waits out the pause, then tries (a server that
        // came back, after a restart, answers it).
        let since = self.last_failure.lock().expect("lock").map(|t| t.elapsed());
        if let Some(pause) = since.and_then(|e| BACKOFF.checked_sub(e)) {
            tokio::time::sleep(pause).await;
        }
        match tokio::time::timeout(self.timeout, self.connect()).await {
            Ok(Ok((c, online))) => {
                let c = Conn {
                    c,
                    online: Arc::new(AtomicU32::new(online)),
                };
                self.session.fetch_add(1, Ordering::AcqRel);
                *self.last_failure.lock().expect("lock") = None;
                *slot = Some(c.clone());
                Ok(c)
            }
            Ok(Err(e)) => {
                *self.last_failure.lock().expect("lock") = Some(Instant::now());
                Err(e)
            }
            Err(_) => {
                *self.last_failure.lock().expect("lock") = Some(Instant::now());
                Err(unavailable("connect timed out"))
            }
        }
    }

    /// A new connection to the primary (asked of Sentinel first, with
    /// `redis+sentinel://`), checked to be one: a replica would refuse
    /// every write, and a primary demoted by a failover is one; through
    /// Sentinel, confirmed after the check (see [`Sentinels::confirm`]).
    /// With the replicas online it reported (or Sentinel sees up).
    pub(super) async fn connect(&self) -> Result<(MultiplexedConnection, u32), StoreError> {
        // The caller bounds the whole connect by the store timeout; the
        // Sentinels' confirmation must answer within it.
        let confirm_by = Instant::now() + self.timeout * 9 / 10;
        let (client, named) = match &self.source {
            Source::Direct(c) => (c.clone(), None),
            Source::Sentinel(s) => {
                let (client, addr) = s.primary(self.timeout).await?;
                (client, Some((s, addr)))
            }
        };
        let mut c = self
            .open(&client)
            .await
            .map_err(|e| connect_failed(e, "redis"))?;
        let info: redis::RedisResult<String> = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut c)
            .await;
        // `None`: an ACL without INFO (`-@dangerous`); the role is found by
        // the first write (READONLY), the replicas are not known.
        let reported = match info {
            Ok(info) => {
                let (role, online) = replication(&info);
                if role != "master" {
                    return Err(unavailable(format!(
                        "the server is a {role}, not the primary (point the store at the primary, or use redis+sentinel://)"
                    )));
                }
                Some(online)
            }
            Err(e) if e.code() == Some("NOPERM") => None,
            Err(e) => return Err(unavailable(e)),
        };
        // Asked after INFO, so that a failover begun meanwhile is seen.
        // Replicas that Sentinel sees up count too: an old primary
        // restarted before Sentinel announced its replica's promotion has
        // no replica of its own, yet is about to become one and lose what
        // it takes meanwhile.
        let seen = match named {
            Some((s, addr)) => s.confirm(&addr, confirm_by).await?,
            None => 0,
        };
        let online = match (reported, self.replicas_to_wait) {
            (Some(online), None) => {
                let online = online.max(seen);
                if online == 0 {
                    tracing::warn!("connected to a redis primary with no replica online: changes are not waited for, and a failover can lose them (docs/stores.md)");
                }
                online
            }
            (Some(online), Some(_)) => online,
            (None, wait) => {
                if wait.is_none() {
                    tracing::warn!("redis refuses INFO to fencegate's user: the replicas online are unknown, so changes are not waited for; allow +info or set store_replicas_to_wait (docs/stores.md)");
                }
                0
            }
        };
        warn_if_not_durable(&mut c).await;
        let wanted = self.replicas_to_wait.unwrap_or(online.min(1));
        tracing::info!(
            online_replicas = online,
            waits_for = wanted,
            "connected to redis"
        );
        Ok((c, online))
    }

    /// A connection to `client`'s server, its connect and every answer
    /// bounded by the store timeout.
    pub(super) async fn open(&self, client: &Client) -> redis::RedisResult<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// Runs one command. On a broken connection (a restarted server closed
    /// it; found by this call) it runs once more on a fresh connection, so
    /// that no request fails for it: every operation of this backend may
    /// run twice (the fence is a compare-and-raise, leases are named by the
    /// caller and registered, refreshed or removed by name, the marker's
    /// bump only rises). So does a script the server no longer has (a
    /// promoted replica, `SCRIPT FLUSH`), once loaded. Other failures, a
    /// timeout among them, drop every runtime's connection so the next call
    /// reconnects.
    pub(super) async fn run<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        self.run_on(|conn| f(conn.c)).await
    }

    /// [`run`](Self::run), `f` given the connection with its replica
    /// count.
    pub(super) async fn run_on<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let mut conn = self.connection().await?;
        let (mut reconnected, mut loaded) = (false, false);
        loop {
            let e = match f(conn.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            if !loaded && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) {
                // (A server that restarted lost its scripts as well as the
                // connection: both may happen to one call.)
                loaded = true;
                self.load_scripts(&mut conn.c).await?;
            } else if !reconnected && e.is_connection_dropped() && !e.is_timeout() {
                // The other runtimes' connections went with the server.
                reconnected = true;
                self.drop_connections().await;
                conn = self.connection().await?;
            } else {
                return Err(self.failed(e).await);
            }
        }
    }

    pub(super) async fn load_scripts(
        &self,
        c: &mut MultiplexedConnection,
    ) -> Result<(), StoreError> {
        for script in self.scripts.all() {
            if let Err(e) = script.load_async(c).await {
                return Err(self.failed(e).await);
            }
        }
        Ok(())
    }

    /// A failed call: a connection-level failure (or a primary that became
    /// a replica) drops every runtime's connection and starts the
    /// reconnect backoff.
    pub(super) async fn failed(&self, e: redis::RedisError) -> StoreError {
        if e.is_io_error()
            || e.is_connection_dropped()
            || e.is_timeout()
            || e.is_unrecoverable_error()
            || e.code() == Some("READONLY")
        {
            self.drop_connections().await;
            *self.last_failure.lock().expect("lock") = Some(Instant::now());
        }
        if e.code() == Some("NOPERM") {
            // An ACL user without the commands fencegate runs.
            return StoreError::Refused(format!(
                "redis: {e} (docs/stores.md lists the ACL fencegate needs)"
            ));
        }
        unavailable(e)
    }

    /// Every runtime reconnects on its next call.
    pub(super) async fn drop_connections(&self) {
        let slots: Vec<_> = self.conns.iter().map(|s| s.value().clone()).collect();
        for slot in slots {
            *slot.lock().await = None;
        }
    }

    /// Runs `cmd`; its answer counts once the replicas wanted have
    /// everything up to it (see the module doc): `SET fencegate:sync` and
    /// `WAIT` go in the same round trip. Too few confirmations fail the
    /// call, and the next one reconnects (and sees how many replicas are
    /// online then).
    pub(super) async fn waited<T: FromRedisValue>(&self, cmd: Cmd) -> Result<T, StoreError> {
        let (cmd, wait_ms) = (&cmd, self.wait_ms());
        let answered = self
            .run_on(|conn| async move {
                // The count of the connection the call goes on: after a
                // failover, the count the new primary reported, and never
                // another runtime's newer connection's.
                let wanted = self.replicas_wanted(&conn);
                let mut c = conn.c;
                if wanted == 0 {
                    return cmd.query_async(&mut c).await.map(|v| (v, 0, 0));
                }
                let mut p = redis::pipe();
                p.add_command(cmd.clone())
                    .cmd("SET")
                    .arg(self.keys.sync())
                    .arg(1)
                    .ignore()
                    .cmd("WAIT")
                    .arg(wanted)
                    .arg(wait_ms);
                let (v, confirmed): (T, u32) = p.query_async(&mut c).await?;
                Ok((v, wanted, confirmed))
            })
            .await;
        let (v, wanted, confirmed) = match answered {
            Ok(a) => a,
            Err(e) => {
                self.last_wait.store(u64::MAX, Ordering::Relaxed);
                return Err(e);
            }
        };
        self.last_wait.store(
            u64::from(wanted) << 32 | u64::from(confirmed),
            Ordering::Relaxed,
        );
        if confirmed < wanted {
            self.failed_waits.fetch_add(1, Ordering::Relaxed);
            self.drop_connections().await;
            *self.last_failure.lock().expect("lock") = Some(Instant::now());
            return Err(unavailable(format!(
                "{confirmed} of {wanted} replicas confirmed the call within {wait_ms} ms (store_replicas_to_wait, docs/stores.md)"
            )));
        }
        Ok(v)
    }
}

#[async_trait::async_trait]
impl Calls for RedisBackend {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire)
    }

    fn replicas(&self) -> Option<Replicas> {
        replicas_seen(&self.last_wait, &self.failed_waits)
    }

    fn keys(&self) -> &Keyspace {
        &self.keys
    }

    fn scripts(&self) -> &Scripts {
        &self.scripts
    }

    async fn query<T: FromRedisValue + Send>(&self, cmd: Cmd) -> Result<T, StoreError> {
        self.waited(cmd).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let _: String = self
            .run(|mut c| async move { redis::cmd("PING").query_async(&mut c).await })
            .await?;
        Ok(())
    }

    async fn before_marker_read(&self) -> Result<(), StoreError> {
        if self.replicas_to_wait.is_some() {
            return Ok(());
        }
        // The heartbeat reads the marker every second: a replica that
        // came online is waited for from then on. The count only goes
        // down at a connect (a wait that failed drops the connections):
        // a primary that lost its replica because it was cut off and
        // replaced (a failover while it was stopped or partitioned) must
        // not start taking writes unwaited on this connection, writes
        // that the promoted replica will never have.
        let info: Result<String, _> = self
            .run(|mut c| async move {
                redis::cmd("INFO")
                    .arg("replication")
                    .query_async(&mut c)
                    .await
            })
            .await;
        if let Ok(info) = info {
            let (role, online) = replication(&info);
            if role != "master" {
                // Demoted without its clients being cut (a REPLICAOF by
                // hand or by a tool other than Sentinel): its answers are
                // a copy that may lag.
                self.drop_connections().await;
                *self.last_failure.lock().expect("lock") = Some(Instant::now());
                return Err(unavailable(format!(
                    "the server became a {role}: reconnecting to the primary"
                )));
            }
            self.saw_replicas(online);
        }
        Ok(())
    }
}

/// `INFO replication`'s role and how many replicas are online (their
/// `slaveN:...,state=online,...` lines).
pub(super) fn replication(info: &str) -> (String, u32) {
    let mut role = String::from("server of unknown role");
    let mut online = 0;
    for line in info.lines() {
        let line = line.trim();
        if let Some(r) = line.strip_prefix("role:") {
            role = r.to_string();
        } else if line.starts_with("slave") && line.contains("state=online") {
            online += 1;
        }
    }
    (role, online)
}

/// Logs a warning unless the server fsyncs every write (`appendonly yes`,
/// `appendfsync always`). CONFIG may be disabled: then nothing is said.
pub(super) async fn warn_if_not_durable(c: &mut MultiplexedConnection) {
    let get = |name: &'static str| {
        let mut c = c.clone();
        async move {
            let v: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async(&mut c)
                .await;
            v.ok().and_then(|v| v.get(1).cloned())
        }
    };
    if let Some(policy) = get("maxmemory-policy").await {
        if policy != "noeviction" {
            tracing::warn!(maxmemory_policy = %policy, "redis may evict keys under memory pressure, fences and leases included (set maxmemory-policy noeviction; see docs/stores.md)");
        }
    }
    let (aof, fsync) = (get("appendonly").await, get("appendfsync").await);
    if let (Some(aof), Some(fsync)) = (aof, fsync) {
        if aof != "yes" || fsync != "always" {
            tracing::warn!(appendonly = %aof, appendfsync = %fsync, "redis does not fsync every write: an acknowledged fence can be lost in a redis crash (set appendonly yes, appendfsync always; see docs/stores.md)");
        }
    }
}
