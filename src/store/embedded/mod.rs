//! The default store: a redb file on local disk and its write-ahead log,
//! with group commit.
//!
//! Every operation goes to one writer thread. It takes everything queued
//! and makes it durable at once, so concurrent advances on many keys share
//! one sync. A batch that raised nothing writes nothing: steady tokens
//! cost no disk write. The file is locked by redb
//! against a second process; a `meta` table carries our format version and a
//! clean-stop flag used for crash recovery, and an `in_flight_log` table the
//! keys that may have a write in flight, so that after a crash only those
//! keys wait for the crashed run's writes. That table is keyed by a sequence
//! number: a mark is an append at its right edge and marks die wholesale
//! below a watermark, so a commit touches a few pages of it however random
//! the keys are.
//!
//! Advances are made durable by a write-ahead log, not by a commit of
//! the table: a batch of advances, marks, rotations and reads is answered
//! from memory and the table, and its raises and marks are appended to the
//! log with one `fdatasync` (a few hundred bytes, where a B-tree commit
//! rewrites several pages). The table catches up by checkpoints, on a
//! thread of their own, and the log is replayed at open after a crash.
//!
//! Files: `store.rs` (the [`EmbeddedStore`]), `writer.rs` (the writer
//! thread and its commits), `logged.rs` (its logged fast path),
//! `checkpoint.rs` (the logged changes and their checkpoints), `wal.rs`
//! (the log's records and files, and replay), `identity.rs` (which log
//! belongs to which table: the checks at open), `ops.rs` (what is sent to
//! it), `schema.rs` (tables, meta keys, opening a file).

mod checkpoint;
mod identity;
#[cfg(test)]
mod identity_tests;
mod logged;
mod ops;
mod schema;
mod store;
#[cfg(test)]
mod tests;
mod wal;
mod writer;

#[cfg(test)]
pub(crate) use schema::forget_marks_flag;
pub use schema::{OpenError, FORMAT_VERSION, OLDEST_FORMAT_VERSION};
pub use store::EmbeddedStore;
/// The write-ahead log's record format, for the fuzz targets (`fuzz/`).
#[cfg(feature = "fuzzing")]
pub use wal::{decode as wal_decode, encode as wal_encode, Record as WalRecord};
