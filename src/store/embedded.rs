//! The default store: a redb file on local disk, with group commit.
//!
//! Every operation goes to one writer thread. It takes everything queued,
//! applies it in a single write transaction and commits once, so concurrent
//! advances on many keys share one fsync. A batch that raised nothing is
//! aborted: steady tokens cost no disk write. The file is locked by redb
//! against a second process; a `meta` table carries our format version and a
//! clean-stop flag used for crash recovery, and an `in_flight_log` table the
//! keys that may have a write in flight, so that after a crash only those
//! keys wait for the crashed run's writes. The log is keyed by a sequence
//! number: a mark is an append at its right edge and marks die wholesale
//! below a watermark, so a commit touches a few pages of it however random
//! the keys are.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redb::{Database, DatabaseError, ReadableTable, TableDefinition};
use tokio::sync::oneshot;

use crate::clock::{lease_end, wall_ms};

use super::api::{Advance, Claim, CrashedKey, FenceStore, Lock, StartState, StoreError};

const FENCES: TableDefinition<&str, u64> = TableDefinition::new("fences");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// The lock service's leases: key -> (lease id, token, holder, expiry in ms
/// since the Unix epoch on this host's clock, which must survive a restart).
const LOCKS: TableDefinition<&str, (&str, u64, &str, u64)> = TableDefinition::new("leases");
/// In-flight marks: sequence number -> (the token of the write it was made
/// for, key). Marks below the watermark ([`WATERMARK_KEY`]) are dead.
const MARKS: TableDefinition<u64, (u64, &str)> = TableDefinition::new("in_flight_log");
const WATERMARK_KEY: &str = "in_flight_watermark";
/// Set (1) by every run that keeps in-flight marks. A crashed run that did
/// not (an older fencegate) recorded none, so every key must wait.
const MARKS_KEY: &str = "in_flight_marks";
const FORMAT_VERSION_KEY: &str = "format_version";
const CLEAN_KEY: &str = "clean_stop";
/// The fingerprint of the key mapping that writes in flight were admitted
/// under ([`FenceStore::record_key_mapping`]).
const KEY_MAPPING_KEY: &str = "key_mapping";
/// The crash-recovery window (ms) of the process that has the store open, so
/// that a restart with a shorter upstream timeout still waits long enough.
const WINDOW_KEY: &str = "recovery_window_ms";
/// Bumped when the on-disk layout changes; a file from a newer version is
/// refused rather than misread.
pub const FORMAT_VERSION: u64 = 1;
/// Upper bound on operations per transaction, so one batch's latency stays
/// bounded under a flood.
const MAX_BATCH: usize = 8192;
/// While the store is unhealthy, a readiness probe commits this many bytes
/// (then removes them) before it says the store takes writes again. A probe
/// of a few bytes can fit in a file's free pages on a disk that has no room
/// for a real batch (a long key, its mark), and readiness would say "ready"
/// while writes still fail.
const PROBE_BYTES: usize = 256 * 1024;
const PROBE: TableDefinition<&str, &[u8]> = TableDefinition::new("probe");
/// How often the writer probes by itself while the store is unhealthy.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Why the embedded store could not be opened. These stop the start.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("store file {0} is in use by another process (is another fencegate running?)")]
    Locked(PathBuf),
    #[error("store file {path} is corrupt or not a fencegate store: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("store file {path} has format version {found}; this fencegate reads version {FORMAT_VERSION} (upgrade fencegate)")]
    UnknownVersion { path: PathBuf, found: u64 },
    #[error("cannot open store file {path}: {reason}")]
    Io { path: PathBuf, reason: String },
}

enum Op {
    Advance {
        key: String,
        token: u64,
        reply: oneshot::Sender<Result<Advance, StoreError>>,
    },
    /// An advance and a mark of the key, in one commit.
    AdvanceMarked {
        key: String,
        token: u64,
        reply: oneshot::Sender<Result<(Advance, u64), StoreError>>,
    },
    Mark {
        key: String,
        token: u64,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
    Rotate {
        /// Each with the lowest token it has in flight.
        keys: Vec<(String, u64)>,
        watermark: u64,
        reply: oneshot::Sender<Result<Vec<u64>, StoreError>>,
    },
    Get {
        key: String,
        reply: oneshot::Sender<Result<Option<u64>, StoreError>>,
    },
    Forget {
        key: String,
        reply: oneshot::Sender<Result<Option<u64>, StoreError>>,
    },
    Lock {
        key: String,
        op: LockOp,
        reply: oneshot::Sender<Result<LockAnswer, StoreError>>,
    },
    Ping {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    KeyMapping {
        fingerprint: u64,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    CloseClean {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
}

/// A lock-service operation ([`FenceStore::claim_lock`] and its kin).
enum LockOp {
    Claim {
        id: String,
        holder: String,
        ttl: Duration,
    },
    Read,
    Renew {
        id: String,
        ttl: Duration,
    },
    Release {
        id: String,
    },
}

enum LockAnswer {
    Claim(Claim),
    Lock(Option<Lock>),
    Released(bool),
}

/// Answers of one batch for the callers on one runtime.
type Answers = Vec<(Op, Result<Answer, StoreError>)>;

/// Carries a batch's answers to a task on the callers' runtime, which
/// hands them out there. Answering each caller from the writer thread
/// would wake its runtime from outside once per operation (a system call
/// each on a single-threaded runtime); this wakes it once per batch.
type Courier = tokio::sync::mpsc::UnboundedSender<Answers>;

/// The redb-backed [`FenceStore`].
pub struct EmbeddedStore {
    ops: mpsc::Sender<(Op, Option<Courier>)>,
    /// One courier per runtime slot ([`crate::slot::slot`]).
    couriers: dashmap::DashMap<usize, Courier>,
    start: StartState,
    /// Keys marked in flight when the last run stopped uncleanly (`None`:
    /// that run kept no marks).
    in_flight_at_crash: Option<Vec<CrashedKey>>,
    key_mapping_at_open: Option<u64>,
    healthy: Arc<AtomicBool>,
    /// Durable commits (fsyncs) so far: group commit makes this grow slower
    /// than the number of advances.
    commits: Arc<AtomicU64>,
    /// In-flight marks in the file as of the last commit.
    marks: Arc<AtomicU64>,
    /// The sequence number the next mark gets.
    next_mark: Arc<AtomicU64>,
    writer: std::sync::Mutex<Option<JoinHandle<()>>>,
}

fn open_db(path: &Path, cache_bytes: usize) -> Result<Database, OpenError> {
    let p = path.to_path_buf();
    // redb's debug builds assert on some corruptions instead of returning an
    // error; catch that so a corrupt file is always a clear refusal.
    let opened =
        std::panic::catch_unwind(|| Database::builder().set_cache_size(cache_bytes).create(&p));
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(DatabaseError::DatabaseAlreadyOpen)) => Err(OpenError::Locked(p)),
        Ok(Err(DatabaseError::Storage(redb::StorageError::Io(e))))
            if e.kind() != std::io::ErrorKind::InvalidData =>
        {
            Err(OpenError::Io {
                path: p,
                reason: e.to_string(),
            })
        }
        Ok(Err(e)) => Err(OpenError::Corrupt {
            path: p,
            reason: e.to_string(),
        }),
        Err(_) => Err(OpenError::Corrupt {
            path: p,
            reason: "the storage engine rejected the file".into(),
        }),
    }
}

/// What the store file said at open.
struct Found {
    start: StartState,
    in_flight: Option<Vec<CrashedKey>>,
    /// Marks left in the log.
    marks: u64,
    next_mark: u64,
    /// The key mapping recorded by the previous run.
    key_mapping: Option<u64>,
}

/// Reads the format version and clean flag, then marks the store as in use
/// (durably) so that a crash from here on is detected at the next start.
/// After an unclean stop it reads the keys marked in flight, and keeps
/// their marks (a second crash during recovery must still find them);
/// after a clean one nothing was in flight, and the marks are dropped.
fn init_meta(db: &Database, path: &Path, window: Duration) -> Result<Found, OpenError> {
    let corrupt = |e: &dyn std::fmt::Display| OpenError::Corrupt {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let txn = db.begin_write().map_err(|e| corrupt(&e))?;
    let start;
    let marked;
    let key_mapping;
    {
        let mut meta = txn.open_table(META).map_err(|e| corrupt(&e))?;
        let version = meta
            .get(FORMAT_VERSION_KEY)
            .map_err(|e| corrupt(&e))?
            .map(|v| v.value());
        start = match version {
            Some(v) if v != FORMAT_VERSION => {
                return Err(OpenError::UnknownVersion {
                    path: path.to_path_buf(),
                    found: v,
                })
            }
            Some(_) => match meta.get(CLEAN_KEY).map_err(|e| corrupt(&e))? {
                Some(v) if v.value() == 1 => StartState::Clean,
                _ => StartState::Unclean {
                    previous_window: meta
                        .get(WINDOW_KEY)
                        .map_err(|e| corrupt(&e))?
                        .map(|v| Duration::from_millis(v.value())),
                },
            },
            // A new file: nothing can be in flight.
            None => StartState::Clean,
        };
        meta.insert(FORMAT_VERSION_KEY, FORMAT_VERSION)
            .map_err(|e| corrupt(&e))?;
        meta.insert(CLEAN_KEY, 0).map_err(|e| corrupt(&e))?;
        let previous = match start {
            StartState::Unclean {
                previous_window: Some(p),
            } => p,
            _ => Duration::ZERO,
        };
        // Keep the longer window until a clean stop: a second crash during
        // recovery must still wait for the first run's writes.
        let ms = u64::try_from(window.max(previous).as_millis()).unwrap_or(u64::MAX);
        meta.insert(WINDOW_KEY, ms).map_err(|e| corrupt(&e))?;
        marked = meta.get(MARKS_KEY).map_err(|e| corrupt(&e))?.is_some();
        key_mapping = meta
            .get(KEY_MAPPING_KEY)
            .map_err(|e| corrupt(&e))?
            .map(|v| v.value());
        // After an unclean stop of a run that kept no marks, the flag stays
        // unset until a clean stop: a crash of this run must still hold
        // every key, as that run's writes may still be in flight.
        if marked || matches!(start, StartState::Clean) {
            meta.insert(MARKS_KEY, 1).map_err(|e| corrupt(&e))?;
        }
    }
    let mut in_flight = Vec::new();
    let mut kept = true;
    let (left, next_mark);
    {
        use redb::ReadableTableMetadata;
        let fences = txn.open_table(FENCES).map_err(|e| corrupt(&e))?;
        let mut meta = txn.open_table(META).map_err(|e| corrupt(&e))?;
        let mut marks = txn.open_table(MARKS).map_err(|e| corrupt(&e))?;
        let watermark = meta
            .get(WATERMARK_KEY)
            .map_err(|e| corrupt(&e))?
            .map_or(0, |v| v.value());
        let last = marks
            .last()
            .map_err(|e| corrupt(&e))?
            .map_or(0, |(k, _)| k.value() + 1);
        next_mark = last.max(watermark);
        if let StartState::Unclean { .. } = start {
            kept = marked;
            // Per key, the lowest token its live marks were made for.
            let mut lowest = std::collections::HashMap::<String, u64>::new();
            for entry in marks.range(watermark..).map_err(|e| corrupt(&e))? {
                let (_, mark) = entry.map_err(|e| corrupt(&e))?;
                let (token, key) = mark.value();
                let l = lowest.entry(key.to_string()).or_insert(token);
                *l = (*l).min(token);
            }
            for (key, lowest) in lowest {
                let highest = fences
                    .get(key.as_str())
                    .map_err(|e| corrupt(&e))?
                    .map(|v| v.value());
                in_flight.push(CrashedKey {
                    key,
                    highest,
                    lowest,
                });
            }
        } else {
            // Nothing was in flight at a clean stop.
            marks.retain(|_, _| false).map_err(|e| corrupt(&e))?;
            meta.insert(WATERMARK_KEY, next_mark)
                .map_err(|e| corrupt(&e))?;
        }
        left = marks.len().map_err(|e| corrupt(&e))?;
    }
    txn.commit().map_err(|e| OpenError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok(Found {
        start,
        in_flight: kept.then_some(in_flight),
        marks: left,
        next_mark,
        key_mapping,
    })
}

impl EmbeddedStore {
    /// Opens (or creates) the store file. `cache_bytes` bounds redb's page
    /// cache; `recovery_window` (the longest upstream timeout) is recorded
    /// for the next start. Refuses a file locked by another process, a
    /// corrupt file, or a file of an unknown format version.
    pub fn open(
        path: &Path,
        cache_bytes: usize,
        recovery_window: Duration,
    ) -> Result<Self, OpenError> {
        let db = open_db(path, cache_bytes)?;
        let found = init_meta(&db, path, recovery_window)?;
        let (tx, rx) = mpsc::channel();
        let healthy = Arc::new(AtomicBool::new(true));
        let commits = Arc::new(AtomicU64::new(0));
        let marks = Arc::new(AtomicU64::new(found.marks));
        let next_mark = Arc::new(AtomicU64::new(found.next_mark));
        let worker = Writer {
            marks: marks.clone(),
            next_mark: next_mark.clone(),
            db: Some(db),
            path: path.to_path_buf(),
            cache_bytes,
            healthy: healthy.clone(),
            commits: commits.clone(),
            closed: false,
            last_probe: None,
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

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.ops
            .send((make(tx), self.courier()))
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    async fn lock(&self, key: &str, op: LockOp) -> Result<LockAnswer, StoreError> {
        let key = key.to_string();
        self.call(|reply| Op::Lock { key, op, reply }).await
    }

    /// The courier of the calling runtime, started on first use. `None`
    /// outside a runtime: the writer then answers directly.
    fn courier(&self) -> Option<Courier> {
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

/// Hands each operation its answer: through its runtime's courier, one
/// message per courier, or directly (no courier, or its runtime is gone).
fn deliver(
    ops: impl Iterator<Item = Op>,
    couriers: impl Iterator<Item = Option<Courier>>,
    answers: Vec<Result<Answer, StoreError>>,
) {
    let mut groups: Vec<(Courier, Answers)> = Vec::new();
    for ((op, courier), answer) in ops.zip(couriers).zip(answers) {
        match courier {
            None => op.answer(answer),
            Some(c) => match groups.iter_mut().find(|(g, _)| g.same_channel(&c)) {
                Some((_, group)) => group.push((op, answer)),
                None => groups.push((c, vec![(op, answer)])),
            },
        }
    }
    for (courier, group) in groups {
        if let Err(returned) = courier.send(group) {
            for (op, answer) in returned.0 {
                op.answer(answer);
            }
        }
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

struct Writer {
    /// `None` after a failed commit until a reopen succeeds.
    db: Option<Database>,
    path: PathBuf,
    cache_bytes: usize,
    healthy: Arc<AtomicBool>,
    commits: Arc<AtomicU64>,
    marks: Arc<AtomicU64>,
    next_mark: Arc<AtomicU64>,
    /// Set once a clean stop is recorded: no write may follow it.
    closed: bool,
    /// When the store last probed for room (while unhealthy).
    last_probe: Option<Instant>,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<(Op, Option<Courier>)>) {
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
            let (op, courier) = match next {
                Ok(next) => next,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = self.probe();
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
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

    fn fail(&self, e: impl std::fmt::Display) -> StoreError {
        self.healthy.store(false, Ordering::Release);
        StoreError::Unavailable(e.to_string())
    }

    /// After an I/O failure redb refuses further work on the handle; reopen
    /// the file so the store heals when the disk does.
    fn db(&mut self) -> Result<&Database, StoreError> {
        if self.db.is_none() {
            let db = open_db(&self.path, self.cache_bytes).map_err(|e| self.fail(e))?;
            self.db = Some(db);
        }
        Ok(self.db.as_ref().expect("just set"))
    }

    /// Proves that the disk takes writes again: [`PROBE_BYTES`] committed,
    /// then removed in a commit of its own, so the room is given back. In
    /// transactions of their own, so that the probe never takes a real
    /// batch down with it.
    fn probe(&mut self) -> Result<(), StoreError> {
        self.last_probe = Some(Instant::now());
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
            Ok(())
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
    fn apply(&mut self, batch: &[Op]) -> Vec<Result<Answer, StoreError>> {
        match self.try_apply(batch) {
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
                self.db = None;
                batch.iter().map(|_| Err(e.clone())).collect()
            }
        }
    }

    /// Applies a batch in one transaction and returns each operation's
    /// answer, to be sent only once the commit is durable (nothing is
    /// acknowledged before the fsync). The batch itself is left in place so
    /// that, on error, every operation in it can be answered with the error.
    fn try_apply(&mut self, batch: &[Op]) -> Result<Vec<Answer>, StoreError> {
        let recovering = !self.healthy.load(Ordering::Acquire);
        let needs_write = recovering
            || batch.iter().any(|op| {
                matches!(
                    op,
                    Op::Ping { .. } | Op::CloseClean { .. } | Op::KeyMapping { .. }
                )
            });
        let closed = self.closed;
        let db = self.db()?;
        let txn = db.begin_write().map_err(|e| self.fail(e))?;
        let mut answers = Vec::with_capacity(batch.len());
        // Something changed that a commit must make durable.
        let mut raised = false;
        // A raise or a mark: crash detection must be armed.
        let mut arm = false;
        let mut closing = false;
        // Marks added and removed by this batch.
        let (mut added, mut removed) = (0u64, 0u64);
        let mut next = self.next_mark.load(Ordering::Relaxed);
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
                    } if closed || closing => Answer::Refused,
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
                                arm = true;
                                raised = true;
                                Advance::Raised { previous }
                            }
                        };
                        if let Op::AdvanceMarked { .. } = op {
                            arm = true;
                            raised = true;
                            Answer::Marked(advance, mark(&mut marks, key, token)?)
                        } else {
                            Answer::Advance(advance)
                        }
                    }
                    Op::Mark { key, token, .. } => {
                        arm = true;
                        raised = true;
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
                        marks
                            .retain_in(..*watermark, |_, _| {
                                removed += 1;
                                false
                            })
                            .map_err(|e| self.fail(e))?;
                        raised = true;
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
                                        arm = true;
                                        raised = true;
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
                                    raised = true;
                                    l.expires_in = *ttl;
                                    Answer::Lock(LockAnswer::Lock(Some(l)))
                                }
                                None => Answer::Lock(LockAnswer::Lock(None)),
                            },
                            LockOp::Release { id } => {
                                let mine = held.is_some_and(|l| &l.id == id);
                                if mine {
                                    locks.remove(key.as_str()).map_err(|e| self.fail(e))?;
                                    raised = true;
                                }
                                Answer::Lock(LockAnswer::Released(mine))
                            }
                        }
                    }
                    Op::Forget { key, .. } => {
                        raised = true; // a change to commit
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
                        closing = true;
                        Answer::Done
                    }
                };
                answers.push(answer);
            }
            if arm && !closing {
                // A raise or a mark after a clean-stop mark (should not
                // happen after a drain) re-arms crash detection; one in
                // front of this batch's clean stop is covered by its drain.
                meta.insert(CLEAN_KEY, 0).map_err(|e| self.fail(e))?;
            }
            if needs_write && !raised {
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
        if raised || needs_write {
            txn.commit().map_err(|e| self.fail(e))?;
            self.commits.fetch_add(1, Ordering::Relaxed);
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
        self.closed |= closing;
        Ok(answers)
    }
}

/// One operation's result inside a committed batch.
enum Answer {
    Advance(Advance),
    /// An advance and the sequence number of its mark.
    Marked(Advance, u64),
    Seq(u64),
    Seqs(Vec<u64>),
    Token(Option<u64>),
    Lock(LockAnswer),
    Done,
    /// An advance after the clean-stop mark.
    Refused,
}

impl Op {
    /// Sends the batch's outcome for this operation to its caller.
    fn answer(self, result: Result<Answer, StoreError>) {
        // A caller that went away no longer needs its answer.
        match self {
            Op::Advance { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Advance(a) => Ok(a),
                _ => Err(StoreError::Closed),
            }))),
            Op::Get { reply, .. } | Op::Forget { reply, .. } => {
                drop(reply.send(result.map(|a| match a {
                    Answer::Token(t) => t,
                    _ => None,
                })))
            }
            Op::Lock { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Lock(l) => Ok(l),
                _ => Err(StoreError::Closed),
            }))),
            Op::Ping { reply } | Op::CloseClean { reply } | Op::KeyMapping { reply, .. } => {
                drop(reply.send(result.map(|_| ())))
            }
            Op::AdvanceMarked { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Marked(a, seq) => Ok((a, seq)),
                _ => Err(StoreError::Closed),
            }))),
            Op::Mark { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Seq(seq) => Ok(seq),
                _ => Err(StoreError::Closed),
            }))),
            Op::Rotate { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Seqs(seqs) => Ok(seqs),
                _ => Err(StoreError::Closed),
            }))),
        }
    }
}

/// Makes the file look last used by a fencegate that kept no in-flight
/// marks (for tests of the upgrade path).
#[cfg(test)]
pub(crate) fn forget_marks_flag(path: &Path) {
    let db = Database::create(path).unwrap();
    let txn = db.begin_write().unwrap();
    txn.open_table(META).unwrap().remove(MARKS_KEY).unwrap();
    txn.commit().unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &tempfile::TempDir) -> EmbeddedStore {
        EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(9)).unwrap()
    }

    #[tokio::test]
    async fn compare_and_raise_over_the_full_range() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(&dir);
        assert_eq!(
            s.advance("k", 0).await.unwrap(),
            Advance::Raised { previous: None }
        );
        assert_eq!(s.advance("k", 0).await.unwrap(), Advance::Equal);
        assert_eq!(
            s.advance("k", u64::MAX).await.unwrap(),
            Advance::Raised { previous: Some(0) }
        );
        assert_eq!(
            s.advance("k", u64::MAX - 1).await.unwrap(),
            Advance::Stale { highest: u64::MAX }
        );
        assert_eq!(s.highest("k").await.unwrap(), Some(u64::MAX));
        assert_eq!(s.highest("other").await.unwrap(), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_advances_share_commits_and_steady_tokens_write_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(open(&dir));
        let before = s.commit_count();
        let tasks: Vec<_> = (0..400)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move { s.advance(&format!("k{i}"), 7).await })
            })
            .collect();
        for t in tasks {
            assert!(matches!(t.await.unwrap().unwrap(), Advance::Raised { .. }));
        }
        let used = s.commit_count() - before;
        assert!(
            used < 400,
            "400 advances took {used} commits: no group commit"
        );
        let before = s.commit_count();
        for i in 0..50 {
            assert_eq!(
                s.advance(&format!("k{i}"), 7).await.unwrap(),
                Advance::Equal
            );
            assert!(matches!(
                s.advance(&format!("k{i}"), 6).await.unwrap(),
                Advance::Stale { .. }
            ));
        }
        assert_eq!(
            s.commit_count(),
            before,
            "equal and stale tokens wrote to disk"
        );
    }

    #[tokio::test]
    async fn start_state_tracks_clean_stops() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(&dir);
        assert_eq!(s.start_state(), StartState::Clean, "a new file");
        s.advance("k", 1).await.unwrap();
        drop(s); // no close_clean: like a crash
        let s = open(&dir);
        assert_eq!(
            s.start_state(),
            StartState::Unclean {
                previous_window: Some(Duration::from_secs(9))
            }
        );
        s.close_clean().await.unwrap();
        assert!(
            matches!(s.advance("k", 2).await, Err(StoreError::Closed)),
            "no write after the clean-stop mark"
        );
        drop(s);
        let s = open(&dir);
        assert_eq!(s.start_state(), StartState::Clean);
        assert_eq!(s.highest("k").await.unwrap(), Some(1));
    }

    /// Marks share the advance's commit, rise, survive a crash (and a
    /// second one) until a rotation lets them die, carry the lowest token
    /// they were made for, and are dropped by a clean stop; numbers keep
    /// rising across opens.
    #[tokio::test]
    async fn in_flight_marks_survive_a_crash_and_a_clean_stop_drops_them() {
        let crashed = |key: &str, highest: Option<u64>, lowest: u64| CrashedKey {
            key: key.into(),
            highest,
            lowest,
        };
        let dir = tempfile::tempdir().unwrap();
        let s = open(&dir);
        assert_eq!(s.in_flight_at_crash(), Some(vec![]), "a new file");
        let before = s.commit_count();
        let (a, first) = s.advance_marked("a", 3).await.unwrap();
        assert!(matches!(a, Advance::Raised { .. }));
        assert_eq!(s.commit_count() - before, 1, "advance and mark: one commit");
        assert_eq!(s.advance_marked("a", 3).await.unwrap().0, Advance::Equal);
        let b = s.mark_in_flight("b", 7).await.unwrap();
        assert!(b > first, "marks rise");
        assert_eq!(s.in_flight_marks(), 3);
        let watermark = s.next_mark();
        assert!(watermark > b);
        let again = s
            .rotate_marks(vec![("b".into(), 6)], watermark)
            .await
            .unwrap();
        assert_eq!(again.len(), 1);
        assert!(again[0] >= watermark, "marked again above the watermark");
        assert_eq!(s.in_flight_marks(), 1, "the marks below it are gone");
        let c = s.mark_in_flight("c", 2).await.unwrap();
        s.mark_in_flight("c", 1).await.unwrap();
        s.mark_in_flight("c", 4).await.unwrap();
        assert!(c > again[0]);
        drop(s); // a crash
        let s = open(&dir);
        let mut found = s.in_flight_at_crash().unwrap();
        found.sort();
        assert_eq!(
            found,
            vec![crashed("b", None, 6), crashed("c", None, 1)],
            "only the live marks, each with its lowest token"
        );
        drop(s); // a second crash, during recovery: the marks are kept
        let s = open(&dir);
        assert_eq!(s.in_flight_at_crash().unwrap().len(), 2);
        assert!(s.next_mark() > c, "numbers keep rising across opens");
        s.close_clean().await.unwrap();
        assert!(
            matches!(s.mark_in_flight("d", 1).await, Err(StoreError::Closed)),
            "no mark after the clean-stop mark"
        );
        drop(s);
        let s = open(&dir);
        assert_eq!(s.in_flight_at_crash(), Some(vec![]), "after a clean stop");
        assert_eq!(s.in_flight_marks(), 0);
        assert!(s.mark_in_flight("e", 1).await.unwrap() > c);
        drop(s); // and a crash now finds that one mark
        let s = open(&dir);
        assert_eq!(s.in_flight_at_crash(), Some(vec![crashed("e", None, 1)]));
        drop(s);
        forget_marks_flag(&dir.path().join("f.redb"));
        let s = open(&dir);
        assert_eq!(s.in_flight_at_crash(), None, "a run that kept no marks");
        drop(s); // a crash of that run: still no marks to trust
        let s = open(&dir);
        assert_eq!(s.in_flight_at_crash(), None, "until a clean stop");
        s.close_clean().await.unwrap();
        drop(s);
        let s = open(&dir);
        s.mark_in_flight("f", 1).await.unwrap();
        drop(s);
        let s = open(&dir);
        assert_eq!(s.in_flight_at_crash(), Some(vec![crashed("f", None, 1)]));
    }

    #[test]
    fn a_newer_format_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.redb");
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(META)
                .unwrap()
                .insert(FORMAT_VERSION_KEY, 99)
                .unwrap();
            txn.commit().unwrap();
        }
        match EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(1)) {
            Err(OpenError::UnknownVersion { found: 99, .. }) => {}
            other => panic!("expected UnknownVersion, got {:?}", other.err()),
        }
    }

    #[test]
    fn a_second_open_is_refused_while_the_first_is_open() {
        let dir = tempfile::tempdir().unwrap();
        let _first = open(&dir);
        assert!(matches!(
            EmbeddedStore::open(&dir.path().join("f.redb"), 1 << 20, Duration::from_secs(1)),
            Err(OpenError::Locked(_))
        ));
    }
}
