//! etcd's v3 gRPC API as fencegate uses it: the messages it sends and reads
//! (a subset of etcd's `rpc.proto` and `kv.proto`, with their field numbers;
//! fields fencegate never sets or reads are left out, and prost skips them
//! in answers), and one unary call over HTTP/2 (gRPC's framing: a flag
//! byte, a 4-byte length, the message; the status in the trailers).
//!
//! Why not the JSON gateway on the same port: it spent two thirds of etcd's
//! CPU per write under fencegate's load (etcd's own profile, `jsonpb`),
//! and that CPU is shared with the proxy when both run on one host. Why
//! not tonic: a unary call over hyper, which is in the tree already, is a
//! page of code; the messages are derived with prost, so there is no
//! protoc in the build.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use prost::Message;

/// The TCP connector, counting the connections it makes.
#[derive(Clone)]
pub struct Dialer {
    pub(super) inner: HttpConnector,
    pub(super) dials: Arc<AtomicU64>,
}

impl tower_service::Service<http::Uri> for Dialer {
    type Response = <HttpConnector as tower_service::Service<http::Uri>>::Response;
    type Error = <HttpConnector as tower_service::Service<http::Uri>>::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connect = self.inner.call(uri);
        let dials = self.dials.clone();
        Box::pin(async move {
            let stream = connect.await?;
            dials.fetch_add(1, Ordering::AcqRel);
            Ok(stream)
        })
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct ResponseHeader {
    #[prost(int64, tag = "3")]
    pub revision: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub mod_revision: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub value: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
pub struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    /// Empty: the one key; otherwise keys in `[key, range_end)`.
    #[prost(bytes = "vec", tag = "2")]
    pub range_end: Vec<u8>,
    #[prost(bool, tag = "9")]
    pub count_only: bool,
}

#[derive(Clone, PartialEq, Message)]
pub struct RangeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(message, repeated, tag = "2")]
    pub kvs: Vec<KeyValue>,
    #[prost(int64, tag = "4")]
    pub count: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
    /// The etcd lease the key is attached to (0: none).
    #[prost(int64, tag = "3")]
    pub lease: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct DeleteRangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, Message)]
pub struct RequestOp {
    #[prost(oneof = "request_op::Request", tags = "1, 2, 3, 4")]
    pub request: Option<request_op::Request>,
}

pub mod request_op {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Request {
        #[prost(message, tag = "1")]
        Range(super::RangeRequest),
        #[prost(message, tag = "2")]
        Put(super::PutRequest),
        #[prost(message, tag = "3")]
        DeleteRange(super::DeleteRangeRequest),
        #[prost(message, tag = "4")]
        Txn(super::TxnRequest),
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct ResponseOp {
    #[prost(oneof = "response_op::Response", tags = "1, 2, 3, 4")]
    pub response: Option<response_op::Response>,
}

pub mod response_op {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Response {
        #[prost(message, tag = "1")]
        Range(super::RangeResponse),
        /// A put's and a delete's answers carry nothing fencegate reads.
        #[prost(message, tag = "2")]
        Put(super::Empty),
        #[prost(message, tag = "3")]
        DeleteRange(super::Empty),
        #[prost(message, tag = "4")]
        Txn(super::TxnResponse),
    }
}

impl ResponseOp {
    pub fn range(&self) -> Option<&RangeResponse> {
        match &self.response {
            Some(response_op::Response::Range(r)) => Some(r),
            _ => None,
        }
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct Compare {
    /// EQUAL 0, GREATER 1, LESS 2, NOT_EQUAL 3.
    #[prost(int32, tag = "1")]
    pub result: i32,
    /// VERSION 0, CREATE 1, MOD 2, VALUE 3, LEASE 4.
    #[prost(int32, tag = "2")]
    pub target: i32,
    #[prost(bytes = "vec", tag = "3")]
    pub key: Vec<u8>,
    #[prost(oneof = "compare::Target", tags = "5, 6, 7")]
    pub target_union: Option<compare::Target>,
}

pub mod compare {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Target {
        #[prost(int64, tag = "5")]
        CreateRevision(i64),
        #[prost(int64, tag = "6")]
        ModRevision(i64),
        #[prost(bytes = "vec", tag = "7")]
        Value(Vec<u8>),
    }
}

const EQUAL: i32 = 0;
const GREATER: i32 = 1;
const CREATE: i32 = 1;
const MOD: i32 = 2;
const VALUE: i32 = 3;

#[derive(Clone, PartialEq, Message)]
pub struct TxnRequest {
    #[prost(message, repeated, tag = "1")]
    pub compare: Vec<Compare>,
    #[prost(message, repeated, tag = "2")]
    pub success: Vec<RequestOp>,
    #[prost(message, repeated, tag = "3")]
    pub failure: Vec<RequestOp>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TxnResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(bool, tag = "2")]
    pub succeeded: bool,
    #[prost(message, repeated, tag = "3")]
    pub responses: Vec<ResponseOp>,
}

#[derive(Clone, PartialEq, Message)]
pub struct LeaseGrantRequest {
    /// Seconds.
    #[prost(int64, tag = "1")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct LeaseGrantResponse {
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(string, tag = "4")]
    pub error: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct AuthenticateRequest {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub password: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct AuthenticateResponse {
    #[prost(string, tag = "2")]
    pub token: String,
}

// Builders for the operations and compares fencegate sends.

pub fn range(key: &str) -> RequestOp {
    op(request_op::Request::Range(RangeRequest {
        key: key.into(),
        ..Default::default()
    }))
}

/// How many keys lie in `[key, end)`.
pub fn count(key: &str, end: &str) -> RequestOp {
    op(request_op::Request::Range(RangeRequest {
        key: key.into(),
        range_end: end.into(),
        count_only: true,
    }))
}

pub fn put(key: &str, value: &str, lease: i64) -> RequestOp {
    op(request_op::Request::Put(PutRequest {
        key: key.into(),
        value: value.into(),
        lease,
    }))
}

pub fn delete(key: &str) -> RequestOp {
    op(request_op::Request::DeleteRange(DeleteRangeRequest {
        key: key.into(),
    }))
}

pub fn nested(txn: TxnRequest) -> RequestOp {
    op(request_op::Request::Txn(txn))
}

fn op(request: request_op::Request) -> RequestOp {
    RequestOp {
        request: Some(request),
    }
}

pub fn value_greater(key: &str, value: &str) -> Compare {
    compare(key, GREATER, VALUE, compare::Target::Value(value.into()))
}

pub fn value_equal(key: &str, value: &str) -> Compare {
    compare(key, EQUAL, VALUE, compare::Target::Value(value.into()))
}

/// The key does not exist.
pub fn absent(key: &str) -> Compare {
    compare(key, EQUAL, CREATE, compare::Target::CreateRevision(0))
}

/// The key was last changed at `revision` (0: it does not exist).
pub fn unchanged(key: &str, revision: i64) -> Compare {
    compare(key, EQUAL, MOD, compare::Target::ModRevision(revision))
}

fn compare(key: &str, result: i32, target: i32, value: compare::Target) -> Compare {
    Compare {
        result,
        target,
        key: key.into(),
        target_union: Some(value),
    }
}

/// Why a call got no answer.
#[derive(Debug)]
pub enum CallError {
    /// Connecting, TLS or HTTP/2 failed.
    Exchange(hyper_util::client::legacy::Error),
    /// etcd answered with a gRPC error (`grpc-status`, `grpc-message`).
    Status { code: u32, message: String },
    /// The answer was not one gRPC message of the expected type.
    Malformed(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Exchange(e) => write!(f, "{e}"),
            CallError::Status { code, message } => write!(f, "{message} (gRPC status {code})"),
            CallError::Malformed(why) => write!(f, "unreadable answer: {why}"),
        }
    }
}

/// An HTTP/2-only client to etcd's members: one connection per member
/// carries every call (gRPC needs HTTP/2; etcd serves it on its client
/// port, in cleartext with prior knowledge or over TLS with ALPN `h2`).
pub type Channel = Client<HttpsConnector<Dialer>, Full<Bytes>>;

/// One unary call: `method` is `/etcdserverpb.KV/Txn` and the like, `base`
/// the endpoint (`http://host:port`); `token` is etcd auth's, sent as its
/// `token` metadata.
pub async fn call<Q: Message, A: Message + Default>(
    channel: &Channel,
    base: &str,
    method: &str,
    token: Option<&str>,
    request: &Q,
) -> Result<A, CallError> {
    let len = request.encoded_len();
    let mut frame = BytesMut::with_capacity(5 + len);
    frame.put_u8(0);
    frame
        .put_u32(u32::try_from(len).map_err(|_| CallError::Malformed("request too large".into()))?);
    request
        .encode(&mut frame)
        .map_err(|e| CallError::Malformed(e.to_string()))?;
    let mut req = http::Request::post(format!("{base}{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = token {
        req = req.header("token", t);
    }
    let req = req
        .body(Full::new(frame.freeze()))
        .map_err(|e| CallError::Malformed(e.to_string()))?;
    let resp = channel.request(req).await.map_err(CallError::Exchange)?;
    let (parts, body) = resp.into_parts();
    // An error without a message comes as headers only ("Trailers-Only").
    status(&parts.headers)?;
    if parts.status != http::StatusCode::OK {
        return Err(CallError::Malformed(format!(
            "HTTP status {}",
            parts.status
        )));
    }
    let body = body
        .collect()
        .await
        .map_err(|e| CallError::Malformed(e.to_string()))?;
    match body.trailers() {
        Some(t) => status(t)?,
        None => return Err(CallError::Malformed("no gRPC status".into())),
    }
    let mut data = body.to_bytes();
    if data.len() < 5 || data[0] != 0 {
        return Err(CallError::Malformed(
            "not one uncompressed gRPC message".into(),
        ));
    }
    data.advance(1);
    let n = data.get_u32() as usize;
    if data.len() != n {
        return Err(CallError::Malformed(format!(
            "a message of {n} bytes in {} bytes",
            data.len()
        )));
    }
    A::decode(data).map_err(|e| CallError::Malformed(e.to_string()))
}

/// The gRPC status in these headers or trailers, if it is an error.
fn status(headers: &http::HeaderMap) -> Result<(), CallError> {
    let Some(code) = headers.get("grpc-status") else {
        return Ok(());
    };
    let code = code
        .to_str()
        .ok()
        .and_then(|c| c.parse::<u32>().ok())
        .ok_or_else(|| CallError::Malformed("grpc-status is not a number".into()))?;
    if code == 0 {
        return Ok(());
    }
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .map(|m| {
            percent_encoding::percent_decode_str(m)
                .decode_utf8_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    Err(CallError::Status { code, message })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes etcd's Go types produce for these messages (field numbers
    /// and wire types from `rpc.proto`), so a wrong tag cannot go unseen.
    #[test]
    fn messages_match_etcds_wire_format() {
        let txn = TxnRequest {
            compare: vec![unchanged("k", 5)],
            success: vec![put("k", "v", 7)],
            failure: vec![count("a", "b")],
        };
        assert_eq!(
            txn.encode_to_vec(),
            [
                // compare: result EQUAL (default, absent), target MOD (2),
                // key "k", mod_revision 5.
                &[0x0a, 0x07, 0x10, 0x02, 0x1a, 0x01, b'k', 0x30, 0x05][..],
                // success: request_put {key "k", value "v", lease 7}.
                &[0x12, 0x0a, 0x12, 0x08, 0x0a, 0x01, b'k', 0x12, 0x01, b'v', 0x18, 0x07],
                // failure: request_range {key "a", range_end "b",
                // count_only (9) true}.
                &[0x1a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'a', 0x12, 0x01, b'b', 0x48, 0x01],
            ]
            .concat()
        );
        // A CREATE compare against 0 still sends its revision: etcd reads
        // an absent one as 0 too, but presence is what a oneof means.
        assert_eq!(
            absent("k").encode_to_vec(),
            [0x10, 0x01, 0x1a, 0x01, b'k', 0x28, 0x00]
        );
        // An answer: header {revision 9}, succeeded, one nested txn answer
        // holding a range answer with one kv (mod_revision 4, value "7")
        // and count 1.
        let kv = [0x0a, 0x01, b'x', 0x18, 0x04, 0x2a, 0x01, b'7'];
        let range = [&[0x12, kv.len() as u8][..], &kv, &[0x20, 0x01]].concat();
        let op_range = [&[0x0a, range.len() as u8][..], &range].concat();
        let inner = [&[0x1a, op_range.len() as u8][..], &op_range].concat();
        let op_txn = [&[0x22, inner.len() as u8][..], &inner].concat();
        let bytes = [
            &[0x0a, 0x02, 0x18, 0x09, 0x10, 0x01][..],
            &[0x1a, op_txn.len() as u8],
            &op_txn,
        ]
        .concat();
        let answer = TxnResponse::decode(&bytes[..]).unwrap();
        assert_eq!(answer.header.as_ref().map(|h| h.revision), Some(9));
        assert!(answer.succeeded);
        let Some(response_op::Response::Txn(nested)) = &answer.responses[0].response else {
            panic!("a nested transaction's answer: {answer:?}");
        };
        let r = nested.responses[0].range().unwrap();
        assert_eq!((r.count, r.kvs[0].mod_revision), (1, 4));
        assert_eq!(r.kvs[0].value, b"7");
    }

    #[test]
    fn an_error_status_carries_its_decoded_message() {
        let mut h = http::HeaderMap::new();
        assert!(status(&h).is_ok());
        h.insert("grpc-status", "0".parse().unwrap());
        assert!(status(&h).is_ok());
        h.insert("grpc-status", "16".parse().unwrap());
        h.insert(
            "grpc-message",
            "etcdserver:%20invalid%20auth%20token".parse().unwrap(),
        );
        match status(&h) {
            Err(CallError::Status { code, message }) => {
                assert_eq!(
                    (code, message.as_str()),
                    (16, "etcdserver: invalid auth token")
                )
            }
            other => panic!("{other:?}"),
        }
        h.insert("grpc-status", "x".parse().unwrap());
        assert!(matches!(status(&h), Err(CallError::Malformed(_))));
    }
}
