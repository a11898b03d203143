//! Checkpoints: what the log holds, written into the table by a durable
//! commit, after which the log's older generations are redundant.
//!
//! A log past [`CHECKPOINT_BYTES`](super::wal::CHECKPOINT_BYTES) is
//! *frozen*: the writer moves its logged changes into an [`Arc`], goes on
//! logging the next generation in the other file, and a thread of the
//! checkpoint's own writes the frozen changes into the table, so that
//! advances are not held up by a B-tree commit of many keys. Reads see the
//! logged changes, then the frozen ones, then the table. Anything that
//! needs a write transaction of the writer's own waits for a running
//! checkpoint first (redb has one writer at a time, and generations must
//! be committed in order).

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use redb::{Database, Table};

use crate::store::api::StoreError;

use super::schema::*;

/// Changes logged since a checkpoint, not yet in the table.
#[derive(Default)]
pub(super) struct Logged {
    /// Raised keys and their new highest: the truth where the table is
    /// behind.
    pub(super) raised: HashMap<String, u64>,
    /// Marks: (sequence number, token, key), in rising order.
    pub(super) marks: Vec<(u64, u64, String)>,
    /// The highest watermark logged: the marks below it are dead.
    pub(super) watermark: Option<u64>,
}

impl Logged {
    pub(super) fn is_empty(&self) -> bool {
        self.raised.is_empty() && self.marks.is_empty() && self.watermark.is_none()
    }

    /// Writes the changes into a write transaction's tables: the dead
    /// marks dropped first, then the raises in key order (each of the
    /// table's pages copied once however many of its keys were raised),
    /// then the marks.
    pub(super) fn write_to(
        &self,
        fences: &mut Table<&str, u64>,
        marks: &mut Table<u64, (u64, &str)>,
        meta: &mut Table<&str, u64>,
    ) -> Result<(), redb::StorageError> {
        if let Some(w) = self.watermark {
            meta.insert(WATERMARK_KEY, w)?;
            marks.retain_in(..w, |_, _| false)?;
        }
        let mut raised: Vec<_> = self.raised.iter().collect();
        raised.sort_unstable();
        for (key, token) in raised {
            fences.insert(key.as_str(), *token)?;
        }
        for (seq, token, key) in &self.marks {
            marks.insert(*seq, (*token, key.as_str()))?;
        }
        Ok(())
    }
}

/// Held by a test, checkpoints wait: what is frozen stays out of the
/// table, as if a crash came before the checkpoint's commit.
#[cfg(test)]
pub(super) static HOLD: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Starts the checkpoint of `frozen` on a thread of its own: its changes
/// and `next_generation` (the oldest generation the table then lacks) in
/// one durable commit.
pub(super) fn start(
    db: Arc<Database>,
    frozen: Arc<Logged>,
    next_generation: u64,
) -> std::io::Result<JoinHandle<Result<(), StoreError>>> {
    std::thread::Builder::new()
        .name("fencegate-checkpoint".into())
        .spawn(move || {
            #[cfg(test)]
            let _held = HOLD.blocking_read();
            let fail = |e: &dyn std::fmt::Display| StoreError::Unavailable(e.to_string());
            let txn = db.begin_write().map_err(|e| fail(&e))?;
            {
                let mut fences = txn.open_table(FENCES).map_err(|e| fail(&e))?;
                let mut marks = txn.open_table(MARKS).map_err(|e| fail(&e))?;
                let mut meta = txn.open_table(META).map_err(|e| fail(&e))?;
                frozen
                    .write_to(&mut fences, &mut marks, &mut meta)
                    .map_err(|e| fail(&e))?;
                meta.insert(WAL_GENERATION_KEY, next_generation)
                    .map_err(|e| fail(&e))?;
                // Raises and marks in the table: a crash from here on must
                // be seen, even after a clean-stop mark whose commit
                // failed but reached the disk (no clean stop can have
                // succeeded: it waits for this checkpoint first).
                meta.insert(CLEAN_KEY, 0).map_err(|e| fail(&e))?;
            }
            txn.commit().map_err(|e| fail(&e))
        })
}
