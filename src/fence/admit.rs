//! Admission and ordering on a key: stale, equal or raise, waiting behind
//! older writes in flight, and the lookups and changes the admin API and
//! the lock service make (highest, raise, forget, overtaken).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::Advance;

use super::error::*;
use super::gate::*;
use super::state::*;

/// A key's writes in flight and hold ([`Fence::activity`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Activity {
    /// (token, writes in flight with it), lowest token first.
    pub in_flight: Vec<(u64, usize)>,
    /// Time left in the key's crash-recovery hold, if it is held.
    pub held_for: Option<Duration>,
}

impl Fence {
    /// Raises the key's highest to `token` in the store (durably) and records
    /// the answer in memory. Runs as its own task so that a client hanging up
    /// cannot leave memory behind a raise that did reach the disk.
    /// With `mark`, the key's in-flight mark is written in the same commit.
    /// Returns the highest afterwards, and the previous highest if this
    /// call is the one that raised it.
    pub(super) async fn advance(
        self: &Arc<Self>,
        key: &Arc<str>,
        gate: &Arc<KeyGate>,
        token: u64,
        mark: bool,
    ) -> Result<(u64, Option<Raised>), FenceError> {
        let fence = self.clone();
        let key = key.clone();
        let gate = gate.clone();
        let task = tokio::spawn(async move {
            let answer = if mark {
                fence
                    .store
                    .advance_marked(&key, token)
                    .await
                    .map(|(a, seq)| (a, Some(seq)))
            } else {
                fence.store.advance(&key, token).await.map(|a| (a, None))
            };
            let highest = answer.map(|(answer, seq)| {
                let (highest, raised) = match answer {
                    Advance::Raised { previous } => (
                        token,
                        Some(Raised::From {
                            previous,
                            at_ms: crate::clock::wall_ms(),
                        }),
                    ),
                    Advance::Equal => (token, None),
                    Advance::Stale { highest } => (highest, None),
                };
                {
                    // The cache is written under the gate lock with the
                    // gate's maximum, so two answers landing in either order
                    // (with an eviction in between) can never leave it below
                    // the store.
                    let mut st = gate.state.lock().expect("gate lock");
                    let max = st.highest.map_or(highest, |h| h.max(highest));
                    st.highest = Some(max);
                    st.mark = st.mark.max(seq);
                    fence.cache.raise(&key, max, seq);
                }
                // Queued older writes must now see that they are stale.
                gate.changed.notify_waiters();
                (highest, raised)
            });
            // The admission that started this may be gone (client hung up):
            // then this task held the last reference, and the gate must not
            // outlive it, whatever the store answered.
            drop(gate);
            fence.release_gate(&key);
            highest
        });
        joined(task.await)
    }

    /// Admits a write of `token` to `key`. While an older-token write to the
    /// key is in flight (and within its own deadline) this waits, but not
    /// past `wait_until`: then it fails with [`FenceError::Busy`]. The permit
    /// it returns carries the write's own deadline, `upstream_timeout` from
    /// now: the caller must have ended the write (exchange and body) by then.
    pub async fn admit(
        self: &Arc<Self>,
        key: &str,
        token: u64,
        wait_until: Instant,
        upstream_timeout: Duration,
    ) -> Result<Permit, FenceError> {
        self.admit_noting(key, token, wait_until, upstream_timeout, &mut None)
            .await
    }

    /// [`Fence::admit`], noting in `raised` how this admission moved the
    /// key's highest, if it did: set as soon as the store answered, so a
    /// raise is known whatever the admission ends in (admitted, refused
    /// as busy or overtaken while it waited behind older writes).
    pub async fn admit_noting(
        self: &Arc<Self>,
        key: &str,
        token: u64,
        wait_until: Instant,
        upstream_timeout: Duration,
        raised: &mut Option<Raised>,
    ) -> Result<Permit, FenceError> {
        let key: Arc<str> = Arc::from(key);
        if !self.store.exclusive() {
            return self
                .admit_shared(key, token, wait_until, upstream_timeout, raised)
                .await;
        }
        // Removes the gate again if this admission fails or is abandoned
        // (the client hung up while waiting).
        let guard = GateGuard {
            fence: self,
            key: key.clone(),
            gate: Some(self.gate(&key)),
        };
        let gate = guard.gate.as_ref().expect("set above");
        self.admit_on(&key, gate, token, wait_until, upstream_timeout, raised)
            .await
    }

    pub(super) async fn admit_on(
        self: &Arc<Self>,
        key: &Arc<str>,
        gate: &Arc<KeyGate>,
        token: u64,
        wait_until: Instant,
        upstream_timeout: Duration,
        raised: &mut Option<Raised>,
    ) -> Result<Permit, FenceError> {
        // Only the embedded store gets here: this process is its one writer,
        // so the in-memory highest (written only after the store committed)
        // answers "equal" and "stale" without I/O.
        loop {
            self.check_held(key, gate, token).await?;
            let (known, marked) = {
                let st = gate.state.lock().expect("gate lock");
                (st.highest, self.live(&st))
            };
            if known.is_none_or(|h| h < token) {
                let (_, r) = self.advance(key, gate, token, !marked).await?;
                if r.is_some() {
                    *raised = r;
                }
            }
            let notified = gate.changed.notified();
            tokio::pin!(notified);
            let now = Instant::now();
            let decision = {
                let mut st = gate.state.lock().expect("gate lock");
                let highest = st.highest.unwrap_or(token);
                match highest.cmp(&token) {
                    std::cmp::Ordering::Greater => Step::Stale(highest),
                    // Cannot follow an advance of this token (the highest
                    // is at least the token then); kept so that a missed
                    // raise asks the store again rather than admitting.
                    std::cmp::Ordering::Less => Step::Retry,
                    std::cmp::Ordering::Equal => match st.older(token, now) {
                        Older::Live(latest) if now >= wait_until => Step::Busy(latest - now),
                        Older::Live(latest) => {
                            notified.as_mut().enable();
                            Step::Wait(latest.min(wait_until))
                        }
                        // The mark is checked, and the write entered, under
                        // the gate's lock: a rotation's scan either finds
                        // the write or raised the watermark before this.
                        other => match (self.live(&st), st.marking) {
                            (true, _) => {
                                st.enter(token, now + upstream_timeout + CUT_GRACE);
                                Step::Go {
                                    waited_out: matches!(other, Older::Expired),
                                }
                            }
                            // Another writer, or a rotation, is marking it.
                            (false, true) if now >= wait_until => {
                                Step::Busy(Duration::from_secs(1))
                            }
                            (false, true) => {
                                notified.as_mut().enable();
                                Step::Wait(wait_until)
                            }
                            (false, false) => {
                                st.marking = true;
                                Step::Mark
                            }
                        },
                    },
                }
            };
            match decision {
                Step::Stale(highest) => return Err(FenceError::Stale { token, highest }),
                Step::Retry => continue,
                Step::Mark => self.mark(key, gate, token).await?,
                Step::Busy(retry_after) => return Err(FenceError::Busy { retry_after }),
                Step::Go { waited_out } => {
                    return Ok(Permit {
                        fence: self.clone(),
                        gate: Some(gate.clone()),
                        key: key.clone(),
                        token,
                        lease: None,
                        active: None,
                        deadline: now + upstream_timeout,
                        repolled: Default::default(),
                        waited_out,
                    })
                }
                Step::Wait(until) => {
                    // Woken by a write ending or the highest rising, or at
                    // the older writes' deadline or our own limit: decide
                    // again in every case.
                    let _waiting = Waiting::new(&self.waiting);
                    let _ = tokio::time::timeout_at(until, notified).await;
                }
            }
        }
    }

    /// The key's highest token as far as this process can tell without
    /// taking part in admission: the in-memory copy (exclusive stores) or
    /// the store.
    pub async fn highest(&self, key: &str) -> Result<Option<u64>, FenceError> {
        if self.store.exclusive() {
            if let Some(h) = self.highest_known(key) {
                return Ok(Some(h));
            }
        }
        Ok(self.store.highest(key).await?)
    }

    /// A lower bound of the key's highest token known without I/O, if any:
    /// the in-memory copy (exclusive stores, where it is the highest), or
    /// the token of this replica's registration of the key (shared stores:
    /// the store granted it as the key's highest, and highests only rise).
    pub fn highest_known(&self, key: &str) -> Option<u64> {
        if !self.store.exclusive() {
            return self.actives.get(key).map(|a| a.token);
        }
        if let Some(g) = self.gates.get(key) {
            if let Some(h) = g.state.lock().expect("gate lock").highest {
                return Some(h);
            }
        }
        self.cache.get(key)
    }

    /// What this process has in flight on `key` now, for the admin lookup:
    /// per token, the writes admitted and not ended (on a shared store,
    /// those admitted on this replica's registration of the key), and the
    /// time left in the key's crash hold, if it is held.
    pub fn activity(&self, key: &str) -> Activity {
        let mut per_token = std::collections::BTreeMap::<u64, usize>::new();
        let mut held_for = None;
        if let Some(g) = self.gates.get(key) {
            let st = g.state.lock().expect("gate lock");
            for ((token, _), n) in &st.inflight {
                *per_token.entry(*token).or_default() += *n as usize;
            }
            held_for = self.held_for(&st, Instant::now());
        }
        if held_for.is_none() && (self.holds_all() || self.held.contains_key(key)) {
            held_for = self.recovering_for();
        }
        if let Some(a) = self.actives.get(key) {
            let n = a.in_flight();
            if n > 0 {
                *per_token.entry(a.token).or_default() += n;
            }
        }
        Activity {
            in_flight: per_token.into_iter().collect(),
            held_for,
        }
    }

    /// Fence-ahead: raises the key's highest to `token` (durably) without a
    /// write, so older holders are cut off at lock grant. Returns the
    /// highest afterwards; `Err(Stale)` if it was already above `token`.
    pub async fn raise(self: &Arc<Self>, key: &str, token: u64) -> Result<u64, FenceError> {
        self.raise_noting(key, token, &mut None).await
    }

    /// [`Fence::raise`], noting in `raised` whether this call raised the
    /// highest (not when the key was already at `token`).
    pub async fn raise_noting(
        self: &Arc<Self>,
        key: &str,
        token: u64,
        raised: &mut Option<Raised>,
    ) -> Result<u64, FenceError> {
        let highest = if self.store.exclusive() {
            let key: Arc<str> = Arc::from(key);
            let guard = GateGuard {
                fence: self,
                key: key.clone(),
                gate: Some(self.gate(&key)),
            };
            let gate = guard.gate.as_ref().expect("set above");
            // A raise on a held key would let a write of the new token
            // overtake the crashed run's write as an equal one.
            self.check_held(&key, gate, token).await?;
            let (highest, r) = self.advance(&key, gate, token, false).await?;
            *raised = r;
            highest
        } else {
            match self.store.advance(key, token).await? {
                Advance::Stale { highest } => highest,
                Advance::Raised { previous } => {
                    *raised = Some(Raised::From {
                        previous,
                        at_ms: crate::clock::wall_ms(),
                    });
                    self.follow_shared_raise(key, token).await;
                    token
                }
                // Followed too: the raise that got there may be under 50 ms
                // old.
                Advance::Equal => {
                    self.follow_shared_raise(key, token).await;
                    token
                }
            }
        };
        if highest > token {
            return Err(FenceError::Stale { token, highest });
        }
        Ok(highest)
    }

    /// Operator reset: forgets the key's fence in the store and in memory.
    /// Refused while the key is held after a crash: the crashed run's write
    /// may still be in flight, and the hold rests on the key's highest.
    pub async fn forget(&self, key: &str) -> Result<Option<u64>, FenceError> {
        if let Some(left) = self.recovering_for() {
            if self.holds_all() || self.held.contains_key(key) {
                return Err(FenceError::Recovering { retry_after: left });
            }
        }
        let old = self.store.forget(key).await?;
        self.cache.remove(key);
        if let Some(g) = self.gates.get(key) {
            g.state.lock().expect("gate lock").highest = None;
        }
        Ok(old)
    }

    /// For a write holding several keys: the highest token of a key if it
    /// rose above the permit's token after admission (the write must not go).
    pub async fn overtaken(&self, permit: &Permit) -> Result<Option<u64>, FenceError> {
        if let Some(gate) = &permit.gate {
            let st = gate.state.lock().expect("gate lock");
            return Ok(st.highest.filter(|h| *h > permit.token));
        }
        self.overtaken_shared(permit).await
    }
}
