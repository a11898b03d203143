//! A kill switch on an HTTP/2 upstream connection.
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

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::rt::{Read, ReadBufCursor, Write};

use crate::error::{BoxError, ProxyBody};

/// Throws a [`Killable`] connection.
#[derive(Default)]
pub(super) struct KillSwitch {
    killed: AtomicBool,
    /// The connection's task, waiting to read and to write: woken so that
    /// it finds the switch thrown at once, not at the next frame.
    read: AtomicWaker,
    write: AtomicWaker,
}

impl KillSwitch {
    pub(super) fn is_killed(&self) -> bool {
        self.killed.load(Ordering::Acquire)
    }

    pub(super) fn kill(&self) {
        self.killed.store(true, Ordering::Release);
        self.read.wake();
        self.write.wake();
    }

    /// Registers the waker first, then reads the flag: a kill between the
    /// two wakes the waker just registered.
    fn check(&self, waker: &AtomicWaker, cx: &Context<'_>) -> io::Result<()> {
        waker.register(cx.waker());
        if self.killed.load(Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "a write was given up on this HTTP/2 connection",
            ));
        }
        Ok(())
    }
}

/// An upstream connection that fails once its [`KillSwitch`] is thrown.
pub(super) struct Killable<T> {
    io: T,
    switch: Arc<KillSwitch>,
}

impl<T> Killable<T> {
    pub(super) fn new(io: T) -> (Self, Arc<KillSwitch>) {
        let switch = Arc::new(KillSwitch::default());
        (
            Self {
                io,
                switch: switch.clone(),
            },
            switch,
        )
    }
}

impl<T: Read + Unpin> Read for Killable<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.read, cx)?;
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for Killable<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.write, cx)?;
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.write, cx)?;
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.write, cx)?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.switch.check(&this.switch.write, cx)?;
        Pin::new(&mut this.io).poll_shutdown(cx)
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
