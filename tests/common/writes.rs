//! Writes sent to replicas in network namespaces, and what a host's
//! kernel still holds for a peer (tests/partition.rs, tests/partition_h2.rs).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper_util::rt::TokioIo;

use super::netns::Host;

/// A write of `body` bytes to `path` with `token`, sent to the proxy at
/// `to` on a connection of its own (from the test's link to the switch);
/// its status, or `None` if no answer came within 30 s.
pub async fn put(to: SocketAddr, path: &str, token: u64, body: usize) -> Option<StatusCode> {
    let exchange = async {
        let io = tokio::net::TcpStream::connect(to).await.ok()?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .ok()?;
        tokio::spawn(conn);
        let req = http::Request::put(path)
            .header("host", to.to_string())
            .header("x-fence-token", token.to_string())
            .body(Full::new(Bytes::from(vec![b'x'; body])))
            .unwrap();
        Some(send.send_request(req).await.ok()?.status())
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .ok()
        .flatten()
}

/// The lines of `ss -tn` on `host` for connections to `peer` that still
/// hold bytes for it, or are closing with bytes it may not have: a
/// non-empty send queue, or a FIN not yet acknowledged.
pub fn queued_for(host: &Host, peer: &Host) -> Vec<String> {
    host.sockets_to(peer.addr)
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let send_q = f.get(2).and_then(|q| q.parse::<u64>().ok()).unwrap_or(0);
            send_q > 0 || f.first().is_some_and(|s| s.starts_with("FIN-WAIT-1"))
        })
        .map(str::to_string)
        .collect()
}

/// Writes at once, one per `(path, body size)`, with `token`: their
/// statuses in order.
pub async fn puts(
    to: SocketAddr,
    writes: &[(String, usize)],
    token: u64,
) -> Vec<Option<StatusCode>> {
    let tasks: Vec<_> = writes
        .iter()
        .map(|(path, body)| {
            let (path, body) = (path.clone(), *body);
            tokio::spawn(async move { put(to, &path, token, body).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// The tokens the backend applied to `path`, in arrival order.
pub fn applied(up: &super::Upstream, path: &str) -> Vec<u64> {
    up.records()
        .iter()
        .filter(|r| r.target == path)
        .map(|r| r.token.as_deref().unwrap_or("").parse().unwrap())
        .collect()
}

/// [`puts`], each refused write sent again until all are admitted, at
/// most `within`: how long that took. Every refusal meanwhile must be a
/// 503.
pub async fn puts_until_ok(
    to: SocketAddr,
    writes: &[(String, usize)],
    token: u64,
    within: Duration,
) -> Duration {
    let from = Instant::now();
    let mut left = writes.to_vec();
    loop {
        let statuses = puts(to, &left, token).await;
        assert!(
            statuses
                .iter()
                .all(|s| matches!(*s, Some(StatusCode::OK | StatusCode::SERVICE_UNAVAILABLE))),
            "{statuses:?}"
        );
        left = left
            .into_iter()
            .zip(&statuses)
            .filter(|(_, s)| **s != Some(StatusCode::OK))
            .map(|(w, _)| w)
            .collect();
        if left.is_empty() {
            return from.elapsed();
        }
        assert!(
            from.elapsed() < within,
            "not admitted within {within:?}: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A write sent again (100 ms apart) until it is admitted, at most
/// `within`; what each refusal was does not matter (a replica resuming
/// after a heal).
pub async fn put_until_ok(to: SocketAddr, path: &str, token: u64, within: Duration) {
    let from = Instant::now();
    loop {
        match put(to, path, token, 10).await {
            Some(StatusCode::OK) => return,
            other => assert!(
                from.elapsed() < within,
                "{path}: {other:?} after {within:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
