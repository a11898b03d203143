//! The durable highest-token table behind the fence.
//!
//! [`FenceStore`] is the seam between admission (`fence`) and the engines. The
//! embedded engine ([`embedded::EmbeddedStore`], redb with group commit) is the
//! default; shared engines (Redis, PostgreSQL, etcd) implement the same trait so
//! several replicas can enforce one fence.

pub mod embedded;

use std::time::Duration;

use async_trait::async_trait;

/// What [`FenceStore::advance`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advance {
    /// The token was higher than the stored one (or the key was new); the
    /// stored highest is now the token, durably.
    Raised { previous: Option<u64> },
    /// The token equals the stored highest; nothing was written.
    Equal,
    /// The stored highest is greater than the token; nothing was written.
    Stale { highest: u64 },
}

/// Why a store could not answer. Every variant fails writes closed (503).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The engine could not read or persist (I/O error, disk full, connection
    /// lost). The operation may be retried later.
    #[error("fence store unavailable: {0}")]
    Unavailable(String),
    /// The store is shutting down or was closed.
    #[error("fence store closed")]
    Closed,
}

/// What was found when the store was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartState {
    /// A new store, or one whose last user stopped cleanly (drained).
    Clean,
    /// The last process using the store did not stop cleanly: writes it had
    /// forwarded may still be in flight upstream, for up to the recovery
    /// window that process ran with (if recorded; it may have been longer
    /// than this run's).
    Unclean { previous_window: Option<Duration> },
}

/// An in-flight lease on a key, held while a write is forwarded (see
/// [`FenceStore::acquire_lease`]).
#[derive(Debug)]
pub struct WriteLease {
    /// Engine-specific identity of the lease; `None` for engines that order
    /// writes in-process only.
    pub id: Option<String>,
}

/// The answer to [`FenceStore::acquire_lease`].
#[derive(Debug)]
pub enum LeaseOutcome {
    /// No older-token write holds the key anywhere; forward.
    Granted(WriteLease),
    /// An older-token write holds the key (on another replica); retry after
    /// the given pause, up to the caller's deadline.
    Busy { retry_after: Duration },
}

/// A durable map from fence key to the highest token seen.
///
/// Keys are opaque UTF-8 strings (`namespace:resource`). Implementations must
/// be safe to call concurrently from many tasks.
#[async_trait]
pub trait FenceStore: Send + Sync + 'static {
    /// Short engine name for logs and metrics (`embedded`, `redis`, ...).
    fn kind(&self) -> &'static str;

    /// Whether this process is the only writer of the store. Only then may
    /// the caller answer "equal" from an in-memory copy of the highest token:
    /// nobody else can have raised it behind our back.
    fn exclusive(&self) -> bool;

    /// How the store was found at open (see [`StartState`]).
    fn start_state(&self) -> StartState;

    /// The durable highest token of `key`, `None` if the key was never
    /// fenced. Reflects every `advance` that has returned.
    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError>;

    /// Atomic compare-and-raise: if `token` is greater than the stored
    /// highest (or the key is new) store it and return `Raised`. The raise is
    /// durable (fsync or the engine's equivalent) before this returns; a
    /// caller may forward the write as soon as it sees `Raised`.
    /// Concurrent calls on one key are linearizable.
    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError>;

    /// Cross-replica ordering: records that a write with `token` is about to
    /// be forwarded for `key`, expiring after `ttl` even if never released.
    /// Answers `Busy` while an unexpired lease with an older token is held by
    /// someone else. Engines with a single writer order writes in-process and
    /// grant at once without I/O.
    async fn acquire_lease(
        &self,
        key: &str,
        token: u64,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let _ = (key, token, ttl);
        Ok(LeaseOutcome::Granted(WriteLease { id: None }))
    }

    /// Releases a lease from [`acquire_lease`](Self::acquire_lease). Best
    /// effort: a lease that is not released expires by itself.
    async fn release_lease(&self, key: &str, lease: WriteLease) -> Result<(), StoreError> {
        let _ = (key, lease);
        Ok(())
    }

    /// Cheap liveness probe for `/readyz`: `Ok` if a write could be
    /// persisted now, as far as the store can tell.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Flushes and records a clean stop, so the next start needs no
    /// crash-recovery wait. Called once, after in-flight writes drained.
    async fn close_clean(&self) -> Result<(), StoreError>;
}
