//! Hostile input on a raw socket: smuggling, token tricks, path confusion,
//! method tricks, oversized and slow input. Each must be refused (a 4xx, or
//! the connection closed without a 2xx) and nothing may reach (or be
//! applied by) the backend.

mod common;

use std::time::Duration;

use common::*;

async fn setup() -> (tempfile::TempDir, Upstream, Proxy) {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&[
            "--max-body-bytes",
            "100000",
            "--header-read-timeout",
            "3s",
            "--max-header-bytes",
            "8192",
        ])
        .spawn();
    (dir, up, p)
}

/// Sends `request` and reads one answer: until the connection closes (within
/// 2 s, when `until_closed`), else until the head and the body its
/// Content-Length announces are in (within 2 s). Whether it was closed.
async fn raw_answer(
    addr: std::net::SocketAddr,
    request: &[u8],
    until_closed: bool,
) -> (String, bool) {
    raw_answer_after(addr, b"", 0, request, until_closed).await
}

/// The end of the first whole answer in `out` (a head and the body its
/// Content-Length announces), if it is all there.
fn answer_end(out: &[u8]) -> Option<usize> {
    let head = out.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let len = String::from_utf8_lossy(&out[..head])
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
        })
        .unwrap_or(0);
    (out.len() >= head + len).then_some(head + len)
}

/// Like [`raw_answer`], on a connection that first sent `before`, whose
/// `skip` answers are read and dropped: the answer returned is the
/// request's own.
async fn raw_answer_after(
    addr: std::net::SocketAddr,
    before: &[u8],
    skip: usize,
    request: &[u8],
    until_closed: bool,
) -> (String, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    if !before.is_empty() {
        // Answered first, so the request meets the connection in the state
        // `before` left it in (handed to hyper).
        s.write_all(before).await.unwrap();
        let mut skipped = 0;
        while skipped < skip {
            if let Some(end) = answer_end(&out) {
                out.drain(..end);
                skipped += 1;
                continue;
            }
            match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => out.extend_from_slice(&buf[..n]),
                _ => panic!("no answer to {:?}", String::from_utf8_lossy(before)),
            }
        }
        assert!(out.is_empty(), "more answers than expected before the case");
    }
    s.write_all(request).await.unwrap();
    loop {
        if !until_closed && answer_end(&out).is_some() {
            return (String::from_utf8_lossy(&out).into_owned(), false);
        }
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into_owned(), true),
            Err(_) => return (String::from_utf8_lossy(&out).into_owned(), false),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// The ways a request head can reach fencegate's readers: first on a new
/// connection (the lane reads it, and hands hyper what it does not take),
/// on a connection hyper already holds (an earlier request handed it over:
/// its `Connection` option is not one the lane takes), and as HTTP/1.0
/// (hyper's from the start).
#[derive(Debug, Clone, Copy)]
enum Reader {
    Fresh,
    HyperHeld,
    Http10,
}

/// A read that hands the connection to hyper, and its target.
const HAND_OVER: &str = "GET /warm HTTP/1.1\r\nHost: x\r\nConnection: x-a\r\n\r\n";

/// Sends `request` the way `reader` says and reads its own answer.
async fn answer_via(
    reader: Reader,
    addr: std::net::SocketAddr,
    request: &str,
    until_closed: bool,
) -> (String, bool) {
    match reader {
        Reader::Fresh => raw_answer(addr, request.as_bytes(), until_closed).await,
        Reader::HyperHeld => {
            raw_answer_after(
                addr,
                HAND_OVER.as_bytes(),
                1,
                request.as_bytes(),
                until_closed,
            )
            .await
        }
        Reader::Http10 => {
            let request = request.replacen(" HTTP/1.1\r\n", " HTTP/1.0\r\n", 1);
            raw_answer(addr, request.as_bytes(), until_closed).await
        }
    }
}

/// A refusal: exactly `status` (not any non-2xx: a handler that panicked
/// or a dropped connection is not a refusal the contract promises), in
/// HTTP/1.1 or, to an HTTP/1.0 request, HTTP/1.0.
fn refused_with(answer: &str, status: u16) -> bool {
    answer.lines().next().is_some_and(|l| {
        l.starts_with(&format!("HTTP/1.1 {status} "))
            || l.starts_with(&format!("HTTP/1.0 {status} "))
    })
}

/// (name, raw request, whether its head may reach the backend before the
/// body turns out bad (such a request must still not be applied), the status
/// it must get, whether the connection must be closed after it: a request
/// whose framing cannot be trusted leaves nothing behind to be read as the
/// next request).
const CASES: &[(&str, &str, bool, u16, bool)] = &[
    // Request smuggling.
    ("two Content-Lengths", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", false, 400, true),
    ("two equal Content-Lengths", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", false, 400, true),
    // hyper reads a length of any number of digits (leading zeros too):
    // a second line must be seen however the first is written.
    ("two Content-Lengths, one of 19 digits", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0000000000000000005\r\nContent-Length: 5\r\n\r\nhello", false, 400, true),
    ("two Content-Lengths, the second of 19 digits", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\nContent-Length: 0000000000000000005\r\n\r\nhello", false, 400, true),
    ("two Content-Lengths, the first not a length", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5x\r\nContent-Length: 5\r\n\r\nhello", false, 400, true),
    ("Content-Length past hyper's largest", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 18446744073709551614\r\n\r\nhello", false, 400, true),
    ("TE gzip, chunked", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", false, 400, true),
    ("two TE headers", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", false, 400, true),
    ("obs-fold header", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-A: a\r\n\tb\r\nContent-Length: 0\r\n\r\n", false, 400, true),
    ("HTTP/1.0 with chunked", "PUT /s HTTP/1.0\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", false, 400, true),
    ("negative Content-Length", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: -5\r\n\r\n", false, 400, true),
    ("malformed chunk", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", true, 400, true),
    // Token tricks.
    ("obs-fold token continuation", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\n 2\r\nContent-Length: 0\r\n\r\n", false, 400, true),
    ("full-width digit token", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: \u{FF19}\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("Arabic-Indic digit token", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: \u{0661}\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("two token headers", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-Fence-Token: 2\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("empty token", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token:\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("token with NUL", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\0\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("space before colon", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token : 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("token list", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1, 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    // Path confusion (the Envoy path-normalization CVE checklist).
    ("double-encoded slash", "PUT /a/%252Fb HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("encoded slash, mixed case", "PUT /a/%2f..%2Fb HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("backslash", "PUT /a\\..\\b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("encoded backslash", "PUT /a/%5c../b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("dot-dot-semicolon", "PUT /a/..;/b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("encoded dots", "PUT /a/%2E%2e/b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("NUL in path", "PUT /a/%00/b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("empty segment", "PUT //a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("absolute form, other host", "PUT http://evil.example/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("invalid escape", "PUT /a/%g1 HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    // Method tricks.
    ("lowercase put without token", "put /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", false, 428, false),
    ("lowercase get without token", "get /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", false, 428, false),
    ("MKCOL without token", "MKCOL /dir/ HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", false, 428, false),
    ("MOVE to another host", "MOVE /s HTTP/1.1\r\nHost: x\r\nDestination: http://evil.example/t\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("COPY to an ambiguous path", "COPY /s HTTP/1.1\r\nHost: x\r\nDestination: /a/../t\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false, 400, false),
    ("GET overridden to DELETE", "GET /s HTTP/1.1\r\nHost: x\r\nX-HTTP-Method-Override: DELETE\r\n\r\n", false, 428, false),
    ("GET overridden via X-HTTP-Method", "GET /s HTTP/1.1\r\nHost: x\r\nX-HTTP-Method: PUT\r\n\r\n", false, 428, false),
    ("GET overridden via X-Method-Override", "GET /s HTTP/1.1\r\nHost: x\r\nX-Method-Override: PATCH\r\n\r\n", false, 428, false),
    ("CONNECT", "CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n", false, 405, false),
    // Oversized.
    ("body over the limit", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 100001\r\n\r\n", false, 413, false),
];

async fn every_hostile_request_is_refused_via(reader: Reader) {
    let (_d, up, p) = setup().await;
    // The hand-over's own read reaches the backend; nothing else may.
    let before = match reader {
        Reader::HyperHeld => 1,
        Reader::Fresh | Reader::Http10 => 0,
    };
    let mut failures = Vec::new();
    for (name, request, head_may_arrive, status, closes) in CASES {
        up.clear();
        // Closed well before the 3 s header timeout, when it must be; else
        // read until the answer is whole.
        let (answer, closed) = answer_via(reader, p.addr, request, *closes).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if !refused_with(&answer, *status) {
            failures.push(format!(
                "{name}: answered {:?}, not {status}",
                answer.lines().next().unwrap_or("")
            ));
        }
        if *closes && !closed {
            failures.push(format!("{name}: the connection was left open"));
        }
        if up.count() != before {
            failures.push(format!("{name}: applied by the backend"));
        }
        if !head_may_arrive && up.arrivals() != before {
            failures.push(format!("{name}: reached the backend"));
        }
    }
    assert!(failures.is_empty(), "{reader:?}: {failures:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_hostile_request_is_refused_and_nothing_reaches_the_backend() {
    every_hostile_request_is_refused_via(Reader::Fresh).await;
}

/// The same cases on a connection hyper already reads: the lane's rules
/// (two `Content-Length` lines refused, whatever their values) hold there
/// too, not only hyper's.
#[tokio::test(flavor = "multi_thread")]
async fn every_hostile_request_is_refused_on_a_connection_hyper_holds() {
    every_hostile_request_is_refused_via(Reader::HyperHeld).await;
}

/// The same cases over HTTP/1.0, which the lane always leaves to hyper.
#[tokio::test(flavor = "multi_thread")]
async fn every_hostile_request_is_refused_over_http_1_0() {
    every_hostile_request_is_refused_via(Reader::Http10).await;
}

/// Content-Length with Transfer-Encoding: the HTTP parser drops the length
/// and reads the body as chunked (RFC 9112 section 6.1), and the connection is
/// closed after the answer, so the bytes smuggled behind the body are never
/// read as a request, and the backend gets a plain chunked request.
#[tokio::test(flavor = "multi_thread")]
async fn cl_te_smuggling_is_defused() {
    let (_d, up, p) = setup().await;
    let req = "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nPUT /smuggled HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n";
    let started = std::time::Instant::now();
    let answer = raw(p.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the connection stayed open"
    );
    assert_eq!(
        answer.matches("HTTP/1.1 ").count(),
        1,
        "one answer only: {answer}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = up.records();
    assert!(
        r.iter().all(|x| x.target != "/smuggled"),
        "the smuggled request reached the backend"
    );
    assert!(
        r.iter().all(|x| x.headers.get("content-length").is_none()),
        "an ambiguous length was forwarded"
    );
}

/// A length hyper reads (19 digits, leading zeros) but the lane does not
/// take hands the connection to hyper: every head after it is still judged
/// by the lane's rules, whether it comes in the same write or a later one.
#[tokio::test(flavor = "multi_thread")]
async fn heads_after_a_long_content_length_are_still_judged() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_d, up, p) = setup().await;
    let first = "PUT /first HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0000000000000000000\r\n\r\n";
    let smuggle = "PUT /smuggled HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello";
    // In the same write: the first is answered, the second refused.
    let (answer, closed) =
        raw_answer_after(p.addr, first.as_bytes(), 1, smuggle.as_bytes(), true).await;
    assert!(refused_with(&answer, 400), "{answer}");
    assert!(closed, "the connection was left open");
    let (answer, _) = raw_answer(p.addr, format!("{first}{smuggle}").as_bytes(), true).await;
    assert_eq!(answer.matches("HTTP/1.1 ").count(), 2, "{answer}");
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.contains("HTTP/1.1 400 "), "{answer}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        up.records().iter().all(|r| r.target != "/smuggled"),
        "the second request reached the backend"
    );
    // In a later write: a plain request is answered, not dropped.
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    for (i, request) in [first, "GET /second HTTP/1.1\r\nHost: x\r\n\r\n"]
        .iter()
        .enumerate()
    {
        s.write_all(request.as_bytes()).await.unwrap();
        while answer_end(&out).is_none() {
            match tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => out.extend_from_slice(&buf[..n]),
                other => panic!(
                    "request {i}: no answer ({other:?}): {:?}",
                    String::from_utf8_lossy(&out)
                ),
            }
        }
        let end = answer_end(&out).unwrap();
        let answer = String::from_utf8_lossy(&out[..end]).into_owned();
        assert!(answer.starts_with("HTTP/1.1 200 "), "request {i}: {answer}");
        out.drain(..end);
    }
    assert!(up.records().iter().any(|r| r.target == "/second"));
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_heads_get_431_and_slow_heads_are_cut() {
    let (_d, up, p) = setup().await;
    let big = format!(
        "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-Pad: {}\r\n\r\n",
        "p".repeat(10_000)
    );
    let answer = raw(p.addr, big.as_bytes(), Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // A head that never ends is cut after the 3 s header timeout (read
    // bounded at 8 s).
    let started = std::time::Instant::now();
    let answer = raw(
        p.addr,
        b"PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-",
        Duration::from_secs(8),
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "connection left open"
    );
    // The head timeout answers 408 (or just closes, as hyper does before
    // any byte of a head): never a 2xx, and nothing reaches the backend.
    assert!(answer.is_empty() || refused_with(&answer, 408), "{answer}");
    assert_eq!(up.arrivals(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_control_case_is_accepted() {
    // The suite's requests differ from this one only by their trick.
    let (_d, up, p) = setup().await;
    let ok = "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\n\r\nhello";
    let answer = raw(p.addr, ok.as_bytes(), Duration::from_millis(800)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(up.count(), 1);
    // No Content-Length at all is fine: a chunked write, a bodiless read.
    let chunked = "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
    let (answer, _) = raw_answer(p.addr, chunked.as_bytes(), false).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let read = "GET /s HTTP/1.1\r\nHost: x\r\n\r\n";
    let (answer, _) = raw_answer(p.addr, read.as_bytes(), false).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(up.count(), 3);
}
