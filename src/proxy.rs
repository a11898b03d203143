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

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::config::{Config, Limits, Route};
use crate::error::{BoxError, ProxyBody, ProxyError};
use crate::fence::{Fence, FenceError, Permit};
use crate::key::{self, CanonicalPath, KeyError};
use crate::metrics::Metrics;
use crate::token::{token_from_headers, FENCE_TOKEN};

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

type UpstreamClient = Client<HttpConnector, ProxyBody>;

/// A route with its upstream connection pool.
struct RouteRuntime {
    route: Route,
    client: UpstreamClient,
}

/// The request handler shared by every connection.
pub struct Proxy {
    routes: Vec<RouteRuntime>,
    fence: Arc<Fence>,
    metrics: Arc<Metrics>,
    limits: Limits,
}

/// Why a relayed request body failed; read after the upstream call errors.
const BODY_OK: u8 = 0;
const BODY_TOO_LARGE: u8 = 1;
const BODY_TIMEOUT: u8 = 2;

impl Proxy {
    pub fn new(config: &Config, fence: Arc<Fence>, metrics: Arc<Metrics>) -> Self {
        let mut routes: Vec<RouteRuntime> = config
            .routes
            .iter()
            .map(|route| {
                let mut connector = HttpConnector::new();
                connector.set_connect_timeout(Some(route.connect_timeout));
                connector.set_nodelay(true);
                let client = Client::builder(TokioExecutor::new())
                    // A write must never be sent twice.
                    .retry_canceled_requests(false)
                    // Host is relayed as the client sent it.
                    .set_host(false)
                    .pool_idle_timeout(Duration::from_secs(30))
                    .build(connector);
                RouteRuntime {
                    route: route.clone(),
                    client,
                }
            })
            .collect();
        // Most specific first: a host-specific route before a catch-all host,
        // then the longest prefix.
        routes.sort_by_key(|r| {
            (
                r.route.host.is_none(),
                std::cmp::Reverse(r.route.path_prefix.trim_end_matches('/').len()),
            )
        });
        Self {
            routes,
            fence,
            metrics,
            limits: config.limits.clone(),
        }
    }

    fn find_route(
        &self,
        host: Option<&str>,
        path: &str,
        literal_only: bool,
    ) -> Option<&RouteRuntime> {
        self.routes.iter().find(|r| {
            (!literal_only || r.route.literal_keys)
                && r.route.host.as_deref().is_none_or(|h| Some(h) == host)
                && r.route.matches_path(path)
        })
    }

    /// Serves one request. Never fails: every error becomes an answer.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let mut ctx = RequestContext::default();
        let resp = match self.serve(req, &mut ctx).await {
            Ok(resp) => resp,
            Err(err) => self.refuse(err, &ctx),
        };
        let route = ctx.route.as_deref().unwrap_or("-");
        self.metrics
            .requests
            .with_label_values(&[
                route,
                if ctx.write { "write" } else { "read" },
                resp.status().as_str(),
            ])
            .inc();
        Ok(resp)
    }

    fn refuse(&self, err: ProxyError, ctx: &RequestContext) -> Response<ProxyBody> {
        let route = ctx.route.as_deref().unwrap_or("-");
        if ctx.write {
            let decision = match &err {
                ProxyError::Token(crate::token::TokenError::Missing) => Some("missing_token"),
                ProxyError::Token(_) => Some("malformed_token"),
                ProxyError::Stale { .. } => Some("stale"),
                ProxyError::BadTarget(_) => Some("bad_key"),
                ProxyError::Recovering { .. } => Some("recovering"),
                ProxyError::StoreUnavailable(_) => Some("store_error"),
                _ => None,
            };
            if let Some(d) = decision {
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
        req: Request<Incoming>,
        ctx: &mut RequestContext,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        ctx.method = req.method().to_string();
        if req.method() == Method::CONNECT {
            return Err(ProxyError::MethodNotAllowed("CONNECT".into()));
        }
        let host_header = req
            .headers()
            .get(header::HOST)
            .map(|h| {
                h.to_str()
                    .map_err(|_| ProxyError::BadRequest("the Host header is not ASCII".into()))
            })
            .transpose()?;
        key::check_authority(req.uri(), host_header).map_err(ProxyError::BadTarget)?;
        let host = req
            .uri()
            .host()
            .or_else(|| host_header.map(strip_port))
            .map(str::to_ascii_lowercase);
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());

        // One parse decides the route, the key and the upstream target.
        let canonical = key::canonicalize(&target);
        let (rt, path) = match &canonical {
            Ok(c) => {
                let rt = self
                    .find_route(host.as_deref(), &c.key_path, false)
                    .ok_or(ProxyError::NoRoute)?;
                if rt.route.literal_keys {
                    (rt, key::literal(&target).map_err(ProxyError::BadTarget)?)
                } else {
                    (rt, c.clone())
                }
            }
            Err(e) => {
                let raw_path = target.split('?').next().unwrap_or("/");
                match self.find_route(host.as_deref(), raw_path, true) {
                    Some(rt) => (rt, key::literal(&target).map_err(ProxyError::BadTarget)?),
                    None => {
                        ctx.write = true; // unknown route: assume the worst for logging
                        return Err(ProxyError::BadTarget(e.clone()));
                    }
                }
            }
        };
        let route = &rt.route;
        ctx.route = Some(route.name.clone());
        ctx.write = self.is_write(route, req.method(), req.headers())?;
        let _in_flight = GaugeGuard::new(self.metrics.in_flight.with_label_values(&[&route.name]));

        if !ctx.write {
            if req.headers().contains_key(&FENCE_TOKEN) {
                self.metrics
                    .read_tokens_ignored
                    .with_label_values(&[&route.name])
                    .inc();
            }
            return self.forward(rt, req, &path, Vec::new()).await;
        }

        // Writes: everything that can be refused is checked before anything
        // is forwarded.
        let mut keys = vec![self.fence_key(route, &path, req.headers())?];
        ctx.key = Some(keys[0].clone());
        if is_copy_or_move(req.method(), req.headers()) {
            if let Some(dest) = req.headers().get("destination") {
                keys.push(self.destination_key(rt, dest, host.as_deref(), req.headers())?);
            }
        }
        if let (Some(limit), Some(len)) =
            (self.limits.max_body_bytes, content_length(req.headers()))
        {
            if len > limit {
                return Err(ProxyError::BodyTooLarge { limit });
            }
        }
        let token = token_from_headers(req.headers()).map_err(ProxyError::Token)?;

        let started = Instant::now();
        keys.sort();
        keys.dedup();
        let mut permits = Vec::with_capacity(keys.len());
        for key in &keys {
            ctx.key = Some(key.clone());
            match self.fence.admit(key, token, route.upstream_timeout).await {
                Ok(p) => {
                    if p.waited_out {
                        self.metrics
                            .admission_waited_out
                            .with_label_values(&[&route.name])
                            .inc();
                    }
                    permits.push(Arc::new(p));
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
            }
        }
        ctx.key = keys.first().cloned();
        self.metrics.store_up.set(1);
        self.metrics
            .admission_wait
            .with_label_values(&[&route.name])
            .observe(started.elapsed().as_secs_f64());
        self.metrics
            .writes
            .with_label_values(&[&route.name, "admitted"])
            .inc();
        tracing::debug!(route = %route.name, key = ctx.key.as_deref().unwrap_or("-"), token, "admitted write");
        self.forward(rt, req, &path, permits).await
    }

    /// A request is a write if its method is, or if a method-override header
    /// names a write method (so a GET overridden to DELETE is fenced).
    fn is_write(
        &self,
        route: &Route,
        method: &Method,
        headers: &HeaderMap,
    ) -> Result<bool, ProxyError> {
        let mut write = route.write_methods.is_write(method.as_str());
        for name in OVERRIDE_HEADERS {
            for value in headers.get_all(name) {
                let m = value
                    .to_str()
                    .ok()
                    .map(str::trim)
                    .filter(|m| !m.is_empty() && Method::from_bytes(m.as_bytes()).is_ok())
                    .ok_or_else(|| {
                        ProxyError::BadRequest(format!("{name} does not name a method"))
                    })?;
                write |= route.write_methods.is_write(m);
            }
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
        Ok(format!("{}:{}", route.namespace, text))
    }

    /// The key of a COPY/MOVE `Destination`, parsed like a request target of
    /// the same route. A destination on another host or route is refused:
    /// this proxy could not fence it.
    fn destination_key(
        &self,
        rt: &RouteRuntime,
        dest: &HeaderValue,
        host: Option<&str>,
        headers: &HeaderMap,
    ) -> Result<String, ProxyError> {
        let bad = |why: &str| ProxyError::BadRequest(format!("Destination header: {why}"));
        let text = dest.to_str().map_err(|_| bad("not ASCII"))?;
        let uri: Uri = text.parse().map_err(|_| bad("not a URI"))?;
        if let Some(h) = uri.host() {
            if Some(h.to_ascii_lowercase().as_str()) != host {
                return Err(bad("names another host"));
            }
        }
        let target = uri.path_and_query().map_or("/", |p| p.as_str());
        let path = if rt.route.literal_keys {
            key::literal(target)
        } else {
            key::canonicalize(target)
        }
        .map_err(ProxyError::BadTarget)?;
        match self.find_route(host, &path.key_path, false) {
            Some(other) if std::ptr::eq(other, rt) => {}
            _ => return Err(bad("is not served by the same route")),
        }
        self.fence_key(&rt.route, &path, headers)
    }

    async fn forward(
        &self,
        rt: &RouteRuntime,
        req: Request<Incoming>,
        path: &CanonicalPath,
        permits: Vec<Arc<Permit>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let route = &rt.route;
        let (parts, body) = req.into_parts();
        let uri = Uri::builder()
            .scheme(route.upstream.scheme.clone())
            .authority(route.upstream.authority.clone())
            .path_and_query(path.upstream_target.as_str())
            .build()
            .map_err(|e| ProxyError::BadTarget(KeyError::TemplateMismatch(e.to_string())))?;
        let mut headers = parts.headers;
        strip_hop_by_hop(&mut headers);
        if route.strip_token {
            headers.remove(&FENCE_TOKEN);
        }
        if !headers.contains_key(header::HOST) {
            if let Some(auth) = parts.uri.authority() {
                if let Ok(v) = HeaderValue::from_str(auth.as_str()) {
                    headers.insert(header::HOST, v);
                }
            }
        }
        let body_state = Arc::new(AtomicU8::new(BODY_OK));
        let body = GuardedBody {
            inner: body,
            permits: permits.clone(),
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
        let result = tokio::time::timeout(route.upstream_timeout, rt.client.request(up)).await;
        // The response head is in (or the exchange failed): for ordering,
        // this write is no longer in flight once its body is done too.
        drop(permits);
        self.metrics
            .upstream_latency
            .with_label_values(&[&route.name])
            .observe(started.elapsed().as_secs_f64());
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
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(
            parts,
            body.map_err(|e| Box::new(e) as BoxError).boxed(),
        ))
    }
}

#[derive(Default)]
struct RequestContext {
    route: Option<String>,
    key: Option<String>,
    method: String,
    write: bool,
}

fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_once(']').map_or(host, |(h, _)| &h[1..]);
    }
    host.rsplit_once(':').map_or(host, |(h, _)| h)
}

fn is_copy_or_move(method: &Method, headers: &HeaderMap) -> bool {
    let named = |m: &str| m.eq_ignore_ascii_case("COPY") || m.eq_ignore_ascii_case("MOVE");
    named(method.as_str())
        || OVERRIDE_HEADERS
            .iter()
            .flat_map(|h| headers.get_all(*h))
            .any(|v| v.to_str().is_ok_and(|m| named(m.trim())))
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

/// Removes hop-by-hop headers, including those named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        // The fence token is end to end even if a client lists it.
        if *name != FENCE_TOKEN {
            headers.remove(name);
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
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
    /// The request body on its way upstream: enforces the size limit and the
    /// body read timeout, and keeps the write's permits alive until the last
    /// byte has been handed to the upstream connection.
    struct GuardedBody {
        #[pin]
        inner: Incoming,
        permits: Vec<Arc<Permit>>,
        limit: Option<u64>,
        seen: u64,
        idle: Duration,
        #[pin]
        timer: Option<tokio::time::Sleep>,
        state: Arc<AtomicU8>,
    }
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
                    this.timer.set(Some(tokio::time::sleep(*this.idle)));
                }
                if let Some(t) = this.timer.as_mut().as_pin_mut() {
                    if std::future::Future::poll(t, cx).is_ready() {
                        this.state.store(BODY_TIMEOUT, Ordering::Release);
                        this.permits.clear();
                        return Poll::Ready(Some(Err("request body read timed out".into())));
                    }
                }
                Poll::Pending
            }
            Poll::Ready(None) => {
                this.permits.clear();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.permits.clear();
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.timer.set(None);
                if let Some(data) = frame.data_ref() {
                    *this.seen += data.len() as u64;
                    if this.limit.is_some_and(|l| *this.seen > l) {
                        this.state.store(BODY_TOO_LARGE, Ordering::Release);
                        this.permits.clear();
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
