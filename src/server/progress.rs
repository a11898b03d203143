//! Whether a connection makes progress, for the idle watchdog of
//! `conn.rs`: bytes moved either way ([`Tracked`]), a request handler
//! running ([`Busy`]), or a response body on its way out ([`Streaming`]).

use std::sync::Arc;
use std::time::Duration;

/// Whether a connection makes progress: bytes moved, a request handler
/// running (an upstream answer can take a while), or a response streaming.
#[derive(Default)]
pub(super) struct Activity {
    pub(super) moved: std::sync::atomic::AtomicBool,
    pub(super) busy: std::sync::atomic::AtomicUsize,
    /// Response bodies not yet ended (Server-Sent Events, a gRPC stream, a
    /// download): the connection is not idle, but bounded by the longer
    /// `limits.response_idle_timeout`.
    pub(super) streaming: std::sync::atomic::AtomicUsize,
}

/// Why the watchdog closes a connection (`connections_closed_total`'s
/// `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// No request in hand and no bytes for the idle timeout.
    Idle,
    /// A response streaming, and no bytes either way for the response idle
    /// timeout: a client that stopped reading (an upstream that stopped
    /// sending is cut by the body's own bound first, see
    /// `proxy::response`).
    Stalled,
}

impl Stop {
    pub(super) fn reason(self) -> &'static str {
        match self {
            Stop::Idle => "idle",
            Stop::Stalled => "response_stalled",
        }
    }
}

impl Activity {
    /// Records that bytes moved, if they did.
    pub(super) fn note(&self, moved: bool) {
        if moved {
            self.moved.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Ends when the connection has been idle for at least `idle` (at most
    /// half as long again): no bytes either way and no request in hand.
    /// With a response streaming, ends only once no bytes have moved for
    /// longer than `stalled` (strictly longer: a response body whose
    /// upstream went silent is cut at `stalled` by its own timer, and
    /// logged as that).
    pub(super) async fn watch(self: Arc<Self>, idle: Duration, stalled: Duration) -> Stop {
        use std::sync::atomic::Ordering::Relaxed;
        let tick = idle / 2;
        let mut quiet = Duration::ZERO;
        loop {
            tokio::time::sleep(tick).await;
            let moved = self.moved.swap(false, Relaxed);
            if moved || self.busy.load(Relaxed) > 0 {
                quiet = Duration::ZERO;
                continue;
            }
            quiet += tick;
            if self.streaming.load(Relaxed) > 0 {
                if quiet > stalled {
                    return Stop::Stalled;
                }
            } else if quiet >= idle {
                return Stop::Idle;
            }
        }
    }
}

/// A request handler in progress on a connection.
pub(super) struct Busy(Arc<Activity>);

impl Busy {
    pub(super) fn new(a: &Arc<Activity>) -> Self {
        a.busy.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Busy(a.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.0.busy.fetch_sub(1, Relaxed);
        self.0.moved.store(true, Relaxed);
    }
}

/// A response body on its way to the client, from its head until it has
/// ended or been dropped.
pub(super) struct Streaming(Arc<Activity>);

impl Streaming {
    pub(super) fn new(a: &Arc<Activity>) -> Self {
        a.streaming
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Streaming(a.clone())
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.0.streaming.fetch_sub(1, Relaxed);
        self.0.moved.store(true, Relaxed);
    }
}

pin_project_lite::pin_project! {
    /// A response body that counts as [`Streaming`] on its connection
    /// until it ends (hyper's side; the lane holds the guard itself while
    /// it writes).
    pub(super) struct StreamingBody<B> {
        #[pin]
        inner: B,
        guard: Option<Streaming>,
    }
}

impl<B> StreamingBody<B> {
    pub(super) fn new(inner: B, guard: Streaming) -> Self {
        StreamingBody {
            inner,
            guard: Some(guard),
        }
    }
}

impl<B: http_body::Body> http_body::Body for StreamingBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if matches!(polled, std::task::Poll::Ready(None | Some(Err(_)))) {
            *this.guard = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// A connection's socket, noting each time bytes move.
    pub(super) struct Tracked<I> {
        #[pin]
        inner: I,
        activity: Arc<Activity>,
    }
}

impl<I: tokio::io::AsyncRead> tokio::io::AsyncRead for Tracked<I> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let r = this.inner.poll_read(cx, buf);
        this.activity.note(buf.filled().len() > before);
        r
    }
}

impl<I: tokio::io::AsyncWrite> tokio::io::AsyncWrite for Tracked<I> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.project();
        let r = this.inner.poll_write(cx, buf);
        this.activity
            .note(matches!(r, std::task::Poll::Ready(Ok(n)) if n > 0));
        r
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.project();
        let r = this.inner.poll_write_vectored(cx, bufs);
        this.activity
            .note(matches!(r, std::task::Poll::Ready(Ok(n)) if n > 0));
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

impl<I> Tracked<I> {
    pub(super) fn new(inner: I, activity: Arc<Activity>) -> Self {
        Tracked { inner, activity }
    }

    /// The socket itself, for its readiness.
    pub(super) fn inner(&self) -> &I {
        &self.inner
    }

    /// The socket itself, for what is read before any request (the PROXY
    /// header).
    pub(super) fn inner_mut(&mut self) -> &mut I {
        &mut self.inner
    }
}
