//! Serving connections: the accept loop of a listener, its connection
//! budget, the TLS handshake and PROXY protocol header, idle and header
//! timeouts, and one connection served until the drain: by the own
//! HTTP/1.1 lane ([`super::lane`]) on a proxy listener, else (or once the
//! lane hands it over) by hyper.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioExecutor;
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::heads::{close_unless_upgraded, may_upgrade, Refusal};
use super::lane::{serve_connection, ConnService, Handoff, Lane};
use super::progress::{Activity, Busy, Streaming, StreamingBody, Sweeper, Tracked};
use crate::error::ProxyBody;
use crate::metrics::Metrics;
use crate::tls::TlsTerminator;

/// When an accept loop stops and how long it waits for its connections.
#[derive(Clone)]
pub(super) struct Gate {
    pub(super) stop: CancellationToken,
    pub(super) grace: Duration,
    /// Cancelled when the grace period is over: connections still open
    /// (idle, reading, or a peer that never acknowledges the HTTP/2
    /// shutdown) are closed. Writes already forwarded run on as exchanges.
    pub(super) kill: CancellationToken,
    /// Every connection task, so the stop can wait until none is left to
    /// start a write.
    pub(super) connections: TaskTracker,
}

/// The TLS side of a listener.
#[derive(Clone)]
pub(super) struct TlsSide {
    pub(super) terminator: Arc<TlsTerminator>,
    /// A handshake must finish within this, like a request head.
    pub(super) timeout: Duration,
    pub(super) failures: prometheus::IntCounterVec,
}

impl TlsSide {
    /// Runs the handshake; `None` if it failed, timed out or the drain
    /// started meanwhile (a half-open handshake must not hold the drain).
    pub(super) async fn handshake<I>(
        &self,
        stream: I,
        peer: SocketAddr,
        stop: &CancellationToken,
    ) -> Option<tokio_rustls::server::TlsStream<I>>
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let accept = self.terminator.acceptor().accept(stream);
        let reason = tokio::select! {
            _ = stop.cancelled() => return None,
            done = tokio::time::timeout(self.timeout, accept) => match done {
                Ok(Ok(stream)) => return Some(stream),
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    "error"
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    "timeout"
                }
            },
        };
        self.failures.with_label_values(&[reason]).inc();
        None
    }
}

/// Descriptors kept back from client connections: the store's
/// connections, the listeners' own sockets, files, logs.
const RESERVED_DESCRIPTORS: usize = 64;

/// The admin listener's connections: its own few (a scrape, a page, an
/// operator's curl), kept out of the budget the data listeners share, so
/// a flood there cannot shut the operator out.
pub(super) const ADMIN_CONNECTIONS: usize = 256;

/// The client connections the data listeners (plain, TLS, lease) may hold
/// together, from the process's descriptor limit, so that a flood of
/// client connections cannot leave no descriptor for the upstream
/// connections and the store; `None` when the limit cannot be read.
///
/// A client connection holds one descriptor. What it may add upstream
/// depends on the routes: with every route's `upstream_max_connections`
/// capped, the upstream connections are at most the caps' sum, whatever
/// the number of clients (HTTP/2 streams and keep-alive requests share
/// the pool); a route without a cap, or one that passes WebSocket tunnels
/// (a tunnel holds its upstream connection for its life), may take one
/// upstream connection per client, so each client counts twice.
pub(super) fn descriptor_budget(routes: &[crate::config::Route]) -> Option<usize> {
    let nofile = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|soft| soft.parse::<usize>().ok())
        })?;
    Some(budget_under(nofile, upstream_descriptors(routes)))
}

/// The upstream connections `routes` may hold at most, or `None` when
/// one of them has no bound.
fn upstream_descriptors(routes: &[crate::config::Route]) -> Option<usize> {
    routes.iter().try_fold(0usize, |sum, r| {
        (r.upstream_max_connections > 0 && !r.websocket)
            .then(|| sum.saturating_add(r.upstream_max_connections))
    })
}

fn budget_under(nofile: usize, upstream: Option<usize>) -> usize {
    let left = nofile.saturating_sub(RESERVED_DESCRIPTORS + ADMIN_CONNECTIONS);
    match upstream {
        Some(n) => left.saturating_sub(n),
        None => left / 2,
    }
    .max(8)
}

/// A listener's connection budget and progress rule.
#[derive(Clone)]
pub(super) struct Slots {
    pub(super) name: &'static str,
    /// This listener's own limit (`limits.max_connections`).
    pub(super) free: Arc<tokio::sync::Semaphore>,
    /// The descriptors the data listeners share ([`descriptor_budget`]);
    /// `None` for the admin listener, which has its own few.
    pub(super) descriptors: Option<Arc<tokio::sync::Semaphore>>,
    /// A connection with no request being served that reads and writes
    /// nothing for this long is closed (HTTP/1 keep-alive, an HTTP/2
    /// connection without streams, a preface that never completes).
    pub(super) idle: Duration,
    /// A connection with a response still streaming is not idle: it is
    /// closed only once it has moved nothing for longer than this
    /// (`limits.response_idle_timeout`).
    pub(super) stalled: Duration,
    pub(super) metrics: Arc<Metrics>,
    /// Counts this accept loop's connections (a worker's share).
    pub(super) accepted: Option<prometheus::IntCounter>,
    /// Connections start with a PROXY protocol header, from these peers
    /// only (see [`crate::proxy_protocol`]).
    pub(super) proxy_protocol: Option<Arc<crate::proxy_protocol::TrustedProxies>>,
    pub(super) engines: Engines,
}

/// This listener's connections by the engine that serves them, resolved
/// once so that a connection costs no label lookup.
#[derive(Clone)]
pub(super) struct Engines {
    lane: prometheus::IntCounter,
    hyper: prometheus::IntCounter,
    handoffs: prometheus::IntCounter,
}

impl Engines {
    pub(super) fn new(metrics: &Metrics, listener: &str) -> Self {
        let served = |engine| {
            metrics
                .connections_served
                .with_label_values(&[listener, engine])
        };
        Self {
            lane: served("lane"),
            hyper: served("hyper"),
            handoffs: metrics.lane_handoffs.with_label_values(&[listener]),
        }
    }
}

impl Slots {
    /// Who the connection is for: the socket's peer, or on a listener
    /// with `proxy_protocol` the client its PROXY header names. `None`
    /// (the connection is to be closed, and is counted) if the peer is not
    /// a trusted proxy or its header does not parse in time.
    pub(super) async fn client(
        &self,
        stream: &mut tokio::net::TcpStream,
        peer: SocketAddr,
    ) -> Option<SocketAddr> {
        let Some(trusted) = &self.proxy_protocol else {
            return Some(peer);
        };
        if !trusted.contains(peer.ip()) {
            tracing::debug!(%peer, "closed: not in trusted_proxies, so it may not send a PROXY header");
            self.closed("untrusted_proxy");
            return None;
        }
        match crate::proxy_protocol::read_header(stream, self.idle).await {
            Ok(client) => Some(client.unwrap_or(peer)),
            Err(e) => {
                tracing::debug!(%peer, error = %e, "closed: bad PROXY protocol header");
                self.closed("proxy_protocol");
                None
            }
        }
    }

    pub(super) fn closed(&self, reason: &str) {
        self.metrics
            .connections_closed
            .with_label_values(&[self.name, reason])
            .inc();
    }

    /// Counts an open connection until the guard is dropped.
    pub(super) fn open(&self) -> impl Drop {
        struct Open(prometheus::IntGauge);
        impl Drop for Open {
            fn drop(&mut self) {
                self.0.dec();
            }
        }
        let g = self.metrics.connections.with_label_values(&[self.name]);
        g.inc();
        Open(g)
    }
}

/// The connection served by the lane (hyper if it hands over), or by hyper
/// alone, as a boxed future (see the accept loop).
fn engine<I, S>(
    lane: Option<Arc<Lane>>,
    io: I,
    peer: SocketAddr,
    activity: Arc<Activity>,
    stop: CancellationToken,
    hyper: Handoff<S>,
    engines: &Engines,
) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
where
    I: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + super::lane::WaitReadable
        + Unpin
        + Send
        + 'static,
    S: ConnService,
{
    match lane {
        Some(lane) => {
            engines.lane.inc();
            let peer = crate::proxy::Peer {
                addr: peer,
                tls: lane.tls,
            };
            Box::pin(lane.serve(io, peer, activity, stop, Box::new(hyper)))
        }
        None => {
            engines.hyper.inc();
            Box::pin(serve_connection(
                hyper.builder,
                io,
                hyper.service,
                hyper.watcher,
            ))
        }
    }
}

/// Accepts connections (TLS ones if `tls` is set) until the gate closes;
/// then drains them within the grace period. Returns whether every
/// connection finished in time.
pub(super) async fn accept_loop<F, Fut>(
    listener: TcpListener,
    builder: auto::Builder<TokioExecutor>,
    tls: Option<TlsSide>,
    gate: Gate,
    slots: Slots,
    lane: Option<Lane>,
    handler: F,
) -> bool
where
    F: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<http::Response<ProxyBody>, std::convert::Infallible>>
        + Send
        + 'static,
{
    let graceful = GracefulShutdown::new();
    let builder = Arc::new(builder);
    let lane = lane.map(Arc::new);
    let sweeper = Sweeper::new();
    // Tracked with the connections: the stop waits for it, and it ends at
    // the kill, having aborted the connections still open.
    let swept = slots.clone();
    gate.connections.spawn(sweeper.clone().run(
        slots.idle,
        slots.stalled,
        gate.kill.clone(),
        move |stop| swept.closed(stop.reason()),
    ));
    loop {
        tokio::select! {
            _ = gate.stop.cancelled() => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: back off
                        // instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // A full listener closes the connection at once: a flood of
                // idle sockets cannot take the descriptors that real
                // requests need.
                let Ok(slot) = slots.free.clone().try_acquire_owned() else {
                    slots.closed("limit");
                    drop(stream);
                    continue;
                };
                let descriptor = match &slots.descriptors {
                    None => None,
                    Some(d) => match d.clone().try_acquire_owned() {
                        Ok(p) => Some(p),
                        Err(_) => {
                            slots.closed("limit");
                            drop(stream);
                            continue;
                        }
                    },
                };
                if let Some(c) = &slots.accepted {
                    c.inc();
                }
                let _ = stream.set_nodelay(true);
                let activity = Arc::new(Activity::default());
                let mut stream = stream;
                // Progress is counted in the bytes the connection's engine
                // reads and writes: on TLS, plaintext, so that a client
                // that drips a record that never completes (no request
                // ever begins) is idle, as a silent one is.
                let tracked = activity.clone();
                let handler = handler.clone();
                let busy = activity.clone();
                let busy_watch = activity.clone();
                let open = slots.open();
                let behind = slots.clone();
                // Watched from accept on, so the drain also waits for a
                // connection still in its TLS handshake (which the drain
                // cuts short).
                let watcher = graceful.watcher();
                let builder = builder.clone();
                let (tls, stop) = (tls.clone(), gate.stop.clone());
                let lane = lane.clone();
                // Boxed, and dropped once the connection is served: all
                // that serving it needs is in the engine's own box, so an
                // idle connection's task holds two pointers (issue 44).
                let setup = Box::pin(async move {
                    let peer = behind.client(&mut stream, peer).await?;
                    let activity = busy.clone();
                    // What the lane's head guard refused, once hyper holds
                    // the connection (`heads.rs`).
                    let refusal = Arc::new(Refusal::default());
                    let refused = refusal.clone();
                    let service = service_fn(move |req: Request<Incoming>| {
                        let guard = Busy::new(&busy);
                        let opaque = may_upgrade(&req);
                        let to_head = req.method() == http::Method::HEAD;
                        let answer = match refused.answer(&req) {
                            Some(stand_in) => Err(stand_in),
                            None => Ok(handler(req, peer)),
                        };
                        let busy = busy.clone();
                        async move {
                            let mut resp = match answer {
                                Ok(answer) => match answer.await {
                                    Ok(resp) => resp,
                                    Err(never) => match never {},
                                },
                                Err(stand_in) => stand_in,
                            };
                            close_unless_upgraded(opaque, &mut resp);
                            // Whatever made the answer (a refusal, the
                            // upstream), an answer to HEAD has no body.
                            if to_head {
                                resp = crate::error::answer_to_head(resp);
                            }
                            // From the head on, the body keeps the
                            // connection from being idle until it ends
                            // (an event stream's pauses are not idleness).
                            let streaming = Streaming::new(&busy);
                            drop(guard);
                            if !http_body::Body::is_end_stream(resp.body()) {
                                resp = resp.map(|body| {
                                    http_body_util::BodyExt::boxed(StreamingBody::new(
                                        body, streaming,
                                    ))
                                });
                            }
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                    let engines = &behind.engines;
                    let handoffs = engines.handoffs.clone();
                    let hyper = Handoff { builder, service, watcher, refusal, handoffs };
                    // This task's future is as large as its largest state and
                    // lives as long as the connection, idle ones included
                    // (issue 44: 27 KB a connection with the engines and
                    // the handshake inline): they are boxed, each in a
                    // statement of its own, since rustc keeps the storage
                    // of a value moved out before an await if its binding
                    // or temporary outlives the await.
                    Some(match tls {
                        None => {
                            let stream = Tracked::new(stream, tracked);
                            engine(lane, stream, peer, activity, stop, hyper, engines)
                        }
                        Some(tls) => {
                            // The handshake is bounded by its own timeout.
                            let handshake = Box::pin(tls.handshake(stream, peer, &stop));
                            let stream = handshake.await?;
                            // HTTP/2 by ALPN is hyper's from the start.
                            let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                            activity.h2.store(h2, std::sync::atomic::Ordering::Relaxed);
                            let lane = lane.filter(|_| !h2);
                            let stream = Tracked::new(stream, tracked);
                            engine(lane, stream, peer, activity, stop, hyper, engines)
                        }
                    })
                });
                sweeper.spawn(busy_watch, |place| {
                    gate.connections.spawn(async move {
                        let _held = (open, slot, descriptor, place);
                        if let Some(served) = setup.await {
                            served.await
                        }
                    })
                });
            }
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => true,
        _ = tokio::time::sleep(gate.grace) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_counts_upstream_caps_once_and_uncapped_routes_per_client() {
        // 20,000 descriptors, one route capped at 64: a client costs one.
        assert_eq!(budget_under(20_000, Some(64)), 20_000 - 64 - 256 - 64);
        // A route without a cap: each client may hold an upstream too.
        assert_eq!(budget_under(20_000, None), (20_000 - 64 - 256) / 2);
        // A tiny limit still takes a few.
        assert_eq!(budget_under(200, Some(64)), 8);
        assert_eq!(budget_under(0, None), 8);
    }
}
