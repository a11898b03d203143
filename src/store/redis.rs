//! The Redis store: fences as strings, in-flight leases as hashes, each
//! operation one Lua script (EVALSHA, reloaded on NOSCRIPT).
//!
//! Keyspace (the `{...}` hash tag keeps a key's fence and leases in one
//! cluster slot):
//! - `fencegate:f:{KEY}`: the highest token, as a decimal string (Lua numbers
//!   are doubles and cannot hold every u64; scripts compare the strings by
//!   length, then lexically, which is numeric order for canonical decimals).
//! - `fencegate:l:{KEY}`: hash of lease `TOKEN20:ID` -> expiry (ms, on the
//!   Redis server's clock, `TIME`).
//! - `fencegate:o:{KEY}`: the same leases in a sorted set (score 0, ordered
//!   by name, so by zero-padded token): the oldest lease is found in
//!   O(log n).
//! - `fencegate:g:{KEY}`: the lock service's lease on the key, a hash of
//!   `id`, `token`, `holder` and `exp` (ms, server clock), expiring with
//!   it (PEXPIRE).
//! - `fencegate:marker`: hash with `epoch` and `seq` (amnesia detection).
//!
//! - `fencegate:sync`: written after each call whose effects must reach
//!   replicas (see below).
//!
//! Durability is Redis's: only `appendonly yes` with `appendfsync always`
//! makes an acknowledged raise survive a Redis crash; fencegate warns at
//! connect when the server says otherwise.
//!
//! Replication is asynchronous, so a failover to a replica can lose what the
//! primary acknowledged. Each call is therefore followed, in the same round
//! trip, by a write to `fencegate:sync` and `WAIT N`: its answer counts only
//! once N replicas have everything up to that write, which covers what the
//! call changed and what it read (another replica's raise it saw). Too few
//! confirmations in time fail the call like a store timeout. The primary is
//! found directly (`redis://`) or asked of Sentinel (`redis+sentinel://`),
//! again after every connection failure, so a promoted replica is followed.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, Cmd, ConnectionAddr, FromRedisValue,
    IntoConnectionInfo, Script, TlsCertificates,
};

use super::api::{Advance, LeaseOutcome, StoreError, WriteLease};
use super::shared::{
    advance_answer, lease_answer, lock_reply, stored_token, Acquire, Backend, LockCall, LockReply,
    Marker,
};

const LT: &str = r#"
local function lt(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Leases of a key: lk, hash member -> expiry ms; ok, sorted set of the same
-- members, all with score 0, so they sort by name: "TOKEN20:ID". The oldest
-- lease is the first member: finding an older one costs O(log n), however
-- many writes of one token are in flight.
-- A whole number of ms as a command argument. Lua would format the number
-- with "%.17g" (floating-point printing, a few percent of Redis's CPU per
-- write); a batch's writes mostly share their values, formatted once.
local formatted = {}
local function ms(n)
  local s = formatted[n]
  if not s then
    s = string.format('%d', n)
    formatted[n] = s
  end
  return s
end
local function pad(token)
  return string.rep('0', 20 - #token) .. token
end
local function unregister(lk, ok, token, id)
  local member = pad(token) .. ':' .. id
  redis.call('ZREM', ok, member)
  redis.call('HDEL', lk, member)
end
-- Whether an unexpired lease older than token exists; expired ones met on
-- the way are dropped.
local function older_exists(lk, ok, token, now)
  local bound = '(' .. pad(token)
  while true do
    local m = redis.call('ZRANGEBYLEX', ok, '-', bound, 'LIMIT', 0, 1)
    if #m == 0 then return false end
    local exp = redis.call('HGET', lk, m[1])
    if exp and tonumber(exp) > now then return true end
    redis.call('ZREM', ok, m[1])
    redis.call('HDEL', lk, m[1])
  end
end
-- fresh: the key has no fence, so it has no leases either (leases are
-- registered only once the fence is set, and fencegate never deletes a
-- fence on Redis): both sets are created here, with no expiry to compare.
local function register(lk, ok, token, id, ttl, now, fresh)
  local member = pad(token) .. ':' .. id
  redis.call('ZADD', ok, 0, member)
  redis.call('HSET', lk, member, ms(now + ttl))
  -- Only ever lengthened: a replica with a shorter TTL must not cut short
  -- another's lease (PEXPIRE's GT needs Redis 7).
  for _, k in ipairs({lk, ok}) do
    if fresh or redis.call('PTTL', k) < ttl * 2 then redis.call('PEXPIRE', k, ms(ttl * 2)) end
  end
end
"#;

/// A batch of admissions in one script (one AOF fsync): per write, keys
/// (fence, leases, lease order) and arguments (token, lease id, TTL in ms);
/// answers (status, value) per write, each as the write alone would get.
const ACQUIRE: &str = r#"
local now = now_ms()
local out = {}
for i = 1, #ARGV / 3 do
  local fk, lk, ok = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local token, id, ttl = ARGV[3 * i - 2], ARGV[3 * i - 1], tonumber(ARGV[3 * i])
  local h = redis.call('GET', fk)
  if h and lt(token, h) then
    -- Registered by an earlier run of this call (sent again after a broken
    -- connection) if at all: a stale answer leaves no lease behind.
    unregister(lk, ok, token, id)
    out[#out + 1] = 'stale'
    out[#out + 1] = h
  else
    if (not h) or lt(h, token) then redis.call('SET', fk, token) end
    -- A key without a fence has no leases (see register): nothing older.
    local older = h and older_exists(lk, ok, token, now)
    register(lk, ok, token, id, ttl, now, not h)
    out[#out + 1] = older and 'busy' or 'granted'
    out[#out + 1] = token
  end
end
return out
"#;

const POLL: &str = r#"
local token, id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local h = redis.call('GET', KEYS[1])
if h and lt(token, h) then
  unregister(KEYS[2], KEYS[3], token, id)
  return {'stale', h}
end
if not h then return {'lost', ''} end
local now = now_ms()
local older = older_exists(KEYS[2], KEYS[3], token, now)
-- (Re)register with a fresh expiry: a lease being waited on, or checked
-- again before its write goes, must outlive that write.
register(KEYS[2], KEYS[3], token, id, ttl, now)
if older then return {'busy', token} end
return {'granted', token}
"#;

const RENEW: &str = r#"
local token, id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local h = redis.call('GET', KEYS[1])
if not h then return {'lost', ''} end
-- Taken by a higher token: the lease stays (its writes may be in flight).
if lt(token, h) then return {'stale', h} end
register(KEYS[2], KEYS[3], token, id, ttl, now_ms())
return {'granted', token}
"#;

/// A batch of releases: per lease, keys (leases, lease order) and
/// arguments (token, lease id).
const RELEASE: &str = r#"
for i = 1, #ARGV / 2 do
  unregister(KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1], ARGV[2 * i])
end
return 1
"#;

const ADVANCE: &str = r#"
local token = ARGV[1]
local h = redis.call('GET', KEYS[1])
if h and lt(token, h) then return {'stale', h} end
if h == token then return {'equal', h} end
redis.call('SET', KEYS[1], token)
return {'raised', h or ''}
"#;

/// One lock-service operation (keys: fence, lease, write leases, their
/// order; arguments: operation,
/// lease id, holder, TTL in ms). A claim raises the fence to one above
/// its highest (decimal text, so incremented digit by digit) in the same
/// script that records the lease. Answers as [`lock_reply`] reads them.
const LOCK: &str = r#"
local op, id, holder, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = now_ms()
local g = redis.call('HMGET', KEYS[2], 'id', 'token', 'holder', 'exp')
local live = g[1] and tonumber(g[4]) > now
local function shown(tag)
  -- Without the extra ms of the lease's end: never more than its TTL.
  return {tag, g[1], g[2], g[3], string.format('%d', math.max(tonumber(g[4]) - now - 1, 0))}
end
if op == 'claim' then
  -- Sent again after a broken connection: the lease is already ours.
  if live and g[1] == id then return {'granted', g[2], '1'} end
  if live then return shown('held') end
  local h = redis.call('GET', KEYS[1])
  local t = '1'
  if h then
    if h == '18446744073709551615' then return {'exhausted'} end
    local i = #h
    while i > 0 and h:sub(i, i) == '9' do i = i - 1 end
    if i == 0 then
      t = '1' .. string.rep('0', #h)
    else
      t = h:sub(1, i - 1) .. string.char(h:byte(i) + 1) .. string.rep('0', #h - i)
    end
  end
  redis.call('SET', KEYS[1], t)
  redis.call('DEL', KEYS[2])
  -- One ms more (TIME is read in whole ms, rounded down): the lease lasts
  -- at least its TTL from any moment before it was granted.
  redis.call('HSET', KEYS[2], 'id', id, 'token', t, 'holder', holder, 'exp', string.format('%d', now + ttl + 1))
  redis.call('PEXPIRE', KEYS[2], ttl + 1)
  -- Every write lease is older than t: is any still held?
  return {'granted', t, older_exists(KEYS[3], KEYS[4], t, now) and '1' or '0'}
end
if not live or (op ~= 'read' and g[1] ~= id) then return {'none'} end
if op == 'release' then
  redis.call('DEL', KEYS[2])
  return {'released'}
end
if op == 'renew' then
  g[4] = string.format('%d', now + ttl + 1)
  redis.call('HSET', KEYS[2], 'exp', g[4])
  redis.call('PEXPIRE', KEYS[2], ttl + 1)
end
return shown('lock')
"#;

const BUMP_MARKER: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return nil end
redis.call('HINCRBY', KEYS[1], 'seq', 1)
return redis.call('HMGET', KEYS[1], 'epoch', 'seq')
"#;

const CREATE_MARKER: &str = r#"
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[1])
redis.call('HSETNX', KEYS[1], 'seq', 1)
return redis.call('HMGET', KEYS[1], 'epoch', 'seq')
"#;

const REPLACE_MARKER: &str = r#"
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'seq')
local matches = (ARGV[1] == '' and not cur[1]) or (cur[1] == ARGV[1] and cur[2] == ARGV[2])
if matches then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'epoch', ARGV[3], 'seq', 1)
end
return redis.call('HMGET', KEYS[1], 'epoch', 'seq')
"#;

const MARKER: &str = "fencegate:marker";

/// Written after a call so that `WAIT` covers it (see the module doc).
const SYNC: &str = "fencegate:sync";

/// How long after a failed connection or call the next connect waits.
const BACKOFF: Duration = Duration::from_millis(200);

/// Where the primary is.
enum Source {
    Direct(Client),
    /// Asked of Sentinel at every connect; the master name.
    Sentinel(tokio::sync::Mutex<SentinelClient>, String),
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

/// A Redis connection that reconnects (with backoff) after failures.
pub struct RedisBackend {
    source: Source,
    /// One connection per runtime (the main one and each worker's): a
    /// multiplexed connection's driver task lives on the runtime that
    /// connected it, and a call from another thread would cost two hops.
    conns: dashmap::DashMap<usize, Arc<tokio::sync::Mutex<Option<MultiplexedConnection>>>>,
    session: AtomicU64,
    last_failure: Mutex<Option<Instant>>,
    timeout: Duration,
    /// `store_replicas_to_wait`, if set.
    replicas_to_wait: Option<u32>,
    /// Replicas the primary reported online at the latest connect, or more
    /// seen since by a marker read: without a setting, a change waits for
    /// one of them, if any.
    online_replicas: AtomicU32,
    acquire: Script,
    poll: Script,
    renew: Script,
    advance: Script,
    release: Script,
    lock: Script,
    bump_marker: Script,
    create_marker: Script,
    replace_marker: Script,
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("redis: {e}"))
}

/// A failed connect: refused (wrong password or user, a certificate that
/// does not check out) or unavailable.
fn connect_failed(e: redis::RedisError, what: &str) -> StoreError {
    let auth = matches!(e.kind(), redis::ErrorKind::AuthenticationFailed)
        || e.code()
            .is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH" || c == "NOPERM");
    if auth || crate::tls::certificate_refused(&e) {
        StoreError::Refused(format!("{what}: {e}"))
    } else {
        StoreError::Unavailable(format!("{what}: {e}"))
    }
}

fn fence_key(key: &str) -> String {
    format!("fencegate:f:{{{key}}}")
}

fn lease_key(key: &str) -> String {
    format!("fencegate:l:{{{key}}}")
}

fn grant_key(key: &str) -> String {
    format!("fencegate:g:{{{key}}}")
}

fn lease_order_key(key: &str) -> String {
    format!("fencegate:o:{{{key}}}")
}

fn parse_token(v: &str) -> Result<u64, StoreError> {
    stored_token("redis", v)
}

/// A lease TTL as the scripts take it: whole milliseconds, at least one.
fn ttl_ms(ttl: Duration) -> u64 {
    ttl.as_millis().max(1) as u64
}

fn lease_outcome(reply: (String, String), lease: WriteLease) -> Result<LeaseOutcome, StoreError> {
    lease_answer("redis", &reply.0, &reply.1, lease)
}

impl RedisBackend {
    /// `url`: `redis://host:port/db` or `rediss://` (TLS, with the CA and
    /// client certificate if given), or the `redis+sentinel://` URL that
    /// `sentinel` was parsed from. Connects lazily.
    pub fn new(url: &str, o: Options<'_>) -> Result<Self, String> {
        let source = match o.sentinel {
            Some(s) => Source::Sentinel(
                tokio::sync::Mutex::new(sentinel_client(s, o.password)?),
                s.master.clone(),
            ),
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
        let with_lib = |body: &str| Script::new(&format!("{LT}\n{body}"));
        Ok(Self {
            source,
            conns: dashmap::DashMap::new(),
            session: AtomicU64::new(0),
            last_failure: Mutex::new(None),
            timeout: o.timeout,
            replicas_to_wait: o.replicas_to_wait,
            online_replicas: AtomicU32::new(0),
            acquire: with_lib(ACQUIRE),
            poll: with_lib(POLL),
            renew: with_lib(RENEW),
            advance: with_lib(ADVANCE),
            release: with_lib(RELEASE),
            lock: with_lib(LOCK),
            bump_marker: Script::new(BUMP_MARKER),
            create_marker: Script::new(CREATE_MARKER),
            replace_marker: Script::new(REPLACE_MARKER),
        })
    }

    /// Replicas the next call waits for.
    fn replicas_wanted(&self) -> u32 {
        self.replicas_to_wait
            .unwrap_or_else(|| self.online_replicas.load(Ordering::Relaxed).min(1))
    }

    /// `WAIT`'s own timeout: half the store timeout, so that the reply
    /// (too few replicas) arrives before the call itself times out.
    fn wait_ms(&self) -> u64 {
        (self.timeout.as_millis() as u64 / 2).max(1)
    }

    /// This runtime's connection slot (see [`crate::slot::slot`]).
    fn slot(&self) -> Arc<tokio::sync::Mutex<Option<MultiplexedConnection>>> {
        let slot = crate::slot::slot();
        // A read lock on the usual path; the entry (a write lock) only the
        // first time a runtime calls.
        if let Some(s) = self.conns.get(&slot) {
            return s.value().clone();
        }
        self.conns.entry(slot).or_default().value().clone()
    }

    async fn connection(&self) -> Result<MultiplexedConnection, StoreError> {
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
            Ok(Ok(c)) => {
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
    /// every write, and a primary demoted by a failover is one.
    async fn connect(&self) -> Result<MultiplexedConnection, StoreError> {
        let client = match &self.source {
            Source::Direct(c) => c.clone(),
            Source::Sentinel(s, _) => s
                .lock()
                .await
                .async_get_client()
                .await
                .map_err(|e| connect_failed(e, "redis sentinel"))?,
        };
        let mut c = self
            .open(&client)
            .await
            .map_err(|e| connect_failed(e, "redis"))?;
        let info: redis::RedisResult<String> = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut c)
            .await;
        let online = match info {
            Ok(info) => {
                let (role, online) = replication(&info);
                if role != "master" {
                    return Err(unavailable(format!(
                        "the server is a {role}, not the primary (point the store at the primary, or use redis+sentinel://)"
                    )));
                }
                // Replicas that Sentinel sees up count too: an old primary
                // restarted before Sentinel announced its replica's
                // promotion has no replica of its own, yet is about to
                // become one and lose what it takes meanwhile.
                let online = match self.replicas_to_wait {
                    None => online.max(self.sentinel_replicas_up().await),
                    Some(_) => online,
                };
                self.online_replicas.store(online, Ordering::Relaxed);
                if self.replicas_to_wait.is_none() && online == 0 {
                    tracing::warn!("connected to a redis primary with no replica online: changes are not waited for, and a failover can lose them (docs/stores.md)");
                }
                online
            }
            // An ACL without INFO (`-@dangerous`): the role is found by the
            // first write (READONLY), the replicas are not known.
            Err(e) if e.code() == Some("NOPERM") => {
                if self.replicas_to_wait.is_none() {
                    tracing::warn!("redis refuses INFO to fencegate's user: the replicas online are unknown, so changes are not waited for; allow +info or set store_replicas_to_wait (docs/stores.md)");
                }
                0
            }
            Err(e) => return Err(unavailable(e)),
        };
        warn_if_not_durable(&mut c).await;
        let wanted = self.replicas_wanted();
        tracing::info!(
            online_replicas = online,
            waits_for = wanted,
            "connected to redis"
        );
        Ok(c)
    }

    /// A connection to `client`'s server, its connect and every answer
    /// bounded by the store timeout.
    async fn open(&self, client: &Client) -> redis::RedisResult<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// How many replicas of the master Sentinel reports up (not down, not
    /// disconnected); 0 without Sentinel or when no Sentinel answers.
    async fn sentinel_replicas_up(&self) -> u32 {
        let Source::Sentinel(s, master) = &self.source else {
            return 0;
        };
        let ask = async {
            let client = s.lock().await.async_get_sentinel_client().await.ok()?;
            let mut c = self.open(&client).await.ok()?;
            let replicas: Vec<Vec<String>> = redis::cmd("SENTINEL")
                .arg("REPLICAS")
                .arg(master)
                .query_async(&mut c)
                .await
                .ok()?;
            Some(sentinel_up(&replicas))
        };
        tokio::time::timeout(self.timeout, ask)
            .await
            .ok()
            .flatten()
            .unwrap_or(0)
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
    async fn run<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(MultiplexedConnection) -> Fut,
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
                self.load_scripts(&mut conn).await?;
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

    async fn load_scripts(&self, c: &mut MultiplexedConnection) -> Result<(), StoreError> {
        for script in [
            &self.acquire,
            &self.poll,
            &self.renew,
            &self.advance,
            &self.release,
            &self.lock,
            &self.bump_marker,
            &self.create_marker,
            &self.replace_marker,
        ] {
            if let Err(e) = script.load_async(c).await {
                return Err(self.failed(e).await);
            }
        }
        Ok(())
    }

    /// A failed call: a connection-level failure (or a primary that became
    /// a replica) drops every runtime's connection and starts the
    /// reconnect backoff.
    async fn failed(&self, e: redis::RedisError) -> StoreError {
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
    async fn drop_connections(&self) {
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
    async fn query<T: FromRedisValue>(&self, cmd: Cmd) -> Result<T, StoreError> {
        let (cmd, wait_ms) = (&cmd, self.wait_ms());
        let (v, wanted, confirmed) = self
            .run(|mut c| async move {
                // Read once this runtime is connected: after a failover,
                // the count the new primary reported, not the old one's.
                let wanted = self.replicas_wanted();
                if wanted == 0 {
                    return cmd.query_async(&mut c).await.map(|v| (v, 0, 0));
                }
                let mut p = redis::pipe();
                p.add_command(cmd.clone())
                    .cmd("SET")
                    .arg(SYNC)
                    .arg(1)
                    .ignore()
                    .cmd("WAIT")
                    .arg(wanted)
                    .arg(wait_ms);
                let (v, confirmed): (T, u32) = p.query_async(&mut c).await?;
                Ok((v, wanted, confirmed))
            })
            .await?;
        if confirmed < wanted {
            self.drop_connections().await;
            *self.last_failure.lock().expect("lock") = Some(Instant::now());
            return Err(unavailable(format!(
                "{confirmed} of {wanted} replicas confirmed the call within {wait_ms} ms (store_replicas_to_wait, docs/stores.md)"
            )));
        }
        Ok(v)
    }

    /// Runs one script (EVALSHA) with these keys and arguments.
    async fn script<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[String],
        args: &[String],
    ) -> Result<T, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        self.query(cmd).await
    }

    /// Runs the poll or renew script: both take the fence, lease and
    /// lease-order keys and (token, lease id, TTL in ms).
    async fn lease_script(
        &self,
        script: &Script,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let reply = self
            .script(
                script,
                &[fence_key(key), lease_key(key), lease_order_key(key)],
                &[
                    lease.token.to_string(),
                    lease.id.clone(),
                    ttl_ms(ttl).to_string(),
                ],
            )
            .await?;
        lease_outcome(reply, lease.clone())
    }
}

/// The Sentinel client for `s`: the data nodes' user and password, and the
/// Sentinels' own if they ask for the same.
fn sentinel_client(
    s: &crate::config::Sentinel,
    password: Option<&crate::config::Secret>,
) -> Result<SentinelClient, String> {
    let addrs = s
        .addrs
        .iter()
        .map(|(host, port)| ConnectionAddr::Tcp(host.clone(), *port));
    let mut b = SentinelClientBuilder::new(addrs, &s.master, SentinelServerType::Master)
        .map_err(|e| e.to_string())?
        .set_client_to_redis_db(s.db);
    let password = password.or(s.password.as_ref());
    if let Some(u) = &s.user {
        b = b.set_client_to_redis_username(u);
        if s.sentinel_auth {
            b = b.set_client_to_sentinel_username(u);
        }
    }
    if let Some(pw) = password {
        b = b.set_client_to_redis_password(pw.expose());
        if s.sentinel_auth {
            b = b.set_client_to_sentinel_password(pw.expose());
        }
    }
    b.build().map_err(|e| e.to_string())
}

/// How many of `SENTINEL REPLICAS`'s entries (flat field/value lists) are
/// up: flags without `s_down`, `o_down` or `disconnected`.
fn sentinel_up(replicas: &[Vec<String>]) -> u32 {
    replicas
        .iter()
        .filter(|r| {
            r.chunks(2).any(|kv| {
                kv.len() == 2
                    && kv[0] == "flags"
                    && !kv[1]
                        .split(',')
                        .any(|f| matches!(f, "s_down" | "o_down" | "disconnected"))
            })
        })
        .count() as u32
}

/// `INFO replication`'s role and how many replicas are online (their
/// `slaveN:...,state=online,...` lines).
fn replication(info: &str) -> (String, u32) {
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
async fn warn_if_not_durable(c: &mut MultiplexedConnection) {
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

#[async_trait]
impl Backend for RedisBackend {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire)
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(fence_key(key));
        let v: Option<String> = self.query(cmd).await?;
        v.map(|v| parse_token(&v)).transpose()
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let (status, value): (String, String) = self
            .script(&self.advance, &[fence_key(key)], &[token.to_string()])
            .await?;
        advance_answer("redis", &status, Some(&value))
    }

    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError> {
        let mut keys = Vec::with_capacity(reqs.len() * 3);
        let mut args = Vec::with_capacity(reqs.len() * 3);
        for r in reqs {
            keys.extend([
                fence_key(&r.key),
                lease_key(&r.key),
                lease_order_key(&r.key),
            ]);
            args.extend([
                r.lease.token.to_string(),
                r.lease.id.clone(),
                ttl_ms(r.ttl).to_string(),
            ]);
        }
        let reply: Vec<String> = self.script(&self.acquire, &keys, &args).await?;
        if reply.len() != reqs.len() * 2 {
            return Err(unavailable(format!(
                "{} answers for a batch of {}",
                reply.len() / 2,
                reqs.len()
            )));
        }
        Ok(reqs
            .iter()
            .zip(reply.chunks(2))
            .map(|(r, a)| lease_outcome((a[0].clone(), a[1].clone()), r.lease.clone()))
            .collect())
    }

    async fn poll(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_script(&self.poll, key, lease, ttl).await
    }

    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_script(&self.renew, key, lease, ttl).await
    }

    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError> {
        let mut keys = Vec::with_capacity(leases.len() * 2);
        let mut args = Vec::with_capacity(leases.len() * 2);
        for (key, lease) in leases {
            keys.extend([lease_key(key), lease_order_key(key)]);
            args.extend([lease.token.to_string(), lease.id.clone()]);
        }
        let _: i64 = self.script(&self.release, &keys, &args).await?;
        Ok(())
    }

    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError> {
        let (op, id, holder, ttl) = call.args();
        let reply: Vec<String> = self
            .script(
                &self.lock,
                &[
                    fence_key(key),
                    grant_key(key),
                    lease_key(key),
                    lease_order_key(key),
                ],
                &[op.into(), id.into(), holder.into(), ttl.to_string()],
            )
            .await?;
        lock_reply("redis", &call, &reply)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        // Not waited for: it changes and reads nothing.
        let _: String = self
            .run(|mut c| async move { redis::cmd("PING").query_async(&mut c).await })
            .await?;
        Ok(())
    }

    async fn read_marker(&self) -> Result<Option<Marker>, StoreError> {
        if self.replicas_to_wait.is_none() {
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
                    // hand or by a tool other than Sentinel): its answers
                    // are a copy that may lag.
                    self.drop_connections().await;
                    *self.last_failure.lock().expect("lock") = Some(Instant::now());
                    return Err(unavailable(format!(
                        "the server became a {role}: reconnecting to the primary"
                    )));
                }
                self.online_replicas.fetch_max(online, Ordering::Relaxed);
            }
        }
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(MARKER).arg("epoch").arg("seq");
        marker(self.query(cmd).await?)
    }

    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError> {
        let v = self
            .script(&self.create_marker, &[MARKER.into()], &[epoch.into()])
            .await?;
        marker(v)?.ok_or_else(|| unavailable("marker not readable after creation"))
    }

    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError> {
        // Only bump an existing marker: never recreate one by accident.
        marker(
            self.script(&self.bump_marker, &[MARKER.into()], &[])
                .await?,
        )
    }

    async fn replace_marker(
        &self,
        expected: Option<&Marker>,
        epoch: &str,
    ) -> Result<Marker, StoreError> {
        let (e, q) = match expected {
            Some(m) => (m.epoch.clone(), m.seq.to_string()),
            None => (String::new(), String::new()),
        };
        let v = self
            .script(
                &self.replace_marker,
                &[MARKER.into()],
                &[e, q, epoch.into()],
            )
            .await?;
        marker(v)?.ok_or_else(|| unavailable("marker not readable after replacement"))
    }
}

/// The marker from `HMGET epoch seq` (a script's nil: none).
fn marker(v: Option<Vec<Option<String>>>) -> Result<Option<Marker>, StoreError> {
    let v = v.unwrap_or_default();
    Ok(
        match (v.first().cloned().flatten(), v.get(1).cloned().flatten()) {
            (Some(epoch), Some(seq)) => Some(Marker {
                epoch,
                seq: seq
                    .parse()
                    .map_err(|_| unavailable(format!("marker sequence `{seq}` is not a number")))?,
            }),
            _ => None,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replication_reads_the_role_and_the_replicas_online() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
                    slave0:ip=127.0.0.1,port=1,state=online,offset=5,lag=0\r\n\
                    slave1:ip=127.0.0.1,port=2,state=wait_bgsave,offset=0,lag=0\r\n\
                    master_failover_state:no-failover\r\n";
        assert_eq!(replication(info), ("master".to_string(), 1));
        assert_eq!(
            replication("role:slave\r\nmaster_link_status:up\r\n"),
            ("slave".to_string(), 0)
        );
        assert_eq!(replication("").0, "server of unknown role");
    }

    #[test]
    fn sentinel_counts_the_replicas_it_sees_up() {
        let entry = |flags: &str| {
            vec![
                "name".to_string(),
                "127.0.0.1:1".into(),
                "flags".into(),
                flags.into(),
            ]
        };
        let replicas = vec![
            entry("slave"),
            entry("s_down,slave"),
            entry("slave,disconnected"),
            entry("o_down,slave"),
            entry("slave,promoted"),
        ];
        assert_eq!(sentinel_up(&replicas), 2);
        assert_eq!(sentinel_up(&[]), 0);
        assert_eq!(sentinel_up(&[vec!["flags".into()]]), 0);
    }
}
