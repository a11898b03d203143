//! [`SharedStore`]: a backend with amnesia detection around it: the
//! marker checked per session, highest tokens witnessed per key, the
//! latch that refuses writes until `confirm-reset`, batching of leases.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;

use crate::store::api::{Claim, LeaseOutcome, StoreError, WriteLease};
use crate::store::batch::{Batcher, Run};

use super::backend::*;
use super::marker::*;

/// `--accept-store-reset`, taken for one confirmation: it is spent only
/// when the confirmation completes (the guard is forgotten then). A
/// confirmation that fails, or is abandoned at the caller's bound on the
/// store (`SharedStore::bounded`), puts it back for the next check.
struct AcceptTaken<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for AcceptTaken<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// How often the marker is re-read even without a reconnect.
pub(super) const MARKER_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(super) struct GuardState {
    /// The marker as this replica last saw it.
    pub(super) known: Option<Marker>,
    /// The backend session the marker was last checked on, and when.
    pub(super) checked_session: Option<u64>,
    pub(super) checked_at: Option<std::time::Instant>,
    /// Why writes are refused, if they are.
    pub(super) amnesia: Option<String>,
    /// `known` came from the state file and no check ran yet.
    pub(super) from_file: bool,
    /// The ticket counter at the last confirmation: an answer to a request
    /// sent before it is not recorded in the store as a loss (the operator
    /// accepted what the store held then).
    pub(super) confirmed_ticket: u64,
    /// When the store's marker was last read to record a latched loss
    /// ([`SharedStore::trip_latched`]), to do that at most once a
    /// [`MARKER_INTERVAL`] from the heartbeat.
    pub(super) trip_checked_at: Option<std::time::Instant>,
}

impl GuardState {
    /// Whether the marker was checked on `session` or a later one (sessions
    /// only go up, so a later check covers it).
    pub(super) fn checked_on(&self, session: u64) -> bool {
        self.checked_session.is_some_and(|c| c >= session)
    }
}

/// Acquire batches out at once: one, so that writes gather while it is out
/// and the server commits (fsyncs, runs Raft) once per gathering. Two
/// measured no better and often worse (smaller batches, more commits on
/// a server that shares the proxy's core).
pub(super) const ACQUIRE_PARALLEL: usize = 1;

/// Release batches out at once: releases are lazy, so they gather longer.
pub(super) const RELEASE_PARALLEL: usize = 1;

/// How long closing waits for batches still out.
pub(super) const SETTLE: Duration = Duration::from_secs(2);

/// A [`FenceStore`](crate::store::api::FenceStore) over a shared [`Backend`].
pub struct SharedStore<B: Backend> {
    pub(super) backend: Arc<B>,
    /// Admissions and releases go to the server in batches (group commit).
    pub(super) acquires: Arc<Batcher<Acquire, LeaseOutcome>>,
    pub(super) releases: Arc<Batcher<(String, WriteLease), ()>>,
    /// Shared with the acquire batcher, which checks it before each batch.
    pub(super) guard: Arc<Mutex<GuardState>>,
    /// Serializes marker checks (one per reconnect, not one per request).
    pub(super) check_lock: tokio::sync::Mutex<()>,
    /// Highest tokens this replica saw acknowledged, to catch a store whose
    /// answers go backwards. Bounded; eviction only loses detection power.
    pub(super) known_highest: DashMap<String, Witnessed>,
    /// Ticket counter for `known_highest`.
    pub(super) tickets: AtomicU64,
    pub(super) known_capacity: usize,
    /// Confirm a reset automatically, once, at the first marker check (the
    /// operator said so at start; later losses need a new confirmation).
    pub(super) accept_reset: std::sync::atomic::AtomicBool,
    /// TTL of the latest lease, to re-register one that expired while its
    /// writer was waiting.
    pub(super) lease_ttl_ms: AtomicU64,
    /// Where this replica keeps the latest marker it saw, if anywhere.
    pub(super) state_file: Option<StateFile>,
    /// A state file write is under way (one at a time, off the checks).
    pub(super) saving: Arc<std::sync::atomic::AtomicBool>,
}

/// What a replica saw acknowledged for a key: its highest token with the
/// ticket it was recorded under, and the highest before that. An answer is
/// only compared with tokens acknowledged before its request was sent
/// (answers to concurrent requests arrive in any order); the one before is
/// kept so that a request sent between two acknowledgements is still
/// compared with the first (the second's later ticket would otherwise
/// hide it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Witnessed {
    pub(super) highest: (u64, u64),
    before: Option<(u64, u64)>,
}

impl Witnessed {
    fn new(token: u64, ticket: u64) -> Self {
        Self {
            highest: (token, ticket),
            before: None,
        }
    }

    /// `token` acknowledged under `ticket`. Recordings may come in
    /// another order than their tickets: an entry that another covers (as
    /// high a token, acknowledged no later) is dropped, and of the rest
    /// the two latest are kept (a request in flight was sent lately).
    fn raise(&mut self, token: u64, ticket: u64) {
        let all: Vec<(u64, u64)> = [self.before, Some(self.highest), Some((token, ticket))]
            .into_iter()
            .flatten()
            .collect();
        let mut kept: Vec<(u64, u64)> = all
            .iter()
            .copied()
            .filter(|&(v, t)| {
                !all.iter()
                    .any(|&(w, u)| (w, u) != (v, t) && w >= v && u <= t)
            })
            .collect();
        kept.sort_by_key(|&(_, t)| t);
        kept.dedup();
        // Not covered by one another: later tickets carry higher tokens.
        let mut latest = kept.into_iter().rev();
        if let Some(h) = latest.next() {
            self.highest = h;
            self.before = latest.next();
        }
    }

    /// The highest token known acknowledged before a request sent under
    /// ticket `sent`.
    pub(super) fn acknowledged_by(&self, sent: u64) -> Option<u64> {
        [Some(self.highest), self.before]
            .into_iter()
            .flatten()
            .find(|(_, ticket)| *ticket <= sent)
            .map(|(token, _)| token)
    }
}

impl<B: Backend> SharedStore<B> {
    /// `batch_sizes`: observes each batch's size, by operation
    /// (`fencegate_store_batch_size`). `state_file`: this replica's record
    /// of the latest marker it saw; its marker, read here, is what the
    /// store's is compared with at the first check.
    pub fn new(
        backend: B,
        accept_reset: bool,
        batch_sizes: Option<&prometheus::HistogramVec>,
        state_file: Option<StateFile>,
    ) -> Result<Self, StoreError> {
        let backend = Arc::new(backend);
        let sizes = |op: &str| batch_sizes.map(|h| h.with_label_values(&[op]));
        let known = match &state_file {
            Some(f) => f.load()?,
            None => None,
        };
        let guard = Arc::new(Mutex::new(GuardState {
            from_file: known.is_some(),
            known,
            ..GuardState::default()
        }));
        let acquires = {
            let (b, guard) = (backend.clone(), guard.clone());
            let run: Run<Acquire, LeaseOutcome> = Arc::new(move |reqs: Vec<Acquire>| {
                let b = b.clone();
                // Amnesia latched while the batch waited (the marker check
                // ran before it was queued): nothing is sent.
                let amnesia = guard.lock().expect("guard lock").amnesia.clone();
                Box::pin(async move {
                    match amnesia {
                        Some(why) => Err(StoreError::Amnesia(why)),
                        None => b.acquire_many(&reqs).await,
                    }
                })
            });
            Batcher::new(ACQUIRE_PARALLEL, run, sizes("acquire_lease"))
        };
        let releases = {
            let b = backend.clone();
            let run: Run<(String, WriteLease), ()> =
                Arc::new(move |leases: Vec<(String, WriteLease)>| {
                    let b = b.clone();
                    Box::pin(async move {
                        b.release_many(&leases).await?;
                        Ok(leases.iter().map(|_| Ok(())).collect())
                    })
                });
            Batcher::new(RELEASE_PARALLEL, run, sizes("release_lease"))
        };
        Ok(Self {
            backend,
            acquires,
            releases,
            guard,
            check_lock: tokio::sync::Mutex::new(()),
            known_highest: DashMap::new(),
            tickets: AtomicU64::new(0),
            known_capacity: 1_000_000,
            accept_reset: std::sync::atomic::AtomicBool::new(accept_reset),
            lease_ttl_ms: AtomicU64::new(60_000),
            state_file,
            saving: Arc::default(),
        })
    }

    /// Bounds the tokens witnessed per key (see `known_highest`) to `n`
    /// entries, for a store that is one of several groups.
    pub fn with_known_capacity(mut self, n: usize) -> Self {
        self.known_capacity = n;
        self
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Bounds a caller's whole wait on the store by `store_timeout`.
    ///
    /// Each round trip inside is bounded by it too, but one call may make
    /// several (a marker check on a new connection, a reconnect after the
    /// backoff, the batch ahead of it in the group commit), and they
    /// stacked: a replica cut from its store kept writes waiting 5-10 s
    /// with a 2 s `store_timeout` (issue 43). From this bound on, the
    /// write is refused (503) at once; what the abandoned call may still
    /// do on the server is what any timed-out call may (an acquire is
    /// released by its `PendingLease`, twice).
    pub(super) async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let limit = self.backend.timeout();
        match tokio::time::timeout(limit, call).await {
            Ok(answer) => answer,
            Err(_) => Err(StoreError::Unavailable(format!(
                "{}: no answer within store_timeout ({limit:?})",
                self.backend.kind()
            ))),
        }
    }

    pub(super) fn set_amnesia(&self, why: String) -> StoreError {
        tracing::error!(store = self.backend.kind(), group = self.backend.group(), reason = %why, "fence store may have lost data: refusing writes until an operator confirms");
        let mut g = self.guard.lock().expect("guard lock");
        g.amnesia.get_or_insert(why.clone());
        StoreError::Amnesia(why)
    }

    /// (whether the marker was checked on this session, whether that check
    /// is recent); fails while in amnesia.
    pub(super) fn check_due(&self, session: u64) -> Result<(bool, bool), StoreError> {
        let g = self.guard.lock().expect("guard lock");
        if let Some(why) = &g.amnesia {
            return Err(StoreError::Amnesia(why.clone()));
        }
        Ok((
            g.checked_on(session),
            g.checked_at.is_some_and(|t| t.elapsed() < MARKER_INTERVAL),
        ))
    }

    /// Checks the marker on a new session, and at least every
    /// [`MARKER_INTERVAL`] (a wipe does not always drop connections); fails
    /// while in amnesia.
    pub(super) async fn ensure(&self) -> Result<(), StoreError> {
        let session = self.backend.session();
        let (same_session, fresh) = self.check_due(session)?;
        if same_session && fresh {
            return Ok(());
        }
        let _one = if same_session {
            // Only the periodic re-check is due: one caller does it, the
            // others go on.
            match self.check_lock.try_lock() {
                Ok(guard) => guard,
                Err(_) => return Ok(()),
            }
        } else {
            self.check_lock.lock().await
        };
        let (same_session, fresh) = self.check_due(session)?;
        if same_session && fresh {
            return Ok(());
        }
        let (known, first_from_file) = {
            let g = self.guard.lock().expect("guard lock");
            (g.known.clone(), g.from_file && g.checked_session.is_none())
        };
        // An error names why, and the marker to record the rollback on
        // when the store went back (not when another replica recorded a
        // new epoch: that may be an operator's confirmation).
        let verdict: Result<Marker, (String, Option<(u64, Marker)>)> =
            match (known, self.backend.read_marker().await?) {
                // Never initialised silently: a wiped store looks just like a
                // new one. `--accept-store-reset` is an operator's say-so.
                (None, None) if self.accept_reset.swap(false, Ordering::AcqRel) => {
                    let taken = AcceptTaken(&self.accept_reset);
                    tracing::warn!("--accept-store-reset: marking a store that has no marker");
                    self.confirm_reset_checked().await?;
                    std::mem::forget(taken);
                    return Ok(());
                }
                (None, None) => return Err(StoreError::Uninitialised),
                // Another replica saw this store go back: so does this one,
                // whatever it remembers.
                (_, Some(m)) if m.trip_reason().is_some() => {
                    Err((m.trip_reason().unwrap_or_default(), None))
                }
                // Adopted as bumped, unless it changed between the read and
                // the bump (another replica recorded a loss meanwhile).
                (None, Some(m)) => match self.backend.bump_marker().await? {
                    None => Err(("the marker vanished".to_string(), None)),
                    Some(b) if b.trip_reason().is_some() => {
                        Err((b.trip_reason().unwrap_or_default(), None))
                    }
                    Some(b) if b.epoch != m.epoch => Err((
                        format!(
                            "its marker changed from epoch {} to {} while it was checked",
                            m.epoch, b.epoch
                        ),
                        None,
                    )),
                    Some(b) => Ok(b),
                },
                // Remembered from the state file, the store has none: as
                // for a store that was never marked, the start is refused
                // and names `init-store` (which a replica with this file
                // then refuses until confirmed: another epoch).
                (Some(_), None) if first_from_file => return Err(StoreError::Uninitialised),
                (Some(k), None) => Err((
                    format!(
                        "its marker (epoch {}) is missing: the data was wiped or replaced",
                        k.epoch
                    ),
                    None,
                )),
                (Some(k), Some(m)) => match behind(&k, &m) {
                    Some(why) => {
                        let trip = (m.epoch == k.epoch).then_some((k.seq, m));
                        Err((why, trip))
                    }
                    // Advanced at every check, periodic ones too (every replica
                    // checks at least every MARKER_INTERVAL, idle or not: the
                    // server's heartbeat): a store rolled back to a state older
                    // than that is behind what every running replica saw. The
                    // marker as it was before the bump must still follow the
                    // known one: the data may have changed since the read.
                    None => match self.backend.bump_marker().await? {
                        None => Err(("the marker vanished".to_string(), None)),
                        Some(b) => {
                            let before = Marker {
                                epoch: b.epoch.clone(),
                                seq: b.seq - 1,
                            };
                            match behind(&k, &before) {
                                None => Ok(b),
                                Some(why) => {
                                    let trip = (b.epoch == k.epoch).then_some((k.seq, b));
                                    Err((why, trip))
                                }
                            }
                        }
                    },
                },
            };
        match verdict {
            Ok(m) => {
                self.accept_reset.store(false, Ordering::Release);
                self.save_state(&m);
                let mut g = self.guard.lock().expect("guard lock");
                g.known = Some(m);
                g.from_file = false;
                g.checked_session = Some(session);
                g.checked_at = Some(std::time::Instant::now());
                Ok(())
            }
            Err((why, trip)) => {
                {
                    let mut g = self.guard.lock().expect("guard lock");
                    g.from_file = false;
                    g.checked_session = Some(session);
                    g.checked_at = Some(std::time::Instant::now());
                }
                let err = self.set_amnesia(why);
                if self.accept_reset.swap(false, Ordering::AcqRel) {
                    let taken = AcceptTaken(&self.accept_reset);
                    tracing::warn!("--accept-store-reset: confirming the reset");
                    self.confirm_reset_checked().await?;
                    std::mem::forget(taken);
                    return Ok(());
                }
                if let Some((seen, found)) = trip {
                    self.trip(seen, found).await;
                }
                Err(err)
            }
        }
    }

    /// Records this replica's marker in its state file, if it keeps one,
    /// in a task of its own: a slow disk must not hold the marker check
    /// (or the requests waiting on it). One write at a time; a check while
    /// one is under way skips its own (the next check, about a second
    /// later, writes again). A failure is logged, not fatal: the file only
    /// narrows what a restart can miss.
    pub(super) fn save_state(&self, m: &Marker) {
        let Some(f) = &self.state_file else { return };
        if self.saving.swap(true, Ordering::AcqRel) {
            return;
        }
        let (f, m, saving) = (f.clone(), m.clone(), self.saving.clone());
        tokio::spawn(async move {
            if let Err(e) = f.save(&m).await {
                tracing::warn!(path = %f.path.display(), error = %e, "store_state_file not written");
            }
            saving.store(false, Ordering::Release);
        });
    }

    /// Records in the store that it went back: replaces its marker `found`
    /// (which must still be the stored one, compare-and-set) with a tripped
    /// one that every replica refuses, restarted or new, until an operator
    /// confirms. `seen`: the sequence this replica saw before. Best effort:
    /// this replica refuses writes whatever the outcome.
    pub(super) async fn trip(&self, seen: u64, mut found: Marker) {
        for _ in 0..5 {
            let tripped = Marker::tripped(seen, found.seq);
            match self.backend.replace_marker(Some(&found), &tripped).await {
                Ok(m) if m.epoch == tripped || m.trip_reason().is_some() => {
                    tracing::error!(store = self.backend.kind(), group = self.backend.group(), seen, found = found.seq, "recorded in the store that it went back: every replica refuses writes until an operator confirms");
                    return;
                }
                // Bumped meanwhile (a replica that has not seen it yet):
                // the same epoch still behind is tripped on the next try.
                Ok(m) if m.epoch == found.epoch && m.seq < seen => found = m,
                // Another epoch: an operator's confirmation, not ours to undo.
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(store = self.backend.kind(), group = self.backend.group(), error = %e, "could not record the rollback in the store");
                    return;
                }
            }
        }
    }

    /// With amnesia latched (by a key's answer, a highest that went down,
    /// or a record that did not land): records it in the store as
    /// [`trip`](Self::trip) does, unless the store says so already or an
    /// operator confirmed a new epoch meanwhile. From the heartbeat at
    /// most once a [`MARKER_INTERVAL`]; `now` for a loss just found.
    pub(super) async fn trip_latched(&self, now: bool) {
        let known = {
            let mut g = self.guard.lock().expect("guard lock");
            if g.amnesia.is_none()
                || (!now
                    && g.trip_checked_at
                        .is_some_and(|t| t.elapsed() < MARKER_INTERVAL))
            {
                return;
            }
            g.trip_checked_at = Some(std::time::Instant::now());
            g.known.clone()
        };
        let Some(k) = known else { return };
        match self.backend.read_marker().await {
            Ok(Some(m)) if m.trip_reason().is_none() && m.epoch == k.epoch => {
                self.trip(k.seq.max(m.seq + 1), m).await
            }
            _ => {}
        }
    }

    /// The ticket to take before sending a request whose answer will be
    /// witnessed.
    pub(super) fn ticket(&self) -> u64 {
        self.tickets.load(Ordering::Acquire)
    }

    /// Records an acknowledged token; a store answer that contradicts what
    /// it acknowledged before the request was sent means lost data.
    pub(super) fn witness_now(
        &self,
        key: &str,
        sent: u64,
        outcome_highest: Option<u64>,
        admitted: Option<u64>,
    ) -> Result<(), StoreError> {
        let known = self.known_highest.get(key).map(|v| *v);
        tracing::trace!(
            store = self.backend.kind(),
            group = self.backend.group(),
            key,
            sent,
            ?known,
            ?admitted,
            ?outcome_highest,
            "witness"
        );
        if let Some(k) = known.and_then(|w| w.acknowledged_by(sent)) {
            if let Some(t) = admitted {
                if t < k {
                    return Err(self.set_amnesia(format!(
                        "it admitted token {t} for {key} after acknowledging {k}"
                    )));
                }
            }
            if let Some(h) = outcome_highest {
                if h < k {
                    return Err(self.set_amnesia(format!(
                        "its highest token for {key} went down from {k} to {h}"
                    )));
                }
            }
        }
        let new = admitted.into_iter().chain(outcome_highest).max();
        if let Some(v) = new {
            if known.is_none() && self.known_highest.len() >= self.known_capacity {
                let mut budget = self.known_capacity / 8;
                self.known_highest.retain(|_, _| {
                    budget = budget.saturating_sub(1);
                    budget == 0
                });
            }
            let ack = self.tickets.fetch_add(1, Ordering::AcqRel) + 1;
            self.known_highest
                .entry(key.to_string())
                .and_modify(|x| x.raise(v, ack))
                .or_insert(Witnessed::new(v, ack));
        }
        Ok(())
    }

    /// [`witness_now`](Self::witness_now), and a loss it finds recorded in
    /// the store's marker at once, so that a replica that starts next
    /// refuses too.
    pub(super) async fn witness(
        &self,
        key: &str,
        sent: u64,
        outcome_highest: Option<u64>,
        admitted: Option<u64>,
    ) -> Result<(), StoreError> {
        let r = self.witness_now(key, sent, outcome_highest, admitted);
        // Not for an answer to a request sent before the last
        // confirmation: the operator accepted what the store held then.
        let before_confirm = sent < self.guard.lock().expect("guard lock").confirmed_ticket;
        if r.is_err() && !before_confirm {
            self.trip_latched(true).await;
        }
        r
    }

    pub(super) async fn witness_lease(
        &self,
        key: &str,
        sent: u64,
        outcome: &LeaseOutcome,
    ) -> Result<(), StoreError> {
        match outcome {
            LeaseOutcome::Stale { highest } => self.witness(key, sent, Some(*highest), None).await,
            LeaseOutcome::Granted(l) | LeaseOutcome::Busy { lease: l, .. } => {
                self.witness(key, sent, None, Some(l.token)).await
            }
        }
    }

    /// A lease operation on the backend as admissions run it: refused while
    /// in amnesia (the marker checked first), its answer compared with what
    /// was acknowledged before it was sent. (`call` is lazy: nothing is
    /// sent before the marker check.)
    pub(super) async fn guarded(
        &self,
        key: &str,
        call: impl std::future::Future<Output = Result<LeaseOutcome, StoreError>>,
    ) -> Result<LeaseOutcome, StoreError> {
        self.bounded(async {
            let (outcome, sent) = self.checked(call).await?;
            self.witness_lease(key, sent, &outcome).await?;
            Ok(outcome)
        })
        .await
    }

    /// One call as every checked call runs: the marker checked before it
    /// is sent (`call` is lazy) and again after it when a new session was
    /// made ([`recheck`](Self::recheck)), a failure latched. The answer,
    /// and the ticket it was sent under for the caller to witness it with.
    pub(super) async fn checked<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<(T, u64), StoreError> {
        self.ensure().await?;
        let sent = self.ticket();
        let answer = call.await.map_err(|e| self.latch(e))?;
        self.recheck().await?;
        Ok((answer, sent))
    }

    /// After a call: if a new connection was made since the marker was last
    /// checked (this call's or another's), the marker is checked before the
    /// answer is used. The call may have gone to a server that restarted
    /// from a backup: its answer is from the rolled-back data.
    pub(super) async fn recheck(&self) -> Result<(), StoreError> {
        // Fails while in amnesia: a check that found the loss while this
        // call was out (on this session too) makes its answer unusable.
        if self.check_due(self.backend.session())?.0 {
            return Ok(());
        }
        self.ensure().await
    }

    /// A lock-service operation as admissions run theirs: refused while in
    /// amnesia, and a grant witnessed like an admitted token (a later
    /// answer below it means the store lost data).
    pub(super) async fn lock(
        &self,
        key: &str,
        call: LockCall<'_>,
    ) -> Result<LockReply, StoreError> {
        self.bounded(async {
            let (reply, sent) = self.checked(self.backend.lock(key, call)).await?;
            if let LockReply::Claim(Claim::Granted { token, .. }) = &reply {
                self.witness(key, sent, None, Some(*token)).await?;
            }
            Ok(reply)
        })
        .await
    }

    /// [`FenceStore::confirm_reset`](crate::store::api::FenceStore::confirm_reset), with the marker-check lock held.
    pub(super) async fn confirm_reset_checked(&self) -> Result<(), StoreError> {
        // Write back every fence this replica knows, then a new marker.
        let known: Vec<(String, u64)> = self
            .known_highest
            .iter()
            .map(|e| (e.key().clone(), e.value().highest.0))
            .collect();
        for (key, token) in &known {
            self.backend.advance(key, *token).await?;
        }
        // If another replica confirmed already, join its new marker instead
        // of replacing it (which would put that replica in amnesia).
        let known_marker = self.guard.lock().expect("guard lock").known.clone();
        let old_epoch = known_marker.as_ref().map(|k| &k.epoch);
        let mut recorded = None;
        for _ in 0..20 {
            let current = self.backend.read_marker().await?;
            // Join another replica's confirmation, never a record that the
            // store went back.
            if let Some(m) = current
                .as_ref()
                .filter(|m| Some(&m.epoch) != old_epoch && m.trip_reason().is_none())
            {
                recorded = Some(m.clone());
                break;
            }
            // Compare-and-set: if two replicas confirm at once, the second
            // joins the first's marker instead of overwriting it; if another
            // replica advanced the old marker meanwhile, read it again.
            let m = self
                .backend
                .replace_marker(current.as_ref(), &crate::id::unique_id())
                .await?;
            if Some(&m.epoch) != old_epoch && m.trip_reason().is_none() {
                recorded = Some(m);
                break;
            }
        }
        let m = recorded.ok_or_else(|| {
            StoreError::Unavailable(
                "the marker kept changing while the reset was confirmed".to_string(),
            )
        })?;
        tracing::warn!(store = self.backend.kind(), group = self.backend.group(), epoch = %m.epoch, restored = known.len(), "store reset confirmed: known fences written back, new marker recorded");
        self.save_state(&m);
        let mut g = self.guard.lock().expect("guard lock");
        g.known = Some(m);
        g.amnesia = None;
        g.from_file = false;
        g.confirmed_ticket = self.tickets.load(Ordering::Acquire);
        g.checked_session = Some(self.backend.session());
        g.checked_at = Some(std::time::Instant::now());
        Ok(())
    }

    /// A backend's own report of lost data latches amnesia like ours.
    pub(super) fn latch(&self, e: StoreError) -> StoreError {
        match e {
            StoreError::Amnesia(why) => self.set_amnesia(why),
            other => other,
        }
    }
}

pub(super) fn wrong_reply(r: LockReply) -> StoreError {
    StoreError::Unavailable(format!("unexpected lease answer {r:?}"))
}

pub(super) fn no_marks() -> StoreError {
    StoreError::Unavailable("a shared store keeps leases, not in-flight marks".into())
}

#[cfg(test)]
mod tests {
    use super::Witnessed;

    #[test]
    fn an_answer_is_compared_with_what_was_acknowledged_before_it_was_sent() {
        // 7 acknowledged under ticket 11, then 9 under 12.
        let mut w = Witnessed::new(7, 11);
        w.raise(9, 12);
        w.raise(8, 13); // lower: changes nothing
        assert_eq!(w.acknowledged_by(13), Some(9));
        assert_eq!(w.acknowledged_by(12), Some(9));
        // Sent between the two: compared with 7, not left unchecked.
        assert_eq!(w.acknowledged_by(11), Some(7));
        // Sent before either: its answer may be lower than both.
        assert_eq!(w.acknowledged_by(10), None);

        // Recorded out of ticket order: 8 under 13 lands before 9 under
        // 12, which covers it; 7 under 11 is still compared with.
        let mut w = Witnessed::new(7, 11);
        w.raise(8, 13);
        w.raise(9, 12);
        assert_eq!(w.acknowledged_by(11), Some(7));
        assert_eq!(w.acknowledged_by(12), Some(9));
        assert_eq!(w.acknowledged_by(13), Some(9));
        assert_eq!(w.highest.0, 9);
    }
}
