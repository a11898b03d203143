//! Whether a connection makes progress, for the idle watchdog
//! ([`Sweeper`]): bytes moved either way ([`Tracked`]), a request handler
//! running ([`Busy`]), or a response body on its way out ([`Streaming`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

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
    /// Served as HTTP/2: bytes alone are no progress (a PING, or a HEADERS
    /// frame dripped a byte at a time, would keep the connection forever);
    /// a stream is.
    pub(super) h2: std::sync::atomic::AtomicBool,
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
}

/// One idle watchdog for all of an accept loop's connections, instead of a
/// timer task beside each (issue 44: that task cost about 0.9 KB a
/// connection, idle ones included). Every `idle / 2` it looks at each
/// connection's [`Activity`] and aborts those that are done; on the kill
/// it aborts them all.
#[derive(Clone)]
pub(super) struct Sweeper {
    watched: Arc<Mutex<slab::Slab<Watched>>>,
}

struct Watched {
    activity: Arc<Activity>,
    /// Set right after the spawn.
    abort: Option<tokio::task::AbortHandle>,
    /// Ticks in a row with no progress.
    quiet: u32,
    /// Not looked at yet: a connection accepted just before a tick has not
    /// been quiet for a whole tick.
    fresh: bool,
    /// Aborted already; counted once.
    closed: bool,
}

/// A connection's place in the [`Sweeper`], given back when its task ends
/// (or is aborted: dropping the future drops this).
pub(super) struct Place {
    watched: Arc<Mutex<slab::Slab<Watched>>>,
    key: usize,
}

impl Drop for Place {
    fn drop(&mut self) {
        lock(&self.watched).try_remove(self.key);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Nothing done under this lock can panic half-way.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Sweeper {
    pub(super) fn new() -> Self {
        Sweeper {
            watched: Arc::new(Mutex::new(slab::Slab::new())),
        }
    }

    /// Spawns the connection's task with `spawn` and watches it from now
    /// on. The task holds its [`Place`] for as long as it runs.
    pub(super) fn spawn<F>(
        &self,
        activity: Arc<Activity>,
        spawn: impl FnOnce(Place) -> tokio::task::JoinHandle<F>,
    ) {
        let key = lock(&self.watched).insert(Watched {
            activity,
            abort: None,
            quiet: 0,
            fresh: true,
            closed: false,
        });
        // Not under the lock: a spawn refused (the runtime shutting down)
        // drops the task's future, and with it its place, at once.
        let abort = spawn(Place {
            watched: self.watched.clone(),
            key,
        })
        .abort_handle();
        // Gone already if the task ended; the key is not reused meanwhile,
        // as only this accept loop takes places.
        if let Some(w) = lock(&self.watched).get_mut(key) {
            w.abort = Some(abort);
        }
    }

    /// Runs until `kill`: closes each connection idle for at least `idle`
    /// (at most half as long again): no bytes either way and no request in
    /// hand. With a response streaming, only once no bytes have moved for
    /// longer than `stalled` (strictly longer: a response body whose
    /// upstream went silent is cut at `stalled` by its own timer, and
    /// logged as that). `closed` counts each.
    pub(super) async fn run(
        self,
        idle: Duration,
        stalled: Duration,
        kill: CancellationToken,
        closed: impl Fn(Stop),
    ) {
        let tick = idle / 2;
        loop {
            tokio::select! {
                _ = kill.cancelled() => {
                    let all: Vec<_> = lock(&self.watched).iter().filter_map(|(_, w)| w.abort.clone()).collect();
                    all.iter().for_each(tokio::task::AbortHandle::abort);
                    return;
                }
                _ = tokio::time::sleep(tick) => {}
            }
            let mut doomed = Vec::new();
            for (_, w) in lock(&self.watched).iter_mut() {
                if let Some(abort) = w.abort.clone() {
                    if let Some(stop) = w.look(tick, idle, stalled) {
                        doomed.push((abort, stop));
                    }
                }
            }
            // Aborted outside the lock: the task's end takes it.
            for (abort, stop) in doomed {
                closed(stop);
                abort.abort();
            }
        }
    }
}

impl Watched {
    /// One tick's look: why to close the connection, if it is to be.
    fn look(&mut self, tick: Duration, idle: Duration, stalled: Duration) -> Option<Stop> {
        use std::sync::atomic::Ordering::Relaxed;
        let moved = self.activity.moved.swap(false, Relaxed);
        if self.closed || std::mem::take(&mut self.fresh) {
            return None;
        }
        let streaming = self.activity.streaming.load(Relaxed) > 0;
        let bytes_count = streaming || !self.activity.h2.load(Relaxed);
        if (moved && bytes_count) || self.activity.busy.load(Relaxed) > 0 {
            self.quiet = 0;
            return None;
        }
        self.quiet = self.quiet.saturating_add(1);
        let quiet = tick.saturating_mul(self.quiet);
        let stop = if streaming {
            (quiet > stalled).then_some(Stop::Stalled)
        } else {
            (quiet >= idle).then_some(Stop::Idle)
        };
        self.closed = stop.is_some();
        stop
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
}
