//! Listeners, connection serving and graceful shutdown.
//!
//! [`Server::start`] opens the store, binds both listeners and spawns their
//! accept loops; [`Server::wait`] runs until the cancellation token fires,
//! then stops accepting, drains in-flight requests within the grace period
//! and, only if the drain completed, records a clean stop in the store.

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
use crate::metrics::{InstrumentedStore, Metrics};
use crate::proxy::Proxy;
use crate::store::embedded::{EmbeddedStore, OpenError};
use crate::store::{FenceStore, StartState};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Store(#[from] OpenError),
    #[error("invalid `store`: {0}")]
    SharedStore(String),
    #[error("cannot listen on {addr} (`{field}`): {reason}")]
    Bind {
        field: &'static str,
        addr: SocketAddr,
        reason: String,
    },
}

/// A running fencegate.
pub struct Server {
    pub proxy_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    fence: Arc<Fence>,
    shutdown: CancellationToken,
    draining: CancellationToken,
    proxy_task: JoinHandle<bool>,
    admin_task: JoinHandle<bool>,
    /// Upstream exchanges of admitted writes, which may outlive their
    /// client connection.
    exchanges: TaskTracker,
    grace: Duration,
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

impl Server {
    /// Opens the store and binds the listeners. `shutdown` stops the server.
    pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Self, ServerError> {
        let metrics = Arc::new(Metrics::new());
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
            StoreConfig::Shared(shared) => crate::store::connect_shared(shared)?,
        };
        if let StartState::Unclean { previous_window } = store.start_state() {
            tracing::warn!(
                window = ?config.max_upstream_timeout().max(previous_window.unwrap_or_default()),
                "the last run did not stop cleanly: writes are refused (503) until writes forwarded before the crash can no longer be in flight"
            );
        }
        if !store.exclusive() {
            // Connect now, so schema setup, durability warnings and the
            // marker check happen at start; a store that is down only makes
            // writes fail closed until it answers.
            let probe = store.clone();
            tokio::spawn(async move {
                if let Err(e) = probe.ping().await {
                    tracing::warn!(store = probe.kind(), error = %e, "fence store not reachable at start: writes fail closed until it is");
                }
            });
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
        let proxy = Arc::new(Proxy::new(&config, fence.clone(), metrics.clone()));
        let exchanges = proxy.exchanges();
        let draining = CancellationToken::new();
        let admin = Arc::new(Admin {
            fence: fence.clone(),
            metrics: metrics.clone(),
            admin_token: config.admin_token.clone(),
            draining: draining.clone(),
        });

        let proxy_listener = bind("listen", config.listen).await?;
        let admin_listener = bind("admin_listen", config.admin_listen).await?;
        let proxy_addr = proxy_listener.local_addr().expect("bound address");
        let admin_addr = admin_listener.local_addr().expect("bound address");

        // HTTP/1.1, and HTTP/2 with prior knowledge (h2c) on the same port.
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
        let proxy_task = tokio::spawn(accept_loop(
            proxy_listener,
            builder.clone(),
            draining.clone(),
            grace,
            move |req, peer| proxy.clone().handle(req, peer),
        ));
        let admin_task = tokio::spawn(accept_loop(
            admin_listener,
            builder,
            draining.clone(),
            grace,
            move |req, _peer| admin.clone().handle(req),
        ));
        tracing::info!(%proxy_addr, %admin_addr, routes = config.routes.len(), "fencegate started");
        Ok(Self {
            proxy_addr,
            admin_addr,
            fence,
            shutdown,
            draining,
            proxy_task,
            admin_task,
            exchanges,
            grace,
        })
    }

    /// Runs until the shutdown token is cancelled, then drains and closes.
    /// Returns whether the stop was clean (drained and recorded).
    pub async fn wait(self) -> bool {
        self.shutdown.cancelled().await;
        tracing::info!(grace = ?self.grace, "shutting down: draining in-flight requests");
        let deadline = tokio::time::Instant::now() + self.grace;
        self.draining.cancel();
        let connections_drained = self.proxy_task.await.unwrap_or(false);
        let _ = self.admin_task.await;
        // Writes whose clients went away are still running upstream: they
        // must end before a clean stop can be recorded.
        self.exchanges.close();
        let exchanges_done = tokio::time::timeout_at(deadline, self.exchanges.wait())
            .await
            .is_ok();
        if !(connections_drained && exchanges_done) {
            tracing::warn!(
                "grace period over with requests still in flight: not marking a clean stop"
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

/// Accepts connections until `stop` fires; then drains them within `grace`.
/// Returns whether every connection finished in time.
async fn accept_loop<F, Fut>(
    listener: TcpListener,
    builder: auto::Builder<TokioExecutor>,
    stop: CancellationToken,
    grace: Duration,
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
            _ = stop.cancelled() => break,
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
                let _ = stream.set_nodelay(true);
                let handler = handler.clone();
                let service = service_fn(move |req| handler(req, peer));
                let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => true,
        _ = tokio::time::sleep(grace) => false,
    }
}
