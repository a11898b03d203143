//! The lock service's side of the fence: a grant raises the key's highest
//! token like a fence-ahead raise, so every copy of that highest in this
//! process (the gate and the cache of the embedded store; the registrations
//! of a shared store) must follow it before the grant is answered. Else a
//! write of the previous holder could still be admitted as "equal" from
//! memory after its successor got its token.

use std::sync::Arc;
use std::time::Duration;

use super::error::{joined, FenceError};
use super::state::Fence;
use crate::store::{Claim, Lock};

impl Fence {
    /// Grants a lease on `key` unless an unexpired one holds it (see
    /// [`crate::store::FenceStore::claim_lock`]). Once this returns
    /// `Granted`, no write of a lower token is admitted here, and (shared
    /// stores) none on another replica either.
    pub async fn claim(
        self: &Arc<Self>,
        key: &str,
        id: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Claim, FenceError> {
        if !self.store.exclusive() {
            let claim = self.store.claim_lock(key, id, holder, ttl).await?;
            // Without a registration on the key when it was granted, no
            // replica can admit an older token on one afterwards (a new
            // registration of an older token would be stale): no wait.
            if let Claim::Granted {
                token,
                registered: true,
            } = claim
            {
                self.follow_shared_raise(key, token).await;
            }
            return Ok(claim);
        }
        let key: Arc<str> = Arc::from(key);
        let gate = self.gate(&key);
        let fence = self.clone();
        let (id, holder) = (id.to_string(), holder.to_string());
        // On a task of its own, like an advance: a client that hangs up must
        // not leave a committed grant unseen by the gate.
        let task = tokio::spawn(async move {
            let claim = fence.store.claim_lock(&key, &id, &holder, ttl).await;
            if let Ok(Claim::Granted { token, .. }) = &claim {
                let mut st = gate.state.lock().expect("gate lock");
                let max = st.highest.map_or(*token, |h| h.max(*token));
                st.highest = Some(max);
                fence.cache.raise(&key, max, None);
            }
            // Queued older writes must now see that they are stale.
            gate.changed.notify_waiters();
            drop(gate);
            fence.release_gate(&key);
            claim
        });
        joined(task.await)
    }

    /// The unexpired lease on `key`, if any.
    pub async fn read_lock(&self, key: &str) -> Result<Option<Lock>, FenceError> {
        Ok(self.store.read_lock(key).await?)
    }

    /// Extends lease `id` on `key`; `None` when it expired or was released.
    pub async fn renew_lock(
        &self,
        key: &str,
        id: &str,
        ttl: Duration,
    ) -> Result<Option<Lock>, FenceError> {
        Ok(self.store.renew_lock(key, id, ttl).await?)
    }

    /// Ends lease `id` on `key`; `false` when it was gone already.
    pub async fn release_lock(&self, key: &str, id: &str) -> Result<bool, FenceError> {
        Ok(self.store.release_lock(key, id).await?)
    }
}
