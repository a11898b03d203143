//! A kill switch on an upstream connection of hyper's, and what its socket
//! still owes the backend when it goes.
//!
//! hyper runs an HTTP/2 client connection on a task of its own, and a
//! stream given up on is only reset: DATA frames already queued on the
//! connection, END_STREAM among them, still go out, and through a partition
//! they wait in fencegate's kernel and reach the backend after the heal,
//! after newer tokens (measured: 65-98 KB queued after the 504s in every
//! run). A write given up on throws the whole connection: its socket
//! fails every read and write from then on, hyper's connection task ends
//! and drops it, and `SO_LINGER` 0 (`dial.rs`) discards what the kernel
//! still holds.
//!
//! An *early answer* (the response head came while the write's body was
//! still being sent, on either HTTP version) leaves the opposite question:
//! the body's last byte handed to hyper is not a byte the backend has. It
//! may wait in hyper, in HTTP/2's flow control or in the kernel, and
//! through a partition it arrives after the heal, after newer tokens other
//! replicas forwarded (a black-box attack: 7 of 7 runs). Such a write
//! settles its connection ([`KillSwitch::settle`]): the connection takes no
//! new request, and when hyper lets it go, its socket is kept until the
//! kernel holds nothing more for the backend (`outq.rs`); at the write's
//! deadline whatever is left is thrown away with the connection. The write
//! holds its keys until the socket is gone ([`KillSwitch::gone`]).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use atomic_waker::AtomicWaker;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::rt::{Read, ReadBufCursor, Write};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::error::{BoxError, ProxyBody};

/// Throws a [`Killable`] connection, and says when its socket is gone.
#[derive(Default)]
pub(super) struct KillSwitch {
    killed: AtomicBool,
    /// The connection's task, waiting to read and to write: woken so that
    /// it finds the switch thrown at once, not at the next frame.
    read: AtomicWaker,
    write: AtomicWaker,
    /// A settling connection's drain (below), woken by a kill.
    kill_wakes: Notify,
    /// The socket's two ends, to ask the kernel what it still holds.
    addrs: Option<(SocketAddr, SocketAddr)>,
    /// An early-answered write settles this connection: it takes no new
    /// request, and its socket is kept until the kernel has delivered
    /// everything (or the connection is killed).
    settling: AtomicBool,
    /// Cancelled once the socket is closed: nothing of any request on it
    /// can reach the backend from then on.
    gone: CancellationToken,
}

impl KillSwitch {
    pub(super) fn is_killed(&self) -> bool {
        self.killed.load(Ordering::Acquire)
    }

    pub(super) fn kill(&self) {
        self.killed.store(true, Ordering::Release);
        self.read.wake();
        self.write.wake();
        self.kill_wakes.notify_waiters();
    }

    /// Whether an early-answered write settles the connection: no new
    /// request may go out on it.
    pub(super) fn is_settling(&self) -> bool {
        self.settling.load(Ordering::Acquire)
    }

    /// From now on the connection takes no new request, and its socket,
    /// once hyper lets it go, is kept until it is delivered.
    pub(super) fn begin_settling(&self) {
        self.settling.store(true, Ordering::Release);
    }

    /// Settles the connection for an early-answered write: returns once
    /// nothing it carried can reach the backend any more. That is when
    /// hyper has let the connection go and the kernel delivered all of
    /// it, or, at `deadline`, once the connection is thrown with whatever
    /// it still held. A kill that does not end the connection within a
    /// moment (its task never scheduled) gives up after the fence's
    /// [`crate::fence::CUT_GRACE`], which newer writes wait anyway.
    /// The caller has begun settling ([`KillSwitch::begin_settling`]).
    pub(super) async fn settle(self: Arc<Self>, deadline: tokio::time::Instant) {
        tokio::select! {
            _ = self.gone.cancelled() => return,
            _ = tokio::time::sleep_until(deadline) => {}
        }
        self.kill();
        let _ = tokio::time::timeout(crate::fence::CUT_GRACE, self.gone.cancelled()).await;
    }

    /// A future that ends when the socket is closed.
    #[cfg(test)]
    pub(super) fn gone(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.gone.cancelled()
    }

    /// Registers the waker first, then reads the flag: a kill between the
    /// two wakes the waker just registered.
    fn check(&self, waker: &AtomicWaker, cx: &Context<'_>) -> io::Result<()> {
        waker.register(cx.waker());
        if self.killed.load(Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "a write was given up on this upstream connection",
            ));
        }
        Ok(())
    }

    /// Returns once a settling connection's socket may be closed: the
    /// kernel holds nothing more for the backend, or the connection is
    /// killed. The pause between two looks grows from 1 ms to 50 ms: a
    /// healthy link is done within a round trip, and the table is read
    /// rarely after that.
    async fn delivered(&self) {
        let Some((local, peer)) = self.addrs else {
            // Nothing to ask the kernel about: held to the kill.
            return self.killed().await;
        };
        let mut pause = Duration::from_millis(1);
        // The table is read in pieces, not as one snapshot: a socket can
        // be missed while others open and close. Missing twice in a row
        // counts as gone (it cannot be: the caller holds it open).
        let mut missed = false;
        loop {
            let wait = self.kill_wakes.notified();
            if self.is_killed() {
                return;
            }
            match super::outq::unacknowledged(local, peer).await {
                Ok(Some(0)) => return,
                Ok(None) if missed => return,
                Ok(None) => missed = true,
                Ok(Some(_)) => missed = false,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read what the kernel holds for an upstream; \
                        the connection is kept until its write's deadline");
                    return self.killed().await;
                }
            }
            tokio::select! {
                _ = wait => return,
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Returns once the switch is thrown.
    async fn killed(&self) {
        let wait = self.kill_wakes.notified();
        if !self.is_killed() {
            wait.await;
        }
    }
}

/// An upstream connection that fails once its [`KillSwitch`] is thrown,
/// and whose socket a settling write keeps until it is delivered.
pub(super) struct Killable<T: Send + 'static> {
    /// Taken only when dropped.
    io: Option<T>,
    switch: Arc<KillSwitch>,
}

impl<T: Send + 'static> Killable<T> {
    /// `addrs`: the socket's local and peer addresses, when known.
    pub(super) fn new(io: T, addrs: Option<(SocketAddr, SocketAddr)>) -> (Self, Arc<KillSwitch>) {
        let switch = Arc::new(KillSwitch {
            addrs,
            ..KillSwitch::default()
        });
        (
            Self {
                io: Some(io),
                switch: switch.clone(),
            },
            switch,
        )
    }

    fn io(&mut self) -> Pin<&mut T>
    where
        T: Unpin,
    {
        Pin::new(self.io.as_mut().expect("taken only when dropped"))
    }
}

impl<T: Send + 'static> Drop for Killable<T> {
    fn drop(&mut self) {
        let Some(io) = self.io.take() else { return };
        let switch = self.switch.clone();
        if switch.is_settling() && !switch.is_killed() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    switch.delivered().await;
                    drop(io);
                    switch.gone.cancel();
                });
                return;
            }
        }
        drop(io);
        switch.gone.cancel();
    }
}

impl<T: Read + Unpin + Send + 'static> Read for Killable<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.read, cx)?;
        this.io().poll_read(cx, buf)
    }
}

impl<T: Write + Unpin + Send + 'static> Write for Killable<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.write, cx)?;
        this.io().poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.write, cx)?;
        this.io().poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(Write::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.write, cx)?;
        this.io().poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.write, cx)?;
        this.io().poll_shutdown(cx)
    }
}

/// Throws the switch when dropped armed: a write's exchange dropped before
/// its answer (its deadline passed) takes the connection with it.
pub(super) struct KillOnDrop(pub(super) Option<Arc<KillSwitch>>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(switch) = self.0.take() {
            switch.kill();
        }
    }
}

/// A write's request body that throws the switch when it fails: cut at
/// the write's deadline, by its client, or by a limit while it streams
/// after the answer's head came. Its stream would only be reset, and
/// frames of it already queued (whole messages, to a gRPC stream) would
/// still go out.
pub(super) struct KillOnCut {
    pub(super) inner: ProxyBody,
    pub(super) switch: Arc<KillSwitch>,
}

impl Body for KillOnCut {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            self.switch.kill();
        }
        polled
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
    use std::time::Duration;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A connection set to reset on close, as every upstream connection
    /// is (`dial.rs`), whose peer has read nothing of what was written,
    /// so that the kernel holds some of it; the peer's end, and the bytes
    /// written.
    async fn owing() -> (TcpStream, TcpStream, usize) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        socket2::SockRef::from(&ours)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        let (theirs, _) = listener.accept().await.unwrap();
        let chunk = vec![7u8; 1 << 16];
        let mut written = 0;
        // Until the socket takes no more (bounded by its buffers).
        while let Ok(n) = ours.try_write(&chunk) {
            written += n;
        }
        (ours, theirs, written)
    }

    fn killable(io: TcpStream) -> (Killable<TcpStream>, Arc<KillSwitch>) {
        let addrs = (io.local_addr().unwrap(), io.peer_addr().unwrap());
        Killable::new(io, Some(addrs))
    }

    /// Let go of by hyper, a settling connection's socket stays open until
    /// the peer has everything: closed earlier it would be reset, the
    /// rest thrown away, and the body would not arrive whole.
    #[tokio::test]
    async fn a_settling_connection_is_kept_until_the_kernel_delivered_it() {
        let (ours, mut theirs, written) = owing().await;
        let (io, switch) = killable(ours);
        switch.begin_settling();
        drop(io);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), switch.gone())
                .await
                .is_err(),
            "closed with bytes the peer has not had"
        );
        let mut got = 0;
        let mut buf = vec![0u8; 1 << 16];
        while got < written {
            match tokio::time::timeout(Duration::from_secs(10), theirs.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => got += n,
                other => panic!("after {got} of {written} bytes: {other:?}"),
            }
        }
        tokio::time::timeout(Duration::from_secs(10), switch.gone())
            .await
            .expect("closed once delivered");
    }

    /// A kill ends a drain that is waiting: the socket is reset with what
    /// it held.
    #[tokio::test]
    async fn a_kill_closes_a_settling_connection_at_once() {
        let (ours, _theirs, _) = owing().await;
        let (io, switch) = killable(ours);
        switch.begin_settling();
        drop(io);
        // The drain has begun waiting (it cannot end by itself: the peer
        // reads nothing).
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!switch.gone.is_cancelled());
        switch.kill();
        tokio::time::timeout(Duration::from_secs(10), switch.gone())
            .await
            .expect("closed at the kill");
    }

    /// A connection no write settles closes as it always did, at once.
    #[tokio::test]
    async fn an_unsettled_connection_closes_at_once() {
        let (ours, _theirs, _) = owing().await;
        let (io, switch) = killable(ours);
        drop(io);
        assert!(switch.gone.is_cancelled());
    }
}
