//! The forms of a request on its way to an upstream: HTTP/1.1's (origin
//! form, the authority in Host) and HTTP/2's (the authority in the request
//! line).

use http::{header, HeaderValue, Request, Uri};

use crate::error::ProxyBody;

/// The request as it goes out over HTTP/1.1: no `te: trailers` (an
/// HTTP/2 hop's header; over HTTP/1.1 it would need `Connection: TE`, and
/// only gRPC asks for it), and [`h2_form`] undone for a request that goes
/// out over HTTP/1.1 after all (a retry on another connection): origin
/// form, the authority back in Host.
pub(super) fn h1_form(req: &mut Request<ProxyBody>) {
    req.headers_mut().remove(header::TE);
    let Some(authority) = req.uri().authority().cloned() else {
        return;
    };
    if !req.headers().contains_key(header::HOST) {
        if let Ok(v) = HeaderValue::from_str(authority.as_str()) {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    let target = req.uri().path_and_query().cloned();
    if let Some(target) = target {
        *req.uri_mut() = Uri::from(target);
    }
}

/// HTTP/2 carries the authority in the request line (`:authority`), not in
/// a Host header: the client's Host becomes it, so the backend sees the
/// name the client used, as it does over HTTP/1.1.
pub(super) fn h2_form(req: &mut Request<ProxyBody>, dial: &Uri) {
    if req.uri().authority().is_some() {
        return;
    }
    let authority = req
        .headers_mut()
        .remove(header::HOST)
        .and_then(|h: HeaderValue| http::uri::Authority::try_from(h.as_bytes()).ok())
        .or_else(|| dial.authority().cloned());
    let mut parts = req.uri().clone().into_parts();
    parts.scheme = dial.scheme().cloned();
    parts.authority = authority;
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::full;

    fn get(path: &str) -> Request<ProxyBody> {
        Request::get(path).body(full("")).unwrap()
    }

    #[test]
    fn h2_form_puts_the_clients_host_in_the_request_line() {
        let dial: Uri = "http://10.0.0.1:8080/".parse().unwrap();
        let mut req = get("/a?b=1");
        req.headers_mut()
            .insert(header::HOST, HeaderValue::from_static("name.example:81"));
        h2_form(&mut req, &dial);
        assert_eq!(req.uri(), "http://name.example:81/a?b=1");
        assert!(!req.headers().contains_key(header::HOST));
        // Without a Host, the upstream's own address.
        let mut req = get("/a");
        h2_form(&mut req, &dial);
        assert_eq!(req.uri(), "http://10.0.0.1:8080/a");
        // Already in that form: as it is.
        h2_form(&mut req, &"http://other/".parse().unwrap());
        assert_eq!(req.uri(), "http://10.0.0.1:8080/a");
    }

    #[test]
    fn h1_form_undoes_h2_form() {
        let dial: Uri = "http://10.0.0.1:8080/".parse().unwrap();
        let mut req = get("/a?b=1");
        req.headers_mut()
            .insert(header::HOST, HeaderValue::from_static("name.example:81"));
        req.headers_mut()
            .insert(header::TE, HeaderValue::from_static("trailers"));
        h2_form(&mut req, &dial);
        assert_eq!(req.headers()[header::TE], "trailers");
        h1_form(&mut req);
        assert!(!req.headers().contains_key(header::TE));
        assert_eq!(req.uri(), "/a?b=1");
        assert_eq!(req.headers()[header::HOST], "name.example:81");
        // A Host already there stays.
        let mut req = Request::get("http://x.example/p").body(full("")).unwrap();
        req.headers_mut()
            .insert(header::HOST, HeaderValue::from_static("kept"));
        h1_form(&mut req);
        assert_eq!(req.uri(), "/p");
        assert_eq!(req.headers()[header::HOST], "kept");
    }
}
