//! The write-ahead log of advances: a batch of raises and in-flight marks
//! is made durable by one append and one `fdatasync` of a preallocated
//! file, instead of a B-tree commit that rewrites several pages.
//!
//! The redb file stays the table. The writer answers advances from memory
//! and the log, and the table catches up by durable commits: a checkpoint
//! on a thread of its own (`checkpoint.rs`), or a commit of the writer's
//! own (`writer.rs`). Each record carries its *generation* and a CRC-32 of
//! its body, so replay at open takes the records of a generation up to
//! the first that is torn, zeroed, or left over from an earlier
//! generation, and drops the rest: a half-written tail is never read as a
//! lower token (a dropped record was never acknowledged: its batch's sync
//! had not returned).
//!
//! # Generations: the invariant
//!
//! `K`, the table's `wal_generation`, is the oldest generation whose
//! records the table may lack; `G`, the generation being logged, is `K`,
//! or `K + 1` while the checkpoint of `K` runs (or failed). Generation `g`
//! is written in file `g % 2`, from just after its header. So the records
//! the table lacks are those of `K` and `K + 1`, one generation per file,
//! and [`replay`] reads exactly those; and no file starts with a
//! generation newer than `K + 1` (`identity.rs` relies on that to tell a
//! table older than its log). Three moves keep it, each through
//! [`Wal::next_generation`] and [`Wal::move_on`]:
//! - open: after `K` and `K + 1` are replayed, `K := K + 2` is committed,
//!   and only then does the log restart at `K + 2`
//!   ([`first_after_replay`]), overwriting the files' older records;
//! - a checkpoint: the log moves on to `G + 1` first, then the frozen
//!   records and `K := G + 1` are committed in one transaction;
//! - a commit of the writer's own (it waits for a running checkpoint
//!   first): everything logged and `K := G + 1` in one transaction, then
//!   the log moves on.
//!
//! The log belongs to one table and one run of it (format 3): each file
//! starts with a header naming the store (a random identity kept in the
//! table's meta), the run that bound it (a random number each start
//! records in the table) and which of the two files it is, so that a table
//! opened beside another store's log, an older copy of its own, or none, is
//! seen rather than opened as clean (see `identity.rs`).
//!
//! Header: `magic: [u8; 8] | store id: u64 | run: u64 | file: u8 |
//! zeros: [u8; 3] | crc32: u32`.
//! Record: `len: u32 | crc32(body): u32 | body`, with body =
//! `generation: u64 | kind: u8 | token: u64 | seq: u64 | key bytes`
//! (little-endian; `seq` is 0 for a raise; a watermark has its value in
//! `seq`, token 0 and no key).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The log grows by this many bytes of zeros at a time, ahead of its
/// appends, so that most appends overwrite allocated blocks and their sync
/// writes no file metadata (a growing file, or fallocate's unwritten
/// extents, would). A log that was once this long stays so: the next
/// generations overwrite it.
pub(super) const GROW: u64 = 1 << 20;

/// A log past this many bytes is checkpointed before the next batch: it
/// bounds the log's size on disk, the memory of what it holds, and the
/// replay at a start after a crash.
pub(super) const CHECKPOINT_BYTES: u64 = 16 << 20;

const HEADER: usize = 8;
const BODY_FIXED: usize = 8 + 1 + 8 + 8;

/// The bytes before the first record of a format-3 log file.
pub(super) const FILE_HEADER: u64 = 32;

const MAGIC: &[u8; 8] = b"fgwal\x00\x00\x03";

/// A log file's header: the store it belongs to, the run that bound it,
/// and which of the two files it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) store: u64,
    pub(super) run: u64,
    pub(super) file: u8,
}

impl Header {
    fn encode(&self) -> [u8; FILE_HEADER as usize] {
        let mut h = [0u8; FILE_HEADER as usize];
        h[..8].copy_from_slice(MAGIC);
        h[8..16].copy_from_slice(&self.store.to_le_bytes());
        h[16..24].copy_from_slice(&self.run.to_le_bytes());
        h[24] = self.file;
        let crc = crc32fast::hash(&h[..28]);
        h[28..].copy_from_slice(&crc.to_le_bytes());
        h
    }

    fn decode(h: &[u8; FILE_HEADER as usize]) -> Option<Self> {
        let crc = u32::from_le_bytes(h[28..].try_into().expect("4 bytes"));
        if &h[..8] != MAGIC || crc32fast::hash(&h[..28]) != crc {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        Some(Self {
            store: u64_at(8),
            run: u64_at(16),
            file: h[24],
        })
    }
}

/// What is at a log file's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Owner {
    /// There is no such file.
    Missing,
    /// The file does not start with a log header (empty, another format,
    /// or not a log).
    Unknown,
    /// A log file with this header, `len` bytes long.
    Log { header: Header, len: u64 },
}

/// Reads the header of the log file at `path`. A file that exists but
/// cannot be read is an error, never `Missing`.
pub(super) fn owner(path: &Path) -> std::io::Result<Owner> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Owner::Missing),
        Err(e) => return Err(e),
    };
    let mut h = [0u8; FILE_HEADER as usize];
    let mut read = 0;
    while read < h.len() {
        match f.read(&mut h[read..])? {
            0 => return Ok(Owner::Unknown),
            n => read += n,
        }
    }
    Ok(match Header::decode(&h) {
        Some(header) => Owner::Log {
            header,
            len: f.metadata()?.len(),
        },
        None => Owner::Unknown,
    })
}

/// Makes both files empty logs of store `id` bound by `run`, durably:
/// their old records are gone. Only for logs whose records the table
/// holds already, or that are not this table's. The header is written
/// before the rest is cut, so that a crash in between leaves a file that
/// names its run.
pub(super) fn bind(paths: &[PathBuf; 2], store: u64, run: u64) -> std::io::Result<()> {
    for (file, p) in (0u8..).zip(paths) {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(p)?;
        f.write_all_at(&Header { store, run, file }.encode(), 0)?;
        f.set_len(FILE_HEADER)?;
        f.sync_all()?;
    }
    sync_dir(&paths[0])
}

/// One logged change: keys borrowed when it is written, owned when read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<K = String> {
    /// `key`'s highest is now `token` (replay takes the larger).
    Raise { key: K, token: u64 },
    /// In-flight mark `seq` of `key`, for a write of `token`.
    Mark { seq: u64, key: K, token: u64 },
    /// The marks below this are dead (a rotation).
    Watermark(u64),
    /// Nothing to replay: the generation began after a commit of the
    /// table's own, which the log's records do not show (see
    /// [`Wal::mark_generation`]).
    Generation,
}

/// The log's two files next to the store file, `<store>.wal.0` and
/// `<store>.wal.1`: generation `g` is written from the start of file
/// `g % 2`, so the next generation can be logged while the previous one is
/// checkpointed.
pub(super) fn paths(store: &Path) -> [PathBuf; 2] {
    [0, 1].map(|i| {
        let mut p = store.as_os_str().to_owned();
        p.push(format!(".wal.{i}"));
        PathBuf::from(p)
    })
}

/// Appends `record` of `generation` to `buf`.
pub fn encode<K: AsRef<str>>(buf: &mut Vec<u8>, generation: u64, record: &Record<K>) {
    let (kind, key, token, seq) = match record {
        Record::Raise { key, token } => (1u8, key.as_ref(), *token, 0),
        Record::Mark { seq, key, token } => (2u8, key.as_ref(), *token, *seq),
        Record::Watermark(w) => (3u8, "", 0, *w),
        Record::Generation => (4u8, "", 0, 0),
    };
    let start = buf.len();
    let body_len = BODY_FIXED + key.len();
    buf.extend_from_slice(&(body_len as u32).to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    buf.extend_from_slice(&generation.to_le_bytes());
    buf.push(kind);
    buf.extend_from_slice(&token.to_le_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(key.as_bytes());
    let crc = crc32fast::hash(&buf[start + HEADER..]);
    buf[start + 4..start + HEADER].copy_from_slice(&crc.to_le_bytes());
}

/// The record at the start of `bytes`, if one checks out: its generation,
/// the record, and its length.
fn decode_one(bytes: &[u8]) -> Option<(u64, Record, usize)> {
    let header = bytes.get(..HEADER)?;
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
    let body = bytes.get(HEADER..HEADER.saturating_add(len))?;
    if len < BODY_FIXED || crc32fast::hash(body) != crc {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().expect("8 bytes"));
    let (token, seq) = (u64_at(9), u64_at(17));
    let key = std::str::from_utf8(&body[BODY_FIXED..]).ok()?.to_string();
    // Only the shape `encode` writes: a field a kind does not use is zero
    // (or empty), so a record reads back as exactly its bytes.
    let record = match body[8] {
        1 if seq == 0 => Record::Raise { key, token },
        2 => Record::Mark { seq, key, token },
        3 if token == 0 && key.is_empty() => Record::Watermark(seq),
        4 if token == 0 && seq == 0 && key.is_empty() => Record::Generation,
        _ => return None,
    };
    Some((u64_at(0), record, HEADER + len))
}

/// The records of `generation` at the start of `bytes`, up to the first
/// that does not check out.
pub fn decode(bytes: &[u8], generation: u64) -> Vec<Record> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some((g, record, len)) = decode_one(&bytes[at..]) {
        if g != generation {
            break;
        }
        out.push(record);
        at += len;
    }
    out
}

/// The newest generation that starts either log file (records from offset
/// `at`): the generation its writer last restarted it under, if it logged
/// anything since.
#[cfg(test)]
pub(super) fn newest_start(paths: &[PathBuf; 2], at: u64) -> std::io::Result<Option<u64>> {
    Ok(first_generation(&paths[0], at)?.max(first_generation(&paths[1], at)?))
}

/// The generation of the first record of the file at `path` (records from
/// offset `at`), if it has one.
pub(super) fn first_generation(path: &Path, at: u64) -> std::io::Result<Option<u64>> {
    let bytes = read_file(path)?;
    Ok(bytes
        .get(at as usize..)
        .and_then(decode_one)
        .map(|(g, _, _)| g))
}

/// The file's bytes; none if it does not exist.
fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(bytes)
}

/// The generation logged after an open that replayed generations
/// `logged` and `logged + 1` into the table: past both.
pub(super) fn first_after_replay(logged: u64) -> u64 {
    logged + 2
}

/// The records not yet in the table, in order: those of `generation` (the
/// oldest the table lacks) and of the generation after it, which was
/// logged while `generation` was being checkpointed. Records start at
/// offset `at` of each file ([`FILE_HEADER`], or 0 in a format-2 log).
pub(super) fn replay(
    paths: &[PathBuf; 2],
    generation: u64,
    at: u64,
) -> std::io::Result<Vec<Record>> {
    let mut out = Vec::new();
    for g in [generation, generation + 1] {
        let bytes = read_file(&paths[(g % 2) as usize])?;
        out.extend(decode(bytes.get(at as usize..).unwrap_or_default(), g));
    }
    Ok(out)
}

/// Makes the directory entries beside `file` durable (its creations,
/// renames and removals).
pub(super) fn sync_dir(file: &Path) -> std::io::Result<()> {
    match file.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => File::open(dir)?.sync_all(),
        None => File::open(".")?.sync_all(),
    }
}

/// The open log: where the next batch goes, and under which generation.
pub(super) struct Wal {
    files: [File; 2],
    /// Bytes of each file allocated (written) so far.
    allocated: [u64; 2],
    pub(super) generation: u64,
    /// Where the next append goes, in the generation's file.
    pub(super) len: u64,
    buf: Vec<u8>,
}

impl Wal {
    /// Opens the log (its files bound to the store by [`bind`]), to be
    /// written from the start of `generation`'s file. The records already
    /// in both files must have been replayed and checkpointed: they are
    /// overwritten.
    pub(super) fn open(paths: &[PathBuf; 2], generation: u64) -> std::io::Result<Self> {
        let open = |p: &PathBuf| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(p)
        };
        let files = [open(&paths[0])?, open(&paths[1])?];
        let allocated = [files[0].metadata()?.len(), files[1].metadata()?.len()];
        let mut wal = Self {
            files,
            allocated,
            generation,
            len: FILE_HEADER,
            buf: Vec::with_capacity(64 << 10),
        };
        for i in 0..2 {
            wal.grow(i, GROW)?;
            wal.files[i].sync_all()?;
        }
        sync_dir(&paths[0])?;
        Ok(wal)
    }

    /// Makes sure the next append has [`GROW`] bytes of room without
    /// growing the file: a disk that was full has room for the log again.
    pub(super) fn reserve(&mut self) -> std::io::Result<()> {
        let i = self.current();
        if self.allocated[i] >= self.len + GROW {
            return Ok(());
        }
        self.grow(i, self.len + GROW)?;
        self.files[i].sync_data()
    }

    fn current(&self) -> usize {
        (self.generation % 2) as usize
    }

    /// Writes zeros up to at least `to` bytes of file `i`, in steps of
    /// [`GROW`]. The next sync makes the new size durable with the records.
    fn grow(&mut self, i: usize, to: u64) -> std::io::Result<()> {
        if to <= self.allocated[i] {
            return Ok(());
        }
        let end = to.div_ceil(GROW) * GROW;
        let zeros = vec![0u8; (end - self.allocated[i]) as usize];
        self.files[i].write_all_at(&zeros, self.allocated[i])?;
        self.allocated[i] = end;
        Ok(())
    }

    /// Adds a record to the next append.
    pub(super) fn stage<K: AsRef<str>>(&mut self, record: &Record<K>) {
        encode(&mut self.buf, self.generation, record);
    }

    /// Whether anything is staged.
    pub(super) fn has_staged(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Drops what is staged (a batch that failed before its append).
    pub(super) fn clear_staged(&mut self) {
        self.buf.clear();
    }

    /// Appends the staged records and syncs them: once this returns `Ok`,
    /// a replay finds them. On an error some of them may be on disk; the
    /// caller must checkpoint before logging again.
    pub(super) fn append_staged(&mut self) -> std::io::Result<()> {
        let result = self.write_staged();
        self.buf.clear();
        result
    }

    fn write_staged(&mut self) -> std::io::Result<()> {
        let i = self.current();
        self.grow(i, self.len + self.buf.len() as u64)?;
        self.files[i].write_all_at(&self.buf, self.len)?;
        self.len += self.buf.len() as u64;
        self.files[i].sync_data()
    }

    /// Stages `records` and appends them.
    #[cfg(test)]
    pub(super) fn append(&mut self, records: &[Record]) -> std::io::Result<()> {
        for r in records {
            self.stage(r);
        }
        self.append_staged()
    }

    /// The log goes on under `generation`, from the start of its file.
    pub(super) fn restart(&mut self, generation: u64) {
        self.generation = generation;
        self.len = FILE_HEADER;
    }

    /// The generation after the one being logged: the table's
    /// `wal_generation` once everything logged so far is committed.
    pub(super) fn next_generation(&self) -> u64 {
        self.generation + 1
    }

    /// The log goes on under [`next_generation`](Self::next_generation),
    /// in the other file: after a commit of everything logged so far, or
    /// before a checkpoint of it starts.
    pub(super) fn move_on(&mut self) {
        self.restart(self.next_generation());
    }

    /// Starts the generation's file with a record of it, after a commit of
    /// the writer's own (leases, forgets: changes the log never holds), so
    /// that the files show how far the table has come and a copy of the
    /// table from before that commit is seen as older than its log. Not
    /// synced: it guards against an operator's mistake, not a crash, and
    /// the next append's sync carries it.
    pub(super) fn mark_generation(&mut self) -> std::io::Result<()> {
        let mut record = Vec::with_capacity(HEADER + BODY_FIXED);
        encode(&mut record, self.generation, &Record::<&str>::Generation);
        let i = self.current();
        self.grow(i, self.len + record.len() as u64)?;
        self.files[i].write_all_at(&record, self.len)?;
        self.len += record.len() as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Record> {
        vec![
            Record::Raise {
                key: "ns:a".into(),
                token: 7,
            },
            Record::Mark {
                seq: 3,
                key: "ns:ü".into(),
                token: u64::MAX,
            },
            Record::Watermark(12),
            Record::Raise {
                key: String::new(),
                token: 0,
            },
        ]
    }

    fn encoded(generation: u64, records: &[Record]) -> Vec<u8> {
        let mut buf = Vec::new();
        for r in records {
            encode(&mut buf, generation, r);
        }
        buf
    }

    #[test]
    fn records_read_back_as_written() {
        let buf = encoded(5, &sample());
        assert_eq!(decode(&buf, 5), sample());
    }

    /// A record whose unused fields are not zero was not written by
    /// `encode`: it ends the replay like a torn one (so a record always
    /// reads back as exactly its bytes; the fuzz target `wal` relies on it).
    #[test]
    fn a_record_of_another_shape_is_not_read() {
        let body = |kind: u8, token: u64, seq: u64, key: &str| {
            let mut b = 1u64.to_le_bytes().to_vec();
            b.push(kind);
            b.extend_from_slice(&token.to_le_bytes());
            b.extend_from_slice(&seq.to_le_bytes());
            b.extend_from_slice(key.as_bytes());
            let mut rec = (b.len() as u32).to_le_bytes().to_vec();
            rec.extend_from_slice(&crc32fast::hash(&b).to_le_bytes());
            rec.extend_from_slice(&b);
            rec
        };
        assert_eq!(
            decode(&body(1, 7, 0, "k"), 1).len(),
            1,
            "a raise as written"
        );
        for bad in [
            body(1, 7, 1, "k"),
            body(3, 1, 5, ""),
            body(3, 0, 5, "k"),
            body(4, 1, 0, ""),
            body(4, 0, 1, ""),
            body(4, 0, 0, "k"),
            body(5, 0, 0, ""),
        ] {
            assert!(decode(&bad, 1).is_empty(), "{bad:?}");
        }
        assert_eq!(decode(&body(3, 0, 5, ""), 1), [Record::Watermark(5)]);
        assert_eq!(decode(&body(4, 0, 0, ""), 1), [Record::Generation]);
    }

    #[test]
    fn another_generation_is_not_read() {
        let buf = encoded(5, &sample());
        assert!(decode(&buf, 6).is_empty());
        assert!(decode(&buf, 4).is_empty());
    }

    #[test]
    fn a_torn_tail_is_dropped_and_what_precedes_it_kept() {
        let buf = encoded(1, &sample());
        let whole = decode(&buf, 1);
        // Every cut inside the last record keeps exactly the ones before.
        let last_start = encoded(1, &sample()[..3]).len();
        for cut in last_start..buf.len() {
            assert_eq!(decode(&buf[..cut], 1), whole[..3], "cut at {cut}");
        }
        let second_end = encoded(1, &sample()[..2]).len();
        // A flipped bit anywhere in a record drops it and all after it.
        for i in 0..second_end {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            assert!(decode(&bad, 1).len() < 2, "flip at byte {i} went unseen");
        }
    }

    #[test]
    fn records_of_a_new_generation_over_old_ones_stop_where_the_new_end() {
        // The log restarts at offset 0 after a checkpoint: what follows the
        // new records is the old generation's, and must not be read.
        let mut buf = encoded(1, &sample());
        buf.extend(encoded(1, &sample()));
        let new = encoded(2, &sample()[..1]);
        buf[..new.len()].copy_from_slice(&new);
        assert_eq!(decode(&buf, 2), sample()[..1]);
        // Zeros (the preallocated part) end the log too.
        let mut z = encoded(3, &sample());
        z.extend([0u8; 64]);
        assert_eq!(decode(&z, 3), sample());
    }

    #[test]
    fn a_log_appends_and_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let paths = paths(&dir.path().join("f.redb"));
        assert_eq!(paths[1].file_name().unwrap(), "f.redb.wal.1");
        let mut w = Wal::open(&paths, 1).unwrap();
        assert_eq!(std::fs::metadata(&paths[1]).unwrap().len(), GROW);
        w.append(&sample()[..2]).unwrap();
        w.append(&sample()[2..]).unwrap();
        assert_eq!(replay(&paths, 1, FILE_HEADER).unwrap(), sample());
        // The next generation goes to the other file: a replay from
        // generation 1 (not yet checkpointed) reads both, in order.
        w.restart(2);
        w.append(&sample()[..1]).unwrap();
        let both: Vec<_> = sample().into_iter().chain(sample()[..1].to_vec()).collect();
        assert_eq!(replay(&paths, 1, FILE_HEADER).unwrap(), both);
        assert_eq!(replay(&paths, 2, FILE_HEADER).unwrap(), sample()[..1]);
        // Generation 3 overwrites generation 1's file.
        w.restart(3);
        w.append(&sample()[1..2]).unwrap();
        assert_eq!(
            replay(&paths, 2, FILE_HEADER).unwrap(),
            [&sample()[..1], &sample()[1..2]].concat()
        );
        assert!(replay(&paths, 4, FILE_HEADER).unwrap().is_empty());
        assert!(
            replay(&super::paths(&dir.path().join("none")), 1, FILE_HEADER)
                .unwrap()
                .is_empty()
        );
    }

    /// A missing log file has no records; one that cannot be opened for
    /// any other reason fails the open of the store rather than pass for
    /// empty (its records may be the only copy of acknowledged advances).
    #[test]
    fn a_log_file_that_cannot_be_read_is_an_error_not_an_empty_log() {
        let dir = tempfile::tempdir().unwrap();
        let paths = paths(&dir.path().join("f.redb"));
        // A symbolic link to itself: opening it fails with ELOOP.
        std::os::unix::fs::symlink(&paths[0], &paths[0]).unwrap();
        // Generation 1 is in file 1 (missing), generation 2 in file 0.
        let e = replay(&paths, 1, FILE_HEADER).unwrap_err();
        assert_ne!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
        // Nor is such a file taken for a missing one.
        assert!(owner(&paths[0]).is_err());
    }
}

#[cfg(test)]
mod ownership {
    use super::*;

    #[test]
    fn a_bound_log_names_its_store_run_and_file_across_generations() {
        let dir = tempfile::tempdir().unwrap();
        let paths = paths(&dir.path().join("f.redb"));
        let header = |file| Header {
            store: 77,
            run: 5,
            file,
        };
        let log = |p: &PathBuf| match owner(p).unwrap() {
            Owner::Log { header, len } => (header, len),
            other => panic!("{other:?}"),
        };
        assert_eq!(owner(&paths[0]).unwrap(), Owner::Missing);
        std::fs::write(&paths[0], b"short").unwrap();
        assert_eq!(owner(&paths[0]).unwrap(), Owner::Unknown);
        bind(&paths, 77, 5).unwrap();
        assert_eq!(log(&paths[0]), (header(0), FILE_HEADER));
        assert_eq!(log(&paths[1]), (header(1), FILE_HEADER));
        assert_eq!(newest_start(&paths, FILE_HEADER).unwrap(), None);
        let mut w = Wal::open(&paths, 4).unwrap();
        w.append(&[Record::Watermark(1)]).unwrap();
        w.restart(5);
        w.append(&[Record::Watermark(2)]).unwrap();
        w.restart(6);
        assert_eq!(newest_start(&paths, FILE_HEADER).unwrap(), Some(5));
        w.mark_generation().unwrap();
        assert_eq!(newest_start(&paths, FILE_HEADER).unwrap(), Some(6));
        w.append(&[Record::Watermark(3)]).unwrap();
        assert_eq!(
            replay(&paths, 6, FILE_HEADER).unwrap(),
            [Record::Generation, Record::Watermark(3)]
        );
        // Appends leave the header alone; the files keep their size.
        assert_eq!(log(&paths[0]), (header(0), GROW));
        assert_eq!(log(&paths[1]), (header(1), GROW));
        // A flipped bit in the header makes it no one's.
        let mut bytes = std::fs::read(&paths[1]).unwrap();
        bytes[17] ^= 1;
        std::fs::write(&paths[1], &bytes).unwrap();
        assert_eq!(owner(&paths[1]).unwrap(), Owner::Unknown);
        // Binding again empties the records.
        bind(&paths, 78, 6).unwrap();
        assert_eq!(newest_start(&paths, FILE_HEADER).unwrap(), None);
        assert_eq!(log(&paths[1]).0.store, 78);
    }
}

#[cfg(test)]
mod growth {
    use super::*;

    #[test]
    fn the_log_grows_ahead_of_its_appends_and_keeps_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let paths = paths(&dir.path().join("f.redb"));
        let path = paths[1].clone();
        let mut w = Wal::open(&paths, 1).unwrap();
        let big = Record::Raise {
            key: "k".repeat(300 << 10),
            token: 1,
        };
        for _ in 0..5 {
            w.append(std::slice::from_ref(&big)).unwrap();
        }
        let size = std::fs::metadata(&path).unwrap().len();
        assert_eq!(size, 2 * GROW, "grown in steps, ahead of the appends");
        assert_eq!(replay(&paths, 1, FILE_HEADER).unwrap().len(), 5);
        // The probe after a failed append makes room for the next one
        // ahead of it (1.5 MiB written, 2 allocated: one step more), and
        // none when there is room.
        w.reserve().unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 3 * GROW);
        w.len = 0;
        w.reserve().unwrap();
        let size = std::fs::metadata(&path).unwrap().len();
        assert_eq!(size, 3 * GROW);
        drop(w);
        // Reopened under a new generation that uses the same file: the
        // old records are not read, and the file keeps its size.
        let _w = Wal::open(&paths, 3).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
        assert!(replay(&paths, 3, FILE_HEADER).unwrap().is_empty());
    }
}
