//! What one request carries through the path: its context (method, key,
//! token, timings) and the record that becomes its access-log line and its
//! metrics however it ends.

use std::sync::Arc;
use std::time::Instant;

use super::body::RequestBody;
use http::header::HeaderValue;
use http::{Method, Request};
use tokio_util::task::task_tracker::TaskTrackerToken;

use crate::error::ProxyError;
use crate::fence::Permit;

use super::linger;
use super::state::*;

/// A write's permits, its key-mapping token, and its token in the drain's
/// tracker.
pub(super) type Held = (Vec<Permit>, Option<TaskTrackerToken>, TaskTrackerToken);

/// What keeps a write in flight for those who must wait for it: its fence
/// permits (newer writes to its keys) and its mapping token (writes under a
/// mapping that replaced it). The write's exchange and body are cut at
/// `deadline`, so nobody waits on it longer than that.
pub(super) struct InFlight {
    /// Taken (released) when the last holder is done, or at the deadline
    /// by [`InFlight::release_at_deadline`], whichever comes first. The
    /// second token counts the write in the drain's tracker of writes in
    /// flight (`Proxy::exchanges`): whatever keeps the write in flight (a
    /// 408, a body still uploading after an early answer) keeps a clean stop
    /// from being recorded.
    pub(super) held: std::sync::Mutex<Option<Held>>,
    pub(super) deadline: tokio::time::Instant,
}

impl InFlight {
    /// A request body still being sent after an early answer is cut at the
    /// deadline only when the upstream connection next polls it, which it
    /// does not while the upstream reads nothing. So the write stops
    /// holding its keys (and its mapping) at the deadline whatever the body
    /// does; newer writes wait [`crate::fence::CUT_GRACE`] beyond that anyway.
    /// With `keep`, the write stays in flight until then even if nothing
    /// else holds it (an answer that may not be its own: a 408).
    pub(super) fn release_at_deadline(hold: &Arc<InFlight>, keep: bool) {
        Self::release_after(hold, keep, tokio::time::sleep_until(hold.deadline));
    }

    /// The write stops holding its keys when `until` ends, whatever its
    /// body does; with `keep`, not before then either.
    fn release_after(
        hold: &Arc<InFlight>,
        keep: bool,
        until: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let weak = Arc::downgrade(hold);
        let kept = keep.then(|| hold.clone());
        tokio::spawn(async move {
            until.await;
            if let Some(hold) = weak.upgrade() {
                drop(hold.held.lock().expect("in-flight lock").take());
            }
            drop(kept);
        });
    }
}

/// A write's hold on its keys while it is forwarded: the exchange's share
/// and at most one share given to its request body. Neither can be
/// cloned, so "the body still holds the write" is exactly "the body's
/// share is alive" ([`WriteHold::body_holds`]); the write stays in flight
/// until both are gone, or its deadline ([`InFlight::release_at_deadline`]).
pub(super) struct WriteHold {
    in_flight: Arc<InFlight>,
    body_shared: bool,
}

/// A request body's share of its [`WriteHold`]: dropped at the body's last
/// byte, at a cut, or with the body.
pub(super) struct BodyHold(#[allow(dead_code)] Arc<InFlight>);

impl WriteHold {
    pub(super) fn new(in_flight: InFlight) -> Self {
        Self {
            in_flight: Arc::new(in_flight),
            body_shared: false,
        }
    }

    pub(super) fn deadline(&self) -> tokio::time::Instant {
        self.in_flight.deadline
    }

    /// The body's share (one per write).
    pub(super) fn body_share(&mut self) -> BodyHold {
        assert!(!self.body_shared, "a write's body takes one share");
        self.body_shared = true;
        BodyHold(self.in_flight.clone())
    }

    /// Whether the request body still holds the write.
    pub(super) fn body_holds(&self) -> bool {
        Arc::strong_count(&self.in_flight) > 1
    }

    /// See [`InFlight::release_at_deadline`].
    pub(super) fn release_at_deadline(&self, keep: bool) {
        InFlight::release_at_deadline(&self.in_flight, keep);
    }

    /// Keeps the write in flight until `settled` ends (it is bounded by
    /// the write's deadline), whatever its body does.
    pub(super) fn release_after(
        &self,
        settled: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        InFlight::release_after(&self.in_flight, true, settled);
    }
}

#[derive(Default)]
pub(super) struct RequestContext {
    pub(super) route: Option<String>,
    /// The route's request counters, once the route is known.
    pub(super) requests: Option<Arc<crate::metrics::RequestCounters>>,
    pub(super) key: Option<String>,
    pub(super) method: Method,
    pub(super) write: bool,
    pub(super) token: Option<u64>,
    pub(super) peer: Option<Peer>,
    /// The fencing decision of a write (`admitted`, `stale`...), for the
    /// access log.
    pub(super) decision: Option<&'static str>,
    /// Forwarding to the upstream's response head.
    pub(super) upstream_ms: Option<f64>,
    /// This request's place under its key mapping (see [`Mapping`]):
    /// released once it is known to be a read, kept by a write in flight.
    pub(super) mapping: Option<TaskTrackerToken>,
    /// A gRPC call: refused with a gRPC status, not problem+json.
    pub(super) grpc: bool,
    /// The route answers refusals in S3's form (`error_format = "s3"`):
    /// the request's path, the error's `<Resource>`.
    pub(super) s3_resource: Option<String>,
    /// On such a route, the step of a multipart upload (`UploadPart`...)
    /// that lacks its token, named in its refusal.
    pub(super) s3_upload_step: Option<&'static str>,
    /// The body of a request refused before it was read.
    pub(super) unread: Option<linger::Unread>,
    /// `trusted_proxies` is set and the peer is not in it: the forwarded
    /// headers it sent are replaced, not appended to.
    pub(super) forwarded_untrusted: bool,
    /// A WebSocket handshake on a route that passes them.
    pub(super) websocket: bool,
    /// The client (the peer, or the one trusted proxies name).
    pub(super) client: Option<std::net::IpAddr>,
    /// The keys whose highest this write's admission raised (see
    /// [`crate::fence::Raised`]): kept in the raise ring before the write
    /// is forwarded. Empty (no allocation) for every other request.
    pub(super) raised: Vec<(String, u64, crate::fence::Raised)>,
    /// The raise ring's reset generation before this write asked for its
    /// raises (see [`crate::raises::Raises::push`]).
    pub(super) raises_since: u64,
}

impl RequestContext {
    /// Keeps what the refusal of `req` needs of its unread body: the
    /// client must be able to read the answer (see [`linger`]).
    pub(super) fn refused_unread(
        &mut self,
        req: Request<RequestBody>,
        err: ProxyError,
    ) -> ProxyError {
        // A gRPC refusal is one HEADERS frame that ends the stream; gRPC
        // clients read it whatever happens to their request stream.
        if !self.grpc {
            let (parts, body) = req.into_parts();
            let framing = matches!(err, ProxyError::BadFraming(_));
            self.unread = Some(linger::Unread::of(
                &parts.method,
                parts.version,
                &parts.headers,
                body,
                framing,
            ));
        }
        err
    }
}

/// The access-log line and the request counter of one request, written
/// once: with its answer's status, or with 499 (nginx's "client closed
/// request") if the request is dropped first, so a write whose client went
/// away still leaves its trace while its exchange runs on.
pub(super) struct Record<'a> {
    pub(super) proxy: &'a Proxy,
    pub(super) peer: Peer,
    /// The client: the peer, or the one trusted proxies name.
    pub(super) client: std::net::IpAddr,
    pub(super) access_log: bool,
    pub(super) started: Instant,
    pub(super) request_id: HeaderValue,
    /// The request target, for the log line and a refusal's record.
    pub(super) target: http::Uri,
    /// The client's W3C `traceparent`, if it sent one (forwarded as it
    /// came; its trace id is logged).
    pub(super) traceparent: Option<HeaderValue>,
    pub(super) user_agent: Option<HeaderValue>,
    pub(super) version: http::Version,
    pub(super) ctx: RequestContext,
    pub(super) done: bool,
}

impl Record<'_> {
    /// The trace id of the client's `traceparent`, if it sent a valid one.
    pub(super) fn trace_id(&self) -> Option<String> {
        self.traceparent
            .as_ref()
            .and_then(|v| crate::refusals::trace_id(v.as_bytes()))
    }

    pub(super) fn finish(&mut self, status: http::StatusCode) {
        self.done = true;
        let ctx = &self.ctx;
        if self.access_log {
            let peer = self.peer;
            tracing::info!(
                target: "fencegate::access",
                request_id = self.request_id.to_str().unwrap_or("-"),
                client = %self.client,
                peer = %peer.addr,
                method = %ctx.method,
                target = crate::refusals::loggable_target(&self.target),
                trace_id = self.trace_id(),
                route = ctx.route.as_deref().unwrap_or("-"),
                key = ctx.key.as_deref().unwrap_or("-"),
                token = ctx.token,
                class = if ctx.write { "write" } else { "read" },
                decision = ctx.decision.unwrap_or("-"),
                status = status.as_u16(),
                version = ?self.version,
                tls = peer.tls,
                latency_ms = self.started.elapsed().as_secs_f64() * 1000.0,
                upstream_ms = ctx.upstream_ms,
                "request"
            );
        }
        match &ctx.requests {
            Some(counters) => counters.inc(ctx.write, status),
            None => self
                .proxy
                .metrics
                .requests
                .with_label_values(&[
                    "-",
                    if ctx.write { "write" } else { "read" },
                    status.as_str(),
                ])
                .inc(),
        }
    }
}

impl Drop for Record<'_> {
    fn drop(&mut self) {
        if !self.done {
            // A panic in the request path is the proxy's failure, not the
            // client's.
            self.finish(if std::thread::panicking() {
                http::StatusCode::INTERNAL_SERVER_ERROR
            } else {
                CLIENT_CLOSED
            });
        }
    }
}

/// nginx's status for a request whose client went away before its answer.
pub(super) const CLIENT_CLOSED: http::StatusCode = match http::StatusCode::from_u16(499) {
    Ok(s) => s,
    Err(_) => panic!("499 is a status code"),
};
