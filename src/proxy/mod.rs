//! The request path: classify a request, fence it if it is a write, relay
//! it.
//!
//! - `classify.rs`: what a request is (route, upstream target, and for a
//!   write its keys and token), decided with no store and no upstream.
//! - `handle.rs`: one request from start to answer: the fencing of a
//!   write (`fence_write`: admission and the waits behind older writes),
//!   and the answer, its log line and its metrics (`context.rs`).
//! - `state.rs`: the [`Proxy`] itself, its reloads; `table.rs`: the route
//!   table and its key mapping.
//! - `forward.rs`: the headers on the way, the guarded request body, and the
//!   exchange with the route's [`Upstream`](crate::upstream::Upstream).
//! - `response.rs`: the response body on its way to the client: its
//!   pauses bounded (`limits.response_idle_timeout`), a cut one logged.
//! - `linger.rs`: reading what is left of a refused request's body, so
//!   that the client reads its answer.
//! - `s3.rs`: the S3 operation a request asks for, named in the refusals
//!   of routes that answer in S3's form; `query.rs`: a query parameter's
//!   values, as the frameworks behind fencegate read them.
//!
//! The order is fixed so that nothing of a refused write leaves the proxy:
//! route and key first (400), then the body limit (413), the token (428/400),
//! admission (409/503), and only then a connection upstream. The request body
//! is not polled before admission, so a client that sent
//! `Expect: 100-continue` gets the final refusal instead of `100 Continue`.

mod body;
mod classify;
mod context;
mod forward;
mod handle;
mod linger;
mod query;
mod response;
mod s3;
mod state;
mod table;

pub use body::RequestBody;
pub use forward::strip_hop_by_hop;
pub use state::{Peer, Proxy};
