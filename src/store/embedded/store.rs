//! [`EmbeddedStore`]: the [`FenceStore`] over the writer thread, with a
//! courier per runtime slot.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::oneshot;

use crate::store::api::{Advance, Claim, CrashedKey, FenceStore, Lock, StartState, StoreError};

use super::ops::*;
use super::schema::*;
use super::writer::*;

/// The redb-backed [`FenceStore`].
pub struct EmbeddedStore {
    pub(super) ops: mpsc::Sender<(Op, Option<Courier>)>,
    /// One courier per runtime slot ([`crate::slot::slot`]).
    pub(super) couriers: dashmap::DashMap<usize, Courier>,
    pub(super) start: StartState,
    /// Keys marked in flight when the last run stopped uncleanly (`None`:
    /// that run kept no marks).
    pub(super) in_flight_at_crash: Option<Vec<CrashedKey>>,
    pub(super) key_mapping_at_open: Option<u64>,
    pub(super) healthy: Arc<AtomicBool>,
    /// Durable commits (fsyncs) so far: group commit makes this grow slower
    /// than the number of advances.
    pub(super) commits: Arc<AtomicU64>,
    /// In-flight marks in the file as of the last commit.
    pub(super) marks: Arc<AtomicU64>,
    /// The sequence number the next mark gets.
    pub(super) next_mark: Arc<AtomicU64>,
    pub(super) writer: std::sync::Mutex<Option<JoinHandle<()>>>,
}

/// Names log files left beside the name the store was given, when that
/// name is a link to the file: an older fencegate kept its log there.
fn with_hint(e: OpenError, given: &Path, resolved: &Path) -> OpenError {
    match e {
        OpenError::LogLost {
            path,
            problem,
            logs,
            ..
        } if given != resolved => {
            let there: Vec<String> = super::wal::paths(given)
                .iter()
                .filter(|p| p.exists())
                .map(|p| p.display().to_string())
                .collect();
            let hint = if there.is_empty() {
                String::new()
            } else {
                format!(
                    "; log files are beside the link {} ({}): an older fencegate kept them there, move them beside the store file",
                    given.display(),
                    there.join(", ")
                )
            };
            OpenError::LogLost {
                path,
                problem,
                logs,
                hint,
            }
        }
        e => e,
    }
}

impl EmbeddedStore {
    /// Opens (or creates) the store file. `cache_bytes` bounds redb's page
    /// cache; `recovery_window` (the longest upstream timeout) is recorded
    /// for the next start. Refuses a file locked by another process, a
    /// corrupt file, a file of an unknown format version, or a file whose
    /// write-ahead log is not with it ([`OpenError::LogLost`]).
    pub fn open(
        path: &Path,
        cache_bytes: usize,
        recovery_window: Duration,
    ) -> Result<Self, OpenError> {
        Self::open_with(path, cache_bytes, recovery_window, false)
    }

    /// [`open`](Self::open); with `accept_loss`, a file whose log is lost
    /// opens anyway (the operator's `--accept-store-reset`): the log is set
    /// aside and every key is held for the recovery window.
    pub fn open_with(
        given: &Path,
        cache_bytes: usize,
        recovery_window: Duration,
        accept_loss: bool,
    ) -> Result<Self, OpenError> {
        let path = &super::identity::resolve(given).map_err(|e| OpenError::Io {
            path: given.to_path_buf(),
            reason: e.to_string(),
        })?;
        let wal_paths = super::wal::paths(path);
        let table = super::identity::before_create(path, &wal_paths, accept_loss)
            .map_err(|e| OpenError::Io {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?
            .map_err(|lost| OpenError::TableLost {
                path: path.to_path_buf(),
                problem: lost.problem,
            })?;
        super::identity::create_whole(path).map_err(|e| OpenError::Io {
            path: path.to_path_buf(),
            reason: format!("cannot create the store file: {e}"),
        })?;
        let db = open_db(path, cache_bytes)?;
        let lost = matches!(table, super::identity::Table::Accepted);
        let found = init_meta(&db, path, &wal_paths, recovery_window, accept_loss, lost)
            .map_err(|e| with_hint(e, given, path))?;
        let wal = bind_log(&db, path, &wal_paths, &found.bind, found.generation)?;
        super::identity::reset_done(path).map_err(|e| OpenError::Io {
            path: path.to_path_buf(),
            reason: format!("cannot end the accepted reset: {e}"),
        })?;
        let (tx, rx) = mpsc::channel();
        let healthy = Arc::new(AtomicBool::new(true));
        let commits = Arc::new(AtomicU64::new(0));
        let marks = Arc::new(AtomicU64::new(found.marks));
        let next_mark = Arc::new(AtomicU64::new(found.next_mark));
        let worker = Writer {
            marks: marks.clone(),
            next_mark: next_mark.clone(),
            db: Some(Arc::new(db)),
            path: path.to_path_buf(),
            cache_bytes,
            healthy: healthy.clone(),
            commits: commits.clone(),
            closed: false,
            last_probe: None,
            wal,
            logged: Default::default(),
            frozen: None,
            checkpointing: None,
            must_checkpoint: false,
            dead_counted: 0,
        };
        let handle = std::thread::Builder::new()
            .name("fencegate-store".into())
            .spawn(move || worker.run(rx))
            .map_err(|e| OpenError::Io {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            ops: tx,
            couriers: dashmap::DashMap::new(),
            start: found.start,
            in_flight_at_crash: found.in_flight,
            key_mapping_at_open: found.key_mapping,
            healthy,
            commits,
            marks,
            next_mark,
            writer: std::sync::Mutex::new(Some(handle)),
        })
    }

    /// Durable commits since open.
    pub fn commit_count(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    pub(super) async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.ops
            .send((make(tx), self.courier()))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    pub(super) async fn lock(&self, key: &str, op: LockOp) -> Result<LockAnswer, StoreError> {
        let key = key.to_string();
        self.call(|reply| Op::Lock { key, op, reply }).await
    }

    /// The courier of the calling runtime, started on first use. `None`
    /// outside a runtime: the writer then answers directly.
    pub(super) fn courier(&self) -> Option<Courier> {
        tokio::runtime::Handle::try_current().ok()?;
        let slot = crate::slot::slot();
        if let Some(c) = self.couriers.get(&slot) {
            if !c.is_closed() {
                return Some(c.clone());
            }
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Answers>();
        tokio::spawn(async move {
            while let Some(answers) = rx.recv().await {
                for (op, answer) in answers {
                    op.answer(answer);
                }
            }
        });
        self.couriers.insert(slot, tx.clone());
        Some(tx)
    }
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        // Closing the channel ends the writer loop; wait so the file lock is
        // released before a reopen in the same process.
        let (dead_tx, _) = mpsc::channel::<(Op, Option<Courier>)>();
        self.ops = dead_tx;
        if let Some(h) = self.writer.lock().ok().and_then(|mut g| g.take()) {
            let _ = h.join();
        }
    }
}

#[async_trait]
impl FenceStore for EmbeddedStore {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    fn exclusive(&self) -> bool {
        true
    }

    fn start_state(&self) -> StartState {
        self.start
    }

    async fn highest(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let key = key.to_string();
        self.call(|reply| Op::Get { key, reply }).await
    }

    async fn advance(&self, key: &str, token: u64) -> Result<Advance, StoreError> {
        let key = key.to_string();
        self.call(|reply| Op::Advance { key, token, reply }).await
    }

    async fn advance_marked(&self, key: &str, token: u64) -> Result<(Advance, u64), StoreError> {
        let key = key.to_string();
        self.call(|reply| Op::AdvanceMarked { key, token, reply })
            .await
    }

    async fn mark_in_flight(&self, key: &str, token: u64) -> Result<u64, StoreError> {
        let key = key.to_string();
        self.call(|reply| Op::Mark { key, token, reply }).await
    }

    fn next_mark(&self) -> u64 {
        self.next_mark.load(Ordering::Acquire)
    }

    async fn rotate_marks(
        &self,
        keys: Vec<(String, u64)>,
        watermark: u64,
    ) -> Result<Vec<u64>, StoreError> {
        self.call(|reply| Op::Rotate {
            keys,
            watermark,
            reply,
        })
        .await
    }

    fn key_mapping_at_open(&self) -> Option<u64> {
        self.key_mapping_at_open
    }

    async fn record_key_mapping(&self, fingerprint: u64) -> Result<(), StoreError> {
        self.call(|reply| Op::KeyMapping { fingerprint, reply })
            .await
    }

    fn in_flight_at_crash(&self) -> Option<Vec<CrashedKey>> {
        self.in_flight_at_crash.clone()
    }

    fn in_flight_marks(&self) -> u64 {
        self.marks.load(Ordering::Relaxed)
    }

    async fn forget(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let key = key.to_string();
        self.call(|reply| Op::Forget { key, reply }).await
    }

    async fn claim_lock(
        &self,
        key: &str,
        id: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let op = LockOp::Claim {
            id: id.to_string(),
            holder: holder.to_string(),
            ttl,
        };
        match self.lock(key, op).await? {
            LockAnswer::Claim(c) => Ok(c),
            _ => Err(StoreError::Closed),
        }
    }

    async fn read_lock(&self, key: &str) -> Result<Option<Lock>, StoreError> {
        match self.lock(key, LockOp::Read).await? {
            LockAnswer::Lock(l) => Ok(l),
            _ => Err(StoreError::Closed),
        }
    }

    async fn renew_lock(
        &self,
        key: &str,
        id: &str,
        ttl: Duration,
    ) -> Result<Option<Lock>, StoreError> {
        let op = LockOp::Renew {
            id: id.to_string(),
            ttl,
        };
        match self.lock(key, op).await? {
            LockAnswer::Lock(l) => Ok(l),
            _ => Err(StoreError::Closed),
        }
    }

    async fn release_lock(&self, key: &str, id: &str) -> Result<bool, StoreError> {
        let op = LockOp::Release { id: id.to_string() };
        match self.lock(key, op).await? {
            LockAnswer::Released(r) => Ok(r),
            _ => Err(StoreError::Closed),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        if self.healthy.load(Ordering::Acquire) {
            return Ok(());
        }
        self.call(|reply| Op::Ping { reply }).await
    }

    async fn close_clean(&self) -> Result<(), StoreError> {
        self.call(|reply| Op::CloseClean { reply }).await
    }
}
