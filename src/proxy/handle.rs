//! One request from start to answer: classify, refuse what needs no
//! store, fence a write (admission and the waits behind older writes),
//! forward, and answer with the log line and metrics.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::body::RequestBody;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Response};

use crate::config::TokenMode;
use crate::error::{ProxyBody, ProxyError};
use crate::fence::{FenceError, Raised};
use crate::token::FENCE_TOKEN;

use super::classify::*;
use super::context::*;
use super::linger;
use super::state::*;
use super::table::*;

/// The client of a request, and whether the forwarded headers it came
/// with are to be dropped. Without `trusted_proxies`: the peer (the PROXY
/// header's client on such a listener), headers kept. With it: from a
/// trusted peer, the first untrusted address of `X-Forwarded-For` read
/// from the right; from anyone else, the peer, its headers dropped.
pub(super) fn client_of(
    trusted: Option<&crate::proxy_protocol::TrustedProxies>,
    peer: Peer,
    headers: &HeaderMap,
) -> (std::net::IpAddr, bool) {
    let ip = peer.addr.ip();
    let Some(trusted) = trusted else {
        return (ip, false);
    };
    if !trusted.contains(ip) {
        return (ip, true);
    }
    let items = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','));
    (trusted.client_in_chain(items).unwrap_or(ip), false)
}

/// Drops every header whose name has an `_`, before anything reads the
/// request (nginx's `underscores_in_headers off`): CGI and WSGI backends
/// read `X_Forwarded_For` as `X-Forwarded-For` (both become
/// `HTTP_X_FORWARDED_FOR`), so such a name would pass the forwarded-header
/// rules, and a header-keyed route would see two spellings of one header.
pub(super) fn drop_underscored(headers: &mut HeaderMap) {
    // Most requests have none: one pass over the names, no allocation.
    if !headers.keys().any(|name| name.as_str().contains('_')) {
        return;
    }
    let names: Vec<header::HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().contains('_'))
        .cloned()
        .collect();
    for name in names {
        tracing::debug!(header = %name, "dropped a header whose name has an underscore");
        headers.remove(&name);
    }
}

/// The body of a request that may have none, whose head did not say
/// whether one follows (HTTP/2 without END_STREAM on its HEADERS, then
/// an empty DATA frame that ends the stream, as some clients send a GET):
/// read to its end before anything is forwarded. Data in it refuses the
/// request; none, and it goes on with no body at all.
async fn empty_body(
    req: Request<RequestBody>,
    websocket: bool,
    idle: Duration,
) -> Result<Request<RequestBody>, (Request<RequestBody>, ProxyError)> {
    use http_body_util::BodyExt;
    let (parts, mut body) = req.into_parts();
    loop {
        let refused = match tokio::time::timeout(idle, body.frame()).await {
            Ok(None) => break,
            Ok(Some(Ok(frame))) if frame.data_ref().is_none_or(|d| d.is_empty()) => continue,
            Ok(Some(Ok(_))) if websocket => no_body_here("a WebSocket handshake"),
            Ok(Some(Ok(_))) => no_body_here(parts.method.as_str()),
            Ok(Some(Err(_))) => ProxyError::BadFraming("the request body could not be read".into()),
            Err(_) => ProxyError::BodyTimeout,
        };
        return Err((Request::from_parts(parts, body), refused));
    }
    Ok(Request::from_parts(parts, RequestBody::Whole(None)))
}

/// Tells an HTTP/1.1 client that the connection ends after this answer
/// (HTTP/2 has no such header; hyper leaves it out there).
pub(super) fn close_after<B>(resp: &mut Response<B>) {
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
}

/// A fence call's failure when only the store can have failed.
pub(super) fn store_error(e: &FenceError) -> ProxyError {
    match e {
        FenceError::Store(s) => ProxyError::from_store(s),
        other => ProxyError::StoreUnavailable(other.to_string()),
    }
}

/// The `decision` label of a refused write, if the refusal is a fencing
/// decision (upstream failures are not).
pub(super) fn refusal_decision(err: &ProxyError) -> Option<&'static str> {
    Some(match err {
        ProxyError::Token(crate::token::TokenError::Missing) => "missing_token",
        ProxyError::Token(_) => "malformed_token",
        ProxyError::Stale { .. } => "stale",
        ProxyError::TokenTooFarAhead { .. } => "too_far_ahead",
        ProxyError::BadTarget(_) | ProxyError::KeyTooLong { .. } => "bad_key",
        ProxyError::Recovering { .. } => "recovering",
        ProxyError::OlderInFlight { .. } => "older_in_flight",
        ProxyError::StoreUnavailable(_) | ProxyError::StoreLostData(_) => "store_error",
        ProxyError::ShuttingDown => "shutting_down",
        _ => return None,
    })
}

impl Proxy {
    /// Serves one request. Never fails: every error becomes an answer.
    pub async fn handle(
        self: Arc<Self>,
        mut req: Request<RequestBody>,
        peer: Peer,
    ) -> Result<Response<ProxyBody>, Infallible> {
        // The routes this request lives with, whatever a reload swaps in
        // meanwhile: the route (and its pool) it starts with is the one it
        // ends with.
        let (table, mapping) = self.enter();
        drop_underscored(req.headers_mut());
        // Keep a sane client-sent request id, else make one; it goes
        // upstream and back to the client, and into the access log.
        let request_id = req
            .headers()
            .get(&X_REQUEST_ID)
            .filter(|v| {
                v.len() <= 128
                    && v.as_bytes()
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(b))
            })
            .cloned()
            .unwrap_or_else(|| self.next_request_id());
        req.headers_mut().insert(&X_REQUEST_ID, request_id.clone());
        let (client, forwarded_untrusted) =
            client_of(table.trusted.as_deref(), peer, req.headers());
        let mut record = Record {
            proxy: &self,
            peer,
            client,
            access_log: table.access_log,
            started: Instant::now(),
            request_id,
            target: req.uri().clone(),
            traceparent: req.headers().get(&TRACEPARENT).cloned(),
            user_agent: req.headers().get(http::header::USER_AGENT).cloned(),
            version: req.version(),
            ctx: RequestContext {
                peer: Some(peer),
                // Held until the request is known to be a read, or by a
                // write until it is no longer in flight.
                mapping: Some(mapping),
                // gRPC runs on HTTP/2 only: an HTTP/1.1 client gets
                // HTTP's answers.
                grpc: req.version() == http::Version::HTTP_2
                    && crate::error::is_grpc(req.headers()),
                forwarded_untrusted,
                client: Some(client),
                ..RequestContext::default()
            },
            done: false,
        };
        let (mut resp, status) = match self.serve(&table, req, &mut record.ctx).await {
            Ok(resp) => {
                let status = resp.status();
                // A body still to come is watched to its end: its pauses
                // are bounded, and a cut is logged after the head's line.
                let resp = if http_body::Body::is_end_stream(resp.body()) {
                    resp
                } else {
                    let origin = super::response::Origin {
                        metrics: self.metrics.clone(),
                        route: record.ctx.route.clone().unwrap_or_else(|| "-".into()),
                        request_id: record.request_id.clone(),
                        method: record.ctx.method.clone(),
                        target: record.target.clone(),
                        status,
                        access_log: record.access_log,
                        started: record.started,
                    };
                    let idle = self.limits.response_idle_timeout;
                    resp.map(|body| {
                        http_body_util::BodyExt::boxed(super::response::WatchedBody::new(
                            body, idle, origin,
                        ))
                    })
                };
                (resp, status)
            }
            Err(err) => {
                if record.ctx.write {
                    record.ctx.decision = refusal_decision(&err);
                }
                // Logged and counted as the HTTP status it stands for,
                // whatever form it takes (a gRPC refusal is an HTTP 200).
                let status = err.status();
                self.keep_refusal(&record, &err, status);
                let mut resp = self.refuse(err, &record.ctx, &record.request_id);
                match record.ctx.unread.take() {
                    None | Some(linger::Unread::None) => {}
                    Some(linger::Unread::Close) => close_after(&mut resp),
                    Some(linger::Unread::Linger { body, close }) => {
                        if close {
                            close_after(&mut resp);
                        }
                        linger::spawn_drain(body);
                    }
                }
                (resp, status)
            }
        };
        resp.headers_mut()
            .insert(&X_REQUEST_ID, record.request_id.clone());
        record.finish(status);
        Ok(resp)
    }

    /// Keeps `err`'s refusal in the ring the admin API and page read.
    fn keep_refusal(&self, record: &Record<'_>, err: &ProxyError, status: http::StatusCode) {
        let ctx = &record.ctx;
        // Writes only, refused by fencegate itself (the fence, a missing or
        // bad token or key, the store): a scanner's 404s or a backend's
        // 502s on reads must not push them out of the ring.
        if self.refusals.kept() == 0
            || !ctx.write
            || !(status.is_client_error() || ctx.decision.is_some())
        {
            return;
        }
        let highest = match err {
            ProxyError::Stale { highest, .. } => Some(*highest),
            _ => None,
        };
        let text = |v: &Option<HeaderValue>| {
            v.as_ref()
                .map(|v| crate::refusals::bounded(&String::from_utf8_lossy(v.as_bytes()), 256))
        };
        self.refusals.push(crate::refusals::Refusal {
            seq: 0,
            at_ms: crate::clock::wall_ms(),
            status: status.as_u16(),
            reason: err.to_string(),
            decision: ctx.decision,
            method: ctx.method.to_string(),
            target: crate::refusals::loggable_target(&record.target),
            route: ctx.route.clone(),
            key: ctx.key.clone(),
            token: ctx.token,
            highest,
            client: record.client,
            user_agent: text(&record.user_agent),
            request_id: record.request_id.to_str().unwrap_or("-").to_string(),
            trace_id: record.trace_id(),
        });
    }

    /// Keeps the raises this write's admission made in the ring the admin
    /// lookup reads: before the write is forwarded, so a client that hangs
    /// up mid-exchange still leaves its raise on record.
    fn keep_raises(&self, req: &Request<RequestBody>, ctx: &mut RequestContext) {
        let text = |name: &http::HeaderName| {
            req.headers()
                .get(name)
                .map(|v| crate::refusals::bounded(&String::from_utf8_lossy(v.as_bytes()), 256))
        };
        let since = ctx.raises_since;
        for (key, token, raised) in ctx.raised.drain(..) {
            let (kind, previous) = match raised {
                Raised::From { previous, .. } => (crate::raises::Kind::Raised, previous),
                Raised::Registered { .. } => (crate::raises::Kind::FirstHere, None),
            };
            self.raises.push(
                crate::raises::Raise {
                    seq: 0,
                    at_ms: raised.at_ms(),
                    kind,
                    key,
                    token,
                    previous,
                    method: ctx.method.to_string(),
                    target: crate::refusals::loggable_target(req.uri()),
                    client: ctx.client,
                    user_agent: text(&http::header::USER_AGENT),
                    request_id: text(&X_REQUEST_ID).unwrap_or_else(|| "-".into()),
                    trace_id: req
                        .headers()
                        .get(&TRACEPARENT)
                        .and_then(|v| crate::refusals::trace_id(v.as_bytes())),
                },
                since,
            );
        }
    }

    pub(super) fn refuse(
        &self,
        err: ProxyError,
        ctx: &RequestContext,
        request_id: &HeaderValue,
    ) -> Response<ProxyBody> {
        let route = ctx.route.as_deref().unwrap_or("-");
        if ctx.write {
            if let Some(d) = ctx.decision {
                self.metrics.writes.with_label_values(&[route, d]).inc();
            }
            if matches!(
                err,
                ProxyError::StoreUnavailable(_) | ProxyError::StoreLostData(_)
            ) {
                self.metrics.store_errors.with_label_values(&[route]).inc();
            }
        }
        let key = ctx.key.as_deref();
        match &err {
            ProxyError::Stale { token, highest } => tracing::warn!(
                route, key = key.unwrap_or("-"), token, highest, method = %ctx.method,
                "refused stale write"
            ),
            e if ctx.write && e.status().is_client_error() => tracing::info!(
                route, key = key.unwrap_or("-"), method = %ctx.method, status = e.status().as_u16(),
                reason = %e, "refused write"
            ),
            e if e.status().is_server_error() => tracing::warn!(
                route, key = key.unwrap_or("-"), method = %ctx.method, status = e.status().as_u16(),
                reason = %e, "request failed"
            ),
            e => tracing::debug!(route, status = e.status().as_u16(), reason = %e, "refused"),
        }
        if ctx.grpc {
            err.into_grpc_response()
        } else if let Some(resource) = &ctx.s3_resource {
            err.into_s3_response(
                Some(resource),
                key,
                request_id.to_str().unwrap_or("-"),
                ctx.s3_upload_step,
            )
        } else {
            err.into_response(key)
        }
    }

    pub(super) async fn serve(
        &self,
        table: &RouteTable,
        mut req: Request<RequestBody>,
        ctx: &mut RequestContext,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let Classified {
            rt,
            path,
            write,
            must_be_empty,
        } = match self.classify(table, &mut req, ctx) {
            Ok(classified) => classified,
            Err(e) => return Err(ctx.refused_unread(req, e)),
        };
        if must_be_empty {
            req = match empty_body(req, ctx.websocket, self.limits.body_read_timeout).await {
                Ok(req) => req,
                Err((req, e)) => return Err(ctx.refused_unread(req, e)),
            };
        }
        let _in_flight = GaugeGuard::new(rt.metrics.in_flight.clone());
        let Some(intent) = write else {
            ctx.mapping = None;
            if req.headers().contains_key(&FENCE_TOKEN) {
                rt.metrics.read_tokens_ignored.inc();
            }
            return self.forward(rt, req, &path, None, ctx).await;
        };
        let admitted = self.fence_write(table, rt, intent, ctx).await;
        // A raise stands even when the write is then refused (it waited
        // behind older writes past its limit, a newer token overtook it, a
        // later key of a COPY was taken).
        if !ctx.raised.is_empty() {
            self.keep_raises(&req, ctx);
        }
        let hold = match admitted {
            Ok(hold) => hold,
            Err(e) => return Err(ctx.refused_unread(req, e)),
        };
        self.forward(rt, req, &path, Some(hold), ctx).await
    }

    /// Admits a classified write: its token checked against each key's
    /// highest, behind the older writes it must follow (older key mappings,
    /// then each key's older writes in flight). The hold it returns keeps
    /// the write in flight for those who must wait for it.
    pub(super) async fn fence_write(
        &self,
        table: &RouteTable,
        rt: &RouteRuntime,
        intent: WriteIntent,
        ctx: &mut RequestContext,
    ) -> Result<WriteHold, ProxyError> {
        let route = &rt.route;
        let WriteIntent { mut keys, token } = intent;
        let granted_only = route.tokens == TokenMode::Granted;
        if route.max_token_step.is_some() || granted_only {
            for key in &keys {
                // Read before admission, not in it: the highest only rises,
                // and a token at or below it never raises it, so on a
                // granted route only a grant can (which makes more tokens
                // granted, never fewer).
                let highest = match self.fence.highest_known(key) {
                    // At or below a known lower bound: granted, and not too
                    // far ahead; no store round trip (a shared store's
                    // steady writes).
                    Some(h) if token <= h => Some(h),
                    _ => self.fence.highest(key).await.map_err(|e| store_error(&e))?,
                };
                if granted_only && highest.is_none_or(|h| token > h) {
                    ctx.key = Some(key.clone());
                    return Err(ProxyError::NotGranted { token });
                }
                if let (Some(step), Some(h)) = (route.max_token_step, highest) {
                    if token > h.saturating_add(step) {
                        ctx.key = Some(key.clone());
                        return Err(ProxyError::TokenTooFarAhead {
                            token,
                            highest: h,
                            max_step: step,
                        });
                    }
                }
            }
        }
        let started = Instant::now();
        // One limit for the whole wait: older mappings, then all keys of the
        // request. Past it the write is refused, never sent ahead of an
        // older write that may still be applied.
        let wait_until = tokio::time::Instant::now() + route.upstream_timeout;
        for older in &table.mapping.behind {
            if tokio::time::timeout_at(wait_until, older.wait())
                .await
                .is_err()
            {
                tracing::warn!(
                    route = %route.name,
                    "writes admitted before a reload that changed the key mapping are still in flight: refusing (503)"
                );
                return Err(ProxyError::OlderInFlight {
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        keys.sort();
        keys.dedup();
        let mut permits = Vec::with_capacity(keys.len());
        ctx.raises_since = self.raises.generation();
        for key in &keys {
            ctx.key = Some(key.clone());
            let mut raised = None;
            let admitted = self
                .fence
                .admit_noting(key, token, wait_until, route.upstream_timeout, &mut raised)
                .await;
            if let Some(r) = raised {
                ctx.raised.push((key.clone(), token, r));
            }
            match admitted {
                Ok(p) => {
                    if p.waited_out {
                        rt.metrics.admission_waited_out.inc();
                    }
                    permits.push(p);
                }
                Err(FenceError::Stale { token, highest }) => {
                    return Err(ProxyError::Stale { token, highest })
                }
                Err(FenceError::Store(e)) => {
                    self.metrics.store_up.set(0);
                    return Err(ProxyError::from_store(&e));
                }
                Err(FenceError::Recovering { retry_after }) => {
                    return Err(ProxyError::Recovering { retry_after })
                }
                Err(FenceError::Busy { retry_after }) => {
                    return Err(ProxyError::OlderInFlight { retry_after })
                }
            }
        }
        // Holding several keys (COPY/MOVE): while this write waited for one,
        // a newer writer may have taken over another. It must not go now.
        for (key, permit) in keys.iter().zip(&permits).filter(|_| keys.len() > 1) {
            let overtaken = self
                .fence
                .overtaken(permit)
                .await
                .map_err(|e| store_error(&e))?;
            if let Some(highest) = overtaken {
                ctx.key = Some(key.clone());
                return Err(ProxyError::Stale { token, highest });
            }
        }
        ctx.key = keys.first().cloned();
        self.metrics.store_up.set(1);
        rt.metrics
            .admission_wait
            .observe(started.elapsed().as_secs_f64());
        rt.metrics.admitted.inc();
        ctx.decision = Some("admitted");
        tracing::debug!(route = %route.name, key = ctx.key.as_deref().unwrap_or("-"), token, "admitted write");
        // The earliest key's deadline: time spent waiting for a second key
        // (COPY/MOVE) comes out of the exchange's share.
        let deadline = permits
            .iter()
            .map(|p| p.deadline())
            .min()
            .expect("a write holds at least one key");
        // Waiting for a later key (COPY/MOVE) may have used up the first
        // key's share: its newer writers stop waiting at that deadline, so
        // this write must not start after it.
        if tokio::time::Instant::now() >= deadline {
            return Err(ProxyError::OlderInFlight {
                retry_after: Duration::from_secs(1),
            });
        }
        // Counted before the check: the drain closes the tracker, then waits
        // for it, so a write either counts or sees it closed.
        let in_flight = self.exchanges.token();
        if self.exchanges.is_closed() {
            return Err(ProxyError::ShuttingDown);
        }
        Ok(WriteHold::new(InFlight {
            held: std::sync::Mutex::new(Some((permits, ctx.mapping.take(), in_flight))),
            deadline,
        }))
    }
}
