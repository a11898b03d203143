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
//!
//! Files: `store.rs` (the [`EmbeddedStore`]), `writer.rs` (the writer
//! thread and its commits), `ops.rs` (what is sent to it), `schema.rs`
//! (tables, meta keys, opening a file).

mod checkpoint;
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
