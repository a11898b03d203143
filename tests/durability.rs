//! Durability and crash behaviour with real processes: kill -9, restart,
//! clean shutdown, the crash-recovery window, store locking and corruption.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_advances_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "1s"])
        .spawn();
    // 200 concurrent advances on distinct keys, and 50 racing tokens on one.
    let mut tasks = Vec::new();
    for i in 0..200u32 {
        let url = p.url(&format!("/k/{i}"));
        tasks.push(tokio::spawn(async move {
            (None, put(&url, "1000").await.status)
        }));
    }
    for t in 1..=50u64 {
        let url = p.url("/hot");
        tasks.push(tokio::spawn(async move {
            (Some(t), put(&url, &t.to_string()).await.status)
        }));
    }
    let mut hot_admitted = Vec::new();
    for t in tasks {
        let (token, status) = t.await.unwrap();
        match token {
            None => assert_eq!(status, 200),
            Some(t) => {
                assert!(status == 200 || status == 409, "{status}");
                if status == 200 {
                    hot_admitted.push(t);
                }
            }
        }
    }
    let hot_max = *hot_admitted.iter().max().unwrap();
    // Applied tokens on the hot key never decrease.
    let applied: Vec<u64> = up
        .records()
        .iter()
        .filter(|r| r.target == "/hot")
        .map(|r| r.token.as_ref().unwrap().parse().unwrap())
        .collect();
    assert!(
        applied.windows(2).all(|w| w[0] <= w[1]),
        "applied out of order: {applied:?}"
    );

    p.kill9();
    p.restart();
    // Unclean stop: writes wait out the recovery window first.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for i in (0..200u32).step_by(7) {
        let a = put(&p.url(&format!("/k/{i}")), "999").await;
        assert_eq!(a.status, 409, "key {i} lost its fence: {}", a.text());
    }
    let a = put(&p.url("/hot"), &(hot_max - 1).to_string()).await;
    assert_eq!(a.status, 409);
    assert_eq!(
        a.header("x-fence-token-highest"),
        Some(hot_max.to_string().as_str())
    );
    assert_eq!(put(&p.url("/hot"), &hot_max.to_string()).await.status, 200);
}

/// Keys recorded in the store as possibly having a write in flight.
async fn durable_marks(p: &Proxy) -> f64 {
    metric(p, "fencegate_in_flight_marks ")
        .await
        .expect("marks metric")
}

/// After kill -9 only the keys that may have had a write in flight wait:
/// a stale token gets 409 at once, an equal one and every other key go as
/// usual, and the in-flight key's newer token gets 503 with its time left
/// until the crashed run's write can no longer be in flight, so the
/// backend sees the older write first.
#[tokio::test(flavor = "multi_thread")]
async fn after_kill_9_only_keys_with_a_write_in_flight_wait() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "6s"])
        .spawn();
    assert_eq!(put(&p.url("/quiet"), "5").await.status, 200);
    let busy = slow_put(p.url("/busy"), "5", "3000");
    eventually(
        "the busy write reached the backend",
        Duration::from_secs(5),
        || up.arrivals() == 2,
    )
    .await;
    // The quiet key's mark is cleared once it has been idle a while; the
    // busy key's stays while its write is in flight.
    let deadline = Instant::now() + Duration::from_secs(10);
    while durable_marks(&p).await != 1.0 {
        assert!(
            Instant::now() < deadline,
            "the quiet key's mark was never cleared"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    p.kill9();
    let _ = busy.await;
    p.restart();
    let started = Instant::now();
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(&m, "fencegate_recovering", 1.0);
    assert_series(&m, "fencegate_recovery_held_keys", 1.0);
    // Stale: refused at once, on either key.
    for key in ["/quiet", "/busy"] {
        let a = put(&p.url(key), "4").await;
        assert_eq!(a.status, 409, "{key}: {}", a.text());
    }
    // Every key but the busy one behaves as if nothing happened.
    assert_eq!(put(&p.url("/quiet"), "5").await.status, 200, "equal");
    assert_eq!(
        put(&p.url("/quiet"), "6").await.status,
        200,
        "newer, quiet key"
    );
    assert_eq!(put(&p.url("/new"), "1").await.status, 200, "a new key");
    assert_eq!(
        put(&p.url("/busy"), "5").await.status,
        200,
        "equal, busy key"
    );
    // The busy key's newer token waits out the crashed run's write.
    let a = put(&p.url("/busy"), "6").await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert_eq!(a.json()["type"], "urn:fencegate:problem:recovering");
    let retry: u64 = a.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=6).contains(&retry), "Retry-After {retry}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the answers above were not immediate: {:?}",
        started.elapsed()
    );
    // Reads flow meanwhile.
    assert_eq!(send("GET", &p.url("/busy"), &[], "").await.status, 200);
    let six = loop {
        let a = put(&p.url("/busy"), "6").await;
        if a.status == 200 {
            break Instant::now();
        }
        assert_eq!(a.status, 503, "{}", a.text());
        assert!(
            started.elapsed() < Duration::from_secs(12),
            "never released"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        six.duration_since(started) >= Duration::from_millis(5500),
        "released before an upstream timeout had passed since the restart"
    );
    let r = up.records();
    let busy_writes: Vec<_> = r.iter().filter(|x| x.target == "/busy").collect();
    let first = busy_writes
        .iter()
        .find(|x| x.token.as_deref() == Some("5"))
        .unwrap();
    let newer = busy_writes
        .iter()
        .find(|x| x.token.as_deref() == Some("6"))
        .unwrap();
    assert!(
        newer.arrived >= first.completed,
        "the newer write reached the backend while the crashed run's was being applied"
    );
    assert_eq!(
        busy_writes
            .iter()
            .filter(|x| x.token.as_deref() == Some("6"))
            .count(),
        1,
        "a refused attempt reached the backend"
    );
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(&m, "fencegate_recovering", 0.0);
    assert_series(&m, "fencegate_recovery_held_keys", 0.0);
}

/// A newer token queued behind an older write at the crash is already the
/// key's highest in the store, but the older write may still be applied:
/// after the restart the newer token waits for it all the same.
#[tokio::test(flavor = "multi_thread")]
async fn a_newer_token_queued_at_the_crash_still_waits_for_the_older_write() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "6s"])
        .spawn();
    let old = slow_put(p.url("/q"), "5", "3000");
    eventually(
        "token 5 reached the backend",
        Duration::from_secs(5),
        || up.arrivals() == 1,
    )
    .await;
    let newer = slow_put(p.url("/q"), "6", "0");
    queued(&p, 1).await;
    p.kill9();
    let _ = (old.await, newer.await);
    p.restart();
    let started = Instant::now();
    let a = put(&p.url("/q"), "6").await;
    assert_eq!(a.status, 503, "the queued token went ahead: {}", a.text());
    assert_eq!(put(&p.url("/q"), "5").await.status, 409, "stale");
    loop {
        let a = put(&p.url("/q"), "6").await;
        if a.status == 200 {
            break;
        }
        assert_eq!(a.status, 503, "{}", a.text());
        assert!(
            started.elapsed() < Duration::from_secs(12),
            "never released"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = up.records();
    let five = r.iter().find(|x| x.token.as_deref() == Some("5")).unwrap();
    let six = r.iter().find(|x| x.token.as_deref() == Some("6")).unwrap();
    assert!(
        six.arrived >= five.completed,
        "6 overtook 5 after the crash"
    );
    assert_eq!(up.arrivals(), 2, "a refused attempt reached the backend");
}

/// Ten crashes in about ten seconds under load: no fence is lost, the
/// backend sees each key's tokens in order, and keys with nothing in
/// flight at a crash are writable right after every restart.
#[tokio::test(flavor = "multi_thread")]
async fn ten_crashes_under_load_lose_no_fence_and_hold_only_busy_keys() {
    use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
    use std::sync::{Arc, Mutex};
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "2s"])
        .spawn();
    // Quiet keys: written once, then idle through every crash.
    for i in 0..10 {
        assert_eq!(put(&p.url(&format!("/quiet/{i}")), "1").await.status, 200);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while durable_marks(&p).await != 0.0 {
        assert!(
            Instant::now() < deadline,
            "marks of idle keys never cleared"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Hot keys: rising tokens, some held upstream for a while, until told
    // to stop (and at most 5000 writes each).
    let stop = Arc::new(AtomicBool::new(false));
    let admitted = Arc::new(Mutex::new(vec![0u64; 4]));
    // Each restart listens on a new port.
    let port = Arc::new(AtomicU16::new(p.addr.port()));
    let mut writers = Vec::new();
    for k in 0..4usize {
        let (stop, admitted, port) = (stop.clone(), admitted.clone(), port.clone());
        writers.push(tokio::spawn(async move {
            for token in 1..=5000u64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let url = format!("http://127.0.0.1:{}/hot/{k}", port.load(Ordering::Relaxed));
                // Mostly slow: a crash nearly always finds a write of each
                // hot key still being applied.
                let delay = if token % 5 == 0 { "0" } else { "400" };
                let req = async move {
                    let t = token.to_string();
                    let headers = [("x-fence-token", t.as_str()), ("x-test-delay-ms", delay)];
                    send("PUT", &url, &headers, "x").await
                };
                // A crash drops the connection (the request panics in its
                // own task): no answer is an answer here.
                if let Ok(Ok(a)) =
                    tokio::time::timeout(Duration::from_secs(5), tokio::spawn(req)).await
                {
                    if a.status == 200 {
                        let mut ad = admitted.lock().unwrap();
                        ad[k] = ad[k].max(token);
                        continue;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    for crash in 0..10u64 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        p.kill9();
        p.restart();
        port.store(p.addr.port(), Ordering::Relaxed);
        // Right after the restart: quiet keys take a newer token and refuse
        // a stale one, a new key goes, all at once.
        let i = crash % 10;
        let quiet = p.url(&format!("/quiet/{i}"));
        let token = 2 + crash / 10;
        let a = put(&quiet, &token.to_string()).await;
        assert_eq!(
            a.status,
            200,
            "crash {crash}: a quiet key was held: {}",
            a.text()
        );
        assert_eq!(put(&quiet, "0").await.status, 409, "crash {crash}");
        let fresh = put(&p.url(&format!("/fresh/{crash}")), "1").await;
        assert_eq!(
            fresh.status,
            200,
            "crash {crash}: a new key waited: {}",
            fresh.text()
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let admitted = admitted.lock().unwrap().clone();
    for (k, highest) in admitted.iter().enumerate() {
        assert!(*highest > 0, "hot key {k} never took a write");
        let a = put(&p.url(&format!("/hot/{k}")), &(highest - 1).to_string()).await;
        assert_eq!(a.status, 409, "hot key {k} lost its fence: {}", a.text());
    }
    // At the backend, no crash let a newer write of a hot key overtake an
    // older one still being applied.
    let mut records = up.records();
    records.sort_by_key(|r| r.arrived);
    let mut crossed = 0;
    for k in 0..4 {
        let target = format!("/hot/{k}");
        let writes: Vec<(u64, Instant, Instant)> = records
            .iter()
            .filter(|r| r.target == target)
            .map(|r| {
                (
                    r.token.as_deref().unwrap().parse().unwrap(),
                    r.arrived,
                    r.completed,
                )
            })
            .collect();
        for (i, (token, arrived, _)) in writes.iter().enumerate() {
            for (older, _, completed) in &writes[..i] {
                assert!(
                    older >= token || arrived >= completed,
                    "hot key {k}: token {token} reached the backend while {older} was being applied"
                );
                crossed += usize::from(older < token);
            }
        }
    }
    assert!(crossed > 0, "no hot key took two writes");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_in_flight_writes_and_a_clean_restart_needs_no_wait() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "30s"])
        .spawn();
    let url = p.url("/d");
    let slow = tokio::spawn(async move {
        send(
            "PUT",
            &url,
            &[("x-fence-token", "4"), ("x-test-delay-ms", "800")],
            "x",
        )
        .await
    });
    eventually(
        "slow write reached the upstream",
        Duration::from_secs(5),
        || up.arrivals() == 1,
    )
    .await;
    let status = tokio::task::spawn_blocking({
        let pid = p.child.id();
        move || signal(pid, "TERM")
    });
    status.await.unwrap();
    let a = slow.await.unwrap();
    assert_eq!(
        a.status, 200,
        "the in-flight write completed during the drain"
    );
    let exit = p.child.wait().unwrap();
    assert!(
        exit.success(),
        "clean stop exits 0: {exit:?}\n{}",
        p.stderr()
    );
    assert!(p.stderr().contains("clean stop recorded"), "{}", p.stderr());
    p.restart();
    // No recovery window after a clean stop (30 s would be the window).
    assert_eq!(put(&p.url("/d"), "5").await.status, 200);
    assert_eq!(
        put(&p.url("/d"), "3").await.status,
        409,
        "fence kept across the restart"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_process_cannot_open_the_same_store() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let _p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let out = std::process::Command::new(bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--upstream",
            &up.url(),
        ])
        .arg("--store")
        .arg(dir.path().join("fences.redb"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another process"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_store_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fences.redb");
    std::fs::write(&path, vec![0x5au8; 64 * 1024]).unwrap();
    let out = std::process::Command::new(bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
        ])
        .arg("--store")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("corrupt"), "{err}");
    // The file was left as it was.
    assert_eq!(std::fs::read(&path).unwrap(), vec![0x5au8; 64 * 1024]);
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_settings_stop_the_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("f.redb");
    let store = store.to_str().unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin())
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(&["--upstream", "localhost:9000", "--store", store]);
    assert!(e.contains("`routes[0].upstream`"), "{e}");
    let e = run(&[
        "--upstream",
        "http://127.0.0.1:9000",
        "--store",
        "/no/such/dir/f.redb",
    ]);
    assert!(e.contains("`store`") && e.contains("does not exist"), "{e}");
    let e = run(&[
        "--upstream",
        "http://127.0.0.1:9000",
        "--store",
        store,
        "--upstream-timeout",
        "fast",
    ]);
    assert!(e.contains("`routes[0].upstream_timeout`"), "{e}");
    let cfg = dir.path().join("bad.toml");
    std::fs::write(
        &cfg,
        "store = \"x.redb\"\n[[routes]]\nupstream = \"http://127.0.0.1:1\"\nliteral = true\n",
    )
    .unwrap();
    let e = run(&["check-config", cfg.to_str().unwrap()]);
    assert!(e.contains("literal"), "unknown key named: {e}");
    // Environment variables work like flags.
    let out = std::process::Command::new(bin())
        .args(["check-config", "/dev/null"])
        .env("FENCEGATE_UPSTREAM", "http://127.0.0.1:9000")
        .env("FENCEGATE_STORE", store)
        .env("FENCEGATE_UPSTREAM_TIMEOUT", "7s")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("upstream_timeout = \"7s\""), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn example_configs_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            seen += 1;
            let out = std::process::Command::new(bin())
                .arg("check-config")
                .arg(&path)
                .arg("--store")
                .arg(std::env::temp_dir().join("example.redb"))
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    assert!(seen >= 2, "expected example configs in config/");
}

/// A clean stop during the crash-recovery window must not erase it: writes
/// the crashed run forwarded may still be applied after the clean stop.
#[tokio::test(flavor = "multi_thread")]
async fn a_clean_stop_during_recovery_keeps_the_recovery_wait() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "6s"])
        .spawn();
    let url = p.url("/c");
    let old = tokio::spawn(async move {
        send(
            "PUT",
            &url,
            &[("x-fence-token", "1"), ("x-test-delay-ms", "4000")],
            "old",
        )
        .await
    });
    eventually(
        "token 1 reached the upstream",
        Duration::from_secs(5),
        || up.arrivals() == 1,
    )
    .await;
    p.kill9();
    let _ = old.await;
    p.restart();
    assert_eq!(put(&p.url("/c"), "2").await.status, 503, "recovering");
    // A clean stop now: nothing of this run is in flight, but the crashed
    // run's write may be.
    let exit = p.sigterm();
    assert!(!exit.success(), "{exit:?}\n{}", p.stderr());
    assert!(
        p.stderr().contains("not marking a clean stop"),
        "{}",
        p.stderr()
    );
    p.restart();
    let a = put(&p.url("/c"), "2").await;
    assert_eq!(a.status, 503, "the recovery wait survived: {}", a.text());
    assert!(a.header("retry-after").is_some());
    // Token 1 is still being applied: token 2 must not reach the backend
    // before it completed.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let a = put(&p.url("/c"), "2").await;
        if a.status == 200 {
            break;
        }
        assert_eq!(a.status, 503, "{}", a.text());
        assert!(std::time::Instant::now() < deadline, "never recovered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = up.records();
    let t1 = r.iter().find(|x| x.token.as_deref() == Some("1")).unwrap();
    let t2 = r.iter().find(|x| x.token.as_deref() == Some("2")).unwrap();
    assert!(
        t2.arrived >= t1.completed,
        "token 2 reached the backend while token 1 was being applied"
    );
    assert_eq!(
        r.iter().filter(|x| x.token.as_deref() == Some("2")).count(),
        1,
        "refused attempts reached the backend"
    );
}

/// A stop is clean when no write is in flight upstream: a stalled HTTP/2
/// client that never answers the shutdown, an idle connection and a slow
/// read still open at the end of the grace period are closed, and the clean
/// stop is recorded.
#[tokio::test(flavor = "multi_thread")]
async fn stalled_connections_and_reads_do_not_make_a_stop_unclean() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--shutdown-grace", "1s"])
        .spawn();
    assert_eq!(put(&p.url("/s"), "1").await.status, 200);
    // An h2c client that sends its preface and settings, then nothing, and
    // never reads (so never acknowledges anything).
    let mut h2 = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let _idle = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    let url = p.url("/slow-read");
    let read =
        tokio::spawn(async move { send("GET", &url, &[("x-test-delay-ms", "5000")], "").await });
    eventually(
        "the read reached the upstream",
        Duration::from_secs(5),
        || up.arrivals() == 2,
    )
    .await;
    let exit = p.sigterm();
    assert!(exit.success(), "{exit:?}\n{}", p.stderr());
    assert!(p.stderr().contains("clean stop recorded"), "{}", p.stderr());
    let _ = read.await;
    drop(h2);
    p.restart();
    // No recovery window: the stop was clean.
    assert_eq!(put(&p.url("/s"), "2").await.status, 200);
}

/// Builds the power-cut shim (tests/powercut/powercut.c): with it preloaded,
/// `FILE.synced` holds what `FILE` would hold after a power cut, the
/// content of its last fsync.
fn powercut_shim(dir: &std::path::Path) -> std::path::PathBuf {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/powercut/powercut.c");
    let out = dir.join("powercut.so");
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&out)
        .arg(&src)
        .args(["-ldl", "-lpthread"])
        .status()
        .expect("cc not found: install a C compiler (Debian package `gcc`)");
    assert!(status.success(), "the power-cut shim did not build");
    out
}

/// The store's files: the table and the write-ahead log's two files. A
/// power cut leaves each as of its own last sync (`FILE.synced`).
fn store_files(store: &std::path::Path) -> [std::path::PathBuf; 3] {
    [
        store.to_path_buf(),
        store.with_extension("redb.wal.0"),
        store.with_extension("redb.wal.1"),
    ]
}

/// Copies what a power cut would leave of `store` to `to` (and `to`'s
/// log), or removes what is there if nothing was synced. The log first: a
/// checkpoint between the copies then leaves a table that holds what the
/// copied log has, where the other order could pair an older table with a
/// log that moved on.
fn cut_power(store: &std::path::Path, to: &std::path::Path) {
    for (from, to) in store_files(store).iter().zip(store_files(to)).rev() {
        let mut synced = from.clone().into_os_string();
        synced.push(".synced");
        if std::fs::copy(&synced, &to).is_err() {
            let _ = std::fs::remove_file(&to);
        }
    }
}

/// An upstream that, the moment each request head arrives, copies what a
/// power cut would leave of the store at `store` to `cuts/N.redb` (and its
/// log), then answers 200. Requests must have no body.
async fn cutting_upstream(store: std::path::PathBuf, cuts: std::path::PathBuf) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (store, cuts, n) = (store.clone(), cuts.clone(), n.clone());
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    while let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        got.drain(..end + 4);
                        let i = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        // No snapshot yet means nothing was ever synced.
                        cut_power(&store, &cuts.join(format!("{i}.redb")));
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                        if s.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => got.extend_from_slice(&buf[..k]),
                    }
                }
            });
        }
    });
    url
}

/// "Durable before forwarded", with the power cut that `kill -9` does not
/// make (it keeps the page cache): at the instant the backend receives each
/// write, the store as of its last fsync must already hold that write's
/// token. Fails if the commit were not synced, or synced after forwarding.
#[tokio::test(flavor = "multi_thread")]
async fn a_power_cut_keeps_every_token_already_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let shim = powercut_shim(dir.path());
    let store = dir.path().join("fences.redb");
    let cuts = dir.path().join("cuts");
    std::fs::create_dir(&cuts).unwrap();
    let up = cutting_upstream(store.clone(), cuts.clone()).await;
    let watched = store_files(&store)
        .map(|f| f.display().to_string())
        .join(":");
    let mut p = ProxyBuilder::new(&up, dir.path())
        .args(&["--upstream-timeout", "1s"])
        .env("LD_PRELOAD", shim.to_str().unwrap())
        .env("POWERCUT_FILE", &watched)
        // A slow disk: a write forwarded before its commit's sync returned
        // would reach the backend while the old snapshot is still in place.
        .env("POWERCUT_DELAY_MS", "40")
        .spawn();
    // New keys (an advance each) and a key raised again and again.
    let writes: Vec<(String, u64)> = (1..=12u64)
        .flat_map(|i| [(format!("/k/{i}"), 100 + i), ("/hot".to_string(), i)])
        .collect();
    for (path, token) in &writes {
        let a = send(
            "PUT",
            &p.url(path),
            &[("x-fence-token", &token.to_string())],
            "",
        )
        .await;
        assert_eq!(a.status, 200, "{path}: {}", a.text());
    }
    // Cut the power at each forward in turn: a fencegate started on what
    // the disk held then knows that write's token.
    for (i, (path, token)) in writes.iter().enumerate() {
        let cut = cuts.join(format!("{i}.redb"));
        assert!(
            cut.exists(),
            "nothing was synced when {path} (token {token}) reached the backend"
        );
        let restored = tempfile::tempdir().unwrap();
        for (from, to) in store_files(&cut)
            .iter()
            .zip(store_files(&restored.path().join("fences.redb")))
        {
            if from.exists() {
                std::fs::copy(from, to).unwrap();
            }
        }
        let q = ProxyBuilder::new(&up, restored.path()).spawn();
        let key = format!("default%3A{}", path.replace('/', "%2F"));
        let a = send("GET", &q.admin_url(&format!("/v1/fences/{key}")), &[], "").await;
        assert_eq!(
            a.status,
            200,
            "{path} (token {token}) was forwarded before its fence was on disk: {}",
            a.text()
        );
        assert_eq!(a.json()["highest"], token.to_string(), "{path}");
    }
    // And the whole story once: power cut after the last forward, restart
    // on what the disk kept; once the recovery window has passed, a token
    // below any forwarded one is refused.
    p.kill9();
    let last = cuts.join(format!("{}.redb", writes.len() - 1));
    for (from, to) in store_files(&last).iter().zip(store_files(&store)) {
        if from.exists() {
            std::fs::copy(from, to).unwrap();
        } else {
            let _ = std::fs::remove_file(to);
        }
    }
    p.restart();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    for (path, token) in writes.iter().rev().take(6) {
        let a = put(&p.url(path), &(token - 1).to_string()).await;
        assert_eq!(
            a.status,
            409,
            "{path} lost its fence in the power cut: {}",
            a.text()
        );
    }
}

/// A grace period that ends with a write still being applied upstream
/// records no clean stop: the process exits 3 and the next start waits a
/// recovery window, so a newer write cannot overtake the one left behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_grace_period_ending_with_a_write_in_flight_records_no_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "4s", "--shutdown-grace", "300ms"])
        .spawn();
    let old = slow_put(p.url("/g"), "1", "2500");
    eventually("token 1 arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    let exit = p.sigterm();
    assert_eq!(exit.code(), Some(3), "{exit:?}\n{}", p.stderr());
    assert_eq!(up.count(), 0, "the grace period outlasted the write");
    assert!(
        p.stderr().contains("not marking a clean stop")
            && !p.stderr().contains("clean stop recorded"),
        "{}",
        p.stderr()
    );
    let _ = old.await;
    p.restart();
    let a = put(&p.url("/g"), "2").await;
    assert_eq!(
        a.status,
        503,
        "no recovery wait after an unclean stop: {}",
        a.text()
    );
    assert_eq!(a.json()["type"], "urn:fencegate:problem:recovering");
}

/// The same over HTTP/2: hyper runs each stream as a task of its own, apart
/// from its connection's, so the drain must count the write's exchange from
/// its start, not only once its stream's task is dropped.
#[tokio::test(flavor = "multi_thread")]
async fn a_grace_period_ending_with_an_h2_write_in_flight_records_no_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "4s", "--shutdown-grace", "300ms"])
        .spawn();
    let url = p.url("/g2");
    let old = tokio::spawn(async move {
        let client: hyper_util::client::legacy::Client<_, Body> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .http2_only(true)
                .build_http();
        let req = http::Request::put(url)
            .header("x-fence-token", "1")
            .header("x-test-delay-ms", "2500")
            .header("content-length", "1")
            .body(full("x"))
            .unwrap();
        let _ = client.request(req).await;
    });
    eventually("token 1 arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    let exit = p.sigterm();
    assert_eq!(exit.code(), Some(3), "{exit:?}\n{}", p.stderr());
    assert!(
        !p.stderr().contains("clean stop recorded"),
        "a clean stop was recorded with an h2 write upstream: {}",
        p.stderr()
    );
    let _ = old.await;
    p.restart();
    let a = put(&p.url("/g2"), "2").await;
    assert_eq!(
        a.status,
        503,
        "no recovery wait after an unclean stop: {}",
        a.text()
    );
}

/// A drain waits for a forwarded write whose client has hung up: the write
/// is still being applied, and a clean mark before it ends would let the
/// next start forward a newer write at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_drain_waits_for_a_write_whose_client_hung_up() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "10s"])
        .spawn();
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    s.write_all(b"PUT /h HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-Test-Delay-Ms: 1000\r\nContent-Length: 1\r\n\r\nx")
        .await
        .unwrap();
    eventually("token 1 arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    drop(s);
    // The proxy has seen the hang-up before the stop begins.
    eventually_async("the client's connection closed", || async {
        metric(&p, "fencegate_connections{listener=\"proxy\"}").await == Some(0.0)
    })
    .await;
    let exit = p.sigterm();
    // The backend had finished applying it before the process was gone.
    assert_eq!(up.count(), 1, "the drain did not wait for the write");
    assert!(exit.success(), "{exit:?}\n{}", p.stderr());
    assert!(p.stderr().contains("clean stop recorded"), "{}", p.stderr());
}

/// Every flag in `--help` has its `FENCEGATE_*` variable, and the variable
/// does exactly what the flag does: the same effective config, or the same
/// error. A flag added without a value in this table fails the test.
#[tokio::test(flavor = "multi_thread")]
async fn every_flag_works_as_a_fencegate_variable() {
    // A value that changes what check-config prints (or makes it fail);
    // None for a switch.
    const VALUES: &[(&str, Option<&str>)] = &[
        ("--config", Some("/nonexistent/fencegate.toml")),
        ("--listen", Some("127.0.0.1:7000")),
        ("--admin-listen", Some("127.0.0.1:7001")),
        ("--upstream", Some("http://127.0.0.1:7002")),
        ("--store", Some("/nonexistent/f.redb")),
        ("--store-timeout", Some("3s")),
        ("--store-replicas-to-wait", Some("2")),
        ("--store-ca", Some("/nonexistent/ca.pem")),
        ("--store-client-cert", Some("/nonexistent/c.pem")),
        ("--store-client-key", Some("/nonexistent/k.pem")),
        ("--store-password-file", Some("/nonexistent/pw")),
        ("--accept-store-reset", None),
        ("--store-state-file", Some("/nonexistent/state")),
        ("--admin-token-file", Some("/nonexistent/token")),
        ("--lease-listen", Some("127.0.0.1:7009")),
        ("--lease-token-file", Some("/nonexistent/lease-tokens")),
        ("--max-lease-ttl", Some("0s")),
        ("--key", Some("/{bucket}")),
        ("--namespace", Some("ns1")),
        ("--literal-keys", None),
        ("--strip-token", None),
        ("--max-token-step", Some("77")),
        ("--error-format", Some("s3")),
        ("--upstream-timeout", Some("7s")),
        ("--connect-timeout", Some("2s")),
        ("--header-read-timeout", Some("3s")),
        ("--response-idle-timeout", Some("33s")),
        ("--upstream-max-connections", Some("7")),
        ("--upstream-queue-timeout", Some("1s")),
        ("--body-read-timeout", Some("4s")),
        ("--max-header-bytes", Some("9999")),
        ("--max-connections", Some("55")),
        ("--max-key-bytes", Some("777")),
        ("--max-body-bytes", Some("1234")),
        ("--shutdown-grace", Some("9s")),
        ("--highest-cache-entries", Some("4321")),
        ("--workers", Some("3")),
        ("--tls-listen", Some("127.0.0.1:7443")),
        ("--tls-cert", Some("/nonexistent/c.pem")),
        ("--tls-key", Some("/nonexistent/k.pem")),
        ("--tls-client-ca", Some("/nonexistent/ca.pem")),
        ("--upstream-ca", Some("/nonexistent/ca.pem")),
        ("--upstream-client-cert", Some("/nonexistent/c.pem")),
        ("--upstream-client-key", Some("/nonexistent/k.pem")),
        ("--access-log", None),
        ("--proxy-protocol", None),
        ("--trusted-proxies", Some("10.0.0.0/8,192.0.2.7")),
        ("--log-format", Some("xml")),
    ];
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("f.redb");
    let help = std::process::Command::new(bin())
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let flags: Vec<&str> = help
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("--").map(|_| l.trim_start()))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|f| !matches!(*f, "--help" | "--version"))
        .collect();
    assert!(flags.len() >= VALUES.len(), "{help}");
    for flag in flags {
        let value = VALUES
            .iter()
            .find(|(f, _)| *f == flag)
            .unwrap_or_else(|| panic!("{flag} is new: give it a value in this test's table"))
            .1;
        let var = format!(
            "FENCEGATE_{}",
            flag.trim_start_matches("--")
                .replace('-', "_")
                .to_uppercase()
        );
        assert!(
            help.contains(&format!("[env: {var}=")),
            "{flag}: no {var} in --help"
        );
        // The shared-store settings only show with a shared store; --config
        // is read by the server, not by check-config (which names its file).
        let shared = matches!(
            flag,
            "--store-timeout"
                | "--accept-store-reset"
                | "--store-state-file"
                | "--store-replicas-to-wait"
        );
        let run = |extra: &[&str], env: Option<(&str, &str)>| {
            let mut c = std::process::Command::new(bin());
            if flag != "--config" {
                c.args(["check-config", "/dev/null"]);
            } else {
                // Should the variable be ignored, the server must not start
                // (and hang this test): an address it cannot bind.
                c.args(["--listen", "192.0.2.1:1"]);
            }
            if flag != "--upstream" {
                c.args(["--upstream", "http://127.0.0.1:1"]);
            }
            if flag != "--store" {
                c.arg("--store");
                if shared {
                    c.arg("redis://127.0.0.1:1");
                } else {
                    c.arg(&store);
                }
            }
            c.args(extra);
            if let Some((k, v)) = env {
                c.env(k, v);
            }
            let out = c.output().unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                // Log lines (a config warning) without their timestamps.
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .map(|l| match l.split_once(' ') {
                        Some((ts, rest)) if ts.starts_with("20") && ts.ends_with('Z') => rest,
                        _ => l,
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            )
        };
        let mut args = vec![flag];
        args.extend(value);
        let by_flag = run(&args, None);
        let by_env = run(&[], Some((&var, value.unwrap_or("true"))));
        assert_eq!(by_env, by_flag, "{var} does not act like {flag}");
        if flag == "--config" {
            // Without it the server would start: compare with the error.
            assert!(by_flag.2.contains("cannot read config file"), "{by_flag:?}");
        } else {
            assert_ne!(by_flag, run(&[], None), "{flag} {value:?} changed nothing");
        }
    }
}

/// An upgrade from the previous release's store: `tests/fixtures/
/// store-v1-crashed.redb` was written by fencegate at 0398cf9 (format
/// version 1, before the write-ahead log) with `--upstream-timeout 1s`:
/// PUTs of token 7 to /obj/a, /obj/b and /obj/c, then token 9 to /obj/a,
/// then `kill -9` within the second, so their in-flight marks were live.
/// This release opens it as it is: the fences are kept, the crash is seen
/// and the marked keys are held for the recorded window, then writes flow
/// and the file is upgraded (the next start is clean after a clean stop).
#[tokio::test(flavor = "multi_thread")]
async fn a_store_of_the_previous_release_left_by_a_crash_is_upgraded() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/store-v1-crashed.redb");
    std::fs::copy(&fixture, dir.path().join("fences.redb")).unwrap();
    let up = start_upstream().await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--upstream-timeout", "1s"])
        .spawn();
    for (path, token) in [("a", "9"), ("b", "7"), ("c", "7")] {
        let key = format!("default%3A%2Fobj%2F{path}");
        let a = send("GET", &p.admin_url(&format!("/v1/fences/{key}")), &[], "").await;
        assert_eq!(a.status, 200, "{path}: {}", a.text());
        assert_eq!(a.json()["highest"], token, "{path}");
    }
    assert_eq!(put(&p.url("/obj/a"), "8").await.status, 409, "stale");
    // Held: a newer token must wait for the crashed run's writes.
    let a = put(&p.url("/obj/b"), "8").await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert_eq!(a.json()["type"], "urn:fencegate:problem:recovering");
    let url = p.url("/obj/b");
    eventually_async("the recovery window ended", || {
        let url = url.clone();
        async move { put(&url, "8").await.status == 200 }
    })
    .await;
    assert_eq!(up.arrivals(), 1);
    let exit = p.sigterm();
    assert!(exit.success(), "{exit:?}\n{}", p.stderr());
    p.restart();
    assert_eq!(put(&p.url("/obj/c"), "8").await.status, 200, "no wait");
    assert_eq!(put(&p.url("/obj/b"), "7").await.status, 409);
}
