//! A route's upstream connections: the pool per worker, the dial, and one
//! exchange through hyper (HTTP/1.1, h2 by ALPN, h2c).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::client::legacy::connect::{Connection, HttpInfo};
use hyper_util::rt::TokioExecutor;
use tower_service::Service;

use super::dial::Connector;
use super::error::UpstreamError;
use super::forms::{h1_form, h2_form};
use super::kill::{KillOnCut, KillOnDrop, KillSwitch, Killable};
use super::limit::{Limit, LimitSettings, Permit};
use crate::error::{BoxError, ProxyBody};

/// Idle connections kept per worker and route; the oldest go first.
pub(super) const MAX_IDLE: usize = 1024;

/// The upstream of one route, as every worker reaches it.
pub struct Upstream {
    /// Where connections go (`scheme://authority` of the route), whatever
    /// the request's own URI or Host says.
    pub(super) dial: Uri,
    pub(super) connector: Connector,
    /// One pool per worker thread ([`crate::slot::current`]).
    pub(super) pools: Box<[Mutex<Pool>]>,
    /// An idle connection older than this is closed, not reused.
    pub(super) idle_timeout: Duration,
    /// HTTP/2 from the first byte on a plain connection (h2c with prior
    /// knowledge, RFC 9113 section 3.3): gRPC servers speak nothing else.
    pub(super) h2c: bool,
    /// The cap on this upstream's connections, all workers together.
    pub(super) limit: Limit,
}

/// An idle or busy connection of the own lane, with its permit.
pub(super) struct WireConn {
    pub(super) io: tokio::net::TcpStream,
    pub(super) permit: Permit,
}

#[derive(Default)]
pub(super) struct Pool {
    /// HTTP/1.1 connections waiting for a request, oldest first.
    h1: VecDeque<(Instant, H1)>,
    /// An HTTP/2 connection carries every request of its worker at once.
    h2: Option<H2>,
    /// Requests dialing a connection of their own that would take one
    /// coming back first: under a burst a connection freed by a finished
    /// request is usually ready before a new one is, and a dial per waiting
    /// request would storm the upstream.
    waiters: VecDeque<tokio::sync::oneshot::Sender<H1>>,
    /// The own lane's HTTP/1.1 connections ([`h1`]), oldest first.
    pub(super) wire: VecDeque<(Instant, WireConn)>,
    /// The lane's requests waiting for a connection while the cap is
    /// reached: one given back on this worker goes to the oldest.
    pub(super) wire_waiters: VecDeque<tokio::sync::oneshot::Sender<WireConn>>,
}

/// An HTTP/1.1 connection of hyper's: the handle requests are sent by, its
/// driver task's, to abort it, and its switch ([`Killable`]).
pub(super) struct H1 {
    sender: http1::SendRequest<ProxyBody>,
    driver: tokio::task::AbortHandle,
    kill: Arc<KillSwitch>,
}

/// Aborts a connection's driver task when dropped armed: dropping it drops
/// the socket (reset by `SO_LINGER` 0, `dial.rs`), where hyper would close
/// the connection politely.
struct AbortOnDrop(Option<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(driver) = self.0.take() {
            driver.abort();
        }
    }
}

/// An HTTP/2 connection of hyper's: the handle requests are sent by, and
/// the switch that throws it ([`Killable`]).
#[derive(Clone)]
pub(super) struct H2 {
    sender: http2::SendRequest<ProxyBody>,
    kill: Arc<KillSwitch>,
}

enum Conn {
    H1(H1),
    H2(H2),
}

/// The connection a write went out on, in its response's extensions: a
/// write answered before its body was sent settles it
/// ([`Upstream::settle`]).
#[derive(Clone)]
pub struct Delivery(Arc<KillSwitch>);

/// A 408 may have been sent on an idle connection just as a request went
/// out on it (a server timing the connection out): the answer to that
/// request may still come on the connection. So a 408 retires its
/// connection, and the write it answers may still be applied (the proxy
/// holds its keys until its deadline).
pub fn retires_connection(status: http::StatusCode) -> bool {
    status == http::StatusCode::REQUEST_TIMEOUT
}

/// Whether an answer with `status` to a request that carried a body may
/// have been sent without the body being read: any answer but a success
/// may be an early one (a refusal, 401, 403, 413; a redirect to a login
/// page), and a request written whole into the socket's buffer says
/// nothing of what the upstream read. Such a connection is not reused on
/// either path: an unread body would be read as the next request, and the
/// upstream's answer to what it holds would go to the next request sent
/// there.
pub(super) fn may_leave_body_unread(status: http::StatusCode) -> bool {
    !status.is_success()
}

impl Upstream {
    pub fn new(
        dial: Uri,
        connector: Connector,
        workers: usize,
        idle_timeout: Duration,
        h2c: bool,
        limit: LimitSettings,
    ) -> Self {
        Self {
            dial,
            connector,
            pools: (0..workers.max(1)).map(|_| Mutex::default()).collect(),
            idle_timeout,
            h2c,
            limit: Limit::new(limit),
        }
    }

    /// Sends `req` (origin-form URI, headers as they go upstream) and
    /// returns the response head; its body returns the connection to this
    /// worker's pool when it ends.
    ///
    /// `write`: a fenced write, whose exchange given up on before its
    /// answer takes its HTTP/2 connection with it (see `kill.rs`), and
    /// whose response carries its [`Delivery`].
    pub async fn send(
        self: &Arc<Self>,
        mut req: Request<ProxyBody>,
        write: bool,
    ) -> Result<Response<ProxyBody>, UpstreamError> {
        let worker = crate::slot::current() % self.pools.len();
        let with_body = !req.body().is_end_stream();
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
            // No wait for `ready()` first: a connection that closed while
            // idle hands the request back unsent, just below.
            let sent = match conn {
                Conn::H1(H1 {
                    mut sender,
                    driver,
                    kill,
                }) => {
                    // A request given up on before its answer (its deadline
                    // passed, its client went away) must leave nothing to
                    // be delivered later. Dropped, hyper would close the
                    // connection politely, flushing first: through a
                    // partition that waits for the heal, and the write then
                    // reaches the backend after newer ones. Aborted, its
                    // socket is reset and the kernel discards what it held.
                    let mut given_up = AbortOnDrop(Some(driver.clone()));
                    // A write's body cut after an early answer: the rest
                    // waits in the kernel no longer (`kill.rs`).
                    let req = cut_kills(req, write, &kill);
                    let sent = sender.try_send_request(req).await;
                    given_up.0 = None;
                    match sent {
                        Ok(resp) => {
                            // An upgraded connection (101) is the tunnel's now.
                            let status = resp.status();
                            let reusable = !retires_connection(status)
                                && status != http::StatusCode::SWITCHING_PROTOCOLS
                                && !(with_body && may_leave_body_unread(status));
                            let delivery = write.then(|| Delivery(kill.clone()));
                            let back = reusable.then(|| {
                                let conn = H1 {
                                    sender,
                                    driver,
                                    kill,
                                };
                                (self.clone(), worker, conn)
                            });
                            let mut resp = resp.map(|body| {
                                PooledBody {
                                    body,
                                    back,
                                    ended: false,
                                }
                                .boxed()
                            });
                            if let Some(d) = delivery {
                                resp.extensions_mut().insert(d);
                            }
                            return Ok(resp);
                        }
                        Err(e) => e,
                    }
                }
                Conn::H2(H2 { mut sender, kill }) => {
                    // A write given up on before its answer must leave
                    // nothing to be delivered later: its stream's frames
                    // may be queued whole on the shared connection, so the
                    // connection goes (every stream on it fails), as for
                    // hyper's HTTP/1.1 above. A read given up on only
                    // resets its stream.
                    let mut given_up = KillOnDrop(write.then(|| kill.clone()));
                    let req = cut_kills(req, write, &kill);
                    let sent = sender.try_send_request(req).await;
                    // An error disarms nothing: a local reset of a cut body
                    // can end the exchange before its deadline.
                    if sent.is_ok() {
                        given_up.0 = None;
                    }
                    match sent {
                        Ok(resp) => {
                            let mut resp =
                                resp.map(|b| b.map_err(|e| Box::new(e) as BoxError).boxed());
                            if write {
                                resp.extensions_mut().insert(Delivery(kill));
                            }
                            return Ok(resp);
                        }
                        Err(e) => e,
                    }
                }
            };
            let mut e = sent;
            match e.take_message() {
                // Never written: it may go out on another connection.
                Some(back) if !fresh => req = back,
                // A new connection that closed before it took the request:
                // not sent, as when no connection could be made.
                Some(_) => return Err(closed_at_once(e.into_error())),
                None => return Err(UpstreamError::Exchange(e.into_error())),
            }
        }
    }

    /// An idle connection of this worker, newest first, or `None`.
    fn checkout(&self, worker: usize) -> Option<Conn> {
        let mut pool = self.pool(worker);
        if let Some(h2) = &pool.h2 {
            // A thrown switch closes the connection a moment later; a
            // settling one takes no new stream.
            if !h2.sender.is_closed() && !h2.kill.is_killed() && !h2.kill.is_settling() {
                return Some(Conn::H2(h2.clone()));
            }
            pool.h2 = None;
        }
        let now = Instant::now();
        while let Some((since, conn)) = pool.h1.pop_back() {
            if now.duration_since(since) > self.idle_timeout {
                // Every older one has waited longer still.
                pool.h1.clear();
                break;
            }
            if !conn.sender.is_closed() && !conn.kill.is_settling() {
                return Some(Conn::H1(conn));
            }
        }
        None
    }

    /// A fresh connection, or one that another request gives back first
    /// (which counts as reused: a request that finds it closed goes on).
    /// With the cap reached, it waits for either in the queue.
    async fn dial_or_wait(&self, worker: usize) -> Result<(Conn, bool), UpstreamError> {
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        {
            let mut pool = self.pool(worker);
            pool.waiters.retain(|w| !w.is_closed());
            pool.waiters.push_back(tx);
        }
        let permit = match self.free_permit() {
            Some(permit) => permit,
            None => tokio::select! {
                biased;
                Ok(sender) = &mut rx => return Ok((Conn::H1(sender), false)),
                permit = self.limit.wait() => permit?,
            },
        };
        // Boxed: the dial's state (connector, TLS and HTTP/2 handshakes) is
        // kilobytes, and every request's future would carry it, to be
        // copied as the request moves.
        let dial = Box::pin(self.dial(worker, permit));
        tokio::select! {
            biased;
            Ok(sender) = rx => Ok((Conn::H1(sender), false)),
            dialed = dial => Ok((dialed?, true)),
        }
    }

    /// A permit for a new connection if the cap allows one now, after
    /// closing an idle connection (of any worker) if that is what it
    /// takes: an idle connection is worth less than a waiting request.
    pub(super) fn free_permit(&self) -> Option<Permit> {
        if let Some(permit) = self.limit.try_acquire() {
            return Some(permit);
        }
        // The lane's idle connections release their permit as they drop;
        // hyper's when their driver task ends, a moment later: then the
        // permit reaches this request in the queue.
        self.close_one_idle().then(|| self.limit.try_acquire())?
    }

    /// Closes the oldest idle connection of the first worker that has one.
    fn close_one_idle(&self) -> bool {
        for pool in self.pools.iter() {
            let closed = {
                let mut pool = pool
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match pool.wire.pop_front() {
                    Some((_, conn)) => Some(Idle::Wire(conn)),
                    None => pool.h1.pop_front().map(|(_, s)| Idle::H1(s)),
                }
            };
            // Dropped outside the lock.
            if closed.is_some() {
                return true;
            }
        }
        false
    }

    pub(super) fn pool(&self, worker: usize) -> std::sync::MutexGuard<'_, Pool> {
        self.pools[worker]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Dials the route's address and starts the connection's driver on this
    /// worker's runtime. HTTP/2 when TLS negotiated it (only offered when
    /// the route asks for it), or from the start on an h2c route.
    async fn dial(&self, worker: usize, permit: Permit) -> Result<Conn, UpstreamError> {
        let mut connector = self.connector.clone();
        let connect = |e: BoxError| {
            let mut detail = crate::error::error_chain(&*e);
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
            UpstreamError::Connect(format!("handshake: {}", crate::error::error_chain(&e)))
        };
        let connected = io.connected();
        let addrs = {
            let mut extras = http::Extensions::new();
            connected.get_extras(&mut extras);
            extras
                .get::<HttpInfo>()
                .map(|i| (i.local_addr(), i.remote_addr()))
        };
        let (io, kill) = Killable::new(io, addrs);
        if self.h2c || connected.is_negotiated_h2() {
            let (sender, conn) = http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(handshake)?;
            // The driver ends when the upstream closes the connection or
            // the last sender is dropped (pool reaped, route reloaded); the
            // connection counts against the cap until then.
            tokio::spawn(async move {
                let _ = conn.await;
                drop(permit);
            });
            let h2 = H2 { sender, kill };
            self.pool(worker).h2 = Some(h2.clone());
            Ok(Conn::H2(h2))
        } else {
            let (sender, conn) = http1::handshake(io).await.map_err(handshake)?;
            // Upgrades: a WebSocket route's 101 hands the connection over
            // (a tunnel no longer counts against the cap: tunnels have
            // their own limit).
            let driver = tokio::spawn(async move {
                let _ = conn.with_upgrades().await;
                drop(permit);
            });
            Ok(Conn::H1(H1 {
                sender,
                driver: driver.abort_handle(),
                kill,
            }))
        }
    }

    /// A connection whose response ended. It may still be sending its
    /// request body (the upstream answered early): it goes back to the pool
    /// only once it is ready, so that no request queues behind an upload.
    fn give_back(self: Arc<Self>, worker: usize, mut conn: H1) {
        if conn.sender.is_closed() || conn.kill.is_settling() {
            return;
        }
        if !conn.sender.is_ready() {
            // Bounded: an upload the upstream stopped reading does not keep
            // the task (and the connection) past the idle timeout.
            tokio::spawn(async move {
                let ready = tokio::time::timeout(self.idle_timeout, conn.sender.ready()).await;
                if matches!(ready, Ok(Ok(()))) {
                    self.idle_again(worker, conn);
                }
            });
            return;
        }
        self.idle_again(worker, conn);
    }

    fn idle_again(&self, worker: usize, mut sender: H1) {
        if sender.kill.is_settling() {
            return;
        }
        let now = Instant::now();
        let mut pool = self.pool(worker);
        // A request waiting for a connection takes it at once.
        while let Some(waiter) = pool.waiters.pop_front() {
            match waiter.send(sender) {
                Ok(()) => return,
                Err(back) => sender = back,
            }
        }
        if self.limit.has_waiters() {
            // Requests queue for the cap (maybe on another worker): the
            // connection closes and its permit goes to the oldest of them.
            drop(pool);
            drop(sender);
            return;
        }
        self.reap(&mut pool, now);
        if pool.h1.len() >= MAX_IDLE {
            pool.h1.pop_front();
        }
        pool.h1.push_back((now, sender));
    }

    pub(super) fn reap(&self, pool: &mut Pool, now: Instant) {
        while let Some((since, conn)) = pool.h1.front() {
            if now.duration_since(*since) <= self.idle_timeout && !conn.sender.is_closed() {
                break;
            }
            pool.h1.pop_front();
        }
        while pool
            .wire
            .front()
            .is_some_and(|(since, _)| now.duration_since(*since) > self.idle_timeout)
        {
            pool.wire.pop_front();
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
            pool.h1.retain(|(_, s)| !s.sender.is_closed());
            pool.wire.retain(|(_, conn)| still_idle(&conn.io));
            if pool.h2.as_ref().is_some_and(|h2| {
                h2.sender.is_closed() || h2.kill.is_killed() || h2.kill.is_settling()
            }) {
                pool.h2 = None;
            }
        }
    }

    /// Settles the connection an early-answered write went out on
    /// (`kill.rs`): it takes no new request from now on, and this returns
    /// once nothing the write sent can reach the backend any more, by
    /// `deadline` (the connection is thrown then, with what it held).
    ///
    /// The connection stops taking requests at the call, not when the
    /// future is first polled: the response may be passed on and its
    /// connection given back before a task runs it.
    pub fn settle(
        &self,
        delivery: Delivery,
        deadline: tokio::time::Instant,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let switch = delivery.0;
        switch.begin_settling();
        // hyper lets an HTTP/2 connection go once its last handle is
        // dropped and its streams have ended.
        for pool in self.pools.iter() {
            let mut pool = pool
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if pool
                .h2
                .as_ref()
                .is_some_and(|h2| Arc::ptr_eq(&h2.kill, &switch))
            {
                pool.h2 = None;
            }
        }
        switch.settle(deadline)
    }

    /// Idle HTTP/1.1 connections, all workers together.
    pub fn idle(&self) -> usize {
        self.pools
            .iter()
            .map(|p| {
                let p = p.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                p.h1.len() + p.wire.len()
            })
            .sum()
    }
}

/// What [`Upstream::close_one_idle`] closes: either kind of idle
/// connection (dropping it closes it).
enum Idle {
    Wire(#[allow(dead_code)] WireConn),
    H1(#[allow(dead_code)] H1),
}

/// An idle connection of the lane (`h1.rs`) that is not readable:
/// one that is has been closed by the upstream, or has bytes nobody asked
/// for, and either way is not one to send on. (Polled with a waker that
/// does nothing: no task waits on an idle connection.)
pub(super) fn still_idle(io: &tokio::net::TcpStream) -> bool {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    io.poll_read_ready(&mut cx).is_pending()
}

/// A write's request body, made to throw its connection if it is cut
/// (`KillOnCut`).
fn cut_kills(req: Request<ProxyBody>, write: bool, kill: &Arc<KillSwitch>) -> Request<ProxyBody> {
    if !write {
        return req;
    }
    req.map(|inner| {
        let switch = kill.clone();
        KillOnCut { inner, switch }.boxed()
    })
}

/// A fresh connection the upstream closed before it took the request: the
/// request was not sent, as when the connection could not be made.
fn closed_at_once(e: hyper::Error) -> UpstreamError {
    UpstreamError::Connect(format!(
        "the upstream closed a new connection at once: {}",
        crate::error::error_chain(&e)
    ))
}

/// A response body that returns its HTTP/1.1 connection to the pool once
/// it has been read to the end. A body dropped before its end takes the
/// connection with it (hyper closes it: the rest of the body is unread).
struct PooledBody {
    body: Incoming,
    back: Option<(Arc<Upstream>, usize, H1)>,
    ended: bool,
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some((upstream, worker, conn)) = self.back.take() {
            upstream.give_back(worker, conn);
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

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
