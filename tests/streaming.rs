//! Bodies: Expect: 100-continue answered before the body, and a 256 MiB
//! upload streamed with flat memory.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn read_head(s: &mut tokio::net::TcpStream) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !out.ends_with(b"\r\n\r\n") {
        match tokio::time::timeout_at(deadline, s.read(&mut b)).await {
            Ok(Ok(1)) => out.push(b[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn expect_100_continue_gets_the_final_refusal_before_the_body() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    assert_eq!(put(&p.url("/e"), "5").await.status, 200);
    for (token_line, status) in [
        ("X-Fence-Token: 4\r\n", "409"),
        ("X-Fence-Token: 04\r\n", "400"),
        ("", "428"),
    ] {
        let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
        let head = format!(
            "PUT /e HTTP/1.1\r\nHost: x\r\n{token_line}Expect: 100-continue\r\nContent-Length: 5\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let got = read_head(&mut s).await;
        assert!(
            got.starts_with(&format!("HTTP/1.1 {status}")),
            "{token_line:?}: {got}"
        );
        assert!(!got.contains("100 Continue"));
    }
    // An admitted write gets 100 Continue, then sends its body.
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    s.write_all(b"PUT /e HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 5\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        .await
        .unwrap();
    let got = read_head(&mut s).await;
    assert!(got.starts_with("HTTP/1.1 100"), "{got}");
    s.write_all(b"hello").await.unwrap();
    let got = read_head(&mut s).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(up.count(), 2);
    assert_eq!(up.records()[1].body_len, 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_256_mib_upload_streams_intact_with_flat_memory() {
    const CHUNK: usize = 256 * 1024;
    const CHUNKS: usize = 1024; // 256 MiB
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    // Deterministic pseudo-random content, hashed as it is generated.
    let mut expected = FNV_START;
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut chunks = Vec::with_capacity(CHUNKS);
    let mut one = vec![0u8; CHUNK];
    for _ in 0..4 {
        for b in one.iter_mut() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            *b = seed as u8;
        }
        chunks.push(Bytes::from(one.clone()));
    }
    let stream_chunks: Vec<Bytes> = (0..CHUNKS).map(|i| chunks[i % 4].clone()).collect();
    for c in &stream_chunks {
        expected = fnv1a(expected, c);
    }
    let body = ChunkBody::new(stream_chunks).boxed();
    let a = send_body("PUT", &p.url("/big"), &[("x-fence-token", "1")], body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let r = &up.records()[0];
    assert_eq!(r.body_len, (CHUNK * CHUNKS) as u64);
    assert_eq!(r.body_hash, expected, "body arrived intact");
    assert_eq!(a.header("x-body-hash"), Some(expected.to_string().as_str()));
    let rss = p.peak_rss();
    assert!(rss < 100 * 1024 * 1024, "peak RSS {} MiB", rss >> 20);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_request_body_gets_408_and_is_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--body-read-timeout", "500ms"])
        .spawn();
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    s.write_all(
        b"PUT /stall HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 100\r\n\r\npartial",
    )
    .await
    .unwrap();
    let got = read_head(&mut s).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(up.count(), 0, "a cut-off body was applied");
}

/// A raw upstream that answers every request with a chunked event stream:
/// `data: 1`, a pause of `gap`, `data: 2`, and the body's end. It reads
/// the request's head only (the tests send bodiless requests).
/// A raw upstream: each connection's request head is read, then `answer`
/// writes what it likes on the connection.
async fn raw_upstream<F, Fut>(answer: F) -> std::net::SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answer = std::sync::Arc::new(answer);
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut b = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&b[..n]),
                    }
                }
                answer(s).await;
            });
        }
    });
    addr
}

async fn event_stream_upstream(gap: Duration) -> std::net::SocketAddr {
    raw_upstream(move |mut s| async move {
        let mut b = [0u8; 4096];
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
                    Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        let one = "9\r\ndata: 1\n\n\r\n";
        if s.write_all(format!("{head}{one}").as_bytes())
            .await
            .is_err()
        {
            return;
        }
        tokio::time::sleep(gap).await;
        let _ = s.write_all(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n").await;
        let _ = s.read(&mut b).await;
    })
    .await
}

/// The three ways a request reaches the upstream: the own lane (plain
/// HTTP/1.1), hyper's HTTP/1.1 (a `TE` header is hyper's), and HTTP/2.
/// Each reads an event stream to its end or its cut; the body read.
async fn read_events(p: &Proxy, how: &str, give_up: Duration) -> Result<String, String> {
    let request = match how {
        "lane" => "GET /events HTTP/1.1\r\nHost: x\r\n\r\n",
        "hyper" => "GET /events HTTP/1.1\r\nHost: x\r\nTE: trailers\r\n\r\n",
        _ => {
            let client: hyper_util::client::legacy::Client<_, Body> =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .http2_only(true)
                    .build_http();
            let read = async {
                let resp = client
                    .request(http::Request::get(p.url("/events")).body(full("")).unwrap())
                    .await
                    .map_err(|e| format!("h2: {e}"))?;
                let mut body = resp.into_body();
                let mut got = String::new();
                while let Some(frame) = body.frame().await {
                    match frame {
                        Ok(f) => {
                            if let Some(d) = f.data_ref() {
                                got.push_str(&String::from_utf8_lossy(d));
                            }
                        }
                        Err(e) => return Err(format!("h2 body cut after {got:?}: {e}")),
                    }
                }
                Ok(got)
            };
            return tokio::time::timeout(give_up, read)
                .await
                .unwrap_or_else(|_| Err("h2: still streaming".into()));
        }
    };
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + give_up;
    loop {
        if got.ends_with(b"\r\n0\r\n\r\n") {
            return Ok(String::from_utf8_lossy(&got).into_owned());
        }
        match tokio::time::timeout_at(deadline, s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                return Err(format!("{how}: cut: {:?}", String::from_utf8_lossy(&got)))
            }
            Ok(Ok(n)) => got.extend_from_slice(&b[..n]),
            Err(_) => {
                return Err(format!(
                    "{how}: still streaming: {:?}",
                    String::from_utf8_lossy(&got)
                ))
            }
        }
    }
}

/// A response streaming is not an idle connection: an event stream whose
/// pause is longer than the idle timeout (`header_read_timeout`) reaches
/// the client whole, on the lane, on hyper's HTTP/1.1 and over HTTP/2.
#[tokio::test(flavor = "multi_thread")]
async fn a_response_pausing_past_the_idle_timeout_is_not_cut() {
    let dir = tempfile::tempdir().unwrap();
    let up = event_stream_upstream(Duration::from_millis(2500)).await;
    let p = ProxyBuilder::new(&format!("http://{up}"), dir.path())
        .args(&["--header-read-timeout", "1s"])
        .spawn();
    let give_up = Duration::from_secs(20);
    let (lane, hyper, h2) = tokio::join!(
        read_events(&p, "lane", give_up),
        read_events(&p, "hyper", give_up),
        read_events(&p, "h2", give_up),
    );
    for got in [lane, hyper, h2] {
        let got = got.unwrap();
        assert!(
            got.contains("data: 1") && got.contains("data: 2"),
            "{got:?}"
        );
    }
}

/// A response body whose upstream sends nothing for
/// `response_idle_timeout` is cut (nginx's `proxy_read_timeout`): the
/// client sees an unfinished body, and the cut is logged and counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_response_whose_upstream_stalls_past_its_bound_is_cut_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let up = event_stream_upstream(Duration::from_secs(30)).await;
    let p = ProxyBuilder::new(&format!("http://{up}"), dir.path())
        .args(&[
            "--header-read-timeout",
            "500ms",
            "--response-idle-timeout",
            "1s",
            "--access-log",
        ])
        .spawn();
    let give_up = Duration::from_secs(15);
    let (lane, hyper, h2) = tokio::join!(
        read_events(&p, "lane", give_up),
        read_events(&p, "hyper", give_up),
        read_events(&p, "h2", give_up),
    );
    for got in [lane, hyper, h2] {
        let e = got.unwrap_err();
        assert!(e.contains("cut") && e.contains("data: 1"), "{e}");
        assert!(!e.contains("data: 2"), "{e}");
    }
    eventually_async("three cuts counted", || async {
        let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
        series_value(
            &m,
            "fencegate_response_bodies_cut_total{reason=\"upstream_stalled\",route=\"default\"}",
        ) == Some(3.0)
    })
    .await;
    let log = p.stderr();
    let cut = log
        .lines()
        .filter(|l| l.contains("response body cut") && l.contains("upstream_stalled"))
        .count();
    assert!(cut >= 3, "{log}");
}

/// A client that stops reading a response holds it no longer than
/// `response_idle_timeout` (nginx's `send_timeout`): its connection is
/// closed, counted as `response_stalled`, and the body as cut.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_is_closed_at_the_response_idle_timeout() {
    const TOTAL: usize = 256 << 20;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut b = [0u8; 4096];
                let _ = s.read(&mut b).await;
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {TOTAL}\r\n\r\n");
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let block = vec![b'x'; 64 * 1024];
                for _ in 0..TOTAL / block.len() {
                    if s.write_all(&block).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let p = ProxyBuilder::new(&format!("http://{up}"), dir.path())
        .args(&[
            "--header-read-timeout",
            "500ms",
            "--response-idle-timeout",
            "1s",
        ])
        .spawn();
    let mut clients = Vec::new();
    for request in [
        "GET /big HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /big HTTP/1.1\r\nHost: x\r\nTE: trailers\r\n\r\n",
    ] {
        let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let head = read_head(&mut s).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        clients.push(s);
    }
    // Neither client reads on: both connections are closed for it.
    eventually_async("two stalled responses closed", || async {
        let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
        series_value(
            &m,
            "fencegate_connections_closed_total{listener=\"proxy\",reason=\"response_stalled\"}",
        ) == Some(2.0)
            && series_value(
                &m,
                "fencegate_response_bodies_cut_total{reason=\"dropped\",route=\"default\"}",
            ) == Some(2.0)
    })
    .await;
    for mut s in clients {
        let mut got = 0usize;
        let mut b = vec![0u8; 1 << 16];
        loop {
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => got += n,
                Err(_) => panic!("the connection is still open after {got} bytes"),
            }
        }
        assert!(got < TOTAL, "the whole body came: {got}");
    }
}

/// An upstream that answers in HTTP/1.0, its body delimited by the close:
/// `rst` ends it with a reset (a cut), otherwise with a FIN (whole).
async fn http10_upstream(rst: bool) -> std::net::SocketAddr {
    raw_upstream(move |mut s| async move {
        let _ = s
            .write_all(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\ndata: 1\n\n")
            .await;
        let _ = s.flush().await;
        // Let the first bytes go out before the end.
        tokio::time::sleep(Duration::from_millis(200)).await;
        if rst {
            socket2::SockRef::from(&s)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
        } else {
            let _ = s.shutdown().await;
        }
    })
    .await
}

/// The attack's finding D1: an HTTP/1.0 upstream's close-delimited answer
/// went to an HTTP/1.1 client on hyper's path as `HTTP/1.0`, close-
/// delimited, so a cut body ended as cleanly as a whole one. Every answer
/// is now HTTP/1.1 and framed: a whole body ends with its last chunk, a cut
/// one never does, on the lane and on hyper's path alike.
#[tokio::test(flavor = "multi_thread")]
async fn an_http_1_0_upstreams_cut_body_is_never_passed_off_as_whole() {
    for rst in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let up = http10_upstream(rst).await;
        let p = ProxyBuilder::new(&format!("http://{up}"), dir.path()).spawn();
        for how in ["lane", "hyper"] {
            let request = match how {
                "lane" => "GET /t HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                _ => "GET /t HTTP/1.1\r\nHost: x\r\nTE: trailers\r\nConnection: close\r\n\r\n",
            };
            let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
            s.write_all(request.as_bytes()).await.unwrap();
            let mut got = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got));
            let _ = read.await.expect("the answer ends");
            let got = String::from_utf8_lossy(&got).to_lowercase();
            assert!(got.starts_with("http/1.1 200"), "{how}, rst {rst}: {got:?}");
            assert!(
                got.contains("transfer-encoding: chunked"),
                "{how}, rst {rst}: framed, not close-delimited: {got:?}"
            );
            assert!(got.contains("data: 1"), "{how}, rst {rst}: {got:?}");
            assert_eq!(
                got.ends_with("\r\n0\r\n\r\n"),
                !rst,
                "{how}, rst {rst}: whole only if the upstream ended it cleanly: {got:?}"
            );
        }
    }
}
