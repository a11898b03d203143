//! What can stop a start or refuse a reload.

use std::net::SocketAddr;
use std::time::Duration;

use crate::store::embedded::OpenError;
use crate::store::StoreError;
use crate::tls::TlsError;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Store(#[from] OpenError),
    #[error(transparent)]
    Connect(#[from] crate::store::ConnectError),
    /// The store answered, but cannot be used (a shared store without a
    /// marker, an embedded one that cannot record the key mapping).
    #[error("invalid `store`: {0}")]
    SharedStore(StoreError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot listen on {addr} (`{field}`): {reason}")]
    Bind {
        field: &'static str,
        addr: SocketAddr,
        reason: String,
    },
}

/// Why a reload was refused; the running config stays in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("the reload task failed: {0}")]
    Task(String),
    #[error("the key mapping could not be recorded in the store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("invalid `routes`: upstream_timeout {new:?} is longer than the {started:?} the server started with; the crash-recovery window and shared-store leases were sized from it, so a longer one needs a restart")]
    LongerUpstreamTimeout { new: Duration, started: Duration },
}
