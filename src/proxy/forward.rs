//! Forwarding an admitted write or a read: the headers added and removed on
//! the way (hop-by-hop, `X-Forwarded-For`, `Forwarded`, request ids), the
//! request body guarded by its limits and its write's deadline, and the
//! exchange with the route's [`Upstream`].

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio_util::either::Either;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tokio_util::task::TaskTracker;

use crate::error::{BoxError, ProxyBody, ProxyError};
use crate::key::{CanonicalPath, KeyError};
use crate::token::FENCE_TOKEN;
use crate::upstream::Delivery;

use super::body::RequestBody;
use super::classify::*;
use super::context::*;
use super::linger::*;
use super::state::*;
use super::table::*;

/// Hop-by-hop headers (RFC 9110 section 7.6.1), plus `Expect`, which the
/// proxy answers itself, and `Proxy-Connection`, a common non-standard one.
pub(super) const HOP_BY_HOP: [HeaderName; 9] = [
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

/// A write's upstream exchange, polled on the request's own task. If that
/// task is dropped first (the client went away, the drain's grace ran out),
/// the rest of the exchange moves to a task of its own, so the write still
/// ends by its deadline.
///
/// The exchange counts in the drain's tracker from its start, not from the
/// move: an HTTP/2 stream's task belongs to no connection tracker, and may
/// be dropped after the drain has stopped waiting for connections.
pub(super) struct Detached<T: Send + 'static> {
    exchange: Option<Pin<Box<dyn std::future::Future<Output = T> + Send>>>,
    token: Option<TaskTrackerToken>,
}

/// The exchange panicked; the request is answered 502 rather than losing
/// its connection.
#[derive(Debug)]
pub(super) struct Panicked;

impl<T: Send + 'static> Detached<T> {
    pub(super) fn new(
        exchange: impl std::future::Future<Output = T> + Send + 'static,
        tracker: &TaskTracker,
    ) -> Self {
        Self {
            exchange: Some(Box::pin(exchange)),
            token: Some(tracker.token()),
        }
    }
}

impl<T: Send + 'static> std::future::Future for Detached<T> {
    type Output = Result<T, Panicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let exchange = self.exchange.as_mut().expect("polled after completion");
        let polled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| exchange.as_mut().poll(cx)));
        let out = match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(out)) => Ok(out),
            Err(_) => Err(Panicked),
        };
        self.exchange = None;
        self.token = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        let Some(exchange) = self.exchange.take() else {
            return;
        };
        // Dropped off a runtime (it is being torn down) or while unwinding:
        // nothing can run it; its permits are released as it drops.
        if std::thread::panicking() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let token = self.token.take();
            rt.spawn(async move {
                let _ = exchange.await;
                drop(token);
            });
        }
    }
}

/// Why a relayed request body failed; read after the upstream call errors.
pub(super) const BODY_OK: u8 = 0;

pub(super) const BODY_TOO_LARGE: u8 = 1;

pub(super) const BODY_TIMEOUT: u8 = 2;

pub(super) const BODY_MALFORMED: u8 = 3;

/// The write's deadline passed while its body was still being sent.
pub(super) const BODY_DEADLINE: u8 = 4;

/// Appends the client to `X-Forwarded-For` (as nginx's
/// `$proxy_add_x_forwarded_for` does) and to `Forwarded` (RFC 7239), and
/// sets `X-Forwarded-Proto` to this hop's scheme: a client's own value is
/// replaced, since a client on the plain port could claim `https`.
pub(super) fn add_forwarded(headers: &mut HeaderMap, peer: Peer) {
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
pub(super) fn forwarded_values(
    ip: std::net::IpAddr,
    proto: &'static str,
) -> (HeaderValue, HeaderValue) {
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

/// Removes hop-by-hop headers, including those named in `Connection`
/// (except the fence token and `keep`, which are end to end here).
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep: Option<&HeaderName>) {
    // Most messages carry none: one pass over the names (standard names
    // compare as numbers) saves nine removals that each hash.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
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

/// A WebSocket tunnel with no bytes either way for this long is closed
/// (nginx's `proxy_read_timeout` default): WebSocket clients and servers
/// ping more often than that, and a peer that vanished without a close
/// must not hold two descriptors for ever.
pub(super) const TUNNEL_IDLE: Duration = Duration::from_secs(60);

/// Joins the two upgraded connections of a WebSocket handshake and copies
/// bytes both ways until both sides have closed, or [`TUNNEL_IDLE`] passes
/// with nothing sent. Nothing in it is fenced: the messages are the
/// backend's to check. It holds one of the proxy's tunnel permits, and
/// ends with its connections (or the process).
fn tunnel(
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    route: String,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    tokio::spawn(async move {
        let _permit = permit;
        let (client, upstream) = match tokio::try_join!(client, upstream) {
            Ok(both) => both,
            Err(e) => {
                tracing::debug!(route, error = %e, "WebSocket upgrade failed");
                return;
            }
        };
        let start = tokio::time::Instant::now();
        let last = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut client = Touching {
            io: hyper_util::rt::TokioIo::new(client),
            start,
            last: last.clone(),
        };
        let mut upstream = Touching {
            io: hyper_util::rt::TokioIo::new(upstream),
            start,
            last: last.clone(),
        };
        let idle = async {
            loop {
                let at = start + Duration::from_millis(last.load(Ordering::Relaxed)) + TUNNEL_IDLE;
                if tokio::time::Instant::now() >= at {
                    return;
                }
                tokio::time::sleep_until(at).await;
            }
        };
        tokio::select! {
            copied = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
                if let Err(e) = copied {
                    tracing::debug!(route, error = %e, "WebSocket tunnel ended");
                }
            }
            () = idle => tracing::debug!(route, "WebSocket tunnel closed: idle"),
        }
    });
}

pin_project_lite::pin_project! {
    /// One side of a tunnel: notes when it last read anything.
    struct Touching<T> {
        #[pin]
        io: T,
        start: tokio::time::Instant,
        last: Arc<std::sync::atomic::AtomicU64>,
    }
}

impl<T: tokio::io::AsyncRead> tokio::io::AsyncRead for Touching<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let polled = this.io.poll_read(cx, buf);
        if buf.filled().len() > before {
            let ms = this.start.elapsed().as_millis() as u64;
            this.last.store(ms, Ordering::Relaxed);
        }
        polled
    }
}

impl<T: tokio::io::AsyncWrite> tokio::io::AsyncWrite for Touching<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_shutdown(cx)
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

pin_project_lite::pin_project! {
    /// The request body on its way upstream: enforces the size limit, the
    /// body read timeout and the write's deadline, and keeps the write in
    /// flight until the last byte has been handed to the upstream
    /// connection.
    struct GuardedBody {
        #[pin]
        inner: RequestBody,
        // A write's deadline: its body is cut there, even after the
        // upstream answered early, so it cannot outlive its permit.
        cutoff: Option<tokio::time::Instant>,
        hold: Option<BodyHold>,
        limit: Option<u64>,
        seen: u64,
        // The request's content-length. Its last byte is held back until
        // the stream is seen to end: over HTTP/2 a client may still reset
        // the stream after sending every declared byte, and a backend
        // framed by content-length would take what it got as complete.
        declared: Option<u64>,
        held: Option<Bytes>,
        ended: bool,
        // An HTTP/2 request: its body ends with END_STREAM, and nothing
        // else (see the end of `poll_frame`).
        h2: bool,
        idle: Duration,
        #[pin]
        timer: Option<tokio::time::Sleep>,
        state: Arc<AtomicU8>,
    }
}

/// Ends a write's body at its deadline: the upstream exchange fails (and its
/// connection is dropped) and the write stops holding its keys.
pub(super) fn cut(
    state: &AtomicU8,
    hold: &mut Option<BodyHold>,
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
        if *this.ended {
            *this.hold = None;
            return Poll::Ready(None);
        }
        loop {
            return match this.inner.as_mut().poll_frame(cx) {
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
                    // hyper reads an HTTP/2 RST_STREAM(NO_ERROR) as the
                    // body's clean end (RFC 9113 section 8.1 allows it to a
                    // server that answered early), whether END_STREAM came
                    // or not. From a client, a reset before END_STREAM
                    // abandons the request: the body is cut, even with every
                    // declared byte sent (the last one is still held) or
                    // no length declared, so the backend never sees it end.
                    let reset = *this.h2 && !this.inner.is_end_stream();
                    if reset || this.declared.is_some_and(|d| *this.seen < d) {
                        this.state.store(BODY_MALFORMED, Ordering::Release);
                        *this.hold = None;
                        *this.held = None;
                        return Poll::Ready(Some(Err(if reset {
                            "the client reset its HTTP/2 stream before the request body's end"
                        } else {
                            "the request body ended before its declared length"
                        }
                        .into())));
                    }
                    *this.ended = true;
                    if let Some(last) = this.held.take() {
                        return Poll::Ready(Some(Ok(Frame::data(last))));
                    }
                    *this.hold = None;
                    Poll::Ready(None)
                }
                Poll::Ready(Some(Err(e))) => {
                    this.state.store(BODY_MALFORMED, Ordering::Release);
                    *this.hold = None;
                    *this.held = None;
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
                    let Ok(data) = frame.into_data() else {
                        // Request trailers are not forwarded: they would carry
                        // headers (a token, a key header) no check has read.
                        continue;
                    };
                    *this.seen += data.len() as u64;
                    if this.limit.is_some_and(|l| *this.seen > l) {
                        this.state.store(BODY_TOO_LARGE, Ordering::Release);
                        *this.hold = None;
                        return Poll::Ready(Some(Err("request body exceeds the limit".into())));
                    }
                    if this.declared.is_some_and(|d| *this.seen >= d) && this.held.is_none() {
                        *this.held = Some(data);
                        continue;
                    }
                    Poll::Ready(Some(Ok(Frame::data(data))))
                }
            };
        }
    }

    fn is_end_stream(&self) -> bool {
        // Not while the last chunk is held, nor while a body short of its
        // declared length has yet to be seen to fail.
        self.held.is_none()
            && (self.ended
                || (self.inner.is_end_stream() && self.declared.is_none_or(|d| self.seen >= d)))
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Proxy {
    pub(super) async fn forward(
        &self,
        rt: &RouteRuntime,
        req: Request<RequestBody>,
        path: &CanonicalPath,
        mut hold: Option<WriteHold>,
        ctx: &mut RequestContext,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let peer = ctx.peer;
        let route = &rt.route;
        let (mut parts, body) = req.into_parts();
        // The client's side of a WebSocket tunnel, if the upstream agrees,
        // and its place among the tunnels, taken before anything is sent.
        let client_upgrade = ctx
            .websocket
            .then(|| parts.extensions.remove::<hyper::upgrade::OnUpgrade>())
            .flatten();
        let tunnel_permit = match client_upgrade {
            Some(_) => Some(
                self.tunnels
                    .clone()
                    .try_acquire_owned()
                    .map_err(|_| ProxyError::TooManyTunnels)?,
            ),
            None => None,
        };
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
        let upgrade = headers.get(header::UPGRADE).cloned();
        // `TE: trailers`: the one `TE` an HTTP/2 hop may carry (RFC 9113
        // section 8.2.2), saying the client reads trailers; gRPC needs it.
        let trailers = lists_token(&headers, header::TE, "trailers");
        strip_hop_by_hop(&mut headers, key_header);
        if trailers {
            // Alone, whatever else the client listed; the pool drops it
            // again for an HTTP/1.1 upstream (`upstream::h1_form`).
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        if let (Some(upgrade), Some(_)) = (upgrade, &client_upgrade) {
            // The handshake's own hop-by-hop headers go on: the upstream
            // must see the request it is asked to upgrade.
            headers.insert(header::UPGRADE, upgrade);
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        if route.strip_token {
            headers.remove(&FENCE_TOKEN);
        }
        if ctx.forwarded_untrusted {
            // Anyone not in `trusted_proxies` could name any client.
            for name in [&X_FORWARDED_FOR, &header::FORWARDED, &X_FORWARDED_PROTO] {
                headers.remove(name);
            }
        }
        if route.forwarded_headers {
            if let Some(peer) = peer {
                add_forwarded(&mut headers, peer);
            }
        }
        if !headers.contains_key(header::HOST) {
            // HTTP/2's `:authority` (or an absolute-form target) names the
            // host; a request with neither (HTTP/1.0 without `Host`, as
            // HAProxy's default health check is) gets the upstream's own
            // authority, as nginx sends it: many backends answer 400 to a
            // request without one.
            let auth = parts.uri.authority().unwrap_or(&route.upstream.authority);
            if let Ok(v) = HeaderValue::from_str(auth.as_str()) {
                headers.insert(header::HOST, v);
            }
        }
        // A write ends by its permit's deadline, exchange and body alike:
        // newer writes to its keys wait for it no longer than that.
        let deadline = hold.as_ref().map_or_else(
            || tokio::time::Instant::now() + route.upstream_timeout,
            WriteHold::deadline,
        );
        // A whole body read by the own lane goes to a plain HTTP/1.1
        // upstream as bytes, on this task (`upstream::h1`).
        let wire = match &body {
            RequestBody::Whole(bytes) if rt.upstream.speaks_plain_h1() => {
                let bytes = bytes.as_deref().unwrap_or_default();
                // `te: trailers` is an HTTP/2 hop's header (`upstream::h1_form`).
                headers.remove(header::TE);
                let mut wire = Vec::with_capacity(512 + bytes.len());
                crate::h1::write_request_head(
                    &mut wire,
                    &parts.method,
                    path.upstream_target.as_str(),
                    &headers,
                );
                wire.extend_from_slice(bytes);
                Some((wire, parts.method == http::Method::HEAD))
            }
            _ => None,
        };
        let body_state = Arc::new(AtomicU8::new(BODY_OK));
        let send = match wire {
            Some(wire) => Either::Left(wire),
            None => Either::Right({
                let body = GuardedBody {
                    inner: body,
                    cutoff: hold.as_ref().map(WriteHold::deadline),
                    hold: hold.as_mut().map(WriteHold::body_share),
                    limit: self.limits.max_body_bytes,
                    seen: 0,
                    declared: content_length(&headers),
                    held: None,
                    ended: false,
                    h2: parts.version == http::Version::HTTP_2,
                    idle: self.limits.body_read_timeout,
                    timer: None,
                    state: body_state.clone(),
                };
                let mut up = Request::new(body.boxed());
                *up.method_mut() = parts.method;
                *up.uri_mut() = uri;
                *up.headers_mut() = headers;
                up
            }),
        };

        let started = Instant::now();
        let upstream = rt.upstream.clone();
        let write = ctx.write;
        let exchange = async move {
            let result = match send {
                Either::Left((wire, to_head)) => {
                    tokio::time::timeout_at(deadline, upstream.send_wire(&wire, to_head)).await
                }
                Either::Right(up) => {
                    tokio::time::timeout_at(deadline, upstream.send(up, write)).await
                }
            };
            if let Some(hold) = hold {
                // A 408 may not answer this write at all: it may still be
                // applied, so its keys stay held to its deadline.
                let ambiguous =
                    matches!(&result, Ok(Ok(r)) if crate::upstream::retires_connection(r.status()));
                // An early answer, with the body still being sent: its last
                // byte handed over is not a byte the backend has, so the
                // write holds its keys until its connection has settled
                // (`upstream/kill.rs`), by its deadline.
                let early = hold.body_holds();
                let delivery = match &result {
                    Ok(Ok(r)) if early => r.extensions().get::<Delivery>().cloned(),
                    _ => None,
                };
                if let Some(delivery) = delivery {
                    let settled = upstream.settle(delivery, deadline);
                    hold.release_after(async move {
                        settled.await;
                        if ambiguous {
                            tokio::time::sleep_until(deadline).await;
                        }
                    });
                } else if ambiguous || early {
                    hold.release_at_deadline(ambiguous);
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
            Detached::new(exchange, &self.exchanges)
                .await
                .map_err(|Panicked| ProxyError::Upstream("the upstream exchange panicked".into()))?
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
                let kind = match &e {
                    crate::upstream::UpstreamError::Queue { .. } => "queue",
                    e if e.is_connect() => "connect",
                    _ => "other",
                };
                self.metrics
                    .upstream_errors
                    .with_label_values(&[&route.name, kind])
                    .inc();
                if let crate::upstream::UpstreamError::Queue { waited, .. } = e {
                    // Not sent: the write's keys are free at once, and the
                    // client may retry (Retry-After).
                    return Err(ProxyError::UpstreamBusy(waited));
                }
                let detail = crate::error::error_chain(&e);
                return Err(if e.is_connect() {
                    ProxyError::UpstreamConnect(detail)
                } else {
                    ProxyError::Upstream(detail)
                });
            }
            Ok(Ok(resp)) => resp,
        };
        let mut resp = resp;
        if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS && client_upgrade.is_none() {
            // A backend that switches protocols unasked would leave the
            // client speaking HTTP to something else.
            return Err(ProxyError::Upstream(
                "the upstream answered 101 to a request that asked for no upgrade".into(),
            ));
        }
        let upgrade = resp.headers().get(header::UPGRADE).cloned();
        strip_hop_by_hop(resp.headers_mut(), None);
        // The answer goes out in the client's protocol, not the upstream's:
        // hyper's server writes the version it is given, and an HTTP/1.0
        // upstream's answer of unknown length would reach an HTTP/1.1
        // client close-delimited, where a cut body ends as cleanly as a
        // whole one. (hyper answers an HTTP/1.0 client in HTTP/1.0 all the
        // same; HTTP/2 has no version on the wire.)
        *resp.version_mut() = http::Version::HTTP_11;
        if let (Some(client), Some(upgrade), http::StatusCode::SWITCHING_PROTOCOLS) =
            (client_upgrade, upgrade, resp.status())
        {
            resp.headers_mut().insert(header::UPGRADE, upgrade);
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            if let Some(permit) = tunnel_permit {
                tunnel(
                    client,
                    hyper::upgrade::on(&mut resp),
                    route.name.clone(),
                    permit,
                );
            }
        }
        Ok(resp)
    }
}
