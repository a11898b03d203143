//! The upstream connection pool against an upstream that ends connections
//! the ways real servers do: a keep-alive limit with `Connection: close`
//! (nginx's `keepalive_requests`), idle connections closed after a timeout
//! (`keepalive_timeout`), and a connection cut after the request arrived
//! but before an answer. None of the first two may cost a failed request;
//! the last must never send the write twice.
//!
//! The upstream here is a small hand-written HTTP/1.1 server over a real
//! socket, so each connection's life is exactly what the test says.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How the raw upstream treats each connection.
#[derive(Clone, Copy)]
enum Mode {
    /// Answers `Connection: close` to the n-th request, then closes.
    KeepAliveLimit(usize),
    /// Closes a connection that has been idle this long (no header says so).
    IdleClose(Duration),
    /// On the first connection, reads the whole request and closes without
    /// an answer; later connections answer normally.
    CutFirstAfterRequest,
    /// Answers a PUT 403 as soon as its head has arrived, then reads its
    /// body and keeps the connection (as an object store refusing an
    /// upload does); answers anything else 200.
    RefusePutsEarly,
    /// Answers a PUT 401 as soon as its head has arrived and never reads
    /// its body (a body-blind server): whatever follows the head on the
    /// connection is read as the next request. Answers anything else 200.
    RefusePutsUnread,
    /// Breaks the protocol as a server timing out an idle connection can
    /// seem to: the second request on the first connection gets a 408 at
    /// once, and its real answer ("late") 300 ms later on the same
    /// connection.
    Late408,
}

struct RawUpstream {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
    /// What happened, in order: `arrived PATH` and `late sent PATH`.
    events: Arc<std::sync::Mutex<Vec<String>>>,
}

impl RawUpstream {
    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn start_raw_upstream(mode: Mode) -> RawUpstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (c, r, ev) = (connections.clone(), requests.clone(), events.clone());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let nth_connection = c.fetch_add(1, Ordering::SeqCst);
            if matches!(mode, Mode::Late408) {
                tokio::spawn(serve_late_408(
                    stream,
                    nth_connection == 0,
                    r.clone(),
                    ev.clone(),
                ));
                continue;
            }
            tokio::spawn(serve_raw(
                stream,
                mode,
                nth_connection,
                r.clone(),
                ev.clone(),
            ));
        }
    });
    RawUpstream {
        addr,
        connections,
        requests,
        events,
    }
}

async fn serve_late_408(
    mut s: tokio::net::TcpStream,
    first: bool,
    requests: Arc<AtomicUsize>,
    events: Arc<std::sync::Mutex<Vec<String>>>,
) {
    let mut buf = Vec::new();
    let mut served = 0;
    while let Some((path, len)) = read_head_path(&mut s, &mut buf).await {
        if read_body(&mut s, &mut buf, len).await.is_none() {
            return;
        }
        requests.fetch_add(1, Ordering::SeqCst);
        events.lock().unwrap().push(format!("arrived {path}"));
        served += 1;
        if first && served == 2 {
            let _ = s
                .write_all(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 4\r\n\r\n408\n")
                .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            events.lock().unwrap().push(format!("late sent {path}"));
            if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nlate\n")
                .await
                .is_err()
            {
                return;
            }
            continue;
        }
        if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n")
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Reads one request (head and a Content-Length body); `None` at a clean
/// end of the connection.
async fn read_request(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let (_, len) = read_head(s, buf).await?;
    read_body(s, buf, len).await
}

/// Reads a request head; its method and Content-Length.
async fn read_head(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<(String, usize)> {
    read_head_line(s, buf)
        .await
        .map(|(method, _, len)| (method, len))
}

/// Like [`read_head`], with the request's path as well.
async fn read_head_path(
    s: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
) -> Option<(String, usize)> {
    read_head_line(s, buf)
        .await
        .map(|(_, path, len)| (path, len))
}

/// Reads a request head; its method (lower case), path and Content-Length.
async fn read_head_line(
    s: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
) -> Option<(String, String, usize)> {
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let lower = head.to_ascii_lowercase();
    let len: usize = lower
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    let method = lower.split(' ').next().unwrap_or_default().to_string();
    let path = head.split(' ').nth(1).unwrap_or_default().to_string();
    buf.drain(..head_end);
    Some((method, path, len))
}

async fn read_body(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>, len: usize) -> Option<()> {
    while buf.len() < len {
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    buf.drain(..len);
    Some(())
}

async fn serve_raw(
    mut s: tokio::net::TcpStream,
    mode: Mode,
    nth_connection: usize,
    requests: Arc<AtomicUsize>,
    events: Arc<std::sync::Mutex<Vec<String>>>,
) {
    let mut buf = Vec::new();
    let mut served = 0;
    if matches!(mode, Mode::RefusePutsUnread) {
        while let Some((method, path, len)) = read_head_line(&mut s, &mut buf).await {
            requests.fetch_add(1, Ordering::SeqCst);
            events
                .lock()
                .unwrap()
                .push(format!("connection {nth_connection} {method} {path}"));
            let answer = if method == "put" {
                "HTTP/1.1 401 Unauthorized\r\ncontent-length: 3\r\n\r\nno\n"
            } else {
                // A body holding the test's marker `<end>` says so as soon
                // as the marker is in: the whole upload it came in is.
                let mut marked = false;
                while buf.len() < len {
                    if !marked && buf.windows(5).any(|w| w == b"<end>") {
                        marked = true;
                        let event = format!("connection {nth_connection} read <end>");
                        events.lock().unwrap().push(event);
                    }
                    let mut chunk = [0u8; 4096];
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                buf.drain(..len);
                "HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n"
            };
            if s.write_all(answer.as_bytes()).await.is_err() {
                return;
            }
        }
        return;
    }
    if matches!(mode, Mode::RefusePutsEarly) {
        while let Some((method, len)) = read_head(&mut s, &mut buf).await {
            requests.fetch_add(1, Ordering::SeqCst);
            events
                .lock()
                .unwrap()
                .push(format!("connection {nth_connection} {method}"));
            let answer = if method == "put" {
                "HTTP/1.1 403 Forbidden\r\ncontent-length: 3\r\n\r\nno\n"
            } else {
                "HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n"
            };
            if s.write_all(answer.as_bytes()).await.is_err()
                || read_body(&mut s, &mut buf, len).await.is_none()
            {
                return;
            }
        }
        return;
    }
    loop {
        let next = match mode {
            Mode::IdleClose(idle) if served > 0 => {
                match tokio::time::timeout(idle, read_request(&mut s, &mut buf)).await {
                    Ok(r) => r,
                    // Idle too long: close, saying nothing.
                    Err(_) => return,
                }
            }
            _ => read_request(&mut s, &mut buf).await,
        };
        if next.is_none() {
            return;
        }
        requests.fetch_add(1, Ordering::SeqCst);
        served += 1;
        if matches!(mode, Mode::CutFirstAfterRequest) && nth_connection == 0 {
            return;
        }
        let last = matches!(mode, Mode::KeepAliveLimit(n) if served == n);
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\n{}\r\nok\n",
            if last { "connection: close\r\n" } else { "" }
        );
        if s.write_all(answer.as_bytes()).await.is_err() || last {
            return;
        }
    }
}

fn proxy_for(up: &RawUpstream, dir: &std::path::Path) -> Proxy {
    // One worker: every request shares one pool, so connection counts are
    // exact.
    ProxyBuilder::new(&up.url(), dir)
        .args(&["--workers", "1"])
        .spawn()
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_are_reused() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_raw_upstream(Mode::KeepAliveLimit(usize::MAX)).await;
    let p = proxy_for(&up, dir.path());
    for i in 0..20 {
        let a = put(&p.url(&format!("/k{i}")), "1").await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 20);
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        1,
        "one connection carried every request in turn"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_keep_alive_limit_with_connection_close_costs_no_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_raw_upstream(Mode::KeepAliveLimit(3)).await;
    let p = proxy_for(&up, dir.path());
    for i in 0..30 {
        let a = put(&p.url(&format!("/k{i}")), "1").await;
        assert_eq!(a.status, 200, "request {i}: {}", a.text());
    }
    // Concurrent ones too: several connections end at once.
    let mut all = tokio::task::JoinSet::new();
    for i in 0..40 {
        let url = p.url(&format!("/c{i}"));
        all.spawn(async move { put(&url, "1").await.status });
    }
    while let Some(status) = all.join_next().await {
        assert_eq!(status.unwrap(), 200);
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 70);
    assert!(up.connections.load(Ordering::SeqCst) >= 10);
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_the_upstream_closed_while_idle_cost_no_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_raw_upstream(Mode::IdleClose(Duration::from_millis(30))).await;
    let p = proxy_for(&up, dir.path());
    for i in 0..10 {
        let a = put(&p.url(&format!("/k{i}")), "1").await;
        assert_eq!(a.status, 200, "request {i}: {}", a.text());
        // Long enough for the upstream to close the idle connection.
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 10);
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        10,
        "each closed connection was replaced, none reused after its close"
    );
    let errors = metric(&p, "fencegate_upstream_errors_total").await;
    assert!(errors.is_none() || errors == Some(0.0), "{errors:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_write_that_may_have_been_sent_is_never_sent_again() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_raw_upstream(Mode::CutFirstAfterRequest).await;
    let p = proxy_for(&up, dir.path());
    let a = put(&p.url("/k"), "5").await;
    assert_eq!(a.status, 502, "{}", a.text());
    assert_eq!(
        up.requests.load(Ordering::SeqCst),
        1,
        "the write reached the upstream once and was not retried"
    );
    assert_eq!(up.connections.load(Ordering::SeqCst), 1);
    // The next write goes out on a fresh connection.
    assert_eq!(put(&p.url("/k"), "5").await.status, 200);
    assert_eq!(up.requests.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn no_request_waits_behind_an_upload_the_upstream_answered_early() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_raw_upstream(Mode::RefusePutsEarly).await;
    let p = proxy_for(&up, dir.path());
    // An upload whose body is mostly still to come when the upstream
    // refuses it.
    let mut upload = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    upload
        .write_all(
            b"PUT /big HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 100000\r\n\r\n",
        )
        .await
        .unwrap();
    upload.write_all(&[b'x'; 1000]).await.unwrap();
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut chunk = [0u8; 1024];
        let n = upload.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the proxy closed the upload");
        head.extend_from_slice(&chunk[..n]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 403"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    // That upstream connection is still taking the upload's body. A read
    // on the same worker must not be queued behind it.
    let read =
        tokio::time::timeout(Duration::from_secs(10), send("GET", &p.url("/r"), &[], "")).await;
    let read = read.expect("a read waited behind an upload still in progress");
    assert_eq!(read.status, 200, "{}", read.text());
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        2,
        "the read took a connection of its own"
    );
    // The upload ends; later reads need no new connection.
    upload.write_all(&[b'x'; 99_000]).await.unwrap();
    for _ in 0..5 {
        assert_eq!(send("GET", &p.url("/again"), &[], "").await.status, 200);
    }
    assert_eq!(up.connections.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_408_on_a_reused_connection_retires_it_and_holds_the_write() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_raw_upstream(Mode::Late408).await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--workers", "1", "--upstream-timeout", "2s"])
        .spawn();
    assert_eq!(put(&p.url("/first"), "1").await.status, 200);
    // Second request on that connection: the 408 comes back at once.
    let a = put(&p.url("/k"), "2").await;
    assert_eq!(a.status, 408, "{}", a.text());
    // Each next request gets its own answer, never the late one.
    let r = send("GET", &p.url("/other"), &[], "").await;
    assert_eq!((r.status.as_u16(), r.text().as_str()), (200, "ok\n"));
    // A newer write on the key reaches the upstream only after the old
    // write's real answer: the 408 did not end it. It waits, or is refused
    // with 503 (older write in flight) while the old one may still be
    // applied; retried, it goes through.
    let mut tries = 0;
    loop {
        let newer = put(&p.url("/k"), "3").await;
        match newer.status.as_u16() {
            200 => break,
            503 if tries < 20 => {
                assert_eq!(
                    newer.json()["type"],
                    "urn:fencegate:problem:older-write-in-flight"
                );
                tries += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            s => panic!("newer write: {s} {}", newer.text()),
        }
    }
    let events = up.events.lock().unwrap().clone();
    let late = events.iter().position(|e| e == "late sent /k");
    let newer = events.iter().rposition(|e| e == "arrived /k");
    assert!(
        matches!((late, newer), (Some(l), Some(n)) if n > l),
        "the newer write overtook the one the 408 answered: {events:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stop_while_a_write_answered_408_is_held_records_no_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_raw_upstream(Mode::Late408).await;
    let mut p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&[
            "--workers",
            "1",
            "--upstream-timeout",
            "4s",
            "--shutdown-grace",
            "300ms",
        ])
        .spawn();
    assert_eq!(put(&p.url("/first"), "1").await.status, 200);
    assert_eq!(put(&p.url("/k"), "2").await.status, 408);
    // The write may still be applied (its real answer is yet to come): the
    // drain must not record a clean stop while it is held.
    let exit = p.sigterm();
    assert_eq!(exit.code(), Some(3), "{exit:?}\n{}", p.stderr());
    assert!(
        !p.stderr().contains("clean stop recorded"),
        "{}",
        p.stderr()
    );
}

/// An upstream that answers 413 as soon as a request head is there, reads
/// nothing more, and keeps the connection open (a server refusing a body
/// it will not read). Its receive buffer is shrunk so that a 64 KiB body
/// cannot all be taken by the kernel: the proxy's write blocks.
fn start_early_refuser() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let socket = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )
    .unwrap();
    // Inherited by accepted sockets; set before listen so the window
    // offered in the handshake is small too.
    socket.set_recv_buffer_size(4096).unwrap();
    socket
        .bind(
            &"127.0.0.1:0"
                .parse::<std::net::SocketAddr>()
                .unwrap()
                .into(),
        )
        .unwrap();
    socket.listen(16).unwrap();
    let listener: std::net::TcpListener = socket.into();
    let addr = listener.local_addr().unwrap();
    let answered = Arc::new(AtomicUsize::new(0));
    let count = answered.clone();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let mut held = Vec::new();
        for s in listener.incoming() {
            let Ok(mut s) = s else { continue };
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            // Byte by byte: nothing past the head is read.
            while !head.ends_with(b"\r\n\r\n") {
                match s.read(&mut b) {
                    Ok(1) => head.push(b[0]),
                    _ => break,
                }
            }
            count.fetch_add(1, Ordering::SeqCst);
            let _ =
                s.write_all(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 8\r\n\r\ntoo big!");
            held.push(s);
        }
    });
    (addr, answered)
}

/// An upstream that refuses a write before it reads the body, and never
/// reads it: the request went into the socket's buffer whole, so the lane
/// cannot tell its answer from a late one. The connection is not reused:
/// the next request on it would be read as part of what the body holds
/// (here the head of a request whose body swallows it), and answered with
/// another request's answer, or never.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_whose_upload_was_refused_is_not_reused() {
    refused_upload_leaves_its_connection(None).await;
}

/// The same on hyper's path (a body over 64 KiB): hyper had sent the
/// whole body when the refusal came (loopback takes it at once), and the
/// connection used to go back to the pool; the next upload sent on it
/// completed the swallowed request and got that request's answer (200).
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_whose_streamed_upload_was_refused_is_not_pooled() {
    refused_upload_leaves_its_connection(Some(100_000)).await;
}

/// A PUT refused unread whose body holds a request head (`/swallow`) whose
/// own body swallows what comes next on the connection; with `padding`,
/// the upload is that long, and ends with a marker the upstream reports
/// when it reads it: the proxy sent the whole upload.
async fn refused_upload_leaves_its_connection(padding: Option<usize>) {
    let dir = tempfile::tempdir().unwrap();
    let up = start_raw_upstream(Mode::RefusePutsUnread).await;
    let p = proxy_for(&up, dir.path());
    let body = match padding {
        None => "GET /swallow HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n".to_string(),
        Some(n) => format!(
            "GET /swallow HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{}<end>",
            n + 4000,
            "x".repeat(n - 5)
        ),
    };
    let a = send("PUT", &p.url("/up"), &[("X-Fence-Token", "1")], body).await;
    assert_eq!(a.status, 401, "{}", a.text());
    let mut expected = vec!["connection 0 put /up", "connection 0 get /swallow"];
    if padding.is_some() {
        expected.push("connection 0 read <end>");
    }
    // The body-blind upstream reads the body as a request, and waits for
    // that request's body.
    // (When the proxy closes the connection is not this test's concern.)
    let events = || -> Vec<String> {
        let events = up.events.lock().unwrap();
        events
            .iter()
            .filter(|e| !e.ends_with(" closed"))
            .cloned()
            .collect()
    };
    eventually("the body read as a request", Duration::from_secs(5), || {
        events().len() == expected.len()
    })
    .await;
    if padding.is_some() {
        // The upload is all sent: give hyper's connection the moment it
        // takes to become ready (and, were it kept, be pooled).
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The next request on the same path as the upload: the lane's GET, or
    // on hyper's path an upload of its own (answered 401 too).
    let url = p.url("/next");
    let next = match padding {
        None => send("GET", &url, &[], String::new()),
        Some(n) => send("PUT", &url, &[("X-Fence-Token", "2")], "y".repeat(n)),
    };
    let a = tokio::time::timeout(Duration::from_secs(3), next)
        .await
        .expect("the next request was sent on the refused upload's connection");
    match padding {
        None => {
            assert_eq!(a.status, 200, "{}", a.text());
            assert_eq!(a.text(), "ok\n");
            expected.push("connection 1 get /next");
        }
        Some(_) => {
            assert_eq!(a.status, 401, "{}", a.text());
            expected.push("connection 1 put /next");
        }
    }
    assert_eq!(events(), expected);
}

/// The lane writes a request while it watches for the answer: an
/// upstream that answers early and stops reading gets its answer passed
/// on at once (as hyper's path does), not a 504 at the deadline; the
/// connection is not reused.
#[tokio::test(flavor = "multi_thread")]
async fn an_early_answer_from_an_upstream_that_stops_reading_is_passed_on() {
    let (addr, answered) = start_early_refuser();
    let dir = tempfile::tempdir().unwrap();
    let p = ProxyBuilder::new(&format!("http://{addr}"), dir.path())
        .args(&["--upstream-timeout", "5s"])
        .spawn();
    for n in 1..=2 {
        // 64 KiB: the largest body the lane reads whole.
        let body = vec![b'b'; 64 * 1024];
        let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
        let head = format!(
            "PUT /big{n} HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body).await.unwrap();
        let mut got = Vec::new();
        let mut b = [0u8; 4096];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => break,
                Ok(k) => got.extend_from_slice(&b[..k]),
            }
        }
        let got = String::from_utf8_lossy(&got);
        assert!(
            got.starts_with("HTTP/1.1 413"),
            "request {n} (upstream answered {}): {got}",
            answered.load(Ordering::SeqCst)
        );
        // A new connection each time: the cut one was not reused.
        assert_eq!(answered.load(Ordering::SeqCst), n);
    }
}

/// A backend as small internal APIs are: a listen queue of `backlog`
/// (Python's `http.server` asks for 5), accepted one at a time with a
/// pause, each request answered after `delay`, or, for `/hold...`, once
/// the test releases it. It counts the connections it has open (the
/// count drops before the answer is written, so it never runs ahead of
/// fencegate's own).
struct SmallBackend {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    max_open: Arc<AtomicUsize>,
    /// Paths of the requests that arrived, in order.
    arrived: Arc<std::sync::Mutex<Vec<String>>>,
    release: Arc<tokio::sync::Notify>,
}

impl SmallBackend {
    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    fn arrived(&self) -> Vec<String> {
        self.arrived.lock().unwrap().clone()
    }
}

fn start_small_backend(backlog: i32, delay: Duration) -> SmallBackend {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(
            &"127.0.0.1:0"
                .parse::<std::net::SocketAddr>()
                .unwrap()
                .into(),
        )
        .unwrap();
    socket.listen(backlog).unwrap();
    socket.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(socket.into()).unwrap();
    let b = SmallBackend {
        addr: listener.local_addr().unwrap(),
        connections: Arc::default(),
        open: Arc::default(),
        max_open: Arc::default(),
        arrived: Arc::default(),
        release: Arc::default(),
    };
    let (connections, open, max_open, arrived, release) = (
        b.connections.clone(),
        b.open.clone(),
        b.max_open.clone(),
        b.arrived.clone(),
        b.release.clone(),
    );
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            connections.fetch_add(1, Ordering::SeqCst);
            let now = open.fetch_add(1, Ordering::SeqCst) + 1;
            max_open.fetch_max(now, Ordering::SeqCst);
            let (open, arrived, release) = (open.clone(), arrived.clone(), release.clone());
            tokio::spawn(async move {
                // One request per connection: as many small servers do,
                // and what makes every request of a burst dial.
                let mut buf = Vec::new();
                let request = match read_head_path(&mut s, &mut buf).await {
                    Some((path, len)) => read_body(&mut s, &mut buf, len).await.map(|()| path),
                    None => None,
                };
                let Some(path) = request else {
                    open.fetch_sub(1, Ordering::SeqCst);
                    return;
                };
                arrived.lock().unwrap().push(path.clone());
                if path.starts_with("/hold") {
                    release.notified().await;
                } else {
                    tokio::time::sleep(delay).await;
                }
                open.fetch_sub(1, Ordering::SeqCst);
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n",
                    )
                    .await;
            });
            // A busy backend calls accept() only now and then.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    b
}

/// One PUT on a connection of its own (`Connection: close`), read to the
/// end: the status line and the head, or what went wrong (a reset, an
/// answer cut short, no answer within `limit`).
async fn put_on_new_connection(
    proxy: std::net::SocketAddr,
    path: &str,
    limit: Duration,
) -> Result<(u16, String), String> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(proxy)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let req = format!(
            "PUT {path} HTTP/1.1\r\nhost: x\r\nx-fence-token: 1\r\ncontent-length: 1\r\nconnection: close\r\n\r\nx"
        );
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&answer).to_string();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("no answer: {text:?}"))?;
        Ok((status, text.to_ascii_lowercase()))
    };
    tokio::time::timeout(limit, exchange)
        .await
        .map_err(|_| format!("no answer within {limit:?}"))?
}

/// Issue 42.6: a burst of new connections against a backend with a listen
/// queue of 5. Without a cap every request dialled at once; the backend's
/// queue overflowed, Linux answered with SYN cookies or dropped the
/// handshake's last ACK, and requests sat unacknowledged until their 60 s
/// upstream timeout (504). With the cap the backend never has more than
/// it connections, and every client gets 200 or a clear problem at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_against_a_small_backlog_backend_gets_200_or_a_clear_problem() {
    const CAP: usize = 4;
    const BURST: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let up = start_small_backend(5, Duration::from_millis(50));
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&[
            "--workers",
            "2",
            "--upstream-max-connections",
            &CAP.to_string(),
            "--upstream-queue-timeout",
            "20s",
            "--connect-timeout",
            "2s",
        ])
        .spawn();
    let mut all = tokio::task::JoinSet::new();
    for i in 0..BURST {
        let addr = p.addr;
        // 40 s: well under the 60 s upstream timeout that the hung
        // requests ran into.
        all.spawn(async move {
            put_on_new_connection(addr, &format!("/k{i}"), Duration::from_secs(40)).await
        });
    }
    let (mut ok, mut problems, mut failures) = (0, Vec::new(), Vec::new());
    while let Some(answer) = all.join_next().await {
        match answer.unwrap() {
            Ok((200, _)) => ok += 1,
            Ok((status @ (502 | 503), head))
                if head.contains("application/problem+json") && head.contains("retry-after:") =>
            {
                problems.push(status)
            }
            Ok((status, head)) => failures.push(format!("{status}: {head}")),
            Err(e) => failures.push(e),
        }
    }
    assert!(
        failures.is_empty(),
        "{} unclear answers: {failures:?}",
        failures.len()
    );
    assert!(ok > 0, "problems only: {problems:?}");
    let max_open = up.max_open.load(Ordering::SeqCst);
    assert!(
        max_open <= CAP,
        "the backend had {max_open} connections at once (cap {CAP})"
    );
}

fn capped_proxy(up: &SmallBackend, dir: &std::path::Path, queue_timeout: &str) -> Proxy {
    // One worker: the connection given back is the one the queued request
    // takes, and the counts are exact.
    ProxyBuilder::new(&up.url(), dir)
        .args(&[
            "--workers",
            "1",
            "--upstream-max-connections",
            "1",
            "--upstream-queue-timeout",
            queue_timeout,
        ])
        .spawn()
}

const QUEUED: &str = "fencegate_upstream_queued_requests{route=\"default\"}";

#[tokio::test(flavor = "multi_thread")]
async fn a_queued_request_gets_the_connection_another_frees() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_small_backend(128, Duration::ZERO);
    let p = capped_proxy(&up, dir.path(), "20s");
    let held = {
        let url = p.url("/hold");
        tokio::spawn(async move { put(&url, "1").await })
    };
    eventually(
        "the first write reaches the backend",
        Duration::from_secs(10),
        || up.arrived() == ["/hold"],
    )
    .await;
    let queued = {
        let url = p.url("/next");
        tokio::spawn(async move { put(&url, "1").await })
    };
    for _ in 0..500 {
        if metric(&p, QUEUED).await == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        metric(&p, QUEUED).await,
        Some(1.0),
        "the second write queues"
    );
    assert_eq!(up.arrived(), ["/hold"], "nothing else was sent");
    assert_eq!(up.connections.load(Ordering::SeqCst), 1);
    up.release.notify_one();
    let (held, queued) = (held.await.unwrap(), queued.await.unwrap());
    assert_eq!(held.status, 200, "{}", held.text());
    assert_eq!(queued.status, 200, "{}", queued.text());
    assert_eq!(up.arrived(), ["/hold", "/next"]);
    assert_eq!(up.max_open.load(Ordering::SeqCst), 1);
    assert_eq!(metric(&p, QUEUED).await, Some(0.0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wait_past_the_queue_timeout_is_a_503_with_retry_after_and_nothing_sent() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_small_backend(128, Duration::ZERO);
    let p = capped_proxy(&up, dir.path(), "300ms");
    let held = {
        let url = p.url("/hold");
        tokio::spawn(async move { put(&url, "1").await })
    };
    eventually(
        "the first write reaches the backend",
        Duration::from_secs(10),
        || up.arrived() == ["/hold"],
    )
    .await;
    let started = std::time::Instant::now();
    let refused = put(&p.url("/next"), "1").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(
        refused.json()["type"],
        "urn:fencegate:problem:upstream-busy",
        "{}",
        refused.text()
    );
    assert_eq!(up.arrived(), ["/hold"], "the refused write was never sent");
    assert_eq!(
        metric(
            &p,
            "fencegate_upstream_queue_timeouts_total{route=\"default\"}"
        )
        .await,
        Some(1.0)
    );
    // Its key was not held: the same write goes through once there is room.
    up.release.notify_one();
    assert_eq!(held.await.unwrap().status, 200);
    let again = put(&p.url("/next"), "1").await;
    assert_eq!(again.status, 200, "{}", again.text());
}
