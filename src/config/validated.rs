//! The validated [`Config`]: built from a [`RawConfig`] with `TryFrom`,
//! which fills every default and names the field at fault; and written
//! back out as TOML (`fencegate config`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::tls::TlsConfig;

use super::error::*;
use super::parse::*;
use super::raw::*;
use super::route::*;
use super::store::*;

/// The most workers a config may ask for.
pub const MAX_WORKERS: usize = 1024;

/// The lease API (`lease_listen`): the lock service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    pub listen: SocketAddr,
    pub token_file: PathBuf,
    /// The bearer tokens read from `token_file`, with their key scopes.
    pub tokens: Vec<crate::bearer::Bearer>,
    /// Bounds `ttl_ms` and `wait_ms`.
    pub max_ttl: Duration,
}

/// Limits and client-side timeouts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Open connections per listener; more are closed at once (counted).
    pub max_connections: usize,
    pub max_header_bytes: usize,
    /// Longest fence key (`namespace:resource`), bytes: each key costs
    /// memory in the highest-token cache and a row in the store.
    pub max_key_bytes: usize,
    /// `None`: no limit.
    pub max_body_bytes: Option<u64>,
    /// A client that has not sent a complete request head within this is
    /// dropped (slowloris). A connection (HTTP/1 or HTTP/2) with no request
    /// being served that reads and writes nothing for this long is closed
    /// too: this is the idle timeout as well.
    pub header_read_timeout: Duration,
    /// Longest pause between two chunks of a request body.
    pub body_read_timeout: Duration,
    /// Longest pause in a response body on its way to the client: no byte
    /// from the upstream (nginx's `proxy_read_timeout`), or none taken by
    /// the client (nginx's `send_timeout`). A connection with a response
    /// streaming is not idle: `header_read_timeout` does not apply to it.
    pub response_idle_timeout: Duration,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The plain listener; `None` (`listen = "off"`) when only TLS is
    /// served.
    pub listen: Option<SocketAddr>,
    pub admin_listen: SocketAddr,
    pub store: StoreConfig,
    pub highest_cache_entries: usize,
    /// Worker threads; `None`: one per CPU this process may use
    /// (its affinity mask and cgroup quota, counted by the server), decided at start.
    pub workers: Option<usize>,
    /// Bearer token for mutating admin endpoints (read from the file).
    pub admin_token: Option<String>,
    pub admin_token_file: Option<PathBuf>,
    /// The lease API; `None` when `lease_listen` is not set.
    pub lease: Option<LeaseConfig>,
    pub shutdown_grace: Duration,
    pub access_log: bool,
    /// The last refusals kept for the admin API and page
    /// (`crate::refusals`); read at start, not by a reload.
    pub refusals_kept: usize,
    /// The last raises kept for the admin lookup and page
    /// (`crate::raises`); read at start, not by a reload.
    pub raises_kept: usize,
    /// The plain listener reads a PROXY protocol header first.
    pub proxy_protocol: bool,
    /// Who may speak for clients; `None` when `trusted_proxies` is unset,
    /// and forwarded headers are then appended to as they come, with the
    /// socket's peer as the client.
    pub trusted_proxies: Option<crate::proxy_protocol::TrustedProxies>,
    pub limits: Limits,
    pub tls: Option<TlsConfig>,
    /// Settings that are valid but work against each other, each naming
    /// its fields: logged at start and by `check-config`.
    pub warnings: Vec<String>,
    pub routes: Vec<Route>,
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        // Routes whose upstream_timeout was given, or every route if
        // shutdown_grace was (the two defaults are not warned about: see
        // `Config::timeout_warnings`).
        let timeout_given: Vec<bool> = raw
            .routes
            .iter()
            .map(|r| r.upstream_timeout.is_some() || raw.shutdown_grace.is_some())
            .collect();
        // `off`: no plain listener, only TLS (so that client certificates
        // cannot be bypassed).
        let listen = match raw.listen.as_deref() {
            Some("off") => None,
            _ => Some(socket("listen", &raw.listen, "127.0.0.1:8080")?),
        };
        let admin_listen = socket("admin_listen", &raw.admin_listen, "127.0.0.1:9090")?;
        if listen == Some(admin_listen) && admin_listen.port() != 0 {
            return Err(invalid("admin_listen", "must differ from `listen`"));
        }
        let store = store(&raw)?;
        let tls = tls_listener(&raw.tls)?;
        let (proxy_protocol, trusted_proxies) = proxies(&raw, tls.as_ref())?;
        if listen.is_none() && tls.is_none() {
            return Err(invalid(
                "listen",
                "`off` needs a TLS listener ([tls] or --tls-listen)",
            ));
        }
        if let Some(t) = &tls {
            if (Some(t.listen) == listen || t.listen == admin_listen) && t.listen.port() != 0 {
                return Err(invalid(
                    "tls.listen",
                    "must differ from `listen` and `admin_listen`",
                ));
            }
        }
        if raw.routes.is_empty() {
            return Err(invalid(
                "routes",
                "at least one route (or --upstream) is required",
            ));
        }
        let routes = raw
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| route(i, r))
            .collect::<Result<Vec<_>, _>>()?;
        let mut names = BTreeSet::new();
        let mut matches = BTreeSet::new();
        for (i, r) in routes.iter().enumerate() {
            // A route admitting any token raises the keys of its namespace:
            // on a granted route of the same namespace its tokens would
            // count as granted.
            if let Some(other) = routes[..i]
                .iter()
                .find(|o| o.namespace == r.namespace && o.tokens != r.tokens)
            {
                return Err(invalid(
                    format!("routes[{i}].tokens"),
                    format!(
                        "routes `{}` and `{}` share namespace `{}` but not `tokens`: a route admitting any token would raise the keys of a granted one (give the granted route a namespace of its own)",
                        other.name, r.name, r.namespace
                    ),
                ));
            }
            if !names.insert(r.name.clone()) {
                return Err(invalid(
                    format!("routes[{i}].name"),
                    format!("`{}` is used twice", r.name),
                ));
            }
            // Two routes for the same requests: only one could ever be
            // used, and which one would hang on their order in the file.
            let prefix = r.path_prefix.trim_end_matches('/').to_string();
            if !matches.insert((r.host.clone(), prefix)) {
                return Err(invalid(
                    format!("routes[{i}].path_prefix"),
                    "another route has the same host and path_prefix",
                ));
            }
        }
        let admin_token = match &raw.admin_token_file {
            None => None,
            Some(p) => {
                let t = std::fs::read_to_string(p).map_err(|e| {
                    invalid(
                        "admin_token_file",
                        format!("cannot read {}: {e}", p.display()),
                    )
                })?;
                let t = t.trim().to_string();
                if t.len() < 16 {
                    return Err(invalid(
                        "admin_token_file",
                        "the token must be at least 16 characters",
                    ));
                }
                Some(t)
            }
        };
        let lease = lease(&raw, listen, admin_listen)?;
        let l = &raw.limits;
        let max_header_bytes = l.max_header_bytes.unwrap_or(64 * 1024);
        if !(8192..=1 << 24).contains(&max_header_bytes) {
            return Err(invalid(
                "limits.max_header_bytes",
                "must be between 8192 and 16777216",
            ));
        }
        let max_connections = l.max_connections.unwrap_or(10_000);
        if !(1..=1_000_000).contains(&max_connections) {
            return Err(invalid(
                "limits.max_connections",
                "must be between 1 and 1000000",
            ));
        }
        let max_key_bytes = l.max_key_bytes.unwrap_or(1536);
        if !(64..=65536).contains(&max_key_bytes) {
            return Err(invalid(
                "limits.max_key_bytes",
                "must be between 64 and 65536",
            ));
        }
        let max_body_bytes = match l.max_body_bytes {
            Some(0) => {
                return Err(invalid(
                    "limits.max_body_bytes",
                    "must be greater than zero (omit it for no limit)",
                ))
            }
            v => v,
        };
        let cache = raw.highest_cache_entries.unwrap_or(1_000_000);
        let workers = match raw.workers {
            None => None,
            Some(n) if (1..=MAX_WORKERS as u64).contains(&n) => Some(n as usize),
            Some(_) => {
                return Err(invalid(
                    "workers",
                    format!(
                        "must be between 1 and {} (omit it for one per CPU)",
                        MAX_WORKERS
                    ),
                ))
            }
        };
        let mut config = Config {
            workers,
            listen,
            admin_listen,
            store,
            highest_cache_entries: usize::try_from(cache)
                .map_err(|_| invalid("highest_cache_entries", "too large"))?,
            admin_token,
            admin_token_file: raw.admin_token_file.clone(),
            lease,
            shutdown_grace: duration(
                "shutdown_grace",
                &raw.shutdown_grace,
                Duration::from_secs(30),
            )?,
            access_log: raw.access_log.unwrap_or(false),
            refusals_kept: ring_size(
                "refusals_kept",
                raw.refusals_kept,
                256,
                crate::ring::MAX_KEPT,
            )?,
            raises_kept: ring_size("raises_kept", raw.raises_kept, 1024, crate::ring::MAX_KEPT)?,
            proxy_protocol,
            trusted_proxies,
            limits: Limits {
                max_connections: max_connections as usize,
                max_header_bytes: max_header_bytes as usize,
                max_key_bytes: max_key_bytes as usize,
                max_body_bytes,
                header_read_timeout: duration(
                    "limits.header_read_timeout",
                    &l.header_read_timeout,
                    Duration::from_secs(10),
                )?,
                body_read_timeout: duration(
                    "limits.body_read_timeout",
                    &l.body_read_timeout,
                    Duration::from_secs(60),
                )?,
                response_idle_timeout: response_idle_timeout(l)?,
            },
            tls,
            routes,
            warnings: Vec::new(),
        };
        config.warnings = config.timeout_warnings(&timeout_given);
        Ok(config)
    }
}

/// `limits.response_idle_timeout`: at least as long as the idle timeout
/// (`header_read_timeout`), or a response's pause would be cut sooner than
/// a connection with nothing to do; at most a day, the longest pause any
/// stream is worth a descriptor and an upstream connection for.
pub(super) fn response_idle_timeout(l: &RawLimits) -> Result<Duration, ConfigError> {
    let field = "limits.response_idle_timeout";
    let idle = duration(
        "limits.header_read_timeout",
        &l.header_read_timeout,
        Duration::from_secs(10),
    )?;
    let d = duration(field, &l.response_idle_timeout, Duration::from_secs(60))?;
    if d > Duration::from_secs(24 * 3600) {
        return Err(invalid(field, "must be at most 24h"));
    }
    if d < idle {
        return Err(invalid(
            field,
            format!(
                "must not be shorter than limits.header_read_timeout ({}): a streaming response would be cut sooner than an idle connection",
                format_duration(idle)
            ),
        ));
    }
    Ok(d)
}

pub(super) fn tls_listener(raw: &Option<RawTls>) -> Result<Option<TlsConfig>, ConfigError> {
    let Some(t) = raw else { return Ok(None) };
    let tls = TlsConfig {
        listen: socket("tls.listen", &t.listen, "127.0.0.1:8443")?,
        cert: t
            .cert
            .clone()
            .ok_or_else(|| invalid("tls.cert", "is required in [tls]"))?,
        key: t
            .key
            .clone()
            .ok_or_else(|| invalid("tls.key", "is required in [tls]"))?,
        client_ca: t.client_ca.clone(),
        watch_interval: duration(
            "tls.watch_interval",
            &t.watch_interval,
            Duration::from_secs(5),
        )?,
        proxy_protocol: t.proxy_protocol.unwrap_or(false),
    };
    crate::tls::server_config(&tls)?;
    Ok(Some(tls))
}

/// `proxy_protocol` on the plain listener, and `trusted_proxies`: a
/// listener that reads PROXY headers needs someone trusted to send them.
pub(super) fn proxies(
    raw: &RawConfig,
    tls: Option<&TlsConfig>,
) -> Result<(bool, Option<crate::proxy_protocol::TrustedProxies>), ConfigError> {
    let trusted = raw
        .trusted_proxies
        .as_deref()
        .map(crate::proxy_protocol::TrustedProxies::parse)
        .transpose()
        .map_err(|e| invalid("trusted_proxies", e))?;
    let plain = raw.proxy_protocol.unwrap_or(false);
    let untrusted = trusted.as_ref().is_none_or(|t| t.is_empty());
    for (field, on) in [
        ("proxy_protocol", plain),
        ("tls.proxy_protocol", tls.is_some_and(|t| t.proxy_protocol)),
    ] {
        if on && untrusted {
            return Err(invalid(
                field,
                "needs `trusted_proxies`: the addresses of the load balancers that send PROXY headers",
            ));
        }
    }
    Ok((plain, trusted))
}

/// The lease API's settings: all three or none but the TTL bound.
pub(super) fn lease(
    raw: &RawConfig,
    listen: Option<SocketAddr>,
    admin_listen: SocketAddr,
) -> Result<Option<LeaseConfig>, ConfigError> {
    let max_ttl = duration("max_lease_ttl", &raw.max_lease_ttl, Duration::from_secs(60))?;
    if max_ttl.is_zero() {
        return Err(invalid("max_lease_ttl", "must be greater than zero"));
    }
    let Some(text) = &raw.lease_listen else {
        if raw.lease_token_file.is_some() {
            return Err(invalid(
                "lease_token_file",
                "is only used with `lease_listen`",
            ));
        }
        return Ok(None);
    };
    let addr = socket("lease_listen", &Some(text.clone()), "")?;
    let clash = Some(addr) == listen
        || addr == admin_listen
        || raw.tls.as_ref().and_then(|t| t.listen.as_deref()) == Some(text.as_str());
    if clash && addr.port() != 0 {
        return Err(invalid(
            "lease_listen",
            "must differ from `listen`, `admin_listen` and `tls.listen`",
        ));
    }
    let Some(path) = &raw.lease_token_file else {
        return Err(invalid(
            "lease_token_file",
            "is required with `lease_listen`: every lease request needs a bearer token",
        ));
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        invalid(
            "lease_token_file",
            format!("cannot read {}: {e}", path.display()),
        )
    })?;
    let tokens =
        crate::bearer::parse_bearers(&text).map_err(|why| invalid("lease_token_file", why))?;
    Ok(Some(LeaseConfig {
        listen: addr,
        token_file: path.clone(),
        tokens,
        max_ttl,
    }))
}

impl Config {
    /// The effective configuration, every default filled in, as TOML.
    pub fn to_toml(&self) -> String {
        let (store, cache_mib, store_timeout, accept, shared) = match &self.store {
            StoreConfig::Embedded {
                path,
                cache_bytes,
                accept_loss,
            } => (
                path.display().to_string(),
                Some((*cache_bytes >> 20) as u64),
                None,
                accept_loss.then_some(true),
                None,
            ),
            StoreConfig::Shared(s) => (
                s.redacted_url(),
                None,
                Some(format_duration(s.timeout)),
                Some(s.accept_reset),
                Some(s),
            ),
        };
        // Certificate paths given in a PostgreSQL URL stay there.
        let tls = shared.and_then(|s| s.tls.as_ref());
        let in_url = |k: &str| shared.is_some_and(|s| s.url.contains(&format!("{k}=")));
        let raw = RawConfig {
            listen: Some(self.listen.map_or("off".into(), |l| l.to_string())),
            admin_listen: Some(self.admin_listen.to_string()),
            store: Some(store),
            store_cache_mib: cache_mib,
            store_timeout,
            store_replicas_to_wait: shared.and_then(|s| s.replicas_to_wait),
            accept_store_reset: accept,
            store_ca: tls
                .and_then(|t| t.ca.clone())
                .filter(|_| !in_url("sslrootcert")),
            store_client_cert: tls
                .and_then(|t| t.client_cert.clone())
                .filter(|_| !in_url("sslcert")),
            store_client_key: tls
                .and_then(|t| t.client_key.clone())
                .filter(|_| !in_url("sslkey")),
            store_password_file: shared.and_then(|s| s.password_file.clone()),
            store_state_file: shared.and_then(|s| s.state_file.clone()),
            store_password: None,
            highest_cache_entries: Some(self.highest_cache_entries as u64),
            workers: self.workers.map(|n| n as u64),
            admin_token_file: self.admin_token_file.clone(),
            lease_listen: self.lease.as_ref().map(|l| l.listen.to_string()),
            lease_token_file: self.lease.as_ref().map(|l| l.token_file.clone()),
            max_lease_ttl: self.lease.as_ref().map(|l| format_duration(l.max_ttl)),
            shutdown_grace: Some(format_duration(self.shutdown_grace)),
            access_log: Some(self.access_log),
            refusals_kept: Some(self.refusals_kept as u64),
            raises_kept: Some(self.raises_kept as u64),
            proxy_protocol: Some(self.proxy_protocol),
            trusted_proxies: self.trusted_proxies.as_ref().map(|t| t.to_strings()),
            limits: RawLimits {
                max_connections: Some(self.limits.max_connections as u64),
                max_header_bytes: Some(self.limits.max_header_bytes as u64),
                max_key_bytes: Some(self.limits.max_key_bytes as u64),
                max_body_bytes: self.limits.max_body_bytes,
                header_read_timeout: Some(format_duration(self.limits.header_read_timeout)),
                body_read_timeout: Some(format_duration(self.limits.body_read_timeout)),
                response_idle_timeout: Some(format_duration(self.limits.response_idle_timeout)),
            },
            tls: self.tls.as_ref().map(|t| RawTls {
                listen: Some(t.listen.to_string()),
                cert: Some(t.cert.clone()),
                key: Some(t.key.clone()),
                client_ca: t.client_ca.clone(),
                watch_interval: Some(format_duration(t.watch_interval)),
                proxy_protocol: Some(t.proxy_protocol),
            }),
            routes: self
                .routes
                .iter()
                .map(|r| RawRoute {
                    name: Some(r.name.clone()),
                    host: r.host.clone(),
                    path_prefix: Some(r.path_prefix.clone()),
                    upstream: Some(r.upstream.to_string()),
                    key: Some(r.key.to_string()),
                    namespace: Some(r.namespace.clone()),
                    write_methods: match &r.write_methods {
                        WriteMethods::AllButSafe => None,
                        WriteMethods::Only(s) => Some(s.iter().cloned().collect()),
                    },
                    literal_keys: Some(r.literal_keys),
                    strip_token: Some(r.strip_token),
                    max_token_step: r.max_token_step,
                    tokens: Some(
                        match r.tokens {
                            TokenMode::Any => "any",
                            TokenMode::Granted => "granted",
                        }
                        .into(),
                    ),
                    forwarded_headers: Some(r.forwarded_headers),
                    websocket: Some(r.websocket),
                    allow_bodies_on: (!r.allow_bodies_on.is_empty())
                        .then(|| r.allow_bodies_on.iter().cloned().collect()),
                    error_format: Some(r.error_format.as_str().into()),
                    connect_timeout: Some(format_duration(r.connect_timeout)),
                    upstream_timeout: Some(format_duration(r.upstream_timeout)),
                    upstream_max_connections: Some(r.upstream_max_connections as u64),
                    upstream_queue_timeout: (r.upstream_max_connections > 0)
                        .then(|| format_duration(r.upstream_queue_timeout)),
                    upstream_ca: r.upstream_tls.ca.clone(),
                    upstream_client_cert: r.upstream_tls.client_cert.clone(),
                    upstream_client_key: r.upstream_tls.client_key.clone(),
                    upstream_http2: Some(r.upstream_tls.http2),
                })
                .collect(),
        };
        toml::to_string_pretty(&raw).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// The longest upstream timeout: bounds how long a write forwarded before
    /// a crash can still be in flight.
    pub fn max_upstream_timeout(&self) -> Duration {
        self.routes
            .iter()
            .map(|r| r.upstream_timeout)
            .max()
            .unwrap_or_default()
    }

    /// Routes whose upstream_timeout is longer than shutdown_grace, where
    /// either was given. The two defaults (60 s and 30 s) alone are not
    /// warned about: a drain that runs out only costs the recovery window
    /// on keys still being written.
    pub(super) fn timeout_warnings(&self, given: &[bool]) -> Vec<String> {
        self.routes
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                given.get(*i).copied().unwrap_or(false) && r.upstream_timeout > self.shutdown_grace
            })
            .map(|(i, r)| {
                format!(
                    "routes[{i}].upstream_timeout ({}) is longer than shutdown_grace ({}): a stop cannot wait for such a write, and the next start then holds newer tokens on its key for an upstream_timeout; raise shutdown_grace",
                    format_duration(r.upstream_timeout),
                    format_duration(self.shutdown_grace)
                )
            })
            .collect()
    }
}

/// The size of an in-memory ring the operator reads (`name`): `default`
/// when unset, at most `max`.
fn ring_size(
    name: &str,
    raw: Option<u64>,
    default: usize,
    max: usize,
) -> Result<usize, ConfigError> {
    match usize::try_from(raw.unwrap_or(default as u64)) {
        Ok(n) if n <= max => Ok(n),
        _ => Err(invalid(name, format!("at most {max}"))),
    }
}
