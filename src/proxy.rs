//! Forwarding: classify a request, fence it if it is a write, relay it.
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

use crate::config::{Config, Limits, Route};
use crate::error::{BoxError, ProxyBody, ProxyError};
use crate::fence::{Fence, FenceError, Permit};
use crate::key::{self, CanonicalPath, KeyError};
use crate::metrics::{Metrics, RouteMetrics};
use crate::tls::{upstream_connector, TlsError};
use crate::token::{token_from_headers, FENCE_TOKEN};
use crate::upstream::Upstream;

/// Headers that name a different method than the request line's.
const OVERRIDE_HEADERS: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// Hop-by-hop headers (RFC 9110 section 7.6.1), plus `Expect`, which the
/// proxy answers itself, and `Proxy-Connection`, a common non-standard one.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::EXPECT,
];

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
}

/// What decides a request's fence key, per route in match order.
#[derive(PartialEq, Eq)]
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
            signature,
            writes: TaskTracker::new(),
            behind,
        }
    }
}

/// What keeps a write in flight for those who must wait for it: its fence
/// permits (newer writes to its keys) and its mapping token (writes under a
/// mapping that replaced it). The write's exchange and body are cut at
/// `deadline`, so nobody waits on it longer than that.
struct InFlight {
    /// Taken (released) when the last holder is done, or at the deadline
    /// by [`InFlight::release_at_deadline`], whichever comes first.
    held: std::sync::Mutex<Option<(Vec<Permit>, Option<TaskTrackerToken>)>>,
    deadline: tokio::time::Instant,
}

impl InFlight {
    /// A request body still being sent after an early answer is cut at the
    /// deadline only when the upstream connection next polls it, which it
    /// does not while the upstream reads nothing. So the write stops
    /// holding its keys (and its mapping) at the deadline whatever the body
    /// does; newer writes wait [`crate::fence::CUT_GRACE`] beyond that anyway.
    fn release_at_deadline(hold: &Arc<InFlight>) {
        let weak = Arc::downgrade(hold);
        let deadline = hold.deadline;
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            if let Some(hold) = weak.upgrade() {
                drop(hold.held.lock().expect("in-flight lock").take());
            }
        });
    }
}

/// A write's upstream exchange, polled on the request's own task. If that
/// task is dropped first (the client went away, the drain's grace ran out),
/// the rest of the exchange moves to a task of its own in `tracker`, so the
/// write still ends by its deadline and the drain waits for it.
struct Detached<T: Send + 'static> {
    exchange: Option<Pin<Box<dyn std::future::Future<Output = T> + Send>>>,
    tracker: TaskTracker,
}

impl<T: Send + 'static> Detached<T> {
    fn new(
        exchange: impl std::future::Future<Output = T> + Send + 'static,
        tracker: &TaskTracker,
    ) -> Self {
        Self {
            exchange: Some(Box::pin(exchange)),
            tracker: tracker.clone(),
        }
    }
}

impl<T: Send + 'static> std::future::Future for Detached<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let exchange = self.exchange.as_mut().expect("polled after completion");
        let out = std::task::ready!(exchange.as_mut().poll(cx));
        self.exchange = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        if let Some(exchange) = self.exchange.take() {
            // Dropped off a runtime (it is being torn down): nothing can
            // run it; its permits are released as it drops.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                self.tracker.spawn_on(
                    async move {
                        let _ = exchange.await;
                    },
                    &rt,
                );
            }
        }
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
    /// Upstream exchanges of admitted writes whose request task was dropped
    /// run on as tasks of their own ([`Detached`]), so a client hanging up
    /// cannot end a write's in-flight period while the backend may still be
    /// applying it; shutdown waits for them.
    exchanges: TaskTracker,
    /// Worker threads (one upstream pool per route each).
    workers: usize,
}

/// Why a relayed request body failed; read after the upstream call errors.
const BODY_OK: u8 = 0;
const BODY_TOO_LARGE: u8 = 1;
const BODY_TIMEOUT: u8 = 2;
const BODY_MALFORMED: u8 = 3;
/// The write's deadline passed while its body was still being sent.
const BODY_DEADLINE: u8 = 4;

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
                &route.upstream,
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
                upstream: Arc::new(Upstream::new(dial, connector, workers, POOL_IDLE_TIMEOUT)),
                metrics: metrics.route(&route.name),
            });
        }
        // Most specific first: a host-specific route before a catch-all host,
        // then the longest prefix.
        routes.sort_by_key(|r| {
            (
                r.route.host.is_none(),
                std::cmp::Reverse(r.route.path_prefix.trim_end_matches('/').len()),
            )
        });
        let signature: Vec<_> = routes.iter().map(|r| MappingEntry::of(&r.route)).collect();
        let mapping = match previous {
            Some(p) if p.mapping.signature == signature => p.mapping.clone(),
            _ => Arc::new(Mapping::new(signature, previous.map(|p| &*p.mapping))),
        };
        Ok(Self {
            host_routes: routes.iter().any(|r| r.route.host.is_some()),
            routes,
            mapping,
            access_log: config.access_log,
        })
    }

    fn find_route(&self, host: Option<&str>, path: &str) -> Option<&RouteRuntime> {
        self.routes.iter().find(|r| {
            r.route.host.as_deref().is_none_or(|h| Some(h) == host) && r.route.matches_path(path)
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
            request_id_prefix: crate::store::shared::unique_id()[..16].to_string(),
            request_seq: std::sync::atomic::AtomicU64::new(0),
            exchanges: TaskTracker::new(),
        })
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
        let started = Instant::now();
        // The routes this request lives with, whatever a reload swaps in
        // meanwhile: the route (and its pool) it starts with is the one it
        // ends with.
        let (table, mapping) = self.enter();
        let mut ctx = RequestContext {
            peer: Some(peer),
            // Held until the request is known to be a read, or by a write
            // until it is no longer in flight.
            mapping: Some(mapping),
            ..RequestContext::default()
        };
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
        let version = req.version();
        let mut resp = match self.serve(&table, req, &mut ctx).await {
            Ok(resp) => resp,
            Err(err) => {
                if ctx.write {
                    ctx.decision = refusal_decision(&err);
                }
                self.refuse(err, &ctx)
            }
        };
        resp.headers_mut().insert(&X_REQUEST_ID, request_id.clone());
        if table.access_log {
            tracing::info!(
                target: "fencegate::access",
                request_id = request_id.to_str().unwrap_or("-"),
                client = %peer.addr,
                method = %ctx.method,
                route = ctx.route.as_deref().unwrap_or("-"),
                key = ctx.key.as_deref().unwrap_or("-"),
                token = ctx.token,
                class = if ctx.write { "write" } else { "read" },
                decision = ctx.decision.unwrap_or("-"),
                status = resp.status().as_u16(),
                version = ?version,
                tls = peer.tls,
                latency_ms = started.elapsed().as_secs_f64() * 1000.0,
                upstream_ms = ctx.upstream_ms,
                "request"
            );
        }
        match &ctx.requests {
            Some(counters) => counters.inc(ctx.write, resp.status()),
            None => self
                .metrics
                .requests
                .with_label_values(&[
                    "-",
                    if ctx.write { "write" } else { "read" },
                    resp.status().as_str(),
                ])
                .inc(),
        }
        Ok(resp)
    }

    fn refuse(&self, err: ProxyError, ctx: &RequestContext) -> Response<ProxyBody> {
        let route = ctx.route.as_deref().unwrap_or("-");
        if ctx.write {
            if let Some(d) = ctx.decision {
                self.metrics.writes.with_label_values(&[route, d]).inc();
            }
            if matches!(err, ProxyError::StoreUnavailable(_)) {
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
        err.into_response(key)
    }

    async fn serve(
        &self,
        table: &RouteTable,
        mut req: Request<Incoming>,
        ctx: &mut RequestContext,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        ctx.method = req.method().clone();
        if req.method() == Method::CONNECT {
            return Err(ProxyError::MethodNotAllowed("CONNECT".into()));
        }
        check_framing(req.method(), req.headers())?;
        let host = request_host(&req)?;
        if host.is_none() && table.host_routes {
            // Without a host it could only take a catch-all route, which may
            // fence the same backend under another namespace.
            return Err(ProxyError::BadRequest("a Host header is required".into()));
        }
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());

        // The route is chosen on the decoded path, the one form every
        // spelling of a resource shares (`/b/r/y`, `/b/r%2Fy`, `/b/%72/y`),
        // then that route's own parse gives the key and the upstream
        // target. A canonical route refuses what it cannot key
        // unambiguously; the spelling cannot slip to another route.
        let parsed = key::route_form(&target).and_then(|form| {
            let Some(rt) = table.find_route(host.as_deref(), &form) else {
                return Ok(None);
            };
            if rt.route.literal_keys {
                key::literal(&target)
            } else {
                key::canonicalize(&target)
            }
            .map(|path| Some((rt, path)))
        });
        let (rt, path) = match parsed {
            Ok(Some(found)) => found,
            Ok(None) => return Err(ProxyError::NoRoute),
            Err(e) => {
                ctx.write = true; // unparsed: assume the worst for logging
                return Err(ProxyError::BadTarget(e));
            }
        };
        let route = &rt.route;
        ctx.route = Some(route.name.clone());
        ctx.requests = Some(rt.metrics.requests.clone());
        ctx.write = self.is_write(route, req.method(), req.headers(), req.uri().query())?;
        let _in_flight = GaugeGuard::new(rt.metrics.in_flight.clone());

        if !ctx.write {
            ctx.mapping = None;
            if req.headers().contains_key(&FENCE_TOKEN) {
                rt.metrics.read_tokens_ignored.inc();
            }
            return self.forward(rt, req, &path, None, ctx).await;
        }

        // Writes: everything that can be refused is checked before anything
        // is forwarded.
        let mut keys = vec![self.fence_key(route, &path, req.headers())?];
        ctx.key = Some(keys[0].clone());
        if is_copy_or_move(req.method(), req.headers(), req.uri().query()) {
            if let Some(dest) = req.headers().get("destination") {
                let (key, rewritten) =
                    self.destination_key(table, rt, dest, host.as_deref(), req.headers())?;
                keys.push(key);
                // The backend gets the destination it was fenced as.
                req.headers_mut().insert("destination", rewritten);
            }
        }
        if let (Some(limit), Some(len)) =
            (self.limits.max_body_bytes, content_length(req.headers()))
        {
            if len > limit {
                return Err(ProxyError::BodyTooLarge { limit });
            }
        }
        // hyper ends an HTTP/2 request body cleanly when the client resets
        // the stream with NO_ERROR or CANCEL: without a declared length a
        // truncated body would reach the backend as a complete one.
        if req.version() == http::Version::HTTP_2
            && !req.body().is_end_stream()
            && !req.headers().contains_key(header::CONTENT_LENGTH)
        {
            return Err(ProxyError::LengthRequired);
        }
        let token = token_from_headers(req.headers()).map_err(ProxyError::Token)?;
        ctx.token = Some(token);

        if let Some(step) = route.max_token_step {
            for key in &keys {
                let highest = self
                    .fence
                    .highest(key)
                    .await
                    .map_err(|e| ProxyError::StoreUnavailable(e.to_string()))?;
                if let Some(h) = highest {
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
                    return Err(ProxyError::StoreUnavailable(e.to_string()));
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
                .map_err(|e| ProxyError::StoreUnavailable(e.to_string()))?;
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
        let hold = Arc::new(InFlight {
            held: std::sync::Mutex::new(Some((permits, ctx.mapping.take()))),
            deadline,
        });
        self.forward(rt, req, &path, Some(hold), ctx).await
    }

    /// A request is a write if its method is, or if a method override
    /// names a write method (so a GET overridden to DELETE is fenced): the
    /// override headers, and `_method` in the query string (Rails, Laravel,
    /// Express's method-override). A form POST (`_method` may be in its
    /// body, which is not read before forwarding) is fenced as a write.
    fn is_write(
        &self,
        route: &Route,
        method: &Method,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> Result<bool, ProxyError> {
        let named = |what: &str, m: Option<&str>| {
            m.map(str::trim)
                .filter(|m| !m.is_empty() && Method::from_bytes(m.as_bytes()).is_ok())
                .map(|m| route.write_methods.is_write(m))
                .ok_or_else(|| ProxyError::BadRequest(format!("{what} does not name a method")))
        };
        let mut write = route.write_methods.is_write(method.as_str());
        for name in OVERRIDE_HEADERS {
            for value in headers.get_all(name) {
                write |= named(name, value.to_str().ok())?;
            }
        }
        for value in query_values(query.unwrap_or(""), "_method") {
            write |= named("the _method parameter", value.as_deref())?;
        }
        if *method == Method::POST && !write && is_form(headers) {
            write = true;
        }
        Ok(write)
    }

    fn fence_key(
        &self,
        route: &Route,
        path: &CanonicalPath,
        headers: &HeaderMap,
    ) -> Result<String, ProxyError> {
        let text = route
            .key
            .key_text(path, headers)
            .map_err(ProxyError::BadTarget)?;
        let len = route.namespace.len() + 1 + text.len();
        if len > self.limits.max_key_bytes {
            return Err(ProxyError::KeyTooLong {
                len,
                limit: self.limits.max_key_bytes,
            });
        }
        Ok(format!("{}:{}", route.namespace, text))
    }

    /// The key of a COPY/MOVE `Destination`, parsed like a request target of
    /// the same route. A destination on another host or route is refused:
    /// this proxy could not fence it.
    fn destination_key(
        &self,
        table: &RouteTable,
        rt: &RouteRuntime,
        dest: &HeaderValue,
        host: Option<&str>,
        headers: &HeaderMap,
    ) -> Result<(String, HeaderValue), ProxyError> {
        let bad = |why: &str| ProxyError::BadRequest(format!("Destination header: {why}"));
        let text = dest.to_str().map_err(|_| bad("not ASCII"))?;
        let uri: Uri = text.parse().map_err(|_| bad("not a URI"))?;
        if let Some(auth) = uri.authority() {
            let (h, _) = key::authority_host(auth.as_str()).map_err(ProxyError::BadTarget)?;
            if Some(h.as_str()) != host {
                return Err(bad("names another host"));
            }
        }
        let target = uri.path_and_query().map_or("/", |p| p.as_str());
        let form = key::route_form(target).map_err(ProxyError::BadTarget)?;
        let path = if rt.route.literal_keys {
            key::literal(target)
        } else {
            key::canonicalize(target)
        }
        .map_err(ProxyError::BadTarget)?;
        match table.find_route(host, &form) {
            Some(other) if std::ptr::eq(other, rt) => {}
            _ => return Err(bad("is not served by the same route")),
        }
        let rewritten = match (uri.scheme(), uri.authority()) {
            (Some(scheme), Some(auth)) => format!("{scheme}://{auth}{}", path.upstream_target),
            _ => path.upstream_target.clone(),
        };
        let rewritten = HeaderValue::from_str(&rewritten).map_err(|_| bad("not ASCII"))?;
        Ok((self.fence_key(&rt.route, &path, headers)?, rewritten))
    }

    async fn forward(
        &self,
        rt: &RouteRuntime,
        req: Request<Incoming>,
        path: &CanonicalPath,
        hold: Option<Arc<InFlight>>,
        ctx: &mut RequestContext,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let peer = ctx.peer;
        let route = &rt.route;
        let (parts, body) = req.into_parts();
        // Origin form: the pool dials the route's address, and the Host
        // header (or HTTP/2's :authority) carries the name.
        let uri = Uri::builder()
            .path_and_query(path.upstream_target.as_str())
            .build()
            .map_err(|e| ProxyError::BadTarget(KeyError::TemplateMismatch(e.to_string())))?;
        let mut headers = parts.headers;
        // A header the key was read from must reach the backend as fenced,
        // even if the client listed it in Connection.
        let key_header = match &route.key {
            crate::key::KeyTemplate::Header(name) => Some(name),
            _ => None,
        };
        strip_hop_by_hop(&mut headers, key_header);
        if route.strip_token {
            headers.remove(&FENCE_TOKEN);
        }
        if route.forwarded_headers {
            if let Some(peer) = peer {
                add_forwarded(&mut headers, peer);
            }
        }
        if !headers.contains_key(header::HOST) {
            if let Some(auth) = parts.uri.authority() {
                if let Ok(v) = HeaderValue::from_str(auth.as_str()) {
                    headers.insert(header::HOST, v);
                }
            }
        }
        // A write ends by its permit's deadline, exchange and body alike:
        // newer writes to its keys wait for it no longer than that.
        let deadline = hold.as_ref().map_or_else(
            || tokio::time::Instant::now() + route.upstream_timeout,
            |h| h.deadline,
        );
        let body_state = Arc::new(AtomicU8::new(BODY_OK));
        let body = GuardedBody {
            inner: body,
            cutoff: hold.as_ref().map(|h| h.deadline),
            hold: hold.clone(),
            limit: self.limits.max_body_bytes,
            seen: 0,
            idle: self.limits.body_read_timeout,
            timer: None,
            state: body_state.clone(),
        };
        let mut up = Request::new(body.boxed());
        *up.method_mut() = parts.method;
        *up.uri_mut() = uri;
        *up.headers_mut() = headers;

        let started = Instant::now();
        let upstream = rt.upstream.clone();
        let exchange = async move {
            let result = tokio::time::timeout_at(deadline, upstream.send(up)).await;
            if let Some(hold) = hold {
                // The body is still being sent (an early answer).
                if Arc::strong_count(&hold) > 1 {
                    InFlight::release_at_deadline(&hold);
                }
            }
            result
        };
        // A write runs to its end (response head or upstream timeout) even
        // if the client goes away: only then is it no longer in flight for
        // ordering (its body keeps its own hold until the last byte is
        // sent). It runs on this task, and moves to a task of its own only
        // if this one is dropped first.
        let result = if ctx.write {
            Detached::new(exchange, &self.exchanges).await
        } else {
            exchange.await
        };
        let upstream = started.elapsed().as_secs_f64();
        rt.metrics.upstream_latency.observe(upstream);
        ctx.upstream_ms = Some(upstream * 1000.0);
        let resp = match result {
            Err(_) => {
                self.metrics
                    .upstream_errors
                    .with_label_values(&[&route.name, "timeout"])
                    .inc();
                return Err(ProxyError::UpstreamTimeout(route.upstream_timeout));
            }
            Ok(Err(e)) => {
                match body_state.load(Ordering::Acquire) {
                    BODY_TOO_LARGE => {
                        return Err(ProxyError::BodyTooLarge {
                            limit: self.limits.max_body_bytes.unwrap_or(0),
                        })
                    }
                    BODY_TIMEOUT => return Err(ProxyError::BodyTimeout),
                    BODY_DEADLINE => {
                        return Err(ProxyError::UpstreamTimeout(route.upstream_timeout))
                    }
                    BODY_MALFORMED => return Err(ProxyError::BadFraming(
                        "the request body could not be read (malformed chunk or connection cut)"
                            .into(),
                    )),
                    _ => {}
                }
                let kind = if e.is_connect() { "connect" } else { "other" };
                self.metrics
                    .upstream_errors
                    .with_label_values(&[&route.name, kind])
                    .inc();
                let detail = error_chain(&e);
                return Err(if e.is_connect() {
                    ProxyError::UpstreamConnect(detail)
                } else {
                    ProxyError::Upstream(detail)
                });
            }
            Ok(Ok(resp)) => resp,
        };
        let mut resp = resp;
        strip_hop_by_hop(resp.headers_mut(), None);
        Ok(resp)
    }
}

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
}

/// `PREFIX-N` with N in hex, written by hand: this runs for every request
/// that brings no id of its own. The prefix is at most 40 bytes.
fn request_id(prefix: &str, n: u64) -> HeaderValue {
    let mut id = [0u8; 64];
    let prefix = prefix.as_bytes();
    id[..prefix.len()].copy_from_slice(prefix);
    id[prefix.len()] = b'-';
    let digits = (64 - n.leading_zeros()).div_ceil(4).max(1) as usize;
    let start = prefix.len() + 1;
    for (i, slot) in id[start..start + digits].iter_mut().enumerate() {
        let nibble = (n >> (4 * (digits - 1 - i))) & 0xf;
        *slot = b"0123456789abcdef"[nibble as usize];
    }
    HeaderValue::from_bytes(&id[..start + digits]).expect("hex id")
}

/// Appends the client to `X-Forwarded-For` (as nginx's
/// `$proxy_add_x_forwarded_for` does) and to `Forwarded` (RFC 7239), and
/// sets `X-Forwarded-Proto` to this hop's scheme: a client's own value is
/// replaced, since a client on the plain port could claim `https`.
fn add_forwarded(headers: &mut HeaderMap, peer: Peer) {
    let ip = peer.addr.ip();
    let proto = if peer.tls { "https" } else { "http" };
    // Earlier hops may have sent the header on several lines: all of them
    // are kept, in order, with this hop last.
    let append = |headers: &mut HeaderMap, name: &HeaderName, item: String| {
        let mut value = String::new();
        for prev in headers.get_all(name).iter().filter_map(|v| v.to_str().ok()) {
            value.push_str(prev);
            value.push_str(", ");
        }
        value.push_str(&item);
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name, v);
        }
    };
    let (xff, forwarded) = forwarded_values(ip, proto);
    if headers.contains_key(&X_FORWARDED_FOR) {
        append(
            headers,
            &X_FORWARDED_FOR,
            xff.to_str().unwrap_or_default().into(),
        );
    } else {
        headers.insert(&X_FORWARDED_FOR, xff);
    }
    if headers.contains_key(header::FORWARDED) {
        append(
            headers,
            &header::FORWARDED,
            forwarded.to_str().unwrap_or_default().into(),
        );
    } else {
        headers.insert(header::FORWARDED, forwarded);
    }
    headers.insert(&X_FORWARDED_PROTO, HeaderValue::from_static(proto));
}

/// This hop's `X-Forwarded-For` and `Forwarded` items for a client. The
/// last client's are kept per thread: the many requests of one connection,
/// or of clients behind one balancer, format them once.
fn forwarded_values(ip: std::net::IpAddr, proto: &'static str) -> (HeaderValue, HeaderValue) {
    type Entry = (std::net::IpAddr, &'static str, HeaderValue, HeaderValue);
    thread_local! {
        static LAST: std::cell::RefCell<Option<Entry>> = const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| {
        if let Some((i, p, xff, fwd)) = last {
            if *i == ip && *p == proto {
                return (xff.clone(), fwd.clone());
            }
        }
        // An IPv6 node is quoted and bracketed (RFC 7239 section 6).
        let node = match ip {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("\"[{v6}]\""),
        };
        let xff = HeaderValue::from_str(&ip.to_string()).expect("an address is a header value");
        let fwd = HeaderValue::from_str(&format!("for={node};proto={proto}"))
            .expect("an address is a header value");
        *last = Some((ip, proto, xff.clone(), fwd.clone()));
        (xff, fwd)
    })
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
        ProxyError::StoreUnavailable(_) => "store_error",
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

/// The host a request names, through one parse whatever carries it (`Host`,
/// an absolute-form target, HTTP/2's `:authority`): both, when present,
/// must name the same host and port. Refuses a repeated `Host` (RFC 9112
/// section 3.2) and a `Connection` header naming `Host`, which would strip
/// the header routing was decided on.
fn request_host<B>(req: &Request<B>) -> Result<Option<String>, ProxyError> {
    let bad = |why: &str| ProxyError::BadRequest(why.to_string());
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host_header = hosts.next();
    if hosts.next().is_some() {
        return Err(bad("more than one Host header"));
    }
    let names_host = req
        .headers()
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("host"));
    if names_host {
        return Err(bad("the Connection header names Host"));
    }
    let parse = |text: &str| key::authority_host(text).map_err(ProxyError::BadTarget);
    let from_header = host_header
        .map(|h| {
            h.to_str()
                .map_err(|_| bad("the Host header is not ASCII"))
                .and_then(parse)
        })
        .transpose()?;
    let from_target = req
        .uri()
        .authority()
        .map(|a| parse(a.as_str()))
        .transpose()?;
    match (from_target, from_header) {
        (Some(t), Some(h)) if t != h => Err(ProxyError::BadTarget(KeyError::ForeignHost)),
        (Some((host, _)), _) | (None, Some((host, _))) => Ok(Some(host)),
        (None, None) => Ok(None),
    }
}

/// The percent-decoded values of `name` in a query string (`+` is a space
/// there); `None` for a value that does not decode to UTF-8. Names are
/// compared decoded, so `%5Fmethod` is `_method`.
fn query_values<'a>(query: &'a str, name: &'a str) -> impl Iterator<Item = Option<String>> + 'a {
    let decode = |s: &str| {
        key::percent_decode(&s.replace('+', " "))
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
    };
    // Most queries name no `_method` in any spelling: skip the decoding.
    let maybe = query.contains(name) || query.contains('%');
    query
        .split('&')
        .filter(move |_| maybe)
        .filter_map(move |pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k).as_deref() == Some(name)).then(|| decode(v))
        })
}

/// A form body (`application/x-www-form-urlencoded` or
/// `multipart/form-data`), where frameworks also read `_method`.
fn is_form(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONTENT_TYPE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| {
            let t = v.split(';').next().unwrap_or("").trim();
            t.eq_ignore_ascii_case("application/x-www-form-urlencoded")
                || t.eq_ignore_ascii_case("multipart/form-data")
        })
}

fn is_copy_or_move(method: &Method, headers: &HeaderMap, query: Option<&str>) -> bool {
    let named = |m: &str| m.eq_ignore_ascii_case("COPY") || m.eq_ignore_ascii_case("MOVE");
    named(method.as_str())
        || OVERRIDE_HEADERS
            .iter()
            .flat_map(|h| headers.get_all(*h))
            .any(|v| v.to_str().is_ok_and(|m| named(m.trim())))
        || query_values(query.unwrap_or(""), "_method").any(|m| m.is_some_and(|m| named(m.trim())))
}

/// Refuses message framing that two HTTP implementations could read two
/// ways (request smuggling): both Content-Length and Transfer-Encoding,
/// several Content-Length headers, or a transfer coding other than exactly
/// `chunked`. The parser accepts some of these; a proxy must not.
fn check_framing(method: &Method, headers: &HeaderMap) -> Result<(), ProxyError> {
    let bad = |why: &str| ProxyError::BadFraming(why.to_string());
    // The upstream client drops a chunked body on GET and HEAD: refused
    // rather than silently lost.
    if matches!(*method, Method::GET | Method::HEAD)
        && headers.contains_key(header::TRANSFER_ENCODING)
    {
        return Err(bad("a chunked body on GET or HEAD"));
    }
    let lengths = headers.get_all(header::CONTENT_LENGTH).iter().count();
    if lengths > 1 {
        return Err(bad("more than one Content-Length header"));
    }
    let mut codings = headers.get_all(header::TRANSFER_ENCODING).iter().peekable();
    if codings.peek().is_some() {
        if lengths > 0 {
            return Err(bad("both Content-Length and Transfer-Encoding"));
        }
        let all: Vec<&[u8]> = codings.map(|v| v.as_bytes()).collect();
        if all.len() != 1 || !all[0].trim_ascii().eq_ignore_ascii_case(b"chunked") {
            return Err(bad("Transfer-Encoding other than a single `chunked`"));
        }
    }
    Ok(())
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Removes hop-by-hop headers, including those named in `Connection`
/// (except the fence token and `keep`, which are end to end here).
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep: Option<&HeaderName>) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        // The fence token is end to end even if a client lists it.
        if *name != FENCE_TOKEN && Some(name) != keep {
            headers.remove(name);
        }
    }
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

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

pin_project_lite::pin_project! {
    /// The request body on its way upstream: enforces the size limit, the
    /// body read timeout and the write's deadline, and keeps the write in
    /// flight until the last byte has been handed to the upstream
    /// connection.
    struct GuardedBody {
        #[pin]
        inner: Incoming,
        // A write's deadline: its body is cut there, even after the
        // upstream answered early, so it cannot outlive its permit.
        cutoff: Option<tokio::time::Instant>,
        hold: Option<Arc<InFlight>>,
        limit: Option<u64>,
        seen: u64,
        idle: Duration,
        #[pin]
        timer: Option<tokio::time::Sleep>,
        state: Arc<AtomicU8>,
    }
}

/// Ends a write's body at its deadline: the upstream exchange fails (and its
/// connection is dropped) and the write stops holding its keys.
fn cut(
    state: &AtomicU8,
    hold: &mut Option<Arc<InFlight>>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    state.store(BODY_DEADLINE, Ordering::Release);
    *hold = None;
    Poll::Ready(Some(Err("the write's deadline passed mid-body".into())))
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        match this.inner.as_mut().poll_frame(cx) {
            Poll::Pending => {
                if this.timer.is_none() {
                    // One timer: the idle limit or the deadline, whichever
                    // comes first.
                    let idle = tokio::time::Instant::now() + *this.idle;
                    let at = this.cutoff.map_or(idle, |c| c.min(idle));
                    this.timer.set(Some(tokio::time::sleep_until(at)));
                }
                if let Some(t) = this.timer.as_mut().as_pin_mut() {
                    if std::future::Future::poll(t, cx).is_ready() {
                        if this
                            .cutoff
                            .is_some_and(|c| tokio::time::Instant::now() >= c)
                        {
                            return cut(this.state, this.hold);
                        }
                        this.state.store(BODY_TIMEOUT, Ordering::Release);
                        *this.hold = None;
                        return Poll::Ready(Some(Err("request body read timed out".into())));
                    }
                }
                Poll::Pending
            }
            Poll::Ready(None) => {
                *this.hold = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.state.store(BODY_MALFORMED, Ordering::Release);
                *this.hold = None;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.timer.set(None);
                if this
                    .cutoff
                    .is_some_and(|c| tokio::time::Instant::now() >= c)
                {
                    return cut(this.state, this.hold);
                }
                if let Some(data) = frame.data_ref() {
                    *this.seen += data.len() as u64;
                    if this.limit.is_some_and(|l| *this.seen > l) {
                        this.state.store(BODY_TOO_LARGE, Ordering::Release);
                        *this.hold = None;
                        return Poll::Ready(Some(Err("request body exceeds the limit".into())));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_the_prefix_and_the_counter_in_hex() {
        for n in [0, 1, 15, 16, 255, 4096, 0xdead_beef, u64::MAX - 1, u64::MAX] {
            let id = request_id("0123456789abcdef", n);
            assert_eq!(id.to_str().unwrap(), format!("0123456789abcdef-{n:x}"));
        }
    }

    #[test]
    fn forwarded_items_follow_the_client_and_the_scheme() {
        let v4: std::net::IpAddr = "192.0.2.7".parse().unwrap();
        let v6: std::net::IpAddr = "2001:db8::1".parse().unwrap();
        // Twice each, so that the per-thread entry is both made and reused,
        // and replaced when the client or the scheme changes.
        for _ in 0..2 {
            for (ip, proto, xff, fwd) in [
                (v4, "http", "192.0.2.7", "for=192.0.2.7;proto=http"),
                (v4, "https", "192.0.2.7", "for=192.0.2.7;proto=https"),
                (
                    v6,
                    "http",
                    "2001:db8::1",
                    "for=\"[2001:db8::1]\";proto=http",
                ),
            ] {
                for _ in 0..2 {
                    let (x, f) = forwarded_values(ip, proto);
                    assert_eq!((x.to_str().unwrap(), f.to_str().unwrap()), (xff, fwd));
                }
            }
        }
    }
}
