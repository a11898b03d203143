//! Issue 43's given-up write over an HTTP/2 upstream (h2c): a replica cut
//! from its backend with writes in flight answers each at its deadline,
//! and nothing of them may reach the backend after the heal. The replica
//! and the backend each on a host of their own (`tests/common/netns.rs`).
//! Needs root, iproute2 and nftables (scripts/test installs them).

mod common;

use std::time::{Duration, Instant};

use common::netns::Net;
use common::writes::{applied, put_until_ok, puts, queued_for};
use common::*;
use http::StatusCode;
use hyper_util::rt::TokioExecutor;

/// Before the fix, the stream of a given-up write was only reset: the
/// connection, shared by every request of the worker, was kept, and 65-98
/// KB of DATA frames (END_STREAM among them) waited in the replica's kernel
/// for the heal, in every run. Now the connection is thrown (`kill.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_write_given_up_at_its_deadline_never_reaches_the_backend_after_the_heal() {
    let mut net = Net::new();
    let (backend, a) = (net.host(), net.host());
    let up = start_upstream_in_with(&backend, 8080, |stream, service| {
        Box::pin(async move {
            // HTTP/2 only, as a gRPC server.
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        })
    });
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.toml");
    std::fs::write(
        &config,
        format!(
            "[[routes]]\nupstream = \"{}\"\nupstream_http2 = true\nupstream_timeout = \"2s\"\n",
            up.url()
        ),
    )
    .unwrap();
    let pa = ProxyBuilder::with_config(&config, dir.path())
        .netns(&a)
        .spawn();
    let keys: Vec<(String, usize)> = (0..4)
        .map(|k| (format!("/k{k}"), if k < 2 { 16 << 10 } else { 512 << 10 }))
        .collect();
    // Each worker's HTTP/2 connection is open before the cut.
    for token in 1..=3 {
        for status in puts(pa.addr, &keys, token).await {
            assert_eq!(status, Some(StatusCode::OK));
        }
    }
    net.cut(&a, &backend);
    let cut_at = Instant::now();
    for status in puts(pa.addr, &keys, 5).await {
        let status = status.expect("A answers at its deadline");
        assert!(
            status == StatusCode::GATEWAY_TIMEOUT || status == StatusCode::BAD_GATEWAY,
            "a write A cannot deliver is answered 504 or 502, got {status}"
        );
    }
    let left = queued_for(&a, &backend);
    assert!(
        left.is_empty(),
        "A still holds bytes for the backend after giving up on its writes (delivered when the link heals):\n{}",
        left.join("\n")
    );
    net.heal();
    eprintln!("partition lasted {:?}", cut_at.elapsed());
    // A resumes on its own, on a new connection; the backend saw each
    // key's tokens in order, none of the given-up ones among them.
    for (p, _) in &keys {
        put_until_ok(pa.addr, p, 6, Duration::from_secs(20)).await;
    }
    for (p, _) in &keys {
        assert_eq!(applied(&up, p), vec![1, 2, 3, 6], "history of {p}");
    }
}
