//! The PostgreSQL store: fences and leases in tables, each operation one
//! call of a PL/pgSQL function (one round trip, one transaction).
//!
//! Tokens are `numeric(20,0)` with a check constraint on the u64 range
//! (`bigint` is signed and would lose the upper half); they cross the wire as
//! text. The schema is created or migrated at connect, under an advisory
//! lock so that replicas starting together do not race. Lease expiry uses
//! the server's clock (`clock_timestamp()`). A raise is durable when its
//! transaction commits with `synchronous_commit` on (the default; fencegate
//! warns at connect when it is off).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Row, Statement};

use super::api::{Advance, LeaseOutcome, StoreError, WriteLease};
use super::postgres_tls::PgTls;
use super::shared::{
    advance_answer, lease_answer, lock_reply, stored_token, Acquire, Backend, LockCall, LockReply,
    Marker,
};

/// How long after a failed connect the next one waits.
const BACKOFF: Duration = Duration::from_millis(200);

/// Bumped with every change below; recorded in `fencegate_schema`.
const SCHEMA_VERSION: i32 = 5;

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS fencegate_schema (version integer NOT NULL);
CREATE TABLE IF NOT EXISTS fencegate_fences (
    key text PRIMARY KEY,
    highest numeric(20,0) NOT NULL CHECK (highest >= 0 AND highest <= 18446744073709551615)
);
CREATE TABLE IF NOT EXISTS fencegate_leases (
    id text PRIMARY KEY,
    key text NOT NULL,
    token numeric(20,0) NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS fencegate_leases_key ON fencegate_leases (key, token);
-- The lock service's leases, one per key at most (expiry on the server's
-- clock).
CREATE TABLE IF NOT EXISTS fencegate_grants (
    key text PRIMARY KEY,
    id text NOT NULL,
    token numeric(20,0) NOT NULL,
    holder text NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS fencegate_marker (
    id integer PRIMARY KEY CHECK (id = 1),
    epoch text NOT NULL,
    seq bigint NOT NULL
);

-- Raise if higher; 'stale' | 'equal' | 'raised', with the previous highest.
CREATE OR REPLACE FUNCTION fencegate_advance(k text, t numeric)
RETURNS TABLE(status text, value text) LANGUAGE plpgsql AS $$
DECLARE h numeric;
BEGIN
    SELECT f.highest INTO h FROM fencegate_fences f WHERE f.key = k FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO fencegate_fences AS f (key, highest) VALUES (k, t)
            ON CONFLICT (key) DO UPDATE SET highest = GREATEST(f.highest, EXCLUDED.highest)
            RETURNING f.highest INTO h;
        IF h > t THEN RETURN QUERY SELECT 'stale'::text, h::text; RETURN; END IF;
        RETURN QUERY SELECT 'raised'::text, NULL::text; RETURN;
    END IF;
    IF h > t THEN RETURN QUERY SELECT 'stale'::text, h::text; RETURN; END IF;
    IF h = t THEN RETURN QUERY SELECT 'equal'::text, h::text; RETURN; END IF;
    UPDATE fencegate_fences SET highest = t WHERE key = k;
    RETURN QUERY SELECT 'raised'::text, h::text;
END $$;

-- Shared by acquire and poll: with the fence row locked, drop expired
-- leases, (re)register this one, and say whether an older one remains.
CREATE OR REPLACE FUNCTION fencegate_register(k text, t numeric, lid text, ttl_ms bigint)
RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM fencegate_leases l WHERE l.key = k AND l.expires_at <= clock_timestamp();
    -- A lease polled again gets a fresh expiry: it must outlive its write.
    INSERT INTO fencegate_leases (id, key, token, expires_at)
        VALUES (lid, k, t, clock_timestamp() + ttl_ms * interval '1 millisecond')
        ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    IF EXISTS (SELECT 1 FROM fencegate_leases l WHERE l.key = k AND l.token < t) THEN
        RETURN 'busy';
    END IF;
    RETURN 'granted';
END $$;

CREATE OR REPLACE FUNCTION fencegate_acquire(k text, t numeric, lid text, ttl_ms bigint)
RETURNS TABLE(status text, value text) LANGUAGE plpgsql AS $$
DECLARE h numeric;
BEGIN
    INSERT INTO fencegate_fences AS f (key, highest) VALUES (k, t)
        ON CONFLICT (key) DO UPDATE SET highest = EXCLUDED.highest WHERE f.highest < EXCLUDED.highest;
    -- The row lock serializes every admission on this key until commit.
    SELECT f.highest INTO h FROM fencegate_fences f WHERE f.key = k FOR UPDATE;
    IF h > t THEN RETURN QUERY SELECT 'stale'::text, h::text; RETURN; END IF;
    RETURN QUERY SELECT fencegate_register(k, t, lid, ttl_ms), t::text;
END $$;

-- A batch of admissions in one transaction (one commit, one WAL flush),
-- each answered as fencegate_acquire alone would, set-based: one statement
-- per step for the whole batch, not one per write. Keys are distinct and
-- sorted in byte order by the caller; fence rows are locked in that order
-- by every batch, so batches of several replicas cannot deadlock. Plans are pinned to index lookups: the planner's estimates for
-- arrays of unknown size and for a lease table that churns pick hash joins
-- over whole tables.
CREATE OR REPLACE FUNCTION fencegate_acquire_many(ks text[], ts numeric[], lids text[], ttls bigint[])
RETURNS TABLE(i integer, status text, value text) LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE now timestamptz := clock_timestamp();
BEGIN
    -- One ordered pass takes every row lock: ON CONFLICT DO UPDATE locks
    -- an existing row even when its WHERE leaves it unchanged, and claims a
    -- new one (locking existing rows first, then inserting, would take new
    -- keys out of order).
    INSERT INTO fencegate_fences AS f (key, highest)
        SELECT u.k, u.t FROM unnest(ks, ts) WITH ORDINALITY AS u(k, t, n) ORDER BY u.n
        ON CONFLICT (key) DO UPDATE SET highest = EXCLUDED.highest WHERE f.highest < EXCLUDED.highest;
    DELETE FROM fencegate_leases l USING unnest(ks) AS u(k)
        WHERE l.key = u.k AND l.expires_at <= now;
    INSERT INTO fencegate_leases (id, key, token, expires_at)
        SELECT u.lid, u.k, u.t, now + u.ttl * interval '1 millisecond'
        FROM unnest(ks, ts, lids, ttls) AS u(k, t, lid, ttl)
        JOIN fencegate_fences f ON f.key = u.k WHERE f.highest <= u.t
        ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    RETURN QUERY
        SELECT u.n::integer,
            CASE WHEN f.highest > u.t THEN 'stale'
                 WHEN EXISTS (SELECT 1 FROM fencegate_leases l
                              WHERE l.key = u.k AND l.token < u.t AND l.expires_at > now) THEN 'busy'
                 ELSE 'granted' END,
            CASE WHEN f.highest > u.t THEN f.highest::text ELSE u.t::text END
        FROM unnest(ks, ts) WITH ORDINALITY AS u(k, t, n)
        JOIN fencegate_fences f ON f.key = u.k;
END $$;

-- A batch of releases. Lease rows of a key are only touched with its fence
-- row locked, and fence rows are locked in byte order (the caller sorts
-- the keys), as admissions do: otherwise a release and an admission that
-- drops expired leases could deadlock on two lease rows.
CREATE OR REPLACE FUNCTION fencegate_release_many(ks text[], lids text[])
RETURNS void LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
BEGIN
    PERFORM 1 FROM unnest(ks) WITH ORDINALITY AS u(k, n) JOIN fencegate_fences f ON f.key = u.k
        ORDER BY u.n FOR UPDATE OF f;
    DELETE FROM fencegate_leases l USING unnest(lids) AS u(id) WHERE l.id = u.id;
END $$;

-- Extend a granted lease, unless a higher token took the key: then the
-- lease stays (writes admitted on it may still be in flight).
CREATE OR REPLACE FUNCTION fencegate_renew(k text, t numeric, lid text, ttl_ms bigint)
RETURNS TABLE(status text, value text) LANGUAGE plpgsql AS $$
DECLARE h numeric;
BEGIN
    SELECT f.highest INTO h FROM fencegate_fences f WHERE f.key = k FOR UPDATE;
    IF NOT FOUND THEN RETURN QUERY SELECT 'lost'::text, ''::text; RETURN; END IF;
    IF h > t THEN RETURN QUERY SELECT 'stale'::text, h::text; RETURN; END IF;
    INSERT INTO fencegate_leases (id, key, token, expires_at)
        VALUES (lid, k, t, clock_timestamp() + ttl_ms * interval '1 millisecond')
        ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    RETURN QUERY SELECT 'granted'::text, t::text;
END $$;

-- One lock-service operation ('claim', 'read', 'renew', 'release'),
-- answered as text: granted T | held ID T HOLDER MS | exhausted | lock ID T
-- HOLDER MS | released | none. Operations on one key run one at a time (a
-- transaction-scoped advisory lock on the key; admissions never take
-- one, so no lock cycle with their fence-row locks). A claim raises the
-- fence row to one above its highest in the same transaction that records
-- the lease.
CREATE OR REPLACE FUNCTION fencegate_lock(op text, k text, lid text, who text, ttl_ms bigint)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    now timestamptz;
    g fencegate_grants%ROWTYPE;
    t numeric;
    live boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('fencegate:' || k, 0));
    -- After the wait for the lock: expiry is judged at the operation's turn.
    now := clock_timestamp();
    SELECT * INTO g FROM fencegate_grants x WHERE x.key = k;
    live := FOUND AND g.expires_at > now;
    IF op = 'claim' THEN
        -- Sent again after a broken connection: the lease is already ours.
        IF live AND g.id = lid THEN RETURN ARRAY['granted', g.token::text, '1']; END IF;
        IF live THEN
            RETURN ARRAY['held', g.id, g.token::text, g.holder,
                floor(extract(epoch FROM g.expires_at - now) * 1000)::bigint::text];
        END IF;
        INSERT INTO fencegate_fences AS f (key, highest) VALUES (k, 1)
            ON CONFLICT (key) DO UPDATE SET highest = f.highest + 1
            WHERE f.highest < 18446744073709551615
            RETURNING f.highest INTO t;
        IF t IS NULL THEN RETURN ARRAY['exhausted']; END IF;
        INSERT INTO fencegate_grants AS x (key, id, token, holder, expires_at)
            VALUES (k, lid, t, who, now + ttl_ms * interval '1 millisecond')
            ON CONFLICT (key) DO UPDATE SET id = EXCLUDED.id, token = EXCLUDED.token,
                holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at;
        -- Every write lease is older than t: is any still held?
        RETURN ARRAY['granted', t::text, CASE WHEN EXISTS (SELECT 1 FROM fencegate_leases l
            WHERE l.key = k AND l.expires_at > now) THEN '1' ELSE '0' END];
    END IF;
    IF NOT live OR (op <> 'read' AND g.id <> lid) THEN RETURN ARRAY['none']; END IF;
    IF op = 'release' THEN
        DELETE FROM fencegate_grants x WHERE x.key = k;
        RETURN ARRAY['released'];
    END IF;
    IF op = 'renew' THEN
        g.expires_at := now + ttl_ms * interval '1 millisecond';
        UPDATE fencegate_grants x SET expires_at = g.expires_at WHERE x.key = k;
    END IF;
    RETURN ARRAY['lock', g.id, g.token::text, g.holder,
        floor(extract(epoch FROM g.expires_at - now) * 1000)::bigint::text];
END $$;

CREATE OR REPLACE FUNCTION fencegate_poll(k text, t numeric, lid text, ttl_ms bigint)
RETURNS TABLE(status text, value text) LANGUAGE plpgsql AS $$
DECLARE h numeric;
BEGIN
    SELECT f.highest INTO h FROM fencegate_fences f WHERE f.key = k FOR UPDATE;
    IF NOT FOUND THEN RETURN QUERY SELECT 'lost'::text, ''::text; RETURN; END IF;
    IF h > t THEN
        DELETE FROM fencegate_leases WHERE id = lid;
        RETURN QUERY SELECT 'stale'::text, h::text; RETURN;
    END IF;
    RETURN QUERY SELECT fencegate_register(k, t, lid, ttl_ms), t::text;
END $$;
"#;

/// A small pool of PostgreSQL connections that reconnect after failures.
/// Several connections matter: one waiting on a key's row lock must not hold
/// up admissions on other keys.
pub struct PostgresBackend {
    url: String,
    connect: Connect,
    timeout: Duration,
    slots: Vec<tokio::sync::Mutex<Option<Conn>>>,
    next: AtomicUsize,
    session: AtomicU64,
    last_failure: Mutex<Option<Instant>>,
    schema_ready: tokio::sync::Mutex<bool>,
}

/// A pooled connection and the statements prepared on it: each query is
/// parsed and planned once per connection, and costs one round trip
/// instead of two (a text query is prepared first, every time).
pub struct Conn {
    client: Client,
    prepared: std::collections::HashMap<&'static str, Statement>,
}

impl std::ops::Deref for Conn {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Conn {
    async fn statement(&mut self, sql: &'static str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.prepared.get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare(sql).await?;
        self.prepared.insert(sql, s.clone());
        Ok(s)
    }

    async fn query(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let s = self.statement(sql).await?;
        self.client.query(&s, params).await
    }

    async fn query_one(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, tokio_postgres::Error> {
        let s = self.statement(sql).await?;
        self.client.query_one(&s, params).await
    }

    async fn query_opt(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        let s = self.statement(sql).await?;
        self.client.query_opt(&s, params).await
    }

    async fn execute(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        let s = self.statement(sql).await?;
        self.client.execute(&s, params).await
    }
}

/// How to connect, beside the URL.
pub struct Connect {
    /// Replaces the URL's password.
    pub password: Option<crate::config::Secret>,
    /// TLS (`sslmode` other than `disable`).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// `sslmode=prefer`: plain if the server does not offer TLS.
    pub prefer: bool,
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("postgres: {e}"))
}

/// A failed connect: refused (wrong password, no `pg_hba.conf` entry for
/// this user over this transport, a certificate that does not check out, a
/// server without TLS when it is required) or unavailable.
fn connect_failed(e: tokio_postgres::Error) -> StoreError {
    use tokio_postgres::error::SqlState;
    let code = e.code();
    let refused = code == Some(&SqlState::INVALID_PASSWORD)
        || code == Some(&SqlState::INVALID_AUTHORIZATION_SPECIFICATION)
        || crate::tls::certificate_refused(&e)
        || e.to_string().contains("server does not support TLS");
    // The driver's message leaves out the cause (a TLS handshake error
    // says nothing of the certificate): add the chain.
    let mut why = e.to_string();
    let mut next = std::error::Error::source(&e);
    while let Some(inner) = next {
        why = format!("{why}: {inner}");
        next = inner.source();
    }
    if refused {
        StoreError::Refused(format!("postgres: {why}"))
    } else {
        unavailable(why)
    }
}

fn parse_token(v: &str) -> Result<u64, StoreError> {
    stored_token("postgres", v)
}

fn lease_outcome(status: &str, value: &str, lease: WriteLease) -> Result<LeaseOutcome, StoreError> {
    lease_answer("postgres", status, value, lease)
}

/// Runs a connection's I/O until it ends.
async fn drive<F: std::future::Future<Output = Result<(), tokio_postgres::Error>>>(conn: F) {
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "postgres connection ended");
    }
}

fn marker_row(r: tokio_postgres::Row) -> Result<Marker, tokio_postgres::Error> {
    Ok(Marker {
        epoch: r.try_get(0)?,
        seq: u64::try_from(r.try_get::<_, i64>(1)?).unwrap_or(0),
    })
}

impl PostgresBackend {
    /// `url`: what the driver takes (libpq's TLS parameters already
    /// taken out into `connect`).
    pub fn new(
        url: &str,
        connect: Connect,
        timeout: Duration,
        pool_size: usize,
    ) -> Result<Self, String> {
        url.parse::<tokio_postgres::Config>()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            url: url.to_string(),
            connect,
            timeout,
            slots: (0..pool_size.max(1))
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            next: AtomicUsize::new(0),
            session: AtomicU64::new(0),
            last_failure: Mutex::new(None),
            schema_ready: tokio::sync::Mutex::new(false),
        })
    }

    async fn connect(&self) -> Result<Conn, StoreError> {
        // Back off after a failure instead of hammering a server that is
        // down: the call waits out the pause, then tries (a server that
        // came back, after a restart, answers it: the first write after a
        // restart must not fail for a release that met the server down).
        let since = self.last_failure.lock().expect("lock").map(|t| t.elapsed());
        if let Some(pause) = since.and_then(|e| BACKOFF.checked_sub(e)) {
            tokio::time::sleep(pause).await;
        }
        let mut config: tokio_postgres::Config = self.url.parse().map_err(unavailable)?;
        config.connect_timeout(self.timeout);
        if let Some(pw) = &self.connect.password {
            config.password(pw.expose());
        }
        if self.connect.prefer {
            config.ssl_mode(tokio_postgres::config::SslMode::Prefer);
        }
        let connected = tokio::time::timeout(self.timeout, async {
            // The connection task drives the socket; its stream type
            // depends on TLS, so each arm spawns its own.
            match &self.connect.tls {
                Some(tls) => {
                    let (client, conn) = config.connect(PgTls(tls.clone())).await?;
                    tokio::spawn(drive(conn));
                    Ok(client)
                }
                None => {
                    let (client, conn) = config.connect(NoTls).await?;
                    tokio::spawn(drive(conn));
                    Ok(client)
                }
            }
        })
        .await;
        let client = match connected {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                *self.last_failure.lock().expect("lock") = Some(Instant::now());
                return Err(connect_failed(e));
            }
            Err(_) => {
                *self.last_failure.lock().expect("lock") = Some(Instant::now());
                return Err(unavailable("connect timed out"));
            }
        };
        *self.last_failure.lock().expect("lock") = None;
        self.ensure_schema(&client).await?;
        self.session.fetch_add(1, Ordering::AcqRel);
        Ok(Conn {
            client,
            prepared: Default::default(),
        })
    }

    /// Creates or migrates the schema once per process (idempotent, under an
    /// advisory lock), and warns if commits are not durable.
    async fn ensure_schema(&self, client: &Client) -> Result<(), StoreError> {
        let mut ready = self.schema_ready.lock().await;
        if *ready {
            return Ok(());
        }
        let sql = format!(
            "BEGIN;
             SELECT pg_advisory_xact_lock(7427811501);
             {SCHEMA}
             DELETE FROM fencegate_schema;
             INSERT INTO fencegate_schema (version) VALUES ({SCHEMA_VERSION});
             COMMIT;"
        );
        tokio::time::timeout(self.timeout * 5, client.batch_execute(&sql))
            .await
            .map_err(|_| unavailable("schema setup timed out"))?
            .map_err(|e| unavailable(format!("schema setup: {e}")))?;
        if let Ok(row) = client.query_one("SHOW synchronous_commit", &[]).await {
            let v: String = row.try_get(0).unwrap_or_default();
            if v == "off" {
                tracing::warn!("postgres synchronous_commit is off: an acknowledged fence can be lost in a crash (see docs/stores.md)");
            }
        }
        *ready = true;
        tracing::info!("connected to postgres; schema version {SCHEMA_VERSION} ready");
        Ok(())
    }

    /// Runs `f` on one pooled connection, reconnecting it if needed; a
    /// failed connection is dropped so the next call reconnects.
    async fn with_client<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: std::future::Future<Output = (Conn, Result<T, tokio_postgres::Error>)>,
    {
        // One deadline for waiting on the slot, connecting and the query.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let mut slot = tokio::time::timeout_at(deadline, self.slots[i].lock())
            .await
            .map_err(|_| unavailable("timed out waiting for a connection"))?;
        let client = match slot.take() {
            Some(c) if !c.is_closed() => c,
            _ => tokio::time::timeout_at(deadline, self.connect())
                .await
                .map_err(|_| unavailable("connect timed out"))??,
        };
        match tokio::time::timeout_at(deadline, f(client)).await {
            Ok((client, Ok(v))) => {
                *slot = Some(client);
                Ok(v)
            }
            Ok((client, Err(e))) => {
                // A database error leaves the connection usable, unless it
                // says a prepared statement no longer holds (a function
                // replaced with another result type, a pooler that lost
                // the session): then a new connection prepares afresh.
                use tokio_postgres::error::SqlState;
                let stale_statement = e.code() == Some(&SqlState::FEATURE_NOT_SUPPORTED)
                    || e.code() == Some(&SqlState::INVALID_SQL_STATEMENT_NAME);
                if !client.is_closed() && e.as_db_error().is_some() && !stale_statement {
                    *slot = Some(client);
                }
                Err(unavailable(e))
            }
            // The client went with the timed-out future: reconnect next time.
            Err(_) => Err(unavailable("timed out")),
        }
    }

    /// A lease function (poll, renew) on an existing lease: (key, token,
    /// lease id, TTL in ms) in, (status, value) out.
    async fn lease_call(
        &self,
        sql: &'static str,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let (status, value) = self
            .call(sql, key, lease.token, Some((&lease.id, ttl_ms)))
            .await?;
        lease_outcome(&status, value.as_deref().unwrap_or(""), lease.clone())
    }

    async fn call(
        &self,
        sql: &'static str,
        key: &str,
        token: u64,
        extra: Option<(&str, i64)>,
    ) -> Result<(String, Option<String>), StoreError> {
        let (k, t) = (key.to_string(), token.to_string());
        let extra = extra.map(|(id, ttl)| (id.to_string(), ttl));
        self.with_client(|mut c| async move {
            let r = match &extra {
                None => c.query_one(sql, &[&k, &t]).await,
                Some((id, ttl)) => c.query_one(sql, &[&k, &t, id, ttl]).await,
            };
            let r = r.and_then(|row| {
                Ok((
                    row.try_get::<_, String>(0)?,
                    row.try_get::<_, Option<String>>(1)?,
                ))
            });
            (c, r)
        })
        .await
    }
}

#[async_trait]
impl Backend for PostgresBackend {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire)
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let k = key.to_string();
        let v: Option<String> = self
            .with_client(|mut c| async move {
                let r = c
                    .query_opt(
                        "SELECT highest::text FROM fencegate_fences WHERE key = $1",
                        &[&k],
                    )
                    .await
                    .and_then(|row| row.map(|r| r.try_get(0)).transpose());
                (c, r)
            })
            .await?;
        v.map(|v| parse_token(&v)).transpose()
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let (status, value) = self
            .call(
                "SELECT * FROM fencegate_advance($1, $2::text::numeric)",
                key,
                token,
                None,
            )
            .await?;
        advance_answer("postgres", &status, value.as_deref())
    }

    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError> {
        // Byte order (Rust's `str` order, PostgreSQL's "C" collation): the
        // order fence rows are locked in by every batch.
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by(|&a, &b| reqs[a].key.cmp(&reqs[b].key));
        let keys: Vec<String> = order.iter().map(|&i| reqs[i].key.clone()).collect();
        let tokens: Vec<String> = order
            .iter()
            .map(|&i| reqs[i].lease.token.to_string())
            .collect();
        let ids: Vec<String> = order.iter().map(|&i| reqs[i].lease.id.clone()).collect();
        let ttls: Vec<i64> = order
            .iter()
            .map(|&i| i64::try_from(reqs[i].ttl.as_millis()).unwrap_or(i64::MAX))
            .collect();
        let rows = self
            .with_client(|mut c| async move {
                let r = c
                    .query(
                        "SELECT i, status, value FROM fencegate_acquire_many($1, $2::text[]::numeric[], $3, $4)",
                        &[&keys, &tokens, &ids, &ttls],
                    )
                    .await;
                (c, r)
            })
            .await?;
        let mut answers: Vec<Option<Result<LeaseOutcome, StoreError>>> = vec![None; reqs.len()];
        for row in rows {
            let (j, status, value) = (|| {
                Ok::<_, tokio_postgres::Error>((
                    row.try_get::<_, i32>(0)?,
                    row.try_get::<_, String>(1)?,
                    row.try_get::<_, Option<String>>(2)?,
                ))
            })()
            .map_err(unavailable)?;
            let Some(&i) = usize::try_from(j - 1).ok().and_then(|j| order.get(j)) else {
                return Err(unavailable(format!("batch answer for unknown item {j}")));
            };
            answers[i] = Some(lease_outcome(
                &status,
                value.as_deref().unwrap_or(""),
                reqs[i].lease.clone(),
            ));
        }
        answers
            .into_iter()
            .map(|a| a.ok_or_else(|| unavailable("a batch item went unanswered")))
            .collect()
    }

    async fn poll(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_call(
            "SELECT * FROM fencegate_poll($1, $2::text::numeric, $3, $4)",
            key,
            lease,
            ttl,
        )
        .await
    }

    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_call(
            "SELECT * FROM fencegate_renew($1, $2::text::numeric, $3, $4)",
            key,
            lease,
            ttl,
        )
        .await
    }

    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError> {
        let (op, id, holder, ttl) = call.args();
        let args = (
            op.to_string(),
            key.to_string(),
            id.to_string(),
            holder.to_string(),
            i64::try_from(ttl).unwrap_or(i64::MAX),
        );
        let parts: Vec<String> = self
            .with_client(|mut c| async move {
                let (op, k, id, holder, ttl) = &args;
                let r = c
                    .query_one(
                        "SELECT fencegate_lock($1, $2, $3, $4, $5)",
                        &[op, k, id, holder, ttl],
                    )
                    .await
                    .and_then(|row| row.try_get::<_, Vec<String>>(0));
                (c, r)
            })
            .await?;
        lock_reply("postgres", &call, &parts)
    }

    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError> {
        // Byte order: the order every batch locks fence rows in.
        let mut sorted: Vec<&(String, WriteLease)> = leases.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let keys: Vec<String> = sorted.iter().map(|(k, _)| k.clone()).collect();
        let ids: Vec<String> = sorted.iter().map(|(_, l)| l.id.clone()).collect();
        self.with_client(|mut c| async move {
            let r = c
                .execute("SELECT fencegate_release_many($1, $2)", &[&keys, &ids])
                .await;
            (c, r)
        })
        .await?;
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.with_client(|c| async move {
            let r = c.simple_query("SELECT 1").await;
            (c, r)
        })
        .await?;
        Ok(())
    }

    async fn read_marker(&self) -> Result<Option<Marker>, StoreError> {
        self.with_client(|mut c| async move {
            let r = c
                .query_opt("SELECT epoch, seq FROM fencegate_marker WHERE id = 1", &[])
                .await
                .and_then(|row| row.map(marker_row).transpose());
            (c, r)
        })
        .await
    }

    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError> {
        let e = epoch.to_string();
        self.with_client(|mut c| async move {
            let r = c
                .execute(
                    "INSERT INTO fencegate_marker (id, epoch, seq) VALUES (1, $1, 1) ON CONFLICT (id) DO NOTHING",
                    &[&e],
                )
                .await;
            (c, r)
        })
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after creation"))
    }

    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError> {
        self.with_client(|mut c| async move {
            let r = c
                .query_opt(
                    "UPDATE fencegate_marker SET seq = seq + 1 WHERE id = 1 RETURNING epoch, seq",
                    &[],
                )
                .await
                .and_then(|row| row.map(marker_row).transpose());
            (c, r)
        })
        .await
    }

    async fn replace_marker(
        &self,
        expected: Option<&Marker>,
        epoch: &str,
    ) -> Result<Marker, StoreError> {
        let e = epoch.to_string();
        let expected =
            expected.map(|m| (m.epoch.clone(), i64::try_from(m.seq).unwrap_or(i64::MAX)));
        self.with_client(|mut c| async move {
            let r = match &expected {
                None => c
                    .execute(
                        "INSERT INTO fencegate_marker (id, epoch, seq) VALUES (1, $1, 1) ON CONFLICT (id) DO NOTHING",
                        &[&e],
                    )
                    .await,
                Some((old, seq)) => c
                    .execute(
                        "UPDATE fencegate_marker SET epoch = $1, seq = 1 WHERE id = 1 AND epoch = $2 AND seq = $3",
                        &[&e, old, seq],
                    )
                    .await,
            };
            (c, r)
        })
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after replacement"))
    }
}
