//! Behind a load balancer: the PROXY protocol (versions 1 and 2) on a
//! listener, accepted only from `trusted_proxies`, and `X-Forwarded-For`
//! believed only from them. The trusted balancer here is 127.0.0.2 (a
//! client socket bound to it); 127.0.0.1 is anyone else.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const BALANCER: &str = "127.0.0.2";

async fn connect_from(source: &str, to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    socket.connect(to).await.unwrap()
}

/// Sends `prefix` then a PUT, and reads until the connection ends: the
/// whole answer, empty if the connection was closed without one.
async fn exchange(
    from: &str,
    p: &Proxy,
    prefix: &[u8],
    path: &str,
    token: &str,
    extra: &str,
) -> String {
    let mut s = connect_from(from, p.addr).await;
    let mut out = prefix.to_vec();
    out.extend_from_slice(
        format!(
            "PUT {path} HTTP/1.1\r\nHost: x\r\nX-Fence-Token: {token}\r\n{extra}Content-Length: 1\r\nConnection: close\r\n\r\nx"
        )
        .as_bytes(),
    );
    // The proxy may close before it has read everything: a write error is
    // an answer too.
    let _ = s.write_all(&out).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

fn v2_header(client: &str) -> Vec<u8> {
    let client = client.parse::<SocketAddr>().unwrap();
    // The balancer's own address, of the client's family.
    let local = if client.is_ipv6() {
        "[2001:db8::1]:8080"
    } else {
        "10.0.0.1:8080"
    };
    ppp::v2::Builder::with_addresses(
        ppp::v2::Version::Two | ppp::v2::Command::Proxy,
        ppp::v2::Protocol::Stream,
        (client, local.parse::<SocketAddr>().unwrap()),
    )
    .build()
    .unwrap()
}

fn forwarded_for(up: &Upstream, path: &str) -> String {
    let r = up
        .records()
        .into_iter()
        .find(|r| r.target == path)
        .unwrap_or_else(|| panic!("{path} did not reach the backend"));
    r.headers["x-forwarded-for"].to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn proxy_headers_name_the_client_only_from_trusted_balancers() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&[
            "--proxy-protocol",
            "--trusted-proxies",
            BALANCER,
            "--access-log",
            "--log-format",
            "json",
        ])
        .spawn();

    // Version 1 and version 2 from the balancer: the client they name is
    // the one the backend and the log see.
    let v1 = b"PROXY TCP4 203.0.113.9 10.0.0.1 51000 8080\r\n";
    let a = exchange(BALANCER, &p, v1, "/pp/v1", "1", "").await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(forwarded_for(&up, "/pp/v1"), "203.0.113.9");
    let a = exchange(
        BALANCER,
        &p,
        &v2_header("[2001:db8::5]:4711"),
        "/pp/v2",
        "1",
        "",
    )
    .await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(forwarded_for(&up, "/pp/v2"), "2001:db8::5");
    // A balancer's own health check (LOCAL) keeps the balancer as client.
    let local = ppp::v2::Builder::with_addresses(
        ppp::v2::Version::Two | ppp::v2::Command::Local,
        ppp::v2::Protocol::Unspecified,
        ppp::v2::Addresses::Unspecified,
    )
    .build()
    .unwrap();
    let a = exchange(BALANCER, &p, &local, "/pp/local", "1", "").await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(forwarded_for(&up, "/pp/local"), BALANCER);

    // Anyone else, with or without a header: closed, nothing forwarded.
    let a = exchange("127.0.0.1", &p, v1, "/pp/untrusted", "1", "").await;
    assert_eq!(a, "");
    let a = exchange("127.0.0.1", &p, b"", "/pp/untrusted", "1", "").await;
    assert_eq!(a, "");
    // The balancer without a header, or with a broken one: closed.
    let a = exchange(BALANCER, &p, b"", "/pp/none", "1", "").await;
    assert_eq!(a, "");
    let a = exchange(
        BALANCER,
        &p,
        b"PROXY TCP4 nope 10.0.0.1 1 2\r\n",
        "/pp/bad",
        "1",
        "",
    )
    .await;
    assert_eq!(a, "");
    for path in ["/pp/untrusted", "/pp/none", "/pp/bad"] {
        assert!(
            up.records().iter().all(|r| r.target != path),
            "{path} reached the backend"
        );
    }
    let closed = |reason: &'static str| {
        let p = &p;
        async move {
            metric(
                p,
                &format!(
                    "fencegate_connections_closed_total{{listener=\"proxy\",reason=\"{reason}\"}}"
                ),
            )
            .await
        }
    };
    assert_eq!(closed("untrusted_proxy").await, Some(2.0));
    assert_eq!(closed("proxy_protocol").await, Some(2.0));

    eventually(
        "the access log names the real client",
        Duration::from_secs(10),
        || {
            p.stderr().lines().any(|l| {
                l.contains("\"client\":\"203.0.113.9\"")
                    && l.contains("\"peer\":\"203.0.113.9:51000\"")
            })
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn forwarded_headers_are_believed_only_from_trusted_proxies() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&[
            "--trusted-proxies",
            BALANCER,
            "--access-log",
            "--log-format",
            "json",
        ])
        .spawn();
    let xff = "X-Forwarded-For: 198.51.100.7\r\nForwarded: for=198.51.100.7\r\n";
    // From the trusted proxy: kept, this hop appended; the client is the
    // address it named.
    let a = exchange(BALANCER, &p, b"", "/x/trusted", "1", xff).await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(
        forwarded_for(&up, "/x/trusted"),
        format!("198.51.100.7, {BALANCER}")
    );
    // From anyone else: what it claims is dropped.
    let a = exchange("127.0.0.1", &p, b"", "/x/untrusted", "2", xff).await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(forwarded_for(&up, "/x/untrusted"), "127.0.0.1");
    let r = up
        .records()
        .into_iter()
        .find(|r| r.target == "/x/untrusted")
        .unwrap();
    assert_eq!(r.headers["forwarded"], "for=127.0.0.1;proto=http");
    eventually(
        "the access log names the client the proxy named",
        Duration::from_secs(10),
        || {
            p.stderr()
                .lines()
                .any(|l| l.contains("\"client\":\"198.51.100.7\""))
        },
    )
    .await;
    assert!(
        !p.stderr()
            .lines()
            .any(|l| l.contains("/x/untrusted") && l.contains("198.51.100.7")),
        "an untrusted peer named the client"
    );
}

/// On the TLS listener the header comes first, in clear, then TLS.
#[tokio::test(flavor = "multi_thread")]
async fn the_tls_listener_reads_the_header_before_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let ca = common::tls::TestCa::new(dir.path(), "ca");
    let leaf = ca.server("server");
    let config = dir.path().join("fencegate.toml");
    std::fs::write(
        &config,
        format!(
            "trusted_proxies = [\"{BALANCER}\"]\n[tls]\nlisten = \"127.0.0.1:0\"\ncert = \"{}\"\nkey = \"{}\"\nproxy_protocol = true\n[[routes]]\nupstream = \"{}\"\n",
            leaf.cert.display(),
            leaf.key.display(),
            up.url()
        ),
    )
    .unwrap();
    let p = ProxyBuilder::with_config(&config, dir.path()).spawn();
    let tls_addr = p.tls.expect("a TLS listener");
    let connector = tokio_rustls::TlsConnector::from(common::tls::client_config(&ca.pem));
    let over_tls = |prefix: Vec<u8>, path: &'static str| {
        let connector = connector.clone();
        async move {
            let mut s = connect_from(BALANCER, tls_addr).await;
            s.write_all(&prefix).await.unwrap();
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let Ok(mut tls) = connector.connect(name, s).await else {
                return String::new();
            };
            let req = format!("PUT {path} HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx");
            tls.write_all(req.as_bytes()).await.unwrap();
            let mut answer = Vec::new();
            let _ = tls.read_to_end(&mut answer).await;
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    let a = over_tls(v2_header("198.51.100.20:6000"), "/tls/v2").await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(forwarded_for(&up, "/tls/v2"), "198.51.100.20");
    // TLS straight away, without the header: closed.
    assert_eq!(over_tls(Vec::new(), "/tls/none").await, "");
    assert!(up.records().iter().all(|r| r.target != "/tls/none"));
}
