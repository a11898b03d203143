//! The embedded store's identity checks at open (`identity.rs`): a table
//! and a log that do not belong together are refused, or the loss is
//! accepted and every key held.

use std::time::Duration;

use super::schema::*;
use super::store::*;
use redb::Database;

use super::tests::{meta_value, open};
use crate::store::api::*;

/// Log files left beside a store file that was deleted hold what that
/// file lacked: a new store there is refused (it would start with none of
/// their fences). Accepted, the new file replays none of their records
/// (whose generations it reuses), sets them aside, and holds every key.
#[tokio::test]
async fn the_log_of_a_deleted_store_file_is_refused_and_never_replayed_into_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let s = open(&dir);
    s.advance("a", 5).await.unwrap();
    s.advance("c", 6).await.unwrap();
    drop(s); // a crash: both live only in the log
    std::fs::remove_file(&path).unwrap();
    match EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(9)) {
        Err(OpenError::TableLost { problem, .. }) => {
            assert!(problem.contains("is missing"), "{problem}")
        }
        other => panic!("expected TableLost, got {:?}", other.err()),
    }
    assert!(!path.exists(), "no new file was made");
    let s = EmbeddedStore::open_with(&path, 1 << 20, Duration::from_secs(9), true).unwrap();
    assert!(
        matches!(s.start_state(), StartState::Unclean { .. }),
        "every key is held"
    );
    // Same length as a's record: without the emptying, c's would follow it.
    s.advance("b", 1).await.unwrap();
    drop(s);
    let s = open(&dir);
    assert_eq!(s.highest("b").await.unwrap(), Some(1));
    assert_eq!(s.highest("a").await.unwrap(), None);
    assert_eq!(s.highest("c").await.unwrap(), None, "the old log's record");
}

/// A format-2 file (a log without a header, records from offset 0) left
/// by a crash: its log is replayed, and the file and its log are bound to
/// one identity (format 3); without its log it is refused.
#[tokio::test]
async fn a_version_2_store_and_its_log_are_upgraded_and_bound() {
    use super::wal::{self, Record};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    {
        let db = Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            meta.insert(FORMAT_VERSION_KEY, 2).unwrap();
            meta.insert(CLEAN_KEY, 0).unwrap();
            meta.insert(MARKS_KEY, 1).unwrap();
            meta.insert(WAL_GENERATION_KEY, 4).unwrap();
            txn.open_table(FENCES).unwrap().insert("a", 7).unwrap();
        }
        txn.commit().unwrap();
    }
    let logs = wal::paths(&path);
    let mut bytes = Vec::new();
    wal::encode(
        &mut bytes,
        4,
        &Record::Raise {
            key: "a",
            token: 10,
        },
    );
    std::fs::write(&logs[0], &bytes).unwrap();
    std::fs::write(&logs[1], []).unwrap();
    // Without its log: refused, the file untouched.
    std::fs::rename(&logs[0], dir.path().join("aside")).unwrap();
    match EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(1)) {
        Err(OpenError::LogLost { problem, .. }) => {
            assert!(problem.contains("missing"), "{problem}")
        }
        other => panic!("expected LogLost, got {:?}", other.err()),
    }
    assert_eq!(meta_value(&path, FORMAT_VERSION_KEY), Some(2));
    std::fs::rename(dir.path().join("aside"), &logs[0]).unwrap();
    let s = open(&dir);
    assert_eq!(s.highest("a").await.unwrap(), Some(10), "replayed");
    drop(s); // a crash
    assert_eq!(meta_value(&path, FORMAT_VERSION_KEY), Some(FORMAT_VERSION));
    let id = meta_value(&path, super::identity::STORE_ID_KEY).unwrap();
    for l in &logs {
        assert!(
            matches!(wal::owner(l).unwrap(), wal::Owner::Log { header, .. } if header.store == id),
            "{l:?}"
        );
    }
    let s = open(&dir);
    assert_eq!(s.highest("a").await.unwrap(), Some(10));
}

/// After an unclean stop, a log that is missing or another store's is
/// refused; accepted, it is set aside (not deleted), every key is held
/// (no marks known), and the store and a new log are bound again.
#[tokio::test]
async fn a_lost_log_is_refused_and_accepting_it_holds_every_key() {
    use super::wal;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let s = open(&dir);
    s.advance("a", 5).await.unwrap();
    drop(s); // a crash: a's raise is in the log only
    let logs = wal::paths(&path);
    std::fs::write(&logs[1], b"not a log at all, and longer than a header").unwrap();
    match EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(1)) {
        Err(e @ OpenError::LogLost { .. }) => {
            let text = e.to_string();
            assert!(text.contains("not a fencegate log"), "{text}");
            assert!(text.contains("--accept-store-reset"), "{text}");
        }
        other => panic!("expected LogLost, got {:?}", other.err()),
    }
    let s = EmbeddedStore::open_with(&path, 1 << 20, Duration::from_secs(1), true).unwrap();
    assert!(matches!(s.start_state(), StartState::Unclean { .. }));
    assert_eq!(s.in_flight_at_crash(), None, "every key is held");
    assert_eq!(s.highest("a").await.unwrap(), None, "the loss accepted");
    let aside: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".rejected-"))
        .collect();
    assert_eq!(aside.len(), 2, "both set aside: {aside:?}");
    s.advance("b", 1).await.unwrap();
    drop(s);
    // The new log is the store's own: a crash now opens without leave.
    let s = open(&dir);
    assert_eq!(s.highest("b").await.unwrap(), Some(1));
    assert_eq!(
        s.in_flight_at_crash(),
        None,
        "still held until a clean stop"
    );
}

/// A commit of the writer's own (a lease claim issues a token) is not in
/// the log: the generation it starts is marked there, so a copy of the
/// table from before it, put back beside the log, is refused as older.
#[tokio::test]
async fn a_table_copied_before_a_lease_commit_is_older_than_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let s = open(&dir);
    s.advance("a", 5).await.unwrap();
    s.close_clean().await.unwrap();
    drop(s);
    let copy = dir.path().join("copy");
    std::fs::copy(&path, &copy).unwrap();
    let s = open(&dir);
    assert!(matches!(
        s.claim_lock("job", "id-1", "me", Duration::from_secs(60))
            .await
            .unwrap(),
        Claim::Granted { .. }
    ));
    drop(s); // a crash, the claim committed to the table only
    std::fs::copy(&copy, &path).unwrap();
    match EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(1)) {
        Err(OpenError::LogLost { problem, .. }) => {
            assert!(
                problem.contains("older than its write-ahead log"),
                "{problem}"
            )
        }
        other => panic!("expected LogLost, got {:?}", other.err()),
    }
}

/// A copy of the store's own log from an earlier run, the two files
/// swapped, or a file cut short: after an unclean stop, refused; each
/// named.
#[tokio::test]
async fn an_older_copy_a_swap_or_a_cut_of_the_own_log_is_refused() {
    use super::wal;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let logs = wal::paths(&path);
    let s = open(&dir);
    s.advance("a", 5).await.unwrap();
    s.close_clean().await.unwrap();
    drop(s);
    let saved: Vec<Vec<u8>> = logs.iter().map(|l| std::fs::read(l).unwrap()).collect();
    let s = open(&dir);
    s.advance("a", 9).await.unwrap();
    drop(s); // a crash: 9 lives in this run's log only
    let now: Vec<Vec<u8>> = logs.iter().map(|l| std::fs::read(l).unwrap()).collect();
    let refused = |what: &str| match EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(1)) {
        Err(OpenError::LogLost { problem, .. }) => assert!(problem.contains(what), "{problem}"),
        Ok(_) => panic!("opened with {what}"),
        Err(e) => panic!("{what}: {e}"),
    };
    for (l, b) in logs.iter().zip(&saved) {
        std::fs::write(l, b).unwrap();
    }
    refused("from another run");
    std::fs::write(&logs[0], &now[1]).unwrap();
    std::fs::write(&logs[1], &now[0]).unwrap();
    refused("swapped");
    std::fs::write(&logs[1], &now[1]).unwrap();
    std::fs::write(&logs[0], &now[0][..64]).unwrap();
    refused("truncated");
    // Put back as they were, nothing is lost.
    std::fs::write(&logs[0], &now[0]).unwrap();
    let s = open(&dir);
    assert_eq!(s.highest("a").await.unwrap(), Some(9));
}

/// A start that crashes between recording its run (pending) and recording
/// the log bound to it, at any point, leaves a store the next start opens
/// without an operator: files of the old run, of the pending run, or one
/// of each.
#[tokio::test]
async fn a_crash_while_the_log_is_bound_needs_no_operator() {
    use super::identity::{LOG_PENDING_KEY, STORE_ID_KEY};
    use super::wal;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let logs = wal::paths(&path);
    let s = open(&dir);
    s.advance("a", 5).await.unwrap();
    drop(s); // a crash
    let set_pending = |run: u64| {
        let db = Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert(LOG_PENDING_KEY, run)
            .unwrap();
        txn.commit().unwrap();
    };
    let id = meta_value(&path, STORE_ID_KEY).unwrap();
    for (run, bound) in [
        (4242, [false, false]),
        (4243, [true, false]),
        (4244, [true, true]),
    ] {
        set_pending(run);
        // What `wal::bind` leaves when a crash stops it after the first
        // file, or after both.
        match bound {
            [true, false] => {
                wal::bind(&[logs[0].clone(), dir.path().join("scratch")], id, run).unwrap()
            }
            [true, true] => wal::bind(&logs, id, run).unwrap(),
            _ => {}
        }
        let s = EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(1))
            .unwrap_or_else(|e| panic!("bound {bound:?}: {e}"));
        assert_eq!(s.highest("a").await.unwrap(), Some(5), "bound {bound:?}");
        drop(s); // and a crash again
    }
}

/// A new store file is made whole under another name and renamed: what a
/// start killed in its first milliseconds leaves (a `.creating` file, no
/// store file) is cleared by the next start, which opens a new store.
#[tokio::test]
async fn a_start_killed_while_creating_the_file_leaves_nothing_refused() {
    let dir = tempfile::tempdir().unwrap();
    // What a kill mid-creation leaves: part of a file, not redb's.
    std::fs::write(dir.path().join("f.redb.creating"), vec![0u8; 73_728]).unwrap();
    let s = open(&dir);
    assert_eq!(s.start_state(), StartState::Clean);
    s.advance("a", 1).await.unwrap();
    assert!(!dir.path().join("f.redb.creating").exists());
    drop(s);
    assert_eq!(open(&dir).highest("a").await.unwrap(), Some(1));
}

/// After a clean stop the table holds everything: a log of this store
/// from another run is replaced, but a log of another store means the
/// table beside it was replaced by another store's, and is refused.
#[tokio::test]
async fn after_a_clean_stop_an_older_own_log_is_replaced_and_another_stores_refused() {
    let (dir, other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let path = dir.path().join("f.redb");
    let logs = super::wal::paths(&path);
    let s = open(&dir);
    s.advance("k", 5).await.unwrap();
    s.close_clean().await.unwrap();
    drop(s);
    let older: Vec<Vec<u8>> = logs.iter().map(|l| std::fs::read(l).unwrap()).collect();
    let s = open(&dir);
    s.advance("k", 6).await.unwrap();
    s.close_clean().await.unwrap();
    drop(s);
    for (l, bytes) in logs.iter().zip(&older) {
        std::fs::write(l, bytes).unwrap();
    }
    let s = open(&dir);
    assert_eq!(s.highest("k").await.unwrap(), Some(6), "the table is whole");
    s.close_clean().await.unwrap();
    drop(s);

    let b = open(&other);
    b.close_clean().await.unwrap();
    drop(b);
    std::fs::copy(other.path().join("f.redb"), &path).unwrap();
    match EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(9)) {
        Err(OpenError::LogLost { problem, .. }) => {
            assert!(problem.contains("is not the store that wrote"), "{problem}")
        }
        other => panic!("expected LogLost, got {:?}", other.err()),
    }
}

/// Where the table should be: an empty file is refused (log or not), and
/// log files that are empty are no log (a new store is made beside them).
#[tokio::test]
async fn an_empty_table_is_refused_and_empty_log_files_are_no_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    std::fs::write(&path, b"").unwrap();
    match EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(9)) {
        Err(OpenError::TableLost { problem, .. }) => {
            assert!(problem.contains("is empty"), "{problem}")
        }
        other => panic!("expected TableLost, got {:?}", other.err()),
    }
    std::fs::remove_file(&path).unwrap();
    for l in super::wal::paths(&path) {
        std::fs::write(l, b"").unwrap();
    }
    let s = open(&dir);
    assert_eq!(s.start_state(), StartState::Clean, "a new store");
}

/// An accepted reset sets the old files aside before the new table records
/// anything: a start that crashes in between (after the new file is made,
/// or after its first commit, but before its log is bound) must leave a
/// store that still holds every key at the next start, which needs no
/// second leave, not a new store that starts clean.
#[tokio::test]
async fn an_accepted_reset_that_crashed_before_its_log_was_bound_still_holds_every_key() {
    for crash_after_first_commit in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.redb");
        let s = open(&dir);
        s.advance("a", 5).await.unwrap();
        drop(s); // a crash: a's fence lives only in the log
        std::fs::remove_file(&path).unwrap();
        let logs = super::wal::paths(&path);
        // The accepted start's first steps, then its crash.
        let table = super::identity::before_create(&path, &logs, true)
            .unwrap()
            .map_err(|l| l.problem)
            .unwrap();
        assert!(matches!(table, super::identity::Table::Accepted));
        super::identity::create_whole(&path).unwrap();
        if crash_after_first_commit {
            let db = open_db(&path, 1 << 20).unwrap();
            init_meta(&db, &path, &logs, Duration::from_secs(9), true, true).unwrap();
        }
        let s = EmbeddedStore::open(&path, 1 << 20, Duration::from_secs(9)).unwrap();
        assert!(
            matches!(s.start_state(), StartState::Unclean { .. }),
            "a reset cut short started clean (crash after its first commit: \
             {crash_after_first_commit})"
        );
        assert!(
            s.in_flight_at_crash().is_none(),
            "every key is held, not only marked ones"
        );
        s.close_clean().await.unwrap();
        drop(s);
        assert!(
            !dir.path().join("f.redb.reset").exists(),
            "the reset's marker outlived its end"
        );
        let s = open(&dir);
        assert_eq!(s.start_state(), StartState::Clean, "the reset is over");
    }
}
