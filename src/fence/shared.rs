//! Admission on a shared store (Redis, PostgreSQL, etcd): a write lease
//! that covers the write's whole deadline, this replica's registration per
//! key in use (`active.rs`), and their release.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{FenceStore, LeaseOutcome, StoreError, WriteLease};

use super::active::{Active, Checked, Granted, Local, Release, CHECK_EVERY};
use super::error::*;
use super::gate::*;
use super::state::*;

/// Whether a shared-store lease whose clock started no earlier than `sent`
/// and that lasts `ttl` covers a write that ends by `deadline`, its cut
/// included ([`CUT_GRACE`]): the one rule every admission on a shared
/// store follows (a registration's later writes too: `active.rs`).
pub(crate) fn lease_covers(sent: Instant, ttl: Duration, deadline: Instant) -> bool {
    deadline + CUT_GRACE <= sent + ttl
}

/// The pause between attempts at a lease release the store did not answer.
pub(super) const RELEASE_RETRY: Duration = Duration::from_millis(200);

/// A lease that may be registered but is not granted yet; released on drop
/// unless disarmed.
pub(super) struct PendingLease {
    pub(super) releases: tokio_util::task::TaskTracker,
    pub(super) store: Arc<dyn FenceStore>,
    pub(super) key: Arc<str>,
    pub(super) lease: Option<WriteLease>,
    /// An acquire whose answer never came may still be applied after a
    /// first release (it was queued on the server, or went over another
    /// pooled connection): release once more after this long.
    pub(super) again_after: Duration,
}

impl PendingLease {
    pub(super) fn disarm(mut self) {
        self.lease = None;
    }
}

impl Drop for PendingLease {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            let (store, key, again) = (self.store.clone(), self.key.clone(), self.again_after);
            self.releases.spawn(async move {
                let _ = store.release_lease(&key, &lease).await;
                tokio::time::sleep(again).await;
                let _ = store.release_lease(&key, &lease).await;
            });
        }
    }
}

/// A check of a registration under way ([`Local::Check`]); if the
/// admission is abandoned mid-call (the client hung up), the registration
/// is closed rather than left marked as checking.
pub(super) struct Check<'a> {
    pub(super) fence: &'a Arc<Fence>,
    pub(super) key: Arc<str>,
    pub(super) active: Option<Arc<Active>>,
}

impl Drop for Check<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.active.take() {
            // No grant admits nothing: always `Refused`.
            if let Checked::Refused(release) = a.checked(None, Duration::ZERO) {
                self.fence.release_active(&self.key, &a, release);
            }
        }
    }
}

impl Fence {
    /// Shared stores: releases the registrations whose last write ended
    /// and that stayed idle for the rest of their check period, a batch
    /// every half period, until `stop`; then the rest at once.
    pub(super) async fn sweep_registrations(
        self: Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        *self.idle.lock().expect("idle lock") = Some(Vec::new());
        let mut tick = tokio::time::interval(CHECK_EVERY / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let stopping = tokio::select! {
                _ = stop.cancelled() => true,
                _ = tick.tick() => false,
            };
            let now = Instant::now();
            let due: Vec<_> = {
                let mut idle = self.idle.lock().expect("idle lock");
                let queue = if stopping {
                    idle.take()
                } else {
                    idle.as_mut().map(std::mem::take)
                }
                .unwrap_or_default();
                let (due, later): (Vec<_>, Vec<_>) = queue
                    .into_iter()
                    .partition(|(_, _, at)| stopping || *at <= now);
                if let Some(q) = idle.as_mut() {
                    q.extend(later);
                }
                due
            };
            for (key, a, _) in due {
                let what = a.idle();
                self.release_active(&key, &a, what);
            }
            if stopping {
                return;
            }
        }
    }

    /// Admission on a shared store: the store raises, registers a lease and
    /// checks for older leases atomically (see
    /// [`FenceStore::acquire_lease`]); this polls until older writes, on any
    /// replica, are released or their leases expired. A write of the token
    /// this replica already has registered on the key goes on that
    /// registration instead, without a store call while its confirmation is
    /// fresh (see [`active`]).
    pub(super) async fn admit_shared(
        self: &Arc<Self>,
        key: Arc<str>,
        token: u64,
        wait_until: Instant,
        upstream_timeout: Duration,
        raised: &mut Option<Raised>,
    ) -> Result<Permit, FenceError> {
        let lasts = upstream_timeout + CUT_GRACE;
        let existing = self.actives.get(&key).map(|e| e.value().clone());
        if let Some(a) = existing {
            if token > a.token {
                // Newer here: the older token stops being admitted on its
                // registration now (the newer write waits for it below).
                let release = a.close();
                self.release_active(&key, &a, release);
            }
            // Writes that find a check under way wait for its answer (a
            // little) rather than each asking the store on its own.
            let mut waits = 0;
            loop {
                let (local, now) = a.try_admit(token, lasts);
                match local {
                    Local::Wait if waits < 2 => {
                        waits += 1;
                        let _ = tokio::time::timeout(CHECK_EVERY, a.changed.notified()).await;
                        continue;
                    }
                    Local::Admitted => {
                        return Ok(self.active_permit(key, token, a, now + upstream_timeout))
                    }
                    Local::AdmittedRefresh { renew } => {
                        let (fence, k, reg) = (self.clone(), key.clone(), a.clone());
                        self.releases.spawn(async move {
                            let granted = fence.confirm(&k, &reg, renew).await;
                            let release = reg.refreshed(granted.ok().flatten());
                            fence.release_active(&k, &reg, release);
                        });
                        return Ok(self.active_permit(key, token, a, now + upstream_timeout));
                    }
                    Local::Check { renew } => {
                        let mut check = Check {
                            fence: self,
                            key: key.clone(),
                            active: Some(a.clone()),
                        };
                        let confirmed = self.confirm(&key, &a, renew).await;
                        check.active = None;
                        let granted = confirmed.as_ref().ok().copied().flatten();
                        match a.checked(granted, lasts) {
                            Checked::Admitted(now) => {
                                return Ok(self.active_permit(
                                    key,
                                    token,
                                    a,
                                    now + upstream_timeout,
                                ))
                            }
                            Checked::Refused(release) => self.release_active(&key, &a, release),
                        }
                        // Taken by a newer token, or a store error: say so.
                        // Otherwise (the registration cannot cover this write,
                        // or its answer came too late) the store path decides.
                        confirmed?;
                    }
                    Local::No | Local::Wait => {}
                }
                break;
            }
        }
        // The lease's identity exists, and its release is armed, before the
        // acquire is sent: whatever ends this admission (a stale answer, an
        // error, a store timeout after the store applied it, the client
        // hanging up mid-call) releases it, so no orphan holds the key for a
        // whole lease TTL.
        let lease = WriteLease {
            id: crate::id::unique_id(),
            token,
        };
        let pending = PendingLease {
            releases: self.releases.clone(),
            store: self.store.clone(),
            key: key.clone(),
            lease: Some(lease.clone()),
            again_after: self.lease_margin,
        };
        let mut sent = Instant::now();
        let mut outcome = match self.store.acquire_lease(&key, &lease, self.lease_ttl).await {
            Ok(o) => o,
            // Refused before anything was sent: nothing to release. (Not
            // so for amnesia: it may be found in the acquire's answer.)
            Err(e @ StoreError::Uninitialised) => {
                pending.disarm();
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        // The wait ends by `wait_until`, at most an upstream timeout away:
        // shorter than any older lease's TTL, which is the longest upstream
        // timeout plus the store's margin.
        let mut pause = Duration::from_millis(2);
        let mut waiting = None;
        loop {
            match outcome {
                LeaseOutcome::Stale { highest } => {
                    // The store registered nothing (or removed it).
                    pending.disarm();
                    return Err(FenceError::Stale { token, highest });
                }
                LeaseOutcome::Granted(lease) => {
                    // The lease counts from before the acquire (or poll)
                    // was sent; a slow answer, or a marker check on a new
                    // connection after it, may have used up the slack:
                    // then it cannot cover the write, which is refused
                    // (and the lease released, as `pending` is armed).
                    let now = Instant::now();
                    if !lease_covers(sent, self.lease_ttl, now + upstream_timeout) {
                        return Err(FenceError::Store(StoreError::Unavailable(format!(
                            "the store took {:?} to grant the write: its lease could end before the write's deadline",
                            now - sent
                        ))));
                    }
                    pending.disarm();
                    // The key's registration here, if it has none (or a
                    // closed one): later writes of the token go on it.
                    let mut own = Some(lease);
                    let active = match self.actives.entry(key.clone()) {
                        dashmap::Entry::Occupied(o) if !o.get().is_closed() => None,
                        entry => {
                            let a = Active::new(
                                token,
                                own.take().expect("set above"),
                                sent,
                                self.lease_ttl,
                            );
                            entry.insert(a.clone());
                            Some(a)
                        }
                    };
                    if active.is_some() {
                        *raised = Some(Raised::Registered {
                            at_ms: crate::clock::wall_ms(),
                        });
                    }
                    return Ok(Permit {
                        fence: self.clone(),
                        gate: None,
                        key,
                        token,
                        lease: own,
                        active,
                        deadline: now + upstream_timeout,
                        repolled: Default::default(),
                        waited_out: false,
                    });
                }
                LeaseOutcome::Busy { lease, retry_after } => {
                    // Our own limit first: an older write on some replica
                    // may outlive it, and this one must not go ahead of it.
                    if Instant::now() >= wait_until {
                        return Err(FenceError::Busy {
                            retry_after: Duration::from_secs(1),
                        });
                    }
                    waiting.get_or_insert_with(|| Waiting::new(&self.waiting));
                    tokio::time::sleep_until(
                        (Instant::now() + retry_after.min(pause)).min(wait_until),
                    )
                    .await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                    sent = Instant::now();
                    outcome = self.store.poll_lease(&key, &lease).await?;
                }
            }
        }
    }

    /// Asks the store whether the registration `a` still holds: a read of
    /// the key's highest, or with `renew` a renewal of its lease (which
    /// leaves the lease in place if the key was taken). `Ok(None)`: it does
    /// not (the caller closes it); `Err(Stale)` when a higher token took
    /// the key.
    pub(super) async fn confirm(
        &self,
        key: &str,
        a: &Active,
        renew: bool,
    ) -> Result<Option<Granted>, FenceError> {
        let sent = Instant::now();
        let token = a.token;
        if renew {
            let renewed = self.store.renew_lease(key, &a.lease, self.lease_ttl).await;
            if renewed.is_err() {
                a.renew_lost();
            }
            return match renewed? {
                LeaseOutcome::Granted(_) => Ok(Some(Granted {
                    sent,
                    ttl: Some(self.lease_ttl),
                })),
                LeaseOutcome::Stale { highest } => Err(FenceError::Stale { token, highest }),
                LeaseOutcome::Busy { .. } => Ok(None),
            };
        }
        match self.store.confirm_highest(key).await? {
            Some(h) if h == token => Ok(Some(Granted { sent, ttl: None })),
            Some(highest) if highest > token => Err(FenceError::Stale { token, highest }),
            _ => Ok(None),
        }
    }

    /// A permit for a write admitted on the key's registration `a` (already
    /// counted in it), to end by `deadline`.
    pub(super) fn active_permit(
        self: &Arc<Self>,
        key: Arc<str>,
        token: u64,
        a: Arc<Active>,
        deadline: Instant,
    ) -> Permit {
        Permit {
            fence: self.clone(),
            gate: None,
            key,
            token,
            lease: None,
            active: Some(a),
            deadline,
            repolled: Default::default(),
            waited_out: false,
        }
    }

    /// Carries out what a registration said about its lease: release it now
    /// (and forget it here), or look again when it has been idle a while.
    pub(super) fn release_active(self: &Arc<Self>, key: &Arc<str>, a: &Arc<Active>, what: Release) {
        let twice = match what {
            Release::Keep => return,
            Release::Now { twice } => twice,
            Release::At(at) => {
                if let Some(queue) = self.idle.lock().expect("idle lock").as_mut() {
                    queue.push((key.clone(), a.clone(), at));
                    return;
                }
                // Nobody sweeps (the fence is stopping, or runs without its
                // background task): no lingering.
                match a.idle() {
                    Release::Now { twice } => twice,
                    _ => return,
                }
            }
        };
        self.actives.remove_if(key, |_, v| Arc::ptr_eq(v, a));
        self.spawn_release(key.clone(), a.lease.clone(), twice);
    }

    /// Releases a lease in the background. A store that cannot answer (it
    /// is restarting, failing over, or its replicas cannot confirm) is
    /// asked again until the lease would have expired anyway: an
    /// unreleased lease holds newer writes to the key until then. `twice`: a poll or
    /// renewal of the lease may still be on its way and bring it back, so
    /// it is released once more after the store's margin.
    pub(super) fn spawn_release(&self, key: Arc<str>, lease: WriteLease, twice: bool) {
        let store = self.store.clone();
        let again = twice.then_some(self.lease_margin);
        let retry_for = self.lease_ttl;
        self.releases.spawn(async move {
            let give_up = Instant::now() + retry_for;
            while let Err(e) = store.release_lease(&key, &lease).await {
                if Instant::now() + RELEASE_RETRY > give_up {
                    tracing::debug!(error = %e, "lease release failed; it will expire");
                    break;
                }
                tokio::time::sleep(RELEASE_RETRY).await;
            }
            if let Some(again) = again {
                tokio::time::sleep(again).await;
                let _ = store.release_lease(&key, &lease).await;
            }
        });
    }

    /// After a shared store raised `key` to `token` outside admission (a
    /// fence-ahead raise, a lease grant): this replica's registration of an
    /// older token is closed, and the answer waits out the time for which
    /// other replicas may still admit an older token on theirs (see
    /// [`active`]); from then on none does.
    pub(super) async fn follow_shared_raise(self: &Arc<Self>, key: &str, token: u64) {
        let existing = self.actives.get(key).map(|e| e.value().clone());
        if let Some(a) = existing.filter(|a| a.token < token) {
            let release = a.close();
            self.release_active(&Arc::from(key), &a, release);
        }
        tokio::time::sleep(CHECK_EVERY).await;
    }

    /// [`overtaken`](Self::overtaken) on a shared store: asks the store.
    pub(super) async fn overtaken_shared(
        &self,
        permit: &Permit,
    ) -> Result<Option<u64>, FenceError> {
        if permit.active.is_some() {
            // A read, not a poll: a poll that finds the key taken removes
            // the lease, which the registration's other writes still need.
            return Ok(self
                .store
                .highest(&permit.key)
                .await?
                .filter(|h| *h > permit.token));
        }
        let Some(lease) = &permit.lease else {
            return Ok(None);
        };
        // A poll re-registers the lease: one still on its way when the
        // permit's release lands would bring it back.
        permit
            .repolled
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(match self.store.poll_lease(&permit.key, lease).await? {
            LeaseOutcome::Stale { highest } => Some(highest),
            _ => None,
        })
    }
}
