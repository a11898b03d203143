//! Listeners, connection serving and graceful shutdown.
//!
//! [`Server::start`] opens the store, binds the listeners (plain proxy,
//! optional TLS proxy, admin) and spawns their accept loops;
//! [`Server::wait`] runs until the cancellation token fires, then stops
//! accepting, drains in-flight requests within the grace period and, only if
//! the drain completed, records a clean stop in the store. [`Reloader`]
//! applies a new config to the running server (SIGHUP) without touching
//! connections in flight.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::config::{Config, StoreConfig};
use crate::error::ProxyBody;
use crate::fence::Fence;
use crate::lease::Leases;
use crate::metrics::Metrics;
use crate::proxy::{Peer, Proxy};
use crate::store::embedded::{EmbeddedStore, OpenError};
use crate::store::instrumented::InstrumentedStore;
use crate::store::StoreError;
use crate::store::{FenceStore, StartState};
use crate::tls::{TlsError, TlsTerminator};
use crate::workers::Workers;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Store(#[from] OpenError),
    #[error(transparent)]
    Connect(#[from] crate::store::ConnectError),
    /// The store answered, but cannot be used (a shared store without a
    /// marker, an embedded one that cannot record the key mapping).
    #[error("invalid `store`: {0}")]
    SharedStore(StoreError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot listen on {addr} (`{field}`): {reason}")]
    Bind {
        field: &'static str,
        addr: SocketAddr,
        reason: String,
    },
}

/// Why a reload was refused; the running config stays in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("the reload task failed: {0}")]
    Task(String),
    #[error("the key mapping could not be recorded in the store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("invalid `routes`: upstream_timeout {new:?} is longer than the {started:?} the server started with; the crash-recovery window and shared-store leases were sized from it, so a longer one needs a restart")]
    LongerUpstreamTimeout { new: Duration, started: Duration },
}

/// A running fencegate.
pub struct Server {
    /// The plain proxy listener (`None` with `listen = "off"`).
    pub proxy_addr: Option<SocketAddr>,
    pub admin_addr: SocketAddr,
    /// The TLS listener, if `[tls]` is configured.
    pub tls_addr: Option<SocketAddr>,
    /// The lease API's listener, if `lease_listen` is configured.
    pub lease_addr: Option<SocketAddr>,
    fence: Arc<Fence>,
    shutdown: CancellationToken,
    draining: CancellationToken,
    /// Accept loops (plain proxy and TLS proxy on every worker, admin):
    /// each answers whether its connections drained in time.
    listeners: Vec<std::pin::Pin<Box<dyn Future<Output = bool> + Send>>>,
    /// The worker threads the proxy listeners run on; stopped once the
    /// drain is over (their runtimes carry the exchanges still in flight).
    workers: Option<Workers>,
    /// Claims on the listen addresses (see [`crate::workers::bind`]).
    _claims: Vec<std::os::unix::net::UnixListener>,
    /// The certificate file watcher; stops with `draining`.
    tls_watcher: Option<JoinHandle<()>>,
    /// Rotates the in-flight marks (embedded store); stops with `draining`.
    sweeper: JoinHandle<()>,
    /// Closes idle upstream connections; stops with `draining`.
    reaper: JoinHandle<()>,
    /// Checks a shared store's marker every second, writes or not; stops
    /// with `draining`.
    heartbeat: JoinHandle<()>,
    /// Upstream exchanges of admitted writes, which may outlive their
    /// client connection.
    exchanges: TaskTracker,
    /// Closes the connections still open when the grace period ends.
    kill: CancellationToken,
    /// Every connection task (see [`Gate::connections`]).
    connections: TaskTracker,
    grace: Duration,
    reloader: Reloader,
}

async fn bind(field: &'static str, addr: SocketAddr) -> Result<TcpListener, ServerError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| ServerError::Bind {
            field,
            addr,
            reason: e.to_string(),
        })
}

/// One listening socket per worker on `addr`.
fn bind_workers(
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
struct Job {
    listener: std::net::TcpListener,
    tls: Option<TlsSide>,
    slots: Slots,
    done: tokio::sync::oneshot::Sender<bool>,
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
            StoreConfig::Embedded { path, cache_bytes } => {
                let (path, cache) = (path.clone(), *cache_bytes);
                let window = config.max_upstream_timeout();
                let opened =
                    tokio::task::spawn_blocking(move || EmbeddedStore::open(&path, cache, window))
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
        let per_listener = connection_budget(config.limits.max_connections);
        // One budget per listener, shared by its workers' accept loops.
        let slots = |name: &'static str| Slots {
            name,
            free: Arc::new(tokio::sync::Semaphore::new(per_listener)),
            idle: config.limits.header_read_timeout,
            metrics: metrics.clone(),
            accepted: None,
            proxy_protocol: None,
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
        let worker_threads = {
            let (proxy, builder, gate) = (proxy.clone(), builder.clone(), gate.clone());
            Workers::start(workers, move |i| {
                let mine = jobs.lock().expect("jobs lock")[i].take().unwrap_or_default();
                let (proxy, builder, gate) = (proxy.clone(), builder.clone(), gate.clone());
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
                            move |req, addr| proxy.clone().handle(req, Peer { addr, tls: on_tls }),
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

    async fn drain(self) -> bool {
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

/// With client certificates required on the TLS listener, a plain listener
/// reachable from elsewhere takes the same requests without any.
fn warn_if_plain_bypasses_mtls(plain: Option<SocketAddr>, config: &Config) {
    if let (Some(addr), Some(t)) = (plain, &config.tls) {
        if t.client_ca.is_some() && !addr.ip().is_loopback() {
            tracing::warn!(listen = %addr, "client certificates are required on the TLS listener, but the plain listener takes requests without any: bind it to loopback or set listen = \"off\"");
        }
    }
}

fn log_tls_reload(
    why: &str,
    result: &Result<(), TlsError>,
    metrics: &Metrics,
    tls: &TlsTerminator,
) {
    // Logged before counted: whoever sees the count finds the log line.
    match result {
        Ok(()) => tracing::info!(why, "TLS certificates reloaded"),
        Err(e) => {
            tracing::error!(why, error = %e, "TLS certificates not reloaded; the previous ones stay in force")
        }
    }
    metrics.reloaded("tls", result.is_ok());
    // An unreadable notAfter leaves the gauge alone: 0 would read as long
    // expired.
    if let Some(t) = tls.not_after() {
        metrics.tls_not_after.set(t);
    }
}

/// Applies a new configuration to a running server.
#[derive(Clone)]
pub struct Reloader(Arc<ReloadState>);

struct ReloadState {
    proxy: Arc<Proxy>,
    /// The plain listener's bound address.
    proxy_addr: Option<SocketAddr>,
    admin: Arc<Admin>,
    /// The lease API, whose bearer tokens a reload replaces.
    leases: Option<Arc<Leases>>,
    tls: Option<Arc<TlsTerminator>>,
    metrics: Arc<Metrics>,
    /// What the server started with: listeners, store and limits cannot
    /// change without a restart.
    started: Config,
    /// One reload at a time.
    lock: tokio::sync::Mutex<()>,
    fence: Arc<Fence>,
    /// Tasks that record a key mapping once writes under older ones ended
    /// ([`Reloader::settle_key_mapping`]); they stop at the drain.
    settles: TaskTracker,
    draining: CancellationToken,
}

impl Reloader {
    /// Swaps in the routes (with their upstream TLS), the access log
    /// switch, the admin token and the TLS listener's certificate files of
    /// `new`. Nothing changes unless all of them load. Connections and
    /// requests in flight are not touched. Returns the changed settings that
    /// only a restart applies (they are logged and ignored).
    pub async fn reload(&self, new: &Config) -> Result<Vec<&'static str>, ReloadError> {
        let _one = self.0.lock.lock().await;
        // A new key mapping: until writes under the old one have ended,
        // a crash leaves marks under both, and the next start must hold
        // every key (`Fence::adopt_key_mapping`). Recorded before any
        // write is admitted under the new one.
        let remap = Proxy::key_mapping_of(new) != self.0.proxy.key_mapping();
        let result = match self.record_remap(remap).await {
            // Loading certificate and CA files blocks: off the runtime threads.
            Ok(()) => {
                let (this, config) = (self.clone(), new.clone());
                tokio::task::spawn_blocking(move || this.apply(&config))
                    .await
                    .unwrap_or_else(|e| Err(ReloadError::Task(e.to_string())))
            }
            Err(e) => Err(e),
        };
        if remap {
            self.settle_key_mapping();
        }
        match &result {
            Ok(ignored) => tracing::info!(
                routes = new.routes.len(),
                needs_restart = ?ignored,
                "config reloaded"
            ),
            Err(e) => {
                tracing::error!(error = %e, "config not reloaded; the previous one stays in force")
            }
        }
        self.0.metrics.reloaded("config", result.is_ok());
        result
    }

    /// Before a reload that remaps keys: records the mapping as mixed, and
    /// holds every key if a crash-recovery window is running.
    async fn record_remap(&self, remap: bool) -> Result<(), ReloadError> {
        if remap {
            let fence = &self.0.fence;
            fence
                .store()
                .record_key_mapping(crate::store::KEY_MAPPING_MIXED)
                .await?;
            fence.hold_every_key_while_recovering();
        }
        Ok(())
    }

    /// Records the key mapping in force in the store once no write under
    /// another one can be in flight (nor a crashed run's, the recovery
    /// window over): a crash after that holds only the keys it marked.
    fn settle_key_mapping(&self) {
        let this = self.0.clone();
        let settled = this.proxy.key_mapping_settled();
        let mapping = this.proxy.key_mapping();
        let stop = this.draining.clone();
        self.0.settles.spawn(async move {
            let wait = async {
                if let Some(left) = this.fence.recovering_for() {
                    tokio::time::sleep(left).await;
                }
                settled.await;
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = wait => {}
            }
            loop {
                {
                    // Not past a newer reload (its own task records its
                    // mapping).
                    let _one = this.lock.lock().await;
                    if this.proxy.key_mapping() != mapping {
                        return;
                    }
                    if this.proxy.key_mapping_is_settled() && this.fence.recovering_for().is_none()
                    {
                        match this.fence.store().record_key_mapping(mapping).await {
                            Ok(()) => {
                                tracing::info!("key mapping recorded: a crash from now on holds only the keys with writes in flight");
                                return;
                            }
                            Err(e) => tracing::warn!(error = %e, "key mapping not recorded yet; a crash now holds every key for the recovery window"),
                        }
                    }
                }
                // Not yet (a write just entering under the old mapping, a
                // window that ends this instant, a store error): again.
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
    }

    /// Records a reload whose config did not even load.
    pub fn refused(&self, why: &str) {
        tracing::error!(
            error = why,
            "config not reloaded; the previous one stays in force"
        );
        self.0.metrics.reloaded("config", false);
    }

    fn apply(&self, new: &Config) -> Result<Vec<&'static str>, ReloadError> {
        let started = &self.0.started;
        if new.max_upstream_timeout() > started.max_upstream_timeout() {
            return Err(ReloadError::LongerUpstreamTimeout {
                new: new.max_upstream_timeout(),
                started: started.max_upstream_timeout(),
            });
        }
        let mut ignored = Vec::new();
        let mut differs = |field, changed: bool| {
            if changed {
                ignored.push(field);
            }
        };
        differs("listen", new.listen != started.listen);
        differs("admin_listen", new.admin_listen != started.admin_listen);
        differs("store", new.store != started.store);
        differs("limits", new.limits != started.limits);
        differs(
            "shutdown_grace",
            new.shutdown_grace != started.shutdown_grace,
        );
        differs(
            "highest_cache_entries",
            new.highest_cache_entries != started.highest_cache_entries,
        );
        differs("workers", new.workers != started.workers);
        let lease_listen = |c: &Config| c.lease.as_ref().map(|l| (l.listen, l.max_ttl));
        differs("lease_listen", lease_listen(new) != lease_listen(started));
        let tls_listen = |c: &Config| c.tls.as_ref().map(|t| t.listen);
        differs("tls.listen", tls_listen(new) != tls_listen(started));
        let watch = |c: &Config| c.tls.as_ref().map(|t| t.watch_interval);
        differs("tls.watch_interval", watch(new) != watch(started));
        // Everything is loaded before anything is swapped.
        let certs = match (&self.0.tls, &new.tls) {
            (Some(running), Some(files)) => Some((running, TlsTerminator::prepare(files)?)),
            _ => None,
        };
        self.0.proxy.reload_routes(new)?;
        if let Some((running, prepared)) = certs {
            running.install(prepared);
            log_tls_reload("config reloaded", &Ok(()), &self.0.metrics, running);
        }
        self.0
            .admin
            .admin_token
            .store(new.admin_token.clone().map(Arc::new));
        if let (Some(leases), Some(l)) = (&self.0.leases, &new.lease) {
            leases.bearers.store(Arc::new(l.tokens.clone()));
        }
        warn_if_plain_bypasses_mtls(self.0.proxy_addr, new);
        for field in &ignored {
            tracing::warn!(field, "changed in the config file, but only a restart applies it; keeping the running value");
        }
        Ok(ignored)
    }
}

/// When an accept loop stops and how long it waits for its connections.
#[derive(Clone)]
struct Gate {
    stop: CancellationToken,
    grace: Duration,
    /// Cancelled when the grace period is over: connections still open
    /// (idle, reading, or a peer that never acknowledges the HTTP/2
    /// shutdown) are closed. Writes already forwarded run on as exchanges.
    kill: CancellationToken,
    /// Every connection task, so the stop can wait until none is left to
    /// start a write.
    connections: TaskTracker,
}

/// The TLS side of a listener.
#[derive(Clone)]
struct TlsSide {
    terminator: Arc<TlsTerminator>,
    /// A handshake must finish within this, like a request head.
    timeout: Duration,
    failures: prometheus::IntCounterVec,
}

impl TlsSide {
    /// Runs the handshake; `None` if it failed, timed out or the drain
    /// started meanwhile (a half-open handshake must not hold the drain).
    async fn handshake<I>(
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

/// How often the heartbeat asks a shared store's marker to be checked; a
/// check runs when the last one is a second old (the store's
/// `MARKER_INTERVAL`), so an idle replica checks at most 1.25 s apart.
const HEARTBEAT: Duration = Duration::from_millis(250);

/// Shared stores: checks and advances the store's marker every
/// second even while no write comes (`check_marker` runs the check when
/// it is due, and nothing otherwise). Every running replica then knows a recent sequence number, so a
/// store rolled back to an older state (a restored backup or snapshot) is
/// caught at the first call after it, by replicas that never wrote the
/// keys it lost too. Failures show in `/readyz`; nothing to do here.
async fn store_heartbeat(store: Arc<dyn crate::store::FenceStore>, stop: CancellationToken) {
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

/// Connections a listener may hold: the configured limit, but never more
/// than the process's file-descriptor limit allows with room to spare, so
/// that a flood of client connections cannot leave no descriptor for the
/// upstream connections and the store. Every proxied request may need one
/// upstream connection besides its client's, so each listener gets a third
/// of half of what is left after a reserve.
fn connection_budget(configured: usize) -> usize {
    let nofile = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|soft| soft.parse::<usize>().ok())
        });
    let Some(nofile) = nofile else {
        return configured;
    };
    let budget = (nofile.saturating_sub(64) / 2 / 3).max(8);
    if budget < configured {
        tracing::info!(
            configured,
            budget,
            nofile,
            "limiting connections per listener to what the file-descriptor limit allows"
        );
    }
    configured.min(budget)
}

/// A listener's connection budget and progress rule.
#[derive(Clone)]
struct Slots {
    name: &'static str,
    free: Arc<tokio::sync::Semaphore>,
    /// A connection with no request being served that reads and writes
    /// nothing for this long is closed (HTTP/1 keep-alive, an HTTP/2
    /// connection without streams, a preface that never completes).
    idle: Duration,
    metrics: Arc<Metrics>,
    /// Counts this accept loop's connections (a worker's share).
    accepted: Option<prometheus::IntCounter>,
    /// Connections start with a PROXY protocol header, from these peers
    /// only (see [`crate::proxy_protocol`]).
    proxy_protocol: Option<Arc<crate::proxy_protocol::TrustedProxies>>,
}

impl Slots {
    /// Who the connection is for: the socket's peer, or on a listener
    /// with `proxy_protocol` the client its PROXY header names. `None`
    /// (the connection is to be closed, and is counted) if the peer is not
    /// a trusted proxy or its header does not parse in time.
    async fn client(
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

    fn closed(&self, reason: &str) {
        self.metrics
            .connections_closed
            .with_label_values(&[self.name, reason])
            .inc();
    }

    /// Counts an open connection until the guard is dropped.
    fn open(&self) -> impl Drop {
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

/// Whether a connection makes progress: bytes moved, or a request handler
/// running (an upstream answer can take a while).
#[derive(Default)]
struct Activity {
    moved: std::sync::atomic::AtomicBool,
    busy: std::sync::atomic::AtomicUsize,
}

impl Activity {
    /// Records that bytes moved, if they did.
    fn note(&self, moved: bool) {
        if moved {
            self.moved.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Ends when the connection has been idle for at least `idle` (at most
    /// half as long again): no bytes either way and no request in hand.
    async fn watch(self: Arc<Self>, idle: Duration) {
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
struct Busy(Arc<Activity>);

impl Busy {
    fn new(a: &Arc<Activity>) -> Self {
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
    struct Tracked<I> {
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

/// Serves one connection (plain or TLS) under the drain's watch.
async fn serve_connection<I, S>(
    builder: auto::Builder<TokioExecutor>,
    io: I,
    service: S,
    watcher: hyper_util::server::graceful::Watcher,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<
            Request<Incoming>,
            Response = http::Response<ProxyBody>,
            Error = std::convert::Infallible,
        > + Send
        + 'static,
    S::Future: Send + 'static,
{
    // With upgrades: a WebSocket route hands its connections to a tunnel.
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    if let Err(e) = watcher.watch(conn.into_owned()).await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// Accepts connections (TLS ones if `tls` is set) until the gate closes;
/// then drains them within the grace period. Returns whether every
/// connection finished in time.
async fn accept_loop<F, Fut>(
    listener: TcpListener,
    builder: auto::Builder<TokioExecutor>,
    tls: Option<TlsSide>,
    gate: Gate,
    slots: Slots,
    handler: F,
) -> bool
where
    F: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<http::Response<ProxyBody>, std::convert::Infallible>>
        + Send
        + 'static,
{
    let graceful = GracefulShutdown::new();
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
                if let Some(c) = &slots.accepted {
                    c.inc();
                }
                let _ = stream.set_nodelay(true);
                let activity = Arc::new(Activity::default());
                let mut stream = Tracked { inner: stream, activity: activity.clone() };
                let handler = handler.clone();
                let busy = activity.clone();
                let open = slots.open();
                let behind = slots.clone();
                let watchdog = activity.watch(slots.idle);
                let idle_closed = slots.clone();
                // Watched from accept on, so the drain also waits for a
                // connection still in its TLS handshake (which the drain
                // cuts short).
                let watcher = graceful.watcher();
                let builder = builder.clone();
                let (tls, stop, kill) = (tls.clone(), gate.stop.clone(), gate.kill.clone());
                let mut connection = gate.connections.spawn(async move {
                    let _held = (open, slot);
                    let Some(peer) = behind.client(&mut stream.inner, peer).await else {
                        return;
                    };
                    let service = service_fn(move |req| {
                        let guard = Busy::new(&busy);
                        let answer = handler(req, peer);
                        async move {
                            let answer = answer.await;
                            drop(guard);
                            answer
                        }
                    });
                    match tls {
                        None => serve_connection(builder, stream, service, watcher).await,
                        Some(tls) => {
                            if let Some(stream) = tls.handshake(stream, peer, &stop).await {
                                serve_connection(builder, stream, service, watcher).await;
                            }
                        }
                    }
                });
                // A supervisor beside the connection, not around it: it
                // wakes only on its timer, the stop or the connection's end,
                // so the request path does not poll it.
                tokio::spawn(async move {
                    tokio::select! {
                        _ = &mut connection => return,
                        _ = kill.cancelled() => {}
                        _ = watchdog => idle_closed.closed("idle"),
                    }
                    connection.abort();
                    let _ = connection.await;
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
