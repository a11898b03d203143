//! [`Grouped`]: one [`FenceStore`] over several [`SharedStore`]s, each
//! fence key in one of them (a Redis Cluster's groups, each one slot).
//!
//! A key's every call goes to its group, and each group keeps its own
//! guard: its marker, its witnessed tokens, its latch in amnesia. So a
//! group whose data was lost refuses its keys' writes until an operator
//! confirms, and the others go on. What spans the store (initialising,
//! confirming a reset, the heartbeat's marker check, closing) is done for
//! every group, and says which groups failed.

use async_trait::async_trait;

use crate::store::api::{
    Advance, Claim, CrashedKey, FenceStore, LeaseOutcome, Lock, Replicas, Shard, StartState,
    StoreError, WriteLease,
};

use super::backend::Backend;
use super::store::SharedStore;

/// The groups, and how a key finds its group.
pub struct Grouped<B: Backend> {
    groups: Vec<SharedStore<B>>,
    group_of: fn(&str) -> usize,
    /// How a group is named in messages (its hash tag, say).
    names: Vec<String>,
}

impl<B: Backend> Grouped<B> {
    /// `group_of` must answer below `groups.len()` for every key.
    pub fn new(groups: Vec<(String, SharedStore<B>)>, group_of: fn(&str) -> usize) -> Self {
        let (names, groups): (Vec<_>, Vec<_>) = groups.into_iter().unzip();
        Self {
            groups,
            group_of,
            names,
        }
    }

    fn of(&self, key: &str) -> &SharedStore<B> {
        &self.groups[(self.group_of)(key)]
    }

    /// Runs `f` on every group at once; the groups that failed, named.
    async fn each<'a, T, F, Fut>(&'a self, f: F) -> Result<Vec<T>, StoreError>
    where
        F: Fn(&'a SharedStore<B>) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let answers = self.each_answer(f).await;
        let mut failed: Vec<(String, StoreError)> = Vec::new();
        let mut ok = Vec::new();
        for (name, a) in self.names.iter().zip(answers) {
            match a {
                Ok(v) => ok.push(v),
                Err(e) => failed.push((name.clone(), e)),
            }
        }
        // The gravest first: a lost group must not hide behind a group
        // that is only unreachable (the start refuses on the former).
        let rank = |e: &StoreError| match e {
            StoreError::Amnesia(_) => 0,
            StoreError::Uninitialised => 1,
            StoreError::Refused(_) => 2,
            _ => 3,
        };
        failed.sort_by_key(|(_, e)| rank(e));
        match failed.first() {
            None => Ok(ok),
            Some((_, first)) => {
                let which = named(failed.iter().map(|(n, _)| n.as_str()));
                // The first group's reason without its error's own words,
                // which the error made here says once.
                let reason = match first {
                    StoreError::Amnesia(r)
                    | StoreError::Refused(r)
                    | StoreError::Unavailable(r) => r.clone(),
                    other => other.to_string(),
                };
                let why = format!(
                    "{} of {} groups ({which}): {reason}",
                    failed.len(),
                    self.groups.len()
                );
                Err(match first {
                    StoreError::Amnesia(_) => StoreError::Amnesia(why),
                    StoreError::Refused(_) => StoreError::Refused(why),
                    StoreError::Uninitialised => StoreError::Uninitialised,
                    _ => StoreError::Unavailable(why),
                })
            }
        }
    }

    /// Runs `f` on every group at once; each group's answer.
    async fn each_answer<'a, T, F, Fut>(&'a self, f: F) -> Vec<Result<T, StoreError>>
    where
        F: Fn(&'a SharedStore<B>) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut answers = futures_util::future::join_all(self.groups.iter().map(f)).await;
        // A group without a marker while others answered with theirs lost
        // its data (its shard came back empty, or from a backup older than
        // init-store): latched as such, so that this replica serves the
        // other groups and an operator's confirm-reset marks it again.
        // (With no group marked, the store is new: init-store.) Its marker
        // is read once more first: init-store marks the groups at once but
        // not in one step, and a group marked meanwhile is no loss (its
        // next check adopts the marker, or finds a rollback).
        if answers.iter().any(Result::is_ok) {
            let unmarked: Vec<usize> = (0..answers.len())
                .filter(|&i| matches!(answers[i], Err(StoreError::Uninitialised)))
                .collect();
            let again = futures_util::future::join_all(unmarked.iter().map(|&i| async move {
                let b = self.groups[i].backend();
                tokio::time::timeout(b.timeout(), b.read_marker())
                    .await
                    .unwrap_or_else(|_| {
                        Err(StoreError::Unavailable(format!(
                            "{}: no answer within store_timeout",
                            b.kind()
                        )))
                    })
            }))
            .await;
            for (i, marker) in unmarked.into_iter().zip(again) {
                answers[i] = Err(match marker {
                    Ok(None) => self.groups[i].set_amnesia(
                        "the group has no marker while other groups of the store have theirs: its shard lost its data (restarted empty, or restored from before init-store)".into(),
                    ),
                    Ok(Some(_)) => StoreError::Unavailable(
                        "the group was marked while it was checked (init-store running): checked again at its next call".into(),
                    ),
                    Err(e) => e,
                });
            }
        }
        answers
    }
}

/// Groups named in a message: the first few, and how many more.
fn named<'a>(names: impl ExactSizeIterator<Item = &'a str>) -> String {
    const SHOWN: usize = 6;
    let more = names.len().saturating_sub(SHOWN);
    let mut text = names.take(SHOWN).collect::<Vec<_>>().join(", ");
    if more > 0 {
        text.push_str(&format!(" and {more} more"));
    }
    text
}

#[async_trait]
impl<B: Backend> FenceStore for Grouped<B> {
    fn kind(&self) -> &'static str {
        self.groups[0].kind()
    }

    fn exclusive(&self) -> bool {
        false
    }

    fn start_state(&self) -> StartState {
        self.groups[0].start_state()
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.of(key).highest(key).await
    }

    async fn confirm_highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.of(key).confirm_highest(key).await
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        self.of(key).advance(key, token).await
    }

    async fn advance_marked(&self, key: &str, token: u64) -> Result<(Advance, u64), StoreError> {
        self.of(key).advance_marked(key, token).await
    }

    async fn mark_in_flight(&self, key: &str, token: u64) -> Result<u64, StoreError> {
        self.of(key).mark_in_flight(key, token).await
    }

    // Marks and crash records are an exclusive store's: every group
    // answers as a shared store does, so the first speaks for all.
    fn next_mark(&self) -> u64 {
        self.groups[0].next_mark()
    }

    async fn rotate_marks(
        &self,
        keys: Vec<(String, u64)>,
        watermark: u64,
    ) -> Result<Vec<u64>, StoreError> {
        self.groups[0].rotate_marks(keys, watermark).await
    }

    fn in_flight_at_crash(&self) -> Option<Vec<CrashedKey>> {
        self.groups[0].in_flight_at_crash()
    }

    fn key_mapping_at_open(&self) -> Option<u64> {
        self.groups[0].key_mapping_at_open()
    }

    async fn record_key_mapping(&self, fingerprint: u64) -> Result<(), StoreError> {
        self.groups[0].record_key_mapping(fingerprint).await
    }

    fn in_flight_marks(&self) -> u64 {
        self.groups[0].in_flight_marks()
    }

    async fn acquire_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: std::time::Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.of(key).acquire_lease(key, lease, ttl).await
    }

    async fn poll_lease(&self, key: &str, lease: &WriteLease) -> Result<LeaseOutcome, StoreError> {
        self.of(key).poll_lease(key, lease).await
    }

    async fn renew_lease(
        &self,
        key: &str,
        lease: &WriteLease,
        ttl: std::time::Duration,
    ) -> Result<LeaseOutcome, StoreError> {
        self.of(key).renew_lease(key, lease, ttl).await
    }

    async fn release_lease(&self, key: &str, lease: &WriteLease) -> Result<(), StoreError> {
        self.of(key).release_lease(key, lease).await
    }

    async fn claim_lock(
        &self,
        key: &str,
        id: &str,
        holder: &str,
        ttl: std::time::Duration,
    ) -> Result<Claim, StoreError> {
        self.of(key).claim_lock(key, id, holder, ttl).await
    }

    async fn read_lock(&self, key: &str) -> Result<Option<Lock>, StoreError> {
        self.of(key).read_lock(key).await
    }

    async fn renew_lock(
        &self,
        key: &str,
        id: &str,
        ttl: std::time::Duration,
    ) -> Result<Option<Lock>, StoreError> {
        self.of(key).renew_lock(key, id, ttl).await
    }

    async fn release_lock(&self, key: &str, id: &str) -> Result<bool, StoreError> {
        self.of(key).release_lock(key, id).await
    }

    async fn forget(&self, key: &str) -> Result<Option<u64>, StoreError> {
        self.of(key).forget(key).await
    }

    /// Marks every group, on a store none of whose groups has a marker;
    /// whether any was marked now. Some groups marked and others not is a
    /// loss (a shard that came back empty): refused, since marking them
    /// would take their lost fences for new keys; `confirm-reset` on a
    /// running replica writes back what it knew.
    async fn initialise(&self) -> Result<bool, StoreError> {
        let marked = self.each(|g| g.backend().read_marker()).await?;
        let unmarked: Vec<&str> = self
            .names
            .iter()
            .zip(&marked)
            .filter(|(_, m)| m.is_none())
            .map(|(n, _)| n.as_str())
            .collect();
        if !unmarked.is_empty() && unmarked.len() < self.groups.len() {
            let serving = futures_util::future::join_all(
                self.groups
                    .iter()
                    .zip(&marked)
                    .filter(|(_, m)| m.is_none())
                    .map(|(g, _)| g.backend().serving()),
            )
            .await;
            let mut shards: Vec<String> = serving
                .into_iter()
                .map(|s| s.unwrap_or_else(|| "unknown".into()))
                .collect();
            shards.sort();
            shards.dedup();
            return Err(StoreError::Amnesia(format!(
                "{} of {} groups ({}) have no marker while the others have theirs: their shard ({}) lost its data; confirm the loss with confirm-reset on a running replica (docs/operations.md) instead of init-store",
                unmarked.len(),
                self.groups.len(),
                named(unmarked.into_iter()),
                shards.join(", ")
            )));
        }
        Ok(self
            .each(|g| g.initialise())
            .await?
            .into_iter()
            .any(|created| created))
    }

    /// The groups in amnesia, named, with the first one's reason.
    fn amnesia(&self) -> Option<String> {
        let lost: Vec<(&String, String)> = self
            .names
            .iter()
            .zip(&self.groups)
            .filter_map(|(n, g)| g.amnesia().map(|why| (n, why)))
            .collect();
        let (_, first) = lost.first()?;
        let which = named(lost.iter().map(|(n, _)| n.as_str()));
        Some(format!(
            "{} of {} groups ({which}; only their keys' writes are refused): {first}",
            lost.len(),
            self.groups.len()
        ))
    }

    /// The group that waited the worst last (fewest confirmations against
    /// those wanted), and the failed waits of all of them.
    fn replicas(&self) -> Option<Replicas> {
        let all: Vec<Replicas> = self.groups.iter().filter_map(|g| g.replicas()).collect();
        if all.is_empty() {
            return None;
        }
        Some(Replicas {
            last: all
                .iter()
                .filter_map(|r| r.last)
                .min_by_key(|w| (i64::from(w.confirmed) - i64::from(w.wanted), w.confirmed)),
            failed_waits: all.iter().map(|r| r.failed_waits).sum(),
        })
    }

    /// Each group pinged now (its marker checked when due), with the shard
    /// serving it.
    async fn shards(&self) -> Option<Vec<Shard>> {
        let (pings, serving) = futures_util::future::join(
            self.each_answer(|g| g.ping()),
            futures_util::future::join_all(self.groups.iter().map(|g| g.backend().serving())),
        )
        .await;
        let mut shards: std::collections::BTreeMap<String, (Shard, Vec<&str>)> = Default::default();
        for (i, (node, ping)) in serving.into_iter().zip(pings).enumerate() {
            let node = node.unwrap_or_else(|| "unknown".into());
            let (s, failing) = shards.entry(node.clone()).or_insert_with(|| {
                (
                    Shard {
                        shard: node,
                        groups: 0,
                        unreachable: 0,
                        lost: 0,
                        failing: None,
                        error: None,
                    },
                    Vec::new(),
                )
            });
            s.groups += 1;
            let why = match self.groups[i].amnesia() {
                Some(why) => {
                    s.lost += 1;
                    why
                }
                None => match ping {
                    Err(e) => {
                        s.unreachable += 1;
                        e.to_string()
                    }
                    Ok(()) => continue,
                },
            };
            s.error.get_or_insert(why);
            failing.push(&self.names[i]);
        }
        Some(
            shards
                .into_values()
                .map(|(mut s, failing)| {
                    s.failing = (!failing.is_empty()).then(|| named(failing.into_iter()));
                    s
                })
                .collect(),
        )
    }

    /// Confirms every group in amnesia here, and joins every group that
    /// another replica confirmed already (its marker of another epoch, no
    /// record of a loss in it). A group whose marker is as this replica
    /// knows it is left alone: confirming it would give it a new epoch,
    /// which every other replica would take for a loss. So is a group
    /// found gone or recorded as gone back that this replica has not
    /// latched yet: a loss the operator has not been shown is not
    /// confirmed with another; it is latched by its next check and needs
    /// a confirmation of its own. Each decision is made with the group's
    /// marker check held off, so that the marker known cannot change
    /// between the decision and the confirmation.
    async fn confirm_reset(&self) -> Result<(), StoreError> {
        self.each(|g| async move {
            let _one = g.check_lock.lock().await;
            let known = g.guard.lock().expect("guard lock").known.clone();
            let due = g.amnesia().is_some()
                || match (known, g.backend().read_marker().await?) {
                    (Some(k), Some(m)) => m.epoch != k.epoch && m.trip_reason().is_none(),
                    _ => false,
                };
            if due {
                g.confirm_reset_checked().await
            } else {
                Ok(())
            }
        })
        .await
        .map(|_| ())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.each(|g| g.ping()).await.map(|_| ())
    }

    async fn check_marker(&self) -> Result<(), StoreError> {
        self.each(|g| g.check_marker()).await.map(|_| ())
    }

    async fn close_clean(&self) -> Result<(), StoreError> {
        self.each(|g| g.close_clean()).await.map(|_| ())
    }
}
