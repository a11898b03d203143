//! Which log belongs to which table: the store's identity, and the checks
//! at open that keep a table from starting without the advances its log
//! holds.
//!
//! A table of format 3 and its two log files carry one identity (a random
//! number in the table's meta, [`STORE_ID_KEY`], and in each file's
//! header); and no log file starts with a generation newer than the
//! table's `wal_generation + 1` (the generations' invariant, `wal.rs`). So
//! at open:
//! - a log file that starts with a newer generation means the table is
//!   older than its log (restored from a backup, alone): refused, whether
//!   the table was stopped cleanly or not;
//! - after an unclean stop, a log file that is missing, not a log, or
//!   another store's means the advances acknowledged since the last
//!   checkpoint may be gone: refused;
//! - after a clean stop the log holds nothing the table lacks: a missing
//!   log, or one of another run, is replaced by an empty one of this
//!   store; but a log of another store means the table beside it is not
//!   the one that wrote it (replaced by another store's file): refused;
//! - before a table is created ([`before_create`]): a missing table with a
//!   log beside it was deleted or moved, not new, and an empty one was
//!   emptied (fencegate creates its table whole): refused, not replaced by
//!   a new store.
//!
//! The way out of a refusal is to put the log files back, or to accept the
//! loss (`--accept-store-reset`): the files are set aside, not deleted, and
//! every key is held for the recovery window, as after a crash of a run
//! that kept no in-flight marks.

use std::path::{Path, PathBuf};

use super::wal::{self, sync_dir, Owner, Record, FILE_HEADER};

/// The meta key of the store's identity (format 3 on).
pub(super) const STORE_ID_KEY: &str = "store_id";

/// The meta key of the run whose log is beside the table: the log files'
/// headers must name it, or the log is an older copy.
pub(super) const LOG_RUN_KEY: &str = "log_run";

/// The meta key of a run being bound: recorded before the log files are
/// bound to it, and replaced by [`LOG_RUN_KEY`] after. A file that names
/// it holds nothing (nothing is logged before the binding is recorded).
pub(super) const LOG_PENDING_KEY: &str = "log_pending_run";

/// What open does with the log it found.
pub(super) enum Log {
    /// The table's own log: replay these records.
    Replay(Vec<Record>),
    /// A log with nothing the table lacks (a clean stop), but missing or
    /// not this store's: bind new files to the store before the table's
    /// first commit.
    Replace,
    /// A log that may have held advances the table lacks, set aside by the
    /// operator's leave: nothing to replay, and every key must be held.
    Accepted,
}

/// Why a table may not start with the log beside it.
pub(super) struct Lost {
    pub(super) problem: String,
}

/// What the table says its log must be.
pub(super) struct Expected {
    pub(super) store: u64,
    /// The run that last bound the log, and one being bound, if any.
    pub(super) run: u64,
    pub(super) pending: Option<u64>,
    /// The oldest generation the table may lack (`wal_generation`).
    pub(super) logged: u64,
    /// The last run stopped cleanly.
    pub(super) clean: bool,
}

/// Reads the log of a format-3 table. With `accept`, a lost log is set
/// aside instead of refused.
pub(super) fn read(
    paths: &[PathBuf; 2],
    e: &Expected,
    accept: bool,
) -> std::io::Result<Result<Log, Lost>> {
    let owners = [wal::owner(&paths[0])?, wal::owner(&paths[1])?];
    // A file of this store that starts with a newer generation than the
    // table may lack: the table is older than its log, clean or not.
    for (p, o) in paths.iter().zip(&owners) {
        let Owner::Log { header, .. } = o else {
            continue;
        };
        if header.store != e.store {
            continue;
        }
        if let Some(g) = wal::first_generation(p, FILE_HEADER)?.filter(|g| *g > e.logged + 1) {
            let problem = format!(
                "is older than its write-ahead log ({} holds generation {g}, the store file only \
                 up to {}): was the store file restored from a backup without its log?",
                p.display(),
                e.logged.saturating_sub(1)
            );
            return refuse_or_accept(paths, problem, accept);
        }
    }
    let problems: Vec<String> = (0u8..)
        .zip(paths.iter().zip(&owners))
        .filter_map(|(i, (p, o))| problem(e, i, o).map(|what| format!("{} {what}", p.display())))
        .collect();
    if problems.is_empty() {
        return Ok(Ok(Log::Replay(wal::replay(paths, e.logged, FILE_HEADER)?)));
    }
    let foreign = owners.iter().find_map(|o| match o {
        Owner::Log { header, .. } if header.store != e.store => Some(header.store),
        _ => None,
    });
    if let (true, Some(other)) = (e.clean, foreign) {
        let problem = format!(
            "is not the store that wrote the write-ahead log beside it (the log is store \
             {other:016x}'s, the file is store {:016x}'s): was the store file replaced by \
             another store's?",
            e.store
        );
        return refuse_or_accept(paths, problem, accept);
    }
    if e.clean {
        return Ok(Ok(Log::Replace));
    }
    let problem = format!(
        "was not stopped cleanly, and its write-ahead log {}",
        problems.join(", ")
    );
    refuse_or_accept(paths, problem, accept)
}

/// What is wrong with log file `i`, if anything.
fn problem(e: &Expected, i: u8, o: &Owner) -> Option<&'static str> {
    let (h, len) = match o {
        Owner::Missing => return Some("is missing"),
        Owner::Unknown => return Some("is not a fencegate log"),
        Owner::Log { header, len } => (header, *len),
    };
    if h.store != e.store {
        return Some("belongs to another store");
    }
    if h.file != i {
        return Some("is the store's other log file (.wal.0 and .wal.1 swapped?)");
    }
    if Some(h.run) == e.pending {
        // Bound by a start that crashed before it recorded the binding:
        // nothing was logged in it.
        return None;
    }
    if h.run != e.run {
        return Some(
            "is a copy of this store's log from another run (copied or restored apart from the \
             store file?)",
        );
    }
    // Every run grows its files to this size before it logs anything.
    if len < wal::GROW {
        return Some("is shorter than fencegate left it (truncated?)");
    }
    None
}

fn refuse_or_accept(
    paths: &[PathBuf; 2],
    problem: String,
    accept: bool,
) -> std::io::Result<Result<Log, Lost>> {
    if !accept {
        return Ok(Err(Lost { problem }));
    }
    tracing::warn!(
        "fence store: {problem}; accepted (--accept-store-reset): the log is set aside and every \
         key is held for the recovery window"
    );
    set_aside(paths)?;
    Ok(Ok(Log::Accepted))
}

/// A format-2 table's log has no header: only a missing file can be told.
pub(super) fn read_format_2(
    paths: &[PathBuf; 2],
    logged: u64,
    clean: bool,
    accept: bool,
) -> std::io::Result<Result<Log, Lost>> {
    let mut missing = Vec::new();
    for p in paths {
        if !p.try_exists()? {
            missing.push(format!("{} is missing", p.display()));
        }
    }
    if clean || missing.is_empty() {
        return Ok(Ok(Log::Replay(wal::replay(paths, logged, 0)?)));
    }
    let problem = format!(
        "was not stopped cleanly, and its write-ahead log {}",
        missing.join(", ")
    );
    refuse_or_accept(paths, problem, accept)
}

/// Renames the log files that exist to `<name>.rejected-<unix seconds>`,
/// durably: an operator who accepted the loss may still want them.
fn set_aside(paths: &[PathBuf; 2]) -> std::io::Result<()> {
    let secs = unix_secs();
    for p in paths {
        let mut to = p.as_os_str().to_owned();
        to.push(format!(".rejected-{secs}"));
        match std::fs::rename(p, &to) {
            Ok(()) => tracing::warn!(from = %p.display(), to = ?to, "fence store log set aside"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    sync_dir(&paths[0])
}

/// What is where the store file should be, before it is created.
pub(super) enum Table {
    /// A file: opened as it is.
    There,
    /// Nothing, and no log: a new store.
    New,
    /// Lost, and the loss accepted (`--accept-store-reset`): the log and
    /// any empty file were set aside; a new store is made, and every key is
    /// held for the recovery window. Also the table an accepted reset made
    /// before its start crashed (its marker is still there).
    Accepted,
}

/// Checks where the store file should be before one is created: a missing
/// file with a non-empty log beside it was deleted or moved, not new; an
/// empty file was emptied after fencegate made it whole (a filesystem
/// that lost it in a crash, `> file`). Either would start as a new, empty
/// store, and every fence it held would be gone: refused unless `accept`.
pub(super) fn before_create(
    path: &Path,
    paths: &[PathBuf; 2],
    accept: bool,
) -> std::io::Result<Result<Table, Lost>> {
    let marker = reset_marker(path);
    // A reset accepted by a start that did not finish it (a crash before
    // the new table's log was bound): the table there, if any, is that new
    // one, and it must still hold every key.
    let resumed = marker.try_exists()?;
    if resumed {
        tracing::warn!(
            marker = %marker.display(),
            "fence store: finishing an accepted reset that a start did not complete: the old \
             files are set aside and every key is held for the recovery window (remove the \
             marker only if no reset was accepted here)"
        );
    }
    let empty = match std::fs::metadata(path) {
        Ok(m) if m.len() > 0 => {
            return Ok(Ok(if resumed {
                Table::Accepted
            } else {
                Table::There
            }))
        }
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(e),
    };
    if !resumed {
        let mut logs = Vec::new();
        for p in paths {
            match std::fs::metadata(p) {
                Ok(m) if m.len() > 0 => logs.push(p.display().to_string()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        let problem = match (empty, logs.is_empty()) {
            (false, true) => return Ok(Ok(Table::New)),
            (true, _) => "is empty: fencegate creates its store file whole, so it was emptied \
                          since (a filesystem that lost it in a crash, or a mistake such as \
                          `> file`), and every fence it held is gone"
                .to_string(),
            (false, false) => format!(
                "is missing, but its write-ahead log is there ({}): was the store file \
                 deleted, moved, or restored without it?",
                logs.join(", ")
            ),
        };
        if !accept {
            return Ok(Err(Lost { problem }));
        }
        tracing::warn!(
            "fence store: {problem}; accepted (--accept-store-reset): a new store is made, the \
             log is set aside and every key is held for the recovery window"
        );
        // Durable before anything is set aside: from here on, a start that
        // crashes leaves a store that knows it was reset.
        std::fs::write(&marker, b"an accepted reset of this store is under way\n")?;
        std::fs::File::open(&marker)?.sync_all()?;
        sync_dir(path)?;
    }
    if empty {
        let mut to = path.as_os_str().to_owned();
        to.push(format!(".rejected-{}", unix_secs()));
        std::fs::rename(path, &to)?;
    }
    set_aside(paths)?;
    Ok(Ok(Table::Accepted))
}

/// The file that says an accepted reset of the store at `path` is under
/// way: made before the old files are set aside, removed once the new
/// table's log is bound ([`reset_done`]).
fn reset_marker(path: &Path) -> PathBuf {
    let mut marker = path.as_os_str().to_owned();
    marker.push(".reset");
    PathBuf::from(marker)
}

/// Ends an accepted reset: the new table holds its keys by its own record
/// now (its flags and its bound log), so the marker can go.
pub(super) fn reset_done(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(reset_marker(path)) {
        Ok(()) => sync_dir(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Makes a store file that does not exist yet whole before it takes its
/// name: made under `<name>.creating` and renamed, durably. redb writes a
/// new file in several steps, and a process killed in its first
/// milliseconds left a file without redb's header under the store's name,
/// which every later start refused as corrupt.
pub(super) fn create_whole(path: &Path) -> std::io::Result<()> {
    if path.try_exists()? {
        return Ok(());
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".creating");
    let tmp = PathBuf::from(tmp);
    // Left by a start killed while creating: never a store of its own.
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    drop(redb::Database::create(&tmp).map_err(std::io::Error::other)?);
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, path)?;
    sync_dir(path)
}

/// A new identity: random, so that no two stores share one.
pub(super) fn new_id() -> u64 {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 8];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system's random source");
    u64::from_le_bytes(b).max(1)
}

/// The store file's path with every symbolic link resolved, so that the
/// table and its log are found in one place whichever name the store is
/// opened by (a mounted volume, a `current` link). A file that does not
/// exist yet (a link to one included) resolves through its directory.
pub(super) fn resolve(path: &Path) -> std::io::Result<PathBuf> {
    let mut path = path.to_path_buf();
    // As many links as the kernel follows (ELOOP past 40).
    for _ in 0..40 {
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&path)?;
                path = match path.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            Ok(_) => return std::fs::canonicalize(&path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let dir = match path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    Some(d) => d,
                    None => Path::new("."),
                };
                let name = path.file_name().ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name")
                })?;
                return Ok(std::fs::canonicalize(dir)?.join(name));
            }
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("too many levels of symbolic links"))
}

#[cfg(test)]
mod tests {
    use super::resolve;

    #[test]
    fn links_resolve_to_the_file_they_name_existing_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::create_dir(root.join("vol")).unwrap();
        std::os::unix::fs::symlink("vol/f.redb", root.join("rel")).unwrap();
        std::os::unix::fs::symlink(root.join("rel"), root.join("abs")).unwrap();
        let file = root.join("vol").join("f.redb");
        assert_eq!(resolve(&root.join("abs")).unwrap(), file, "not there yet");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(resolve(&root.join("abs")).unwrap(), file);
        assert_eq!(resolve(&root.join("vol/../rel")).unwrap(), file);
        assert_eq!(
            resolve(&root.join("new.redb")).unwrap(),
            root.join("new.redb")
        );
        std::os::unix::fs::symlink(root.join("loop"), root.join("loop")).unwrap();
        assert!(resolve(&root.join("loop")).is_err());
    }
}
