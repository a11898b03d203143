//! [`Reloader`]: a new config applied to the running server (SIGHUP, the
//! admin API) without touching connections in flight: routes, TLS files,
//! tokens, and the key-mapping barrier when the mapping changed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::config::Config;
use crate::fence::Fence;
use crate::lease::Leases;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::tls::{TlsError, TlsTerminator};

use super::error::*;

pub(super) fn log_tls_reload(
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
pub struct Reloader(pub(super) Arc<ReloadState>);

pub(super) struct ReloadState {
    pub(super) proxy: Arc<Proxy>,
    /// The plain listener's bound address.
    pub(super) proxy_addr: Option<SocketAddr>,
    pub(super) admin: Arc<Admin>,
    /// The lease API, whose bearer tokens a reload replaces.
    pub(super) leases: Option<Arc<Leases>>,
    pub(super) tls: Option<Arc<TlsTerminator>>,
    pub(super) metrics: Arc<Metrics>,
    /// What the server started with: listeners, store and limits cannot
    /// change without a restart.
    pub(super) started: Config,
    /// One reload at a time.
    pub(super) lock: tokio::sync::Mutex<()>,
    pub(super) fence: Arc<Fence>,
    /// Tasks that record a key mapping once writes under older ones ended
    /// ([`Reloader::settle_key_mapping`]); they stop at the drain.
    pub(super) settles: TaskTracker,
    pub(super) draining: CancellationToken,
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
    pub(super) async fn record_remap(&self, remap: bool) -> Result<(), ReloadError> {
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
    pub(super) fn settle_key_mapping(&self) {
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

    pub(super) fn apply(&self, new: &Config) -> Result<Vec<&'static str>, ReloadError> {
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

/// With client certificates required on the TLS listener, a plain listener
/// reachable from elsewhere takes the same requests without any.
pub(super) fn warn_if_plain_bypasses_mtls(plain: Option<SocketAddr>, config: &Config) {
    if let (Some(addr), Some(t)) = (plain, &config.tls) {
        if t.client_ca.is_some() && !addr.ip().is_loopback() {
            tracing::warn!(listen = %addr, "client certificates are required on the TLS listener, but the plain listener takes requests without any: bind it to loopback or set listen = \"off\"");
        }
    }
}
