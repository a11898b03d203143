//! The one place where errors become HTTP answers.
//!
//! Every refusal fencegate produces is a [`ProxyError`]; [`ProxyError::into_response`]
//! picks the status by where the fault lies (client 4xx, store 503, upstream
//! 502/504) and writes an RFC 9457 `application/problem+json` body; the
//! same refusal takes gRPC's form for gRPC calls
//! ([`ProxyError::into_grpc_response`]) and S3's on routes in front of
//! object stores (`error/s3.rs`).

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Map, Value};

use crate::key::KeyError;
use crate::token::{TokenError, FENCE_TOKEN_HIGHEST};

mod s3;

/// The body type of every response fencegate sends.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type ProxyBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// A refused or failed request.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("{0}")]
    Token(TokenError),
    #[error("token {token} is lower than the highest token {highest} for this key")]
    Stale { token: u64, highest: u64 },
    #[error(
        "token {token} is more than {max_step} above the highest token {highest} for this key"
    )]
    TokenTooFarAhead {
        token: u64,
        highest: u64,
        max_step: u64,
    },
    #[error("{0}")]
    BadTarget(KeyError),
    #[error("{0}")]
    BadRequest(String),
    #[error("ambiguous message framing: {0}")]
    BadFraming(String),
    #[error("no route matches this host and path")]
    NoRoute,
    #[error("method {0} is not supported by this proxy")]
    MethodNotAllowed(String),
    #[error("this route does not pass WebSocket upgrades (its messages would not be fenced); set `websocket = true` on the route to pass them")]
    UpgradeNotEnabled,
    #[error("token {token} was never granted for this key; this route admits only tokens granted by fencegate's lease API")]
    NotGranted { token: u64 },
    #[error("the fence key is {len} bytes, over the limit of {limit}")]
    KeyTooLong { len: usize, limit: usize },
    #[error("the request body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("the client stopped sending the request body")]
    BodyTimeout,
    #[error("the fence store cannot answer: {0}")]
    StoreUnavailable(String),
    /// The store may have lost fences: the reason (and what the operator
    /// must do) is fencegate's own, for the client too.
    #[error("{0}")]
    StoreLostData(String),
    #[error("recovering from an unclean stop; writes resume when writes forwarded before it can no longer be in flight")]
    Recovering { retry_after: Duration },
    #[error("an older write to this key is still in flight upstream and may be applied after this one's wait limit; retry")]
    OlderInFlight { retry_after: Duration },
    #[error("fencegate is shutting down and forwards no new write; retry (on another replica)")]
    ShuttingDown,
    #[error("too many WebSocket tunnels are open; retry later")]
    TooManyTunnels,
    #[error("cannot connect to the upstream: {0}")]
    UpstreamConnect(String),
    #[error("the upstream did not answer within {0:?}")]
    UpstreamTimeout(Duration),
    /// Every connection the route's cap allows stayed taken for the queue
    /// timeout; the request was not sent.
    #[error("the upstream is busy: every connection fencegate may open to it stayed taken for {0:?}; retry")]
    UpstreamBusy(Duration),
    #[error("the upstream exchange failed: {0}")]
    Upstream(String),
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Token(TokenError::Missing) => StatusCode::PRECONDITION_REQUIRED,
            Self::Token(_)
            | Self::BadTarget(_)
            | Self::BadRequest(_)
            | Self::BadFraming(_)
            | Self::TokenTooFarAhead { .. } => StatusCode::BAD_REQUEST,
            Self::Stale { .. } => StatusCode::CONFLICT,
            Self::NotGranted { .. } => StatusCode::FORBIDDEN,
            Self::NoRoute => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::UpgradeNotEnabled => StatusCode::NOT_IMPLEMENTED,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::KeyTooLong { .. } => StatusCode::URI_TOO_LONG,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::StoreUnavailable(_)
            | Self::StoreLostData(_)
            | Self::Recovering { .. }
            | Self::OlderInFlight { .. }
            | Self::ShuttingDown
            | Self::TooManyTunnels
            | Self::UpstreamBusy(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::UpstreamConnect(_) | Self::Upstream(_) => StatusCode::BAD_GATEWAY,
            Self::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// Short machine name: the `type` suffix and the log/metric decision.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Token(TokenError::Missing) => "missing-token",
            Self::Token(_) => "malformed-token",
            Self::Stale { .. } => "stale-token",
            Self::TokenTooFarAhead { .. } => "token-too-far-ahead",
            Self::NotGranted { .. } => "not-granted",
            Self::BadTarget(_) => "bad-target",
            Self::BadRequest(_) => "bad-request",
            Self::BadFraming(_) => "bad-framing",
            Self::NoRoute => "no-route",
            Self::MethodNotAllowed(_) => "method-not-allowed",
            Self::UpgradeNotEnabled => "upgrade-not-enabled",
            Self::BodyTooLarge { .. } => "body-too-large",
            Self::KeyTooLong { .. } => "key-too-long",
            Self::BodyTimeout => "body-timeout",
            Self::StoreUnavailable(_) | Self::StoreLostData(_) => "store-unavailable",
            Self::Recovering { .. } => "recovering",
            Self::OlderInFlight { .. } => "older-write-in-flight",
            Self::ShuttingDown => "shutting-down",
            Self::TooManyTunnels => "too-many-tunnels",
            Self::UpstreamConnect(_) => "upstream-unreachable",
            Self::UpstreamTimeout(_) => "upstream-timeout",
            Self::UpstreamBusy(_) => "upstream-busy",
            Self::Upstream(_) => "upstream-failed",
        }
    }

    /// What the client is told. An upstream failure names no upstream
    /// host, certificate name or setting (a TLS error lists every name in
    /// the upstream's certificate): those are for the operator, and the log
    /// line of the request has the whole cause.
    fn client_detail(&self) -> String {
        match self {
            Self::UpstreamConnect(_) => {
                "cannot connect to the upstream (fencegate's log has the cause)".into()
            }
            Self::Upstream(_) => {
                "the upstream exchange failed (fencegate's log has the cause)".into()
            }
            // A store's errors name its hosts, ports and files, which are
            // the operator's, as an upstream's are.
            Self::StoreUnavailable(_) => {
                "the fence store cannot answer (fencegate's log has the cause)".into()
            }
            other => other.to_string(),
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::Token(TokenError::Missing) => "Fence token required",
            Self::Token(_) => "Malformed fence token",
            Self::Stale { .. } => "Stale fence token",
            Self::TokenTooFarAhead { .. } => "Fence token too far ahead",
            Self::NotGranted { .. } => "Fence token not granted",
            Self::BadTarget(_) => "Ambiguous or invalid request target",
            Self::BadRequest(_) => "Bad request",
            Self::BadFraming(_) => "Ambiguous message framing",
            Self::NoRoute => "No route",
            Self::MethodNotAllowed(_) => "Method not allowed",
            Self::UpgradeNotEnabled => "Protocol upgrade not enabled",
            Self::BodyTooLarge { .. } => "Request body too large",
            Self::KeyTooLong { .. } => "Fence key too long",
            Self::BodyTimeout => "Request body timeout",
            Self::StoreUnavailable(_) | Self::StoreLostData(_) => "Fence store unavailable",
            Self::Recovering { .. } => "Recovering from an unclean stop",
            Self::OlderInFlight { .. } => "Older write still in flight",
            Self::ShuttingDown => "Shutting down",
            Self::TooManyTunnels => "Too many WebSocket tunnels",
            Self::UpstreamConnect(_) => "Upstream unreachable",
            Self::UpstreamTimeout(_) => "Upstream timeout",
            Self::UpstreamBusy(_) => "Upstream busy",
            Self::Upstream(_) => "Upstream failed",
        }
    }

    /// Builds the problem+json answer. `key` is the fence key when one was
    /// derived.
    pub fn into_response(self, key: Option<&str>) -> Response<ProxyBody> {
        let status = self.status();
        let mut body = Map::new();
        body.insert(
            "type".into(),
            json!(format!("urn:fencegate:problem:{}", self.kind())),
        );
        body.insert("title".into(), json!(self.title()));
        body.insert("status".into(), json!(status.as_u16()));
        body.insert("detail".into(), json!(self.client_detail()));
        if let Some(k) = key {
            body.insert("key".into(), json!(k));
        }
        match &self {
            Self::Stale { token, highest } => {
                // As strings: JSON numbers above 2^53 lose precision in
                // many parsers, and tokens use the full u64 range.
                body.insert("token".into(), json!(token.to_string()));
                body.insert("highest".into(), json!(highest.to_string()));
            }
            Self::TokenTooFarAhead {
                highest, max_step, ..
            } => {
                body.insert("highest".into(), json!(highest.to_string()));
                body.insert("max_step".into(), json!(max_step.to_string()));
            }
            _ => {}
        }
        self.finish(problem_response(status, Value::Object(body)))
    }

    /// What every HTTP form of the answer carries beside its body: the
    /// extra headers, and `Connection: close` where the connection cannot
    /// be trusted to carry another request.
    fn finish(&self, mut resp: Response<ProxyBody>) -> Response<ProxyBody> {
        for (name, value) in self.extra_headers() {
            resp.headers_mut().insert(name, value);
        }
        if matches!(
            self,
            Self::BadTarget(_)
                | Self::Token(_)
                | Self::BadFraming(_)
                | Self::BodyTooLarge { .. }
                | Self::KeyTooLong { .. }
                | Self::BodyTimeout
        ) {
            // The request may have an unread body, or be a smuggling attempt:
            // do not reuse the connection.
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

impl ProxyError {
    /// A store failure: lost data in the store's own words, anything else
    /// (I/O, connection, credentials) told to the log only.
    pub fn from_store(e: &crate::store::StoreError) -> Self {
        use crate::store::StoreError;
        match e {
            StoreError::Amnesia(_) | StoreError::Uninitialised => {
                Self::StoreLostData(e.to_string())
            }
            _ => Self::StoreUnavailable(e.to_string()),
        }
    }

    /// Headers every form of the answer carries: the key's highest token
    /// for a token refused against it, when to retry for a refusal that
    /// passes.
    fn extra_headers(&self) -> Vec<(header::HeaderName, HeaderValue)> {
        match self {
            Self::Stale { highest, .. } | Self::TokenTooFarAhead { highest, .. } => {
                vec![(FENCE_TOKEN_HIGHEST.clone(), HeaderValue::from(*highest))]
            }
            Self::StoreUnavailable(_)
            | Self::StoreLostData(_)
            | Self::ShuttingDown
            | Self::TooManyTunnels
            // Neither was sent: a retry a moment later may find the
            // upstream's queue (or the cap's) drained.
            | Self::UpstreamBusy(_)
            | Self::UpstreamConnect(_) => {
                vec![(header::RETRY_AFTER, HeaderValue::from_static("1"))]
            }
            Self::Recovering { retry_after } | Self::OlderInFlight { retry_after } => {
                let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
                vec![(header::RETRY_AFTER, HeaderValue::from(secs.max(1)))]
            }
            _ => Vec::new(),
        }
    }

    /// The gRPC status code (gRPC's `doc/statuscodes.md`) of this refusal.
    /// gRPC clients read `grpc-status`, not the HTTP status: any status but
    /// 200 reaches them as UNKNOWN, the reason lost.
    pub fn grpc_status(&self) -> u8 {
        const UNKNOWN: u8 = 2;
        const DEADLINE_EXCEEDED: u8 = 4;
        const INVALID_ARGUMENT: u8 = 3;
        const PERMISSION_DENIED: u8 = 7;
        const RESOURCE_EXHAUSTED: u8 = 8;
        const FAILED_PRECONDITION: u8 = 9;
        const ABORTED: u8 = 10;
        const OUT_OF_RANGE: u8 = 11;
        const UNIMPLEMENTED: u8 = 12;
        const UNAVAILABLE: u8 = 14;
        match self {
            // The lock was lost: the caller retries from a new lease.
            Self::Stale { .. } => ABORTED,
            Self::Token(_) => FAILED_PRECONDITION,
            Self::TokenTooFarAhead { .. } => OUT_OF_RANGE,
            Self::NotGranted { .. } => PERMISSION_DENIED,
            Self::BadTarget(_)
            | Self::BadRequest(_)
            | Self::BadFraming(_)
            | Self::KeyTooLong { .. } => INVALID_ARGUMENT,
            Self::NoRoute | Self::MethodNotAllowed(_) | Self::UpgradeNotEnabled => UNIMPLEMENTED,
            Self::BodyTooLarge { .. } => RESOURCE_EXHAUSTED,
            Self::BodyTimeout | Self::UpstreamTimeout(_) => DEADLINE_EXCEEDED,
            // Nothing was sent: safe to retry, which gRPC clients may do
            // on their own for UNAVAILABLE.
            Self::StoreUnavailable(_)
            | Self::StoreLostData(_)
            | Self::Recovering { .. }
            | Self::OlderInFlight { .. }
            | Self::ShuttingDown
            | Self::TooManyTunnels
            | Self::UpstreamBusy(_)
            | Self::UpstreamConnect(_) => UNAVAILABLE,
            // The call may have been applied: not a status clients retry
            // by themselves (a retry with the same token is admitted).
            Self::Upstream(_) => UNKNOWN,
        }
    }

    /// The answer to a gRPC call (`content-type: application/grpc...`): a
    /// "trailers-only" response, HTTP 200 with `grpc-status`,
    /// `grpc-message` (the same reason a problem's `detail` gives) and the
    /// other headers as metadata, so that the client's status carries the
    /// code and the reason and its trailing metadata the highest token.
    pub fn into_grpc_response(self) -> Response<ProxyBody> {
        let mut resp = Response::new(full(Bytes::new()));
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert(
            "grpc-status",
            HeaderValue::from(u16::from(self.grpc_status())),
        );
        if let Ok(message) = HeaderValue::from_str(&grpc_message(&self.client_detail())) {
            headers.insert("grpc-message", message);
        }
        for (name, value) in self.extra_headers() {
            headers.insert(name, value);
        }
        resp
    }
}

/// Whether a request is a gRPC call, whose refusals must be gRPC statuses.
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            let v = v.trim_start();
            // `application/grpc`, `application/grpc+proto`, `;` parameters;
            // not `application/grpc-web`, which carries its status in the
            // body.
            v.get(..16)
                .is_some_and(|p| p.eq_ignore_ascii_case("application/grpc"))
                && matches!(v.as_bytes().get(16), None | Some(b'+' | b';' | b' '))
        })
}

/// `grpc-message` as gRPC's HTTP/2 mapping writes it: bytes outside
/// printable ASCII, and `%` itself, percent-encoded.
fn grpc_message(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An error and every cause under it, `: `-separated (hyper's and
/// reqwest-style errors say "client error (Connect)" at the top and the
/// reason below).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// A `problem+json` response with the given body.
pub fn problem_response(status: StatusCode, body: Value) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp
}

/// The answer to a `HEAD` request: the head the same request with `GET`
/// would get (its `content-length`, `content-type`...) and no body, on
/// every protocol. hyper drops the body of an answer to HEAD over
/// HTTP/1.1, but over HTTP/2 it sends it as DATA frames, which clients
/// refuse as a protocol error (RFC 9110 section 9.3.2: no content).
pub fn answer_to_head(resp: Response<ProxyBody>) -> Response<ProxyBody> {
    use http_body::Body as _;
    if resp.body().is_end_stream() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    if let Some(len) = body.size_hint().exact() {
        parts
            .headers
            .entry(header::CONTENT_LENGTH)
            .or_insert_with(|| HeaderValue::from(len));
    }
    Response::from_parts(parts, full(Bytes::new()))
}

/// A JSON (not problem) response with the given body.
pub fn json_response(status: StatusCode, body: Value) -> Response<ProxyBody> {
    let mut r = Response::new(full(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A complete in-memory body.
pub fn full(data: impl Into<Bytes>) -> ProxyBody {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A refused or failed lease API request (the lock service).
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error(
        "lease requests need `Authorization: Bearer TOKEN` with a token from the lease token file"
    )]
    Unauthorized,
    #[error("this bearer token may not lease {0} (its key prefixes do not cover it)")]
    OutOfScope(String),
    #[error("the lease on {0} was taken with another bearer token: only that token may renew, read or release it")]
    OtherBearer(String),
    #[error("{0}: {1}")]
    BadField(&'static str, String),
    #[error("{0}")]
    BadBody(String),
    #[error("no such endpoint: use /v1/leases and /v1/leases/{{id}}[/renew]")]
    NotFound,
    #[error("method not allowed here: POST /v1/leases, GET or DELETE /v1/leases/{{id}}, POST /v1/leases/{{id}}/renew")]
    MethodNotAllowed,
    #[error("another lease holds {key}")]
    Held {
        key: String,
        holder: String,
        expires_in: Duration,
    },
    #[error("the lease expired or was released; a lost lease is never revived: acquire a new one")]
    Gone,
    #[error("{0} has the highest token there is: no token above it can be granted (an operator can reset the fence)")]
    Exhausted(String),
    #[error("the fence store cannot answer: {0}")]
    Store(String),
}

impl From<crate::fence::FenceError> for LeaseError {
    fn from(e: crate::fence::FenceError) -> Self {
        LeaseError::Store(e.to_string())
    }
}

impl LeaseError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::OutOfScope(_) | Self::OtherBearer(_) => StatusCode::FORBIDDEN,
            Self::BadField(..) | Self::BadBody(_) => StatusCode::BAD_REQUEST,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Held { .. } | Self::Exhausted(_) => StatusCode::CONFLICT,
            Self::Gone => StatusCode::GONE,
            Self::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The `type` suffix, and the result label of the lease metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::OutOfScope(_) => "out-of-scope",
            Self::OtherBearer(_) => "other-bearer",
            Self::BadField(..) | Self::BadBody(_) => "bad-request",
            Self::NotFound => "not-found",
            Self::MethodNotAllowed => "method-not-allowed",
            Self::Held { .. } => "lease-held",
            Self::Exhausted(_) => "tokens-exhausted",
            Self::Gone => "lease-gone",
            Self::Store(_) => "store-unavailable",
        }
    }

    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.status();
        let mut body = Map::new();
        body.insert(
            "type".into(),
            json!(format!("urn:fencegate:problem:{}", self.kind())),
        );
        body.insert(
            "title".into(),
            json!(status.canonical_reason().unwrap_or("")),
        );
        body.insert("status".into(), json!(status.as_u16()));
        body.insert("detail".into(), json!(self.to_string()));
        match &self {
            Self::Held {
                key,
                holder,
                expires_in,
            } => {
                body.insert("key".into(), json!(key));
                body.insert("holder".into(), json!(holder));
                body.insert(
                    "expires_in_ms".into(),
                    json!(crate::clock::millis(*expires_in)),
                );
            }
            Self::BadField(field, _) => {
                body.insert("field".into(), json!(field));
            }
            Self::OutOfScope(key) | Self::OtherBearer(key) | Self::Exhausted(key) => {
                body.insert("key".into(), json!(key));
            }
            _ => {}
        }
        let mut resp = problem_response(status, Value::Object(body));
        match self {
            Self::Unauthorized => {
                resp.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            Self::Store(_) => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Self::MethodNotAllowed => {
                resp.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, POST, DELETE"));
            }
            _ => {}
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_calls_are_told_by_their_content_type() {
        let with = |ct: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            is_grpc(&h)
        };
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC;charset=x",
            "application/grpc ",
        ] {
            assert!(with(yes), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpcx",
            "application/json",
            "application/grp",
        ] {
            assert!(!with(no), "{no}");
        }
        assert!(!is_grpc(&http::HeaderMap::new()));
    }

    #[test]
    fn grpc_refusals_carry_the_code_the_reason_and_the_highest_token() {
        let resp = ProxyError::Stale {
            token: 33,
            highest: 34,
        }
        .into_grpc_response();
        assert_eq!(resp.status(), StatusCode::OK);
        let h = resp.headers();
        assert_eq!(h["content-type"], "application/grpc");
        assert_eq!(h["grpc-status"], "10");
        assert_eq!(
            h["grpc-message"],
            "token 33 is lower than the highest token 34 for this key"
        );
        assert_eq!(h[&FENCE_TOKEN_HIGHEST], "34");
        assert!(
            http_body::Body::is_end_stream(resp.body()),
            "trailers-only: no body"
        );
        let code = |e: ProxyError| e.into_grpc_response().headers()["grpc-status"].clone();
        assert_eq!(code(ProxyError::Token(TokenError::Missing)), "9");
        assert_eq!(code(ProxyError::StoreUnavailable("x".into())), "14");
        assert_eq!(code(ProxyError::UpstreamConnect("x".into())), "14");
        assert_eq!(code(ProxyError::Upstream("x".into())), "2");
        assert_eq!(
            code(ProxyError::UpstreamTimeout(Duration::from_secs(1))),
            "4"
        );
        assert_eq!(code(ProxyError::NotGranted { token: 1 }), "7");
        assert_eq!(code(ProxyError::NoRoute), "12");
        assert_eq!(code(ProxyError::BodyTooLarge { limit: 1 }), "8");
        assert_eq!(
            code(ProxyError::TokenTooFarAhead {
                token: 9,
                highest: 1,
                max_step: 2
            }),
            "11"
        );
        assert_eq!(code(ProxyError::BadRequest("x".into())), "3");
        let retry = ProxyError::Recovering {
            retry_after: Duration::from_millis(1500),
        }
        .into_grpc_response();
        assert_eq!(retry.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn store_failures_show_lost_data_and_hide_the_rest() {
        use crate::store::StoreError;
        let detail = |e: StoreError| {
            let err = ProxyError::from_store(&e);
            assert_eq!(err.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(err.kind(), "store-unavailable");
            err.client_detail()
        };
        let hidden = detail(StoreError::Unavailable(
            "redis://10.0.0.7:6379: refused".into(),
        ));
        assert!(!hidden.contains("10.0.0.7"), "{hidden}");
        assert!(hidden.contains("fencegate's log has the cause"), "{hidden}");
        let refused = detail(StoreError::Refused("wrong password for user x".into()));
        assert!(!refused.contains("password"), "{refused}");
        let lost = detail(StoreError::Amnesia("its marker went back".into()));
        assert!(
            lost.contains("lost data") && lost.contains("marker went back"),
            "{lost}"
        );
        assert!(detail(StoreError::Uninitialised).contains("init-store"));
    }

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(grpc_message("a b~"), "a b~");
        assert_eq!(grpc_message("100% é\n"), "100%25 %C3%A9%0A");
        assert_eq!(grpc_message("tab\there"), "tab%09here");
    }
}
