//! The store's latency in `fencegate_store_latency_seconds`: a decorator
//! around any engine, so that every engine is measured the same way and no
//! engine carries metrics code of its own.

use std::sync::Arc;

use super::api::{
    Advance, Claim, CrashedKey, FenceStore, LeaseOutcome, Lock, StartState, StoreError, WriteLease,
};
use crate::metrics::Metrics;

/// A [`FenceStore`] decorator that records each
/// operation's latency in `fencegate_store_latency_seconds`.
pub struct InstrumentedStore {
    inner: Arc<dyn FenceStore>,
    metrics: Arc<Metrics>,
}

impl InstrumentedStore {
    pub fn new(inner: Arc<dyn FenceStore>, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }

    fn observe(&self, op: &str, started: std::time::Instant) {
        self.metrics
            .store_latency
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
    }
}

#[async_trait::async_trait]
impl FenceStore for InstrumentedStore {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn exclusive(&self) -> bool {
        self.inner.exclusive()
    }
    fn start_state(&self) -> StartState {
        self.inner.start_state()
    }
    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.highest(key).await;
        self.observe("highest", t);
        r
    }
    async fn confirm_highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.confirm_highest(key).await;
        self.observe("confirm_highest", t);
        r
    }
    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.advance(key, token).await;
        self.observe("advance", t);
        r
    }
    async fn advance_marked(&self, key: &str, token: u64) -> Result<(Advance, u64), StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.advance_marked(key, token).await;
        self.observe("advance", t);
        r
    }
    async fn mark_in_flight(&self, key: &str, token: u64) -> Result<u64, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.mark_in_flight(key, token).await;
        self.observe("mark_in_flight", t);
        r
    }
    fn next_mark(&self) -> u64 {
        self.inner.next_mark()
    }
    async fn rotate_marks(
        &self,
        keys: Vec<(String, u64)>,
        watermark: u64,
    ) -> Result<Vec<u64>, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.rotate_marks(keys, watermark).await;
        self.observe("rotate_marks", t);
        r
    }
    fn in_flight_at_crash(&self) -> Option<Vec<CrashedKey>> {
        self.inner.in_flight_at_crash()
    }
    fn key_mapping_at_open(&self) -> Option<u64> {
        self.inner.key_mapping_at_open()
    }
    async fn record_key_mapping(&self, fingerprint: u64) -> Result<(), StoreError> {
        self.inner.record_key_mapping(fingerprint).await
    }
    fn in_flight_marks(&self) -> u64 {
        self.inner.in_flight_marks()
    }
    async fn acquire_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: std::time::Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.acquire_lease(key, lease, ttl).await;
        self.observe("acquire_lease", t);
        r
    }
    async fn poll_lease(&self, key: &str, lease: &WriteLease) -> Result<LeaseOutcome, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.poll_lease(key, lease).await;
        self.observe("poll_lease", t);
        r
    }
    async fn renew_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: std::time::Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.renew_lease(key, lease, ttl).await;
        self.observe("renew_lease", t);
        r
    }
    async fn release_lease(&self, key: &str, lease: &WriteLease) -> Result<(), StoreError> {
        self.inner.release_lease(key, lease).await
    }
    async fn claim_lock(
        &self,
        key: &str,
        id: &str,
        holder: &str,
        ttl: std::time::Duration,
    ) -> Result<Claim, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.claim_lock(key, id, holder, ttl).await;
        self.observe("claim_lock", t);
        r
    }
    async fn read_lock(&self, key: &str) -> Result<Option<Lock>, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.read_lock(key).await;
        self.observe("read_lock", t);
        r
    }
    async fn renew_lock(
        &self,
        key: &str,
        id: &str,
        ttl: std::time::Duration,
    ) -> Result<Option<Lock>, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.renew_lock(key, id, ttl).await;
        self.observe("renew_lock", t);
        r
    }
    async fn release_lock(&self, key: &str, id: &str) -> Result<bool, StoreError> {
        let t = std::time::Instant::now();
        let r = self.inner.release_lock(key, id).await;
        self.observe("release_lock", t);
        r
    }
    fn amnesia(&self) -> Option<String> {
        self.inner.amnesia()
    }
    fn replicas(&self) -> Option<crate::store::api::Replicas> {
        self.inner.replicas()
    }
    async fn shards(&self) -> Option<Vec<crate::store::api::Shard>> {
        self.inner.shards().await
    }
    async fn confirm_reset(&self) -> Result<(), StoreError> {
        self.inner.confirm_reset().await
    }
    async fn initialise(&self) -> Result<bool, StoreError> {
        self.inner.initialise().await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
    async fn check_marker(&self) -> Result<(), StoreError> {
        self.inner.check_marker().await
    }
    async fn forget(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.inner.forget(key).await
    }
    async fn close_clean(&self) -> Result<(), StoreError> {
        self.inner.close_clean().await
    }
}
