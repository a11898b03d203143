//! The request path: classify a request, fence it if it is a write, relay
//! it.
//!
//! - `classify.rs`: what a request is (route, upstream target, and for a
//!   write its keys and token), decided with no store and no upstream.
//! - this file: the route table and its reloads, the fencing of a write
//!   (`fence_write`: admission and the waits behind older writes), and the
//!   answer, its log line and its metrics (`handle`).
//! - `forward.rs`: the headers on the way, the guarded request body, and the
//!   exchange with the route's [`Upstream`](crate::upstream::Upstream).
//!
//! The order is fixed so that nothing of a refused write leaves the proxy:
//! route and key first (400), then the body limit (413), the token (428/400),
//! admission (409/503), and only then a connection upstream. The request body
//! is not polled before admission, so a client that sent
//! `Expect: 100-continue` gets the final refusal instead of `100 Continue`.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, ErrorFormat, Limits, Route, TokenMode};
use crate::error::{BoxError, ProxyBody, ProxyError};
use crate::fence::{Fence, FenceError, Permit};
use crate::key::{self, CanonicalPath, KeyError};
use crate::metrics::{Metrics, RouteMetrics};
use crate::routing::{match_order, Explain, Explained};
use crate::tls::{upstream_connector, TlsError};
use crate::token::{token_from_headers, FENCE_TOKEN};
use crate::upstream::Upstream;

mod classify;
mod forward;
mod linger;

use classify::*;
pub use forward::strip_hop_by_hop;
use forward::*;

/// Idle upstream connections older than this are closed.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often idle upstream connections are reaped.
const REAP_EVERY: Duration = Duration::from_secs(5);

/// A route with its upstream connection pools.
struct RouteRuntime {
    route: Route,
    /// One pool per worker thread: a worker's upstream connections are
    /// driven by tasks on its own runtime.
    upstream: Arc<Upstream>,
    metrics: RouteMetrics,
}

impl AsRef<Route> for RouteRuntime {
    fn as_ref(&self) -> &Route {
        &self.route
    }
}

/// What a reload replaces: the routes and their upstream clients.
struct RouteTable {
    routes: Vec<RouteRuntime>,
    /// How requests map to fence keys; shared with the previous table when
    /// a reload left it unchanged.
    mapping: Arc<Mapping>,
    /// Some route names a host: then a request must name one too.
    host_routes: bool,
    /// One log line per request (target `fencegate::access`).
    access_log: bool,
    /// Who may speak for clients in forwarded headers; `None`: not set,
    /// and those headers are appended to as they come.
    trusted: Option<Arc<crate::proxy_protocol::TrustedProxies>>,
}

/// What decides a request's fence key, per route in match order.
#[derive(PartialEq, Eq, Debug)]
struct MappingEntry {
    host: Option<String>,
    path_prefix: String,
    key: String,
    namespace: String,
    literal_keys: bool,
}

impl MappingEntry {
    fn of(route: &Route) -> Self {
        Self {
            host: route.host.clone(),
            path_prefix: route.path_prefix.clone(),
            key: route.key.to_string(),
            namespace: route.namespace.clone(),
            literal_keys: route.literal_keys,
        }
    }
}

/// One way of mapping requests to fence keys. After a reload that changes
/// the mapping, a write to a resource may be in flight under its old key
/// while a new write arrives under the new key, where no fence gate orders
/// them: so writes under the new mapping first wait (as long as they would
/// behind an older write) until no write admitted under an older mapping is
/// in flight, which is what a restart's drain would have given them.
struct Mapping {
    signature: Vec<MappingEntry>,
    /// [`fingerprint`] of the signature, as recorded in the store.
    fingerprint: u64,
    /// Every request under this mapping holds a token from the start until
    /// it is known to be a read, or, for a write, until it is no longer in
    /// flight. Closed when a reload replaces the mapping.
    writes: TaskTracker,
    /// The trackers of older mappings that may still have writes in flight.
    /// Each of those writes ends by its own deadline, so they empty in
    /// bounded time; until then writes here wait or are refused (503).
    behind: Vec<TaskTracker>,
}

impl Mapping {
    fn new(signature: Vec<MappingEntry>, previous: Option<&Mapping>) -> Self {
        let mut behind = Vec::new();
        if let Some(p) = previous {
            behind.extend(
                p.behind
                    .iter()
                    .filter(|t| !(t.is_closed() && t.is_empty()))
                    .cloned(),
            );
            // Closed by `reload_routes` once this mapping is in place.
            behind.push(p.writes.clone());
        }
        Self {
            fingerprint: fingerprint(&signature),
            signature,
            writes: TaskTracker::new(),
            behind,
        }
    }
}

/// A fingerprint of a key mapping that stays the same across restarts
/// and releases of the same routes (FNV-1a over its printed form), never
/// [`KEY_MAPPING_MIXED`](crate::store::KEY_MAPPING_MIXED).
fn fingerprint(signature: &[MappingEntry]) -> u64 {
    let text = format!("{signature:?}");
    let h = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    h.max(crate::store::KEY_MAPPING_MIXED + 1)
}

/// The signature of the key mapping `routes` give, in match order (the
/// order the route table matches in, whatever the config's).
fn signature<'a>(routes: impl IntoIterator<Item = &'a Route>) -> Vec<MappingEntry> {
    let mut routes: Vec<&Route> = routes.into_iter().collect();
    routes.sort_by_key(|r| match_order(r));
    routes.into_iter().map(MappingEntry::of).collect()
}

/// A write's permits, its key-mapping token, and its token in the drain's
/// tracker.
type Held = (Vec<Permit>, Option<TaskTrackerToken>, TaskTrackerToken);

/// What keeps a write in flight for those who must wait for it: its fence
/// permits (newer writes to its keys) and its mapping token (writes under a
/// mapping that replaced it). The write's exchange and body are cut at
/// `deadline`, so nobody waits on it longer than that.
struct InFlight {
    /// Taken (released) when the last holder is done, or at the deadline
    /// by [`InFlight::release_at_deadline`], whichever comes first. The
    /// second token counts the write in the drain's tracker of writes in
    /// flight (`Proxy::exchanges`): whatever keeps the write in flight (a
    /// 408, a body still uploading after an early answer) keeps a clean stop
    /// from being recorded.
    held: std::sync::Mutex<Option<Held>>,
    deadline: tokio::time::Instant,
}

impl InFlight {
    /// A request body still being sent after an early answer is cut at the
    /// deadline only when the upstream connection next polls it, which it
    /// does not while the upstream reads nothing. So the write stops
    /// holding its keys (and its mapping) at the deadline whatever the body
    /// does; newer writes wait [`crate::fence::CUT_GRACE`] beyond that anyway.
    /// With `keep`, the write stays in flight until then even if nothing
    /// else holds it (an answer that may not be its own: a 408).
    fn release_at_deadline(hold: &Arc<InFlight>, keep: bool) {
        let weak = Arc::downgrade(hold);
        let kept = keep.then(|| hold.clone());
        let deadline = hold.deadline;
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            if let Some(hold) = weak.upgrade() {
                drop(hold.held.lock().expect("in-flight lock").take());
            }
            drop(kept);
        });
    }
}

/// The request handler shared by every connection.
pub struct Proxy {
    /// Swapped whole by a reload; each request holds the table it started
    /// with.
    routes: ArcSwap<RouteTable>,
    fence: Arc<Fence>,
    metrics: Arc<Metrics>,
    limits: Limits,
    request_id_prefix: String,
    request_seq: std::sync::atomic::AtomicU64,
    /// Every admitted write's upstream exchange, counted from its start
    /// (`forward::Detached`); one whose request task is dropped runs on as a
    /// task of its own, so a client hanging up cannot end a write's
    /// in-flight period while the backend may still be applying it.
    /// Shutdown waits for them.
    exchanges: TaskTracker,
    /// Open WebSocket tunnels, bounded like a listener's connections
    /// (`limits.max_connections`): a tunnel leaves its connection's slot.
    tunnels: Arc<tokio::sync::Semaphore>,
    /// Worker threads (one upstream pool per route each).
    workers: usize,
}

impl Explain for Proxy {
    /// Under the routes now in force (see [`crate::routing::explain`]).
    fn explain(
        &self,
        host: Option<&str>,
        target: &str,
        headers: &HeaderMap,
    ) -> Result<Explained, ProxyError> {
        crate::routing::explain(
            &self.routes.load().routes,
            host,
            target,
            headers,
            self.limits.max_key_bytes,
        )
    }
}

impl RouteTable {
    /// Builds every route's upstream client. Fails (naming the field) if a
    /// route's TLS files do not load.
    fn build(
        config: &Config,
        metrics: &Metrics,
        previous: Option<&RouteTable>,
        workers: usize,
    ) -> Result<Self, TlsError> {
        let mut routes = Vec::with_capacity(config.routes.len());
        for (i, route) in config.routes.iter().enumerate() {
            // An unchanged plain-HTTP route keeps its client and so its pool
            // of upstream connections. An https one is rebuilt: a reload is
            // how a changed CA bundle or client certificate is picked up.
            let unchanged = previous.and_then(|t| {
                t.routes.iter().find(|r| {
                    r.route == *route && route.upstream.scheme != http::uri::Scheme::HTTPS
                })
            });
            if let Some(rt) = unchanged {
                routes.push(RouteRuntime {
                    route: rt.route.clone(),
                    upstream: rt.upstream.clone(),
                    metrics: rt.metrics.clone(),
                });
                continue;
            }
            let mut http = HttpConnector::new();
            http.set_connect_timeout(Some(route.connect_timeout));
            http.set_nodelay(true);
            // https upstreams go through the TLS layer.
            http.enforce_http(false);
            let connector = upstream_connector(
                &format!("routes[{i}]"),
                &route.upstream.scheme,
                &route.upstream_tls,
                http,
            )?;
            let dial = Uri::builder()
                .scheme(route.upstream.scheme.clone())
                .authority(route.upstream.authority.clone())
                .path_and_query("/")
                .build()
                .map_err(|e| TlsError {
                    field: format!("routes[{i}].upstream"),
                    reason: e.to_string(),
                })?;
            routes.push(RouteRuntime {
                route: route.clone(),
                upstream: Arc::new(Upstream::new(
                    dial,
                    connector,
                    workers,
                    POOL_IDLE_TIMEOUT,
                    route.upstream_tls.http2 && route.upstream.scheme != http::uri::Scheme::HTTPS,
                )),
                metrics: metrics.route(&route.name),
            });
        }
        routes.sort_by_key(|r| match_order(&r.route));
        let signature = signature(routes.iter().map(|r| &r.route));
        let mapping = match previous {
            Some(p) if p.mapping.signature == signature => p.mapping.clone(),
            _ => Arc::new(Mapping::new(signature, previous.map(|p| &*p.mapping))),
        };
        Ok(Self {
            host_routes: routes.iter().any(|r| r.route.host.is_some()),
            routes,
            mapping,
            access_log: config.access_log,
            trusted: config.trusted_proxies.clone().map(Arc::new),
        })
    }
}

impl Proxy {
    /// `workers`: how many worker threads serve requests (each gets its
    /// own upstream pools).
    pub fn new(
        config: &Config,
        fence: Arc<Fence>,
        metrics: Arc<Metrics>,
        workers: usize,
    ) -> Result<Self, TlsError> {
        Ok(Self {
            routes: ArcSwap::from_pointee(RouteTable::build(config, &metrics, None, workers)?),
            workers,
            fence,
            metrics,
            limits: config.limits.clone(),
            request_id_prefix: crate::id::unique_id()[..16].to_string(),
            request_seq: std::sync::atomic::AtomicU64::new(0),
            exchanges: TaskTracker::new(),
            tunnels: Arc::new(tokio::sync::Semaphore::new(config.limits.max_connections)),
        })
    }

    /// The fingerprint of the key mapping now in force.
    pub fn key_mapping(&self) -> u64 {
        self.routes.load().mapping.fingerprint
    }

    /// The fingerprint of the key mapping `config`'s routes would give.
    pub fn key_mapping_of(config: &Config) -> u64 {
        fingerprint(&signature(&config.routes))
    }

    /// Resolves once no write admitted under an older key mapping than
    /// the one in force now can be in flight (each ends by its deadline).
    pub fn key_mapping_settled(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let behind = self.routes.load().mapping.behind.clone();
        async move {
            for t in behind {
                t.wait().await;
            }
        }
    }

    /// Whether writes under older key mappings are all done now.
    pub fn key_mapping_is_settled(&self) -> bool {
        let table = self.routes.load();
        table
            .mapping
            .behind
            .iter()
            .all(|t| t.is_closed() && t.is_empty())
    }

    /// Builds the routes of `config` and swaps them in: requests that
    /// already picked a route finish on it (with its connection pool); new
    /// ones use the new table. On error nothing changes.
    pub fn reload_routes(&self, config: &Config) -> Result<(), TlsError> {
        let previous = self.routes.load_full();
        let table = RouteTable::build(config, &self.metrics, Some(&previous), self.workers)?;
        let remapped = !Arc::ptr_eq(&table.mapping, &previous.mapping);
        self.routes.store(Arc::new(table));
        // Closed only now that the new table is in place: see `enter`.
        if remapped {
            previous.mapping.writes.close();
        }
        Ok(())
    }

    /// The route table a request lives with, and its place under that
    /// table's key mapping. A request that loaded a table whose mapping a
    /// reload has just closed takes the newer table instead (already in
    /// place by then): otherwise it could slip in after the new mapping's
    /// writes stopped waiting for the old one.
    fn enter(&self) -> (Arc<RouteTable>, TaskTrackerToken) {
        loop {
            let table = self.routes.load_full();
            let token = table.mapping.writes.token();
            if !table.mapping.writes.is_closed() {
                return (table, token);
            }
        }
    }

    /// A new request id: a per-process random prefix and a counter, so the
    /// request path pays one atomic increment, not a random draw.
    fn next_request_id(&self) -> HeaderValue {
        let n = self.request_seq.fetch_add(1, Ordering::Relaxed);
        request_id(&self.request_id_prefix, n)
    }

    /// Closes idle upstream connections past their timeout every few
    /// seconds, until `stop`.
    pub async fn reap_idle_connections(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(REAP_EVERY) => {}
            }
            for rt in &self.routes.load().routes {
                rt.upstream.reap_idle();
            }
        }
    }

    /// The tracker of in-flight write exchanges (for the drain).
    pub fn exchanges(&self) -> TaskTracker {
        self.exchanges.clone()
    }

    /// Serves one request. Never fails: every error becomes an answer.
    pub async fn handle(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        peer: Peer,
    ) -> Result<Response<ProxyBody>, Infallible> {
        // The routes this request lives with, whatever a reload swaps in
        // meanwhile: the route (and its pool) it starts with is the one it
        // ends with.
        let (table, mapping) = self.enter();
        // Keep a sane client-sent request id, else make one; it goes
        // upstream and back to the client, and into the access log.
        let request_id = req
            .headers()
            .get(&X_REQUEST_ID)
            .filter(|v| {
                v.len() <= 128
                    && v.as_bytes()
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(b))
            })
            .cloned()
            .unwrap_or_else(|| self.next_request_id());
        req.headers_mut().insert(&X_REQUEST_ID, request_id.clone());
        let (client, forwarded_untrusted) =
            client_of(table.trusted.as_deref(), peer, req.headers());
        let mut record = Record {
            proxy: &self,
            peer,
            client,
            access_log: table.access_log,
            started: Instant::now(),
            request_id,
            version: req.version(),
            ctx: RequestContext {
                peer: Some(peer),
                // Held until the request is known to be a read, or by a
                // write until it is no longer in flight.
                mapping: Some(mapping),
                // gRPC runs on HTTP/2 only: an HTTP/1.1 client gets
                // HTTP's answers.
                grpc: req.version() == http::Version::HTTP_2
                    && crate::error::is_grpc(req.headers()),
                forwarded_untrusted,
                ..RequestContext::default()
            },
            done: false,
        };
        let (mut resp, status) = match self.serve(&table, req, &mut record.ctx).await {
            Ok(resp) => {
                let status = resp.status();
                (resp, status)
            }
            Err(err) => {
                if record.ctx.write {
                    record.ctx.decision = refusal_decision(&err);
                }
                // Logged and counted as the HTTP status it stands for,
                // whatever form it takes (a gRPC refusal is an HTTP 200).
                let status = err.status();
                let mut resp = self.refuse(err, &record.ctx, &record.request_id);
                match record.ctx.unread.take() {
                    None | Some(linger::Unread::None) => {}
                    Some(linger::Unread::Close) => close_after(&mut resp),
                    Some(linger::Unread::Linger { body, close }) => {
                        if close {
                            close_after(&mut resp);
                        }
                        linger::spawn_drain(body);
                    }
                }
                (resp, status)
            }
        };
        resp.headers_mut()
            .insert(&X_REQUEST_ID, record.request_id.clone());
        record.finish(status);
        Ok(resp)
    }

    fn refuse(
        &self,
        err: ProxyError,
        ctx: &RequestContext,
        request_id: &HeaderValue,
    ) -> Response<ProxyBody> {
        let route = ctx.route.as_deref().unwrap_or("-");
        if ctx.write {
            if let Some(d) = ctx.decision {
                self.metrics.writes.with_label_values(&[route, d]).inc();
            }
            if matches!(
                err,
                ProxyError::StoreUnavailable(_) | ProxyError::StoreLostData(_)
            ) {
                self.metrics.store_errors.with_label_values(&[route]).inc();
            }
        }
        let key = ctx.key.as_deref();
        match &err {
            ProxyError::Stale { token, highest } => tracing::warn!(
                route, key = key.unwrap_or("-"), token, highest, method = %ctx.method,
                "refused stale write"
            ),
            e if ctx.write && e.status().is_client_error() => tracing::info!(
                route, key = key.unwrap_or("-"), method = %ctx.method, status = e.status().as_u16(),
                reason = %e, "refused write"
            ),
            e if e.status().is_server_error() => tracing::warn!(
                route, key = key.unwrap_or("-"), method = %ctx.method, status = e.status().as_u16(),
                reason = %e, "request failed"
            ),
            e => tracing::debug!(route, status = e.status().as_u16(), reason = %e, "refused"),
        }
        if ctx.grpc {
            err.into_grpc_response()
        } else if let Some(resource) = &ctx.s3_resource {
            err.into_s3_response(Some(resource), key, request_id.to_str().unwrap_or("-"))
        } else {
            err.into_response(key)
        }
    }

    async fn serve(
        &self,
        table: &RouteTable,
        mut req: Request<Incoming>,
        ctx: &mut RequestContext,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let Classified { rt, path, write } = match self.classify(table, &mut req, ctx) {
            Ok(classified) => classified,
            Err(e) => return Err(ctx.refused_unread(req, e)),
        };
        let _in_flight = GaugeGuard::new(rt.metrics.in_flight.clone());
        let Some(intent) = write else {
            ctx.mapping = None;
            if req.headers().contains_key(&FENCE_TOKEN) {
                rt.metrics.read_tokens_ignored.inc();
            }
            return self.forward(rt, req, &path, None, ctx).await;
        };
        let hold = match self.fence_write(table, rt, intent, ctx).await {
            Ok(hold) => hold,
            Err(e) => return Err(ctx.refused_unread(req, e)),
        };
        self.forward(rt, req, &path, Some(hold), ctx).await
    }

    /// Admits a classified write: its token checked against each key's
    /// highest, behind the older writes it must follow (older key mappings,
    /// then each key's older writes in flight). The hold it returns keeps
    /// the write in flight for those who must wait for it.
    async fn fence_write(
        &self,
        table: &RouteTable,
        rt: &RouteRuntime,
        intent: WriteIntent,
        ctx: &mut RequestContext,
    ) -> Result<Arc<InFlight>, ProxyError> {
        let route = &rt.route;
        let WriteIntent { mut keys, token } = intent;
        let granted_only = route.tokens == TokenMode::Granted;
        if route.max_token_step.is_some() || granted_only {
            for key in &keys {
                // Read before admission, not in it: the highest only rises,
                // and a token at or below it never raises it, so on a
                // granted route only a grant can (which makes more tokens
                // granted, never fewer).
                let highest = match self.fence.highest_known(key) {
                    // At or below a known lower bound: granted, and not too
                    // far ahead; no store round trip (a shared store's
                    // steady writes).
                    Some(h) if token <= h => Some(h),
                    _ => self.fence.highest(key).await.map_err(|e| store_error(&e))?,
                };
                if granted_only && highest.is_none_or(|h| token > h) {
                    ctx.key = Some(key.clone());
                    return Err(ProxyError::NotGranted { token });
                }
                if let (Some(step), Some(h)) = (route.max_token_step, highest) {
                    if token > h.saturating_add(step) {
                        ctx.key = Some(key.clone());
                        return Err(ProxyError::TokenTooFarAhead {
                            token,
                            highest: h,
                            max_step: step,
                        });
                    }
                }
            }
        }
        let started = Instant::now();
        // One limit for the whole wait: older mappings, then all keys of the
        // request. Past it the write is refused, never sent ahead of an
        // older write that may still be applied.
        let wait_until = tokio::time::Instant::now() + route.upstream_timeout;
        for older in &table.mapping.behind {
            if tokio::time::timeout_at(wait_until, older.wait())
                .await
                .is_err()
            {
                tracing::warn!(
                    route = %route.name,
                    "writes admitted before a reload that changed the key mapping are still in flight: refusing (503)"
                );
                return Err(ProxyError::OlderInFlight {
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        keys.sort();
        keys.dedup();
        let mut permits = Vec::with_capacity(keys.len());
        for key in &keys {
            ctx.key = Some(key.clone());
            match self
                .fence
                .admit(key, token, wait_until, route.upstream_timeout)
                .await
            {
                Ok(p) => {
                    if p.waited_out {
                        rt.metrics.admission_waited_out.inc();
                    }
                    permits.push(p);
                }
                Err(FenceError::Stale { token, highest }) => {
                    return Err(ProxyError::Stale { token, highest })
                }
                Err(FenceError::Store(e)) => {
                    self.metrics.store_up.set(0);
                    return Err(ProxyError::from_store(&e));
                }
                Err(FenceError::Recovering { retry_after }) => {
                    return Err(ProxyError::Recovering { retry_after })
                }
                Err(FenceError::Busy { retry_after }) => {
                    return Err(ProxyError::OlderInFlight { retry_after })
                }
            }
        }
        // Holding several keys (COPY/MOVE): while this write waited for one,
        // a newer writer may have taken over another. It must not go now.
        for (key, permit) in keys.iter().zip(&permits).filter(|_| keys.len() > 1) {
            let overtaken = self
                .fence
                .overtaken(permit)
                .await
                .map_err(|e| store_error(&e))?;
            if let Some(highest) = overtaken {
                ctx.key = Some(key.clone());
                return Err(ProxyError::Stale { token, highest });
            }
        }
        ctx.key = keys.first().cloned();
        self.metrics.store_up.set(1);
        rt.metrics
            .admission_wait
            .observe(started.elapsed().as_secs_f64());
        rt.metrics.admitted.inc();
        ctx.decision = Some("admitted");
        tracing::debug!(route = %route.name, key = ctx.key.as_deref().unwrap_or("-"), token, "admitted write");
        // The earliest key's deadline: time spent waiting for a second key
        // (COPY/MOVE) comes out of the exchange's share.
        let deadline = permits
            .iter()
            .map(|p| p.deadline())
            .min()
            .expect("a write holds at least one key");
        // Waiting for a later key (COPY/MOVE) may have used up the first
        // key's share: its newer writers stop waiting at that deadline, so
        // this write must not start after it.
        if tokio::time::Instant::now() >= deadline {
            return Err(ProxyError::OlderInFlight {
                retry_after: Duration::from_secs(1),
            });
        }
        // Counted before the check: the drain closes the tracker, then waits
        // for it, so a write either counts or sees it closed.
        let in_flight = self.exchanges.token();
        if self.exchanges.is_closed() {
            return Err(ProxyError::ShuttingDown);
        }
        Ok(Arc::new(InFlight {
            held: std::sync::Mutex::new(Some((permits, ctx.mapping.take(), in_flight))),
            deadline,
        }))
    }
}

/// The access-log line and the request counter of one request, written
/// once: with its answer's status, or with 499 (nginx's "client closed
/// request") if the request is dropped first, so a write whose client went
/// away still leaves its trace while its exchange runs on.
struct Record<'a> {
    proxy: &'a Proxy,
    peer: Peer,
    /// The client: the peer, or the one trusted proxies name.
    client: std::net::IpAddr,
    access_log: bool,
    started: Instant,
    request_id: HeaderValue,
    version: http::Version,
    ctx: RequestContext,
    done: bool,
}

impl Record<'_> {
    fn finish(&mut self, status: http::StatusCode) {
        self.done = true;
        let ctx = &self.ctx;
        if self.access_log {
            let peer = self.peer;
            tracing::info!(
                target: "fencegate::access",
                request_id = self.request_id.to_str().unwrap_or("-"),
                client = %self.client,
                peer = %peer.addr,
                method = %ctx.method,
                route = ctx.route.as_deref().unwrap_or("-"),
                key = ctx.key.as_deref().unwrap_or("-"),
                token = ctx.token,
                class = if ctx.write { "write" } else { "read" },
                decision = ctx.decision.unwrap_or("-"),
                status = status.as_u16(),
                version = ?self.version,
                tls = peer.tls,
                latency_ms = self.started.elapsed().as_secs_f64() * 1000.0,
                upstream_ms = ctx.upstream_ms,
                "request"
            );
        }
        match &ctx.requests {
            Some(counters) => counters.inc(ctx.write, status),
            None => self
                .proxy
                .metrics
                .requests
                .with_label_values(&[
                    "-",
                    if ctx.write { "write" } else { "read" },
                    status.as_str(),
                ])
                .inc(),
        }
    }
}

impl Drop for Record<'_> {
    fn drop(&mut self) {
        if !self.done {
            // A panic in the request path is the proxy's failure, not the
            // client's.
            self.finish(if std::thread::panicking() {
                http::StatusCode::INTERNAL_SERVER_ERROR
            } else {
                CLIENT_CLOSED
            });
        }
    }
}

/// nginx's status for a request whose client went away before its answer.
const CLIENT_CLOSED: http::StatusCode = match http::StatusCode::from_u16(499) {
    Ok(s) => s,
    Err(_) => panic!("499 is a status code"),
};

#[derive(Default)]
struct RequestContext {
    route: Option<String>,
    /// The route's request counters, once the route is known.
    requests: Option<Arc<crate::metrics::RequestCounters>>,
    key: Option<String>,
    method: Method,
    write: bool,
    token: Option<u64>,
    peer: Option<Peer>,
    /// The fencing decision of a write (`admitted`, `stale`...), for the
    /// access log.
    decision: Option<&'static str>,
    /// Forwarding to the upstream's response head.
    upstream_ms: Option<f64>,
    /// This request's place under its key mapping (see [`Mapping`]):
    /// released once it is known to be a read, kept by a write in flight.
    mapping: Option<TaskTrackerToken>,
    /// A gRPC call: refused with a gRPC status, not problem+json.
    grpc: bool,
    /// The route answers refusals in S3's form (`error_format = "s3"`):
    /// the request's path, the error's `<Resource>`.
    s3_resource: Option<String>,
    /// The body of a request refused before it was read.
    unread: Option<linger::Unread>,
    /// `trusted_proxies` is set and the peer is not in it: the forwarded
    /// headers it sent are replaced, not appended to.
    forwarded_untrusted: bool,
    /// A WebSocket handshake on a route that passes them.
    websocket: bool,
}

impl RequestContext {
    /// Keeps what the refusal of `req` needs of its unread body: the
    /// client must be able to read the answer (see [`linger`]).
    fn refused_unread(&mut self, req: Request<Incoming>, err: ProxyError) -> ProxyError {
        // A gRPC refusal is one HEADERS frame that ends the stream; gRPC
        // clients read it whatever happens to their request stream.
        if !self.grpc {
            let (parts, body) = req.into_parts();
            let framing = matches!(err, ProxyError::BadFraming(_));
            self.unread = Some(linger::Unread::of(
                &parts.method,
                parts.version,
                &parts.headers,
                body,
                framing,
            ));
        }
        err
    }
}

/// The client of a request, and whether the forwarded headers it came
/// with are to be dropped. Without `trusted_proxies`: the peer (the PROXY
/// header's client on such a listener), headers kept. With it: from a
/// trusted peer, the first untrusted address of `X-Forwarded-For` read
/// from the right; from anyone else, the peer, its headers dropped.
fn client_of(
    trusted: Option<&crate::proxy_protocol::TrustedProxies>,
    peer: Peer,
    headers: &HeaderMap,
) -> (std::net::IpAddr, bool) {
    let ip = peer.addr.ip();
    let Some(trusted) = trusted else {
        return (ip, false);
    };
    if !trusted.contains(ip) {
        return (ip, true);
    }
    let items = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','));
    (trusted.client_in_chain(items).unwrap_or(ip), false)
}

/// Tells an HTTP/1.1 client that the connection ends after this answer
/// (HTTP/2 has no such header; hyper leaves it out there).
fn close_after<B>(resp: &mut Response<B>) {
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
}

/// A fence call's failure when only the store can have failed.
fn store_error(e: &FenceError) -> ProxyError {
    match e {
        FenceError::Store(s) => ProxyError::from_store(s),
        other => ProxyError::StoreUnavailable(other.to_string()),
    }
}

/// The `decision` label of a refused write, if the refusal is a fencing
/// decision (upstream failures are not).
fn refusal_decision(err: &ProxyError) -> Option<&'static str> {
    Some(match err {
        ProxyError::Token(crate::token::TokenError::Missing) => "missing_token",
        ProxyError::Token(_) => "malformed_token",
        ProxyError::Stale { .. } => "stale",
        ProxyError::TokenTooFarAhead { .. } => "too_far_ahead",
        ProxyError::BadTarget(_) | ProxyError::KeyTooLong { .. } => "bad_key",
        ProxyError::Recovering { .. } => "recovering",
        ProxyError::OlderInFlight { .. } => "older_in_flight",
        ProxyError::StoreUnavailable(_) | ProxyError::StoreLostData(_) => "store_error",
        ProxyError::ShuttingDown => "shutting_down",
        _ => return None,
    })
}

/// The client end of a connection.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    pub addr: std::net::SocketAddr,
    /// Came in on the TLS listener (X-Forwarded-Proto: https).
    pub tls: bool,
}

static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Decrements a gauge when dropped.
struct GaugeGuard(prometheus::IntGauge);

impl GaugeGuard {
    fn new(g: prometheus::IntGauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
