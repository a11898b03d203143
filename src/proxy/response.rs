//! A response body on its way from the upstream to the client: a pause
//! longer than `limits.response_idle_timeout` with no byte from the
//! upstream ends it (nginx's `proxy_read_timeout`), and a body that does
//! not reach its end is logged and counted as cut: its access-log line was
//! written with the head's status, which alone would read as a success.
//!
//! The other direction (a client that reads nothing) is the connection's
//! watchdog's (`server::progress`): an HTTP/1 server or an HTTP/2 stream
//! without flow-control window stops polling the body, so no timer in it
//! would run.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::HeaderValue;
use http_body::{Body, Frame, SizeHint};

use crate::error::{BoxError, ProxyBody};
use crate::metrics::Metrics;

/// Who a response is for, for the line a cut body leaves.
pub(super) struct Origin {
    pub(super) metrics: Arc<Metrics>,
    pub(super) route: String,
    pub(super) request_id: HeaderValue,
    pub(super) method: http::Method,
    pub(super) target: http::Uri,
    pub(super) status: http::StatusCode,
    pub(super) access_log: bool,
    pub(super) started: Instant,
}

pin_project_lite::pin_project! {
    /// See the module's documentation.
    pub(super) struct WatchedBody {
        #[pin]
        inner: ProxyBody,
        idle: Duration,
        // Armed when the body has nothing to give, disarmed by each frame.
        #[pin]
        timer: Option<tokio::time::Sleep>,
        armed: bool,
        sent: u64,
        // Ended (cleanly, or cut and already counted).
        done: bool,
        origin: Origin,
    }

    impl PinnedDrop for WatchedBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if !*this.done && !this.inner.is_end_stream() {
                this.origin.cut("dropped", *this.sent);
            }
        }
    }
}

impl Origin {
    fn cut(&self, reason: &'static str, sent: u64) {
        self.metrics
            .response_bodies_cut
            .with_label_values(&[&self.route, reason])
            .inc();
        if self.access_log {
            tracing::info!(
                target: "fencegate::access",
                request_id = self.request_id.to_str().unwrap_or("-"),
                method = %self.method,
                target = crate::refusals::loggable_target(&self.target),
                route = %self.route,
                status = self.status.as_u16(),
                reason,
                bytes = sent,
                latency_ms = self.started.elapsed().as_secs_f64() * 1000.0,
                "response body cut"
            );
        }
        if reason != "dropped" {
            tracing::warn!(route = %self.route, reason, bytes = sent, "response body cut");
        }
    }
}

impl WatchedBody {
    pub(super) fn new(inner: ProxyBody, idle: Duration, origin: Origin) -> Self {
        WatchedBody {
            inner,
            idle,
            timer: None,
            armed: false,
            sent: 0,
            done: false,
            origin,
        }
    }
}

impl Body for WatchedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                *this.armed = false;
                if let Some(data) = frame.data_ref() {
                    *this.sent += data.len() as u64;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                *this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                *this.done = true;
                this.origin.cut("upstream_failed", *this.sent);
                Poll::Ready(Some(Err(e)))
            }
            Poll::Pending => {
                // One timer per body, moved on rather than made anew: a
                // download pauses at every read.
                if !*this.armed {
                    *this.armed = true;
                    let at = tokio::time::Instant::now() + *this.idle;
                    match this.timer.as_mut().as_pin_mut() {
                        Some(timer) => timer.reset(at),
                        None => this.timer.set(Some(tokio::time::sleep_until(at))),
                    }
                }
                let timer = this.timer.as_mut().as_pin_mut().expect("armed");
                if std::future::Future::poll(timer, cx).is_pending() {
                    return Poll::Pending;
                }
                *this.done = true;
                this.origin.cut("upstream_stalled", *this.sent);
                Poll::Ready(Some(Err(format!(
                    "no byte from the upstream for {:?} (limits.response_idle_timeout)",
                    *this.idle
                )
                .into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
