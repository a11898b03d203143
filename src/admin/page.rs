//! The admin page (issue 46): one HTML page, its script and its style,
//! compiled into the binary so that it works air-gapped (nothing fetched
//! from anywhere but this listener). The page holds no data: it asks for
//! the admin token and calls `/v1/status`, `/v1/refusals` and
//! `/v1/fences` with it.

use http::{header, HeaderValue, Response, StatusCode};

use crate::error::{full, ProxyBody};

const INDEX: &str = include_str!("page/index.html");
const SCRIPT: &str = include_str!("page/app.js");
const STYLE: &str = include_str!("page/style.css");

/// The page's file at `path`.
pub(super) fn asset(path: &str) -> Response<ProxyBody> {
    let (body, kind) = match path {
        "/ui/app.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "/ui/style.css" => (STYLE, "text/css; charset=utf-8"),
        _ => (INDEX, "text/html; charset=utf-8"),
    };
    let mut r = Response::new(full(body));
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    // Only this listener's own script, style and API; no framing by other
    // sites (the page acts with the admin token).
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    r
}
