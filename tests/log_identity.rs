//! The embedded store's write-ahead log belongs to its store file: after
//! `kill -9`, a store file started without its own log (moved, restored
//! from a backup, reached through a symbolic link, beside another store's
//! log) refuses to start, naming the files and the way out, instead of
//! opening with older fences; `--accept-store-reset` is the way out.

mod common;

use common::*;
use std::path::{Path, PathBuf};

fn logs(store: &Path) -> [PathBuf; 2] {
    [0, 1].map(|i| PathBuf::from(format!("{}.wal.{i}", store.display())))
}

/// A store whose key `/k` is 7 in the table (a clean stop checkpoints)
/// and 10 only in the log (a `kill -9` after the raise).
async fn seven_in_the_table_ten_in_the_log(up: &Upstream, store: &Path, dir: &Path) {
    let mut p = ProxyBuilder::new(&up.url(), dir).store(store).spawn();
    assert_eq!(put(&p.url("/k"), "7").await.status, 200);
    assert!(p.sigterm().success());
    let mut p = ProxyBuilder::new(&up.url(), dir).store(store).spawn();
    assert_eq!(put(&p.url("/k"), "10").await.status, 200);
    p.kill9();
}

fn assert_refused_naming_the_log(err: &str, store: &Path) {
    assert!(err.contains("write-ahead log"), "{err}");
    assert!(
        err.contains(&logs(store)[0].display().to_string()),
        "names the log files: {err}"
    );
    assert!(err.contains("--accept-store-reset"), "the way out: {err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_file_moved_without_its_log_is_refused_until_the_loss_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let store = dir.path().join("fences.redb");
    seven_in_the_table_ten_in_the_log(&up, &store, dir.path()).await;
    let elsewhere = tempfile::tempdir().unwrap();
    let moved = elsewhere.path().join("fences.redb");
    std::fs::rename(&store, &moved).unwrap();

    let (status, err) = ProxyBuilder::new(&up.url(), elsewhere.path())
        .store(&moved)
        .start_refused();
    assert!(!status.success());
    assert_refused_naming_the_log(&err, &moved);
    assert!(err.contains("is missing"), "{err}");

    // Put back, the log is found again and nothing was lost.
    for (from, to) in logs(&store).iter().zip(logs(&moved).iter()) {
        std::fs::rename(from, to).unwrap();
    }
    let mut p = ProxyBuilder::new(&up.url(), elsewhere.path())
        .store(&moved)
        .spawn();
    let a = put(&p.url("/k"), "9").await;
    assert_eq!(a.status, 409, "{}", a.text());
    assert_eq!(a.header("x-fence-token-highest"), Some("10"));
    p.kill9();

    // Moved again without it, and the loss accepted: the store starts,
    // every key is held for the recovery window, nothing is deleted.
    let third = tempfile::tempdir().unwrap();
    let again = third.path().join("fences.redb");
    std::fs::rename(&moved, &again).unwrap();
    let p = ProxyBuilder::new(&up.url(), third.path())
        .store(&again)
        .args(&["--accept-store-reset", "--upstream-timeout", "30s"])
        .spawn();
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(&m, "fencegate_recovering", 1.0);
    let a = put(&p.url("/k"), "11").await;
    assert_eq!(a.status, 503, "held for the recovery window: {}", a.text());
    assert!(logs(&moved).iter().all(|l| l.exists()), "left where it was");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_reached_through_a_symlink_keeps_one_log_whichever_name_starts_it() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let target = dir.path().join("volume").join("fences.redb");
    std::fs::create_dir(target.parent().unwrap()).unwrap();
    let link = dir.path().join("current.redb");
    std::os::unix::fs::symlink(&target, &link).unwrap();

    // Started by the link, restarted by the target.
    seven_in_the_table_ten_in_the_log(&up, &link, dir.path()).await;
    assert!(logs(&target).iter().all(|l| l.exists()), "beside the file");
    assert!(!logs(&link)[0].exists(), "not beside the link");
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .store(&target)
        .spawn();
    assert_eq!(put(&p.url("/k"), "9").await.status, 409);
    // (A key that had no write in flight at the crash is not held.)
    assert_eq!(put(&p.url("/j"), "3").await.status, 200);
    p.kill9();
    // And the other way round.
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .store(&link)
        .spawn();
    let a = put(&p.url("/j"), "2").await;
    assert_eq!(a.status, 409, "{}", a.text());
    assert_eq!(a.header("x-fence-token-highest"), Some("3"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_file_beside_another_stores_log_is_refused() {
    let up = start_upstream().await;
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let (sa, sb) = (a.path().join("fences.redb"), b.path().join("fences.redb"));
    seven_in_the_table_ten_in_the_log(&up, &sa, a.path()).await;
    seven_in_the_table_ten_in_the_log(&up, &sb, b.path()).await;
    for (from, to) in logs(&sb).iter().zip(logs(&sa).iter()) {
        std::fs::copy(from, to).unwrap();
    }
    let (status, err) = ProxyBuilder::new(&up.url(), a.path())
        .store(&sa)
        .start_refused();
    assert!(!status.success());
    assert_refused_naming_the_log(&err, &sa);
    assert!(err.contains("belongs to another store"), "{err}");
}

/// A store file restored from a backup taken while it was stopped cleanly
/// is older than the log beside it: refused too, clean flag or not.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_file_restored_from_an_older_backup_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let store = dir.path().join("fences.redb");
    let mut p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    assert_eq!(put(&p.url("/k"), "7").await.status, 200);
    assert!(p.sigterm().success());
    let backup = dir.path().join("backup.redb");
    std::fs::copy(&store, &backup).unwrap();
    for (token, restart_cleanly) in [("10", true), ("11", false)] {
        let mut p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
        assert_eq!(put(&p.url("/k"), token).await.status, 200);
        if restart_cleanly {
            assert!(p.sigterm().success());
            // A clean stop checkpointed: 10 is in the table; the next
            // run's raise lives in the log only.
        } else {
            p.kill9();
        }
    }
    std::fs::copy(&backup, &store).unwrap();
    let (status, err) = ProxyBuilder::new(&up.url(), dir.path()).start_refused();
    assert!(!status.success());
    assert_refused_naming_the_log(&err, &store);
    assert!(err.contains("older than its write-ahead log"), "{err}");
}

/// The store's own log, but a copy from an earlier run (copied after a
/// clean stop and put back after a crash), or left under another name of
/// the same file (a hard link the store later ran under): refused too.
#[tokio::test(flavor = "multi_thread")]
async fn an_older_copy_of_the_own_log_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let store = dir.path().join("fences.redb");
    let mut p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    assert_eq!(put(&p.url("/k"), "10").await.status, 200);
    assert!(p.sigterm().success());
    let saved: Vec<Vec<u8>> = logs(&store)
        .iter()
        .map(|l| std::fs::read(l).unwrap())
        .collect();
    // A hard link to the file, run under that name and crashed.
    let other = dir.path().join("other.redb");
    std::fs::hard_link(&store, &other).unwrap();
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .store(&other)
        .spawn();
    assert_eq!(put(&p.url("/k"), "20").await.status, 200);
    p.kill9();
    // Started by the first name: its log is the older run's.
    let (status, err) = ProxyBuilder::new(&up.url(), dir.path()).start_refused();
    assert!(!status.success());
    assert_refused_naming_the_log(&err, &store);
    assert!(err.contains("from another run"), "{err}");
    // And the older copy put back beside the name that ran last.
    for (l, b) in logs(&other).iter().zip(&saved) {
        std::fs::write(l, b).unwrap();
    }
    let (status, err) = ProxyBuilder::new(&up.url(), dir.path())
        .store(&other)
        .start_refused();
    assert!(!status.success());
    assert!(err.contains("from another run"), "{err}");
}

/// `kill -9` in the first milliseconds of the very first start on a new
/// store file leaves nothing a later start refuses (it once left a file
/// without redb's header under the store's name, refused as corrupt).
#[tokio::test(flavor = "multi_thread")]
async fn a_first_start_killed_at_once_leaves_a_store_that_opens() {
    let up = start_upstream().await;
    for i in 0..60u64 {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new(bin())
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--upstream", &up.url(), "--store"])
            .arg(dir.path().join("fences.redb"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Spread over the start's first milliseconds (a bounded loop).
        std::thread::sleep(std::time::Duration::from_micros(300 * (i % 40)));
        child.kill().unwrap();
        child.wait().unwrap();
        let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
        assert_eq!(put(&p.url("/k"), "1").await.status, 200, "round {i}");
    }
}

/// The attack's finding A1: after `kill -9`, a store file deleted, or
/// emptied (a filesystem that lost it, `> file`), beside the log that
/// holds its last raises started as a new, empty store and overwrote the
/// log; a stale token was forwarded. Both are refused now, the log left as
/// it was; accepting the loss makes a new store that holds every key.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_file_deleted_or_emptied_beside_its_log_is_refused_not_made_anew() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let store = dir.path().join("fences.redb");
    seven_in_the_table_ten_in_the_log(&up, &store, dir.path()).await;
    let before: Vec<Vec<u8>> = logs(&store)
        .iter()
        .map(|l| std::fs::read(l).unwrap())
        .collect();
    let table = std::fs::read(&store).unwrap();

    std::fs::remove_file(&store).unwrap();
    let (status, err) = ProxyBuilder::new(&up.url(), dir.path())
        .store(&store)
        .start_refused();
    assert!(!status.success());
    assert!(
        err.contains("is missing, but its write-ahead log is there"),
        "{err}"
    );
    assert!(err.contains("--accept-store-reset"), "the way out: {err}");
    assert!(!store.exists(), "no new store was made");

    std::fs::write(&store, b"").unwrap();
    let (status, err) = ProxyBuilder::new(&up.url(), dir.path())
        .store(&store)
        .start_refused();
    assert!(!status.success());
    assert!(err.contains("is empty"), "{err}");
    assert_eq!(std::fs::read(&store).unwrap(), b"", "left as it was");
    let after: Vec<Vec<u8>> = logs(&store)
        .iter()
        .map(|l| std::fs::read(l).unwrap())
        .collect();
    assert_eq!(before, after, "the log is left as it was");

    // Restored, nothing was lost.
    std::fs::write(&store, &table).unwrap();
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .store(&store)
        .spawn();
    let a = put(&p.url("/k"), "9").await;
    assert_eq!(a.status, 409, "{}", a.text());
    p.kill9();

    // Emptied again and the loss accepted: a new store that holds every
    // key for the recovery window; the empty file and the log set aside.
    std::fs::write(&store, b"").unwrap();
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .store(&store)
        .args(&["--accept-store-reset", "--upstream-timeout", "30s"])
        .spawn();
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(&m, "fencegate_recovering", 1.0);
    let a = put(&p.url("/k"), "11").await;
    assert_eq!(a.status, 503, "held for the recovery window: {}", a.text());
    let aside = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains(".rejected-"))
        .count();
    assert_eq!(aside, 3, "the empty file and both log files are set aside");
}

/// The attack's finding A1, after a clean stop: a store file replaced by
/// another store's (a fresh one, or a copy) beside the log of the store
/// that was there started with the other store's fences, silently.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_file_replaced_by_another_stores_after_a_clean_stop_is_refused() {
    let up = start_upstream().await;
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let (sa, sb) = (a.path().join("fences.redb"), b.path().join("fences.redb"));
    let mut p = ProxyBuilder::new(&up.url(), a.path()).store(&sa).spawn();
    assert_eq!(put(&p.url("/k"), "100").await.status, 200);
    assert!(p.sigterm().success());
    let mut p = ProxyBuilder::new(&up.url(), b.path()).store(&sb).spawn();
    assert!(p.sigterm().success());
    std::fs::copy(&sb, &sa).unwrap();

    let (status, err) = ProxyBuilder::new(&up.url(), a.path())
        .store(&sa)
        .start_refused();
    assert!(!status.success());
    assert!(
        err.contains("is not the store that wrote the write-ahead log"),
        "{err}"
    );
}

/// A brand-new store still starts where nothing was, and an empty file
/// with no log (a `touch`) is refused: fencegate never leaves one.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_store_starts_where_nothing_was_and_an_empty_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let store = dir.path().join("fences.redb");
    std::fs::write(&store, b"").unwrap();
    let (status, err) = ProxyBuilder::new(&up.url(), dir.path())
        .store(&store)
        .start_refused();
    assert!(!status.success());
    assert!(err.contains("is empty"), "{err}");
    std::fs::remove_file(&store).unwrap();
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .store(&store)
        .spawn();
    assert_eq!(put(&p.url("/k"), "1").await.status, 200);
    assert!(p.sigterm().success());
}
