//! Upstream connections of one route: a pool per worker thread, the dial,
//! and one exchange.
//!
//! Each worker keeps its own idle connections. The lock around a worker's
//! pool is only ever taken on that worker's thread (and by the reaper once a
//! few seconds), so it is never contended, and a connection's driver task
//! runs on the worker that dialed it: a request, its upstream connection and
//! the downstream connection share one thread.
//!
//! A request goes out on the most recently used idle connection. One that
//! the upstream closed while it sat idle costs no failed request: a request
//! that was never written goes out on the next connection or a fresh one.
//! A request that may have been written is never sent again; its error is a
//! 502 (a write must not reach the backend twice).
//!
//! Every upstream connection is dialled by `dial.rs`, which makes closing
//! one discard what its kernel still holds for the backend.
//!
//! Files: `pool.rs` (the [`Upstream`], its pools and hyper's exchange),
//! `h1.rs` (the own HTTP/1.1 lane's exchange with a plain upstream: the
//! request as bytes, the answer read on the asking task), `limit.rs` (the
//! cap on connections and its queue), `forms.rs` (a request's HTTP/1.1 and
//! HTTP/2 forms), `kill.rs` (the switch that throws a connection of hyper's
//! when a write on it is given up, and the settling of one that carried an
//! early-answered write), `outq.rs` (what the kernel still holds for the
//! backend on a connection), `error.rs` (how an exchange fails).

mod dial;
mod error;
mod forms;
mod h1;
mod kill;
mod limit;
mod outq;
mod pool;

pub use dial::{Connector, Dialer};
pub use error::UpstreamError;
pub use limit::LimitSettings;
pub use pool::{retires_connection, Delivery, Upstream};
