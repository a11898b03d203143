//! The connection to etcd: the [`EtcdBackend`] with its channel (one
//! HTTP/2 connection, replaced after a call that timed out), the call with
//! its timeout per member, authentication, and the replica's etcd lease.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use prost::Message;

use crate::config::Secret;
use crate::store::api::{StoreError, WriteLease};

use super::keys::*;
use super::rpc::{self, CallError, Dialer, RequestOp, TxnRequest, TxnResponse};

/// Per-replica etcd lease that in-flight lease keys are attached to,
/// rotated so every key outlives the longest write it can belong to.
pub(super) struct ReplicaLease {
    pub(super) id: i64,
    pub(super) granted: Instant,
    pub(super) ttl: Duration,
}

pub struct EtcdBackend {
    pub(super) endpoints: Vec<String>,
    pub(super) current: AtomicUsize,
    /// Replaced after a call that timed out or failed to exchange: an
    /// HTTP/2 connection to a member that vanished without closing it would
    /// otherwise hold every later call until a keep-alive ping gives up.
    pub(super) channel: ArcSwap<rpc::Channel>,
    /// What a new channel is built from.
    pub(super) connector: HttpsConnector<Dialer>,
    /// Connections made so far: part of the session, so that a new
    /// connection (etcd restarted, perhaps from a backup) makes the marker
    /// be checked before an answer it carried is used.
    pub(super) dials: Arc<AtomicU64>,
    pub(super) timeout: Duration,
    pub(super) session: AtomicU64,
    pub(super) failing: AtomicBool,
    pub(super) lease: tokio::sync::Mutex<Option<ReplicaLease>>,
    /// etcd auth: the user and password, and the token they were last
    /// exchanged for (sent as the `token` metadata of every call).
    pub(super) auth: Option<(String, Secret)>,
    pub(super) token: ArcSwapOption<String>,
    /// One re-authentication at a time.
    pub(super) authenticating: tokio::sync::Mutex<()>,
}

/// A failed exchange: a certificate refused (by either side) is a setting
/// to fix; anything else an outage.
pub(super) fn exchange_failed(e: hyper_util::client::legacy::Error) -> StoreError {
    if crate::tls::certificate_refused(&e) {
        let mut why = e.to_string();
        let mut next = std::error::Error::source(&e);
        while let Some(inner) = next {
            why = format!("{why}: {inner}");
            next = inner.source();
        }
        StoreError::Refused(format!("etcd: {why}"))
    } else {
        unavailable(e)
    }
}

/// gRPC's UNAUTHENTICATED.
pub(super) const UNAUTHENTICATED: u32 = 16;

/// Whether an error answer says the auth token is missing, expired or
/// revoked (etcd's simple tokens expire after five idle minutes): get a new
/// one and ask again.
pub(super) fn token_invalid(code: u32, message: &str) -> bool {
    code == UNAUTHENTICATED
        || message.contains("invalid auth token")
        || message.contains("user name is empty")
        // Any change to users or roles makes etcd refuse older tokens.
        || message.contains("revision of auth store is old")
}

/// gRPC methods fencegate calls.
pub(super) const TXN: &str = "/etcdserverpb.KV/Txn";

pub(super) const RANGE: &str = "/etcdserverpb.KV/Range";

pub(super) const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";

pub(super) const AUTHENTICATE: &str = "/etcdserverpb.Auth/Authenticate";

/// HTTP/2 flow-control windows for etcd's answers: a batch's answer comes
/// back without waiting for window updates. (How fast a request goes out
/// is etcd's windows' business.)
pub(super) const WINDOW: u32 = 4 * 1024 * 1024;

/// HTTP/2 keep-alive pings (only while calls are out and nothing arrives).
/// etcd refuses pings closer than 5 s apart (`--grpc-keepalive-min-time`)
/// and closes the connection after a few; a call that times out replaces
/// the connection anyway ([`EtcdBackend::send`]).
pub(super) const KEEP_ALIVE: Duration = Duration::from_secs(10);

impl EtcdBackend {
    /// `tls`: the client config for `https://` endpoints (`etcds://`);
    /// `auth`: etcd user and password.
    pub fn new(
        endpoints: Vec<String>,
        tls: Option<Arc<rustls::ClientConfig>>,
        auth: Option<(String, Secret)>,
        timeout: Duration,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        connector.enforce_http(false);
        let tls = tls.unwrap_or_else(crate::tls::plain_client_config);
        let mut tls = (*tls).clone();
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let dials = Arc::new(AtomicU64::new(0));
        let connector = HttpsConnector::from((
            Dialer {
                inner: connector,
                dials: dials.clone(),
            },
            tls,
        ));
        Self {
            endpoints,
            current: AtomicUsize::new(0),
            channel: ArcSwap::from_pointee(Self::channel(&connector)),
            connector,
            dials,
            timeout,
            session: AtomicU64::new(0),
            failing: AtomicBool::new(true),
            lease: tokio::sync::Mutex::new(None),
            auth,
            token: ArcSwapOption::empty(),
            authenticating: tokio::sync::Mutex::new(()),
        }
    }

    pub(super) fn channel(connector: &HttpsConnector<Dialer>) -> rpc::Channel {
        Client::builder(TokioExecutor::new())
            .http2_only(true)
            .http2_initial_stream_window_size(WINDOW)
            .http2_initial_connection_window_size(WINDOW)
            .timer(TokioTimer::new())
            .http2_keep_alive_interval(KEEP_ALIVE)
            .http2_keep_alive_timeout(KEEP_ALIVE)
            .build(connector.clone())
    }

    /// Calls `method` on the current endpoint, moving to the next one on a
    /// failure; with auth, gets a token first and a new one when etcd says
    /// it is no longer valid.
    pub(super) async fn call<Q: Message, A: Message + Default>(
        &self,
        method: &str,
        request: &Q,
    ) -> Result<A, StoreError> {
        // One bound for the whole call, whatever endpoints and re-logins it
        // takes: leases count on a store call answering within it.
        let first = self.current.load(Ordering::Relaxed);
        match tokio::time::timeout(self.timeout, self.call_once(method, request)).await {
            Ok(answer) => answer,
            Err(_) => {
                // The endpoint's own timeout in `send` may not have run
                // (a login or another endpoint came first): same remedies,
                // and the next call starts at the next member.
                // (Unless the call, or another, moved on already: calls
                // timing out together move it once.)
                if self.endpoints.len() > 1 {
                    let _ = self.current.compare_exchange(
                        first,
                        first + 1,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                }
                self.failing.store(true, Ordering::Release);
                self.timed_out(
                    &self.channel.load_full(),
                    self.token.load_full().as_deref().map(|t| t.as_str()),
                );
                Err(unavailable("timed out"))
            }
        }
    }

    /// After a call that timed out: new connections, and, with auth, a new
    /// token for the next call. etcd holds a call whose token names a raft
    /// index it has not reached (a wiped or restored etcd) until its own
    /// deadline, so a timeout may be that.
    pub(super) fn timed_out(&self, channel: &Arc<rpc::Channel>, token: Option<&str>) {
        self.redial(channel);
        if let Some(used) = token {
            // Only the token that was used: a newer one is kept.
            self.token.rcu(|t| match t {
                Some(t) if t.as_str() == used => None,
                other => other.clone(),
            });
        }
    }

    pub(super) async fn call_once<Q: Message, A: Message + Default>(
        &self,
        method: &str,
        request: &Q,
    ) -> Result<A, StoreError> {
        if self.auth.is_none() {
            return self.send(method, request, None).await.map_err(|(e, _)| e);
        }
        let mut fresh = false;
        loop {
            let token = match self.token.load_full() {
                Some(t) => t,
                None => {
                    fresh = true;
                    self.authenticate().await?
                }
            };
            match self.send(method, request, Some(&token)).await {
                Err((_, true)) if !fresh => {
                    // Expired or revoked: once more with a new token (unless
                    // another call replaced it already).
                    self.token
                        .compare_and_swap(&Some(token), None::<Arc<String>>);
                    fresh = true;
                }
                other => return other.map_err(|(e, _)| e),
            }
        }
    }

    /// Exchanges the user and password for a token.
    pub(super) async fn authenticate(&self) -> Result<Arc<String>, StoreError> {
        let _one = self.authenticating.lock().await;
        if let Some(t) = self.token.load_full() {
            return Ok(t);
        }
        let (user, password) = self.auth.as_ref().expect("auth is set");
        let request = rpc::AuthenticateRequest {
            name: user.clone(),
            password: password.expose().to_string(),
        };
        let answer: rpc::AuthenticateResponse = match self.send(AUTHENTICATE, &request, None).await
        {
            Ok(a) => a,
            Err((StoreError::Unavailable(why), _))
                if why.contains("authentication failed")
                    || why.contains("authentication is not enabled") =>
            {
                return Err(StoreError::Refused(format!(
                    "etcd: user {user}: {}",
                    why.trim_start_matches("etcd: ")
                )))
            }
            Err((e, _)) => return Err(e),
        };
        if answer.token.is_empty() {
            return Err(StoreError::Refused(format!(
                "etcd: user {user} authenticated but got no token (is auth enabled on the cluster?)"
            )));
        }
        let token = Arc::new(answer.token);
        self.token.store(Some(token.clone()));
        Ok(token)
    }

    /// One call, over the endpoints in turn; the error says whether etcd
    /// refused the auth token.
    pub(super) async fn send<Q: Message, A: Message + Default>(
        &self,
        method: &str,
        request: &Q,
        token: Option<&str>,
    ) -> Result<A, (StoreError, bool)> {
        let mut last = None;
        // A member that hangs (stopped, cut off from the others) must leave
        // time for the next one within the call's one bound.
        let attempt = if self.endpoints.len() > 1 {
            self.timeout / 2
        } else {
            self.timeout
        };
        for _ in 0..self.endpoints.len() {
            let i = self.current.load(Ordering::Relaxed) % self.endpoints.len();
            let channel = self.channel.load_full();
            let result = match tokio::time::timeout(
                attempt,
                rpc::call(&channel, &self.endpoints[i], method, token, request),
            )
            .await
            {
                Ok(Err(CallError::Exchange(e))) => {
                    self.redial(&channel);
                    Err(CallError::Exchange(e))
                }
                Ok(r) => r,
                Err(_) => {
                    self.timed_out(&channel, token);
                    Err(CallError::Malformed("timed out".into()))
                }
            }
            .map_err(|e| match e {
                CallError::Exchange(e) => (exchange_failed(e), false),
                CallError::Status { message, .. } if message.contains("permission denied") => (
                    StoreError::Refused(format!(
                        "etcd: {message} (the user needs read-write on the prefix fencegate/, docs/stores.md)"
                    )),
                    false,
                ),
                CallError::Status { code, message } => {
                    let invalid = token_invalid(code, &message);
                    (unavailable(message), invalid)
                }
                CallError::Malformed(why) => (unavailable(why), false),
            });
            match result {
                Ok(v) => {
                    if self.failing.swap(false, Ordering::AcqRel) {
                        // Back after a failure (or the first contact): the
                        // marker must be checked again.
                        self.session.fetch_add(1, Ordering::AcqRel);
                    }
                    return Ok(v);
                }
                Err((e, true)) => return Err((e, true)),
                // A refusal (a certificate, a permission) may be one
                // member's: the others are asked too, and the last answer
                // is reported.
                Err((e, false)) => {
                    self.failing.store(true, Ordering::Release);
                    self.current.store(i + 1, Ordering::Relaxed);
                    last = Some(e);
                }
            }
        }
        Err((last.unwrap_or_else(|| unavailable("no endpoint")), false))
    }

    /// Replaces `used` with a new channel (new connections), unless another
    /// call did already.
    pub(super) fn redial(&self, used: &Arc<rpc::Channel>) {
        let fresh = Arc::new(Self::channel(&self.connector));
        self.channel.compare_and_swap(used, fresh);
    }

    /// The replica lease to attach a new in-flight key to. It is granted for
    /// `ttl` plus an eighth, or plus a store timeout if that is more
    /// (rounded up to whole seconds, etcd's unit), and used for new keys
    /// only while it has at least `ttl` left, so every key lives at least
    /// `ttl` (the write plus the store's latency) and a dead replica's keys
    /// no longer than the grant. etcd itself may lengthen it (its minimum
    /// TTL, a leader change).
    pub(super) async fn replica_lease(&self, ttl: Duration) -> Result<i64, StoreError> {
        let mut slot = self.lease.lock().await;
        if let Some(l) = slot.as_ref() {
            // Stamped before the grant was sent: etcd's clock for it started
            // no earlier, so this underestimates what is left.
            let left = l.ttl.saturating_sub(l.granted.elapsed());
            if left >= ttl
                && l.ttl <= grant_for(ttl).max(ttl + self.timeout + Duration::from_secs(1))
            {
                return Ok(l.id);
            }
        }
        // A new lease must also cover the grant call itself (at most a
        // store timeout) before the key's own call is sent.
        let grant_ttl = grant_for(ttl).max(Duration::from_secs(
            (ttl + self.timeout).as_millis().div_ceil(1000) as u64,
        ));
        let sent = Instant::now();
        let answer: rpc::LeaseGrantResponse = self
            .call(
                LEASE_GRANT,
                &rpc::LeaseGrantRequest {
                    ttl: grant_ttl.as_secs() as i64,
                },
            )
            .await?;
        if !answer.error.is_empty() || answer.id == 0 {
            return Err(unavailable(format!(
                "lease grant refused: {}",
                answer.error
            )));
        }
        *slot = Some(ReplicaLease {
            id: answer.id,
            granted: sent,
            ttl: grant_ttl,
        });
        Ok(answer.id)
    }

    pub(super) fn lease_key(key: &str, lease: &WriteLease) -> String {
        format!("{}{}/{}", lease_prefix(key), pad(lease.token), lease.id)
    }

    /// A txn: if the stored highest is above `token`, report it (stale);
    /// otherwise run `ops` (which end with a count of older leases).
    pub(super) async fn guarded_txn(
        &self,
        key: &str,
        token: u64,
        stale_ops: Vec<RequestOp>,
        ops: Vec<RequestOp>,
    ) -> Result<LeaseStep, StoreError> {
        let txn = GuardedTxn::new(key, token, stale_ops, ops);
        let answer = self.txn(&txn.body).await?;
        txn.answer(answer)
    }

    /// Sends a transaction; an answer without etcd's header is no answer.
    pub(super) async fn txn(&self, body: &TxnRequest) -> Result<TxnResponse, StoreError> {
        let answer: TxnResponse = self.call(TXN, body).await?;
        if answer.header.is_none() {
            return Err(unavailable("transaction answer without a header"));
        }
        Ok(answer)
    }

    /// The transaction of one acquire (nested in a batch's). A stale answer
    /// deletes the write's own lease key: the call may be a second sending
    /// (the next endpoint, after the first one timed out) of one that
    /// registered it before a higher token took the key, and the caller
    /// releases nothing after a stale answer.
    pub(super) fn acquire_txn(key: &str, lease: &WriteLease, etcd_lease: i64) -> GuardedTxn {
        GuardedTxn::new(
            key,
            lease.token,
            vec![rpc::delete(&Self::lease_key(key, lease))],
            vec![
                rpc::put(&fence_key(key), &pad(lease.token), 0),
                rpc::put(&Self::lease_key(key, lease), "", etcd_lease),
                older_count(key, lease.token),
            ],
        )
    }
}
