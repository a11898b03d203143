//! [`Server`]: start (open the store, build the fence and services, bind
//! the listeners, spawn their loops on the workers), wait, and the drain
//! that records a clean stop only when it completed.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::config::{Config, StoreConfig};
use crate::fence::Fence;
use crate::lease::Leases;
use crate::metrics::Metrics;
use crate::proxy::{Peer, Proxy};
use crate::store::embedded::EmbeddedStore;
use crate::store::instrumented::InstrumentedStore;
use crate::store::StoreError;
use crate::store::{FenceStore, StartState};
use crate::tls::TlsTerminator;
use crate::workers::Workers;

use super::conn::*;
use super::error::*;
use super::lane::{Lane, BODY_WAIT, MAX_WHOLE_BODY};
use super::reload::*;

/// A running fencegate.
pub struct Server {
    /// The plain proxy listener (`None` with `listen = "off"`).
    pub proxy_addr: Option<SocketAddr>,
    pub admin_addr: SocketAddr,
    /// The TLS listener, if `[tls]` is configured.
    pub tls_addr: Option<SocketAddr>,
    /// The lease API's listener, if `lease_listen` is configured.
    pub lease_addr: Option<SocketAddr>,
    pub(super) fence: Arc<Fence>,
    pub(super) shutdown: CancellationToken,
    pub(super) draining: CancellationToken,
    /// Accept loops (plain proxy and TLS proxy on every worker, admin):
    /// each answers whether its connections drained in time.
    pub(super) listeners: Vec<std::pin::Pin<Box<dyn Future<Output = bool> + Send>>>,
    /// The worker threads the proxy listeners run on; stopped once the
    /// drain is over (their runtimes carry the exchanges still in flight).
    pub(super) workers: Option<Workers>,
    /// Claims on the listen addresses (see [`crate::workers::bind`]).
    pub(super) _claims: Vec<std::os::unix::net::UnixListener>,
    /// The certificate file watcher; stops with `draining`.
    pub(super) tls_watcher: Option<JoinHandle<()>>,
    /// Rotates the in-flight marks (embedded store); stops with `draining`.
    pub(super) sweeper: JoinHandle<()>,
    /// Closes idle upstream connections; stops with `draining`.
    pub(super) reaper: JoinHandle<()>,
    /// Checks a shared store's marker every second, writes or not; stops
    /// with `draining`.
    pub(super) heartbeat: JoinHandle<()>,
    /// Upstream exchanges of admitted writes, which may outlive their
    /// client connection.
    pub(super) exchanges: TaskTracker,
    /// Closes the connections still open when the grace period ends.
    pub(super) kill: CancellationToken,
    /// Every connection task (see [`Gate::connections`]).
    pub(super) connections: TaskTracker,
    pub(super) grace: Duration,
    pub(super) reloader: Reloader,
}

pub(super) async fn bind(
    field: &'static str,
    addr: SocketAddr,
) -> Result<TcpListener, ServerError> {
    // tokio's `bind` asks for a backlog of 128: a burst of more new
    // connections than that (lease clients starting together, scrapers)
    // would have SYNs dropped and retried a second later. The proxy
    // listeners ask for 4096 (`workers::bind`).
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    };
    socket
        .and_then(|s| {
            s.set_reuseaddr(true)?;
            s.bind(addr)?;
            s.listen(1024)
        })
        .map_err(|e| ServerError::Bind {
            field,
            addr,
            reason: e.to_string(),
        })
}

/// One listening socket per worker on `addr`.
pub(super) fn bind_workers(
    field: &'static str,
    addr: SocketAddr,
    workers: usize,
) -> Result<crate::workers::Bound, ServerError> {
    crate::workers::bind(addr, workers).map_err(|e| ServerError::Bind {
        field,
        addr,
        reason: e.to_string(),
    })
}

/// A proxy listener's socket for one worker, and where its accept loop
/// reports whether its connections drained.
pub(super) struct Job {
    pub(super) listener: std::net::TcpListener,
    pub(super) tls: Option<TlsSide>,
    pub(super) slots: Slots,
    pub(super) done: tokio::sync::oneshot::Sender<bool>,
}

impl Server {
    /// Opens the store and binds the listeners. `shutdown` stops the server.
    pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Self, ServerError> {
        let metrics = Arc::new(Metrics::new());
        // Certificates before the store: a bad file is a config error, and
        // should not cost an unclean-stop window.
        let tls = config
            .tls
            .as_ref()
            .map(|t| TlsTerminator::new(t).map(Arc::new))
            .transpose()?;
        if let Some(tls) = &tls {
            metrics.track_tls();
            if let Some(t) = tls.not_after() {
                metrics.tls_not_after.set(t);
            }
        }
        // Listeners before the store: an address in use is a config error
        // too, and a start that fails on one must not leave a new store
        // file behind. (Connections wait in the backlog until the accept
        // loops run.)
        let workers = config
            .workers
            .unwrap_or_else(crate::workers::available_cpus);
        let proxy_listeners = match config.listen {
            Some(addr) => Some(bind_workers("listen", addr, workers)?),
            None => None,
        };
        let admin_listener = bind("admin_listen", config.admin_listen).await?;
        let lease_listener = match &config.lease {
            Some(l) => Some(bind("lease_listen", l.listen).await?),
            None => None,
        };
        let tls_listeners = match &config.tls {
            Some(t) => Some(bind_workers("tls.listen", t.listen, workers)?),
            None => None,
        };
        let store: Arc<dyn FenceStore> = match &config.store {
            StoreConfig::Embedded {
                path,
                cache_bytes,
                accept_loss,
            } => {
                let (path, cache, accept) = (path.clone(), *cache_bytes, *accept_loss);
                let window = config.max_upstream_timeout();
                let opened = tokio::task::spawn_blocking(move || {
                    EmbeddedStore::open_with(&path, cache, window, accept)
                })
                .await
                .expect("store open task")?;
                Arc::new(opened)
            }
            StoreConfig::Shared(shared) => {
                crate::store::connect_shared(shared, Some(&metrics.store_batch_size))?
            }
        };

        if let StoreConfig::Shared(shared) = &config.store {
            // Connect now, so schema setup, durability warnings and the
            // marker check happen at start. A store without a marker stops
            // the start (it is new, or was wiped: an operator must say
            // which), as does one that refuses our credentials or
            // certificates; one that is down only makes writes fail closed
            // until it answers, and is checked then.
            let bound = shared.timeout * 3 + Duration::from_secs(1);
            match tokio::time::timeout(bound, store.ping()).await {
                Ok(Ok(())) => {}
                // A wrong password or certificate is a setting to fix: say
                // so now rather than fail every write.
                Ok(Err(e @ (StoreError::Uninitialised | StoreError::Refused(_)))) => {
                    return Err(ServerError::SharedStore(e))
                }
                Ok(Err(e)) => {
                    tracing::warn!(store = store.kind(), error = %e, "fence store not usable at start: writes fail closed until it is")
                }
                Err(_) => {
                    tracing::warn!(
                        store = store.kind(),
                        "fence store not reachable at start: writes fail closed until it is"
                    )
                }
            }
        }
        let store: Arc<dyn FenceStore> = Arc::new(InstrumentedStore::new(store, metrics.clone()));
        let lease_margin = match &config.store {
            StoreConfig::Shared(s) => s.timeout + Duration::from_secs(1),
            StoreConfig::Embedded { .. } => Duration::from_secs(1),
        };
        let fence = Fence::with_lease_margin(
            store,
            config.highest_cache_entries,
            config.max_upstream_timeout(),
            lease_margin,
        );
        metrics
            .registry
            .register(Box::new(fence.waiting().clone()))
            .expect("register");
        if let StartState::Unclean { .. } = fence.store().start_state() {
            match (fence.recovering_for(), fence.held_keys()) {
                (Some(window), None) => tracing::warn!(
                    ?window,
                    "the last run did not stop cleanly and kept no record of its writes in flight: every write is refused (503) until writes forwarded before the crash can no longer be in flight"
                ),
                (Some(window), Some(keys)) => tracing::warn!(
                    ?window,
                    keys,
                    "the last run did not stop cleanly: newer tokens on the keys that had writes in flight are refused (503) until those writes can no longer be in flight; every other write goes as usual"
                ),
                (None, _) => tracing::info!(
                    "the last run did not stop cleanly, with no write in flight: nothing to wait for"
                ),
            }
        }
        let proxy = Arc::new(Proxy::new(
            &config,
            fence.clone(),
            metrics.clone(),
            workers,
        )?);
        // The crashed run's marks name keys under the mapping it recorded.
        let mapping = proxy.key_mapping();
        let record = fence.adopt_key_mapping(mapping);
        fence
            .store()
            .record_key_mapping(record)
            .await
            .map_err(ServerError::SharedStore)?;
        let exchanges = proxy.exchanges();
        let draining = CancellationToken::new();
        let admin = Arc::new(Admin {
            fence: fence.clone(),
            routes: proxy.clone(),
            metrics: metrics.clone(),
            admin_token: arc_swap::ArcSwapOption::from_pointee(config.admin_token.clone()),
            draining: draining.clone(),
            refusals: proxy.refusals(),
            raises: proxy.raises(),
        });

        metrics
            .workers
            .set(i64::try_from(workers).unwrap_or(i64::MAX));
        let leases = config.lease.as_ref().map(|l| {
            Arc::new(Leases {
                fence: fence.clone(),
                routes: proxy.clone(),
                metrics: metrics.clone(),
                bearers: arc_swap::ArcSwap::from_pointee(l.tokens.clone()),
                max_ttl: l.max_ttl,
                max_key_bytes: config.limits.max_key_bytes,
                released: tokio::sync::Notify::new(),
            })
        });
        let first = |ls: &Option<crate::workers::Bound>| {
            ls.as_ref()
                .map(|l| l.sockets[0].local_addr().expect("bound address"))
        };
        let proxy_addr = first(&proxy_listeners);
        warn_if_plain_bypasses_mtls(proxy_addr, &config);
        let admin_addr = admin_listener.local_addr().expect("bound address");
        let tls_addr = first(&tls_listeners);

        // HTTP/1.1, and HTTP/2 with prior knowledge (h2c) or by ALPN, on
        // the same port: the connection preface tells them apart.
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(config.limits.header_read_timeout)
            // The read buffer bounds the request head (431 above it); body
            // chunks are read through it too.
            .max_buf_size(config.limits.max_header_bytes.max(8192))
            .keep_alive(true);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_header_list_size(
                u32::try_from(config.limits.max_header_bytes).unwrap_or(u32::MAX),
            );
        let grace = config.shutdown_grace;
        let kill = CancellationToken::new();
        let connections = TaskTracker::new();
        let gate = Gate {
            stop: draining.clone(),
            grace,
            kill: kill.clone(),
            connections: connections.clone(),
        };
        let configured = config.limits.max_connections;
        let descriptors = descriptor_budget(&config.routes);
        if let Some(budget) = descriptors.filter(|b| *b < configured) {
            tracing::info!(
                configured,
                budget,
                "the file-descriptor limit holds fewer client connections than limits.max_connections: the data listeners hold at most the budget together"
            );
        }
        let descriptors = descriptors.map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
        // One limit per listener, shared by its workers' accept loops; the
        // data listeners also share the descriptor budget.
        let slots = |name: &'static str| Slots {
            name,
            free: Arc::new(tokio::sync::Semaphore::new(match name {
                "admin" => configured.min(ADMIN_CONNECTIONS),
                _ => configured,
            })),
            descriptors: descriptors.clone().filter(|_| name != "admin"),
            idle: config.limits.header_read_timeout,
            stalled: config.limits.response_idle_timeout,
            metrics: metrics.clone(),
            accepted: None,
            proxy_protocol: None,
            engines: super::conn::Engines::new(&metrics, name),
        };
        let mut listeners: Vec<std::pin::Pin<Box<dyn Future<Output = bool> + Send>>> = Vec::new();
        let mut jobs: Vec<Vec<Job>> = (0..workers).map(|_| Vec::new()).collect();
        let mut claims = Vec::new();
        let mut assign = |bound: crate::workers::Bound, tls: Option<TlsSide>, slots: Slots| {
            claims.extend(bound.claim);
            for (i, listener) in bound.sockets.into_iter().enumerate() {
                let (done, result) = tokio::sync::oneshot::channel();
                listeners.push(Box::pin(async move { result.await.unwrap_or(false) }));
                jobs[i].push(Job {
                    listener,
                    tls: tls.clone(),
                    slots: slots.clone(),
                    done,
                });
            }
        };
        let trusted = config.trusted_proxies.clone().map(Arc::new);
        let with_proxy_protocol = |mut slots: Slots, on: bool| {
            slots.proxy_protocol = trusted.clone().filter(|_| on);
            slots
        };
        if let Some(sockets) = proxy_listeners {
            assign(
                sockets,
                None,
                with_proxy_protocol(slots("proxy"), config.proxy_protocol),
            );
        }
        if let (Some(sockets), Some(terminator)) = (tls_listeners, &tls) {
            let side = TlsSide {
                terminator: terminator.clone(),
                timeout: config.limits.header_read_timeout,
                failures: metrics.tls_handshake_failures.clone(),
            };
            let on = config.tls.as_ref().is_some_and(|t| t.proxy_protocol);
            assign(sockets, Some(side), with_proxy_protocol(slots("tls"), on));
        }
        let jobs = Arc::new(std::sync::Mutex::new(
            jobs.into_iter().map(Some).collect::<Vec<_>>(),
        ));
        // The own HTTP/1.1 lane of the proxy listeners (issue 32), with the
        // limits hyper's side applies.
        let lane = Lane {
            proxy: proxy.clone(),
            tls: false,
            max_head: config.limits.max_header_bytes.max(8192),
            max_body: config
                .limits
                .max_body_bytes
                .map_or(MAX_WHOLE_BODY, |m| m.min(MAX_WHOLE_BODY)),
            header_timeout: config.limits.header_read_timeout,
            body_wait: config.limits.body_read_timeout.min(BODY_WAIT),
        };
        let worker_threads = {
            let (proxy, builder, gate) = (proxy.clone(), builder.clone(), gate.clone());
            Workers::start(workers, move |i| {
                let mine = jobs.lock().expect("jobs lock")[i].take().unwrap_or_default();
                let (proxy, builder, gate) = (proxy.clone(), builder.clone(), gate.clone());
                let lane = lane.clone();
                async move {
                    for job in mine {
                        let on_tls = job.tls.is_some();
                        let mut slots = job.slots;
                        let worker = i.to_string();
                        slots.accepted = Some(
                            slots
                                .metrics
                                .worker_connections
                                .with_label_values(&[slots.name, &worker]),
                        );
                        let listener = match TcpListener::from_std(job.listener) {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::error!(worker = i, error = %e, "cannot serve a listener on this worker");
                                let _ = job.done.send(false);
                                continue;
                            }
                        };
                        let proxy = proxy.clone();
                        let serving = accept_loop(
                            listener,
                            builder.clone(),
                            job.tls,
                            gate.clone(),
                            slots,
                            Some(Lane { proxy: proxy.clone(), tls: on_tls, ..lane.clone() }),
                            move |req: http::Request<hyper::body::Incoming>, addr| {
                                proxy.clone().handle(req.map(Into::into), Peer { addr, tls: on_tls })
                            },
                        );
                        let done = job.done;
                        tokio::spawn(async move {
                            let _ = done.send(serving.await);
                        });
                    }
                }
            })
            .map_err(|e| ServerError::Bind {
                field: "workers",
                addr: proxy_addr.or(tls_addr).unwrap_or(admin_addr),
                reason: format!("cannot start the worker threads: {e}"),
            })?
        };
        let admin_handler = admin.clone();
        let admin_loop = tokio::spawn(accept_loop(
            admin_listener,
            builder.clone(),
            None,
            gate.clone(),
            slots("admin"),
            None,
            move |req, _peer| admin_handler.clone().handle(req),
        ));
        listeners.push(Box::pin(async move { admin_loop.await.unwrap_or(false) }));
        let lease_addr = lease_listener
            .as_ref()
            .map(|l| l.local_addr().expect("bound address"));
        if let (Some(listener), Some(leases)) = (lease_listener, leases.clone()) {
            let lease_loop = tokio::spawn(accept_loop(
                listener,
                builder,
                None,
                gate,
                slots("lease"),
                None,
                move |req, _peer| leases.clone().handle(req),
            ));
            listeners.push(Box::pin(async move { lease_loop.await.unwrap_or(false) }));
        }
        let tls_watcher = match (&tls, &config.tls) {
            (Some(tls), Some(files)) => {
                let metrics = metrics.clone();
                let terminator = tls.clone();
                Some(tokio::spawn(tls.clone().watch(
                    files.watch_interval,
                    draining.clone(),
                    move |result| {
                        log_tls_reload("certificate files changed", result, &metrics, &terminator)
                    },
                )))
            }
            _ => None,
        };
        let sweeper = tokio::spawn(fence.clone().keep_marks(draining.clone()));
        let reaper = tokio::spawn(proxy.clone().reap_idle_connections(draining.clone()));
        let heartbeat = tokio::spawn(store_heartbeat(fence.store().clone(), draining.clone()));
        let or_off = |a: Option<SocketAddr>| a.map_or_else(|| "off".to_string(), |a| a.to_string());
        tracing::info!(
            proxy_addr = %or_off(proxy_addr),
            %admin_addr,
            tls_addr = %or_off(tls_addr),
            lease_addr = %or_off(lease_addr),
            routes = config.routes.len(),
            workers,
            "fencegate started"
        );
        let reloader = Reloader(Arc::new(ReloadState {
            proxy,
            proxy_addr,
            admin,
            leases,
            tls,
            metrics,
            started: config,
            lock: tokio::sync::Mutex::new(()),
            fence: fence.clone(),
            settles: TaskTracker::new(),
            draining: draining.clone(),
        }));
        if record != mapping {
            reloader.settle_key_mapping();
        }
        Ok(Self {
            proxy_addr,
            admin_addr,
            tls_addr,
            lease_addr,
            fence,
            shutdown,
            draining,
            listeners,
            workers: Some(worker_threads),
            _claims: claims,
            tls_watcher,
            sweeper,
            reaper,
            heartbeat,
            exchanges,
            kill,
            connections,
            grace,
            reloader,
        })
    }

    /// A handle that applies a new config to this server (SIGHUP).
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
    }

    /// Runs until the shutdown token is cancelled, then drains and closes.
    /// Returns whether the stop was clean (drained and recorded).
    pub async fn wait(mut self) -> bool {
        let workers = self.workers.take();
        let fence = self.fence.clone();
        let clean = self.drain().await;
        // Lease releases run on the worker runtimes: let them land first.
        fence.settle(Duration::from_secs(2)).await;
        if let Some(w) = workers {
            w.stop().await;
        }
        clean
    }

    pub(super) async fn drain(self) -> bool {
        self.shutdown.cancelled().await;
        tracing::info!(grace = ?self.grace, "shutting down: draining in-flight requests");
        let deadline = tokio::time::Instant::now() + self.grace;
        self.draining.cancel();
        let mut connections_drained = true;
        for listener in self.listeners {
            connections_drained &= listener.await;
        }
        if let Some(watcher) = self.tls_watcher {
            let _ = watcher.await;
        }
        let _ = self.sweeper.await;
        let _ = self.reaper.await;
        let _ = self.heartbeat.await;
        self.reloader.0.settles.close();
        self.reloader.0.settles.wait().await;
        if !connections_drained {
            tracing::warn!("grace period over: closing the connections still open");
        }
        // No connection is left to start a write once this returns; one
        // that was admitted but not yet forwarded is dropped unsent.
        self.kill.cancel();
        self.connections.close();
        self.connections.wait().await;
        // Writes already forwarded run on as exchanges (also those whose
        // clients went away): they must end before a clean stop can be
        // recorded. Reads and idle connections do not matter.
        self.exchanges.close();
        let exchanges_done = tokio::time::timeout_at(deadline, self.exchanges.wait())
            .await
            .is_ok();
        if !exchanges_done {
            tracing::warn!(
                "grace period over with writes still in flight upstream: not marking a clean stop"
            );
            return false;
        }
        // Writes a crashed run forwarded may still be in flight: a clean
        // mark now would let the next start forward newer writes at once.
        // Left unclean, the next start waits a whole window again (longer
        // than what is left, never shorter).
        if let Some(left) = self.fence.recovering_for() {
            tracing::warn!(
                left = ?left,
                "drained, but still within the crash-recovery window: not marking a clean stop"
            );
            return false;
        }
        match self.fence.store().close_clean().await {
            Ok(()) => {
                tracing::info!("drained; clean stop recorded");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not record a clean stop");
                false
            }
        }
    }
}

/// How often the heartbeat asks a shared store's marker to be checked; a
/// check runs when the last one is a second old (the store's
/// `MARKER_INTERVAL`), so an idle replica checks at most 1.25 s apart.
pub(super) const HEARTBEAT: Duration = Duration::from_millis(250);

/// Shared stores: checks and advances the store's marker every
/// second even while no write comes (`check_marker` runs the check when
/// it is due, and nothing otherwise). Every running replica then knows a recent sequence number, so a
/// store rolled back to an older state (a restored backup or snapshot) is
/// caught at the first call after it, by replicas that never wrote the
/// keys it lost too. Failures show in `/readyz`; nothing to do here.
pub(super) async fn store_heartbeat(
    store: Arc<dyn crate::store::FenceStore>,
    stop: CancellationToken,
) {
    if store.exclusive() {
        return;
    }
    let mut tick = tokio::time::interval(HEARTBEAT);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            // The store's calls have their own timeouts.
            _ = async {
                tick.tick().await;
                let _ = store.check_marker().await;
            } => {}
        }
    }
}
