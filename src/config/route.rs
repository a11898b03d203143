//! A route's settings validated: its match (host, path prefix), its
//! upstream and TLS towards it, its key template and token mode.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::key::KeyTemplate;
use crate::tls::UpstreamTls;

use super::error::*;
use super::parse::*;
use super::raw::*;

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

/// Methods whose requests have no body semantics (RFC 9110 section 9.3):
/// their bodies are refused unless the route allows them. A backend that
/// does not read such a body (Python's `http.server`, many small APIs)
/// reads it as the next request on the connection: a request fencegate
/// never admitted. Compared case-insensitively, as a backend may.
pub fn bodiless(method: &str) -> bool {
    ["GET", "HEAD", "OPTIONS", "DELETE", "TRACE"]
        .iter()
        .any(|m| m.eq_ignore_ascii_case(method))
}

/// The bodiless methods a route may allow bodies on. `HEAD` and `TRACE`
/// requests never carry one (RFC 9110 sections 9.3.2 and 9.3.8).
pub const BODY_OPT_IN: [&str; 3] = ["GET", "OPTIONS", "DELETE"];

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
    /// Methods without body semantics whose requests may carry a body
    /// here (upper case, among [`BODY_OPT_IN`]); any other bodiless
    /// method's body is refused (see [`bodiless`]).
    pub allow_bodies_on: BTreeSet<String>,
    /// How fencegate's own refusals are written on this route.
    pub error_format: ErrorFormat,
    pub connect_timeout: Duration,
    /// From the first byte sent upstream to the response head. Also bounds
    /// how long a newer write waits behind an older one, and the
    /// crash-recovery window.
    pub upstream_timeout: Duration,
    /// Connections to the upstream open or being dialled (idle ones
    /// included), all workers together; 0: no cap.
    pub upstream_max_connections: usize,
    /// Longest wait for a connection once the cap is reached (then 503).
    /// Shorter than `upstream_timeout`, within which it counts.
    pub upstream_queue_timeout: Duration,
    pub upstream_tls: UpstreamTls,
}

/// Default `upstream_max_connections`. Past what thread-per-connection
/// backends serve at once (Tomcat's 200 threads, a gunicorn or Python
/// `http.server` pool), more connections only wait in the backend's listen
/// queue, whose overflow makes dials hang (issue 42.6); and far below what
/// an event-loop backend or a balancer in front of many takes. HAProxy's
/// and nginx's defaults are no cap at all, which is what let a burst dial
/// one connection per request.
pub const DEFAULT_UPSTREAM_MAX_CONNECTIONS: u64 = 64;

/// Largest `upstream_max_connections` (a value past it is a typo).
pub const MAX_UPSTREAM_MAX_CONNECTIONS: u64 = 1_000_000;

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

pub(super) fn route(i: usize, r: &RawRoute) -> Result<Route, ConfigError> {
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
    let mut allow_bodies_on = BTreeSet::new();
    for m in r.allow_bodies_on.iter().flatten() {
        let upper = m.to_ascii_uppercase();
        if !BODY_OPT_IN.contains(&upper.as_str()) {
            return Err(invalid(
                f("allow_bodies_on"),
                format!("`{m}` is not one of GET, OPTIONS, DELETE (other methods' bodies need no permission; HEAD and TRACE never have one)"),
            ));
        }
        allow_bodies_on.insert(upper);
    }
    let literal_keys = r.literal_keys.unwrap_or(false);
    // Literal keys read `+` as a space; routes are matched on the path as
    // sent, so a `+` in a literal route's prefix would put `a+b` and `a%20b`
    // (one name to the key) on two routes.
    let connect_timeout = duration(
        &f("connect_timeout"),
        &r.connect_timeout,
        Duration::from_secs(5),
    )?;
    let upstream_timeout = duration(
        &f("upstream_timeout"),
        &r.upstream_timeout,
        Duration::from_secs(60),
    )?;
    let upstream_max_connections = r
        .upstream_max_connections
        .unwrap_or(DEFAULT_UPSTREAM_MAX_CONNECTIONS);
    if upstream_max_connections > MAX_UPSTREAM_MAX_CONNECTIONS {
        return Err(invalid(
            f("upstream_max_connections"),
            format!("must be at most {MAX_UPSTREAM_MAX_CONNECTIONS} (0: no cap)"),
        ));
    }
    if upstream_max_connections == 0 && r.upstream_queue_timeout.is_some() {
        return Err(invalid(
            f("upstream_queue_timeout"),
            "only applies with upstream_max_connections above 0 (0: no cap, so no queue)",
        ));
    }
    // HAProxy's `timeout queue` defaults to its `timeout connect` too: a
    // request waits for a connection about as long as for a dial.
    let upstream_queue_timeout = duration(
        &f("upstream_queue_timeout"),
        &r.upstream_queue_timeout,
        connect_timeout.min(upstream_timeout / 2),
    )?;
    // The wait counts within a write's deadline (upstream_timeout): one as
    // long would end as a 504 before it could be refused as busy.
    if upstream_queue_timeout >= upstream_timeout {
        return Err(invalid(
            f("upstream_queue_timeout"),
            format!(
                "must be shorter than upstream_timeout ({}): the wait counts within it",
                format_duration(upstream_timeout)
            ),
        ));
    }
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
        allow_bodies_on,
        error_format: match r.error_format.as_deref() {
            None => ErrorFormat::Problem,
            Some(v) => v
                .parse()
                .map_err(|reason: String| invalid(f("error_format"), reason))?,
        },
        connect_timeout,
        upstream_timeout,
        upstream_max_connections: upstream_max_connections as usize,
        upstream_queue_timeout,
        upstream_tls,
    })
}

pub(super) fn upstream_tls(
    i: usize,
    r: &RawRoute,
    upstream: &Upstream,
) -> Result<UpstreamTls, ConfigError> {
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
