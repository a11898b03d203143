//! Prometheus metrics. One [`Registry`] is created at start, the metric
//! handles live in [`Metrics`] and are passed to whoever records.

use prometheus::{
    exponential_buckets, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Every metric fencegate exports (all prefixed `fencegate_`).
pub struct Metrics {
    pub registry: Registry,
    /// Write decisions by route: admitted, stale, missing_token,
    /// malformed_token, bad_key, recovering, store_error.
    pub writes: IntCounterVec,
    /// Requests answered, by route, class (read/write) and status code.
    pub requests: IntCounterVec,
    /// Reads that carried an X-Fence-Token (ignored), by route.
    pub read_tokens_ignored: IntCounterVec,
    /// Store operation failures, by route.
    pub store_errors: IntCounterVec,
    /// Time a write spent in admission (store round trip and waiting behind
    /// older in-flight writes), by route.
    pub admission_wait: HistogramVec,
    /// Writes that waited their full limit and went ahead, by route.
    pub admission_waited_out: IntCounterVec,
    /// Store operation latency, by operation.
    pub store_latency: HistogramVec,
    /// Operations per round trip to a shared store (group commit), by
    /// operation (acquire_lease, release_lease).
    pub store_batch_size: HistogramVec,
    /// Upstream response-head latency, by route.
    pub upstream_latency: HistogramVec,
    /// Upstream failures by route and kind (connect, timeout, queue, other).
    pub upstream_errors: IntCounterVec,
    /// Requests waiting for an upstream connection under the route's
    /// `upstream_max_connections`, by route.
    pub upstream_queued: IntGaugeVec,
    /// Requests refused (503) after waiting `upstream_queue_timeout` for an
    /// upstream connection, by route.
    pub upstream_queue_timeouts: IntCounterVec,
    /// Upstream connections open or being dialled, by route (all workers).
    pub upstream_connections: IntGaugeVec,
    /// Response bodies that did not reach the client whole, by route and
    /// reason (`upstream_stalled`: no byte from the upstream within
    /// `limits.response_idle_timeout`; `upstream_failed`: the upstream
    /// connection failed mid-body; `dropped`: the client went away, or
    /// its connection was closed for reading nothing within that bound).
    pub response_bodies_cut: IntCounterVec,
    /// Requests currently being proxied, by route.
    pub in_flight: IntGaugeVec,
    /// 1 while the store answers, 0 while it does not.
    pub store_up: IntGauge,
    /// 1 while in the crash-recovery window after an unclean stop.
    pub recovering: IntGauge,
    /// Keys held by the crash-recovery window (-1: every key, the crashed
    /// run kept no in-flight marks).
    pub recovery_held_keys: IntGauge,
    /// Seconds left in the crash-recovery window.
    pub recovery_seconds_left: prometheus::Gauge,
    /// Keys whose in-flight mark is in the embedded store now.
    pub in_flight_marks: IntGauge,
    /// 1 while a shared store is suspected of having lost data.
    pub store_amnesia: IntGauge,
    /// A store spread over shards (Redis Cluster), by shard (its primary's
    /// `host:port`): 1 while every group of fence keys it serves answers;
    /// the groups it serves; those in amnesia. Set at each scrape, every
    /// group pinged then, so a shard no longer in the topology drops out.
    pub store_shard_up: IntGaugeVec,
    pub store_shard_groups: IntGaugeVec,
    pub store_shard_groups_lost: IntGaugeVec,
    /// Redis: replicas the last answered store call waited for (`WAIT`),
    /// and how many confirmed it; -1 when there is none (before the
    /// first, the store unreachable) and for stores that do not count
    /// replicas.
    pub store_replicas_wanted: IntGauge,
    pub store_replicas_confirmed: IntGauge,
    /// Redis: store calls failed because fewer replicas confirmed them
    /// than were waited for.
    pub store_replica_wait_failures: prometheus::IntCounter,
    /// The store's own count that `store_replica_wait_failures` follows.
    replica_wait_failures: std::sync::atomic::AtomicU64,
    /// Client connections by the engine that began serving them, by
    /// listener (lane: fencegate's own HTTP/1.1 reader, on the proxy and
    /// TLS listeners; hyper: HTTP/2 by ALPN, and the admin and lease
    /// listeners).
    pub connections_served: IntCounterVec,
    /// Connections the lane handed to hyper part-way (a body that did not
    /// come at once, a head it does not take), by listener.
    pub lane_handoffs: IntCounterVec,
    /// Requests the admin listener answered, by endpoint and status: the
    /// page's own traffic (its polls) shows here.
    pub admin_requests: IntCounterVec,
    /// Reloads by what (config, tls) and result (ok, error).
    pub reloads: IntCounterVec,
    /// By what (config, tls): 1 if the last reload worked, 0 if it failed
    /// (the old one is still in force).
    pub last_reload_ok: IntGaugeVec,
    /// TLS handshakes that failed, by reason (error, timeout): untrusted or
    /// missing client certificates, scanners, plain HTTP on the TLS port.
    pub tls_handshake_failures: IntCounterVec,
    /// notAfter of the TLS listener's certificate, Unix seconds.
    pub tls_not_after: IntGauge,
    /// Open client connections, by listener (proxy, tls, admin).
    pub connections: IntGaugeVec,
    /// Connections closed by fencegate, by listener and reason (limit: the
    /// listener was full; idle: no progress within the header timeout;
    /// response_stalled: a response streaming and no bytes within the
    /// response idle timeout).
    pub connections_closed: IntCounterVec,
    /// Client connections accepted, by listener (proxy, tls) and worker
    /// thread: shows how the kernel spreads them.
    pub worker_connections: IntCounterVec,
    /// Worker threads serving the proxy listeners.
    pub workers: IntGauge,
    /// Lease API requests by operation (acquire, renew, release, get,
    /// other) and result (granted, ok, gone, or the problem type: lease-held,
    /// lease-gone, unauthorized...).
    pub leases: IntCounterVec,
    /// Lease API answer time by operation (an acquire's `wait_ms`
    /// included).
    pub lease_latency: HistogramVec,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("metric");
            registry.register(Box::new(c.clone())).expect("register");
            c
        };
        let histogram = |name: &str, help: &str, labels: &[&str], start: f64| {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help)
                    .buckets(exponential_buckets(start, 2.0, 18).expect("buckets")),
                labels,
            )
            .expect("metric");
            registry.register(Box::new(h.clone())).expect("register");
            h
        };
        let writes = counter(
            "fencegate_writes_total",
            "Write requests by fencing decision.",
            &["route", "decision"],
        );
        let requests = counter(
            "fencegate_requests_total",
            "Requests answered, by request class and status code.",
            &["route", "class", "status"],
        );
        let read_tokens_ignored = counter(
            "fencegate_read_tokens_ignored_total",
            "Reads that carried an X-Fence-Token, which is ignored on reads.",
            &["route"],
        );
        let store_errors = counter(
            "fencegate_store_errors_total",
            "Writes refused because the fence store could not answer or persist.",
            &["route"],
        );
        let admission_wait = histogram(
            "fencegate_admission_wait_seconds",
            "Time a write spent being admitted: store round trip and waiting behind older in-flight writes.",
            &["route"],
            0.000_05,
        );
        let admission_waited_out = counter(
            "fencegate_admission_waited_out_total",
            "Writes that waited their full limit behind an older in-flight write and went ahead.",
            &["route"],
        );
        let store_latency = histogram(
            "fencegate_store_latency_seconds",
            "Fence store operation latency.",
            &["op"],
            0.000_01,
        );
        let store_batch_size = histogram(
            "fencegate_store_batch_size",
            "Operations sent to a shared store in one round trip (group commit).",
            &["op"],
            1.0,
        );
        let upstream_latency = histogram(
            "fencegate_upstream_latency_seconds",
            "Time from forwarding a request to the upstream response head.",
            &["route"],
            0.000_1,
        );
        let upstream_errors = counter(
            "fencegate_upstream_errors_total",
            "Requests that failed upstream, by kind (connect, timeout, queue, other).",
            &["route", "kind"],
        );
        let upstream_queue_timeouts = counter(
            "fencegate_upstream_queue_timeouts_total",
            "Requests refused (503) after waiting upstream_queue_timeout for a connection under upstream_max_connections.",
            &["route"],
        );
        let gauge = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["route"]).expect("metric");
            registry.register(Box::new(g.clone())).expect("register");
            g
        };
        let upstream_queued = gauge(
            "fencegate_upstream_queued_requests",
            "Requests waiting for an upstream connection (upstream_max_connections reached).",
        );
        let upstream_connections = gauge(
            "fencegate_upstream_connections",
            "Upstream connections open or being dialled, all workers together.",
        );
        let response_bodies_cut = counter(
            "fencegate_response_bodies_cut_total",
            "Response bodies cut before their end, by reason (upstream_stalled: no byte from the upstream within limits.response_idle_timeout; upstream_failed: the upstream connection failed mid-body; dropped: the client went away or read nothing within that bound).",
            &["route", "reason"],
        );
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "fencegate_in_flight_requests",
                "Requests being proxied now.",
            ),
            &["route"],
        )
        .expect("metric");
        registry
            .register(Box::new(in_flight.clone()))
            .expect("register");
        let store_up = IntGauge::new("fencegate_store_up", "1 while the fence store answers.")
            .expect("metric");
        registry
            .register(Box::new(store_up.clone()))
            .expect("register");
        let recovering = IntGauge::new(
            "fencegate_recovering",
            "1 while writes wait out the crash-recovery window after an unclean stop.",
        )
        .expect("metric");
        registry
            .register(Box::new(recovering.clone()))
            .expect("register");
        let recovery_held_keys = IntGauge::new(
            "fencegate_recovery_held_keys",
            "Keys whose newer tokens wait out the crash-recovery window (they may have had a write in flight at the crash); -1 while every key does.",
        )
        .expect("metric");
        registry
            .register(Box::new(recovery_held_keys.clone()))
            .expect("register");
        let recovery_seconds_left = prometheus::Gauge::new(
            "fencegate_recovery_seconds_left",
            "Seconds left in the crash-recovery window after an unclean stop.",
        )
        .expect("metric");
        registry
            .register(Box::new(recovery_seconds_left.clone()))
            .expect("register");
        let in_flight_marks = IntGauge::new(
            "fencegate_in_flight_marks",
            "Entries in the embedded store's in-flight log (at least one per key that may have a write in flight; those of idle keys die within two seconds).",
        )
        .expect("metric");
        registry
            .register(Box::new(in_flight_marks.clone()))
            .expect("register");
        let store_amnesia = IntGauge::new(
            "fencegate_store_amnesia",
            "1 while writes are refused because the shared store may have lost data.",
        )
        .expect("metric");
        registry
            .register(Box::new(store_amnesia.clone()))
            .expect("register");
        let by_shard = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["shard"]).expect("metric");
            registry.register(Box::new(g.clone())).expect("register");
            g
        };
        let store_shard_up = by_shard(
            "fencegate_store_shard_up",
            "Redis Cluster: 1 while every group of fence keys the shard serves answers, by shard (its primary).",
        );
        let store_shard_groups = by_shard(
            "fencegate_store_shard_groups",
            "Redis Cluster: groups of fence keys the shard serves, by shard (its primary).",
        );
        let store_shard_groups_lost = by_shard(
            "fencegate_store_shard_groups_lost",
            "Redis Cluster: groups of the shard in amnesia (writes refused until confirm-reset), by shard (its primary).",
        );
        let int_gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("metric");
            registry.register(Box::new(g.clone())).expect("register");
            g.set(-1);
            g
        };
        let store_replicas_wanted = int_gauge(
            "fencegate_store_replicas_wanted",
            "Redis: replicas the last answered store call waited for (WAIT); -1 when there is none (before the first call, the store unreachable) or where the store does not count replicas.",
        );
        let store_replicas_confirmed = int_gauge(
            "fencegate_store_replicas_confirmed",
            "Redis: replicas that confirmed the last store call in time (fewer than wanted failed it); -1 as for fencegate_store_replicas_wanted.",
        );
        let store_replica_wait_failures = prometheus::IntCounter::new(
            "fencegate_store_replica_wait_failures_total",
            "Redis: store calls failed (503) because fewer replicas confirmed them (WAIT) than were waited for.",
        )
        .expect("metric");
        registry
            .register(Box::new(store_replica_wait_failures.clone()))
            .expect("register");
        let connections_served = counter(
            "fencegate_connections_served_total",
            "Client connections by the engine that began serving them: lane (fencegate's HTTP/1.1 reader, proxy and TLS listeners) or hyper (HTTP/2 by ALPN; the admin and lease listeners).",
            &["listener", "engine"],
        );
        let lane_handoffs = counter(
            "fencegate_lane_handoffs_total",
            "Connections the lane handed to hyper part-way (a body that did not arrive at once, a head the lane does not take).",
            &["listener"],
        );
        let admin_requests = counter(
            "fencegate_admin_requests_total",
            "Requests the admin listener answered, by endpoint (page, status, refusals, lookup, fence, metrics, health, confirm_reset, other) and status code.",
            &["endpoint", "code"],
        );
        let reloads = counter(
            "fencegate_reloads_total",
            "Reloads of the config (SIGHUP) or of TLS certificate files, by result.",
            &["what", "result"],
        );
        let last_reload_ok = IntGaugeVec::new(
            Opts::new(
                "fencegate_last_reload_successful",
                "1 if the last reload of the config or of the certificates worked; 0 if the old one is still in force.",
            ),
            &["what"],
        )
        .expect("metric");
        registry
            .register(Box::new(last_reload_ok.clone()))
            .expect("register");
        last_reload_ok.with_label_values(&["config"]).set(1);
        let tls_handshake_failures = counter(
            "fencegate_tls_handshake_failures_total",
            "TLS handshakes on the TLS listener that failed or timed out.",
            &["reason"],
        );
        let tls_not_after = IntGauge::new(
            "fencegate_tls_certificate_expiry_timestamp_seconds",
            "When the TLS listener's certificate expires (notAfter), Unix seconds.",
        )
        .expect("metric");
        let connections = IntGaugeVec::new(
            Opts::new(
                "fencegate_connections",
                "Open client connections, by listener.",
            ),
            &["listener"],
        )
        .expect("metric");
        registry
            .register(Box::new(connections.clone()))
            .expect("register");
        let connections_closed = counter(
            "fencegate_connections_closed_total",
            "Client connections closed by fencegate: the listener was full (limit), the connection made no progress within the header timeout with no request in hand (idle), or moved no bytes within the response idle timeout with a response streaming (response_stalled).",
            &["listener", "reason"],
        );
        let worker_connections = counter(
            "fencegate_worker_connections_total",
            "Client connections accepted, by listener and worker thread.",
            &["listener", "worker"],
        );
        let workers = IntGauge::new(
            "fencegate_workers",
            "Worker threads serving the proxy listeners.",
        )
        .expect("metric");
        registry
            .register(Box::new(workers.clone()))
            .expect("register");
        let leases = counter(
            "fencegate_lease_requests_total",
            "Lease API requests, by operation and result.",
            &["op", "result"],
        );
        let lease_latency = histogram(
            "fencegate_lease_seconds",
            "Lease API answer time, by operation (an acquire's wait included).",
            &["op"],
            0.000_05,
        );
        store_up.set(1);
        Self {
            leases,
            lease_latency,
            worker_connections,
            workers,
            connections,
            connections_closed,
            tls_not_after,
            tls_handshake_failures,
            reloads,
            last_reload_ok,
            store_amnesia,
            store_shard_up,
            store_shard_groups,
            store_shard_groups_lost,
            store_replicas_wanted,
            store_replicas_confirmed,
            store_replica_wait_failures,
            replica_wait_failures: Default::default(),
            connections_served,
            lane_handoffs,
            admin_requests,
            registry,
            writes,
            requests,
            read_tokens_ignored,
            store_errors,
            admission_wait,
            admission_waited_out,
            store_latency,
            store_batch_size,
            upstream_latency,
            upstream_queued,
            upstream_queue_timeouts,
            upstream_connections,
            upstream_errors,
            response_bodies_cut,
            in_flight,
            store_up,
            recovering,
            recovery_held_keys,
            recovery_seconds_left,
            in_flight_marks,
        }
    }

    /// Brings `store_replica_wait_failures` up to the store's count:
    /// of two scrapes at once, only the one that raises the mark adds.
    pub fn replica_wait_failures_seen(&self, count: u64) {
        let before = self
            .replica_wait_failures
            .fetch_max(count, std::sync::atomic::Ordering::Relaxed);
        self.store_replica_wait_failures
            .inc_by(count.saturating_sub(before));
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        use prometheus::Encoder;
        let mut out = Vec::new();
        let encoder = prometheus::TextEncoder::new();
        if encoder.encode(&self.registry.gather(), &mut out).is_err() {
            return String::new();
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// A route's metric handles, resolved once at start: the per-request path
/// then touches atomics only, no label hashing.
#[derive(Clone)]
pub struct RouteMetrics {
    pub in_flight: IntGauge,
    pub admitted: prometheus::IntCounter,
    pub admission_wait: prometheus::Histogram,
    pub upstream_latency: prometheus::Histogram,
    pub read_tokens_ignored: prometheus::IntCounter,
    pub admission_waited_out: prometheus::IntCounter,
    pub requests: std::sync::Arc<RequestCounters>,
}

/// `fencegate_requests_total` of one route. Each (class, status) series is
/// looked up once, on its first request; later requests pay an array index,
/// not a hash of three labels under a lock.
pub struct RequestCounters {
    vec: IntCounterVec,
    route: String,
    /// Reads then writes, one cell per status 100..=599.
    cells: Box<[std::sync::OnceLock<prometheus::IntCounter>]>,
}

impl RequestCounters {
    const STATUSES: usize = 500;

    fn new(vec: IntCounterVec, route: &str) -> Self {
        Self {
            vec,
            route: route.to_string(),
            cells: (0..2 * Self::STATUSES)
                .map(|_| std::sync::OnceLock::new())
                .collect(),
        }
    }

    pub fn inc(&self, write: bool, status: http::StatusCode) {
        let class = if write { "write" } else { "read" };
        let code = usize::from(status.as_u16());
        let series = || {
            self.vec
                .with_label_values(&[&self.route, class, status.as_str()])
        };
        match code.checked_sub(100).filter(|c| *c < Self::STATUSES) {
            Some(c) => self.cells[usize::from(write) * Self::STATUSES + c]
                .get_or_init(series)
                .inc(),
            None => series().inc(),
        }
    }
}

impl Metrics {
    /// Exports the certificate expiry and the TLS reload gauge (only
    /// servers with a TLS listener have them: a 0 would look like an
    /// expired certificate).
    pub fn track_tls(&self) {
        let _ = self.registry.register(Box::new(self.tls_not_after.clone()));
        self.last_reload_ok.with_label_values(&["tls"]).set(1);
    }

    /// Counts a reload and sets the last-reload gauge.
    pub fn reloaded(&self, what: &str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.reloads.with_label_values(&[what, result]).inc();
        self.last_reload_ok
            .with_label_values(&[what])
            .set(i64::from(ok));
    }

    pub fn route(&self, name: &str) -> RouteMetrics {
        RouteMetrics {
            in_flight: self.in_flight.with_label_values(&[name]),
            admitted: self.writes.with_label_values(&[name, "admitted"]),
            admission_wait: self.admission_wait.with_label_values(&[name]),
            upstream_latency: self.upstream_latency.with_label_values(&[name]),
            read_tokens_ignored: self.read_tokens_ignored.with_label_values(&[name]),
            admission_waited_out: self.admission_waited_out.with_label_values(&[name]),
            requests: std::sync::Arc::new(RequestCounters::new(self.requests.clone(), name)),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
