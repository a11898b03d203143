//! The connection to PostgreSQL: the [`PostgresBackend`], its connection
//! per call slot with prepared statements, the schema check at connect,
//! and a call with its timeout.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Row, Statement};

use super::tls::PgTls;
use crate::store::api::{LeaseOutcome, StoreError, WriteLease};
use crate::store::shared::dial::{dial_bound, Slot};

use super::schema::*;

/// How long after a failed connect the next one waits.
pub(super) const BACKOFF: Duration = Duration::from_millis(200);

/// A small pool of PostgreSQL connections that reconnect after failures.
/// Several connections matter: one waiting on a key's row lock must not hold
/// up admissions on other keys.
pub struct PostgresBackend {
    pub(super) dialer: Arc<Dialer>,
    pub(super) slots: Vec<tokio::sync::Mutex<Slot<Conn>>>,
    pub(super) next: AtomicUsize,
}

/// What a new connection needs, shared with the dials in flight.
pub(super) struct Dialer {
    url: String,
    connect: Connect,
    pub(super) timeout: Duration,
    pub(super) session: AtomicU64,
    last_failure: Mutex<Option<Instant>>,
    schema_ready: tokio::sync::Mutex<bool>,
}

/// A pooled connection and the statements prepared on it: each query is
/// parsed and planned once per connection, and costs one round trip
/// instead of two (a text query is prepared first, every time).
pub struct Conn {
    pub(super) client: Client,
    pub(super) prepared: std::collections::HashMap<&'static str, Statement>,
}

impl std::ops::Deref for Conn {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Conn {
    pub(super) async fn statement(
        &mut self,
        sql: &'static str,
    ) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.prepared.get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare(sql).await?;
        self.prepared.insert(sql, s.clone());
        Ok(s)
    }

    pub(super) async fn query(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let s = self.statement(sql).await?;
        self.client.query(&s, params).await
    }

    pub(super) async fn query_one(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, tokio_postgres::Error> {
        let s = self.statement(sql).await?;
        self.client.query_one(&s, params).await
    }

    pub(super) async fn query_opt(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        let s = self.statement(sql).await?;
        self.client.query_opt(&s, params).await
    }

    pub(super) async fn execute(
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

pub(super) fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("postgres: {e}"))
}

/// A failed connect: refused (wrong password, no `pg_hba.conf` entry for
/// this user over this transport, a certificate that does not check out, a
/// server without TLS when it is required) or unavailable.
pub(super) fn connect_failed(e: tokio_postgres::Error) -> StoreError {
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

/// Runs a connection's I/O until it ends.
pub(super) async fn drive<F: std::future::Future<Output = Result<(), tokio_postgres::Error>>>(
    conn: F,
) {
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "postgres connection ended");
    }
}

impl Dialer {
    pub(super) async fn connect(&self) -> Result<Conn, StoreError> {
        // Back off after a failure instead of hammering a server that is
        // down: the call waits out the pause, then tries (a server that
        // came back, after a restart, answers it: the first write after a
        // restart must not fail for a release that met the server down).
        let since = self.last_failure.lock().expect("lock").map(|t| t.elapsed());
        if let Some(pause) = since.and_then(|e| BACKOFF.checked_sub(e)) {
            tokio::time::sleep(pause).await;
        }
        let mut config: tokio_postgres::Config = self.url.parse().map_err(unavailable)?;
        // Per host: a URL listing a primary and its standby reaches the
        // second within the dial's bound when the first is cut off.
        config.connect_timeout(self.timeout);
        if let Some(pw) = &self.connect.password {
            config.password(pw.expose());
        }
        if self.connect.prefer {
            config.ssl_mode(tokio_postgres::config::SslMode::Prefer);
        }
        let connected = tokio::time::timeout(dial_bound(self.timeout), async {
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
        Ok(Conn {
            client,
            prepared: Default::default(),
        })
    }

    /// Creates or migrates the schema once per process (idempotent, under an
    /// advisory lock), and warns if commits are not durable.
    pub(super) async fn ensure_schema(&self, client: &Client) -> Result<(), StoreError> {
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
            dialer: Arc::new(Dialer {
                url: url.to_string(),
                connect,
                timeout,
                session: AtomicU64::new(0),
                last_failure: Mutex::new(None),
                schema_ready: tokio::sync::Mutex::new(false),
            }),
            slots: (0..pool_size.max(1))
                .map(|_| tokio::sync::Mutex::new(Slot::Empty))
                .collect(),
            next: AtomicUsize::new(0),
        })
    }
    /// Runs `f` on one pooled connection, reconnecting it if needed; a
    /// failed connection is dropped so the next call reconnects.
    pub(super) async fn with_client<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: std::future::Future<Output = (Conn, Result<T, tokio_postgres::Error>)>,
    {
        // One deadline for waiting on the slot, connecting and the query.
        let deadline = tokio::time::Instant::now() + self.dialer.timeout;
        let mut slot = self.slot(deadline).await?;
        let dialer = &self.dialer;
        let (client, new) = slot
            .take(
                "postgres",
                deadline,
                |c| !c.is_closed(),
                || {
                    let dialer = dialer.clone();
                    async move { dialer.connect().await }
                },
            )
            .await?;
        if new {
            // A new session, counted when it is first used (the marker
            // check on a new connection: store/shared).
            self.dialer.session.fetch_add(1, Ordering::AcqRel);
        }
        match tokio::time::timeout_at(deadline, f(client)).await {
            Ok((client, Ok(v))) => {
                *slot = Slot::Ready(client);
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
                    *slot = Slot::Ready(client);
                }
                Err(unavailable(e))
            }
            // The client went with the timed-out future: reconnect next time.
            Err(_) => Err(unavailable("timed out")),
        }
    }

    /// A slot to call on: the first free one holding a connection
    /// (from the round-robin start), else the round-robin one, waited for
    /// until `deadline`. Calls prefer open connections, so that while
    /// dials are slow (a lossy link) the ones made serve every call.
    async fn slot(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<tokio::sync::MutexGuard<'_, Slot<Conn>>, StoreError> {
        let n = self.slots.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        for k in 0..n {
            if let Ok(slot) = self.slots[(start + k) % n].try_lock() {
                if slot.is_ready(|c| !c.is_closed()) {
                    return Ok(slot);
                }
            }
        }
        tokio::time::timeout_at(deadline, self.slots[start].lock())
            .await
            .map_err(|_| unavailable("timed out waiting for a connection"))
    }

    /// A lease function (poll, renew) on an existing lease: (key, token,
    /// lease id, TTL in ms) in, (status, value) out.
    pub(super) async fn lease_call(
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

    pub(super) async fn call(
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
