//! The embedded store's unit tests: compare-and-raise, group commit,
//! clean stops, in-flight marks, refusals at open.

use std::sync::Arc;
use std::time::Duration;

use redb::Database;

use super::schema::*;
use super::store::*;
use crate::store::api::*;

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
