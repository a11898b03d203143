//! The [`FenceStore`] contract over any [`SharedStore`]: each call
//! checked against what this replica witnessed before it is answered.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;

use crate::store::api::{
    Advance, Claim, CrashedKey, FenceStore, LeaseOutcome, Lock, StartState, StoreError, WriteLease,
};

use super::backend::*;
use super::store::*;

#[async_trait]
impl<B: Backend> FenceStore for SharedStore<B> {
    fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    fn exclusive(&self) -> bool {
        false
    }

    fn start_state(&self) -> StartState {
        // In-flight writes of a crashed replica hold leases in the store
        // until they expire: no local recovery window is needed.
        StartState::Clean
    }

    // Every call a request waits on is `bounded` by `store_timeout` as a
    // whole (the lock service's through `lock`, leases' through
    // `guarded`).

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.bounded(self.backend.highest(key)).await
    }

    async fn confirm_highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.bounded(async {
            let (h, sent) = self.checked(self.backend.highest(key)).await?;
            if let Some(h) = h {
                self.witness(key, sent, Some(h), None).await?;
            }
            Ok(h)
        })
        .await
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        self.bounded(async {
            let (a, sent) = self.checked(self.backend.advance(key, token)).await?;
            match a {
                Advance::Stale { highest } => self.witness(key, sent, Some(highest), None).await?,
                Advance::Raised { .. } | Advance::Equal => {
                    self.witness(key, sent, None, Some(token)).await?
                }
            }
            Ok(a)
        })
        .await
    }

    // In-flight marks are for exclusive stores; a shared store keeps
    // leases instead, and the fence never asks it for marks.
    async fn advance_marked(&self, key: &str, token: u64) -> Result<(Advance, u64), StoreError> {
        let _ = (key, token);
        Err(no_marks())
    }

    async fn mark_in_flight(&self, key: &str, token: u64) -> Result<u64, StoreError> {
        let _ = (key, token);
        Err(no_marks())
    }

    fn next_mark(&self) -> u64 {
        0
    }

    async fn rotate_marks(
        &self,
        keys: Vec<(String, u64)>,
        watermark: u64,
    ) -> Result<Vec<u64>, StoreError> {
        let _ = (keys, watermark);
        Err(no_marks())
    }

    fn in_flight_at_crash(&self) -> Option<Vec<CrashedKey>> {
        Some(Vec::new())
    }

    fn key_mapping_at_open(&self) -> Option<u64> {
        None
    }

    async fn record_key_mapping(&self, fingerprint: u64) -> Result<(), StoreError> {
        let _ = fingerprint;
        Ok(())
    }

    fn in_flight_marks(&self) -> u64 {
        0
    }

    async fn acquire_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.lease_ttl_ms.store(
            u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let req = Acquire {
            key: key.to_string(),
            lease: lease.clone(),
            ttl,
        };
        // On a witness failure the caller's guard releases the lease.
        self.guarded(key, self.acquires.call(key, req)).await
    }

    async fn poll_lease(&self, key: &str, lease: &WriteLease) -> Result<LeaseOutcome, StoreError> {
        let ttl = Duration::from_millis(self.lease_ttl_ms.load(Ordering::Relaxed));
        self.guarded(key, self.backend.poll(key, lease, ttl)).await
    }

    async fn renew_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.guarded(key, self.backend.renew(key, lease, ttl)).await
    }

    async fn release_lease(&self, key: &str, lease: &WriteLease) -> Result<(), StoreError> {
        // Batched per lease (a lease released twice at once is sent once
        // per batch).
        // Not bounded: only background tasks release, and a release
        // abandoned while queued would never be sent (its lease would hold
        // its key until its TTL on every replica).
        self.releases
            .call(&lease.id, (key.to_string(), lease.clone()))
            .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.bounded(async {
            self.backend.ping().await?;
            self.ensure().await
        })
        .await
    }

    async fn check_marker(&self) -> Result<(), StoreError> {
        let r = self.ensure().await;
        if let Err(StoreError::Amnesia(_)) = &r {
            self.trip_latched(false).await;
        }
        r
    }

    async fn claim_lock(
        &self,
        key: &str,
        id: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        match self.lock(key, LockCall::Claim { id, holder, ttl }).await? {
            LockReply::Claim(c) => Ok(c),
            other => Err(wrong_reply(other)),
        }
    }

    async fn read_lock(&self, key: &str) -> Result<Option<Lock>, StoreError> {
        match self.lock(key, LockCall::Read).await? {
            LockReply::Lock(l) => Ok(l),
            other => Err(wrong_reply(other)),
        }
    }

    async fn renew_lock(
        &self,
        key: &str,
        id: &str,
        ttl: Duration,
    ) -> Result<Option<Lock>, StoreError> {
        match self.lock(key, LockCall::Renew { id, ttl }).await? {
            LockReply::Lock(l) => Ok(l),
            other => Err(wrong_reply(other)),
        }
    }

    async fn release_lock(&self, key: &str, id: &str) -> Result<bool, StoreError> {
        match self.lock(key, LockCall::Release { id }).await? {
            LockReply::Released(r) => Ok(r),
            other => Err(wrong_reply(other)),
        }
    }

    async fn initialise(&self) -> Result<bool, StoreError> {
        self.backend.ping().await?;
        if self.backend.read_marker().await?.is_some() {
            return Ok(false);
        }
        let m = self.backend.create_marker(&crate::id::unique_id()).await?;
        // `init-store` says it once for the whole store (a cluster has a
        // marker per group).
        tracing::debug!(store = self.backend.kind(), epoch = %m.epoch, "fence store initialised");
        Ok(true)
    }

    async fn close_clean(&self) -> Result<(), StoreError> {
        self.acquires.settle(SETTLE).await;
        self.releases.settle(SETTLE).await;
        Ok(())
    }

    fn amnesia(&self) -> Option<String> {
        self.guard.lock().expect("guard lock").amnesia.clone()
    }

    fn replicas(&self) -> Option<crate::store::api::Replicas> {
        self.backend.replicas()
    }

    async fn confirm_reset(&self) -> Result<(), StoreError> {
        // Not while a marker check runs: it would record the old marker
        // after the new one.
        let _one = self.check_lock.lock().await;
        self.confirm_reset_checked().await
    }
}
