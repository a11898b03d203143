//! Crash recovery: in-flight marks written before a write is forwarded,
//! their rotation under a rising watermark, and after an unclean stop the
//! holds on the keys whose marks were live.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::error::*;
use super::gate::*;
use super::state::*;

/// How often the server raises the mark watermark: a key in steady use
/// costs one mark per rotation, and a key idle for two rotations is not
/// held after a crash.
pub const ROTATE_EVERY: Duration = Duration::from_secs(1);

impl Fence {
    /// Every key is held while the crash-recovery window lasts.
    pub(super) fn holds_all(&self) -> bool {
        self.hold_all.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Called once at start with the fingerprint of the key mapping this run
    /// admits writes under; returns the fingerprint to record in the store
    /// ([`FenceStore::record_key_mapping`](crate::store::FenceStore::record_key_mapping)).
    /// The crashed run's marks name
    /// keys under the mapping it recorded: under another one (a reload or
    /// a changed config before the restart) a resource that had a write in
    /// flight has another key now, so every key is held until the window
    /// ends, and the record says so ([`KEY_MAPPING_MIXED`]) until then, in
    /// case this run crashes too.
    ///
    /// [`KEY_MAPPING_MIXED`]: crate::store::KEY_MAPPING_MIXED
    pub fn adopt_key_mapping(&self, fingerprint: u64) -> u64 {
        let recorded = self.store.key_mapping_at_open();
        if self.recovering_until.is_none() || recorded == Some(fingerprint) {
            return fingerprint;
        }
        self.hold_every_key("writes were in flight at the crash under another key mapping (a reload or a changed config)");
        crate::store::KEY_MAPPING_MIXED
    }

    /// A reload remapped keys while the crash-recovery window lasts: the
    /// held keys are named under the mapping the crashed run had, and a
    /// resource that had a write in flight has another key now, so every
    /// key is held for the rest of the window.
    pub fn hold_every_key_while_recovering(&self) {
        if self.recovering_for().is_some() {
            self.hold_every_key("the key mapping changed during the crash-recovery window");
        }
    }

    /// From now until the crash-recovery window ends, every key is held.
    pub(super) fn hold_every_key(&self, why: &str) {
        tracing::warn!(
            held = self.held.len(),
            "{why}: holding every key until the recovery window ends"
        );
        self.hold_all
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Time left in the crash-recovery window, if any key is held.
    pub fn recovering_for(&self) -> Option<Duration> {
        let until = self.recovering_until?;
        let left = until.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// Keys held since the start by the crash-recovery window (0 once it
    /// has passed). `None`: every key is held (the crashed run kept no
    /// in-flight marks).
    pub fn held_keys(&self) -> Option<usize> {
        match (self.recovering_for(), self.holds_all()) {
            (None, _) => Some(0),
            (Some(_), true) => None,
            (Some(_), false) => Some(self.held.len()),
        }
    }

    /// Time left in the key's crash hold, if it is held.
    pub(super) fn held_for(&self, st: &GateState, now: Instant) -> Option<Duration> {
        let until = match (self.holds_all(), st.held_until) {
            (true, _) => self.recovering_until,
            (false, held) => held,
        }?;
        (until > now).then(|| until - now)
    }

    /// While a key's crash hold lasts, refuses a token that is not stale
    /// and is above the lowest token the crashed run may still have had in
    /// flight on it (with every key held, that lowest is unknown: every
    /// token that is not stale). A stale token passes, to get its 409 from
    /// admission; a key whose highest is not in memory (every key is held)
    /// is looked up first for that.
    pub(super) async fn check_held(
        &self,
        key: &Arc<str>,
        gate: &KeyGate,
        token: u64,
    ) -> Result<(), FenceError> {
        if self.recovering_until.is_none() {
            return Ok(());
        }
        let (known, held, lowest) = {
            let st = gate.state.lock().expect("gate lock");
            (
                st.highest,
                self.held_for(&st, Instant::now()),
                st.held_lowest,
            )
        };
        let Some(left) = held else { return Ok(()) };
        let highest = match known {
            Some(h) => Some(h),
            None => {
                let h = self.store.highest(key).await?;
                let mut st = gate.state.lock().expect("gate lock");
                st.highest = st.highest.max(h);
                st.highest
            }
        };
        if highest.is_some_and(|h| token < h) {
            return Ok(());
        }
        if self.holds_all() || token > lowest {
            return Err(FenceError::Recovering { retry_after: left });
        }
        Ok(())
    }

    /// Records a durable mark of the key in its gate and in the cache.
    pub(super) fn record_mark(&self, key: &str, st: &mut GateState, seq: u64) {
        st.mark = st.mark.max(Some(seq));
        self.cache.note_mark(key, seq);
    }

    /// Whether the key has a live mark: at or above the watermark.
    pub(super) fn live(&self, st: &GateState) -> bool {
        st.mark
            .is_some_and(|m| m >= self.watermark.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Raises the watermark to the store's next mark, marking again (in the
    /// same commit) every key with a write in flight and, while the crash
    /// hold lasts, every held key; the marks below die. Returns how many
    /// keys it marked again.
    ///
    /// Why this is safe: the watermark is raised in memory first, so an
    /// admission that decides after it needs a new mark. One that decided
    /// before it entered its write in flight under the gate's lock, which
    /// the scan takes next: the scan finds the write and marks its key
    /// again. Writers on those keys wait for the rotation's commit
    /// (`marking`) instead of writing marks of their own.
    pub async fn rotate_marks(&self) -> Result<usize, FenceError> {
        use std::sync::atomic::Ordering::AcqRel;
        let watermark = self.store.next_mark();
        self.watermark.fetch_max(watermark, AcqRel);
        let mut keys = Vec::new();
        let mut busy = Vec::new();
        for entry in self.gates.iter() {
            let mut st = entry.value().state.lock().expect("gate lock");
            // The oldest write in flight: a crash now must hold newer ones
            // off until it can no longer be in flight.
            if let Some(&(lowest, _)) = st.inflight.keys().next() {
                st.marking = true;
                keys.push((entry.key().to_string(), lowest));
                busy.push((entry.key().clone(), entry.value().clone()));
            }
        }
        if self.recovering_for().is_some() {
            keys.extend(self.held.iter().map(|h| (h.key().to_string(), h.value().1)));
        } else if !self.held.is_empty() {
            self.held.clear();
        }
        let answer = self.store.rotate_marks(keys, watermark).await;
        for (i, (key, gate)) in busy.iter().enumerate() {
            {
                let mut st = gate.state.lock().expect("gate lock");
                st.marking = false;
                if let Ok(seqs) = &answer {
                    self.record_mark(key, &mut st, seqs[i]);
                }
            }
            gate.changed.notify_waiters();
        }
        let marked = busy.len();
        for (key, gate) in busy {
            drop(gate);
            self.release_gate(&key);
        }
        answer?;
        Ok(marked)
    }

    /// Waits (at most `bound`) for the shared-store lease releases under
    /// way; a second release some take later, for an acquire that may
    /// still be applied, is left to expire if the bound ends first.
    pub async fn settle(&self, bound: Duration) {
        self.releases.close();
        let _ = tokio::time::timeout(bound, self.releases.wait()).await;
    }

    /// Rotates the marks every [`ROTATE_EVERY`] until `stop`; the server
    /// owns it.
    pub async fn keep_marks(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        if !self.store.exclusive() {
            return self.sweep_registrations(stop).await;
        }
        let mut tick = tokio::time::interval(ROTATE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {
                    if let Err(e) = self.rotate_marks().await {
                        tracing::warn!(error = %e, "could not rotate the in-flight marks; writes mark their keys anew");
                    }
                }
            }
        }
    }

    /// Writes a mark of the key (the gate is `marking`), as its own task
    /// for the same reason as [`advance`](Self::advance): a client hanging
    /// up must not leave the gate marking.
    pub(super) async fn mark(
        self: &Arc<Self>,
        key: &Arc<str>,
        gate: &Arc<KeyGate>,
        token: u64,
    ) -> Result<(), FenceError> {
        let fence = self.clone();
        let key = key.clone();
        let gate = gate.clone();
        let task = tokio::spawn(async move {
            let answer = fence.store.mark_in_flight(&key, token).await;
            {
                let mut st = gate.state.lock().expect("gate lock");
                st.marking = false;
                if let Ok(seq) = answer {
                    fence.record_mark(&key, &mut st, seq);
                }
            }
            gate.changed.notify_waiters();
            drop(gate);
            fence.release_gate(&key);
            answer.map(|_| ())
        });
        joined(task.await)
    }
}
