//! The writer's fast path: a batch of advances, marks, rotations and reads
//! answered from memory and the table, its changes made durable by one
//! append to the write-ahead log, and the log frozen for a checkpoint
//! once it is long enough.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use redb::{ReadOnlyTable, ReadableDatabase};

use crate::store::api::{Advance, StoreError};

use super::checkpoint;
use super::ops::*;
use super::schema::*;
use super::wal::{Record, CHECKPOINT_BYTES};
use super::writer::Writer;

/// A log this far past its checkpoint size (its checkpoint has not kept
/// up) is checkpointed by the writer itself before the next batch.
const LAG_BYTES: u64 = 4 * CHECKPOINT_BYTES;

impl Writer {
    /// Whether the batch may be logged: only advances, marks, rotations and
    /// reads, on a healthy, open store whose log needs no checkpoint of
    /// the writer's own.
    pub(super) fn loggable(&self, batch: &[Op]) -> bool {
        self.healthy.load(Ordering::Acquire)
            && !self.closed
            && !self.must_checkpoint
            && self.wal.len < LAG_BYTES
            && batch.iter().all(|op| {
                matches!(
                    op,
                    Op::Advance { .. }
                        | Op::AdvanceMarked { .. }
                        | Op::Mark { .. }
                        | Op::Get { .. }
                        | Op::Rotate { .. }
                )
            })
    }

    /// The highest token of `key`: logged, frozen, or in the table.
    fn highest_of(
        &self,
        table: &ReadOnlyTable<&str, u64>,
        key: &str,
    ) -> Result<Option<u64>, StoreError> {
        if let Some(t) = self.logged.raised.get(key) {
            return Ok(Some(*t));
        }
        if let Some(t) = self.frozen.as_ref().and_then(|f| f.raised.get(key)) {
            return Ok(Some(*t));
        }
        Ok(table.get(key).map_err(|e| self.fail(e))?.map(|v| v.value()))
    }

    /// Answers a loggable batch and makes its raises and marks durable
    /// with one append to the log. As in
    /// [`try_apply`](Self::try_apply), nothing is answered before the
    /// sync, and a batch that raised and marked nothing writes nothing.
    pub(super) fn try_log(&mut self, batch: &[Op]) -> Result<Vec<Answer>, StoreError> {
        let db = self.db()?;
        let read = db.begin_read().map_err(|e| self.fail(e))?;
        let table = read.open_table(FENCES).map_err(|e| self.fail(e))?;
        let mut answers = Vec::with_capacity(batch.len());
        self.wal.clear_staged();
        let marks_before = self.logged.marks.len();
        let mut next = self.next_mark.load(Ordering::Relaxed);
        let mut rotated: Option<u64> = None;
        for op in batch {
            let answer = match op {
                Op::Advance { key, token, .. } | Op::AdvanceMarked { key, token, .. } => {
                    let token = *token;
                    let advance = match self.highest_of(&table, key)? {
                        Some(h) if h > token => Advance::Stale { highest: h },
                        Some(h) if h == token => Advance::Equal,
                        previous => {
                            // Kept if the append fails: a raise that may
                            // be on disk anyway is kept, as a failed
                            // commit's is (the write was refused, not
                            // forwarded).
                            self.logged.raised.insert(key.clone(), token);
                            self.wal.stage(&Record::Raise {
                                key: key.as_str(),
                                token,
                            });
                            Advance::Raised { previous }
                        }
                    };
                    if let Op::AdvanceMarked { .. } = op {
                        Answer::Marked(advance, self.log_mark(&mut next, key, token))
                    } else {
                        Answer::Advance(advance)
                    }
                }
                Op::Mark { key, token, .. } => Answer::Seq(self.log_mark(&mut next, key, *token)),
                Op::Rotate {
                    keys, watermark, ..
                } => {
                    // The keys still in flight marked again above the
                    // watermark, then the watermark; the dead marks are
                    // dropped once the append is durable.
                    let seqs = keys
                        .iter()
                        .map(|(key, token)| self.log_mark(&mut next, key, *token))
                        .collect();
                    self.wal.stage(&Record::<&str>::Watermark(*watermark));
                    rotated = rotated.max(Some(*watermark));
                    Answer::Seqs(seqs)
                }
                Op::Get { key, .. } => Answer::Token(self.highest_of(&table, key)?),
                _ => unreachable!("only loggable operations reach try_log"),
            };
            answers.push(answer);
        }
        // Published before the sync, as in `try_apply`: an append that
        // fails may still have reached the disk.
        self.next_mark.store(next, Ordering::Release);
        if !self.wal.has_staged() {
            return Ok(answers);
        }
        if let Err(e) = self.wal.append_staged() {
            self.logged.marks.truncate(marks_before);
            self.must_checkpoint = true;
            return Err(self.fail(e));
        }
        self.commits.fetch_add(1, Ordering::Relaxed);
        let added = (self.logged.marks.len() - marks_before) as u64;
        let removed = match rotated {
            Some(w) => self.drop_dead_marks(&read, w),
            None => 0,
        };
        let now = self.marks.load(Ordering::Relaxed) + added;
        self.marks
            .store(now.saturating_sub(removed), Ordering::Relaxed);
        drop((table, read));
        self.freeze_if_long();
        Ok(answers)
    }

    /// A rotation to `w` is durable: drops the logged marks below it and
    /// counts every mark below it once (logged, frozen, or in the table;
    /// those two never overlap: a checkpoint adds only the frozen marks,
    /// all numbered above what the table held before).
    ///
    /// The rotation is durable by now, so nothing here fails the batch: a
    /// table that cannot be read only leaves the gauge high.
    fn drop_dead_marks(&mut self, read: &redb::ReadTransaction, w: u64) -> u64 {
        self.logged.watermark = self.logged.watermark.max(Some(w));
        let before = self.logged.marks.len();
        self.logged.marks.retain(|(seq, _, _)| *seq >= w);
        let mut removed = (before - self.logged.marks.len()) as u64;
        if w > self.dead_counted {
            let from = self.dead_counted;
            let mut table_below = w;
            if let Some(f) = &self.frozen {
                removed += f
                    .marks
                    .iter()
                    .filter(|(seq, _, _)| (from..w).contains(seq))
                    .count() as u64;
                if let Some((first, _, _)) = f.marks.first() {
                    table_below = table_below.min(*first);
                }
            }
            if table_below > from {
                let dead = read
                    .open_table(MARKS)
                    .and_then(|marks| Ok(marks.range(from..table_below)?.count()));
                match dead {
                    Ok(n) => removed += n as u64,
                    Err(e) => {
                        tracing::warn!(error = %e, "could not count the dead in-flight marks")
                    }
                }
            }
            self.dead_counted = w;
        }
        removed
    }

    /// Logs a mark of `key` and returns its sequence number.
    fn log_mark(&mut self, next: &mut u64, key: &str, token: u64) -> u64 {
        let seq = *next;
        *next += 1;
        self.wal.stage(&Record::Mark { seq, key, token });
        self.logged.marks.push((seq, token, key.to_string()));
        seq
    }

    /// Freezes a log past its checkpoint size, if no checkpoint runs: the
    /// next generation is logged in the other file while a thread writes
    /// this one into the table.
    fn freeze_if_long(&mut self) {
        if self.wal.len < CHECKPOINT_BYTES
            || self.checkpointing.is_some()
            || self.frozen.is_some()
            || self.must_checkpoint
        {
            return;
        }
        let Some(db) = self.db.clone() else {
            return;
        };
        let frozen = Arc::new(std::mem::take(&mut self.logged));
        let next = self.wal.next_generation();
        self.wal.move_on();
        self.frozen = Some(frozen.clone());
        match checkpoint::start(db, frozen, next) {
            Ok(handle) => self.checkpointing = Some(handle),
            Err(e) => {
                // The writer's next commit writes the frozen changes.
                tracing::error!(error = %e, "could not start a fence store checkpoint");
                self.must_checkpoint = true;
            }
        }
    }
}
