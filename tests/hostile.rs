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
            "1s",
            "--max-header-bytes",
            "8192",
        ])
        .spawn();
    (dir, up, p)
}

fn refused(answer: &str) -> bool {
    let first = answer.lines().next().unwrap_or("");
    !(first.starts_with("HTTP/1.1 2")
        || first.starts_with("HTTP/1.0 2")
        || first.starts_with("HTTP/1.1 1"))
        || answer.is_empty()
}

/// (name, raw request, whether its head may reach the backend before the
/// body turns out bad: such a request must still not be applied).
const CASES: &[(&str, &str, bool)] = &[
    // Request smuggling.
    ("two Content-Lengths", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", false),
    ("TE gzip, chunked", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", false),
    ("two TE headers", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", false),
    ("obs-fold header", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-A: a\r\n\tb\r\nContent-Length: 0\r\n\r\n", false),
    ("HTTP/1.0 with chunked", "PUT /s HTTP/1.0\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", false),
    ("negative Content-Length", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: -5\r\n\r\n", false),
    ("malformed chunk", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", true),
    // Token tricks.
    ("obs-fold token continuation", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\n 2\r\nContent-Length: 0\r\n\r\n", false),
    ("full-width digit token", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: \u{FF19}\r\nContent-Length: 0\r\n\r\n", false),
    ("Arabic-Indic digit token", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: \u{0661}\r\nContent-Length: 0\r\n\r\n", false),
    ("two token headers", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-Fence-Token: 2\r\nContent-Length: 0\r\n\r\n", false),
    ("empty token", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token:\r\nContent-Length: 0\r\n\r\n", false),
    ("token with NUL", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\0\r\nContent-Length: 0\r\n\r\n", false),
    ("space before colon", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token : 1\r\nContent-Length: 0\r\n\r\n", false),
    ("token list", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1, 1\r\nContent-Length: 0\r\n\r\n", false),
    // Path confusion (the Envoy path-normalization CVE checklist).
    ("double-encoded slash", "PUT /a/%252Fb HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("encoded slash, mixed case", "PUT /a/%2f..%2Fb HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("backslash", "PUT /a\\..\\b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("encoded backslash", "PUT /a/%5c../b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("dot-dot-semicolon", "PUT /a/..;/b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("encoded dots", "PUT /a/%2E%2e/b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("NUL in path", "PUT /a/%00/b HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("empty segment", "PUT //a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("absolute form, other host", "PUT http://evil.example/a HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("invalid escape", "PUT /a/%g1 HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    // Method tricks.
    ("lowercase put without token", "put /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", false),
    ("lowercase get without token", "get /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", false),
    ("MKCOL without token", "MKCOL /dir/ HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", false),
    ("MOVE to another host", "MOVE /s HTTP/1.1\r\nHost: x\r\nDestination: http://evil.example/t\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("COPY to an ambiguous path", "COPY /s HTTP/1.1\r\nHost: x\r\nDestination: /a/../t\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n", false),
    ("GET overridden to DELETE", "GET /s HTTP/1.1\r\nHost: x\r\nX-HTTP-Method-Override: DELETE\r\n\r\n", false),
    ("GET overridden via X-HTTP-Method", "GET /s HTTP/1.1\r\nHost: x\r\nX-HTTP-Method: PUT\r\n\r\n", false),
    ("GET overridden via X-Method-Override", "GET /s HTTP/1.1\r\nHost: x\r\nX-Method-Override: PATCH\r\n\r\n", false),
    ("CONNECT", "CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n", false),
    // Oversized.
    ("body over the limit", "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 100001\r\n\r\n", false),
];

#[tokio::test(flavor = "multi_thread")]
async fn every_hostile_request_is_refused_and_nothing_reaches_the_backend() {
    let (_d, up, p) = setup().await;
    let mut failures = Vec::new();
    for (name, request, head_may_arrive) in CASES {
        up.clear();
        let answer = raw(p.addr, request.as_bytes(), Duration::from_millis(1500)).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if !refused(&answer) {
            failures.push(format!(
                "{name}: accepted: {}",
                answer.lines().next().unwrap_or("")
            ));
        }
        if up.count() != 0 {
            failures.push(format!("{name}: applied by the backend"));
        }
        if !head_may_arrive && up.arrivals() != 0 {
            failures.push(format!("{name}: reached the backend"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
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

#[tokio::test(flavor = "multi_thread")]
async fn oversized_heads_get_431_and_slow_heads_are_cut() {
    let (_d, up, p) = setup().await;
    let big = format!(
        "PUT /s HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nX-Pad: {}\r\n\r\n",
        "p".repeat(10_000)
    );
    let answer = raw(p.addr, big.as_bytes(), Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // A head that never ends is cut after the 1 s header timeout (read
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
    assert!(refused(&answer), "{answer}");
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
}
