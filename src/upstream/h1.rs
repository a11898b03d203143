//! The own lane's exchange with a plain HTTP/1.1 upstream (issue 32): the
//! request goes out as bytes ([`crate::h1`] wrote its head), and the answer
//! is read on the task that asked, with no connection task between them.
//! Idle connections wait in the same per-worker pool as hyper's, under the
//! same rules: newest first, none older than the idle timeout, and a
//! request that may have been written is never sent again.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use http::Response;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower_service::Service;

use super::error::UpstreamError;
use super::limit::Permit;
use super::pool::{
    may_leave_body_unread, retires_connection, still_idle, Upstream, WireConn, MAX_IDLE,
};
use crate::error::{BoxError, ProxyBody};
use crate::h1::{parse_response, ChunkedDecoder, Framing};

/// Longest response head read from an upstream.
const MAX_HEAD: usize = 64 * 1024;

/// What one read of a head from an upstream asks the buffer to hold free.
const READ_AHEAD: usize = 16 * 1024;

/// The same for a body's reads.
const BODY_READ: usize = 64 * 1024;

impl Upstream {
    /// Whether the lane's requests can go to this upstream as bytes: plain
    /// HTTP/1.1 (not TLS, not h2c).
    pub fn speaks_plain_h1(&self) -> bool {
        !self.h2c && self.dial.scheme() == Some(&http::uri::Scheme::HTTP)
    }

    /// Sends a whole request (`wire`: head and body) and returns the
    /// response head; its body gives the connection back to this worker's
    /// pool when it ends. `to_head`: the request is a HEAD (no body comes).
    pub async fn send_wire(
        self: &Arc<Self>,
        wire: &[u8],
        to_head: bool,
    ) -> Result<Response<ProxyBody>, UpstreamError> {
        let worker = crate::slot::current() % self.pools.len();
        loop {
            let (conn, fresh) = match self.checkout_wire(worker) {
                Some(conn) => (conn, false),
                None => self.dial_or_wait_wire(worker).await?,
            };
            let WireConn { mut io, permit } = conn;
            // A write that fails at once wrote nothing: on a reused
            // connection (closed while idle) the request goes on the next.
            let written = match io.write(wire).await {
                Ok(n) => n,
                Err(_) if !fresh => continue,
                Err(e) => {
                    return Err(UpstreamError::Connect(format!(
                        "the upstream closed a new connection at once: {e}"
                    )))
                }
            };
            let mut buf = BytesMut::with_capacity(READ_AHEAD);
            let conn = Sent {
                permit,
                worker,
                fresh,
            };
            let with_body = carries_body(wire);
            if written == wire.len() {
                let reuse = !answered_before_written(&io, &mut buf, to_head);
                return self
                    .read_head(io, buf, conn, to_head, reuse, with_body)
                    .await;
            }
            // The rest goes out while the answer is watched for: an
            // upstream may answer early (413, 401, 403) and read no more
            // of the body while it keeps the connection open, and a write
            // that waited for it to read would wait until the deadline.
            let cut = {
                let (mut rd, mut wr) = io.split();
                let write = wr.write_all(&wire[written..]);
                tokio::pin!(write);
                loop {
                    tokio::select! {
                        biased;
                        w = &mut write => break w.err(),
                        r = rd.read_buf(&mut buf) => match r {
                            // An answer is under way: the rest of the
                            // request is not sent. (Watched no further
                            // than a head's length: a longer one is no
                            // answer to wait for.)
                            Ok(n) if n > 0 && !final_head(&buf, to_head) && buf.len() <= MAX_HEAD => {
                                buf.reserve(READ_AHEAD);
                            }
                            Ok(_) => break Some(std::io::ErrorKind::ConnectionAborted.into()),
                            Err(e) => break Some(e),
                        },
                    }
                }
            };
            if let Some(e) = cut {
                // The upstream answered early, or closed: its answer, if
                // one came, is the one to pass on. The connection is not
                // reused: the request was cut.
                return self
                    .read_head(io, buf, conn, to_head, false, with_body)
                    .await
                    .map_err(|_| lost_on(e, fresh));
            }
            // The write ended in the same turn as an answer came: an answer
            // that was there before the request was all written is an
            // early one, and the connection is not reused.
            let reuse = !answered_before_written(&io, &mut buf, to_head);
            return self
                .read_head(io, buf, conn, to_head, reuse, with_body)
                .await;
        }
    }

    async fn read_head(
        self: &Arc<Self>,
        mut io: TcpStream,
        mut buf: BytesMut,
        conn: Sent,
        to_head: bool,
        reuse: bool,
        with_body: bool,
    ) -> Result<Response<ProxyBody>, UpstreamError> {
        let head = loop {
            match parse_response(&buf, to_head).map_err(|e| UpstreamError::Wire(e.to_string()))? {
                Some(head) if head.status == http::StatusCode::SWITCHING_PROTOCOLS => {
                    return Err(UpstreamError::Wire(
                        "the upstream answered 101 to a request that asked for no upgrade".into(),
                    ))
                }
                // Interim answers (100, 103) are not passed on, as hyper
                // does not.
                Some(head) if head.status.is_informational() => buf.advance(head.len),
                Some(head) => break head,
                None if buf.len() > MAX_HEAD => {
                    return Err(UpstreamError::Wire(
                        "the upstream's response head is too long".into(),
                    ))
                }
                None => {
                    buf.reserve(READ_AHEAD);
                    let read = io.read_buf(&mut buf).await;
                    if read.map_err(|e| lost_on(e, conn.fresh))? == 0 {
                        return Err(UpstreamError::Wire(
                            "the upstream closed the connection before it answered".into(),
                        ));
                    }
                }
            }
        };
        buf.advance(head.len);
        if conn.fresh {
            // The upstream answered, so it acknowledged the request: from
            // here on unacknowledged bytes are no sign of a dial that
            // failed (an upload the upstream reads slowly is its own).
            unacked_limit(&io, None);
        }
        let state = match head.framing {
            Framing::Empty | Framing::Length(0) => State::Length(0),
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(ChunkedDecoder::default()),
            Framing::Close => State::Close,
        };
        let mut resp = Response::new(());
        *resp.status_mut() = head.status;
        *resp.headers_mut() = head.headers;
        // A refused upload's body may be unread (see `may_leave_body_unread`).
        let maybe_unread = with_body && may_leave_body_unread(head.status);
        let body = WireBody {
            io: Some(WireConn {
                io,
                permit: conn.permit,
            }),
            buf,
            state,
            back: (reuse && !head.close && !retires_connection(head.status) && !maybe_unread)
                .then(|| (self.clone(), conn.worker)),
        };
        Ok(resp.map(|()| body.boxed()))
    }

    /// An idle connection of this worker, newest first, that has not been
    /// closed (or sent anything) while it waited.
    fn checkout_wire(&self, worker: usize) -> Option<WireConn> {
        let mut pool = self.pool(worker);
        let now = Instant::now();
        while let Some((since, conn)) = pool.wire.pop_back() {
            if now.duration_since(since) > self.idle_timeout {
                pool.wire.clear();
                break;
            }
            if still_idle(&conn.io) {
                return Some(conn);
            }
        }
        None
    }

    /// A new connection if the cap allows one, else the first of: one
    /// given back on this worker, a permit from the queue (then dialled),
    /// or the queue timeout. The flag: the connection is new.
    async fn dial_or_wait_wire(&self, worker: usize) -> Result<(WireConn, bool), UpstreamError> {
        let permit = match self.free_permit() {
            Some(permit) => permit,
            None => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                {
                    let mut pool = self.pool(worker);
                    pool.wire_waiters.retain(|w| !w.is_closed());
                    pool.wire_waiters.push_back(tx);
                }
                tokio::select! {
                    biased;
                    Ok(conn) = rx => return Ok((conn, false)),
                    permit = self.limit.wait() => permit?,
                }
            }
        };
        let io = self.dial_wire().await?;
        // Linux: a request on a connection whose handshake the upstream's
        // kernel never completed (its listen queue overflowed: the last
        // ACK was dropped, or SYN cookies were sent) is never acknowledged,
        // and its retransmissions back off for minutes. TCP_USER_TIMEOUT
        // ends such a connection after the connect timeout: the kernel
        // drops the unsent request (it is never delivered later) and the
        // read fails with ETIMEDOUT, which `lost_on` calls a failed dial.
        unacked_limit(&io, Some(self.limit.settings.connect_timeout));
        Ok((WireConn { io, permit }, true))
    }

    async fn dial_wire(&self) -> Result<TcpStream, UpstreamError> {
        let mut connector = self.connector.clone();
        let connect = |e: BoxError| UpstreamError::Connect(crate::error::error_chain(&*e));
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(connect)?;
        match connector.call(self.dial.clone()).await.map_err(connect)? {
            hyper_rustls::MaybeHttpsStream::Http(io) => Ok(io.into_inner()),
            hyper_rustls::MaybeHttpsStream::Https(_) => Err(UpstreamError::Connect(
                "a plain HTTP/1.1 upstream negotiated TLS".into(),
            )),
        }
    }

    fn give_back_wire(&self, worker: usize, mut conn: WireConn) {
        let now = Instant::now();
        let mut pool = self.pool(worker);
        // A request of this worker waiting for a connection takes it.
        while let Some(waiter) = pool.wire_waiters.pop_front() {
            match waiter.send(conn) {
                Ok(()) => return,
                Err(back) => conn = back,
            }
        }
        if self.limit.has_waiters() {
            // Requests of other workers wait for the cap: the connection
            // closes (outside the lock) and its permit goes to the oldest.
            drop(pool);
            drop(conn);
            return;
        }
        self.reap(&mut pool, now);
        if pool.wire.len() >= MAX_IDLE {
            pool.wire.pop_front();
        }
        pool.wire.push_back((now, conn));
    }
}

/// Whether `buf` starts with a whole final answer head (interim 1xx
/// heads before it skipped), or with bytes that are no answer at all.
fn final_head(buf: &[u8], to_head: bool) -> bool {
    let mut at = 0;
    loop {
        match parse_response(&buf[at..], to_head) {
            Ok(Some(head)) if head.status.is_informational() => at += head.len,
            Ok(Some(_)) | Err(_) => return true,
            Ok(None) => return false,
        }
    }
}

/// Whether a final answer head (or bytes that are no answer) is already
/// there once the request's last byte was handed to the socket: what the
/// upstream has sent so far is read without waiting. Such an answer came
/// before the upstream could have read the whole request (or did not
/// read it): the rest of the request would be read as the next one.
fn answered_before_written(io: &TcpStream, buf: &mut BytesMut, to_head: bool) -> bool {
    loop {
        if buf.len() > MAX_HEAD {
            return true;
        }
        buf.reserve(READ_AHEAD);
        match io.try_read_buf(buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(_) => return true,
        }
    }
    final_head(buf, to_head)
}

/// Whether `wire` (a request's head and body) has body bytes after its
/// head.
fn carries_body(wire: &[u8]) -> bool {
    wire.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .is_some_and(|end| end + 4 < wire.len())
}

/// A failed read or write once the request may have been sent.
fn lost(e: std::io::Error) -> UpstreamError {
    UpstreamError::Wire(format!("the upstream connection failed: {e}"))
}

/// The same, where a new connection that timed out (`unacked_limit`)
/// never had its request acknowledged by the upstream's kernel: the dial
/// failed, and the request was dropped unsent.
fn lost_on(e: std::io::Error, fresh: bool) -> UpstreamError {
    if fresh && e.kind() == std::io::ErrorKind::TimedOut {
        return UpstreamError::Connect(format!(
            "the upstream's kernel never acknowledged the request on a new connection ({e}): its listen queue is likely full (a small accept backlog under a burst), so the handshake never completed on its side"
        ));
    }
    lost(e)
}

/// What a new connection of the lane carries to its answer.
struct Sent {
    permit: Permit,
    worker: usize,
    /// Dialled for this request.
    fresh: bool,
}

/// Sets (or clears, `None`) how long bytes sent may stay unacknowledged
/// before the kernel ends the connection (TCP_USER_TIMEOUT, Linux only).
/// A failure is no reason to fail the request: the upstream timeout still
/// bounds it.
fn unacked_limit(io: &TcpStream, limit: Option<std::time::Duration>) {
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
    if let Err(e) = socket2::SockRef::from(io).set_tcp_user_timeout(limit) {
        tracing::debug!(error = %e, "TCP_USER_TIMEOUT not set");
    }
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "fuchsia")))]
    let _ = (io, limit);
}

enum State {
    /// Bytes of the body still to come.
    Length(u64),
    Chunked(ChunkedDecoder),
    /// Until the upstream closes.
    Close,
}

/// A response body read from the upstream connection it owns.
struct WireBody {
    /// The connection and its permit under the cap.
    io: Option<WireConn>,
    /// Bytes read past the head, not yet passed on.
    buf: BytesMut,
    state: State,
    /// Where the connection goes when the body has ended cleanly.
    back: Option<(Arc<Upstream>, usize)>,
}

impl WireBody {
    /// The body ended: the connection goes back to the pool if it can carry
    /// another exchange (nothing read past this body).
    fn ended(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let (Some(io), Some((up, worker))) = (self.io.take(), self.back.take()) {
            if self.buf.is_empty() {
                up.give_back_wire(worker, io);
            }
        }
        Poll::Ready(None)
    }

    /// Reads more from the upstream; `Ok(false)` at its end.
    fn fill(&mut self, cx: &mut Context<'_>) -> Poll<Result<bool, BoxError>> {
        let Some(WireConn { io, .. }) = self.io.as_mut() else {
            return Poll::Ready(Ok(false));
        };
        // Body reads are larger than head reads: a download goes in few
        // system calls.
        self.buf.reserve(BODY_READ);
        match tokio_util::io::poll_read_buf(Pin::new(io), cx, &mut self.buf) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(n)) => Poll::Ready(Ok(n > 0)),
            Poll::Ready(Err(e)) => Poll::Ready(Err(Box::new(e))),
        }
    }
}

impl Body for WireBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            let data = match &mut this.state {
                State::Length(0) => return this.ended(),
                State::Length(left) => {
                    let n = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(this.buf.len());
                    *left -= n as u64;
                    this.buf.split_to(n).freeze()
                }
                State::Chunked(decoder) => match decoder.next(&mut this.buf) {
                    Ok(Some(data)) => data,
                    Ok(None) => return this.ended(),
                    Err(e) => return Poll::Ready(Some(Err(Box::new(e)))),
                },
                State::Close => this.buf.split().freeze(),
            };
            if !data.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            match std::task::ready!(this.fill(cx)) {
                Ok(true) => {}
                Ok(false) if matches!(this.state, State::Close) => {
                    this.back = None;
                    return this.ended();
                }
                Ok(false) => {
                    return Poll::Ready(Some(Err(
                        "the upstream closed the connection before the body's end".into(),
                    )))
                }
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.state, State::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            State::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}
