//! fencegate: an HTTP reverse proxy that enforces fencing tokens.
//!
//! Writes carry `X-Fence-Token`; the proxy keeps the highest token per
//! resource key in a durable store, forwards writes that are not stale, and
//! refuses the rest, so a lock holder that lost its lease cannot overwrite
//! the work of the next one. `docs/contract.md` is the exact promise.
//!
//! Where things live, floor by floor (a module uses only the floors below
//! it; `docs/architecture.md` draws the house, `tests/layers.rs` checks it):
//!
//! 0. Plain values and parsers:
//!    [`token`] (the `X-Fence-Token` grammar), [`key`] (the one canonical
//!    parse of a request target: fence key and upstream target),
//!    [`id`] (identifiers no two processes share), [`clock`] (milliseconds
//!    and lease expiry arithmetic), [`slot`] (which worker runtime this
//!    thread is), [`bearer`] (bearer tokens and the credential rule),
//!    [`proxy_protocol`] (the PROXY header and who may send it),
//!    [`metrics`] (the Prometheus registry and handles), [`tls`]
//!    (certificates and rustls configs; the TLS settings' types), [`h1`]
//!    (the HTTP/1.1 heads the request path reads and writes itself),
//!    [`ring`] (a bounded ring of numbered entries).
//! 1. [`refusals`] and [`raises`]: the last refusals and raises, kept for
//!    the operator.
//! 2. [`config`]: the TOML/flag shape ([`config::RawConfig`]) and the
//!    validated [`config::Config`] built from it with `TryFrom`.
//! 3. [`store`]: the [`store::FenceStore`] contract (`store/api.rs`) and
//!    its engines ([`store::embedded`], redb with group commit; Redis,
//!    Redis Cluster (`store/redis/cluster.rs`, its fence keys in 64 groups,
//!    each a store of its own: `store/shared/groups.rs`), PostgreSQL and
//!    etcd behind [`store::shared`]).
//! 4. [`fence`]: admission and ordering (stale / equal / raise, waiting
//!    behind older in-flight writes, crash recovery), one file per concern.
//! 5. [`error`]: the one place where errors become HTTP answers
//!    (problem+json, S3's XML, or gRPC statuses for gRPC calls).
//! 6. What the services share: [`routing`] (route matching, the fence key
//!    a route gives, and `explain` for people, reached through the
//!    [`routing::Explain`] trait) and [`upstream`] (a route's connections,
//!    a pool per worker, and one exchange, never sent twice).
//! 7. The services, side by side: [`proxy`] (the request path: classify,
//!    fence, forward), [`lease`] (the lock service), [`admin`] (metrics,
//!    health, fence lookups, `confirm-reset`).
//! 8. [`workers`]: the worker threads (one runtime, listener and upstream
//!    pool each) and the CPU count they default to.
//! 9. [`server`]: listeners, connection serving, reload, graceful
//!    shutdown.
//!
//! The binary (`src/main.rs`, its command line in `src/cli/`) parses flags,
//! sets up logging and signals, and calls [`server::Server`].

#![forbid(unsafe_code)]

pub mod admin;
pub mod bearer;
pub mod clock;
pub mod config;
pub mod error;
pub mod fence;
pub mod h1;
pub mod id;
pub mod key;
pub mod lease;
pub mod metrics;
pub mod proxy;
pub mod proxy_protocol;
pub mod raises;
pub mod refusals;
pub mod ring;
pub mod routing;
pub mod server;
pub mod slot;
pub mod store;
pub mod tls;
pub mod token;
pub mod upstream;
pub mod workers;
