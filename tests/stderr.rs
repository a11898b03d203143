//! fencegate keeps serving, and stops cleanly, when the reader of its
//! stderr goes away (a log shipper restarted): a log line that cannot be
//! written is dropped, not a reason to abort.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_closed_stderr_neither_aborts_nor_blocks_a_clean_stop() {
    let up = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(bin())
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", "127.0.0.1:0", "--access-log"])
        .args(["--upstream", &up.url(), "--store"])
        .arg(dir.path().join("fences.redb"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read stderr until the proxy listens, then close it.
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "fencegate did not start");
        match lines.next() {
            Some(Ok(l)) if l.contains(&format!("proxy_addr=127.0.0.1:{port}")) => break,
            Some(_) => {}
            None => panic!("fencegate's stderr ended before it listened"),
        }
    }
    drop(lines);
    let url = format!("http://127.0.0.1:{port}/k");
    for token in ["1", "2", "3"] {
        assert_eq!(put(&url, token).await.status, 200, "token {token}");
    }
    assert_eq!(put(&url, "1").await.status, 409);
    signal(child.id(), "TERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "SIGTERM did not stop fencegate");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");
}
