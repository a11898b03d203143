//! Routing shared by the request path and the services beside it: which
//! route serves a target (`resolve`, in `match_order`), the fence key that
//! route gives it (`route_key`), and the same classification for people
//! (`explain`). The proxy classifies writes with these functions; the admin
//! lookup (`GET /v1/fences?path=`), the lock service and `fencegate explain`
//! answer through them too, so what they print is what a write gets. The
//! live route table is the proxy's: the services reach it through the
//! [`Explain`] trait, which the proxy implements, never through the proxy
//! itself.
//!
//! `explain` gives a request target in the proxy's own terms: which route
//! serves it, the key template that route applies, the fence key a write
//! there takes, or why such a write would be refused before anything is
//! forwarded.

use http::{HeaderMap, HeaderName, HeaderValue, Uri};
use serde_json::json;

use crate::config::Route;
use crate::error::ProxyError;
use crate::key::{self, CanonicalPath, KeyError};

/// Where a write to a target goes.
#[derive(Debug)]
pub struct Explained {
    /// The request target explained, as a client sends it.
    pub target: String,
    /// The route that serves the target.
    pub route: Route,
    /// The path and query sent upstream.
    pub upstream_target: String,
    /// The fence key a write takes, or why the write would be refused
    /// (a key template the path does not match, a missing key header, a
    /// key over the length limit).
    pub key: Result<String, ProxyError>,
}

impl Explained {
    /// The JSON both the admin lookup and `explain --json` print (the
    /// lookup adds the key's `highest`).
    pub fn to_json(&self) -> serde_json::Value {
        let r = &self.route;
        let mut v = json!({
            "target": self.target,
            "route": r.name,
            "route_host": r.host,
            "path_prefix": r.path_prefix,
            "key_template": r.key.to_string(),
            "namespace": r.namespace,
            "literal_keys": r.literal_keys,
            "upstream": format!("{}{}", r.upstream, self.upstream_target),
        });
        match &self.key {
            Ok(k) => v["key"] = json!(k),
            Err(e) => {
                v["key"] = serde_json::Value::Null;
                v["refused"] = json!({"status": e.status().as_u16(), "detail": e.to_string()});
            }
        }
        v
    }
}

/// Resolves `target`, as a client sends it in the request line: a path
/// (`/bucket/report.csv`, percent-encoding and query included) or an
/// absolute URL (`http://host:port/path`), on `host` (a `Host` header's
/// value; `None`: none sent), as the proxy would. `headers` are consulted
/// only by `header:NAME` key templates. `Err` is the refusal that comes
/// before any route is chosen: a target that does not parse (400), no
/// route (404), no host where some route names one, a URL whose host
/// differs from `host`, a host spelled otherwise than the host route it
/// meets names it.
pub fn explain<R: AsRef<Route>>(
    routes: &[R],
    host: Option<&str>,
    target: &str,
    headers: &HeaderMap,
    max_key_bytes: usize,
) -> Result<Explained, ProxyError> {
    let not_a_target = || {
        ProxyError::BadRequest(
            "not a request target: give a path starting with `/` (percent-encoded as a client sends it) or an http:// URL"
                .into(),
        )
    };
    let uri: Uri = target.parse().map_err(|_| not_a_target())?;
    // (`Uri` also takes `host:port` alone, the CONNECT form.)
    if uri.scheme().is_none() && !target.starts_with('/') {
        return Err(not_a_target());
    }
    let parse = |h: &str| key::authority_host(h).map_err(ProxyError::BadTarget);
    let from_url = uri.authority().map(|a| parse(a.as_str())).transpose()?;
    let given_text = host;
    let given = host.map(parse).transpose()?;
    let host = match (from_url, given) {
        // As for a request: an absolute-form target and a Host header
        // must agree on host and port.
        (Some(u), Some(h)) if u != h => return Err(ProxyError::BadTarget(KeyError::ForeignHost)),
        (u, h) => u.or(h).map(|(h, _)| h),
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut ordered: Vec<&Route> = routes.iter().map(AsRef::as_ref).collect();
    ordered.sort_by_key(|r| match_order(r));
    if host.is_none() && ordered.iter().any(|r| r.host.is_some()) {
        return Err(ProxyError::BadRequest(
            "some route names a host: give the host too".into(),
        ));
    }
    let (route, parsed) = resolve(&ordered, host.as_deref(), path)
        .map_err(ProxyError::BadTarget)?
        .ok_or(ProxyError::NoRoute)?;
    let plain = uri
        .authority()
        .is_none_or(|a| key::host_spelled_plainly(a.as_str()))
        && given_text.is_none_or(key::host_spelled_plainly);
    if route.host.is_some() && !plain {
        return Err(ProxyError::BadRequest(HOST_SPELLING.into()));
    }
    Ok(Explained {
        target: target.to_string(),
        route: (*route).clone(),
        key: route_key(route, &parsed, headers, max_key_bytes),
        upstream_target: parsed.upstream_target,
    })
}

/// A header given as `NAME: VALUE` (a flag or a query parameter), for
/// `header:NAME` key templates.
pub fn parse_header(text: &str) -> Option<(HeaderName, HeaderValue)> {
    let (name, value) = text.split_once(':')?;
    Some((
        HeaderName::from_bytes(name.trim().as_bytes()).ok()?,
        HeaderValue::from_str(value.trim()).ok()?,
    ))
}

/// Why a request that meets a host route with its host spelled otherwise
/// is refused.
pub(crate) const HOST_SPELLING: &str = "spell the host as the route names it (lower case, no trailing dot): a backend may read another spelling as another host";

/// The order routes are tried in: most specific first, a host-specific
/// route before a catch-all host, then the longest prefix.
pub(crate) fn match_order(route: &Route) -> (bool, std::cmp::Reverse<usize>) {
    (
        route.host.is_none(),
        std::cmp::Reverse(route.path_prefix.trim_end_matches('/').len()),
    )
}

/// The route that serves `target` (a path and query as sent) on `host`,
/// and the target parsed as that route parses it; `None` when no route
/// serves it. The route is chosen on the decoded path, the one form every
/// spelling of a resource shares (`/b/r/y`, `/b/r%2Fy`, `/b/%72/y`), then
/// that route's own parse gives the key and the upstream target. A
/// canonical route refuses what it cannot key unambiguously; the spelling
/// cannot slip to another route. The proxy, the admin lookup and `fencegate
/// explain` all take this one path.
pub(crate) fn resolve<'r, R: AsRef<Route>>(
    routes: &'r [R],
    host: Option<&str>,
    target: &str,
) -> Result<Option<(&'r R, CanonicalPath)>, KeyError> {
    let form = key::route_form(target)?;
    let find = |form: &str| {
        routes.iter().find(|r| {
            let route = r.as_ref();
            route.host.as_deref().is_none_or(|h| Some(h) == host) && route.matches_path(form)
        })
    };
    let Some(found) = find(&form) else {
        return Ok(None);
    };
    // A backend that drops path parameters reads `/api;x/1` as `/api/1`:
    // a spelling that reads as another route's that way is refused (a
    // canonical route refuses `;` itself, so this guards the literal ones).
    if let Some(bare) = key::without_params(&form) {
        if !find(&bare).is_some_and(|other| std::ptr::eq(other, found)) {
            return Err(KeyError::PathParameter);
        }
    }
    let path = if found.as_ref().literal_keys {
        key::literal(target)
    } else {
        key::canonicalize(target)
    }?;
    Ok(Some((found, path)))
}

/// The fence key (`namespace:resource`) `route` gives a parsed target,
/// within the key length limit.
pub(crate) fn route_key(
    route: &Route,
    path: &CanonicalPath,
    headers: &HeaderMap,
    max_key_bytes: usize,
) -> Result<String, ProxyError> {
    let text = route
        .key
        .key_text(path, headers)
        .map_err(ProxyError::BadTarget)?;
    let len = route.namespace.len() + 1 + text.len();
    if len > max_key_bytes {
        return Err(ProxyError::KeyTooLong {
            len,
            limit: max_key_bytes,
        });
    }
    Ok(format!("{}:{}", route.namespace, text))
}

/// The live route table as the admin lookup and the lock service see it:
/// how a write to a target would be classified now. The proxy implements
/// it (its routes change on reload); a service holds an `Arc<dyn Explain>`
/// so that it depends on this module, not on the proxy.
pub trait Explain: Send + Sync {
    /// The route, key and upstream target a write to `target` on `host`
    /// with `headers` gets, or why it would be refused before forwarding.
    fn explain(
        &self,
        host: Option<&str>,
        target: &str,
        headers: &HeaderMap,
    ) -> Result<Explained, ProxyError>;

    /// Requests that started under a key mapping a reload has since
    /// replaced and have not ended: writes under the mapping in force wait
    /// for them (the reload barrier).
    fn older_mapping_in_flight(&self) -> usize;
}
