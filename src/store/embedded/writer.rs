//! The writer thread: takes everything queued and makes it durable at
//! once (group commit). A batch of advances, marks, rotations and reads is
//! logged (`logged.rs`). Anything else (leases, forgets, a clean stop), a
//! log grown far past its size, or a failure first waits for a running
//! checkpoint, then writes what is logged into a write transaction of the
//! table, applies the batch in it and commits once
//! ([`Writer::try_apply`]); a batch that changed nothing is aborted.
//! Probes the disk when a commit fails.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Instant;

use redb::{Database, ReadableTable};

use crate::clock::{lease_end, wall_ms};
use crate::store::api::{Advance, Claim, Lock, StoreError};

use super::checkpoint::Logged;
use super::ops::*;
use super::schema::*;
use super::wal::Wal;

/// What the operations of a batch applied in a write transaction ask of
/// its commit ([`Writer::try_apply`]).
#[derive(Default)]
struct Effects {
    /// A change that only the commit makes durable: a raise, a mark, a
    /// rotation, a lease change, a forget, the log's checkpoint. The batch
    /// must commit before any answer leaves.
    changed: bool,
    /// A raise or a mark (the log's included): a crash from this commit on
    /// must be seen at the next start, so the clean-stop flag is cleared.
    arms_crash_detection: bool,
    /// A clean stop is recorded in this batch: the advances, marks and
    /// claims after it are refused.
    closing: bool,
}

impl Effects {
    /// A raise or a mark.
    fn raise(&mut self) {
        self.changed = true;
        self.arms_crash_detection = true;
    }

    /// Any other change to commit.
    fn change(&mut self) {
        self.changed = true;
    }
}

pub(super) struct Writer {
    /// `None` after a failed commit until a reopen succeeds. Shared with
    /// a running checkpoint.
    pub(super) db: Option<Arc<Database>>,
    pub(super) path: PathBuf,
    pub(super) cache_bytes: usize,
    pub(super) healthy: Arc<AtomicBool>,
    pub(super) commits: Arc<AtomicU64>,
    pub(super) marks: Arc<AtomicU64>,
    pub(super) next_mark: Arc<AtomicU64>,
    /// Set once a clean stop is recorded: no write may follow it.
    pub(super) closed: bool,
    /// When the store last probed for room (while unhealthy).
    pub(super) last_probe: Option<Instant>,
    pub(super) wal: Wal,
    /// Logged in the current generation.
    pub(super) logged: Logged,
    /// The previous generation, while its checkpoint runs (or failed).
    pub(super) frozen: Option<Arc<Logged>>,
    pub(super) checkpointing: Option<JoinHandle<Result<(), StoreError>>>,
    /// A commit, an append or a checkpoint failed: part of it may be on
    /// disk, so nothing is logged again before a commit of the writer's
    /// own has moved the log to a new generation.
    pub(super) must_checkpoint: bool,
    /// The table's marks below this are already counted as gone from
    /// [`marks`](Self::marks).
    pub(super) dead_counted: u64,
}

impl Writer {
    pub(super) fn run(mut self, rx: mpsc::Receiver<(Op, Option<Courier>)>) {
        let mut batch = Vec::new();
        let mut couriers = Vec::new();
        loop {
            // While unhealthy, nothing may come to heal the store: probe
            // once a second by itself.
            let next = if self.healthy.load(Ordering::Acquire) || self.closed {
                rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
            } else {
                rx.recv_timeout(PROBE_EVERY)
            };
            self.finish_checkpoint(false);
            let (op, courier) = match next {
                Ok(next) => next,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = self.probe();
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // The file lock goes with the last handle.
                    self.finish_checkpoint(true);
                    break;
                }
            };
            batch.push(op);
            couriers.push(courier);
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok((op, courier)) => {
                        batch.push(op);
                        couriers.push(courier);
                    }
                    Err(_) => break,
                }
            }
            let answers = self.apply(&batch);
            deliver(batch.drain(..), couriers.drain(..), answers);
        }
    }

    pub(super) fn fail(&self, e: impl std::fmt::Display) -> StoreError {
        self.healthy.store(false, Ordering::Release);
        StoreError::Unavailable(e.to_string())
    }

    /// After an I/O failure redb refuses further work on the handle; reopen
    /// the file so the store heals when the disk does.
    pub(super) fn db(&mut self) -> Result<&Arc<Database>, StoreError> {
        if self.db.is_none() {
            // A running checkpoint holds the old handle (and the lock).
            self.finish_checkpoint(true);
            let db = open_db(&self.path, self.cache_bytes).map_err(|e| self.fail(e))?;
            self.db = Some(Arc::new(db));
        }
        Ok(self.db.as_ref().expect("just set"))
    }

    /// Reaps a checkpoint that has ended (or waits for it): the frozen
    /// generation is then in the table, or, if it failed, left for the
    /// writer's next commit.
    pub(super) fn finish_checkpoint(&mut self, wait: bool) {
        let Some(handle) = self.checkpointing.take_if(|h| wait || h.is_finished()) else {
            return;
        };
        match handle.join() {
            Ok(Ok(())) => {
                self.frozen = None;
                self.commits.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "fence store checkpoint failed");
                self.must_checkpoint = true;
                // redb refuses further work on a handle after an I/O
                // failure: the next commit reopens the file.
                self.db = None;
            }
            Err(_) => {
                tracing::error!("fence store checkpoint panicked");
                self.must_checkpoint = true;
                self.db = None;
            }
        }
    }

    /// Proves that the disk takes writes again: [`PROBE_BYTES`] committed,
    /// then removed in a commit of its own, so the room is given back. In
    /// transactions of their own, so that the probe never takes a real
    /// batch down with it.
    pub(super) fn probe(&mut self) -> Result<(), StoreError> {
        self.last_probe = Some(Instant::now());
        self.finish_checkpoint(true);
        let result = (|| {
            let db = self.db()?;
            let txn = db.begin_write().map_err(|e| self.fail(e))?;
            {
                let mut t = txn.open_table(PROBE).map_err(|e| self.fail(e))?;
                t.insert("room", vec![0x5a_u8; PROBE_BYTES].as_slice())
                    .map_err(|e| self.fail(e))?;
            }
            txn.commit().map_err(|e| self.fail(e))?;
            let db = self.db()?;
            let txn = db.begin_write().map_err(|e| self.fail(e))?;
            txn.delete_table(PROBE).map_err(|e| self.fail(e))?;
            txn.commit().map_err(|e| self.fail(e))?;
            self.commits.fetch_add(2, Ordering::Relaxed);
            // The log needs room too: the next append may grow it.
            self.wal.reserve().map_err(|e| self.fail(e))
        })();
        match &result {
            Ok(()) => self.healthy.store(true, Ordering::Release),
            Err(e) => {
                tracing::warn!(error = %e, "fence store still cannot write");
                self.db = None;
            }
        }
        result
    }

    /// Each operation's answer, in batch order.
    pub(super) fn apply(&mut self, batch: &[Op]) -> Vec<Result<Answer, StoreError>> {
        let result = if self.loggable(batch) {
            self.try_log(batch)
        } else {
            self.try_apply(batch)
        };
        match result {
            Ok(answers) => {
                // While the store is unhealthy, a readiness check probes at
                // once, and the writer itself once a second, so the store
                // heals whether or not anything asks /readyz.
                let ping = batch.iter().any(|op| matches!(op, Op::Ping { .. }));
                let due = self.last_probe.is_none_or(|at| at.elapsed() >= PROBE_EVERY);
                let probed =
                    if !self.healthy.load(Ordering::Acquire) && !self.closed && (ping || due) {
                        self.probe().err()
                    } else {
                        None
                    };
                batch
                    .iter()
                    .zip(answers)
                    .map(|(op, answer)| match (op, &probed) {
                        (Op::Ping { .. }, Some(e)) => Err(e.clone()),
                        _ => Ok(answer),
                    })
                    .collect()
            }
            Err(e) => {
                // Every waiter gets the real cause (it reaches the log and
                // the 503's detail), not a closed channel.
                tracing::error!(error = %e, ops = batch.len(), "fence store commit failed");
                self.must_checkpoint = true;
                self.finish_checkpoint(true);
                self.db = None;
                batch.iter().map(|_| Err(e.clone())).collect()
            }
        }
    }

    /// Applies a batch in one transaction and returns each operation's
    /// answer, to be sent only once the commit is durable (nothing is
    /// acknowledged before the fsync). The batch itself is left in place so
    /// that, on error, every operation in it can be answered with the error.
    ///
    /// Durability, in one place: the batch commits if it changed anything
    /// ([`Effects::changed`]) or must reach the disk anyway (`forced`), and
    /// the answers are returned only after that commit; a batch that did
    /// neither is aborted, and answers what it read.
    pub(super) fn try_apply(&mut self, batch: &[Op]) -> Result<Vec<Answer>, StoreError> {
        let recovering = !self.healthy.load(Ordering::Acquire);
        // A commit that must reach the disk though nothing changed: a
        // probe of a store that failed (a ping), a clean stop, the key
        // mapping.
        let forced = recovering
            || batch.iter().any(|op| {
                matches!(
                    op,
                    Op::Ping { .. } | Op::CloseClean { .. } | Op::KeyMapping { .. }
                )
            });
        let closed = self.closed;
        // Generations are committed in order, one writer at a time.
        self.finish_checkpoint(true);
        let db = self.db()?;
        let txn = db.begin_write().map_err(|e| self.fail(e))?;
        let mut answers = Vec::with_capacity(batch.len());
        let mut fx = Effects::default();
        // Marks added and removed by this batch.
        let (mut added, mut removed) = (0u64, 0u64);
        let mut next = self.next_mark.load(Ordering::Relaxed);
        let mut rotated: Option<u64> = None;
        {
            let mut table = txn.open_table(FENCES).map_err(|e| self.fail(e))?;
            let mut meta = txn.open_table(META).map_err(|e| self.fail(e))?;
            let mut marks = txn.open_table(MARKS).map_err(|e| self.fail(e))?;
            // Only batches with a lease operation open the lease table: the
            // write path pays nothing for the lock service.
            let mut locks = if batch
                .iter()
                .any(|op| matches!(op, Op::Lock { .. } | Op::Forget { .. }))
            {
                Some(txn.open_table(LOCKS).map_err(|e| self.fail(e))?)
            } else {
                None
            };
            // The checkpoint: what was logged goes into this transaction
            // first (the frozen generation, then the current one), so
            // that the batch reads it there. Its marks were counted when
            // they were logged.
            let checkpoint =
                self.frozen.is_some() || !self.logged.is_empty() || self.must_checkpoint;
            for part in self.frozen.as_deref().into_iter().chain([&self.logged]) {
                part.write_to(&mut table, &mut marks, &mut meta)
                    .map_err(|e| self.fail(e))?;
            }
            if checkpoint {
                // Logged raises and marks in the table: a crash from here
                // on must be seen (a clean-stop mark whose commit failed
                // may be on disk).
                fx.raise();
            }
            // Lease expiry is the only use of the wall clock here.
            let now = if locks.is_some() { wall_ms() } else { 0 };
            // Appends a mark and returns its sequence number.
            let mut mark = |marks: &mut redb::Table<u64, (u64, &str)>,
                            key: &str,
                            token: u64|
             -> Result<u64, StoreError> {
                let seq = next;
                marks.insert(seq, (token, key)).map_err(|e| self.fail(e))?;
                next += 1;
                added += 1;
                Ok(seq)
            };
            for op in batch {
                let answer = match op {
                    Op::Advance { .. }
                    | Op::AdvanceMarked { .. }
                    | Op::Mark { .. }
                    | Op::Lock {
                        op: LockOp::Claim { .. },
                        ..
                    } if closed || fx.closing => Answer::Refused,
                    Op::Advance { key, token, .. } | Op::AdvanceMarked { key, token, .. } => {
                        let token = *token;
                        let current = table
                            .get(key.as_str())
                            .map_err(|e| self.fail(e))?
                            .map(|v| v.value());
                        let advance = match current {
                            Some(h) if h > token => Advance::Stale { highest: h },
                            Some(h) if h == token => Advance::Equal,
                            previous => {
                                table
                                    .insert(key.as_str(), token)
                                    .map_err(|e| self.fail(e))?;
                                fx.raise();
                                Advance::Raised { previous }
                            }
                        };
                        if let Op::AdvanceMarked { .. } = op {
                            fx.raise();
                            Answer::Marked(advance, mark(&mut marks, key, token)?)
                        } else {
                            Answer::Advance(advance)
                        }
                    }
                    Op::Mark { key, token, .. } => {
                        fx.raise();
                        Answer::Seq(mark(&mut marks, key, *token)?)
                    }
                    Op::Rotate {
                        keys, watermark, ..
                    } => {
                        // In one commit: the keys still in flight marked
                        // again above the watermark, the watermark, and the
                        // dead marks gone.
                        let mut seqs = Vec::with_capacity(keys.len());
                        for (key, token) in keys {
                            seqs.push(mark(&mut marks, key, *token)?);
                        }
                        meta.insert(WATERMARK_KEY, *watermark)
                            .map_err(|e| self.fail(e))?;
                        rotated = rotated.max(Some(*watermark));
                        marks
                            .retain_in(..*watermark, |_, _| {
                                removed += 1;
                                false
                            })
                            .map_err(|e| self.fail(e))?;
                        fx.change();
                        Answer::Seqs(seqs)
                    }
                    Op::Get { key, .. } => Answer::Token(
                        table
                            .get(key.as_str())
                            .map_err(|e| self.fail(e))?
                            .map(|v| v.value()),
                    ),
                    Op::Lock { key, op, .. } => {
                        let locks = locks.as_mut().expect("opened for lease operations");
                        let held = locks
                            .get(key.as_str())
                            .map_err(|e| self.fail(e))?
                            .map(|v| {
                                let (id, token, holder, exp) = v.value();
                                (
                                    Lock {
                                        id: id.to_string(),
                                        token,
                                        holder: holder.to_string(),
                                        expires_in: crate::clock::lease_left(exp, now),
                                    },
                                    exp,
                                )
                            })
                            .filter(|(_, exp)| *exp > now)
                            .map(|(l, _)| l);
                        match op {
                            LockOp::Claim { id, holder, ttl } => {
                                let current = table
                                    .get(key.as_str())
                                    .map_err(|e| self.fail(e))?
                                    .map(|v| v.value());
                                let next = current.map_or(Some(1), |h| h.checked_add(1));
                                match (held, next) {
                                    // Asked again (a retry): already ours.
                                    (Some(l), _) if &l.id == id => {
                                        Answer::Lock(LockAnswer::Claim(Claim::Granted {
                                            token: l.token,
                                            registered: false,
                                        }))
                                    }
                                    (Some(l), _) => Answer::Lock(LockAnswer::Claim(Claim::Held(l))),
                                    (None, None) => {
                                        Answer::Lock(LockAnswer::Claim(Claim::Exhausted))
                                    }
                                    (None, Some(token)) => {
                                        table
                                            .insert(key.as_str(), token)
                                            .map_err(|e| self.fail(e))?;
                                        let exp = lease_end(now, *ttl);
                                        locks
                                            .insert(
                                                key.as_str(),
                                                (id.as_str(), token, holder.as_str(), exp),
                                            )
                                            .map_err(|e| self.fail(e))?;
                                        fx.raise();
                                        Answer::Lock(LockAnswer::Claim(Claim::Granted {
                                            token,
                                            registered: false,
                                        }))
                                    }
                                }
                            }
                            LockOp::Read => Answer::Lock(LockAnswer::Lock(held)),
                            LockOp::Renew { id, ttl } => match held.filter(|l| &l.id == id) {
                                Some(mut l) => {
                                    let exp = lease_end(now, *ttl);
                                    locks
                                        .insert(
                                            key.as_str(),
                                            (id.as_str(), l.token, l.holder.as_str(), exp),
                                        )
                                        .map_err(|e| self.fail(e))?;
                                    fx.change();
                                    l.expires_in = *ttl;
                                    Answer::Lock(LockAnswer::Lock(Some(l)))
                                }
                                None => Answer::Lock(LockAnswer::Lock(None)),
                            },
                            LockOp::Release { id } => {
                                let mine = held.is_some_and(|l| &l.id == id);
                                if mine {
                                    locks.remove(key.as_str()).map_err(|e| self.fail(e))?;
                                    fx.change();
                                }
                                Answer::Lock(LockAnswer::Released(mine))
                            }
                        }
                    }
                    Op::Forget { key, .. } => {
                        fx.change();
                        if let Some(locks) = locks.as_mut() {
                            locks.remove(key.as_str()).map_err(|e| self.fail(e))?;
                        }
                        Answer::Token(
                            table
                                .remove(key.as_str())
                                .map_err(|e| self.fail(e))?
                                .map(|v| v.value()),
                        )
                    }
                    Op::Ping { .. } => Answer::Done,
                    Op::KeyMapping { fingerprint, .. } => {
                        meta.insert(KEY_MAPPING_KEY, *fingerprint)
                            .map_err(|e| self.fail(e))?;
                        Answer::Done
                    }
                    Op::CloseClean { .. } => {
                        meta.insert(CLEAN_KEY, 1).map_err(|e| self.fail(e))?;
                        fx.closing = true;
                        Answer::Done
                    }
                };
                answers.push(answer);
            }
            if fx.arms_crash_detection && !fx.closing {
                // A raise or a mark after a clean-stop mark (should not
                // happen after a drain) re-arms crash detection; one in
                // front of this batch's clean stop is covered by its drain.
                meta.insert(CLEAN_KEY, 0).map_err(|e| self.fail(e))?;
            }
            if fx.changed || forced {
                // The log's records are in the table from this commit on.
                meta.insert(WAL_GENERATION_KEY, self.wal.next_generation())
                    .map_err(|e| self.fail(e))?;
            }
            if forced && !fx.changed {
                // A write of its own, so that the commit reaches the disk.
                let n = meta
                    .get("probe")
                    .map_err(|e| self.fail(e))?
                    .map_or(0, |v| v.value());
                meta.insert("probe", n.wrapping_add(1))
                    .map_err(|e| self.fail(e))?;
            }
        }
        // Published before the commit: a commit that fails may still have
        // reached the disk, so its numbers are never handed out again. (A
        // batch that failed before this never wrote them.)
        self.next_mark.store(next, Ordering::Release);
        if fx.changed || forced {
            if let Err(e) = txn.commit() {
                self.must_checkpoint = true;
                return Err(self.fail(e));
            }
            self.commits.fetch_add(1, Ordering::Relaxed);
            self.logged = Logged::default();
            self.frozen = None;
            if let Some(w) = rotated {
                self.dead_counted = self.dead_counted.max(w);
            }
            self.wal.move_on();
            if let Err(e) = self.wal.mark_generation() {
                // Only the check of a table restored alone is weaker.
                tracing::warn!(error = %e, "could not mark the write-ahead log's generation");
            }
            self.must_checkpoint = false;
            let now = self.marks.load(Ordering::Relaxed) + added;
            self.marks
                .store(now.saturating_sub(removed), Ordering::Relaxed);
            // Only a probe of real size proves that the disk has room
            // again (see `apply`); a small batch that happens to commit
            // does not.
            if !recovering {
                self.healthy.store(true, Ordering::Release);
            }
        } else {
            txn.abort().map_err(|e| self.fail(e))?;
        }
        // Only a durable clean mark closes the store to further advances.
        self.closed |= fx.closing;
        Ok(answers)
    }
}
