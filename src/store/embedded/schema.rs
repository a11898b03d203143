//! The file's layout: its tables (fences, meta, leases, the in-flight
//! log), the meta keys (format version, clean stop, key mapping, recovery
//! window), and opening a file: its checks and what it says about the last
//! run.

use std::path::{Path, PathBuf};
use std::time::Duration;

use redb::{Database, DatabaseError, ReadableTable, TableDefinition};

use crate::store::api::{CrashedKey, StartState};

use super::identity::{self, LOG_PENDING_KEY, LOG_RUN_KEY, STORE_ID_KEY};
use super::wal::{Record, Wal};

pub(super) const FENCES: TableDefinition<&str, u64> = TableDefinition::new("fences");

pub(super) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// The lock service's leases: key -> (lease id, token, holder, expiry in ms
/// since the Unix epoch on this host's clock, which must survive a restart).
pub(super) const LOCKS: TableDefinition<&str, (&str, u64, &str, u64)> =
    TableDefinition::new("leases");

/// In-flight marks: sequence number -> (the token of the write it was made
/// for, key). Marks below the watermark ([`WATERMARK_KEY`]) are dead.
pub(super) const MARKS: TableDefinition<u64, (u64, &str)> = TableDefinition::new("in_flight_log");

pub(super) const WATERMARK_KEY: &str = "in_flight_watermark";

/// Set (1) by every run that keeps in-flight marks. A crashed run that did
/// not (an older fencegate) recorded none, so every key must wait.
pub(super) const MARKS_KEY: &str = "in_flight_marks";

pub(super) const FORMAT_VERSION_KEY: &str = "format_version";

pub(super) const CLEAN_KEY: &str = "clean_stop";

/// The fingerprint of the key mapping that writes in flight were admitted
/// under ([`FenceStore::record_key_mapping`]).
pub(super) const KEY_MAPPING_KEY: &str = "key_mapping";

/// The crash-recovery window (ms) of the process that has the store open, so
/// that a restart with a shorter upstream timeout still waits long enough.
pub(super) const WINDOW_KEY: &str = "recovery_window_ms";

/// The oldest generation of the write-ahead log whose records the table
/// may lack: older ones are in it (the invariant: `wal.rs`).
pub(super) const WAL_GENERATION_KEY: &str = "wal_generation";

/// Bumped when the on-disk layout changes; a file from a newer version is
/// refused rather than misread. Version 2 added the write-ahead log next
/// to the file: a version-1 file (no log) is upgraded at open, and a
/// fencegate that reads only version 1 refuses a version-2 file rather
/// than miss the advances in its log.
/// Version 3 binds the log to the file: the log files start with a header
/// naming the store, whose identity the file keeps (`identity.rs`); a
/// version-2 file is upgraded at open, once its log is replayed.
pub const FORMAT_VERSION: u64 = 3;

/// The oldest format version this fencegate upgrades at open.
pub const OLDEST_FORMAT_VERSION: u64 = 1;

/// While the store is unhealthy, a readiness probe commits this many bytes
/// (then removes them) before it says the store takes writes again. A probe
/// of a few bytes can fit in a file's free pages on a disk that has no room
/// for a real batch (a long key, its mark), and readiness would say "ready"
/// while writes still fail.
pub(super) const PROBE_BYTES: usize = 256 * 1024;

pub(super) const PROBE: TableDefinition<&str, &[u8]> = TableDefinition::new("probe");

/// How often the writer probes by itself while the store is unhealthy.
pub(super) const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Why the embedded store could not be opened. These stop the start.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("store file {0} is in use by another process (is another fencegate running?)")]
    Locked(PathBuf),
    #[error("store file {path} is corrupt or not a fencegate store: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("store file {path} has format version {found}; this fencegate reads versions {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION} (upgrade fencegate)")]
    UnknownVersion { path: PathBuf, found: u64 },
    #[error("cannot open store file {path}: {reason}")]
    Io { path: PathBuf, reason: String },
    /// The table may lack advances that only its log held.
    #[error("store file {path} {problem}. The fence advances acknowledged since its last checkpoint live only in its write-ahead log ({logs}){hint}. Put the log files back beside the store file as they were; or, to accept that fences may have gone back, start once with --accept-store-reset: the log files are set aside and every key is held for the recovery window")]
    LogLost {
        path: PathBuf,
        problem: String,
        logs: String,
        /// Where log files of this store may be instead.
        hint: String,
    },
    /// The table is missing beside its log, or emptied.
    #[error("store file {path} {problem}. Restore the store file as it was, with its log files; or, to accept that fences may have gone back, start once with --accept-store-reset: a new store is made, what was there is set aside, and every key is held for the recovery window")]
    TableLost { path: PathBuf, problem: String },
}

pub(super) fn open_db(path: &Path, cache_bytes: usize) -> Result<Database, OpenError> {
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
pub(super) struct Found {
    pub(super) start: StartState,
    pub(super) in_flight: Option<Vec<CrashedKey>>,
    /// Marks left in the log.
    pub(super) marks: u64,
    pub(super) next_mark: u64,
    /// The key mapping recorded by the previous run.
    pub(super) key_mapping: Option<u64>,
    /// The write-ahead log's generation from here on.
    pub(super) generation: u64,
    /// How the log files are bound to this run, once this commit is made
    /// and before anything is logged ([`bind_log`]).
    pub(super) bind: Bind,
}

pub(super) struct Bind {
    /// The store's identity (new for a new or upgraded file).
    pub(super) id: u64,
    /// This run's.
    pub(super) run: u64,
    /// The files are bound already (a clean table's log replaced).
    pub(super) bound: bool,
    /// The file is new or of an older format: its identity and format
    /// version are recorded with the run.
    pub(super) upgrade: bool,
}

/// Replays the write-ahead log at `wal` into the table, reads the format
/// version and clean flag, then marks the store as in use (durably) so
/// that a crash from here on is detected at the next start. Records found
/// in the log mean the last run did not stop cleanly (a clean stop
/// checkpoints the log), whatever the clean flag says.
/// After an unclean stop it reads the keys marked in flight, and keeps
/// their marks (a second crash during recovery must still find them);
/// after a clean one nothing was in flight, and the marks are dropped.
pub(super) fn init_meta(
    db: &Database,
    path: &Path,
    wal: &[PathBuf; 2],
    window: Duration,
    accept_loss: bool,
    table_lost: bool,
) -> Result<Found, OpenError> {
    let corrupt = |e: &dyn std::fmt::Display| OpenError::Corrupt {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let txn = db.begin_write().map_err(|e| corrupt(&e))?;
    let start;
    let marked;
    let key_mapping;
    let generation;
    let mut bind;
    {
        let mut meta = txn.open_table(META).map_err(|e| corrupt(&e))?;
        let version = meta
            .get(FORMAT_VERSION_KEY)
            .map_err(|e| corrupt(&e))?
            .map(|v| v.value());
        if let Some(v) = version.filter(|v| !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(v)) {
            return Err(OpenError::UnknownVersion {
                path: path.to_path_buf(),
                found: v,
            });
        }
        // A version-1 file has no log (generation 0 finds no records).
        let logged = meta
            .get(WAL_GENERATION_KEY)
            .map_err(|e| corrupt(&e))?
            .map_or(0, |v| v.value());
        let io = |e: std::io::Error| OpenError::Io {
            path: wal[0].clone(),
            reason: e.to_string(),
        };
        let clean_flag = meta
            .get(CLEAN_KEY)
            .map_err(|e| corrupt(&e))?
            .map(|v| v.value())
            == Some(1);
        let id = meta
            .get(STORE_ID_KEY)
            .map_err(|e| corrupt(&e))?
            .map(|v| v.value());
        let get = |meta: &redb::Table<&str, u64>, key| {
            meta.get(key)
                .map_err(|e| corrupt(&e))
                .map(|v| v.map(|v| v.value()))
        };
        let pending = get(&meta, LOG_PENDING_KEY)?;
        let log = match (version, id) {
            (Some(v), None) if v >= 3 => {
                return Err(corrupt(&"a format-3 store file without its identity"))
            }
            (Some(v), Some(store)) if v >= 3 => identity::read(
                wal,
                &identity::Expected {
                    store,
                    run: get(&meta, LOG_RUN_KEY)?.unwrap_or(0),
                    pending,
                    logged,
                    clean: clean_flag,
                },
                accept_loss,
            ),
            (Some(2), _) => identity::read_format_2(wal, logged, clean_flag, accept_loss),
            // A new file made for a lost one (`identity::before_create`):
            // every key waits.
            (None, _) if table_lost => Ok(Ok(identity::Log::Accepted)),
            // A new file, or one of version 1, has no log yet (a log left
            // beside a new file was refused before it was made); files
            // under the log's names are bound to this one after this
            // commit, before anything is logged.
            _ => Ok(Ok(identity::Log::Replay(Vec::new()))),
        }
        .map_err(io)?
        .map_err(|lost| OpenError::LogLost {
            path: path.to_path_buf(),
            problem: lost.problem,
            logs: format!("{}, {}", wal[0].display(), wal[1].display()),
            hint: String::new(),
        })?;
        // Every start binds the log to a run of its own, recorded as
        // pending in this commit and as the log's run once the files name
        // it (`bind_log`): a copy of the log from another run is then told
        // apart from the log this run writes.
        let upgrade = !matches!(version, Some(v) if v >= 3);
        bind = Bind {
            id: id.unwrap_or_else(identity::new_id),
            // A start that crashed before it recorded its binding logged
            // nothing: its run is this one's, so that files it bound, and
            // files it did not get to, both stay readable if this start
            // crashes too.
            run: pending
                .filter(|_| !upgrade)
                .unwrap_or_else(identity::new_id),
            bound: false,
            upgrade,
        };
        meta.insert(LOG_PENDING_KEY, bind.run)
            .map_err(|e| corrupt(&e))?;
        let (records, accepted) = match log {
            identity::Log::Replay(records) => (records, false),
            identity::Log::Replace => {
                // Nothing in the log is needed (a clean stop): bound
                // before this commit marks the file in use, so that a
                // crash after it finds the store's own log.
                super::wal::bind(wal, bind.id, bind.run).map_err(io)?;
                bind.bound = true;
                (Vec::new(), false)
            }
            identity::Log::Accepted => (Vec::new(), true),
        };
        if accepted {
            // Marks may have been lost with the log: every key waits, as
            // after a crash of a run that kept none (the flag stays unset
            // until a clean stop).
            meta.remove(MARKS_KEY).map_err(|e| corrupt(&e))?;
        }
        // (A generation's first record says only where the table was.)
        let replayed = accepted || records.iter().any(|r| !matches!(r, Record::Generation));
        replay(&txn, &mut meta, records).map_err(|e| corrupt(&e))?;
        // Past both generations the log may hold: every record in its
        // files is in the table now.
        generation = super::wal::first_after_replay(logged);
        meta.insert(WAL_GENERATION_KEY, generation)
            .map_err(|e| corrupt(&e))?;
        start = match version {
            Some(_) => match meta.get(CLEAN_KEY).map_err(|e| corrupt(&e))? {
                Some(v) if v.value() == 1 && !replayed => StartState::Clean,
                _ => StartState::Unclean {
                    previous_window: meta
                        .get(WINDOW_KEY)
                        .map_err(|e| corrupt(&e))?
                        .map(|v| Duration::from_millis(v.value())),
                },
            },
            // A new file made for a lost one: its writes may be in flight.
            None if accepted => StartState::Unclean {
                previous_window: None,
            },
            // A new file: nothing can be in flight.
            None => StartState::Clean,
        };
        // The version is raised only once the log is bound (`Bind`): a
        // crash before that finds the file as it was, with nothing logged.
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
        generation,
        bind,
    })
}

/// Binds the log files to this run (emptied, their headers naming the
/// store, the run and the file), grows them (`Wal::open`), then records
/// the run in the table (and, for a new or upgraded file, its identity and
/// the current format version): from that commit on, an unclean stop is
/// refused without this log. Nothing is logged before it.
pub(super) fn bind_log(
    db: &Database,
    path: &Path,
    wal: &[PathBuf; 2],
    bind: &Bind,
    generation: u64,
) -> Result<Wal, OpenError> {
    let io = |e: std::io::Error| OpenError::Io {
        path: wal[0].clone(),
        reason: e.to_string(),
    };
    if !bind.bound {
        super::wal::bind(wal, bind.id, bind.run).map_err(io)?;
    }
    let log = Wal::open(wal, generation).map_err(io)?;
    let fail = |e: &dyn std::fmt::Display| OpenError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let txn = db.begin_write().map_err(|e| fail(&e))?;
    {
        let mut meta = txn.open_table(META).map_err(|e| fail(&e))?;
        meta.insert(LOG_RUN_KEY, bind.run).map_err(|e| fail(&e))?;
        meta.remove(LOG_PENDING_KEY).map_err(|e| fail(&e))?;
        if bind.upgrade {
            meta.insert(STORE_ID_KEY, bind.id).map_err(|e| fail(&e))?;
            meta.insert(FORMAT_VERSION_KEY, FORMAT_VERSION)
                .map_err(|e| fail(&e))?;
        }
    }
    txn.commit().map_err(|e| fail(&e))?;
    Ok(log)
}

/// Applies logged records to the table, in order: a raise never lowers a
/// key (the table may already hold a higher token), a mark is put back as
/// it was, a watermark drops the marks below it.
fn replay(
    txn: &redb::WriteTransaction,
    meta: &mut redb::Table<&str, u64>,
    records: Vec<Record>,
) -> Result<(), redb::Error> {
    let mut fences = txn.open_table(FENCES)?;
    let mut marks = txn.open_table(MARKS)?;
    for r in records {
        match r {
            Record::Raise { key, token } => {
                let current = fences.get(key.as_str())?.map(|v| v.value());
                if current.is_none_or(|c| c < token) {
                    fences.insert(key.as_str(), token)?;
                }
            }
            Record::Mark { seq, key, token } => {
                marks.insert(seq, (token, key.as_str()))?;
            }
            Record::Watermark(w) => {
                let current = meta.get(WATERMARK_KEY)?.map_or(0, |v| v.value());
                meta.insert(WATERMARK_KEY, w.max(current))?;
                marks.retain_in(..w, |_, _| false)?;
            }
            Record::Generation => {}
        }
    }
    Ok(())
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
