//! Whether a connection makes progress, for the idle watchdog of
//! `conn.rs`: bytes moved either way ([`Tracked`]), or a request handler
//! running ([`Busy`]).

use std::sync::Arc;
use std::time::Duration;

/// Whether a connection makes progress: bytes moved, or a request handler
/// running (an upstream answer can take a while).
#[derive(Default)]
pub(super) struct Activity {
    pub(super) moved: std::sync::atomic::AtomicBool,
    pub(super) busy: std::sync::atomic::AtomicUsize,
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
    pub(super) async fn watch(self: Arc<Self>, idle: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let tick = idle / 2;
        let mut quiet = Duration::ZERO;
        loop {
            tokio::time::sleep(tick).await;
            let moved = self.moved.swap(false, Relaxed);
            if moved || self.busy.load(Relaxed) > 0 {
                quiet = Duration::ZERO;
            } else {
                quiet += tick;
                if quiet >= idle {
                    return;
                }
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

    /// The socket itself, for what is read before any request (the PROXY
    /// header).
    pub(super) fn inner_mut(&mut self) -> &mut I {
        &mut self.inner
    }
}
