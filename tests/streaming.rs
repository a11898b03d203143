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
