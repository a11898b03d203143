//! The request path's own HTTP/1.1 lane (issue 32) where it meets what
//! it does not take: a body that comes late, pipelined requests, and a
//! connection handed to hyper between two requests it serves.

mod common;

use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread")]
async fn a_body_that_comes_late_is_served_whole() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    s.write_all(
        b"PUT /late HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 3\r\nContent-Length: 5\r\n\r\nhe",
    )
    .await
    .unwrap();
    // Longer than the lane waits for a small body: hyper takes it over.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.write_all(b"llo").await.unwrap();
    assert_eq!(answers(&mut s, 1).await, ["http/1.1 200 ok"]);
    let r = &up.records()[0];
    assert_eq!((r.target.as_str(), r.body_len), ("/late", 5));
}

/// Pipelined requests are answered in order, the stale one refused and
/// not forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn pipelined_requests_are_answered_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    let one = |path: &str, token: u32| {
        format!("PUT {path} HTTP/1.1\r\nHost: x\r\nX-Fence-Token: {token}\r\nContent-Length: 2\r\n\r\nok")
    };
    let all = format!("{}{}{}", one("/p", 5), one("/p", 4), one("/q", 1));
    s.write_all(all.as_bytes()).await.unwrap();
    assert_eq!(
        answers(&mut s, 3).await,
        [
            "http/1.1 200 ok",
            "http/1.1 409 conflict",
            "http/1.1 200 ok"
        ]
    );
    let targets: Vec<_> = up.records().into_iter().map(|r| r.target).collect();
    assert_eq!(targets, ["/p", "/q"], "the stale write was not forwarded");
}

/// A connection's requests on either side of the hand-over to hyper (a
/// chunked body is hyper's) are all fenced and answered, in order: the
/// bytes the lane had read are hyper's first.
#[tokio::test(flavor = "multi_thread")]
async fn the_hand_over_to_hyper_mid_connection_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    let requests = concat!(
        "PUT /h HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 2\r\nContent-Length: 3\r\n\r\nabc",
        "PUT /h HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 3\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nwxyz\r\n0\r\n\r\n",
        "PUT /h HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 2\r\nContent-Length: 1\r\n\r\nq",
        "GET /h HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    s.write_all(requests.as_bytes()).await.unwrap();
    let got = answers(&mut s, 4).await;
    assert_eq!(
        got,
        [
            "http/1.1 200 ok",
            "http/1.1 200 ok",
            "http/1.1 409 conflict",
            "http/1.1 200 ok"
        ]
    );
    let seen: Vec<_> = up
        .records()
        .into_iter()
        .map(|r| (r.method, r.token, r.body_len))
        .collect();
    assert_eq!(
        seen,
        [
            ("PUT".to_string(), Some("2".to_string()), 3),
            ("PUT".to_string(), Some("3".to_string()), 4),
            ("GET".to_string(), None, 0),
        ]
    );
}

/// Idle connections are closed once idle for the idle timeout (the header
/// read timeout), fresh ones and keep-alive ones alike, each counted once;
/// one that keeps sending requests is not, however long it lives. One
/// watchdog serves all of a listener's connections (issue 44).
#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_are_closed_at_the_idle_timeout_and_busy_ones_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--header-read-timeout", "1s"])
        .spawn();
    let put = |n: u32| {
        format!("PUT /k HTTP/1.1\r\nHost: x\r\nX-Fence-Token: {n}\r\nContent-Length: 1\r\n\r\nx")
    };
    let opened = tokio::time::Instant::now();
    let mut fresh = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    let mut kept = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    kept.write_all(put(1).as_bytes()).await.unwrap();
    assert_eq!(answers(&mut kept, 1).await, ["http/1.1 200 ok"]);
    let mut busy = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    // The busy connection sends a request every 300 ms for 4 s: 4 idle
    // timeouts, each shorter than one.
    let busy_side = tokio::spawn(async move {
        for n in 0..13 {
            busy.write_all(put(1).as_bytes()).await.unwrap();
            assert_eq!(
                answers(&mut busy, 1).await,
                ["http/1.1 200 ok"],
                "request {n}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    for (name, s) in [("fresh", &mut fresh), ("keep-alive", &mut kept)] {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte)).await;
        assert!(
            matches!(read, Ok(Ok(0) | Err(_))),
            "the {name} connection was not closed: {read:?}"
        );
        // Never before it has been idle for the timeout.
        assert!(opened.elapsed() >= Duration::from_secs(1), "{name}");
    }
    busy_side.await.unwrap();
    assert_eq!(
        metric(
            &p,
            "fencegate_connections_closed_total{listener=\"proxy\",reason=\"idle\"}"
        )
        .await,
        Some(2.0),
        "{}",
        p.stderr()
    );
}
