//! Classifying a request before anything is forwarded: is it a write (its
//! method, a method override, a form POST), which fence keys it takes (its
//! target, a COPY/MOVE `Destination`), and the header checks that refuse
//! ambiguous framing or hosts.

use super::linger::content_length;
use super::query::query_values;

use super::body::RequestBody;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Uri};

use crate::config::{ErrorFormat, Route};
use crate::error::ProxyError;
use crate::key::{self, CanonicalPath, KeyError};
use crate::token::token_from_headers;

use super::context::*;
use super::state::*;
use super::table::*;
use crate::routing::{resolve, route_key, HOST_SPELLING};

/// Headers that name a different method than the request line's.
/// Names made once: a lookup by `&str` parses the name on every request.
pub(super) static OVERRIDE_HEADERS: [header::HeaderName; 3] = [
    header::HeaderName::from_static("x-http-method-override"),
    header::HeaderName::from_static("x-http-method"),
    header::HeaderName::from_static("x-method-override"),
];

/// The host a request names, through one parse whatever carries it (`Host`,
/// an absolute-form target, HTTP/2's `:authority`): both, when present,
/// must name the same host and port. Refuses a repeated `Host` (RFC 9112
/// section 3.2) and a `Connection` header naming `Host`, which would strip
/// the header routing was decided on.
pub(super) fn request_host<B>(req: &Request<B>) -> Result<Option<String>, ProxyError> {
    let bad = |why: &str| ProxyError::BadRequest(why.to_string());
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host_header = hosts.next();
    if hosts.next().is_some() {
        return Err(bad("more than one Host header"));
    }
    if lists_token(req.headers(), header::CONNECTION, "host") {
        return Err(bad("the Connection header names Host"));
    }
    let parse = |text: &str| key::authority_host(text).map_err(ProxyError::BadTarget);
    let from_header = host_header
        .map(|h| {
            h.to_str()
                .map_err(|_| bad("the Host header is not ASCII"))
                .and_then(parse)
        })
        .transpose()?;
    let from_target = req
        .uri()
        .authority()
        .map(|a| parse(a.as_str()))
        .transpose()?;
    match (from_target, from_header) {
        (Some(t), Some(h)) if t != h => Err(ProxyError::BadTarget(KeyError::ForeignHost)),
        (Some((host, _)), _) | (None, Some((host, _))) => Ok(Some(host)),
        (None, None) => Ok(None),
    }
}

/// Whether every source of a request's host (`Host`, an absolute-form
/// target, HTTP/2's `:authority`) spells it plainly (see
/// [`key::host_spelled_plainly`]).
pub(super) fn host_sources_plain<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(header::HOST)
        .is_none_or(|h| h.to_str().is_ok_and(key::host_spelled_plainly))
        && req
            .uri()
            .authority()
            .is_none_or(|a| key::host_spelled_plainly(a.as_str()))
}

/// A form body (`application/x-www-form-urlencoded` or
/// `multipart/form-data`), where frameworks also read `_method`.
pub(super) fn is_form(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONTENT_TYPE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| {
            let t = v.split(';').next().unwrap_or("").trim();
            t.eq_ignore_ascii_case("application/x-www-form-urlencoded")
                || t.eq_ignore_ascii_case("multipart/form-data")
        })
}

/// An HTTP/1.1 WebSocket opening handshake (RFC 6455 section 4.1):
/// `Upgrade: websocket` with `upgrade` among the `Connection` options.
/// Other upgrades (`h2c`) are ignored as RFC 9110 allows: the request goes
/// on as a plain one.
pub(super) fn is_websocket_upgrade(version: http::Version, headers: &HeaderMap) -> bool {
    version == http::Version::HTTP_11
        && lists_token(headers, header::UPGRADE, "websocket")
        && lists_token(headers, header::CONNECTION, "upgrade")
}

/// Whether a comma-list header (`Connection`, `Upgrade`, `TE`), on any of
/// its lines, names `token` (case-insensitive; `;` parameters ignored).
pub(super) fn lists_token(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            let t = t.split(';').next().unwrap_or_default();
            t.trim().eq_ignore_ascii_case(token)
        })
}

pub(super) fn is_copy_or_move(method: &Method, headers: &HeaderMap, query: Option<&str>) -> bool {
    let named = |m: &str| m.eq_ignore_ascii_case("COPY") || m.eq_ignore_ascii_case("MOVE");
    named(method.as_str())
        || OVERRIDE_HEADERS
            .iter()
            .flat_map(|h| headers.get_all(h))
            .any(|v| v.to_str().is_ok_and(|m| named(m.trim())))
        || query_values(query.unwrap_or(""), "_method").any(|m| m.is_some_and(|m| named(m.trim())))
}

/// Refuses message framing that two HTTP implementations could read two
/// ways (request smuggling): both Content-Length and Transfer-Encoding,
/// several Content-Length headers, or a transfer coding other than exactly
/// `chunked`. The parser accepts some of these; a proxy must not.
pub(super) fn check_framing(method: &Method, headers: &HeaderMap) -> Result<(), ProxyError> {
    let bad = |why: &str| ProxyError::BadFraming(why.to_string());
    // The upstream client drops a chunked body on GET and HEAD: refused
    // rather than silently lost.
    if matches!(*method, Method::GET | Method::HEAD)
        && headers.contains_key(header::TRANSFER_ENCODING)
    {
        return Err(bad("a chunked body on GET or HEAD"));
    }
    let lengths = headers.get_all(header::CONTENT_LENGTH).iter().count();
    if lengths > 1 {
        return Err(bad("more than one Content-Length header"));
    }
    let mut codings = headers.get_all(header::TRANSFER_ENCODING).iter().peekable();
    if codings.peek().is_some() {
        if lengths > 0 {
            return Err(bad("both Content-Length and Transfer-Encoding"));
        }
        let all: Vec<&[u8]> = codings.map(|v| v.as_bytes()).collect();
        if all.len() != 1 || !all[0].trim_ascii().eq_ignore_ascii_case(b"chunked") {
            return Err(bad("Transfer-Encoding other than a single `chunked`"));
        }
    }
    Ok(())
}

/// For a target that does not parse: whether the route it would most
/// likely have taken (the first whose host matches and whose prefix starts
/// its raw path) answers in S3's form, so that an S3 client is told why
/// (`InvalidURI`) in a form it reads. Only the refusal's form depends on it.
fn s3_route_by_prefix(routes: &[RouteRuntime], host: Option<&str>, raw_path: &str) -> bool {
    routes
        .iter()
        .map(|r| &r.route)
        .find(|r| {
            r.host.as_deref().is_none_or(|h| Some(h) == host)
                && raw_path.starts_with(&r.path_prefix)
        })
        .is_some_and(|r| r.error_format == ErrorFormat::S3)
}

/// What a request is, decided before anything waits or is forwarded.
pub(super) struct Classified<'t> {
    pub(super) rt: &'t RouteRuntime,
    pub(super) path: CanonicalPath,
    /// `None` for a read.
    pub(super) write: Option<WriteIntent>,
    /// A bodiless method whose head did not say whether a body follows
    /// (HTTP/2 without END_STREAM on its HEADERS): it must be seen to end
    /// with no data before anything is forwarded.
    pub(super) must_be_empty: bool,
}

/// Refuses a body on a request that has no body semantics (a bodiless
/// method the route does not allow bodies on, or any WebSocket handshake)
/// when its head declares one; says whether the body must still be seen
/// to be empty (its length unknown from the head).
///
/// A backend that does not read a `GET` body (Python's `http.server`,
/// many small APIs) reads it as the next request on its connection: one
/// fencegate never admitted, and another client's answer goes astray.
pub(super) fn check_bodiless<B: http_body::Body>(
    route: &Route,
    websocket: bool,
    req: &Request<B>,
) -> Result<bool, ProxyError> {
    let method = req.method().as_str();
    let refused = if websocket {
        "a WebSocket handshake"
    } else if crate::config::bodiless(method)
        && !route.allow_bodies_on.contains(&method.to_ascii_uppercase())
    {
        method
    } else {
        return Ok(false);
    };
    let headers = req.headers();
    let declared = headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0");
    if declared {
        return Err(no_body_here(refused));
    }
    Ok(!req.body().is_end_stream())
}

/// The refusal of a body on a request that has none.
pub(super) fn no_body_here(what: &str) -> ProxyError {
    ProxyError::BadFraming(format!(
        "a body on {what}, which this route does not take (a backend that does not read it would read it as another request; see `allow_bodies_on`)"
    ))
}

/// A write's fence keys (its target first, then a COPY/MOVE destination)
/// and its token.
pub(super) struct WriteIntent {
    pub(super) keys: Vec<String>,
    pub(super) token: u64,
}

impl Proxy {
    /// Decides what a request is before anything waits or leaves: its
    /// route and upstream target, and for a write its fence keys and token.
    /// Every refusal that needs no store (400, 413, 428...) happens here.
    pub(super) fn classify<'t>(
        &self,
        table: &'t RouteTable,
        req: &mut Request<RequestBody>,
        ctx: &mut RequestContext,
    ) -> Result<Classified<'t>, ProxyError> {
        ctx.method = req.method().clone();
        if req.method() == Method::CONNECT {
            return Err(ProxyError::MethodNotAllowed("CONNECT".into()));
        }
        check_framing(req.method(), req.headers())?;
        let host = request_host(req)?;
        if host.is_none() && table.host_routes {
            // Without a host it could only take a catch-all route, which may
            // fence the same backend under another namespace.
            return Err(ProxyError::BadRequest("a Host header is required".into()));
        }
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());

        let (rt, path) = match resolve(&table.routes, host.as_deref(), &target) {
            Ok(Some(found)) => found,
            Ok(None) => return Err(ProxyError::NoRoute),
            Err(e) => {
                ctx.write = true; // unparsed: assume the worst for logging
                if s3_route_by_prefix(&table.routes, host.as_deref(), req.uri().path()) {
                    ctx.s3_resource = Some(req.uri().path().to_string());
                }
                return Err(ProxyError::BadTarget(e));
            }
        };
        let route = &rt.route;
        ctx.route = Some(route.name.clone());
        if route.error_format == ErrorFormat::S3 {
            ctx.s3_resource = Some(req.uri().path().to_string());
        }
        if route.host.is_some() && !host_sources_plain(req) {
            return Err(ProxyError::BadRequest(HOST_SPELLING.into()));
        }
        if is_websocket_upgrade(req.version(), req.headers()) {
            if !route.websocket {
                return Err(ProxyError::UpgradeNotEnabled);
            }
            ctx.websocket = true;
        }
        let must_be_empty = check_bodiless(route, ctx.websocket, req)?;
        ctx.requests = Some(rt.metrics.requests.clone());
        ctx.write = self.is_write(route, req.method(), req.headers(), req.uri().query())?;
        if !ctx.write {
            return Ok(Classified {
                rt,
                path,
                write: None,
                must_be_empty,
            });
        }

        // Writes: everything that can be refused is checked before anything
        // is forwarded.
        let mut keys = vec![self.fence_key(route, &path, req.headers())?];
        ctx.key = Some(keys[0].clone());
        if is_copy_or_move(req.method(), req.headers(), req.uri().query()) {
            if let Some(dest) = req.headers().get("destination") {
                let (key, rewritten) =
                    self.destination_key(table, rt, dest, host.as_deref(), req.headers())?;
                keys.push(key);
                // The backend gets the destination it was fenced as.
                req.headers_mut().insert("destination", rewritten);
            }
        }
        if let (Some(limit), Some(len)) =
            (self.limits.max_body_bytes, content_length(req.headers()))
        {
            if len > limit {
                return Err(ProxyError::BodyTooLarge { limit });
            }
        }
        let token = token_from_headers(req.headers()).map_err(|e| {
            // Named in the refusal: a tool may send the token with some
            // requests of an upload and not others.
            if ctx.s3_resource.is_some() {
                ctx.s3_upload_step =
                    super::s3::operation(req.method(), req.uri().query(), req.headers())
                        .filter(|op| super::s3::is_upload_step(op));
            }
            ProxyError::Token(e)
        })?;
        ctx.token = Some(token);
        Ok(Classified {
            rt,
            path,
            write: Some(WriteIntent { keys, token }),
            must_be_empty,
        })
    }

    /// A request is a write if its method is, or if a method override
    /// names a write method (so a GET overridden to DELETE is fenced): the
    /// override headers, and `_method` in the query string (Rails, Laravel,
    /// Express's method-override). A form POST (`_method` may be in its
    /// body, which is not read before forwarding) is fenced as a write.
    pub(super) fn is_write(
        &self,
        route: &Route,
        method: &Method,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> Result<bool, ProxyError> {
        let named = |what: &str, m: Option<&str>| {
            m.map(str::trim)
                .filter(|m| !m.is_empty() && Method::from_bytes(m.as_bytes()).is_ok())
                .map(|m| route.write_methods.is_write(m))
                .ok_or_else(|| ProxyError::BadRequest(format!("{what} does not name a method")))
        };
        let mut write = route.write_methods.is_write(method.as_str());
        for name in &OVERRIDE_HEADERS {
            for value in headers.get_all(name) {
                write |= named(name.as_str(), value.to_str().ok())?;
            }
        }
        for value in query_values(query.unwrap_or(""), "_method") {
            write |= named("the _method parameter", value.as_deref())?;
        }
        if *method == Method::POST && !write && is_form(headers) {
            write = true;
        }
        Ok(write)
    }

    pub(super) fn fence_key(
        &self,
        route: &Route,
        path: &CanonicalPath,
        headers: &HeaderMap,
    ) -> Result<String, ProxyError> {
        route_key(route, path, headers, self.limits.max_key_bytes)
    }

    /// The key of a COPY/MOVE `Destination`, parsed like a request target of
    /// the same route. A destination on another host or route is refused:
    /// this proxy could not fence it.
    pub(super) fn destination_key(
        &self,
        table: &RouteTable,
        rt: &RouteRuntime,
        dest: &HeaderValue,
        host: Option<&str>,
        headers: &HeaderMap,
    ) -> Result<(String, HeaderValue), ProxyError> {
        let bad = |why: &str| ProxyError::BadRequest(format!("Destination header: {why}"));
        let text = dest.to_str().map_err(|_| bad("not ASCII"))?;
        let uri: Uri = text.parse().map_err(|_| bad("not a URI"))?;
        if let Some(auth) = uri.authority() {
            let (h, _) = key::authority_host(auth.as_str()).map_err(ProxyError::BadTarget)?;
            if Some(h.as_str()) != host {
                return Err(bad("names another host"));
            }
        }
        let target = uri.path_and_query().map_or("/", |p| p.as_str());
        let path = match resolve(&table.routes, host, target).map_err(ProxyError::BadTarget)? {
            Some((other, path)) if std::ptr::eq(other, rt) => path,
            _ => return Err(bad("is not served by the same route")),
        };
        let rewritten = match (uri.scheme(), uri.authority()) {
            (Some(scheme), Some(auth)) => format!("{scheme}://{auth}{}", path.upstream_target),
            _ => path.upstream_target.clone(),
        };
        let rewritten = HeaderValue::from_str(&rewritten).map_err(|_| bad("not ASCII"))?;
        Ok((self.fence_key(&rt.route, &path, headers)?, rewritten))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn websocket_handshakes_are_told_apart() {
        let with = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(*k, HeaderValue::from_static(v));
            }
            h
        };
        let h11 = http::Version::HTTP_11;
        let ws = with(&[("upgrade", "websocket"), ("connection", "Upgrade")]);
        assert!(is_websocket_upgrade(h11, &ws));
        assert!(is_websocket_upgrade(
            h11,
            &with(&[
                ("upgrade", "WebSocket"),
                ("connection", "keep-alive, upgrade")
            ])
        ));
        assert!(is_websocket_upgrade(
            h11,
            &with(&[
                ("upgrade", "websocket"),
                ("connection", "keep-alive"),
                ("connection", "upgrade")
            ])
        ));
        // Not one: no Connection option, another protocol, HTTP/1.0 or 2.
        assert!(!is_websocket_upgrade(
            h11,
            &with(&[("upgrade", "websocket")])
        ));
        assert!(!is_websocket_upgrade(
            h11,
            &with(&[("upgrade", "h2c"), ("connection", "upgrade")])
        ));
        assert!(!is_websocket_upgrade(http::Version::HTTP_10, &ws));
        assert!(!is_websocket_upgrade(http::Version::HTTP_2, &ws));
    }
}
