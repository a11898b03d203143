//! fencegate: an HTTP reverse proxy that enforces fencing tokens.
//!
//! Writes carry `X-Fence-Token`; the proxy keeps the highest token per
//! resource key in a durable store, forwards writes that are not stale, and
//! refuses the rest, so a lock holder that lost its lease cannot overwrite
//! the work of the next one. `docs/contract.md` is the exact promise.
//!
//! Where things live:
//!
//! - [`config`]: the TOML/flag shape ([`config::RawConfig`]) and the
//!   validated [`config::Config`] built from it with `TryFrom`.
//! - [`token`]: the `X-Fence-Token` grammar.
//! - [`key`]: the one canonical parse of the request target that yields both
//!   the fence key and the target sent upstream.
//! - [`fence`]: admission and ordering: stale / equal / raise, waiting behind
//!   older in-flight writes, crash recovery.
//! - [`store`]: the [`store::FenceStore`] trait and its engines
//!   ([`store::embedded`], redb with group commit; Redis, PostgreSQL and
//!   etcd behind [`store::shared`]).
//! - [`proxy`]: the request path: classifying a request (`proxy/classify.rs`),
//!   fencing a write (`proxy/mod.rs`), relaying it (`proxy/forward.rs`,
//!   WebSocket tunnels included), reading a refused body so that the
//!   client reads its answer (`proxy/linger.rs`), and the same
//!   classification for people (`proxy/explain.rs`: the admin lookup by
//!   path and `fencegate explain`).
//! - [`upstream`]: a route's upstream connections (a pool per worker,
//!   HTTP/1.1, h2 by ALPN or h2c) and one exchange, with the rule that a
//!   write is never sent twice.
//! - [`error`]: the one place where errors become HTTP answers
//!   (problem+json, or gRPC statuses for gRPC calls).
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/v1/fences/{key}` and
//!   the lookup by path `/v1/fences?path=`.
//! - [`lease`]: the lock service (`lease_listen`): leases whose tokens
//!   are granted by the fence itself, for routes with `tokens = "granted"`.
//! - [`id`]: identifiers no two processes share (request ids, lease ids).
//! - [`metrics`]: the Prometheus registry and metric handles.
//! - [`server`]: listeners (plain and TLS), connection serving, reload,
//!   graceful shutdown.
//! - [`proxy_protocol`]: the PROXY protocol header a load balancer puts in
//!   front of a connection, and the addresses trusted to speak for clients.
//! - [`workers`]: the worker threads (one runtime, listener and upstream
//!   pool each) and the CPU count they default to.
//! - [`tls`]: rustls configs for the TLS listener (reloadable) and for
//!   https upstreams.
//!
//! The binary (`src/main.rs`) only parses flags, sets up logging and signals,
//! and calls [`server::Server`].

#![forbid(unsafe_code)]

pub mod admin;
pub mod bearer;
pub mod clock;
pub mod config;
pub mod error;
pub mod fence;
pub mod id;
pub mod key;
pub mod lease;
pub mod metrics;
pub mod proxy;
pub mod proxy_protocol;
pub mod routing;
pub mod server;
pub mod slot;
pub mod store;
pub mod tls;
pub mod token;
pub mod upstream;
pub mod workers;
