//! The store's contract: the [`FenceStore`] trait, each method with the
//! guarantee it gives, and the values it trades in. Every engine implements
//! it; the fence sees nothing else of them.

use std::time::Duration;

use async_trait::async_trait;

/// A key-mapping fingerprint that no mapping has: writes under several
/// mappings may be in flight ([`FenceStore::record_key_mapping`]).
pub const KEY_MAPPING_MIXED: u64 = 0;

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

/// One shard of a store that spreads its keys over several
/// ([`FenceStore::shards`]): the groups of fence keys it serves, and how
/// they answered last.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Shard {
    /// The shard's primary (`host:port`), as the store's topology names
    /// it; `unknown` while that cannot be read.
    pub shard: String,
    /// Groups of fence keys it serves.
    pub groups: usize,
    /// Of those, the groups that failed the ping this report made: their
    /// keys' writes fail closed (503) until they answer.
    pub unreachable: usize,
    /// Of those, the groups in amnesia (lost data): their keys' writes are
    /// refused until an operator confirms (`confirm-reset`).
    pub lost: usize,
    /// The groups failing, by name (a few, then how many more).
    pub failing: Option<String>,
    /// The first failure's reason.
    pub error: Option<String>,
}

impl Shard {
    /// Whether every group it serves answers.
    pub fn up(&self) -> bool {
        self.unreachable == 0 && self.lost == 0
    }

    /// Whether some group it serves answers.
    pub fn serving(&self) -> bool {
        self.groups > self.unreachable + self.lost
    }

    /// What fails over `shards`, one clause per failing shard; `None`
    /// while every group answers.
    pub fn failing(shards: &[Shard]) -> Option<String> {
        let clauses: Vec<String> = shards
            .iter()
            .filter(|s| !s.up())
            .map(|s| {
                format!(
                    "shard {}: {} of its {} groups failing ({}): {}",
                    s.shard,
                    s.unreachable + s.lost,
                    s.groups,
                    s.failing.as_deref().unwrap_or(""),
                    s.error.as_deref().unwrap_or("")
                )
            })
            .collect();
        (!clauses.is_empty()).then(|| clauses.join("; "))
    }
}

/// A store's replica waits ([`FenceStore::replicas`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Replicas {
    /// The last call that got an answer: the replicas it waited for and
    /// how many confirmed it in time. `None` before the first, and after
    /// a call that got no answer (the store unreachable).
    pub last: Option<LastWait>,
    /// Calls failed since start because fewer replicas confirmed them
    /// than were waited for (503; the next call reconnects). The last
    /// call alone can hide these: after a replica is lost, the reconnect
    /// may find none online and wait for none.
    pub failed_waits: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LastWait {
    pub wanted: u32,
    pub confirmed: u32,
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
    /// The store may have lost data (its marker is missing or older than
    /// this process saw, or a key's highest went down): writes are refused
    /// until an operator confirms.
    #[error("fence store may have lost data ({0}); writes are refused until an operator confirms (POST /v1/store/confirm-reset or --accept-store-reset)")]
    Amnesia(String),
    /// The store refused fencegate: a wrong password or user, or a TLS
    /// certificate that does not check out (either side). A setting to fix,
    /// not an outage: a replica that meets it at start does not start.
    #[error("fence store refused the connection: {0}")]
    Refused(String),
    /// The store carries no fencegate marker: it is new (run `fencegate
    /// init-store` once) or it was wiped. Writes are refused until one or
    /// the other is settled by an operator.
    #[error("fence store has no fencegate marker: a new store must be initialised once with `fencegate init-store --store URL`; a store that was in use has lost its fences (see docs/stores.md, \"Data loss\")")]
    Uninitialised,
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

/// A key with a live in-flight mark when the last run stopped uncleanly.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct CrashedKey {
    pub key: String,
    pub highest: Option<u64>,
    /// The lowest token among the writes its live marks were made for: a
    /// write of a higher token could overtake one of them.
    pub lowest: u64,
}

/// An in-flight lease on a key, held while a write is forwarded (see
/// [`FenceStore::acquire_lease`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteLease {
    /// Unique identity of the lease in the store.
    pub id: String,
    /// The token of the write holding it.
    pub token: u64,
}

/// The answer to [`FenceStore::acquire_lease`] and [`FenceStore::poll_lease`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// The token is the key's highest and no older-token lease is held
    /// anywhere: forward, then release.
    Granted(WriteLease),
    /// The lease is registered (so older writers are now stale and newer ones
    /// wait for it), but an older-token lease is still held: poll again after
    /// the pause. Older leases expire by themselves.
    Busy {
        lease: WriteLease,
        retry_after: Duration,
    },
    /// A higher token holds the key; nothing is registered (a lease being
    /// polled is removed).
    Stale { highest: u64 },
}

/// A lease of the lock service (`lease` module) as the store keeps it:
/// at most one per key, held until it expires or is released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lock {
    /// The lease id the API hands out (it names the key too).
    pub id: String,
    /// The token granted with it: the key's highest when it was granted.
    pub token: u64,
    /// Free text from the client, for people.
    pub holder: String,
    /// Left of its TTL, on the store's clock (the granting side's where the
    /// store has none).
    pub expires_in: Duration,
}

/// The answer to [`FenceStore::claim_lock`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Granted: the key's highest is now `token`, durably, and the lease is
    /// recorded. `registered`: a replica held a write registration on the
    /// key at that moment (shared stores), so it may still admit an older
    /// token on it for a while (see `fence::active`); never on the
    /// embedded store.
    Granted { token: u64, registered: bool },
    /// Another unexpired lease holds the key; nothing changed.
    Held(Lock),
    /// The key's highest is `u64::MAX`: no token above it exists.
    Exhausted,
}

fn no_locks(kind: &str) -> StoreError {
    StoreError::Unavailable(format!("the {kind} store keeps no leases"))
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

    /// [`highest`](Self::highest) as an admission sees it: shared stores
    /// first refuse while they may have lost data (and check their marker
    /// as admissions do), and compare the answer with what they saw
    /// acknowledged. The registration checks of the fence use it.
    async fn confirm_highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.highest(key).await
    }

    /// Atomic compare-and-raise: if `token` is greater than the stored
    /// highest (or the key is new) store it and return `Raised`. The raise is
    /// durable (fsync or the engine's equivalent) before this returns; a
    /// caller may forward the write as soon as it sees `Raised`.
    /// Concurrent calls on one key are linearizable.
    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError>;

    /// Exclusive stores: [`advance`](Self::advance), and in the same
    /// commit an in-flight mark of the key (see
    /// [`mark_in_flight`](Self::mark_in_flight)), whatever the answer. One
    /// fsync covers both, so a write to a new key costs no more disk writes
    /// than before.
    async fn advance_marked(&self, key: &str, token: u64) -> Result<(Advance, u64), StoreError>;

    /// Exclusive stores: records durably, before it returns, that `key` may
    /// have a write of `token` in flight, and returns the mark's sequence number
    /// (rising, never reused once answered). A mark lives until a
    /// [`rotate_marks`](Self::rotate_marks) to a watermark above it is
    /// durable. After an unclean stop
    /// [`in_flight_at_crash`](Self::in_flight_at_crash) names every key with
    /// a live mark, so that only those keys wait for the crashed run's
    /// writes.
    async fn mark_in_flight(&self, key: &str, token: u64) -> Result<u64, StoreError>;

    /// Exclusive stores: the sequence number the next mark will get. Every
    /// mark asked for after this call gets at least this number.
    fn next_mark(&self) -> u64;

    /// Exclusive stores, in one commit: marks `keys` again, each with the
    /// lowest token it has in flight (their new sequence numbers, in order,
    /// are at least `watermark`), makes `watermark` durable, and drops every
    /// mark below it.
    async fn rotate_marks(
        &self,
        keys: Vec<(String, u64)>,
        watermark: u64,
    ) -> Result<Vec<u64>, StoreError>;

    /// Exclusive stores, read at open: after an unclean stop, the keys that
    /// were marked in flight, each with its highest token and the lowest
    /// token its marks were for; empty after a clean stop. `None` when the crashed run kept no marks (a store last
    /// used by a fencegate from before marks): then any key may have had a
    /// write in flight.
    fn in_flight_at_crash(&self) -> Option<Vec<CrashedKey>>;

    /// Exclusive stores, read at open: the key mapping the previous run
    /// recorded last ([`record_key_mapping`](Self::record_key_mapping)).
    /// The crashed run's marks name keys under that mapping; under another
    /// one the same resource has another key. `None`: none recorded.
    fn key_mapping_at_open(&self) -> Option<u64>;

    /// Exclusive stores: records durably, before it returns, the
    /// fingerprint of the key mapping that writes from now on are admitted
    /// under ([`KEY_MAPPING_MIXED`]: more than one may have writes in
    /// flight). Stores without in-flight marks ignore it.
    async fn record_key_mapping(&self, fingerprint: u64) -> Result<(), StoreError>;

    /// Exclusive stores: how many in-flight marks are durable now.
    fn in_flight_marks(&self) -> u64;

    /// Cross-replica admission, for shared stores, in one atomic step:
    /// refuse if the stored highest is above `lease.token` (`Stale`); raise
    /// it durably if the token is higher; register `lease` (its id chosen by
    /// the caller, so the caller can release it even if this call's answer
    /// is lost) expiring after `ttl` on the store's clock; answer `Granted`
    /// if no unexpired older-token lease is held by anyone, else `Busy`.
    /// Registering before checking makes the protocol safe: of two writers,
    /// the later one to register always sees the earlier one.
    /// Exclusive stores are never asked (the fence orders in-process).
    async fn acquire_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let _ = (key, lease, ttl);
        Err(StoreError::Unavailable("this store has no leases".into()))
    }

    /// Re-checks a `Busy` lease: `Stale` (and the lease removed) if a higher
    /// token took the key meanwhile, `Granted` once no older lease is held.
    async fn poll_lease(&self, key: &str, lease: &WriteLease) -> Result<LeaseOutcome, StoreError> {
        let _ = (key, lease);
        Err(StoreError::Unavailable("this store has no leases".into()))
    }

    /// Extends a granted lease to `ttl` from now on the store's clock,
    /// unless a higher token took the key: then `Stale`, and the lease is
    /// left in place (unlike [`poll_lease`](Self::poll_lease)), because
    /// writes admitted on it may still be in flight.
    async fn renew_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let _ = (key, lease, ttl);
        Err(StoreError::Unavailable("this store has no leases".into()))
    }

    /// Releases a lease. Best effort: a lease that is not released expires.
    /// Releasing a lease that was never registered, or already released, is
    /// harmless.
    async fn release_lease(&self, key: &str, lease: &WriteLease) -> Result<(), StoreError> {
        let _ = (key, lease);
        Ok(())
    }

    /// Lock service, in one atomic step: unless an unexpired lease holds
    /// `key`, raises its highest to one above every token it had (admitted
    /// or granted) and records lease `id` for `holder`, expiring after `ttl`;
    /// both durable before this returns. Of two concurrent claims on one
    /// key (from any replica), at most one is granted.
    async fn claim_lock(
        &self,
        key: &str,
        id: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let _ = (key, id, holder, ttl);
        Err(no_locks(self.kind()))
    }

    /// The unexpired lease holding `key`, if any.
    async fn read_lock(&self, key: &str) -> Result<Option<Lock>, StoreError> {
        let _ = key;
        Err(no_locks(self.kind()))
    }

    /// Extends lease `id` to `ttl` from now if it still holds `key`
    /// (unexpired); `None` otherwise: an expired or released lease is never
    /// revived.
    async fn renew_lock(
        &self,
        key: &str,
        id: &str,
        ttl: Duration,
    ) -> Result<Option<Lock>, StoreError> {
        let _ = (key, id, ttl);
        Err(no_locks(self.kind()))
    }

    /// Ends lease `id` on `key` if it still holds it (durably); `false` if
    /// it had expired or was released already.
    async fn release_lock(&self, key: &str, id: &str) -> Result<bool, StoreError> {
        let _ = (key, id);
        Err(no_locks(self.kind()))
    }

    /// Marks a new store as this deployment's (`fencegate init-store`), the
    /// one explicit step before first use: a shared store with no marker is
    /// never initialised silently, since a wiped store looks the same.
    /// Returns `true` if it marked the store, `false` if it was marked
    /// already (then nothing changes). The embedded store is created on
    /// open, and answers `false`.
    async fn initialise(&self) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// Why the store is refusing writes because it may have lost data
    /// (see `docs/stores.md`), if it is.
    fn amnesia(&self) -> Option<String> {
        None
    }

    /// For a store whose calls wait for replicas (Redis's `WAIT`): how
    /// many the last call waited for, how many confirmed it, and the calls
    /// that failed for too few. `None`
    /// where replication is not the store's to count (embedded, etcd's
    /// quorum, PostgreSQL's synchronous commit). A read, no call.
    fn replicas(&self) -> Option<Replicas> {
        None
    }

    /// An operator's confirmation that a store which lost data may be used
    /// again: fences this process knows are written back, and a new marker
    /// is recorded.
    async fn confirm_reset(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Removes a key's fence (an operator's reset after token inflation),
    /// durably; returns the highest it had. Stores that cannot do it safely
    /// refuse.
    async fn forget(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let _ = key;
        Err(StoreError::Unavailable(format!(
            "resetting a fence is not supported on the {} store",
            self.kind()
        )))
    }

    /// For a store that spreads its keys over shards (a Redis Cluster):
    /// each shard with its groups' health, each group pinged now (its
    /// marker checked when due), so that an operator sees which shard
    /// fails and that the others serve. `None` for a store of one part.
    async fn shards(&self) -> Option<Vec<Shard>> {
        None
    }

    /// Cheap liveness probe for `/readyz`: `Ok` if a write could be
    /// persisted now, as far as the store can tell.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Runs the data-loss check (a shared store's marker) if it is due,
    /// without a probe of its own: the server's heartbeat calls it often,
    /// so that idle replicas check too. Stores without one have nothing
    /// to do.
    async fn check_marker(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Flushes and records a clean stop, so the next start needs no
    /// crash-recovery wait. Called once, after in-flight writes drained.
    async fn close_clean(&self) -> Result<(), StoreError>;
}
