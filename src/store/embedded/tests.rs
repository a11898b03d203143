//! The embedded store's unit tests: compare-and-raise, group commit,
//! clean stops, in-flight marks (the checks of which log belongs to
//! which table: `identity_tests.rs`).

use std::sync::Arc;
use std::time::Duration;

use redb::Database;

use super::schema::*;
use super::store::*;
use crate::store::api::*;

pub(super) fn open(dir: &tempfile::TempDir) -> EmbeddedStore {
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

/// What `table` of the file alone holds for `key` (the log not
/// applied): opens the file as redb, so the store must be closed.
fn stored(
    path: &std::path::Path,
    table: redb::TableDefinition<&str, u64>,
    key: &str,
) -> Option<u64> {
    use redb::ReadableDatabase;
    let db = Database::create(path).unwrap();
    let read = db.begin_read().unwrap();
    let t = read.open_table(table).unwrap();
    let v = t.get(key).unwrap().map(|v| v.value());
    v
}

fn table_value(path: &std::path::Path, key: &str) -> Option<u64> {
    stored(path, FENCES, key)
}

pub(super) fn meta_value(path: &std::path::Path, key: &str) -> Option<u64> {
    stored(path, META, key)
}

/// Advances and marks are made durable by the log, not by a commit of the
/// table: after a crash the table alone lacks them, and the replay at
/// open puts them back, never lowering a key. A second crash right after
/// that open loses nothing either (the replay was committed).
#[tokio::test]
async fn advances_live_in_the_log_until_a_checkpoint_and_a_crash_replays_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let s = open(&dir);
    let before = s.commit_count();
    assert!(matches!(
        s.advance("a", 5).await.unwrap(),
        Advance::Raised { previous: None }
    ));
    assert_eq!(s.commit_count() - before, 1, "one sync for the advance");
    s.advance("a", 9).await.unwrap();
    assert_eq!(
        s.advance("a", 8).await.unwrap(),
        Advance::Stale { highest: 9 }
    );
    let (_, seq) = s.advance_marked("b", 4).await.unwrap();
    assert_eq!(s.highest("a").await.unwrap(), Some(9), "read from the log");
    drop(s); // a crash
    assert_eq!(table_value(&path, "a"), None, "the table was not committed");
    let s = open(&dir);
    assert!(matches!(s.start_state(), StartState::Unclean { .. }));
    assert_eq!(s.highest("a").await.unwrap(), Some(9));
    assert_eq!(s.highest("b").await.unwrap(), Some(4));
    assert_eq!(
        s.in_flight_at_crash(),
        Some(vec![CrashedKey {
            key: "b".into(),
            highest: Some(4),
            lowest: 4
        }])
    );
    assert!(s.next_mark() > seq, "mark numbers are not handed out again");
    drop(s); // a second crash, before anything else was written
    assert_eq!(table_value(&path, "a"), Some(9), "the replay was committed");
    let s = open(&dir);
    assert_eq!(s.highest("a").await.unwrap(), Some(9));
    s.close_clean().await.unwrap();
    drop(s);
    let s = open(&dir);
    assert_eq!(
        s.start_state(),
        StartState::Clean,
        "a clean stop checkpoints"
    );
}

/// A lease operation (or anything else that is not an advance, a mark, a
/// rotation or a read) checkpoints the log into the table first, in its
/// own commit; after it the log starts over under a new generation, and
/// what the table holds is never lowered by what the log held.
#[tokio::test]
async fn other_operations_checkpoint_the_log_first() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let s = open(&dir);
    s.advance("a", 5).await.unwrap();
    s.record_key_mapping(42).await.unwrap();
    s.advance("b", 1).await.unwrap();
    // A lease read writes nothing of its own, and still checkpoints.
    assert_eq!(s.read_lock("x").await.unwrap(), None);
    s.advance("c", 1).await.unwrap();
    drop(s);
    assert_eq!(table_value(&path, "a"), Some(5), "checkpointed");
    assert_eq!(table_value(&path, "b"), Some(1), "checkpointed by the read");
    assert_eq!(table_value(&path, "c"), None, "logged after it");
    let generation = meta_value(&path, WAL_GENERATION_KEY).unwrap();
    let s = open(&dir);
    assert_eq!(s.highest("a").await.unwrap(), Some(5));
    assert_eq!(s.highest("c").await.unwrap(), Some(1));
    drop(s);
    assert!(
        meta_value(&path, WAL_GENERATION_KEY).unwrap() > generation,
        "each open moves the log to a new generation"
    );
}

/// A log grown past its checkpoint size is checkpointed (on a thread of
/// its own, while the next generation is logged in the other file), so it
/// stays bounded however long the store runs without a lease operation or
/// a stop.
#[tokio::test]
async fn a_long_log_is_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let s = open(&dir);
    let keys = fill_past_a_checkpoint(&s).await;
    drop(s);
    assert_eq!(table_value(&path, &keys[0]), Some(1), "checkpointed");
    for log in super::wal::paths(&path) {
        let len = std::fs::metadata(&log).unwrap().len();
        assert!(
            len <= super::wal::CHECKPOINT_BYTES + 2 * super::wal::GROW,
            "{} grew to {len} bytes",
            log.display()
        );
    }
    let s = open(&dir);
    assert_eq!(s.highest(keys.last().unwrap()).await.unwrap(), Some(1));
}

/// Advances keys of 64 KiB each to token 1 until the log has passed its
/// checkpoint size, and a few more; returns them in order.
async fn fill_past_a_checkpoint(s: &EmbeddedStore) -> Vec<String> {
    let n = (super::wal::CHECKPOINT_BYTES / (64 << 10)) as usize + 8;
    let mut keys = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("{i}:{}", "k".repeat(64 << 10));
        s.advance(&key, 1).await.unwrap();
        keys.push(key);
    }
    keys
}

/// A crash while a checkpoint runs loses nothing: the generation being
/// checkpointed stays in its own file until the table holds it, and the
/// next one is logged in the other file. A rotation meanwhile counts the
/// frozen marks it lets die, once.
#[tokio::test]
async fn a_crash_during_a_checkpoint_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let s = open(&dir);
    let held = super::checkpoint::HOLD.write().await;
    s.mark_in_flight("m", 1).await.unwrap();
    let keys = fill_past_a_checkpoint(&s).await;
    s.advance("after", 2).await.unwrap();
    assert_eq!(s.in_flight_marks(), 1);
    s.rotate_marks(vec![], s.next_mark()).await.unwrap();
    assert_eq!(s.in_flight_marks(), 0, "the frozen mark died");
    // The crash: the files as the disk holds them now.
    let copy = tempfile::tempdir().unwrap();
    let copied = copy.path().join("f.redb");
    std::fs::copy(&path, &copied).unwrap();
    for (from, to) in super::wal::paths(&path)
        .iter()
        .zip(super::wal::paths(&copied).iter())
    {
        std::fs::copy(from, to).unwrap();
    }
    drop(held);
    drop(s);
    assert_eq!(
        table_value(&copied, &keys[0]),
        None,
        "the checkpoint was held"
    );
    let c = open(&copy);
    assert_eq!(
        c.highest(&keys[0]).await.unwrap(),
        Some(1),
        "the generation being checkpointed"
    );
    assert_eq!(c.highest(keys.last().unwrap()).await.unwrap(), Some(1));
    assert_eq!(c.highest("after").await.unwrap(), Some(2), "the next one");
}

/// A torn or overwritten tail of the log is dropped at open, and what
/// precedes it is kept; the store opens either way.
#[tokio::test]
async fn a_torn_log_tail_is_dropped_not_misread() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    let s = open(&dir);
    s.advance("a", 5).await.unwrap();
    s.advance("b", 7).await.unwrap();
    drop(s);
    // b's record is the last of the first generation logged (in the
    // first file): damage its final byte (the end of its key).
    let log = &super::wal::paths(&path)[0];
    let mut bytes = std::fs::read(log).unwrap();
    let end = bytes.iter().rposition(|b| *b != 0).unwrap();
    bytes[end] ^= 0xff;
    std::fs::File::options()
        .write(true)
        .open(log)
        .unwrap()
        .write_all_at(&bytes[end..=end], end as u64)
        .unwrap();
    let s = open(&dir);
    assert_eq!(s.highest("a").await.unwrap(), Some(5));
    assert_eq!(s.highest("b").await.unwrap(), None, "the torn record");
}

/// A store written by the previous release (format version 1: no log,
/// no generation), left by a crash with a write in flight, opens: its
/// fences, marks and crash are found, and it is upgraded to the current
/// version.
#[tokio::test]
async fn a_version_1_store_is_upgraded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.redb");
    {
        let db = Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            meta.insert(FORMAT_VERSION_KEY, 1).unwrap();
            meta.insert(CLEAN_KEY, 0).unwrap();
            meta.insert(MARKS_KEY, 1).unwrap();
            meta.insert(WATERMARK_KEY, 10).unwrap();
            meta.insert(WINDOW_KEY, 3000).unwrap();
            let mut fences = txn.open_table(FENCES).unwrap();
            fences.insert("a", 9).unwrap();
            fences.insert("b", 3).unwrap();
            let mut marks = txn.open_table(MARKS).unwrap();
            marks.insert(11, (9, "a")).unwrap();
            txn.open_table(LOCKS).unwrap();
        }
        txn.commit().unwrap();
    }
    let s = open(&dir);
    assert_eq!(
        s.start_state(),
        StartState::Unclean {
            previous_window: Some(Duration::from_secs(3))
        }
    );
    assert_eq!(
        s.in_flight_at_crash(),
        Some(vec![CrashedKey {
            key: "a".into(),
            highest: Some(9),
            lowest: 9
        }])
    );
    assert_eq!(s.highest("b").await.unwrap(), Some(3));
    assert!(s.next_mark() >= 12);
    s.advance("b", 4).await.unwrap();
    s.close_clean().await.unwrap();
    drop(s);
    assert_eq!(
        meta_value(&path, FORMAT_VERSION_KEY),
        Some(FORMAT_VERSION),
        "upgraded"
    );
    let s = open(&dir);
    assert_eq!(s.start_state(), StartState::Clean);
    assert_eq!(s.highest("b").await.unwrap(), Some(4));
}
