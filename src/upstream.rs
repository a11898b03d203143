//! Upstream connections of one route: a pool per worker thread, the dial,
//! and one exchange.
//!
//! Each worker keeps its own idle connections. The lock around a worker's
//! pool is only ever taken on that worker's thread (and by the reaper once a
//! few seconds), so it is never contended, and a connection's driver task
//! runs on the worker that dialed it: a request, its upstream connection and
//! the downstream connection share one thread.
//!
//! A request goes out on the most recently used idle connection. One that
//! the upstream closed while it sat idle costs no failed request: a request
//! that was never written goes out on the next connection or a fresh one.
//! A request that may have been written is never sent again; its error is a
//! 502 (a write must not reach the backend twice).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::client::legacy::connect::Connection;
use hyper_util::rt::TokioExecutor;
use tower_service::Service;

use crate::error::{BoxError, ProxyBody};
use crate::tls::UpstreamConnector;

/// Idle connections kept per worker and route; the oldest go first.
const MAX_IDLE: usize = 1024;

/// The upstream of one route, as every worker reaches it.
pub struct Upstream {
    /// Where connections go (`scheme://authority` of the route), whatever
    /// the request's own URI or Host says.
    dial: Uri,
    connector: UpstreamConnector,
    /// One pool per worker thread ([`crate::workers::current`]).
    pools: Box<[Mutex<Pool>]>,
    /// An idle connection older than this is closed, not reused.
    idle_timeout: Duration,
}

#[derive(Default)]
struct Pool {
    /// HTTP/1.1 connections waiting for a request, oldest first.
    h1: VecDeque<(Instant, http1::SendRequest<ProxyBody>)>,
    /// An HTTP/2 connection carries every request of its worker at once.
    h2: Option<http2::SendRequest<ProxyBody>>,
    /// Requests dialing a connection of their own that would take one
    /// coming back first: under a burst a connection freed by a finished
    /// request is usually ready before a new one is, and a dial per waiting
    /// request would storm the upstream.
    waiters: VecDeque<tokio::sync::oneshot::Sender<http1::SendRequest<ProxyBody>>>,
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made (refused, timed out, TLS handshake);
    /// the request was not sent.
    #[error("{0}")]
    Connect(String),
    /// The connection failed once the request may have been sent.
    #[error(transparent)]
    Exchange(#[from] hyper::Error),
}

impl UpstreamError {
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }
}

enum Conn {
    H1(http1::SendRequest<ProxyBody>),
    H2(http2::SendRequest<ProxyBody>),
}

impl Conn {
    /// Resolves when the connection can take a request; fails if it closed.
    async fn ready(&mut self) -> hyper::Result<()> {
        match self {
            Conn::H1(s) => s.ready().await,
            Conn::H2(s) => s.ready().await,
        }
    }
}

/// A 408 may have been sent on an idle connection just as a request went
/// out on it (a server timing the connection out): the answer to that
/// request may still come on the connection. So a 408 retires its
/// connection, and the write it answers may still be applied (the proxy
/// holds its keys until its deadline).
pub fn retires_connection(status: http::StatusCode) -> bool {
    status == http::StatusCode::REQUEST_TIMEOUT
}

impl Upstream {
    pub fn new(
        dial: Uri,
        connector: UpstreamConnector,
        workers: usize,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            dial,
            connector,
            pools: (0..workers.max(1)).map(|_| Mutex::default()).collect(),
            idle_timeout,
        }
    }

    /// Sends `req` (origin-form URI, headers as they go upstream) and
    /// returns the response head; its body returns the connection to this
    /// worker's pool when it ends.
    pub async fn send(
        self: &Arc<Self>,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<ProxyBody>, UpstreamError> {
        let worker = crate::workers::current() % self.pools.len();
        // Each pass takes one idle connection out of the pool or dials a
        // fresh one, which ends the loop.
        loop {
            let (conn, fresh) = match self.checkout(worker) {
                Some(conn) => (conn, false),
                None => self.dial_or_wait(worker).await?,
            };
            let mut conn = conn;
            match &mut conn {
                Conn::H1(_) => h1_form(&mut req),
                Conn::H2(_) => h2_form(&mut req, &self.dial),
            }
            if let Err(e) = conn.ready().await {
                // Closed while idle: nothing was written.
                if fresh {
                    return Err(closed_at_once(e));
                }
                continue;
            }
            let sent = match conn {
                Conn::H1(mut sender) => match sender.try_send_request(req).await {
                    Ok(resp) => {
                        let back = (!retires_connection(resp.status()))
                            .then(|| (self.clone(), worker, sender));
                        return Ok(resp.map(|body| {
                            PooledBody {
                                body,
                                back,
                                ended: false,
                            }
                            .boxed()
                        }));
                    }
                    Err(e) => e,
                },
                Conn::H2(mut sender) => match sender.try_send_request(req).await {
                    Ok(resp) => {
                        return Ok(resp.map(|b| b.map_err(|e| Box::new(e) as BoxError).boxed()))
                    }
                    Err(e) => e,
                },
            };
            let mut e = sent;
            match e.take_message() {
                // Never written: it may go out on another connection.
                Some(back) if !fresh => req = back,
                _ => return Err(UpstreamError::Exchange(e.into_error())),
            }
        }
    }

    /// An idle connection of this worker, newest first, or `None`.
    fn checkout(&self, worker: usize) -> Option<Conn> {
        let mut pool = self.pool(worker);
        if let Some(h2) = &pool.h2 {
            if !h2.is_closed() {
                return Some(Conn::H2(h2.clone()));
            }
            pool.h2 = None;
        }
        let now = Instant::now();
        while let Some((since, sender)) = pool.h1.pop_back() {
            if now.duration_since(since) > self.idle_timeout {
                // Every older one has waited longer still.
                pool.h1.clear();
                break;
            }
            if !sender.is_closed() {
                return Some(Conn::H1(sender));
            }
        }
        None
    }

    /// A fresh connection, or one that another request gives back first
    /// (which counts as reused: a request that finds it closed goes on).
    async fn dial_or_wait(&self, worker: usize) -> Result<(Conn, bool), UpstreamError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut pool = self.pool(worker);
            pool.waiters.retain(|w| !w.is_closed());
            pool.waiters.push_back(tx);
        }
        // Boxed: the dial's state (connector, TLS and HTTP/2 handshakes) is
        // kilobytes, and every request's future would carry it, to be
        // copied as the request moves.
        let dial = Box::pin(self.dial(worker));
        tokio::select! {
            biased;
            Ok(sender) = rx => Ok((Conn::H1(sender), false)),
            dialed = dial => Ok((dialed?, true)),
        }
    }

    fn pool(&self, worker: usize) -> std::sync::MutexGuard<'_, Pool> {
        self.pools[worker]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Dials the route's address and starts the connection's driver on this
    /// worker's runtime. HTTP/2 when TLS negotiated it (only offered when
    /// the route asks for it).
    async fn dial(&self, worker: usize) -> Result<Conn, UpstreamError> {
        let mut connector = self.connector.clone();
        let connect = |e: BoxError| {
            let mut detail = crate::proxy::error_chain(&*e);
            // The error is flattened here: advice on a TLS failure must be
            // found now, while its rustls error is still in the chain.
            if let Some(advice) = crate::tls::advice(&*e) {
                detail.push_str(". What to do: ");
                detail.push_str(&advice);
            }
            UpstreamError::Connect(detail)
        };
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(connect)?;
        let io = connector.call(self.dial.clone()).await.map_err(connect)?;
        let handshake = |e: hyper::Error| {
            UpstreamError::Connect(format!("handshake: {}", crate::proxy::error_chain(&e)))
        };
        if io.connected().is_negotiated_h2() {
            let (sender, conn) = http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(handshake)?;
            // The driver ends when the upstream closes the connection or
            // the last sender is dropped (pool reaped, route reloaded).
            tokio::spawn(conn);
            self.pool(worker).h2 = Some(sender.clone());
            Ok(Conn::H2(sender))
        } else {
            let (sender, conn) = http1::handshake(io).await.map_err(handshake)?;
            tokio::spawn(conn);
            Ok(Conn::H1(sender))
        }
    }

    /// A connection whose response ended. It may still be sending its
    /// request body (the upstream answered early): it goes back to the pool
    /// only once it is ready, so that no request queues behind an upload.
    fn give_back(self: Arc<Self>, worker: usize, mut sender: http1::SendRequest<ProxyBody>) {
        if sender.is_closed() {
            return;
        }
        if !sender.is_ready() {
            // Bounded: an upload the upstream stopped reading does not keep
            // the task (and the connection) past the idle timeout.
            tokio::spawn(async move {
                let ready = tokio::time::timeout(self.idle_timeout, sender.ready()).await;
                if matches!(ready, Ok(Ok(()))) {
                    self.idle_again(worker, sender);
                }
            });
            return;
        }
        self.idle_again(worker, sender);
    }

    fn idle_again(&self, worker: usize, mut sender: http1::SendRequest<ProxyBody>) {
        let now = Instant::now();
        let mut pool = self.pool(worker);
        // A request waiting for a connection takes it at once.
        while let Some(waiter) = pool.waiters.pop_front() {
            match waiter.send(sender) {
                Ok(()) => return,
                Err(back) => sender = back,
            }
        }
        self.reap(&mut pool, now);
        if pool.h1.len() >= MAX_IDLE {
            pool.h1.pop_front();
        }
        pool.h1.push_back((now, sender));
    }

    fn reap(&self, pool: &mut Pool, now: Instant) {
        while let Some((since, sender)) = pool.h1.front() {
            if now.duration_since(*since) <= self.idle_timeout && !sender.is_closed() {
                break;
            }
            pool.h1.pop_front();
        }
    }

    /// Closes the connections that have been idle too long, in every
    /// worker's pool; the server calls this every few seconds so that a
    /// route that went quiet does not hold them open.
    pub fn reap_idle(&self) {
        let now = Instant::now();
        for pool in self.pools.iter() {
            let mut pool = pool
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.reap(&mut pool, now);
            pool.h1.retain(|(_, s)| !s.is_closed());
            if pool.h2.as_ref().is_some_and(http2::SendRequest::is_closed) {
                pool.h2 = None;
            }
        }
    }

    /// Idle HTTP/1.1 connections, all workers together.
    pub fn idle(&self) -> usize {
        self.pools
            .iter()
            .map(|p| {
                p.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .h1
                    .len()
            })
            .sum()
    }
}

/// A fresh connection the upstream closed before it took the request: the
/// request was not sent, as when the connection could not be made.
fn closed_at_once(e: hyper::Error) -> UpstreamError {
    UpstreamError::Connect(format!(
        "the upstream closed a new connection at once: {}",
        crate::proxy::error_chain(&e)
    ))
}

/// Undoes [`h2_form`] for a request that goes out over HTTP/1.1 after all
/// (a retry on another connection): origin form, the authority back in
/// Host.
fn h1_form(req: &mut Request<ProxyBody>) {
    let Some(authority) = req.uri().authority().cloned() else {
        return;
    };
    if !req.headers().contains_key(header::HOST) {
        if let Ok(v) = HeaderValue::from_str(authority.as_str()) {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    let target = req.uri().path_and_query().cloned();
    if let Some(target) = target {
        *req.uri_mut() = Uri::from(target);
    }
}

/// HTTP/2 carries the authority in the request line (`:authority`), not in
/// a Host header: the client's Host becomes it, so the backend sees the
/// name the client used, as it does over HTTP/1.1.
fn h2_form(req: &mut Request<ProxyBody>, dial: &Uri) {
    if req.uri().authority().is_some() {
        return;
    }
    let authority = req
        .headers_mut()
        .remove(header::HOST)
        .and_then(|h: HeaderValue| http::uri::Authority::try_from(h.as_bytes()).ok())
        .or_else(|| dial.authority().cloned());
    let mut parts = req.uri().clone().into_parts();
    parts.scheme = dial.scheme().cloned();
    parts.authority = authority;
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    }
}

/// A response body that returns its HTTP/1.1 connection to the pool once
/// it has been read to the end. A body dropped before its end takes the
/// connection with it (hyper closes it: the rest of the body is unread).
struct PooledBody {
    body: Incoming,
    back: Option<(Arc<Upstream>, usize, http1::SendRequest<ProxyBody>)>,
    ended: bool,
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some((upstream, worker, sender)) = self.back.take() {
            upstream.give_back(worker, sender);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(None) => {
                this.ended = true;
                this.give_back();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.back = None;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            other => other.map_err(|e| Box::new(e) as BoxError),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body with nothing in it (HEAD, 204, 304) may never be polled.
        if self.ended || self.body.is_end_stream() {
            self.give_back();
        }
    }
}
