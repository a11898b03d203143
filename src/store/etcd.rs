//! The etcd store, over etcd's v3 gRPC API ([`rpc`]: HTTP/2, cleartext
//! with prior knowledge for `etcd://`, TLS with ALPN for `etcds://`; one
//! connection carries every call). With a user, calls carry the token
//! etcd's auth gave for it.
//!
//! Keyspace (`HEX` is the fence key in hex, so keys never nest):
//! - `fencegate/f/HEX`: the highest token, zero-padded to 20 digits so that
//!   etcd's byte-wise compare is numeric order over the whole u64 range.
//! - `fencegate/l/HEX/TOKEN20/ID`: an in-flight lease, attached to an etcd
//!   lease of this replica (expires on etcd's clock if the replica dies, at
//!   most an eighth after the write's own lease would).
//! - `fencegate/g/HEX`: the lock service's lease on the key, JSON `{id,
//!   token, holder, exp}`; `exp` is in ms on the granting replica's wall
//!   clock (etcd has no clock to read), so replicas' clock skew shifts
//!   expiry. Changed by compare-and-swap on its and the fence's revisions.
//! - `fencegate/marker`: `EPOCH SEQ` (amnesia detection).
//!
//! Admission is one transaction: if the stored highest is greater, read it
//! (stale); otherwise write the token, register the lease and count older
//! leases, atomically. A raise is durable once etcd acknowledged it: etcd
//! commits through its Raft quorum and fsyncs its WAL.

mod rpc;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use async_trait::async_trait;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use prost::Message;
use serde_json::{json, Value};

use crate::config::Secret;

use self::rpc::{CallError, RequestOp, ResponseOp, TxnRequest, TxnResponse};
use super::shared::{busy, stored_token, Acquire, Backend, LockCall, LockReply, Marker};
use crate::clock::wall_ms;

use super::api::{Advance, Claim, LeaseOutcome, Lock, StoreError, WriteLease};

const MARKER: &str = "fencegate/marker";

/// Per-replica etcd lease that in-flight lease keys are attached to,
/// rotated so every key outlives the longest write it can belong to.
struct ReplicaLease {
    id: i64,
    granted: Instant,
    ttl: Duration,
}

pub struct EtcdBackend {
    endpoints: Vec<String>,
    current: AtomicUsize,
    /// Replaced after a call that timed out or failed to exchange: an
    /// HTTP/2 connection to a member that vanished without closing it would
    /// otherwise hold every later call until a keep-alive ping gives up.
    channel: ArcSwap<rpc::Channel>,
    /// What a new channel is built from.
    connector: HttpsConnector<Dialer>,
    /// Connections made so far: part of the session, so that a new
    /// connection (etcd restarted, perhaps from a backup) makes the marker
    /// be checked before an answer it carried is used.
    dials: Arc<AtomicU64>,
    timeout: Duration,
    session: AtomicU64,
    failing: AtomicBool,
    lease: tokio::sync::Mutex<Option<ReplicaLease>>,
    /// etcd auth: the user and password, and the token they were last
    /// exchanged for (sent as the `token` metadata of every call).
    auth: Option<(String, Secret)>,
    token: ArcSwapOption<String>,
    /// One re-authentication at a time.
    authenticating: tokio::sync::Mutex<()>,
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("etcd: {e}"))
}

/// A failed exchange: a certificate refused (by either side) is a setting
/// to fix; anything else an outage.
fn exchange_failed(e: hyper_util::client::legacy::Error) -> StoreError {
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
const UNAUTHENTICATED: u32 = 16;

/// Whether an error answer says the auth token is missing, expired or
/// revoked (etcd's simple tokens expire after five idle minutes): get a new
/// one and ask again.
fn token_invalid(code: u32, message: &str) -> bool {
    code == UNAUTHENTICATED
        || message.contains("invalid auth token")
        || message.contains("user name is empty")
        // Any change to users or roles makes etcd refuse older tokens.
        || message.contains("revision of auth store is old")
}

fn hex(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

fn pad(token: u64) -> String {
    format!("{token:020}")
}

fn fence_key(key: &str) -> String {
    format!("fencegate/f/{}", hex(key))
}

fn lease_prefix(key: &str) -> String {
    format!("fencegate/l/{}/", hex(key))
}

fn grant_key(key: &str) -> String {
    format!("fencegate/g/{}", hex(key))
}

/// How many times a lock operation reads and tries its compare-and-swap
/// before it gives up (each retry means another replica changed the key
/// meanwhile).
const LOCK_ATTEMPTS: usize = 16;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The first key-value of a range answer in a transaction, with its
/// modification revision.
fn range_kv(resp: &ResponseOp) -> Option<(String, i64)> {
    let kv = resp.range()?.kvs.first()?;
    Some((text(&kv.value), kv.mod_revision))
}

fn parse_token(v: &str) -> Result<u64, StoreError> {
    stored_token("etcd", v)
}

/// An etcd lease for keys that must live `ttl`: an eighth more, in whole
/// seconds (etcd's unit), so at least a second more and at least 2 s.
fn grant_for(ttl: Duration) -> Duration {
    let ms = ttl.as_millis() as u64;
    let secs = (ms + ms / 8).div_ceil(1000).max(ms / 1000 + 1).max(2);
    Duration::from_secs(secs)
}

/// The TCP connector, counting the connections it makes.
#[derive(Clone)]
pub struct Dialer {
    inner: HttpConnector,
    dials: Arc<AtomicU64>,
}

impl tower_service::Service<http::Uri> for Dialer {
    type Response = <HttpConnector as tower_service::Service<http::Uri>>::Response;
    type Error = <HttpConnector as tower_service::Service<http::Uri>>::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connect = self.inner.call(uri);
        let dials = self.dials.clone();
        Box::pin(async move {
            let stream = connect.await?;
            dials.fetch_add(1, Ordering::AcqRel);
            Ok(stream)
        })
    }
}

/// gRPC methods fencegate calls.
const TXN: &str = "/etcdserverpb.KV/Txn";
const RANGE: &str = "/etcdserverpb.KV/Range";
const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";
const AUTHENTICATE: &str = "/etcdserverpb.Auth/Authenticate";

/// HTTP/2 flow-control windows for etcd's answers: a batch's answer comes
/// back without waiting for window updates. (How fast a request goes out
/// is etcd's windows' business.)
const WINDOW: u32 = 4 * 1024 * 1024;

/// HTTP/2 keep-alive pings (only while calls are out and nothing arrives).
/// etcd refuses pings closer than 5 s apart (`--grpc-keepalive-min-time`)
/// and closes the connection after a few; a call that times out replaces
/// the connection anyway ([`EtcdBackend::send`]).
const KEEP_ALIVE: Duration = Duration::from_secs(10);

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

    fn channel(connector: &HttpsConnector<Dialer>) -> rpc::Channel {
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
    async fn call<Q: Message, A: Message + Default>(
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
    fn timed_out(&self, channel: &Arc<rpc::Channel>, token: Option<&str>) {
        self.redial(channel);
        if let Some(used) = token {
            // Only the token that was used: a newer one is kept.
            self.token.rcu(|t| match t {
                Some(t) if t.as_str() == used => None,
                other => other.clone(),
            });
        }
    }

    async fn call_once<Q: Message, A: Message + Default>(
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
    async fn authenticate(&self) -> Result<Arc<String>, StoreError> {
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
    async fn send<Q: Message, A: Message + Default>(
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
    fn redial(&self, used: &Arc<rpc::Channel>) {
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
    async fn replica_lease(&self, ttl: Duration) -> Result<i64, StoreError> {
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

    fn lease_key(key: &str, lease: &WriteLease) -> String {
        format!("{}{}/{}", lease_prefix(key), pad(lease.token), lease.id)
    }

    /// A txn: if the stored highest is above `token`, report it (stale);
    /// otherwise run `ops` (which end with a count of older leases).
    async fn guarded_txn(
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
    async fn txn(&self, body: &TxnRequest) -> Result<TxnResponse, StoreError> {
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
    fn acquire_txn(key: &str, lease: &WriteLease, etcd_lease: i64) -> GuardedTxn {
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

/// A transaction guarded by the key's fence: if the stored highest is above
/// the token, the stale operations run and the highest is read; otherwise
/// the operations run.
struct GuardedTxn {
    body: TxnRequest,
    success_n: usize,
    ops_n: usize,
}

impl GuardedTxn {
    fn new(key: &str, token: u64, stale_ops: Vec<RequestOp>, ops: Vec<RequestOp>) -> Self {
        let fk = fence_key(key);
        let mut success = stale_ops;
        success.push(rpc::range(&fk));
        let (success_n, ops_n) = (success.len(), ops.len());
        Self {
            body: TxnRequest {
                compare: vec![rpc::value_greater(&fk, &pad(token))],
                success,
                failure: ops,
            },
            success_n,
            ops_n,
        }
    }

    /// The transaction's answer (top-level or nested).
    fn answer(&self, v: TxnResponse) -> Result<LeaseStep, StoreError> {
        let expected = if v.succeeded {
            self.success_n
        } else {
            self.ops_n
        };
        if v.responses.len() != expected {
            return Err(unavailable(format!(
                "transaction answered {} results for {expected} operations",
                v.responses.len()
            )));
        }
        if v.succeeded {
            let highest = v.responses.last().and_then(range_kv).map(|(h, _)| h);
            return Ok(LeaseStep::Stale(decode_padded(
                &highest.unwrap_or_default(),
            )?));
        }
        Ok(LeaseStep::Ran(v.responses))
    }
}

/// The most a batch transaction carries: etcd refuses requests over
/// `--max-request-bytes` (1.5 MiB by default).
const MAX_TXN_BYTES: usize = 512 * 1024;

/// What one acquire adds to a batch transaction, at most: its key appears
/// seven times in hex (unit-tested against the encoded size).
fn txn_size(key: &str) -> usize {
    key.len() * 14 + 400
}

/// Splits a batch into transactions under [`MAX_TXN_BYTES`], by each item's
/// `size` (an item over it alone goes alone, as a lone write would). The
/// writes of a batch are independent: splitting changes no answer.
fn by_size<T>(items: Vec<T>, size: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut chunks: Vec<Vec<T>> = Vec::new();
    let mut total = 0;
    for item in items {
        let n = size(&item);
        match chunks.last_mut() {
            Some(last) if total + n <= MAX_TXN_BYTES => {
                last.push(item);
                total += n;
            }
            _ => {
                chunks.push(vec![item]);
                total = n;
            }
        }
    }
    chunks
}

enum LeaseStep {
    Stale(u64),
    Ran(Vec<ResponseOp>),
}

impl LeaseStep {
    /// The answer to an admission (an acquire, or a poll of a waiting
    /// lease): stale, or busy while an older lease is held, else granted.
    fn admission(self, lease: WriteLease) -> LeaseOutcome {
        match self {
            LeaseStep::Stale(h) => LeaseOutcome::Stale { highest: h },
            LeaseStep::Ran(r) => older_leases(&r, lease),
        }
    }
}

fn decode_padded(v: &str) -> Result<u64, StoreError> {
    let t = v.trim_start_matches('0');
    if t.is_empty() {
        Ok(0)
    } else {
        parse_token(t)
    }
}

/// Busy if the transaction's last result (the count of older leases) is
/// not zero, else granted.
fn older_leases(results: &[ResponseOp], lease: WriteLease) -> LeaseOutcome {
    if results
        .last()
        .and_then(ResponseOp::range)
        .map_or(0, |r| r.count)
        > 0
    {
        busy(lease)
    } else {
        LeaseOutcome::Granted(lease)
    }
}

fn older_count(key: &str, token: u64) -> RequestOp {
    let prefix = lease_prefix(key);
    rpc::count(&prefix, &format!("{prefix}{}", pad(token)))
}

#[async_trait]
impl Backend for EtcdBackend {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire) + self.dials.load(Ordering::Acquire)
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        match self.get(&fence_key(key)).await? {
            None => Ok(None),
            Some(kv) => decode_padded(&text(&kv.value)).map(Some),
        }
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let fk = fence_key(key);
        // The failure branch only runs when highest <= token (or none).
        let step = self
            .guarded_txn(
                key,
                token,
                vec![],
                vec![rpc::range(&fk), rpc::put(&fk, &pad(token), 0)],
            )
            .await?;
        match step {
            LeaseStep::Stale(h) => Ok(Advance::Stale { highest: h }),
            LeaseStep::Ran(r) => {
                let prev = r
                    .first()
                    .and_then(range_kv)
                    .map(|(v, _)| decode_padded(&v))
                    .transpose()?;
                Ok(match prev {
                    Some(p) if p == token => Advance::Equal,
                    previous => Advance::Raised { previous },
                })
            }
        }
    }

    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError> {
        // One transaction of nested ones (etcd 3.3+), each guarded by its
        // key's fence as a lone acquire is: one Raft round for the batch.
        // Writes of one TTL share a transaction (under MAX_TXN_BYTES), and
        // its replica lease is chosen right before it is sent, as for a
        // lone acquire: the lease must outlive the writes from the moment
        // their grant is sent, whatever the transactions before took.
        let mut answers: Vec<Option<Result<LeaseOutcome, StoreError>>> = vec![None; reqs.len()];
        let mut ttls: Vec<Duration> = reqs.iter().map(|r| r.ttl).collect();
        ttls.sort();
        ttls.dedup();
        for ttl in ttls {
            let same: Vec<usize> = (0..reqs.len()).filter(|&i| reqs[i].ttl == ttl).collect();
            for chunk in by_size(same, |&i| txn_size(&reqs[i].key)) {
                let etcd_lease = self.replica_lease(ttl).await?;
                let mut txns: Vec<GuardedTxn> = chunk
                    .iter()
                    .map(|&i| Self::acquire_txn(&reqs[i].key, &reqs[i].lease, etcd_lease))
                    .collect();
                let success = txns
                    .iter_mut()
                    .map(|t| rpc::nested(std::mem::take(&mut t.body)))
                    .collect();
                let v = self
                    .txn(&TxnRequest {
                        success,
                        ..Default::default()
                    })
                    .await?;
                if v.responses.len() != chunk.len() {
                    return Err(unavailable(format!(
                        "a batch of {} answered {} results",
                        chunk.len(),
                        v.responses.len()
                    )));
                }
                for ((&i, t), resp) in chunk.iter().zip(&txns).zip(v.responses) {
                    let nested = match resp.response {
                        Some(rpc::response_op::Response::Txn(n)) => Ok(n),
                        _ => Err(unavailable("a batch item answered without its transaction")),
                    };
                    answers[i] = Some(
                        nested
                            .and_then(|n| t.answer(n))
                            .map(|step| step.admission(reqs[i].lease.clone())),
                    );
                }
            }
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
        let lk = Self::lease_key(key, lease);
        let etcd_lease = self.replica_lease(ttl).await?;
        let step = self
            .guarded_txn(
                key,
                lease.token,
                vec![rpc::delete(&lk)],
                vec![
                    // Re-attach (a no-op if present) so a long wait cannot
                    // outlive its own key.
                    rpc::put(&lk, "", etcd_lease),
                    older_count(key, lease.token),
                ],
            )
            .await?;
        Ok(step.admission(lease.clone()))
    }

    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let lk = Self::lease_key(key, lease);
        let etcd_lease = self.replica_lease(ttl).await?;
        // No stale operations: a taken key leaves the lease as it is.
        let step = self
            .guarded_txn(
                key,
                lease.token,
                vec![],
                vec![rpc::put(&lk, "", etcd_lease)],
            )
            .await?;
        match step {
            LeaseStep::Stale(h) => Ok(LeaseOutcome::Stale { highest: h }),
            LeaseStep::Ran(_) => Ok(LeaseOutcome::Granted(lease.clone())),
        }
    }

    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError> {
        let ops: Vec<RequestOp> = leases
            .iter()
            .map(|(key, lease)| rpc::delete(&Self::lease_key(key, lease)))
            .collect();
        for success in by_size(ops, RequestOp::encoded_len) {
            self.txn(&TxnRequest {
                success,
                ..Default::default()
            })
            .await?;
        }
        Ok(())
    }

    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError> {
        let (fk, gk) = (fence_key(key), grant_key(key));
        let (_, _, _, ttl_ms) = call.args();
        for attempt in 0..LOCK_ATTEMPTS {
            if attempt > 0 {
                // Another replica changed the key: step aside a little
                // (spread by the clock's low bits), then read it again.
                let spread = u64::from(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.subsec_nanos())
                        % 4,
                );
                tokio::time::sleep(Duration::from_millis(1 + spread + attempt as u64)).await;
            }
            // The fence and the lease at one revision.
            let v = self
                .txn(&TxnRequest {
                    success: vec![rpc::range(&fk), rpc::range(&gk)],
                    ..Default::default()
                })
                .await?;
            let (fence, grant) = match v.responses.as_slice() {
                [f, g] => (range_kv(f), range_kv(g)),
                _ => return Err(unavailable("lease read without its two answers")),
            };
            // The fence is compared by value: admissions of an equal token
            // rewrite it (a new revision) without changing it.
            let fence_same = match &fence {
                Some((v, _)) => rpc::value_equal(&fk, v),
                None => rpc::absent(&fk),
            };
            let gmr = grant.as_ref().map_or(0, |(_, r)| *r);
            let highest = fence.map(|(v, _)| decode_padded(&v)).transpose()?;
            let now = wall_ms();
            let lock = match grant {
                None => None,
                Some((text, _)) => {
                    let g: Value = serde_json::from_str(&text)
                        .map_err(|_| unavailable(format!("unexpected lease record {text:?}")))?;
                    let exp = g["exp"].as_u64().unwrap_or(0);
                    (exp > now)
                        .then(|| -> Result<Lock, StoreError> {
                            Ok(Lock {
                                id: g["id"].as_str().unwrap_or("").to_string(),
                                token: parse_token(g["token"].as_str().unwrap_or(""))?,
                                holder: g["holder"].as_str().unwrap_or("").to_string(),
                                expires_in: crate::clock::lease_left(exp, now),
                            })
                        })
                        .transpose()?
                }
            };
            let record = |id: &str, token: u64, holder: &str| {
                json!({
                    "id": id,
                    "token": token.to_string(),
                    "holder": holder,
                    "exp": crate::clock::lease_end(now, Duration::from_millis(ttl_ms)),
                })
                .to_string()
            };
            let (body, answer) = match call {
                LockCall::Read => return Ok(LockReply::Lock(lock)),
                LockCall::Claim { id, holder, .. } => {
                    if let Some(l) = lock {
                        // Sent again after a lost answer: already ours.
                        if l.id == id {
                            return Ok(LockReply::Claim(Claim::Granted {
                                token: l.token,
                                registered: true,
                            }));
                        }
                        return Ok(LockReply::Claim(Claim::Held(l)));
                    }
                    let Some(t) = highest.map_or(Some(1), |h| h.checked_add(1)) else {
                        return Ok(LockReply::Claim(Claim::Exhausted));
                    };
                    (
                        TxnRequest {
                            compare: vec![fence_same, rpc::unchanged(&gk, gmr)],
                            success: vec![
                                rpc::put(&fk, &pad(t), 0),
                                rpc::put(&gk, &record(id, t, holder), 0),
                                // Write registrations held as it commits
                                // (all older than t; they expire on etcd's
                                // clock).
                                older_count(key, t),
                            ],
                            ..Default::default()
                        },
                        LockReply::Claim(Claim::Granted {
                            token: t,
                            registered: true,
                        }),
                    )
                }
                LockCall::Renew { id, ttl } => {
                    let Some(mut l) = lock.filter(|l| l.id == id) else {
                        return Ok(LockReply::Lock(None));
                    };
                    let value = record(id, l.token, &l.holder);
                    l.expires_in = ttl;
                    (
                        TxnRequest {
                            compare: vec![rpc::unchanged(&gk, gmr)],
                            success: vec![rpc::put(&gk, &value, 0)],
                            ..Default::default()
                        },
                        LockReply::Lock(Some(l)),
                    )
                }
                LockCall::Release { id } => {
                    if lock.is_none_or(|l| l.id != id) {
                        return Ok(LockReply::Released(false));
                    }
                    (
                        TxnRequest {
                            compare: vec![rpc::unchanged(&gk, gmr)],
                            success: vec![rpc::delete(&gk)],
                            ..Default::default()
                        },
                        LockReply::Released(true),
                    )
                }
            };
            let v = self.txn(&body).await?;
            if v.succeeded {
                if let LockReply::Claim(Claim::Granted { token, .. }) = answer {
                    let held = v
                        .responses
                        .get(2)
                        .and_then(ResponseOp::range)
                        .map(|r| r.count);
                    return Ok(LockReply::Claim(Claim::Granted {
                        token,
                        registered: held != Some(0),
                    }));
                }
                return Ok(answer);
            }
        }
        Err(unavailable(
            "a lease operation lost its compare-and-swap too many times in a row",
        ))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let _: rpc::RangeResponse = self
            .call(
                RANGE,
                &rpc::RangeRequest {
                    key: MARKER.into(),
                    count_only: true,
                    ..Default::default()
                },
            )
            .await?;
        Ok(())
    }

    async fn read_marker(&self) -> Result<Option<Marker>, StoreError> {
        Ok(self.read_marker_rev().await?.map(|(m, _)| m))
    }

    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError> {
        self.txn(&TxnRequest {
            compare: vec![rpc::absent(MARKER)],
            success: vec![rpc::put(MARKER, &format!("{epoch} 1"), 0)],
            ..Default::default()
        })
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after creation"))
    }

    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError> {
        for _ in 0..20 {
            let Some((m, rev)) = self.read_marker_rev().await? else {
                return Ok(None);
            };
            let next = Marker {
                epoch: m.epoch.clone(),
                seq: m.seq + 1,
            };
            let v = self
                .txn(&TxnRequest {
                    compare: vec![rpc::unchanged(MARKER, rev)],
                    success: vec![rpc::put(MARKER, &format!("{} {}", next.epoch, next.seq), 0)],
                    ..Default::default()
                })
                .await?;
            if v.succeeded {
                return Ok(Some(next));
            }
        }
        Err(unavailable("marker update kept conflicting"))
    }

    async fn replace_marker(
        &self,
        expected: Option<&Marker>,
        epoch: &str,
    ) -> Result<Marker, StoreError> {
        let compare = match expected {
            None => rpc::absent(MARKER),
            Some(m) => rpc::value_equal(MARKER, &format!("{} {}", m.epoch, m.seq)),
        };
        self.txn(&TxnRequest {
            compare: vec![compare],
            success: vec![rpc::put(MARKER, &format!("{epoch} 1"), 0)],
            ..Default::default()
        })
        .await?;
        self.read_marker()
            .await?
            .ok_or_else(|| unavailable("marker not readable after replacement"))
    }
}

impl EtcdBackend {
    /// One key's value and revision, if it exists.
    async fn get(&self, key: &str) -> Result<Option<rpc::KeyValue>, StoreError> {
        let answer: rpc::RangeResponse = self
            .call(
                RANGE,
                &rpc::RangeRequest {
                    key: key.into(),
                    ..Default::default()
                },
            )
            .await?;
        Ok(answer.kvs.into_iter().next())
    }

    async fn read_marker_rev(&self) -> Result<Option<(Marker, i64)>, StoreError> {
        let Some(kv) = self.get(MARKER).await? else {
            return Ok(None);
        };
        let text = text(&kv.value);
        let (epoch, seq) = text
            .split_once(' ')
            .ok_or_else(|| unavailable("malformed marker"))?;
        Ok(Some((
            Marker {
                epoch: epoch.to_string(),
                seq: seq.parse().unwrap_or(0),
            },
            kv.mod_revision,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_split_by_size_keep_every_operation_in_order() {
        let op = |n: usize| "x".repeat(n);
        let ops: Vec<String> = (0..10).map(|i| op(MAX_TXN_BYTES / 4 + i)).collect();
        let chunks = by_size(ops.clone(), String::len);
        assert!(
            chunks.len() >= 3,
            "ten quarter-size operations need several transactions"
        );
        for c in &chunks {
            let size: usize = c.iter().map(String::len).sum();
            assert!(size <= MAX_TXN_BYTES || c.len() == 1);
        }
        assert_eq!(chunks.concat(), ops, "nothing lost or reordered");
        // One operation over the limit goes alone.
        let big = by_size(vec![op(10), op(MAX_TXN_BYTES * 2), op(10)], String::len);
        assert_eq!(big.iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 1, 1]);
        assert!(by_size(Vec::<String>::new(), String::len).is_empty());
        // Full batches of the longest default keys (1536 bytes) split, and
        // each part stays far under etcd's 1.5 MiB request limit.
        let parts = by_size((0..64).collect::<Vec<usize>>(), |_| {
            txn_size(&"k".repeat(1536))
        });
        assert!(
            parts.len() > 1
                && parts
                    .iter()
                    .all(|p| p.len() * txn_size(&"k".repeat(1536)) <= MAX_TXN_BYTES)
        );
    }

    /// The size a batch is split by bounds what an acquire really adds to
    /// the encoded transaction, for short and long keys and the largest
    /// tokens, lease ids and etcd lease ids.
    #[test]
    fn the_size_estimate_bounds_an_acquires_encoding() {
        for len in [0, 1, 40, 1536, 8192] {
            let key = "\u{7f}".repeat(len);
            let lease = WriteLease {
                token: u64::MAX,
                id: "f".repeat(32),
            };
            let txn = EtcdBackend::acquire_txn(&key, &lease, i64::MIN);
            let encoded = rpc::nested(txn.body).encoded_len() + 4;
            assert!(
                encoded <= txn_size(&key),
                "key of {len} bytes: {encoded} encoded > {} estimated",
                txn_size(&key)
            );
        }
    }
}
