//! A request target in the proxy's own terms, for people: which route
//! serves it, the key template that route applies, the fence key a write
//! there takes, or why such a write would be refused before anything is
//! forwarded. The admin lookup (`GET /v1/fences?path=`) and `fencegate
//! explain` answer through the functions the proxy classifies writes with
//! ([`resolve`], [`route_key`]), so what they print is what a write gets.

use http::HeaderMap;
use serde_json::json;

use super::classify::{match_order, resolve, route_key};
use crate::config::Route;
use crate::error::ProxyError;
use crate::key;

/// Where a write to a target goes.
#[derive(Debug)]
pub struct Explained {
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
    /// The JSON the admin lookup answers (`highest`: the key's highest
    /// token, when the caller read it).
    pub fn to_json(&self, highest: Option<u64>) -> serde_json::Value {
        let r = &self.route;
        let mut v = json!({
            "route": r.name,
            "route_host": r.host,
            "path_prefix": r.path_prefix,
            "key_template": r.key.to_string(),
            "namespace": r.namespace,
            "literal_keys": r.literal_keys,
            "upstream": format!("{}{}", r.upstream, self.upstream_target),
        });
        match &self.key {
            Ok(k) => {
                v["key"] = json!(k);
                v["highest"] = json!(highest.map(|h| h.to_string()));
            }
            Err(e) => {
                v["key"] = serde_json::Value::Null;
                v["refused"] = json!({"status": e.status().as_u16(), "detail": e.to_string()});
            }
        }
        v
    }
}

/// Resolves `target`, an origin-form path (`/bucket/report.csv`, with an
/// optional query) or an absolute URL whose authority is the host, on
/// `host` (a `Host` header's value; `None`: none sent) as the proxy would.
/// `headers` are consulted only by `header:NAME` key templates. `Err` is
/// the refusal that comes before any route is chosen: a target that does
/// not parse (400), no route (404), no host where some route names one.
pub fn explain<R: AsRef<Route>>(
    routes: &[R],
    host: Option<&str>,
    target: &str,
    headers: &HeaderMap,
    max_key_bytes: usize,
) -> Result<Explained, ProxyError> {
    let parse = |h: &str| {
        key::authority_host(h)
            .map(|(h, _)| h)
            .map_err(ProxyError::BadTarget)
    };
    let (url_host, target) = split_absolute(target)?;
    let host = match (
        url_host.map(parse).transpose()?,
        host.map(parse).transpose()?,
    ) {
        (Some(u), Some(h)) if u != h => {
            return Err(ProxyError::BadRequest(format!(
                "the URL names host {u} and the host given is {h}"
            )))
        }
        (u, h) => u.or(h),
    };
    let mut ordered: Vec<&Route> = routes.iter().map(AsRef::as_ref).collect();
    ordered.sort_by_key(|r| match_order(r));
    if host.is_none() && ordered.iter().any(|r| r.host.is_some()) {
        return Err(ProxyError::BadRequest(
            "some route names a host: give the host too".into(),
        ));
    }
    let (route, path) = resolve(&ordered, host.as_deref(), target)
        .map_err(ProxyError::BadTarget)?
        .ok_or(ProxyError::NoRoute)?;
    Ok(Explained {
        route: (*route).clone(),
        key: route_key(route, &path, headers, max_key_bytes),
        upstream_target: path.upstream_target,
    })
}

/// `http://host/path` names its host (returned first); a plain path names
/// none.
fn split_absolute(target: &str) -> Result<(Option<&str>, &str), ProxyError> {
    let Some(rest) = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
    else {
        if !target.starts_with('/') {
            return Err(ProxyError::BadRequest(
                "the path must start with `/` (or be an http:// or https:// URL)".into(),
            ));
        }
        return Ok((None, target));
    };
    match rest.find(['/', '?']) {
        Some(i) if rest.as_bytes()[i] == b'/' => {
            let (authority, path) = rest.split_at(i);
            Ok((Some(authority), path))
        }
        _ => Err(ProxyError::BadRequest(
            "the URL has no path after its host".into(),
        )),
    }
}
