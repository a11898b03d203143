//! Listeners, connection serving and graceful shutdown.
//!
//! [`Server::start`] opens the store, binds the listeners (plain proxy,
//! optional TLS proxy, admin) and spawns their accept loops;
//! [`Server::wait`] runs until the cancellation token fires, then stops
//! accepting, drains in-flight requests within the grace period and, only if
//! the drain completed, records a clean stop in the store. [`Reloader`]
//! applies a new config to the running server (SIGHUP) without touching
//! connections in flight.
//!
//! Files: `start.rs` (the [`Server`], its start and drain), `conn.rs`
//! (accept loops and connections), `progress.rs` (what the idle watchdog
//! counts as progress), `lane.rs` (the own HTTP/1.1 lane of
//! the proxy listeners), `heads.rs` (the lane's reading of the heads
//! hyper reads after it), `reload.rs` (the [`Reloader`]),
//! `error.rs`.

mod conn;
mod error;
mod heads;
mod lane;
mod progress;
mod reload;
mod start;

pub use error::{ReloadError, ServerError};
pub use reload::Reloader;
pub use start::Server;
