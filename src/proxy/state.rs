//! The [`Proxy`] shared by every connection: its route table, fence and
//! limits; construction, reload, request ids, and the live route table
//! seen by the admin lookup and the lock service ([`Explain`]). Also the
//! small things every file of the proxy uses: the client's [`Peer`], the
//! `X-Request-Id` and `X-Forwarded-*` header names, a gauge guard.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use tokio_util::task::task_tracker::TaskTrackerToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, Limits};
use crate::error::ProxyError;
use crate::fence::Fence;
use crate::metrics::Metrics;
use crate::routing::{Explain, Explained};
use crate::tls::TlsError;

use super::table::*;

/// The request handler shared by every connection.
pub struct Proxy {
    /// Swapped whole by a reload; each request holds the table it started
    /// with.
    pub(super) routes: ArcSwap<RouteTable>,
    pub(super) fence: Arc<Fence>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) limits: Limits,
    pub(super) request_id_prefix: String,
    pub(super) request_seq: std::sync::atomic::AtomicU64,
    /// Every admitted write's upstream exchange, counted from its start
    /// (`forward::Detached`); one whose request task is dropped runs on as a
    /// task of its own, so a client hanging up cannot end a write's
    /// in-flight period while the backend may still be applying it.
    /// Shutdown waits for them.
    pub(super) exchanges: TaskTracker,
    /// Open WebSocket tunnels, bounded like a listener's connections
    /// (`limits.max_connections`): a tunnel leaves its connection's slot.
    pub(super) tunnels: Arc<tokio::sync::Semaphore>,
    /// Worker threads (one upstream pool per route each).
    pub(super) workers: usize,
    /// The last refusals, for the admin API and page.
    pub(super) refusals: Arc<crate::refusals::Refusals>,
    /// The last raises of keys' highest tokens, for the admin lookup.
    pub(super) raises: Arc<crate::raises::Raises>,
}

impl Explain for Proxy {
    /// Under the routes now in force (see [`crate::routing::explain`]).
    fn explain(
        &self,
        host: Option<&str>,
        target: &str,
        headers: &HeaderMap,
    ) -> Result<Explained, ProxyError> {
        crate::routing::explain(
            &self.routes.load().routes,
            host,
            target,
            headers,
            self.limits.max_key_bytes,
        )
    }

    fn older_mapping_in_flight(&self) -> usize {
        self.routes
            .load()
            .mapping
            .behind
            .iter()
            .map(TaskTracker::len)
            .sum()
    }
}

impl Proxy {
    /// `workers`: how many worker threads serve requests (each gets its
    /// own upstream pools).
    pub fn new(
        config: &Config,
        fence: Arc<Fence>,
        metrics: Arc<Metrics>,
        workers: usize,
    ) -> Result<Self, TlsError> {
        Ok(Self {
            routes: ArcSwap::from_pointee(RouteTable::build(config, &metrics, None, workers)?),
            workers,
            fence,
            metrics,
            limits: config.limits.clone(),
            request_id_prefix: crate::id::unique_id()[..16].to_string(),
            request_seq: std::sync::atomic::AtomicU64::new(0),
            exchanges: TaskTracker::new(),
            tunnels: Arc::new(tokio::sync::Semaphore::new(config.limits.max_connections)),
            refusals: Arc::new(crate::refusals::Refusals::new(config.refusals_kept)),
            raises: Arc::new(crate::raises::Raises::new(config.raises_kept)),
        })
    }

    /// The ring of the last refusals (kept as configured at start).
    pub fn refusals(&self) -> Arc<crate::refusals::Refusals> {
        self.refusals.clone()
    }

    /// The ring of the last raises (kept as configured at start).
    pub fn raises(&self) -> Arc<crate::raises::Raises> {
        self.raises.clone()
    }

    /// The fingerprint of the key mapping now in force.
    pub fn key_mapping(&self) -> u64 {
        self.routes.load().mapping.fingerprint
    }

    /// The fingerprint of the key mapping `config`'s routes would give.
    pub fn key_mapping_of(config: &Config) -> u64 {
        fingerprint(&signature(&config.routes))
    }

    /// Resolves once no write admitted under an older key mapping than
    /// the one in force now can be in flight (each ends by its deadline).
    pub fn key_mapping_settled(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let behind = self.routes.load().mapping.behind.clone();
        async move {
            for t in behind {
                t.wait().await;
            }
        }
    }

    /// Whether writes under older key mappings are all done now.
    pub fn key_mapping_is_settled(&self) -> bool {
        let table = self.routes.load();
        table
            .mapping
            .behind
            .iter()
            .all(|t| t.is_closed() && t.is_empty())
    }

    /// Builds the routes of `config` and swaps them in: requests that
    /// already picked a route finish on it (with its connection pool); new
    /// ones use the new table. On error nothing changes.
    pub fn reload_routes(&self, config: &Config) -> Result<(), TlsError> {
        let previous = self.routes.load_full();
        let table = RouteTable::build(config, &self.metrics, Some(&previous), self.workers)?;
        let remapped = !Arc::ptr_eq(&table.mapping, &previous.mapping);
        self.routes.store(Arc::new(table));
        // Closed only now that the new table is in place: see `enter`.
        if remapped {
            previous.mapping.writes.close();
        }
        Ok(())
    }

    /// The route table a request lives with, and its place under that
    /// table's key mapping. A request that loaded a table whose mapping a
    /// reload has just closed takes the newer table instead (already in
    /// place by then): otherwise it could slip in after the new mapping's
    /// writes stopped waiting for the old one.
    pub(super) fn enter(&self) -> (Arc<RouteTable>, TaskTrackerToken) {
        loop {
            let table = self.routes.load_full();
            let token = table.mapping.writes.token();
            if !table.mapping.writes.is_closed() {
                return (table, token);
            }
        }
    }

    /// A new request id: a per-process random prefix and a counter, so the
    /// request path pays one atomic increment, not a random draw.
    pub(super) fn next_request_id(&self) -> HeaderValue {
        let n = self.request_seq.fetch_add(1, Ordering::Relaxed);
        request_id(&self.request_id_prefix, n)
    }

    /// Closes idle upstream connections past their timeout every few
    /// seconds, until `stop`.
    pub async fn reap_idle_connections(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(REAP_EVERY) => {}
            }
            for rt in &self.routes.load().routes {
                rt.upstream.reap_idle();
            }
        }
    }

    /// The tracker of in-flight write exchanges (for the drain).
    pub fn exchanges(&self) -> TaskTracker {
        self.exchanges.clone()
    }
}

/// The client end of a connection.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    pub addr: std::net::SocketAddr,
    /// Came in on the TLS listener (X-Forwarded-Proto: https).
    pub tls: bool,
}

pub(super) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// W3C Trace Context's header: forwarded as it came, its trace id logged.
pub(super) static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

pub(super) static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

pub(super) static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Decrements a gauge when dropped.
pub(super) struct GaugeGuard(prometheus::IntGauge);

impl GaugeGuard {
    pub(super) fn new(g: prometheus::IntGauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// `PREFIX-N` with N in hex, written by hand: this runs for every request
/// that brings no id of its own. The prefix is at most 40 bytes.
pub(super) fn request_id(prefix: &str, n: u64) -> HeaderValue {
    let mut id = [0u8; 64];
    let prefix = prefix.as_bytes();
    id[..prefix.len()].copy_from_slice(prefix);
    id[prefix.len()] = b'-';
    let digits = (64 - n.leading_zeros()).div_ceil(4).max(1) as usize;
    let start = prefix.len() + 1;
    for (i, slot) in id[start..start + digits].iter_mut().enumerate() {
        let nibble = (n >> (4 * (digits - 1 - i))) & 0xf;
        *slot = b"0123456789abcdef"[nibble as usize];
    }
    HeaderValue::from_bytes(&id[..start + digits]).expect("hex id")
}
