//! What an engine implements ([`Backend`]: its server's protocol and
//! nothing more) and the helpers engines share to read their answers.

use std::time::Duration;

use async_trait::async_trait;

use crate::store::api::{Advance, Claim, LeaseOutcome, Lock, StoreError, WriteLease};

use super::marker::*;

/// One server protocol. Every method is one atomic operation on the server.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    fn kind(&self) -> &'static str;
    /// `store_timeout`: what one of its calls may take, each of its
    /// server round trips, and a caller's whole wait on the store
    /// (`SharedStore::bounded`).
    fn timeout(&self) -> Duration;
    /// Changes every time a new connection (session) to the server is made,
    /// so the marker is checked again after each reconnect.
    fn session(&self) -> u64;
    /// See [`crate::store::api::FenceStore::replicas`].
    fn replicas(&self) -> Option<crate::store::api::Replicas> {
        None
    }
    /// Where a store's keys are spread over several backends (a cluster's
    /// groups): this one's name, for the log lines about it.
    fn group(&self) -> Option<&str> {
        None
    }
    /// Where the store spreads keys over nodes: the node serving this
    /// backend's keys now (`host:port`), to name it to an operator. `None`
    /// elsewhere, or while it cannot be told.
    async fn serving(&self) -> Option<String> {
        None
    }
    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError>;
    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError>;
    /// Admits several writes in one round trip (keys distinct): each answer
    /// is what the acquire alone would have got, as if they ran one after
    /// another. The outer error fails them all (none, some or all may
    /// have been applied).
    async fn acquire_many(
        &self,
        reqs: &[Acquire],
    ) -> Result<Vec<Result<LeaseOutcome, StoreError>>, StoreError>;
    async fn poll(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError>;
    /// Extends a granted lease to `ttl` from now, unless a higher token
    /// took the key (`Stale`: the lease is left as it is, since writes
    /// admitted on it may still be in flight). `Granted` otherwise.
    async fn renew(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError>;
    /// Removes several leases (by key and lease) in one round trip; a lease
    /// already gone is no error.
    async fn release_many(&self, leases: &[(String, WriteLease)]) -> Result<(), StoreError>;
    async fn ping(&self) -> Result<(), StoreError>;
    /// One lock-service operation on `key`, atomically (see
    /// [`FenceStore::claim_lock`](crate::store::api::FenceStore::claim_lock) and its kin). May run twice on a broken
    /// connection: a claim sent again finds its own lease and answers it
    /// granted.
    async fn lock(&self, key: &str, call: LockCall<'_>) -> Result<LockReply, StoreError>;
    async fn read_marker(&self) -> Result<Option<Marker>, StoreError>;
    /// Creates the marker if none exists; returns the stored one.
    async fn create_marker(&self, epoch: &str) -> Result<Marker, StoreError>;
    /// Adds one to the marker's sequence; returns the new marker (`None` if
    /// the marker is gone).
    async fn bump_marker(&self) -> Result<Option<Marker>, StoreError>;
    /// Replaces the marker with a new epoch (after an operator confirmed a
    /// reset), but only if it is still `expected` (`None`: absent); returns
    /// the marker stored afterwards, ours or a concurrent confirmer's.
    async fn replace_marker(
        &self,
        expected: Option<&Marker>,
        epoch: &str,
    ) -> Result<Marker, StoreError>;
}

/// A lock-service operation ([`Backend::lock`]).
#[derive(Debug, Clone, Copy)]
pub enum LockCall<'a> {
    Claim {
        id: &'a str,
        holder: &'a str,
        ttl: Duration,
    },
    Read,
    Renew {
        id: &'a str,
        ttl: Duration,
    },
    Release {
        id: &'a str,
    },
}

impl LockCall<'_> {
    /// The operation's name, lease id, holder and TTL (ms) as scripts and
    /// functions take them.
    pub fn args(&self) -> (&'static str, &str, &str, u64) {
        let ms = |t: &Duration| crate::clock::millis(*t).max(1);
        match self {
            LockCall::Claim { id, holder, ttl } => ("claim", id, holder, ms(ttl)),
            LockCall::Read => ("read", "", "", 0),
            LockCall::Renew { id, ttl } => ("renew", id, "", ms(ttl)),
            LockCall::Release { id } => ("release", id, "", 0),
        }
    }
}

/// The answer to a [`LockCall`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockReply {
    Claim(Claim),
    Lock(Option<Lock>),
    Released(bool),
}

/// A lock answer as Redis's script and PostgreSQL's function give it, a
/// list of text: `granted T R` (R: `1` if a write registration was held on
/// the key, else `0`), `held ID T HOLDER MS`, `exhausted`, `lock ID
/// T HOLDER MS`, `released` or `none`.
pub fn lock_reply(
    engine: &str,
    call: &LockCall<'_>,
    parts: &[String],
) -> Result<LockReply, StoreError> {
    let bad = || StoreError::Unavailable(format!("{engine}: unexpected lease answer {parts:?}"));
    let lock = || -> Result<Lock, StoreError> {
        match parts {
            [_, id, token, holder, left] => Ok(Lock {
                id: id.clone(),
                token: stored_token(engine, token)?,
                holder: holder.clone(),
                expires_in: Duration::from_millis(left.parse::<u64>().map_err(|_| bad())?),
            }),
            _ => Err(bad()),
        }
    };
    let status = parts.first().map(String::as_str).unwrap_or("");
    Ok(match (call, status) {
        (LockCall::Claim { .. }, "granted") => LockReply::Claim(Claim::Granted {
            token: stored_token(engine, parts.get(1).ok_or_else(bad)?)?,
            // Absent (an older answer): assume a registration.
            registered: parts.get(2).is_none_or(|r| r != "0"),
        }),
        (LockCall::Claim { .. }, "held") => LockReply::Claim(Claim::Held(lock()?)),
        (LockCall::Claim { .. }, "exhausted") => LockReply::Claim(Claim::Exhausted),
        (LockCall::Read | LockCall::Renew { .. }, "lock") => LockReply::Lock(Some(lock()?)),
        (LockCall::Read | LockCall::Renew { .. }, "none") => LockReply::Lock(None),
        (LockCall::Release { .. }, "released") => LockReply::Released(true),
        (LockCall::Release { .. }, "none") => LockReply::Released(false),
        _ => return Err(bad()),
    })
}

/// One admission in a batch ([`Backend::acquire_many`]).
#[derive(Debug, Clone)]
pub struct Acquire {
    pub key: String,
    pub lease: WriteLease,
    pub ttl: Duration,
}

/// A token as a store wrote it (decimal text); anything else is a store
/// fault, reported as unavailable.
pub fn stored_token(engine: &str, v: &str) -> Result<u64, StoreError> {
    v.parse().map_err(|_| {
        StoreError::Unavailable(format!(
            "{engine}: unexpected token value {v:?} in the store"
        ))
    })
}

/// The answer of an advance script or function as (status, value):
/// `stale` with the highest, `equal`, or `raised` with the previous highest
/// (absent, or empty text, for a new key).
pub fn advance_answer(
    engine: &str,
    status: &str,
    value: Option<&str>,
) -> Result<Advance, StoreError> {
    let value = value.filter(|v| !v.is_empty());
    Ok(match status {
        "stale" => Advance::Stale {
            highest: stored_token(engine, value.unwrap_or(""))?,
        },
        "equal" => Advance::Equal,
        _ => Advance::Raised {
            previous: value.map(|v| stored_token(engine, v)).transpose()?,
        },
    })
}

/// The admission answer scripts and functions return as (status, value):
/// `stale` with the highest, `busy`, `granted`, or `lost` (the fence
/// vanished while a write waited on it: lost data).
pub fn lease_answer(
    engine: &str,
    status: &str,
    value: &str,
    lease: WriteLease,
) -> Result<LeaseOutcome, StoreError> {
    match status {
        "stale" => Ok(LeaseOutcome::Stale {
            highest: stored_token(engine, value)?,
        }),
        "busy" => Ok(busy(lease)),
        "granted" => Ok(LeaseOutcome::Granted(lease)),
        "lost" => Err(StoreError::Amnesia(
            "a fence vanished while a write was waiting on it".into(),
        )),
        other => Err(StoreError::Unavailable(format!(
            "{engine}: unexpected answer {other}"
        ))),
    }
}

/// An older lease is held: poll again shortly.
pub fn busy(lease: WriteLease) -> LeaseOutcome {
    LeaseOutcome::Busy {
        lease,
        retry_after: Duration::from_millis(5),
    }
}
