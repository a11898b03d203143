//! The request path's own HTTP/1.1 lane (issue 32): a connection's plain
//! requests are read, fenced, forwarded and answered on the connection's
//! task, with no hyper dispatch and, to a plain HTTP/1.1 upstream, no
//! connection task in between (`upstream::h1`).
//!
//! The lane takes a request only if [`crate::h1::parse_request`] calls it
//! plain and its whole body (at most [`MAX_WHOLE_BODY`]) is soon there.
//! At the first request it does not take (HTTP/2's preface, chunked or
//! large bodies, `Expect`, upgrades, anything the hostile-input rules must
//! judge) the connection goes to hyper from that request's first byte
//! ([`Rewind`]), for the rest of its life: nothing of it has been consumed,
//! so hyper reads it as it would have from the start. The heads hyper
//! reads from there on are still read by the lane's rules first
//! ([`super::heads`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_util::sync::CancellationToken;

use super::progress::{Activity, Busy, Streaming};
use crate::error::ProxyBody;
use crate::h1::{parse_request, Parsed};
use crate::proxy::{Peer, Proxy, RequestBody};

/// Largest body the lane reads whole before the request is classified;
/// a longer one goes to hyper, which streams it.
pub(super) const MAX_WHOLE_BODY: u64 = 64 * 1024;

/// How long the lane waits for the rest of a small body after its head
/// (a client that writes head and body apart sends the body at once); a
/// slower one is hyper's.
pub(super) const BODY_WAIT: Duration = Duration::from_secs(1);

/// Response bytes gathered before a write: a body's chunks that are
/// already there go out with the head in one write.
const WRITE_AT: usize = 64 * 1024;

/// What the first read of a request may take (more is read if the head
/// or a small body needs it).
const READ_AT: usize = 8 * 1024;

/// Waits until a read would find bytes (or the end) where the stream can
/// tell without a buffer, so that an idle connection holds none.
pub(super) trait WaitReadable {
    /// `fresh`: no read was tried on the connection yet.
    fn wait_readable(
        &self,
        fresh: bool,
    ) -> impl std::future::Future<Output = std::io::Result<()>> + Send;
}

/// By polling, not tokio's `readable()` and `peek()`: their futures (152
/// and 232 bytes) would be kept in every idle connection's state.
impl WaitReadable for tokio::net::TcpStream {
    async fn wait_readable(&self, fresh: bool) -> std::io::Result<()> {
        if fresh {
            // On a new connection the first read came before any byte
            // (strace: recvfrom EAGAIN right after accept4, 2026-12-06),
            // and so did its buffer; after a PROXY header, read exactly,
            // or a TLS handshake, the readiness is stale too. A one-byte
            // peek waits for a real byte (one recv more per connection;
            // measured: 14 KB an idle connection with the buffer, 5.6 KB
            // without). Later the readiness is mostly true: a read that
            // came back short cleared it, and so did the watch for a
            // client that closes, when an exchange waits. Where it is
            // stale (a refusal answered at once after a read that filled
            // the buffer), the read finds nothing and waits with its
            // buffer taken: correct, only costlier.
            let mut one = [0u8; 1];
            std::future::poll_fn(|cx| self.poll_peek(cx, &mut ReadBuf::new(&mut one)))
                .await
                .map(drop)
        } else {
            std::future::poll_fn(|cx| self.poll_read_ready(cx)).await
        }
    }
}

/// rustls may hold decrypted bytes the socket no longer shows: those are
/// there at once. Otherwise its next bytes come from the socket (rustls
/// decrypts every whole record it has read before a read returns, so none
/// waits inside it for bytes that already came).
impl WaitReadable for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    async fn wait_readable(&self, fresh: bool) -> std::io::Result<()> {
        let (socket, tls) = self.get_ref();
        if tls.wants_read() {
            socket.wait_readable(fresh).await
        } else {
            // Plaintext waiting, or the peer's close_notify to read.
            Ok(())
        }
    }
}

impl<I: WaitReadable + Sync> WaitReadable for super::progress::Tracked<I> {
    fn wait_readable(
        &self,
        fresh: bool,
    ) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        self.inner().wait_readable(fresh)
    }
}

/// The lane of a proxy listener.
#[derive(Clone)]
pub(super) struct Lane {
    pub(super) proxy: Arc<Proxy>,
    /// The TLS listener's lane: requests are marked `https`.
    pub(super) tls: bool,
    /// A head longer than this goes to hyper (which answers 431).
    pub(super) max_head: usize,
    /// The longest body read whole (`MAX_WHOLE_BODY`, or less with
    /// `limits.max_body_bytes`).
    pub(super) max_body: u64,
    /// A head must arrive within this once its first byte has.
    pub(super) header_timeout: Duration,
    /// How long the rest of a small body is waited for before the request
    /// goes to hyper ([`BODY_WAIT`], or `limits.body_read_timeout` if
    /// shorter).
    pub(super) body_wait: Duration,
}

/// What serves a connection's requests on hyper's side.
pub(super) trait ConnService:
    hyper::service::Service<
        Request<Incoming>,
        Response = Response<ProxyBody>,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + Send
    + 'static
{
}

impl<S> ConnService for S where
    S: hyper::service::Service<
            Request<Incoming>,
            Response = Response<ProxyBody>,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + Send
        + 'static
{
}

/// What the hyper side of a connection needs if it takes over.
pub(super) struct Handoff<S> {
    /// Shared by the listener's connections; copied only by a connection
    /// hyper serves.
    pub(super) builder: Arc<auto::Builder<TokioExecutor>>,
    pub(super) service: S,
    pub(super) watcher: hyper_util::server::graceful::Watcher,
    /// Shared with the service: the head guard's refusal, for it to answer.
    pub(super) refusal: Arc<super::heads::Refusal>,
    /// Counts the connections the lane hands over.
    pub(super) handoffs: prometheus::IntCounter,
}

impl Lane {
    /// Serves a connection until it ends, or hands it to hyper.
    ///
    /// This future lives as long as the connection, idle included, and
    /// is boxed for it (`conn.rs`): between requests it holds only the
    /// connection, a small wait for its next bytes, and a pointer to what
    /// hyper would need (issue 44). Each request's reading and exchange
    /// are boxed apart ([`Lane::step`]) and freed when it is answered.
    pub(super) async fn serve<I, S>(
        self: Arc<Self>,
        mut io: I,
        peer: Peer,
        activity: Arc<Activity>,
        stop: CancellationToken,
        hyper: Box<Handoff<S>>,
    ) where
        I: AsyncRead + AsyncWrite + WaitReadable + Unpin + Send + 'static,
        S: ConnService,
    {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fresh = true;
        loop {
            if buf.is_empty() {
                // Between requests a connection holds no buffer (nginx's
                // and HAProxy's habit): an idle keep-alive connection costs
                // its socket and a small task, not 16 KB of buffers.
                // Pipelined bytes keep theirs. Idle, the drain ends it.
                buf = BytesMut::new();
                out = Vec::new();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    ready = io.wait_readable(fresh) => if ready.is_err() {
                        return;
                    },
                }
            }
            fresh = false;
            // Boxed in a statement of its own (see `conn.rs`).
            let step = Box::pin(self.step(&mut io, &mut buf, &mut out, peer, &activity, &stop));
            match step.await {
                Step::Again => {}
                Step::End => return,
                Step::Hyper => {
                    // h2c with prior knowledge (see `Activity::h2`): the lane
                    // hands over once its request line does not parse, at
                    // "HTTP/2.0", so the whole preface may not be here yet.
                    if buf.starts_with(&super::heads::PREFACE[..14]) {
                        activity
                            .h2
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    let hyper_side = hand_off(io, buf, *hyper, self.max_head);
                    return hyper_side.await;
                }
            }
        }
    }

    /// Reads the next request and serves it, or says it is hyper's.
    async fn step<I: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: &mut I,
        buf: &mut BytesMut,
        out: &mut Vec<u8>,
        peer: Peer,
        activity: &Arc<Activity>,
        stop: &CancellationToken,
    ) -> Step {
        let Some(next) = self.read_request(io, buf, stop).await else {
            return Step::End;
        };
        let refusal = match next {
            Next::Request(head, body) => {
                let again = self
                    .exchange(io, buf, out, head, body, peer, activity, stop)
                    .await;
                return if again { Step::Again } else { Step::End };
            }
            Next::Hyper if stop.is_cancelled() => {
                // hyper would close a connection it meets after the drain
                // began without reading it: the client is told.
                crate::error::ProxyError::ShuttingDown
            }
            Next::Hyper => return Step::Hyper,
            Next::Refused(why) => crate::error::ProxyError::BadFraming(why.into()),
        };
        let _ = write_response(io, out, refusal.into_response(None), false, true).await;
        let _ = io.shutdown().await;
        Step::End
    }

    /// One request served and its answer written; whether the connection
    /// carries another.
    #[allow(clippy::too_many_arguments)]
    async fn exchange<I: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: &mut I,
        buf: &mut BytesMut,
        out: &mut Vec<u8>,
        head: crate::h1::RequestHead,
        body: Bytes,
        peer: Peer,
        activity: &Arc<Activity>,
        stop: &CancellationToken,
    ) -> bool {
        let to_head = head.parts.method == Method::HEAD;
        let close_asked = head.close;
        let req = Request::from_parts(head.parts, RequestBody::Whole(Some(body)));
        let busy = Busy::new(activity);
        let handled = self.proxy.clone().handle(req, peer);
        tokio::pin!(handled);
        // The client is watched while its request is served: one that
        // closes is gone (hyper's rule too), and the request's future
        // is dropped: it is logged as 499, and a write's exchange runs
        // on to its end on a task of its own.
        // Once pipelined bytes are there, no more is read (hyper's rule
        // too): a client that sent its requests and half-closed gets
        // its answers.
        let resp = loop {
            tokio::select! {
                biased;
                Ok(resp) = &mut handled => break resp,
                read = io.read_buf(buf), if buf.is_empty() => match read {
                    Ok(n) if n > 0 => {}
                    _ => return false,
                },
            }
        };
        // From the head on the connection is streaming, not idle: an
        // event stream's pauses are bounded by the response idle
        // timeout, not the keep-alive one.
        let streaming = Streaming::new(activity);
        drop(busy);
        let close = close_asked || stop.is_cancelled();
        let written = write_response(io, out, resp, to_head, close).await;
        drop(streaming);
        if !matches!(written, Ok(After::KeepAlive)) {
            let _ = io.shutdown().await;
            return false;
        }
        true
    }

    /// The next request's head and whole body; `None` when the connection
    /// is to end (closed, timed out, or idle at the drain).
    async fn read_request<I: AsyncRead + Unpin>(
        &self,
        io: &mut I,
        buf: &mut BytesMut,
        stop: &CancellationToken,
    ) -> Option<Next> {
        let mut head_by = None;
        let head = loop {
            match parse_request(buf) {
                // hyper answers 431 to a head past its buffer.
                Parsed::Head(head) if head.len > self.max_head => return Some(Next::Hyper),
                Parsed::Head(head) => break head,
                Parsed::Other => return Some(Next::Hyper),
                Parsed::Refused(why) => return Some(Next::Refused(why)),
                Parsed::Partial if buf.len() > self.max_head => return Some(Next::Hyper),
                Parsed::Partial => {}
            }
            let read = if buf.is_empty() {
                // The caller saw bytes there (or the readiness was stale):
                // the buffer is taken now. Still idle: the drain ends it.
                buf.reserve(READ_AT);
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    read = io.read_buf(buf) => read,
                }
            } else {
                buf.reserve(4096);
                let by = *head_by
                    .get_or_insert_with(|| tokio::time::Instant::now() + self.header_timeout);
                tokio::time::timeout_at(by, io.read_buf(buf)).await.ok()?
            };
            if !matches!(read, Ok(n) if n > 0) {
                return None;
            }
        };
        if head.body > self.max_body {
            return Some(Next::Hyper);
        }
        let whole = head.len + head.body as usize;
        // The clock is read only for a body that is not all there yet.
        let mut body_by = None;
        while buf.len() < whole {
            let body_by =
                *body_by.get_or_insert_with(|| tokio::time::Instant::now() + self.body_wait);
            buf.reserve(whole - buf.len());
            let read = tokio::select! {
                _ = stop.cancelled() => return Some(Next::Hyper),
                read = tokio::time::timeout_at(body_by, io.read_buf(buf)) => read,
            };
            match read {
                Ok(Ok(n)) if n > 0 => {}
                // A body that does not come at once goes to hyper, which
                // reads it under the body rules (idle limit, 408, the
                // write's deadline) as it would have from the start.
                Err(_) => return Some(Next::Hyper),
                _ => return None,
            }
        }
        let mut request = buf.split_to(whole);
        let body = request.split_off(head.len).freeze();
        Some(Next::Request(head, body))
    }
}

/// What a request's step leaves the connection to do.
enum Step {
    /// Read the next request.
    Again,
    /// Close (the step has written what was to be written).
    End,
    /// Hand it to hyper from the buffer's first byte.
    Hyper,
}

// Made once per request and moved once: a box would be an allocation more.
#[allow(clippy::large_enum_variant)]
enum Next {
    Request(crate::h1::RequestHead, Bytes),
    Hyper,
    /// Refused before it is routed: 400, and the connection closed.
    Refused(&'static str),
}

/// How an answer's body is delimited on the wire.
#[derive(Clone, Copy)]
enum Framing {
    /// No body goes out: an answer to HEAD, 1xx, 204 or 304.
    Bodiless,
    /// `Content-Length`, the upstream's or the body's exact size.
    Length(u64),
    /// `Transfer-Encoding: chunked`, for a body of unknown size.
    Chunked,
}

/// Whether a connection carries another request after an answer.
#[must_use]
enum After {
    KeepAlive,
    Close,
}

/// How an answer's body ended.
enum BodyEnd {
    /// All of it went, as framed.
    Whole,
    /// The upstream failed mid-body.
    Failed,
    /// More bytes than its `Content-Length`: the piece past it was not
    /// sent, or it would be read as another answer.
    Overlong,
}

/// Writes an answer: head, then body as it comes.
///
/// Keep-alive rule, kept here only: the connection carries another
/// request only if the client did not ask to close, the answer did not
/// say `Connection: close`, and the body went out whole and exactly as
/// framed. Any other end closes it, so a client never reads a cut or
/// overlong body as whole or as the start of the next answer.
async fn write_response<I: AsyncWrite + Unpin>(
    io: &mut I,
    out: &mut Vec<u8>,
    resp: Response<ProxyBody>,
    to_head: bool,
    close: bool,
) -> std::io::Result<After> {
    let (mut parts, mut body) = resp.into_parts();
    let (framing, close) = frame_head(&mut parts, &body, to_head, close);
    out.clear();
    // Taken per answer (a connection between requests holds none).
    out.reserve(READ_AT);
    crate::h1::write_response_head(out, parts.status, &parts.headers);
    let mut wire = BodyOut {
        io,
        out,
        framing,
        bytes: 0,
    };
    let end = match framing {
        Framing::Bodiless => {
            wire.send().await?;
            if body.is_end_stream() {
                // Polled to its end all the same: an upstream connection
                // goes back to its pool only when its body is seen to end.
                let _ = body.frame().await;
            }
            BodyEnd::Whole
        }
        Framing::Length(_) | Framing::Chunked => {
            let end = wire.copy(&mut body).await?;
            wire.finish(&end).await?;
            end
        }
    };
    Ok(if !close && matches!(end, BodyEnd::Whole) && wire.exact() {
        After::KeepAlive
    } else {
        After::Close
    })
}

/// Completes an answer's head for the wire and says how its body is
/// framed, and whether the connection closes after it.
fn frame_head(
    parts: &mut http::response::Parts,
    body: &ProxyBody,
    to_head: bool,
    mut close: bool,
) -> (Framing, bool) {
    let status = parts.status;
    let headers = &mut parts.headers;
    close |= headers.get_all(header::CONNECTION).iter().any(|v| {
        v.as_bytes()
            .split(|b| *b == b',')
            .any(|o| o.trim_ascii().eq_ignore_ascii_case(b"close"))
    });
    let framing = if to_head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        Framing::Bodiless
    } else if let Some(n) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
    {
        Framing::Length(n)
    } else if let Some(n) = body.size_hint().exact() {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        Framing::Length(n)
    } else {
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        Framing::Chunked
    };
    if !headers.contains_key(header::DATE) {
        headers.insert(header::DATE, date());
    }
    if close {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    (framing, close)
}

/// An answer going out: bytes are gathered in `out` (the head first) and
/// written when the next frame is not there yet, when a piece is large, or
/// at the end; every write that waits for the body is flushed first, as
/// TLS keeps what it was given until then. The body's framing on the wire
/// (chunks, their terminator) is made here only.
struct BodyOut<'a, I> {
    io: &'a mut I,
    out: &'a mut Vec<u8>,
    framing: Framing,
    /// Body bytes sent so far, framing not counted.
    bytes: u64,
}

impl<I: AsyncWrite + Unpin> BodyOut<'_, I> {
    /// Copies the body's data frames out until it ends; a declared length
    /// bounds what is sent.
    async fn copy(&mut self, body: &mut ProxyBody) -> std::io::Result<BodyEnd> {
        loop {
            let frame = match ready_now(body.frame()).await {
                Ok(frame) => frame,
                Err(next) => {
                    self.send().await?;
                    next.await
                }
            };
            let data = match frame {
                None => return Ok(BodyEnd::Whole),
                Some(Err(_)) => return Ok(BodyEnd::Failed),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => data,
                    // Trailers are not sent on HTTP/1.1 answers.
                    Err(_) => continue,
                },
            };
            self.bytes += data.len() as u64;
            if matches!(self.framing, Framing::Length(n) if self.bytes > n) {
                return Ok(BodyEnd::Overlong);
            }
            if !data.is_empty() {
                self.put(&data).await?;
            }
        }
    }

    /// Adds one piece of body, in its chunk if chunked.
    async fn put(&mut self, data: &[u8]) -> std::io::Result<()> {
        let chunked = matches!(self.framing, Framing::Chunked);
        if chunked {
            self.out
                .extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        }
        if self.out.len() + data.len() > WRITE_AT {
            // A large piece (a download) is written from where it lies,
            // not copied into the gathered bytes.
            self.io.write_all(self.out).await?;
            self.out.clear();
            self.io.write_all(data).await?;
        } else {
            self.out.extend_from_slice(data);
        }
        if chunked {
            self.out.extend_from_slice(b"\r\n");
        }
        Ok(())
    }

    /// Sends what is left: a whole chunked body gets its terminator, a cut
    /// one never does.
    async fn finish(&mut self, end: &BodyEnd) -> std::io::Result<()> {
        if matches!(end, BodyEnd::Whole) && matches!(self.framing, Framing::Chunked) {
            self.out.extend_from_slice(b"0\r\n\r\n");
        }
        self.send().await
    }

    /// Whether the body sent is exactly as long as its head said.
    fn exact(&self) -> bool {
        match self.framing {
            Framing::Length(n) => self.bytes == n,
            Framing::Bodiless | Framing::Chunked => true,
        }
    }

    /// Writes and flushes what is gathered.
    async fn send(&mut self) -> std::io::Result<()> {
        self.io.write_all(self.out).await?;
        self.io.flush().await?;
        self.out.clear();
        Ok(())
    }
}

/// Polls a future once: its output if it is ready now, or the future
/// itself to await later.
async fn ready_now<F: Future + Unpin>(mut fut: F) -> Result<F::Output, F> {
    match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut fut).poll(cx))).await {
        Poll::Ready(output) => Ok(output),
        Poll::Pending => Err(fut),
    }
}

/// The `Date` header, made once a second per thread.
fn date() -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<(u64, HeaderValue)> =
            const { std::cell::RefCell::new((0, HeaderValue::from_static(""))) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    LAST.with_borrow_mut(|(at, value)| {
        if *at != secs {
            *value = HeaderValue::from_str(&httpdate::fmt_http_date(now))
                .expect("an HTTP date is a header value");
            *at = secs;
        }
        value.clone()
    })
}

pin_project_lite::pin_project! {
    /// A connection handed to hyper with the bytes the lane already read
    /// put back in front.
    struct Rewind<I> {
        pre: Bytes,
        #[pin]
        io: I,
    }
}

impl<I: AsyncRead> AsyncRead for Rewind<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.project();
        if !this.pre.is_empty() {
            let n = this.pre.len().min(buf.remaining());
            buf.put_slice(&this.pre[..n]);
            this.pre.advance(n);
            if this.pre.is_empty() {
                // The lane's read buffer is freed, not held by an empty
                // view for the connection's life (issue 44).
                *this.pre = Bytes::new();
            }
            return Poll::Ready(Ok(()));
        }
        this.io.poll_read(cx, buf)
    }
}

impl<I: AsyncWrite> AsyncWrite for Rewind<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }
}

/// The connection as hyper's, from the first byte of `buf` on. A plain
/// function, not part of the lane's future: what it takes would otherwise
/// be kept in that future's storage for the connection's whole life.
fn hand_off<I, S>(
    io: I,
    buf: BytesMut,
    hyper: Handoff<S>,
    max_head: usize,
) -> Pin<Box<dyn Future<Output = ()> + Send>>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: ConnService,
{
    let io = Rewind {
        pre: buf.freeze(),
        io,
    };
    // hyper reads on, but every head it reads is read by the lane's rules
    // first (`heads.rs`).
    let io = super::heads::HeadGuard::new(io, max_head, hyper.refusal);
    hyper.handoffs.inc();
    Box::pin(serve_connection(
        hyper.builder,
        io,
        hyper.service,
        hyper.watcher,
    ))
}

/// Serves one connection (plain or TLS) under the drain's watch.
pub(super) async fn serve_connection<I, S>(
    builder: Arc<auto::Builder<TokioExecutor>>,
    io: I,
    service: S,
    watcher: hyper_util::server::graceful::Watcher,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: ConnService,
{
    // With upgrades: a WebSocket route hands its connections to a tunnel.
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    if let Err(e) = watcher.watch(conn.into_owned()).await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}
