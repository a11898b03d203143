//! Configuration: the raw TOML/flag shape and the validated [`Config`].
//!
//! [`RawConfig`] is what a file (or the quick-start flags) says, with every
//! field optional and unknown fields refused. [`Config`] is built from it
//! with `TryFrom`, which checks each value and names the field on failure; a
//! `Config` that exists is one the server can run with.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::key::KeyTemplate;
use crate::tls::{TlsConfig, UpstreamTls};

mod store;
pub use store::{
    redact_url, store, url_password, Secret, Sentinel, SharedEngine, SharedStoreConfig, StoreConfig,
};

/// The most workers a config may ask for.
pub const MAX_WORKERS: usize = 1024;
/// A configuration error, naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    #[error("cannot read config file {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("config file {path}: {reason}")]
    Parse { path: PathBuf, reason: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The file format. Every field is optional; defaults are applied in
/// [`Config::try_from`].
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    /// A file path, or `redb://PATH`.
    pub store: Option<String>,
    /// redb page cache, MiB.
    pub store_cache_mib: Option<u64>,
    /// Timeout of shared-store calls.
    pub store_timeout: Option<String>,
    /// Redis: replicas a change must reach before it counts as stored.
    pub store_replicas_to_wait: Option<u32>,
    /// Accept a shared store that lost data (after checking why).
    pub accept_store_reset: Option<bool>,
    /// Where a shared-store replica keeps the latest marker it saw.
    pub store_state_file: Option<PathBuf>,
    /// PEM CA certificates for a shared store's TLS, instead of the
    /// system's.
    pub store_ca: Option<PathBuf>,
    /// Client certificate (PEM chain) and key presented to a shared store.
    pub store_client_cert: Option<PathBuf>,
    pub store_client_key: Option<PathBuf>,
    /// A file whose first line is the shared store's password.
    pub store_password_file: Option<PathBuf>,
    /// The password from the environment (`FENCEGATE_STORE_PASSWORD`); never
    /// read from or written to a file.
    #[serde(skip)]
    pub store_password: Option<Secret>,
    /// How many highest tokens to keep in memory.
    pub highest_cache_entries: Option<u64>,
    /// Worker threads, each with its own listeners and upstream pools;
    /// absent: the CPUs this process may use.
    pub workers: Option<u64>,
    pub admin_token_file: Option<PathBuf>,
    /// The lease API's listener (the lock service); absent: not served.
    pub lease_listen: Option<String>,
    /// Bearer tokens of the lease API, one per line: `TOKEN [PREFIX ...]`.
    pub lease_token_file: Option<PathBuf>,
    /// The longest TTL (and `wait_ms`) a lease may ask for.
    pub max_lease_ttl: Option<String>,
    pub shutdown_grace: Option<String>,
    /// One log line per request.
    pub access_log: Option<bool>,
    /// The plain listener reads a PROXY protocol header (v1 or v2) first
    /// on every connection.
    pub proxy_protocol: Option<bool>,
    /// Addresses (CIDR ranges) allowed to send PROXY headers and whose
    /// `X-Forwarded-For`/`Forwarded` items are believed.
    pub trusted_proxies: Option<Vec<String>>,
    #[serde(default)]
    pub limits: RawLimits,
    /// A TLS listener (`[tls]`), beside the plain one.
    pub tls: Option<RawTls>,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub listen: Option<String>,
    /// PEM certificate chain, leaf first.
    pub cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
    /// Require client certificates signed by these CAs (mTLS).
    pub client_ca: Option<PathBuf>,
    /// How often the files are checked for changes.
    pub watch_interval: Option<String>,
    /// Every connection starts with a PROXY protocol header (before TLS).
    pub proxy_protocol: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub max_connections: Option<u64>,
    pub max_header_bytes: Option<u64>,
    pub max_key_bytes: Option<u64>,
    pub max_body_bytes: Option<u64>,
    pub header_read_timeout: Option<String>,
    pub body_read_timeout: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Option<String>,
    pub host: Option<String>,
    pub path_prefix: Option<String>,
    pub upstream: Option<String>,
    pub key: Option<String>,
    pub namespace: Option<String>,
    pub write_methods: Option<Vec<String>>,
    pub literal_keys: Option<bool>,
    pub strip_token: Option<bool>,
    /// Refuse a token more than this far above the key's highest.
    pub max_token_step: Option<u64>,
    /// `any` (default) or `granted`: only tokens fencegate's lease API
    /// granted for the key are admitted.
    pub tokens: Option<String>,
    /// Add X-Forwarded-For / X-Forwarded-Proto upstream (default true).
    pub forwarded_headers: Option<bool>,
    /// Pass WebSocket upgrades through (default false: refused, 501).
    pub websocket: Option<bool>,
    /// `problem` (default) or `s3`: how fencegate's own refusals are
    /// written (S3 SDKs read S3's XML errors).
    pub error_format: Option<String>,
    pub connect_timeout: Option<String>,
    pub upstream_timeout: Option<String>,
    /// PEM CA certificates for an https upstream, instead of the system's.
    pub upstream_ca: Option<PathBuf>,
    /// Client certificate (PEM chain) and key presented to the upstream.
    pub upstream_client_cert: Option<PathBuf>,
    pub upstream_client_key: Option<PathBuf>,
    /// Offer HTTP/2 to an https upstream (ALPN); default false.
    pub upstream_http2: Option<bool>,
}

/// Which methods are writes on a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteMethods {
    /// Everything except exactly `GET`, `HEAD` and `OPTIONS` (so `get`
    /// spelled in lower case, `MKCOL` or any unknown method is a write).
    AllButSafe,
    /// Only these (compared case-insensitively, so `put` is a write when
    /// `PUT` is listed).
    Only(BTreeSet<String>),
}

impl WriteMethods {
    pub fn is_write(&self, method: &str) -> bool {
        match self {
            Self::AllButSafe => !matches!(method, "GET" | "HEAD" | "OPTIONS"),
            Self::Only(set) => set.contains(&method.to_ascii_uppercase()),
        }
    }
}

/// A validated upstream origin (`http://host:port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.scheme, self.authority)
    }
}

/// How a route answers the refusals fencegate itself makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ErrorFormat {
    /// RFC 9457 `application/problem+json` (gRPC calls get gRPC statuses).
    #[default]
    Problem,
    /// S3's `<Error>` XML, as S3 SDKs read it.
    S3,
}

impl ErrorFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Problem => "problem",
            Self::S3 => "s3",
        }
    }
}

impl std::str::FromStr for ErrorFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "problem" => Ok(Self::Problem),
            "s3" => Ok(Self::S3),
            other => Err(format!("`{other}` is not `problem` or `s3`")),
        }
    }
}

/// A validated route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub name: String,
    /// Lower-case host without port; `None` matches any host.
    pub host: Option<String>,
    /// Matched on segment boundaries: `/api` matches `/api` and `/api/x`.
    pub path_prefix: String,
    pub upstream: Upstream,
    pub key: KeyTemplate,
    /// Tokens from different lock services must not share a key space.
    pub namespace: String,
    pub write_methods: WriteMethods,
    pub literal_keys: bool,
    pub strip_token: bool,
    /// Token inflation guard: a write whose token is more than this above
    /// the key's highest is refused (a holder with a valid lock could
    /// otherwise lock everyone out with u64::MAX).
    pub max_token_step: Option<u64>,
    /// Which tokens a write may carry.
    pub tokens: TokenMode,
    /// Append the client address to X-Forwarded-For and set
    /// X-Forwarded-Proto on requests sent upstream.
    pub forwarded_headers: bool,
    /// WebSocket upgrades are passed through: the upgrade request is
    /// fenced by its method, the messages after it are not. Off, they are
    /// refused (501) rather than sent on as plain requests.
    pub websocket: bool,
    /// How fencegate's own refusals are written on this route.
    pub error_format: ErrorFormat,
    pub connect_timeout: Duration,
    /// From the first byte sent upstream to the response head. Also bounds
    /// how long a newer write waits behind an older one, and the
    /// crash-recovery window.
    pub upstream_timeout: Duration,
    pub upstream_tls: UpstreamTls,
}

/// Which tokens a route admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenMode {
    /// Any token not below the key's highest (the client's lock service
    /// hands them out).
    Any,
    /// Only a token the lease API granted for the key: equal to the key's
    /// highest. A higher one was never granted (403, never forwarded), so
    /// a forged token cannot lock the key.
    Granted,
}

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

impl AsRef<Route> for Route {
    fn as_ref(&self) -> &Route {
        self
    }
}

impl Route {
    pub fn matches_path(&self, path: &str) -> bool {
        let p = self.path_prefix.trim_end_matches('/');
        p.is_empty()
            || path == p
            || (path.starts_with(p) && path.as_bytes().get(p.len()) == Some(&b'/'))
    }
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

/// Parses `250ms`, `10s`, `2m`, `1h`.
/// The longest duration any setting takes. Durations become deadlines
/// (`Instant + d`), which must not overflow; and no timeout, grace period or
/// recovery window of fencegate's makes sense beyond a day.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// A duration such as `250ms`, `10s`, `2m` or `1h 30m` (humantime's
/// grammar), at most [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let d = humantime::parse_duration(t)
        .map_err(|e| format!("`{t}` is not a duration like 10s or 250ms ({e})"))?;
    if d > MAX_DURATION {
        return Err(format!("`{t}` is out of range (at most 24h)"));
    }
    Ok(d)
}

fn format_duration(d: Duration) -> String {
    if d.subsec_millis() != 0 || d.as_secs() == 0 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs())
    }
}

fn duration(field: &str, raw: &Option<String>, default: Duration) -> Result<Duration, ConfigError> {
    match raw {
        None => Ok(default),
        Some(t) => {
            let d = parse_duration(t).map_err(|r| invalid(field, r))?;
            if d.is_zero() {
                return Err(invalid(field, "must be greater than zero"));
            }
            Ok(d)
        }
    }
}

fn socket(field: &str, raw: &Option<String>, default: &str) -> Result<SocketAddr, ConfigError> {
    let text = raw.as_deref().unwrap_or(default);
    text.parse()
        .map_err(|_| invalid(field, format!("`{text}` is not an IP:port address")))
}

pub fn parse_upstream(field: &str, text: &str) -> Result<Upstream, ConfigError> {
    let uri: http::Uri = text
        .parse()
        .map_err(|e| invalid(field, format!("`{text}` is not a URL: {e}")))?;
    let scheme = uri.scheme().cloned().ok_or_else(|| {
        invalid(
            field,
            format!("`{text}` needs a scheme, e.g. http://{text}"),
        )
    })?;
    if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
        return Err(invalid(
            field,
            format!("`{text}`: the upstream must be http:// or https://"),
        ));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| invalid(field, format!("`{text}` has no host")))?;
    if authority.as_str().contains('@') {
        return Err(invalid(
            field,
            "credentials in the upstream URL are not supported",
        ));
    }
    if authority.host().is_empty() {
        return Err(invalid(field, format!("`{text}` has no host")));
    }
    match uri.path_and_query().map(|p| p.as_str()) {
        None | Some("") | Some("/") => {}
        Some(p) => {
            return Err(invalid(
                field,
                format!(
                    "`{text}` has a path ({p}); an upstream is an origin like http://host:port"
                ),
            ))
        }
    }
    Ok(Upstream { scheme, authority })
}

fn route(i: usize, r: &RawRoute) -> Result<Route, ConfigError> {
    let f = |name: &str| format!("routes[{i}].{name}");
    let name = r.name.clone().unwrap_or_else(|| format!("route{i}"));
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(invalid(f("name"), "use letters, digits, '-', '_' or '.'"));
    }
    // A route's host is compared with a request's host as
    // `key::authority_host` spells it; a spelling that could never equal
    // that is refused rather than left to match nothing.
    let host = match &r.host {
        None => None,
        // An IPv6 address without brackets, as requests' hosts are spelled
        // once parsed.
        Some(h) if h.parse::<std::net::Ipv6Addr>().is_ok() => Some(h.to_ascii_lowercase()),
        Some(h) => match crate::key::authority_host(h) {
            Ok((parsed, None)) if parsed == h.to_ascii_lowercase() => Some(parsed),
            _ => {
                return Err(invalid(
                    f("host"),
                    format!("`{h}` is not a plain lower-case host name or IP address (no port, brackets, trailing dot or user info)"),
                ))
            }
        },
    };
    let path_prefix = r.path_prefix.clone().unwrap_or_else(|| "/".into());
    if !path_prefix.starts_with('/') {
        return Err(invalid(f("path_prefix"), "must start with '/'"));
    }
    // Prefixes are matched on the decoded path: an escape, or a character a
    // path cannot carry plain, could never match.
    if !path_prefix
        .bytes()
        .all(|b| b.is_ascii_graphic() && !matches!(b, b'%' | b'?' | b'#' | b'\\'))
    {
        return Err(invalid(
            f("path_prefix"),
            format!("`{path_prefix}` must be a plain decoded path (no escapes, spaces, '?', '#' or '\\')"),
        ));
    }
    // Routes are matched with runs of `/` merged, and a dot segment or a
    // path parameter (`;`) is refused before it could match: such a prefix
    // would never match.
    if path_prefix.contains(';') {
        return Err(invalid(
            f("path_prefix"),
            format!("`{path_prefix}` has a path parameter (`;`): no request could match it"),
        ));
    }
    // Without its trailing slashes: "" for "/", else "/" and one segment
    // or more (two bytes at least).
    let inner = path_prefix.trim_end_matches('/');
    if inner.len() >= 2
        && inner[1..]
            .split('/')
            .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return Err(invalid(
            f("path_prefix"),
            format!("`{path_prefix}` has an empty or dot segment (`//`, `/./`, `/../`): no request could match it"),
        ));
    }
    let upstream = parse_upstream(
        &f("upstream"),
        r.upstream
            .as_deref()
            .ok_or_else(|| invalid(f("upstream"), "is required"))?,
    )?;
    let upstream_tls = upstream_tls(i, r, &upstream)?;
    let key =
        KeyTemplate::parse(r.key.as_deref().unwrap_or("path")).map_err(|e| invalid(f("key"), e))?;
    let namespace = r.namespace.clone().unwrap_or_else(|| "default".into());
    if namespace.is_empty() || namespace.contains(':') {
        return Err(invalid(f("namespace"), "must be non-empty and without ':'"));
    }
    let write_methods = match &r.write_methods {
        None => WriteMethods::AllButSafe,
        Some(list) => {
            let mut set = BTreeSet::new();
            for m in list {
                if http::Method::from_bytes(m.as_bytes()).is_err() {
                    return Err(invalid(
                        f("write_methods"),
                        format!("`{m}` is not a method token"),
                    ));
                }
                set.insert(m.to_ascii_uppercase());
            }
            WriteMethods::Only(set)
        }
    };
    if r.websocket == Some(true) && upstream_tls.http2 {
        // HTTP/2 has no Upgrade: the handshake would reach the backend as
        // a plain GET.
        return Err(invalid(
            f("websocket"),
            "cannot go with upstream_http2 (WebSocket handshakes are HTTP/1.1 upgrades)",
        ));
    }
    let literal_keys = r.literal_keys.unwrap_or(false);
    // Literal keys read `+` as a space; routes are matched on the path as
    // sent, so a `+` in a literal route's prefix would put `a+b` and `a%20b`
    // (one name to the key) on two routes.
    if literal_keys && path_prefix.contains('+') {
        return Err(invalid(
            f("path_prefix"),
            format!("`{path_prefix}` has a `+`, which literal keys read as a space: `+` and `%20` spellings of one name would meet two routes"),
        ));
    }
    Ok(Route {
        name,
        host,
        path_prefix,
        upstream,
        key,
        namespace,
        write_methods,
        literal_keys,
        strip_token: r.strip_token.unwrap_or(false),
        max_token_step: match r.max_token_step {
            Some(0) => {
                return Err(invalid(
                    f("max_token_step"),
                    "must be at least 1 (omit it for no limit)",
                ))
            }
            v => v,
        },
        tokens: match r.tokens.as_deref() {
            None | Some("any") => TokenMode::Any,
            Some("granted") => TokenMode::Granted,
            Some(other) => {
                return Err(invalid(
                    f("tokens"),
                    format!("`{other}` is not `any` or `granted`"),
                ))
            }
        },
        forwarded_headers: r.forwarded_headers.unwrap_or(true),
        websocket: r.websocket.unwrap_or(false),
        error_format: match r.error_format.as_deref() {
            None => ErrorFormat::Problem,
            Some(v) => v
                .parse()
                .map_err(|reason: String| invalid(f("error_format"), reason))?,
        },
        connect_timeout: duration(
            &f("connect_timeout"),
            &r.connect_timeout,
            Duration::from_secs(5),
        )?,
        upstream_timeout: duration(
            &f("upstream_timeout"),
            &r.upstream_timeout,
            Duration::from_secs(60),
        )?,
        upstream_tls,
    })
}

fn upstream_tls(i: usize, r: &RawRoute, upstream: &Upstream) -> Result<UpstreamTls, ConfigError> {
    let f = |name: &str| format!("routes[{i}].{name}");
    let tls = UpstreamTls {
        ca: r.upstream_ca.clone(),
        client_cert: r.upstream_client_cert.clone(),
        client_key: r.upstream_client_key.clone(),
        // Off by default: over HTTP/2 the `:authority` is the upstream's
        // address while `Host` is the client's (SigV4 signs Host), and a
        // route would share one multiplexed connection.
        http2: r.upstream_http2.unwrap_or(false),
    };
    if upstream.scheme != http::uri::Scheme::HTTPS {
        let set = [
            ("upstream_ca", tls.ca.is_some()),
            ("upstream_client_cert", tls.client_cert.is_some()),
            ("upstream_client_key", tls.client_key.is_some()),
        ];
        if let Some((name, _)) = set.iter().find(|(_, s)| *s) {
            return Err(invalid(f(name), "only applies to an https:// upstream"));
        }
    }
    match (&tls.client_cert, &tls.client_key) {
        (Some(_), None) => Err(invalid(
            f("upstream_client_key"),
            "is required with upstream_client_cert",
        )),
        (None, Some(_)) => Err(invalid(
            f("upstream_client_cert"),
            "is required with upstream_client_key",
        )),
        _ => {
            // Load the files now, so check-config and a reload catch them.
            crate::tls::upstream_connector(
                &format!("routes[{i}]"),
                &upstream.scheme,
                &tls,
                hyper_util::client::legacy::connect::HttpConnector::new(),
            )?;
            Ok(tls)
        }
    }
}

fn tls_listener(raw: &Option<RawTls>) -> Result<Option<TlsConfig>, ConfigError> {
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
fn proxies(
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
fn lease(
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

impl From<crate::tls::TlsError> for ConfigError {
    fn from(e: crate::tls::TlsError) -> Self {
        invalid(e.field, e.reason)
    }
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
            },
            tls,
            routes,
            warnings: Vec::new(),
        };
        config.warnings = config.timeout_warnings(&timeout_given);
        Ok(config)
    }
}

impl RawConfig {
    /// Reads and parses a TOML file; unknown fields are errors. Relative
    /// file paths in it are relative to the file's directory, as a config
    /// file is read by a service whose working directory is not the
    /// operator's (flags and environment variables stay relative to the
    /// working directory).
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let mut raw = Self::from_toml(&text).map_err(|reason| ConfigError::Parse {
            path: path.to_path_buf(),
            reason,
        })?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Absolute, so that the printed config (`check-config`) names
            // the same files wherever it is read back.
            let dir = std::path::absolute(dir).map_err(|e| ConfigError::Read {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
            raw.resolve_paths(&dir)?;
        }
        Ok(raw)
    }

    /// Makes every relative file path `dir`-relative: the store file
    /// (`PATH` or `redb://PATH`, not a shared store's URL, whose query
    /// parameters are the driver's), key, certificate, token and state
    /// files.
    ///
    /// Before this rule such paths were the working directory's: a store
    /// (or state) file found there and not beside the config file refuses
    /// the start, naming both, instead of a new, empty store forgetting
    /// every fence.
    fn resolve_paths(&mut self, dir: &std::path::Path) -> Result<(), ConfigError> {
        let join = |p: &mut Option<PathBuf>| {
            if let Some(p) = p.as_mut().filter(|p| p.is_relative()) {
                *p = dir.join(&*p);
            }
        };
        let moved = |field: &str, given: &std::path::Path| -> Result<PathBuf, ConfigError> {
            let resolved = dir.join(given);
            if !resolved.exists() && given.exists() {
                return Err(invalid(
                    field,
                    format!(
                        "`{}` is relative to the config file's directory: {}, which does not exist; {} (from the working directory, where fencegate looked before) does: move it beside the config file, or give an absolute path",
                        given.display(),
                        resolved.display(),
                        std::path::absolute(given).unwrap_or_else(|_| given.to_path_buf()).display()
                    ),
                ));
            }
            Ok(resolved)
        };
        if let Some(store) = &mut self.store {
            let (scheme, rest) = match store.strip_prefix("redb://") {
                Some(rest) => ("redb://", rest.to_string()),
                None if !store.contains("://") => ("", store.clone()),
                None => ("", String::new()),
            };
            if !rest.is_empty() && std::path::Path::new(&rest).is_relative() {
                let resolved = moved("store", std::path::Path::new(&rest))?;
                *store = format!("{scheme}{}", resolved.display());
            }
        }
        if let Some(p) = self.store_state_file.as_mut().filter(|p| p.is_relative()) {
            *p = moved("store_state_file", p)?;
        }
        for p in [
            &mut self.store_ca,
            &mut self.store_client_cert,
            &mut self.store_client_key,
            &mut self.store_password_file,
            &mut self.admin_token_file,
            &mut self.lease_token_file,
        ] {
            join(p);
        }
        if let Some(tls) = &mut self.tls {
            for p in [&mut tls.cert, &mut tls.key, &mut tls.client_ca] {
                join(p);
            }
        }
        for r in &mut self.routes {
            for p in [
                &mut r.upstream_ca,
                &mut r.upstream_client_cert,
                &mut r.upstream_client_key,
            ] {
                join(p);
            }
        }
        Ok(())
    }

    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }
}

impl Config {
    /// The effective configuration, every default filled in, as TOML.
    pub fn to_toml(&self) -> String {
        let (store, cache_mib, store_timeout, accept, shared) = match &self.store {
            StoreConfig::Embedded { path, cache_bytes } => (
                path.display().to_string(),
                Some((*cache_bytes >> 20) as u64),
                None,
                None,
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
            proxy_protocol: Some(self.proxy_protocol),
            trusted_proxies: self.trusted_proxies.as_ref().map(|t| t.to_strings()),
            limits: RawLimits {
                max_connections: Some(self.limits.max_connections as u64),
                max_header_bytes: Some(self.limits.max_header_bytes as u64),
                max_key_bytes: Some(self.limits.max_key_bytes as u64),
                max_body_bytes: self.limits.max_body_bytes,
                header_read_timeout: Some(format_duration(self.limits.header_read_timeout)),
                body_read_timeout: Some(format_duration(self.limits.body_read_timeout)),
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
                    error_format: Some(r.error_format.as_str().into()),
                    connect_timeout: Some(format_duration(r.connect_timeout)),
                    upstream_timeout: Some(format_duration(r.upstream_timeout)),
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
    fn timeout_warnings(&self, given: &[bool]) -> Vec<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> RawConfig {
        RawConfig::from_toml(
            r#"
            store = "/tmp/fencegate-config-test.redb"
            [[routes]]
            upstream = "http://127.0.0.1:9000"
            "#,
        )
        .unwrap()
    }

    fn err(raw: RawConfig) -> String {
        Config::try_from(raw).unwrap_err().to_string()
    }

    /// The base config with `extra` lines added to its route, and `top`
    /// lines before it.
    fn with(top: &str, extra: &str) -> RawConfig {
        RawConfig::from_toml(&format!(
            "store = \"/tmp/fencegate-config-test.redb\"\n{top}\n[[routes]]\nupstream = \"http://127.0.0.1:9000\"\n{extra}\n"
        ))
        .unwrap()
    }

    #[test]
    fn the_admin_token_has_at_least_16_characters() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("admin-token");
        let top = format!("admin_token_file = \"{}\"", file.display());
        for (token, ok) in [
            ("0123456789abcde", false),
            ("0123456789abcdef", true),
            (" 0123456789abcdef0 \n", true),
        ] {
            std::fs::write(&file, token).unwrap();
            let c = Config::try_from(with(&top, ""));
            assert_eq!(c.is_ok(), ok, "{token:?}");
            if ok {
                assert_eq!(c.unwrap().admin_token.as_deref(), Some(token.trim()));
            } else {
                assert!(err(with(&top, "")).contains("admin_token_file"));
            }
        }
    }

    #[test]
    fn listeners_files_and_the_longest_timeout() {
        assert!(err(with(
            "listen = \"127.0.0.1:7200\"\nadmin_listen = \"127.0.0.1:7200\"",
            ""
        ))
        .contains("admin_listen"));
        // Port 0 on both: two ephemeral ports, no clash.
        assert!(Config::try_from(with(
            "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"",
            ""
        ))
        .is_ok());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f.toml");
        std::fs::write(
            &file,
            "store = \"/tmp/x.redb\"\n[[routes]]\nupstream = \"http://127.0.0.1:1\"\nupstream_timeout = \"7s\"\n[[routes]]\npath_prefix = \"/b\"\nupstream = \"http://127.0.0.1:2\"\nupstream_timeout = \"9s\"\n",
        )
        .unwrap();
        let raw = RawConfig::from_file(&file).unwrap();
        assert_eq!(raw.store.as_deref(), Some("/tmp/x.redb"));
        let c = Config::try_from(raw).unwrap();
        assert_eq!(c.max_upstream_timeout(), Duration::from_secs(9));
        assert!(RawConfig::from_file(&dir.path().join("missing.toml")).is_err());
    }

    #[test]
    fn an_upstream_timeout_past_the_shutdown_grace_is_warned_about() {
        let config = |text: &str| Config::try_from(RawConfig::from_toml(text).unwrap()).unwrap();
        let route = "store = \"/tmp/x.redb\"\n[[routes]]\nupstream = \"http://127.0.0.1:1\"\n";
        assert!(config(route).warnings.is_empty());
        let w = config(&format!("{route}upstream_timeout = \"120s\"")).warnings;
        assert_eq!(w.len(), 1);
        assert!(
            w[0].starts_with(
                "routes[0].upstream_timeout (120s) is longer than shutdown_grace (30s)"
            ),
            "{w:?}"
        );
        assert!(config(&format!(
            "shutdown_grace = \"2m\"\n{route}upstream_timeout = \"120s\""
        ))
        .warnings
        .is_empty());
        // A shorter shutdown_grace than the default upstream_timeout.
        assert_eq!(
            config(&format!("shutdown_grace = \"10s\"\n{route}"))
                .warnings
                .len(),
            1
        );
        // The flag sets every route's, as given.
        let mut raw = RawConfig::from_toml(route).unwrap();
        raw.routes[0].upstream_timeout = Some("45s".into());
        assert_eq!(Config::try_from(raw).unwrap().warnings.len(), 1);
    }

    /// Relative paths in a config file are the file's directory's; absolute
    /// ones and shared-store URLs are left as they are.
    #[test]
    fn relative_paths_in_a_file_are_relative_to_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("conf");
        std::fs::create_dir(&conf).unwrap();
        let read = |text: &str| {
            std::fs::write(conf.join("f.toml"), text).unwrap();
            RawConfig::from_file(&conf.join("f.toml")).unwrap()
        };
        let raw = read(
            "store = \"fences.redb\"\nlease_token_file = \"tokens\"\nadmin_token_file = \"/etc/admin\"\n\
             [tls]\ncert = \"tls/chain.pem\"\nkey = \"./key.pem\"\n\
             [[routes]]\nupstream = \"https://x\"\nupstream_ca = \"ca.pem\"\n",
        );
        assert_eq!(
            raw.store,
            Some(conf.join("fences.redb").display().to_string())
        );
        assert_eq!(raw.lease_token_file, Some(conf.join("tokens")));
        assert_eq!(raw.admin_token_file, Some(PathBuf::from("/etc/admin")));
        let tls = raw.tls.unwrap();
        assert_eq!(tls.cert, Some(conf.join("tls/chain.pem")));
        assert_eq!(tls.key, Some(conf.join("./key.pem")));
        assert_eq!(raw.routes[0].upstream_ca, Some(conf.join("ca.pem")));
        assert_eq!(
            read("store = \"redb://f.redb\"").store,
            Some(format!("redb://{}", conf.join("f.redb").display()))
        );
        for url in [
            "redis://127.0.0.1:6379/0",
            "/var/lib/f.redb",
            "redb:///var/f.redb",
        ] {
            assert_eq!(
                read(&format!("store = \"{url}\"")).store.as_deref(),
                Some(url)
            );
        }
        // In the working directory itself: nothing to join.
        let here = RawConfig::from_toml("store = \"f.redb\"").unwrap();
        assert_eq!(here.store.as_deref(), Some("f.redb"));
        // A store the old rule found (from the working directory) and the
        // new one does not: refused, not replaced by a new empty store.
        // The old store sits under the working directory and is named
        // without `..`, so the name cannot also lead somewhere from the
        // config file's directory (a `../` chain climbing to the root would,
        // whenever both directories are equally deep).
        let cwd_dir = tempfile::tempdir_in(std::env::current_dir().unwrap()).unwrap();
        let name = cwd_dir.path().file_name().unwrap().to_str().unwrap();
        let from_cwd = format!("{name}/old.redb");
        std::fs::write(&from_cwd, b"x").unwrap();
        assert!(!conf.join(&from_cwd).exists());
        std::fs::write(conf.join("f.toml"), format!("store = \"{from_cwd}\"")).unwrap();
        let e = RawConfig::from_file(&conf.join("f.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("invalid `store`") && e.contains("move it beside the config file"),
            "{e}"
        );
    }

    /// Store TLS files given in the URL are printed there only; given as
    /// settings, as settings: the printed config reads back the same.
    #[test]
    fn store_tls_files_print_once() {
        let dir = tempfile::tempdir().unwrap();
        let f = |n: &str| {
            let p = dir.path().join(n);
            std::fs::write(&p, "x").unwrap();
            p.display().to_string()
        };
        let (ca, cert, key) = (f("ca.pem"), f("c.pem"), f("k.pem"));
        let in_url = format!(
            "store = \"postgres://fg@db/fg?sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}\""
        );
        let as_settings = format!(
            "store = \"postgres://fg@db/fg?sslmode=verify-full\"\nstore_ca = \"{ca}\"\nstore_client_cert = \"{cert}\"\nstore_client_key = \"{key}\""
        );
        for (top, settings) in [(in_url, false), (as_settings, true)] {
            let raw = RawConfig::from_toml(&format!(
                "{top}\n[[routes]]\nupstream = \"http://127.0.0.1:9000\"\n"
            ))
            .unwrap();
            let printed = Config::try_from(raw).unwrap().to_toml();
            for field in ["store_ca", "store_client_cert", "store_client_key"] {
                assert_eq!(printed.contains(field), settings, "{field}: {printed}");
            }
        }
    }

    #[test]
    fn durations_print_in_the_unit_they_read_back_in() {
        assert_eq!(format_duration(Duration::from_secs(2)), "2s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_duration(Duration::ZERO), "0ms");
    }

    #[test]
    fn route_names_prefixes_and_client_certificates_are_checked() {
        assert!(Config::try_from(with("", "name = \"ok-1.x_y\"")).is_ok());
        for bad in ["\"\"", "\"a b\"", "\"a/b\""] {
            assert!(
                err(with("", &format!("name = {bad}"))).contains("routes[0].name"),
                "{bad}"
            );
        }
        assert!(Config::try_from(with("", "path_prefix = \"/\"")).is_ok());
        assert!(Config::try_from(with("", "path_prefix = \"/a/\"")).is_ok());
        for bad in ["/.", "/./", "/a//b", "/a/.."] {
            assert!(
                err(with("", &format!("path_prefix = \"{bad}\"")))
                    .contains("routes[0].path_prefix"),
                "{bad}"
            );
        }
        assert!(Config::try_from(with("", "path_prefix = \"/a+b\"")).is_ok());
        assert!(err(with("", "path_prefix = \"/a+b\"\nliteral_keys = true"))
            .contains("routes[0].path_prefix"));
        let https = |line: &str| {
            RawConfig::from_toml(&format!(
                "store = \"/tmp/fencegate-config-test.redb\"\n[[routes]]\nupstream = \"https://127.0.0.1:9443\"\n{line}\n"
            ))
            .unwrap()
        };
        assert!(err(https("upstream_client_key = \"/nonexistent/k.pem\""))
            .contains("routes[0].upstream_client_cert"));
        assert!(err(https("upstream_client_cert = \"/nonexistent/c.pem\""))
            .contains("routes[0].upstream_client_key"));
    }

    #[test]
    fn the_lease_listener_needs_an_address_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = dir.path().join("lease-tokens");
        std::fs::write(&tokens, "abcdefghijklmnopqrstuvwx\n").unwrap();
        let top = |lease: &str| {
            format!(
                "listen = \"127.0.0.1:7100\"\nadmin_listen = \"127.0.0.1:7101\"\nlease_listen = \"{lease}\"\nlease_token_file = \"{}\"",
                tokens.display()
            )
        };
        let ok = Config::try_from(with(&top("127.0.0.1:7102"), "")).unwrap();
        assert_eq!(
            ok.lease.map(|l| l.listen.to_string()),
            Some("127.0.0.1:7102".to_string())
        );
        for clash in ["127.0.0.1:7100", "127.0.0.1:7101"] {
            assert!(
                err(with(&top(clash), "")).contains("lease_listen"),
                "{clash}"
            );
        }
    }

    #[test]
    fn tls_listener_files_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: String| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let one = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let two = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert = write("cert.pem", one.cert.pem());
        let key = write("key.pem", one.signing_key.serialize_pem());
        let other_key = write("other.pem", two.signing_key.serialize_pem());
        let with = |key: &PathBuf, listen: &str| {
            let mut raw = base();
            raw.tls = Some(RawTls {
                listen: Some(listen.into()),
                cert: Some(cert.clone()),
                key: Some(key.clone()),
                client_ca: Some(cert.clone()),
                watch_interval: None,
                proxy_protocol: None,
            });
            raw
        };
        let c = Config::try_from(with(&key, "127.0.0.1:8443")).unwrap();
        let tls = c.tls.clone().unwrap();
        assert_eq!(tls.watch_interval, Duration::from_secs(5));
        let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
        assert_eq!(again.tls, c.tls);
        assert!(err(with(&other_key, "127.0.0.1:8443")).contains("`tls.key`"));
        assert!(err(with(&key, "127.0.0.1:8080")).contains("`tls.listen`"));
        // TLS only: the plain listener can be turned off.
        let mut only_tls = with(&key, "127.0.0.1:8443");
        only_tls.listen = Some("off".into());
        let c = Config::try_from(only_tls).unwrap();
        assert_eq!(c.listen, None);
        assert!(c.to_toml().contains("listen = \"off\""));
    }

    #[test]
    fn defaults_apply() {
        let c = Config::try_from(base()).unwrap();
        assert_eq!(c.listen.unwrap().to_string(), "127.0.0.1:8080");
        assert_eq!(c.admin_listen.to_string(), "127.0.0.1:9090");
        assert_eq!(c.routes[0].namespace, "default");
        assert_eq!(c.routes[0].key, KeyTemplate::Path);
        assert!(c.routes[0].write_methods.is_write("MKCOL"));
        assert!(c.routes[0].write_methods.is_write("get"));
        assert!(!c.routes[0].write_methods.is_write("GET"));
        assert_eq!(c.routes[0].upstream_timeout, Duration::from_secs(60));
        // One worker per CPU, decided at start.
        assert_eq!(c.workers, None);
        let mut raw = base();
        raw.workers = Some(1024);
        assert_eq!(Config::try_from(raw).unwrap().workers, Some(1024));
        // The printed config parses back to the same thing.
        let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
        assert_eq!(again.to_toml(), c.to_toml());
    }

    #[test]
    fn proxy_protocol_needs_trusted_proxies_on_each_listener() {
        let mut raw = base();
        raw.proxy_protocol = Some(true);
        raw.trusted_proxies = Some(vec!["10.0.0.0/8".into(), "192.0.2.7".into()]);
        let c = Config::try_from(raw.clone()).unwrap();
        assert!(c.proxy_protocol);
        let trusted = c.trusted_proxies.clone().unwrap();
        assert!(trusted.contains("10.9.9.9".parse().unwrap()));
        assert!(!trusted.contains("192.0.2.8".parse().unwrap()));
        // Written back as it reads.
        let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
        assert_eq!(again.trusted_proxies, c.trusted_proxies);
        assert!(again.proxy_protocol);
        // The TLS listener's own switch needs the same trust.
        raw.proxy_protocol = None;
        raw.trusted_proxies = None;
        let tls = TlsConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            cert: "c".into(),
            key: "k".into(),
            client_ca: None,
            watch_interval: Duration::from_secs(5),
            proxy_protocol: true,
        };
        let e = proxies(&raw, Some(&tls)).unwrap_err().to_string();
        assert!(e.contains("tls.proxy_protocol"), "{e}");
        raw.trusted_proxies = Some(vec!["10.0.0.0/8".into()]);
        assert!(proxies(&raw, Some(&tls)).is_ok());
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = RawConfig::from_toml("stor = \"x\"").unwrap_err();
        assert!(e.contains("stor"), "{e}");
        let e = RawConfig::from_toml("[[routes]]\nupstrem = \"x\"").unwrap_err();
        assert!(e.contains("upstrem"), "{e}");
    }

    #[test]
    fn bad_values_name_their_field() {
        type Mutation = fn(&mut RawConfig);
        let cases: Vec<(Mutation, &str)> = vec![
            (|r| r.workers = Some(0), "workers"),
            (|r| r.workers = Some(1025), "workers"),
            (|r| r.proxy_protocol = Some(true), "proxy_protocol"),
            (
                |r| r.routes[0].error_format = Some("xml".into()),
                "routes[0].error_format",
            ),
            (
                |r| {
                    r.routes[0].websocket = Some(true);
                    r.routes[0].upstream_http2 = Some(true);
                },
                "routes[0].websocket",
            ),
            (
                |r| {
                    r.proxy_protocol = Some(true);
                    r.trusted_proxies = Some(vec![]);
                },
                "proxy_protocol",
            ),
            (
                |r| r.trusted_proxies = Some(vec!["10.0.0.0/8".into(), "10.0.0.0/40".into()]),
                "trusted_proxies",
            ),
            (
                |r| r.routes[0].upstream = Some("127.0.0.1:9000".into()),
                "routes[0].upstream",
            ),
            (
                |r| r.routes[0].upstream = Some("ftp://x".into()),
                "routes[0].upstream",
            ),
            (
                |r| r.routes[0].upstream = Some("http://x/base".into()),
                "routes[0].upstream",
            ),
            (|r| r.routes[0].upstream = None, "routes[0].upstream"),
            (
                |r| r.routes[0].upstream_ca = Some("/etc/hostname".into()),
                "routes[0].upstream_ca",
            ),
            (
                |r| {
                    r.routes[0].upstream = Some("https://x".into());
                    r.routes[0].upstream_ca = Some("/no/such/ca.pem".into());
                },
                "routes[0].upstream_ca",
            ),
            (
                |r| {
                    r.routes[0].upstream = Some("https://x".into());
                    r.routes[0].upstream_client_cert = Some("/no/such/c.pem".into());
                },
                "routes[0].upstream_client_key",
            ),
            (|r| r.tls = Some(RawTls::default()), "tls.cert"),
            (
                |r| {
                    r.tls = Some(RawTls {
                        cert: Some("/no/such/cert.pem".into()),
                        ..RawTls::default()
                    })
                },
                "tls.key",
            ),
            (
                |r| {
                    r.tls = Some(RawTls {
                        cert: Some("/etc/hostname".into()),
                        key: Some("/etc/hostname".into()),
                        ..RawTls::default()
                    })
                },
                "tls.cert",
            ),
            (|r| r.store = Some("/no/such/dir/f.redb".into()), "store"),
            (|r| r.store = Some("mongodb://x".into()), "store"),
            (|r| r.store = Some("etcd://a:1,/x".into()), "store"),
            (
                |r| {
                    r.store = Some("redis://127.0.0.1:6379".into());
                    r.store_timeout = Some("x".into());
                },
                "store_timeout",
            ),
            (|r| r.store = None, "store"),
            (|r| r.listen = Some("8080".into()), "listen"),
            (|r| r.listen = Some("off".into()), "listen"),
            (|r| r.routes[0].key = Some("bucket".into()), "routes[0].key"),
            (
                |r| r.routes[0].namespace = Some("a:b".into()),
                "routes[0].namespace",
            ),
            (
                |r| r.routes[0].upstream_timeout = Some("10".into()),
                "routes[0].upstream_timeout",
            ),
            (
                |r| r.routes[0].upstream_timeout = Some("0s".into()),
                "routes[0].upstream_timeout",
            ),
            (
                |r| r.routes[0].upstream_timeout = Some("18446744073709551615s".into()),
                "routes[0].upstream_timeout",
            ),
            (
                |r| r.shutdown_grace = Some("307445734561825861m".into()),
                "shutdown_grace",
            ),
            (
                |r| r.routes[0].write_methods = Some(vec!["P UT".into()]),
                "routes[0].write_methods",
            ),
            (
                |r| {
                    let mut twin = r.routes[0].clone();
                    twin.name = Some("twin".into());
                    r.routes.push(twin);
                },
                "routes[1].path_prefix",
            ),
            (
                |r| r.routes[0].host = Some("api.example:8080".into()),
                "routes[0].host",
            ),
            (
                |r| r.routes[0].tokens = Some("strict".into()),
                "routes[0].tokens",
            ),
            (
                |r| {
                    let mut granted = r.routes[0].clone();
                    granted.name = Some("granted".into());
                    granted.path_prefix = Some("/g".into());
                    granted.tokens = Some("granted".into());
                    r.routes.push(granted);
                },
                "routes[1].tokens",
            ),
            (
                |r| r.lease_token_file = Some("/nonexistent/lease".into()),
                "lease_token_file",
            ),
            (
                |r| r.lease_listen = Some("127.0.0.1:0".into()),
                "lease_token_file",
            ),
            (
                |r| {
                    r.lease_listen = Some("127.0.0.1:0".into());
                    r.lease_token_file = Some("/nonexistent/lease".into());
                },
                "lease_token_file",
            ),
            (|r| r.max_lease_ttl = Some("0s".into()), "max_lease_ttl"),
            (
                |r| r.routes[0].host = Some("api.example.".into()),
                "routes[0].host",
            ),
            (
                |r| r.routes[0].host = Some("[::1]".into()),
                "routes[0].host",
            ),
            (
                |r| r.routes[0].host = Some("u@api.example".into()),
                "routes[0].host",
            ),
            (
                |r| r.routes[0].path_prefix = Some("/%7Euser".into()),
                "routes[0].path_prefix",
            ),
            (
                |r| r.routes[0].path_prefix = Some("/a b".into()),
                "routes[0].path_prefix",
            ),
            (
                |r| r.routes[0].path_prefix = Some("api".into()),
                "routes[0].path_prefix",
            ),
            (
                |r| r.routes[0].path_prefix = Some("/a//b".into()),
                "routes[0].path_prefix",
            ),
            (
                |r| r.routes[0].path_prefix = Some("//a".into()),
                "routes[0].path_prefix",
            ),
            (
                |r| r.routes[0].path_prefix = Some("/a/../b/".into()),
                "routes[0].path_prefix",
            ),
            (
                |r| r.routes[0].path_prefix = Some("/./a".into()),
                "routes[0].path_prefix",
            ),
            (
                |r| r.routes[0].path_prefix = Some("/a;v=1".into()),
                "routes[0].path_prefix",
            ),
            (
                |r| {
                    r.routes[0].path_prefix = Some("/a+b".into());
                    r.routes[0].literal_keys = Some(true);
                },
                "routes[0].path_prefix",
            ),
            (
                |r| r.limits.max_header_bytes = Some(10),
                "limits.max_header_bytes",
            ),
            (
                |r| r.limits.max_body_bytes = Some(0),
                "limits.max_body_bytes",
            ),
            (
                |r| r.admin_token_file = Some("/no/such/token".into()),
                "admin_token_file",
            ),
            (|r| r.routes.clear(), "routes"),
            (|r| r.shutdown_grace = Some("soon".into()), "shutdown_grace"),
        ];
        for (mutate, field) in cases {
            let mut raw = base();
            mutate(&mut raw);
            let e = err(raw);
            assert!(
                e.contains(&format!("`{field}`")),
                "expected {field} in: {e}"
            );
        }
    }

    #[test]
    fn store_urls() {
        let store = |url: &str| {
            let mut raw = base();
            raw.store = Some(url.into());
            Config::try_from(raw).unwrap().store
        };
        let shared = |url: &str| match store(url) {
            StoreConfig::Shared(s) => s.engine,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            shared("redis://127.0.0.1:6379/0"),
            SharedEngine::Redis { sentinel: None }
        );
        assert!(matches!(
            shared("postgres://u@127.0.0.1/db"),
            SharedEngine::Postgres { prefer: false, .. }
        ));
        assert!(matches!(
            shared("postgresql://u@127.0.0.1/db"),
            SharedEngine::Postgres { .. }
        ));
        assert_eq!(
            shared("etcd://127.0.0.1:2379,127.0.0.2:2379"),
            SharedEngine::Etcd {
                endpoints: vec![
                    "http://127.0.0.1:2379".into(),
                    "http://127.0.0.2:2379".into()
                ],
                user: None
            }
        );
        assert!(matches!(
            store("redb:///tmp/x.redb"),
            StoreConfig::Embedded { .. }
        ));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("10").is_err());
        assert_eq!(parse_duration("24h"), Ok(MAX_DURATION));
        // Out of range is an error, never a wrapped or saturated value.
        for big in [
            "25h",
            "307445734561825861m",
            "18446744073709551615s",
            "99999999999999999999999ms",
        ] {
            let e = parse_duration(big).unwrap_err();
            assert!(e.contains(big), "{e}");
        }
    }

    #[test]
    fn route_hosts_are_spelled_as_requests_are_parsed() {
        for (given, kept) in [
            ("API.example", "api.example"),
            ("::1", "::1"),
            ("127.0.0.1", "127.0.0.1"),
        ] {
            let mut raw = base();
            raw.routes[0].host = Some(given.into());
            let c = Config::try_from(raw).unwrap();
            assert_eq!(c.routes[0].host.as_deref(), Some(kept));
        }
    }

    #[test]
    fn prefix_matching_is_on_segment_boundaries() {
        let mut raw = base();
        raw.routes[0].path_prefix = Some("/api".into());
        let c = Config::try_from(raw).unwrap();
        let r = &c.routes[0];
        assert!(r.matches_path("/api"));
        assert!(r.matches_path("/api/x"));
        assert!(!r.matches_path("/apix"));
        assert!(!r.matches_path("/"));
    }

    use proptest::prelude::*;

    fn field() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("listen".to_string()),
            Just("store".to_string()),
            Just("upstream".to_string()),
            Just("key".to_string()),
            Just("namespace".to_string()),
            Just("upstream_timeout".to_string()),
            Just("write_methods".to_string()),
            Just("max_token_step".to_string()),
            Just("path_prefix".to_string()),
            "[a-z_]{1,12}",
        ]
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            "\"[ -~]{0,24}\"",
            "-?[0-9]{1,22}",
            Just("true".to_string()),
            Just("[\"PUT\", \"post\"]".to_string()),
            Just("\"http://127.0.0.1:9000\"".to_string()),
            Just("\"/{a}/{b}\"".to_string()),
            Just("\"10ms\"".to_string()),
        ]
    }

    proptest! {
        /// Whatever a config file says, loading it never panics: it is a
        /// config or an error naming a field.
        #[test]
        fn the_loader_never_panics(
            top in proptest::collection::vec((field(), value()), 0..5),
            routes in proptest::collection::vec(proptest::collection::vec((field(), value()), 0..6), 0..3),
        ) {
            let mut text = String::new();
            for (k, v) in &top {
                text.push_str(&format!("{k} = {v}\n"));
            }
            for r in &routes {
                text.push_str("[[routes]]\n");
                for (k, v) in r {
                    text.push_str(&format!("{k} = {v}\n"));
                }
            }
            if let Ok(raw) = RawConfig::from_toml(&text) {
                match Config::try_from(raw) {
                    Ok(c) => {
                        // A valid config prints to a config that loads to the
                        // same thing.
                        let again = Config::try_from(RawConfig::from_toml(&c.to_toml()).unwrap()).unwrap();
                        prop_assert_eq!(again.to_toml(), c.to_toml());
                    }
                    Err(e) => prop_assert!(e.to_string().contains('`') || e.to_string().contains("config")),
                }
            }
        }
    }

    #[test]
    fn explicit_write_methods_are_case_insensitive() {
        let w = WriteMethods::Only(["PUT".to_string()].into());
        assert!(w.is_write("PUT") && w.is_write("put"));
        assert!(!w.is_write("POST"));
    }
}
