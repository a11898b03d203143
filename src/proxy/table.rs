//! The route table: each route with its upstream pools and metrics,
//! rebuilt whole on reload (an unchanged plain-HTTP route keeps its pool),
//! and the key mapping a reload may change (with the barrier that keeps
//! writes admitted under the old mapping from overlapping new ones).

use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio_util::task::TaskTracker;

use crate::config::{Config, Route};
use crate::metrics::{Metrics, RouteMetrics};
use crate::routing::match_order;
use crate::tls::{upstream_connector, TlsError};
use crate::upstream::{LimitSettings, Upstream};

/// Idle upstream connections older than this are closed.
pub(super) const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How often idle upstream connections are reaped.
pub(super) const REAP_EVERY: Duration = Duration::from_secs(5);

/// A route with its upstream connection pools.
pub(super) struct RouteRuntime {
    pub(super) route: Route,
    /// One pool per worker thread: a worker's upstream connections are
    /// driven by tasks on its own runtime.
    pub(super) upstream: Arc<Upstream>,
    pub(super) metrics: RouteMetrics,
}

impl AsRef<Route> for RouteRuntime {
    fn as_ref(&self) -> &Route {
        &self.route
    }
}

/// What a reload replaces: the routes and their upstream clients.
pub(super) struct RouteTable {
    pub(super) routes: Vec<RouteRuntime>,
    /// How requests map to fence keys; shared with the previous table when
    /// a reload left it unchanged.
    pub(super) mapping: Arc<Mapping>,
    /// Some route names a host: then a request must name one too.
    pub(super) host_routes: bool,
    /// One log line per request (target `fencegate::access`).
    pub(super) access_log: bool,
    /// Who may speak for clients in forwarded headers; `None`: not set,
    /// and those headers are appended to as they come.
    pub(super) trusted: Option<Arc<crate::proxy_protocol::TrustedProxies>>,
}

impl RouteTable {
    /// Builds every route's upstream client. Fails (naming the field) if a
    /// route's TLS files do not load.
    pub(super) fn build(
        config: &Config,
        metrics: &Metrics,
        previous: Option<&RouteTable>,
        workers: usize,
    ) -> Result<Self, TlsError> {
        let mut routes = Vec::with_capacity(config.routes.len());
        for (i, route) in config.routes.iter().enumerate() {
            // An unchanged plain-HTTP route keeps its client and so its pool
            // of upstream connections. An https one is rebuilt: a reload is
            // how a changed CA bundle or client certificate is picked up.
            let unchanged = previous.and_then(|t| {
                t.routes.iter().find(|r| {
                    r.route == *route && route.upstream.scheme != http::uri::Scheme::HTTPS
                })
            });
            if let Some(rt) = unchanged {
                routes.push(RouteRuntime {
                    route: rt.route.clone(),
                    upstream: rt.upstream.clone(),
                    metrics: rt.metrics.clone(),
                });
                continue;
            }
            let mut http = HttpConnector::new();
            http.set_connect_timeout(Some(route.connect_timeout));
            http.set_nodelay(true);
            // https upstreams go through the TLS layer.
            http.enforce_http(false);
            let connector = upstream_connector(
                &format!("routes[{i}]"),
                &route.upstream.scheme,
                &route.upstream_tls,
                crate::upstream::Dialer::new(http),
            )?;
            let dial = Uri::builder()
                .scheme(route.upstream.scheme.clone())
                .authority(route.upstream.authority.clone())
                .path_and_query("/")
                .build()
                .map_err(|e| TlsError {
                    field: format!("routes[{i}].upstream"),
                    reason: e.to_string(),
                })?;
            let name = [route.name.as_str()];
            let limit = LimitSettings {
                max_connections: route.upstream_max_connections,
                queue_timeout: route.upstream_queue_timeout,
                connect_timeout: route.connect_timeout,
                queued: metrics.upstream_queued.with_label_values(&name),
                queue_timeouts: metrics.upstream_queue_timeouts.with_label_values(&name),
                open: metrics.upstream_connections.with_label_values(&name),
            };
            routes.push(RouteRuntime {
                route: route.clone(),
                upstream: Arc::new(Upstream::new(
                    dial,
                    connector,
                    workers,
                    POOL_IDLE_TIMEOUT,
                    route.upstream_tls.http2 && route.upstream.scheme != http::uri::Scheme::HTTPS,
                    limit,
                )),
                metrics: metrics.route(&route.name),
            });
        }
        routes.sort_by_key(|r| match_order(&r.route));
        let signature = signature(routes.iter().map(|r| &r.route));
        let mapping = match previous {
            Some(p) if p.mapping.signature == signature => p.mapping.clone(),
            _ => Arc::new(Mapping::new(signature, previous.map(|p| &*p.mapping))),
        };
        Ok(Self {
            host_routes: routes.iter().any(|r| r.route.host.is_some()),
            routes,
            mapping,
            access_log: config.access_log,
            trusted: config.trusted_proxies.clone().map(Arc::new),
        })
    }
}

/// What decides a request's fence key, per route in match order.
#[derive(PartialEq, Eq, Debug)]
pub(super) struct MappingEntry {
    pub(super) host: Option<String>,
    pub(super) path_prefix: String,
    pub(super) key: String,
    pub(super) namespace: String,
    pub(super) literal_keys: bool,
}

impl MappingEntry {
    pub(super) fn of(route: &Route) -> Self {
        Self {
            host: route.host.clone(),
            path_prefix: route.path_prefix.clone(),
            key: route.key.to_string(),
            namespace: route.namespace.clone(),
            literal_keys: route.literal_keys,
        }
    }
}

/// One way of mapping requests to fence keys. After a reload that changes
/// the mapping, a write to a resource may be in flight under its old key
/// while a new write arrives under the new key, where no fence gate orders
/// them: so writes under the new mapping first wait (as long as they would
/// behind an older write) until no write admitted under an older mapping is
/// in flight, which is what a restart's drain would have given them.
pub(super) struct Mapping {
    pub(super) signature: Vec<MappingEntry>,
    /// [`fingerprint`] of the signature, as recorded in the store.
    pub(super) fingerprint: u64,
    /// Every request under this mapping holds a token from the start until
    /// it is known to be a read, or, for a write, until it is no longer in
    /// flight. Closed when a reload replaces the mapping.
    pub(super) writes: TaskTracker,
    /// The trackers of older mappings that may still have writes in flight.
    /// Each of those writes ends by its own deadline, so they empty in
    /// bounded time; until then writes here wait or are refused (503).
    pub(super) behind: Vec<TaskTracker>,
}

impl Mapping {
    pub(super) fn new(signature: Vec<MappingEntry>, previous: Option<&Mapping>) -> Self {
        let mut behind = Vec::new();
        if let Some(p) = previous {
            behind.extend(
                p.behind
                    .iter()
                    .filter(|t| !(t.is_closed() && t.is_empty()))
                    .cloned(),
            );
            // Closed by `reload_routes` once this mapping is in place.
            behind.push(p.writes.clone());
        }
        Self {
            fingerprint: fingerprint(&signature),
            signature,
            writes: TaskTracker::new(),
            behind,
        }
    }
}

/// A fingerprint of a key mapping that stays the same across restarts
/// and releases of the same routes (FNV-1a over its printed form), never
/// [`KEY_MAPPING_MIXED`](crate::store::KEY_MAPPING_MIXED).
pub(super) fn fingerprint(signature: &[MappingEntry]) -> u64 {
    let text = format!("{signature:?}");
    let h = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    h.max(crate::store::KEY_MAPPING_MIXED + 1)
}

/// The signature of the key mapping `routes` give, in match order (the
/// order the route table matches in, whatever the config's).
pub(super) fn signature<'a>(routes: impl IntoIterator<Item = &'a Route>) -> Vec<MappingEntry> {
    let mut routes: Vec<&Route> = routes.into_iter().collect();
    routes.sort_by_key(|r| match_order(r));
    routes.into_iter().map(MappingEntry::of).collect()
}
