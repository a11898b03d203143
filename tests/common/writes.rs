//! Writes sent to replicas in network namespaces, and what a host's
//! kernel still holds for a peer (tests/partition.rs, tests/partition_h2.rs).

use std::net::SocketAddr;
use std::time::Duration;

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
