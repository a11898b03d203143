//! The `store` setting and what goes with it: which engine, how to reach it
//! (TLS, certificates, credentials), validated into a [`StoreConfig`].
//!
//! Shared stores run in production behind TLS with credentials, so each
//! engine takes them the way its own users write them:
//! - Redis: `rediss://[user[:password]@]host:port/db` (TLS, ACL user);
//! - PostgreSQL: libpq's `sslmode` (`disable`, `prefer`, `require`,
//!   `verify-ca`, `verify-full`) and `sslrootcert` / `sslcert` / `sslkey` in
//!   the URL's query, SCRAM or MD5 passwords;
//! - etcd: `etcds://[user@]host:port,...` (https endpoints) with etcd's
//!   user/password auth and client certificates.
//!
//! The CA and client certificate can also be given as `store_ca`,
//! `store_client_cert`, `store_client_key`; the password as
//! `store_password_file` or `FENCEGATE_STORE_PASSWORD` rather than in the
//! URL (which shows in `ps` and shell history). Passwords never reach a log:
//! [`Secret`] prints as `****` and [`SharedStoreConfig::redacted_url`] is the
//! only form of the URL that is printed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::error::{invalid, ConfigError};
use super::parse::duration;
use super::raw::RawConfig;
use super::secret::Secret;
use crate::tls::{StoreTls, TlsVerify};

/// Where fences are kept.
// Built once at start and read by reference: the size of the shared
// variant costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// The local redb file (one fencegate process).
    Embedded {
        path: PathBuf,
        cache_bytes: usize,
        /// Open a file whose write-ahead log is lost (`accept_store_reset`).
        accept_loss: bool,
    },
    /// A shared server several replicas use.
    Shared(SharedStoreConfig),
}

/// A shared store and how to reach it. Its `Debug` shows the URL
/// redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct SharedStoreConfig {
    pub engine: SharedEngine,
    /// The URL as given; may hold a password, so print
    /// [`redacted_url`](Self::redacted_url) instead.
    pub url: String,
    /// Bounds every store call and connect.
    pub timeout: Duration,
    /// Confirm a store reset (lost data) at start.
    pub accept_reset: bool,
    /// This replica's record of the latest marker it saw
    /// (`store_state_file`); its directory exists.
    pub state_file: Option<PathBuf>,
    /// `None`: plain TCP.
    pub tls: Option<StoreTls>,
    /// From `store_password_file` or the environment; replaces a password
    /// in the URL.
    pub password: Option<Secret>,
    /// Where the password was read from, to print back.
    pub password_file: Option<PathBuf>,
    /// Redis only (`store_replicas_to_wait`): how many replicas must have
    /// a change before it counts as stored; `None`: one while the primary
    /// has a replica online, else none.
    pub replicas_to_wait: Option<u32>,
}

impl std::fmt::Debug for SharedStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedStoreConfig")
            .field("url", &self.redacted_url())
            .field("timeout", &self.timeout)
            .field("accept_reset", &self.accept_reset)
            .field("tls", &self.tls)
            .field("password", &self.password)
            .finish_non_exhaustive()
    }
}

impl SharedStoreConfig {
    /// The URL with any password replaced by `****`: the one form that may
    /// be logged or printed.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedEngine {
    Redis {
        /// `redis+sentinel://`: the primary is asked of these Sentinels.
        sentinel: Option<Sentinel>,
    },
    /// `redis+cluster://` / `rediss+cluster://`: a Redis Cluster, its
    /// topology found from these seed nodes.
    RedisCluster(RedisCluster),
    Postgres {
        /// The URL handed to the PostgreSQL driver: fencegate's own TLS
        /// parameters (`sslrootcert`, `sslcert`, `sslkey`, the `verify-*`
        /// modes) taken out, since the driver refuses them and fencegate
        /// does the TLS itself.
        conn: String,
        /// `sslmode=prefer`: TLS if the server offers it, else plain.
        prefer: bool,
    },
    Etcd {
        /// Client URLs (`http://host:port` or `https://host:port`), one per
        /// endpoint.
        endpoints: Vec<String>,
        /// etcd auth user (`etcd://user@...`); its password comes from
        /// the URL, `store_password_file` or the environment.
        user: Option<String>,
    },
}

/// A Redis primary found through Sentinel: `redis+sentinel://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB][?sentinel_auth=same]`.
#[derive(Clone, PartialEq, Eq)]
pub struct Sentinel {
    /// The Sentinels' addresses (port 26379 when not given).
    pub addrs: Vec<(String, u16)>,
    /// The master name the Sentinels monitor.
    pub master: String,
    pub db: i64,
    /// The data nodes' ACL user and password (the password may be replaced
    /// by `store_password_file` or the environment).
    pub user: Option<String>,
    pub password: Option<Secret>,
    /// `sentinel_auth=same`: the Sentinels ask for the same user and
    /// password (Sentinel's own `requirepass`); otherwise they are asked
    /// without credentials.
    pub sentinel_auth: bool,
}

impl std::fmt::Debug for Sentinel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sentinel")
            .field("addrs", &self.addrs)
            .field("master", &self.master)
            .field("db", &self.db)
            .field("user", &self.user)
            .field("sentinel_auth", &self.sentinel_auth)
            .finish_non_exhaustive()
    }
}

/// A Redis Cluster: `redis+cluster://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...][/]`
/// (`rediss+cluster://` over TLS). Any node of the cluster will do as a
/// seed; the others are found from it.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisCluster {
    /// The seed nodes (port 6379 when not given).
    pub seeds: Vec<(String, u16)>,
    /// The ACL user and password (the password may be replaced by
    /// `store_password_file` or the environment).
    pub user: Option<String>,
    pub password: Option<Secret>,
}

impl std::fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCluster")
            .field("seeds", &self.seeds)
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// `scheme://user:password@host...` with the password (and a `password=`
/// query parameter) replaced by `****`. The user information runs to the
/// last `@`, as the drivers read it (a password may hold `/`, `?` or `#`);
/// redacting too much is harmless.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let rest = match rest.rsplit_once('@') {
        Some((userinfo, after)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:****@{after}"),
            None => rest.to_string(),
        },
        None => rest.to_string(),
    };
    let rest = match rest.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=****"),
                    _ => p.to_string(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => rest,
    };
    format!("{scheme}://{rest}")
}

/// The store the config names, validated on its own (`fencegate init-store`
/// needs nothing else).
pub fn store(raw: &RawConfig) -> Result<StoreConfig, ConfigError> {
    let text = raw
        .store
        .as_deref()
        .ok_or_else(|| invalid("store", "is required (a file path such as ./fences.redb)"))?;
    let path = match text.split_once("://") {
        Some(("redb", p)) => p,
        Some((scheme, rest)) => return shared(raw, text, scheme, rest).map(StoreConfig::Shared),
        None => text,
    };
    for field in [
        ("store_ca", &raw.store_ca),
        ("store_client_cert", &raw.store_client_cert),
        ("store_client_key", &raw.store_client_key),
        ("store_password_file", &raw.store_password_file),
    ] {
        if field.1.is_some() {
            return Err(invalid(
                field.0,
                "is for shared stores; the embedded store is a local file",
            ));
        }
    }
    if raw.store_replicas_to_wait.is_some() {
        return Err(invalid(
            "store_replicas_to_wait",
            "is for Redis; the embedded store is a local file",
        ));
    }
    if path.is_empty() {
        return Err(invalid("store", "the path is empty"));
    }
    if path.contains('=') && path.contains(' ') {
        return Err(invalid(
            "store",
            "looks like a key=value connection string; give a URL (postgres://USER@HOST/DB?sslmode=...)",
        ));
    }
    let path = PathBuf::from(path);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(invalid(
            "store",
            format!("directory {} does not exist", dir.display()),
        ));
    }
    if path.is_dir() {
        return Err(invalid(
            "store",
            format!("{} is a directory", path.display()),
        ));
    }
    let mib = raw.store_cache_mib.unwrap_or(64);
    if mib == 0 || mib > 1 << 20 {
        return Err(invalid("store_cache_mib", "must be between 1 and 1048576"));
    }
    Ok(StoreConfig::Embedded {
        path,
        cache_bytes: (mib as usize) << 20,
        accept_loss: raw.accept_store_reset.unwrap_or(false),
    })
}

/// What the URL itself says about TLS: whether it asks for it, how to
/// verify, and certificate paths given in it (PostgreSQL's query).
struct UrlTls {
    on: bool,
    verify: TlsVerify,
    ca: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
}

impl UrlTls {
    fn off() -> Self {
        Self::on(false)
    }

    fn on(on: bool) -> Self {
        Self {
            on,
            verify: TlsVerify::Full,
            ca: None,
            client_cert: None,
            client_key: None,
        }
    }
}

fn shared(
    raw: &RawConfig,
    text: &str,
    scheme: &str,
    rest: &str,
) -> Result<SharedStoreConfig, ConfigError> {
    let (engine, url_tls) = match scheme {
        "redis" | "rediss" => {
            if rest.contains("#insecure") {
                return Err(invalid(
                    "store",
                    "`#insecure` (no certificate check) is not supported; give the server's CA as store_ca",
                ));
            }
            (SharedEngine::Redis { sentinel: None }, UrlTls::on(scheme == "rediss"))
        }
        "redis+sentinel" => (
            SharedEngine::Redis {
                sentinel: Some(sentinel(rest)?),
            },
            UrlTls::off(),
        ),
        "redis+cluster" | "rediss+cluster" => (
            SharedEngine::RedisCluster(cluster(rest)?),
            UrlTls::on(scheme == "rediss+cluster"),
        ),
        "rediss+sentinel" => {
            return Err(invalid(
                "store",
                "rediss+sentinel:// (TLS to Sentinel) is not supported yet; use redis+sentinel:// on a private network, or rediss:// to one primary",
            ))
        }
        "postgres" | "postgresql" => postgres(text)?,
        "etcd" | "etcds" => (etcd(scheme, rest)?, UrlTls::on(scheme == "etcds")),
        _ => {
            return Err(invalid(
                "store",
                format!("unsupported store `{scheme}://`; use a file path, redb://PATH, redis://, rediss://, redis+sentinel://, redis+cluster://, rediss+cluster://, postgres://, etcd:// or etcds://"),
            ))
        }
    };
    let given = |field: &'static str, url: Option<PathBuf>, raw: &Option<PathBuf>| match (url, raw)
    {
        (Some(_), Some(_)) => Err(invalid(
            field,
            "is given both here and in the store URL; give it once",
        )),
        (u, r) => Ok(u.or_else(|| r.clone())),
    };
    let ca = given("store_ca", url_tls.ca, &raw.store_ca)?;
    let client_cert = given(
        "store_client_cert",
        url_tls.client_cert,
        &raw.store_client_cert,
    )?;
    let client_key = given(
        "store_client_key",
        url_tls.client_key,
        &raw.store_client_key,
    )?;
    for (field, path) in [
        ("store_ca", &ca),
        ("store_client_cert", &client_cert),
        ("store_client_key", &client_key),
    ] {
        if let Some(p) = path {
            readable(field, p)?;
            if !url_tls.on {
                return Err(invalid(
                    field,
                    "is set but the store URL does not use TLS (use rediss://, etcds:// or PostgreSQL's sslmode=verify-full)",
                ));
            }
        }
    }
    if client_cert.is_some() != client_key.is_some() {
        let missing = if client_cert.is_some() {
            "store_client_key"
        } else {
            "store_client_cert"
        };
        return Err(invalid(
            missing,
            "is required: a client certificate goes with its key",
        ));
    }
    if url_tls.on && url_tls.verify == TlsVerify::Chain && ca.is_none() {
        // As libpq: the chain is checked against a CA given for it, not
        // the system's (any public certificate would pass, whatever name).
        return Err(invalid(
            "store",
            "sslmode=verify-ca needs the CA that signed the server's certificate: sslrootcert=PATH in the URL, or store_ca",
        ));
    }
    let tls = url_tls.on.then_some(StoreTls {
        // libpq: `require` with a CA file verifies the chain.
        verify: match (url_tls.verify, &ca) {
            (TlsVerify::None, Some(_)) => TlsVerify::Chain,
            (v, _) => v,
        },
        ca,
        client_cert,
        client_key,
    });
    let password = match (&raw.store_password_file, &raw.store_password) {
        (Some(f), _) => Some(password_file(f)?),
        (None, p) => p.clone(),
    };
    if let SharedEngine::Etcd { user: None, .. } = &engine {
        if password.is_some() {
            return Err(invalid(
                "store",
                "a store password is set but the etcd URL names no user (etcds://USER@host:port)",
            ));
        }
    }
    let replicas_to_wait = match (&engine, raw.store_replicas_to_wait) {
        (_, None) => None,
        (SharedEngine::Redis { .. } | SharedEngine::RedisCluster(_), Some(n))
            if n <= MAX_REPLICAS_TO_WAIT =>
        {
            Some(n)
        }
        (SharedEngine::Redis { .. } | SharedEngine::RedisCluster(_), Some(_)) => {
            return Err(invalid(
                "store_replicas_to_wait",
                format!("must be between 0 and {MAX_REPLICAS_TO_WAIT}"),
            ))
        }
        (_, Some(_)) => {
            return Err(invalid(
                "store_replicas_to_wait",
                "is for Redis; PostgreSQL waits for its synchronous standbys (synchronous_standby_names), etcd for a Raft majority",
            ))
        }
    };
    Ok(SharedStoreConfig {
        engine,
        replicas_to_wait,
        url: text.to_string(),
        timeout: duration("store_timeout", &raw.store_timeout, Duration::from_secs(2))?,
        accept_reset: raw.accept_store_reset.unwrap_or(false),
        state_file: raw
            .store_state_file
            .as_deref()
            .map(state_file)
            .transpose()?,
        tls,
        password,
        password_file: raw.store_password_file.clone(),
    })
}

/// The most replicas a Redis change may be made to wait for.
const MAX_REPLICAS_TO_WAIT: u32 = 100;

/// `HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB][?sentinel_auth=same]`, after
/// `redis+sentinel://` and any `USER[:PASSWORD]@`.
fn sentinel(rest: &str) -> Result<Sentinel, ConfigError> {
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (user, password, rest) = userinfo(rest);
    let form = "redis+sentinel://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]";
    let (hosts, path) = rest
        .split_once('/')
        .ok_or_else(|| invalid("store", format!("the Sentinel URL names no master: {form}")))?;
    let addrs = host_list(hosts, 26379, "Sentinel")?;
    let mut parts = path.trim_end_matches('/').splitn(2, '/');
    let master = decode(parts.next().unwrap_or(""));
    if master.is_empty() {
        return Err(invalid(
            "store",
            format!("the Sentinel URL names no master: {form}"),
        ));
    }
    let db = match parts.next() {
        None => 0,
        Some(d) => d
            .parse::<i64>()
            .ok()
            .filter(|d| *d >= 0)
            .ok_or_else(|| invalid("store", format!("database `{d}` is not a number")))?,
    };
    let mut sentinel_auth = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=').unwrap_or((pair, "")) {
            ("sentinel_auth", "same") => sentinel_auth = true,
            ("sentinel_auth", "none") => sentinel_auth = false,
            (k, v) => {
                return Err(invalid(
                    "store",
                    format!(
                        "unknown Sentinel URL parameter `{k}={v}` (known: sentinel_auth=same|none)"
                    ),
                ))
            }
        }
    }
    Ok(Sentinel {
        addrs,
        master,
        db,
        user,
        password,
        sentinel_auth,
    })
}

/// `HOST[:PORT][,HOST[:PORT]...][/]`, after `redis+cluster://` and any
/// `USER[:PASSWORD]@`. A cluster has one database, and no parameter is
/// known yet: anything more is refused rather than ignored.
fn cluster(rest: &str) -> Result<RedisCluster, ConfigError> {
    let (user, password, rest) = userinfo(rest);
    let hosts = rest.strip_suffix('/').unwrap_or(rest);
    if let Some(extra) = hosts.find(['/', '?', '#']) {
        return Err(invalid(
            "store",
            format!(
                "`{}` after the cluster's nodes: a Redis Cluster has one database and takes no parameter (redis+cluster://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...])",
                &hosts[extra..]
            ),
        ));
    }
    Ok(RedisCluster {
        seeds: host_list(hosts, 6379, "cluster node")?,
        user,
        password,
    })
}

fn decode(v: &str) -> String {
    percent_encoding::percent_decode_str(v)
        .decode_utf8_lossy()
        .into_owned()
}

/// `[USER[:PASSWORD]@]REST` (the user information runs to the last `@`):
/// the user and password, percent-decoded, empty ones as none.
fn userinfo(rest: &str) -> (Option<String>, Option<Secret>, &str) {
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((u, r)) => (Some(u), r),
        None => (None, rest),
    };
    match userinfo.map(|u| u.split_once(':').unwrap_or((u, ""))) {
        None => (None, None, rest),
        Some((u, p)) => (
            Some(decode(u)).filter(|u| !u.is_empty()),
            Some(Secret::new(decode(p))).filter(|p| !p.expose().is_empty()),
            rest,
        ),
    }
}

/// `HOST[:PORT][,HOST[:PORT]...]` (`[V6]` or `[V6]:PORT` for IPv6).
fn host_list(
    hosts: &str,
    default_port: u16,
    what: &str,
) -> Result<Vec<(String, u16)>, ConfigError> {
    let mut addrs = Vec::new();
    for h in hosts.split(',') {
        let h = h.trim();
        // `[::1]` alone is a host without a port.
        let bracketed = h.starts_with('[') && h.ends_with(']');
        let (host, port) = match h
            .rsplit_once(':')
            .filter(|(host, _)| !host.ends_with(':') && !bracketed)
        {
            Some((host, port)) if !host.is_empty() => (
                host,
                port.parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| invalid("store", format!("{what} `{h}`: bad port")))?,
            ),
            _ => (h, default_port),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains(['/', '@', ' ']) {
            return Err(invalid("store", format!("{what} `{h}` is not HOST[:PORT]")));
        }
        addrs.push((host.to_string(), port));
    }
    Ok(addrs)
}

/// `store_state_file`: a file in a directory that exists (the file itself
/// is created at the first marker check).
fn state_file(p: &Path) -> Result<PathBuf, ConfigError> {
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if p.file_name().is_none() || p.is_dir() {
        return Err(invalid(
            "store_state_file",
            format!("{} is not a file name", p.display()),
        ));
    }
    if !dir.is_dir() {
        return Err(invalid(
            "store_state_file",
            format!("directory {} does not exist", dir.display()),
        ));
    }
    Ok(p.to_path_buf())
}

fn readable(field: &str, p: &Path) -> Result<(), ConfigError> {
    std::fs::File::open(p)
        .map(drop)
        .map_err(|e| invalid(field, format!("cannot read {}: {e}", p.display())))
}

/// The first line of the file, which must not be empty.
fn password_file(p: &Path) -> Result<Secret, ConfigError> {
    let text = std::fs::read_to_string(p).map_err(|e| {
        invalid(
            "store_password_file",
            format!("cannot read {}: {e}", p.display()),
        )
    })?;
    let line = text.lines().next().unwrap_or("");
    if line.is_empty() {
        return Err(invalid(
            "store_password_file",
            format!("{} is empty (its first line is the password)", p.display()),
        ));
    }
    Ok(Secret::new(line))
}

/// `postgres://...?sslmode=...&sslrootcert=...`: libpq's TLS parameters
/// taken out (the driver knows only `disable`, `prefer` and `require`,
/// and no certificate files), the rest left for the driver.
fn postgres(text: &str) -> Result<(SharedEngine, UrlTls), ConfigError> {
    let (base, query) = text.split_once('?').unwrap_or((text, ""));
    // Other parameters go to the driver byte for byte (it percent-decodes
    // them itself).
    let mut kept: Vec<&str> = Vec::new();
    let mut mode = "disable".to_string();
    let mut tls = UrlTls::off();
    let decode = |v: &str| {
        percent_encoding::percent_decode_str(v)
            .decode_utf8_lossy()
            .into_owned()
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match decode(k).as_str() {
            "sslmode" => mode = decode(v),
            "sslrootcert" => tls.ca = Some(PathBuf::from(decode(v))),
            "sslcert" => tls.client_cert = Some(PathBuf::from(decode(v))),
            "sslkey" => tls.client_key = Some(PathBuf::from(decode(v))),
            _ => kept.push(pair),
        }
    }
    let (driver_mode, verify, prefer) = match mode.as_str() {
        "disable" => ("disable", None, false),
        "prefer" => ("prefer", Some(TlsVerify::None), true),
        "require" => ("require", Some(TlsVerify::None), false),
        "verify-ca" => ("require", Some(TlsVerify::Chain), false),
        "verify-full" => ("require", Some(TlsVerify::Full), false),
        other => {
            return Err(invalid(
                "store",
                format!(
                "sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
            ),
            ))
        }
    };
    if let Some(v) = verify {
        tls.on = true;
        tls.verify = v;
    }
    let mode_pair = format!("sslmode={driver_mode}");
    kept.push(&mode_pair);
    let conn = format!("{base}?{}", kept.join("&"));
    conn.parse::<tokio_postgres::Config>()
        .map_err(|e| invalid("store", format!("not a PostgreSQL URL: {e}")))?;
    Ok((SharedEngine::Postgres { conn, prefer }, tls))
}

/// `etcd://[user[:password]@]host:port,host:port` (`etcds://` for https).
fn etcd(scheme: &str, rest: &str) -> Result<SharedEngine, ConfigError> {
    let (user, hosts) = match rest.rsplit_once('@') {
        Some((userinfo, hosts)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            if user.is_empty() {
                return Err(invalid("store", "the etcd user name is empty"));
            }
            (Some(user.to_string()), hosts)
        }
        None => (None, rest),
    };
    let http = if scheme == "etcds" { "https" } else { "http" };
    let mut endpoints = Vec::new();
    for ep in hosts.trim_end_matches('/').split(',') {
        let ep = ep.trim();
        if ep.is_empty() || ep.contains('/') || !ep.contains(':') {
            return Err(invalid(
                "store",
                format!("etcd endpoint `{ep}` is not host:port"),
            ));
        }
        endpoints.push(format!("{http}://{ep}"));
    }
    Ok(SharedEngine::Etcd { endpoints, user })
}

/// The password in a URL's userinfo (percent-decoded), if any.
pub fn url_password(url: &str) -> Option<Secret> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.rsplit_once('@')?.0;
    let pw = userinfo.split_once(':')?.1;
    Some(Secret::new(
        percent_encoding::percent_decode_str(pw)
            .decode_utf8_lossy()
            .into_owned(),
    ))
}

#[cfg(test)]
mod tests;
