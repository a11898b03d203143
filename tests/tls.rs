//! TLS on both sides: the TLS listener (ALPN h2 and http/1.1, client
//! certificates, certificate reload) and https upstreams (verification,
//! private CA, SNI, client certificate, HTTP/2). Certificates are generated
//! per test.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::tls::*;
use common::*;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One request with a chosen client; `Err` if the connection or handshake
/// failed.
async fn send_via(
    client: &HttpsClient,
    method: &str,
    url: &str,
    token: Option<&str>,
) -> Result<(http::Version, Answer), String> {
    let mut req = http::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        req = req.header("x-fence-token", t);
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(20),
        // GET and HEAD have no body (fencegate refuses one: a backend
        // that does not read it would take it as another request).
        client.request(
            req.body(full(if matches!(method, "GET" | "HEAD") {
                ""
            } else {
                "tls body"
            }))
            .unwrap(),
        ),
    )
    .await
    .map_err(|_| "timed out".to_string())?
    .map_err(|e| format!("{e:?}"))?;
    let version = resp.version();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((
        version,
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        },
    ))
}

fn tls_args(leaf: &Leaf) -> Vec<String> {
    vec![
        "--tls-listen".into(),
        "127.0.0.1:0".into(),
        "--tls-cert".into(),
        leaf.cert.display().to_string(),
        "--tls-key".into(),
        leaf.key.display().to_string(),
    ]
}

/// fencegate with a TLS listener (a certificate from a CA made in `dir`)
/// in front of `up`, with `extra` flags.
fn with_tls_listener(dir: &std::path::Path, up: &Upstream, extra: &[&str]) -> (TestCa, Proxy) {
    let ca = TestCa::new(dir, "ca");
    let leaf = ca.server("proxy");
    let args = tls_args(&leaf);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = ProxyBuilder::new(&up.url(), dir)
        .args(&args)
        .args(extra)
        .spawn();
    (ca, p)
}

/// A TLS connection to `p`'s TLS listener, trusting `ca`.
async fn tls_connect(
    p: &Proxy,
    ca: &TestCa,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let connector = tokio_rustls::TlsConnector::from(client_config(&ca.pem));
    let tcp = tokio::net::TcpStream::connect(p.tls.expect("a TLS listener"))
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await.unwrap()
}

fn https(p: &Proxy, path: &str) -> String {
    format!("https://{}{}", p.tls.expect("a TLS listener"), path)
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_listener_fences_the_same_over_http1_and_h2() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let (ca, p) = with_tls_listener(dir.path(), &up, &[]);

    assert_eq!(listening_sockets(p.child.id()), 3, "plain, TLS and admin");
    let h1 = https_client(&ca.pem, None, Alpn::Http1);
    let h2 = https_client(&ca.pem, None, Alpn::H2);
    let (v, a) = send_via(&h1, "PUT", &https(&p, "/a/obj"), Some("5"))
        .await
        .unwrap();
    assert_eq!((v, a.status.as_u16()), (http::Version::HTTP_11, 200));
    // The same key spelled differently, over h2: the same refusal.
    let (v, a) = send_via(&h2, "PUT", &https(&p, "/a/%6Fbj"), Some("4"))
        .await
        .unwrap();
    assert_eq!(v, http::Version::HTTP_2);
    assert_eq!(a.status, 409, "{}", a.text());
    assert_eq!(a.header("x-fence-token-highest"), Some("5"));
    assert_eq!(a.header("content-type"), Some("application/problem+json"));
    let (_, a) = send_via(&h2, "PUT", &https(&p, "/a/obj"), None)
        .await
        .unwrap();
    assert_eq!(a.status, 428);
    let (_, a) = send_via(&h2, "PUT", &https(&p, "/a/../obj"), Some("9"))
        .await
        .unwrap();
    assert_eq!(a.status, 400);
    let (_, a) = send_via(&h2, "PUT", &https(&p, "/a/obj"), Some("6"))
        .await
        .unwrap();
    assert_eq!(a.status, 200);
    let (_, a) = send_via(&h2, "GET", &https(&p, "/a/obj"), None)
        .await
        .unwrap();
    assert_eq!(a.body, Bytes::from("applied GET /a/obj len=0"));

    let r = up.records();
    assert_eq!(
        r.len(),
        3,
        "two admitted writes and a read reached the backend"
    );
    assert_eq!(r[0].target, "/a/obj");
    assert_eq!(r[1].target, "/a/obj");
    assert_eq!(r[0].headers["x-forwarded-proto"], "https");
    assert_eq!(r[1].headers["x-forwarded-proto"], "https");
    // The plain listener still serves (and says http).
    assert_eq!(put(&p.url("/a/obj"), "6").await.status, 200);
    assert_eq!(up.records()[3].headers["x-forwarded-proto"], "http");
    // The certificate's notAfter (rcgen's default, 4096-01-01) is exported
    // for expiry alerts.
    assert_eq!(
        metric(&p, "fencegate_tls_certificate_expiry_timestamp_seconds ").await,
        Some(67_090_118_400.0)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn client_certificates_are_required_when_a_client_ca_is_set() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "ca");
    let clients = TestCa::new(dir.path(), "clients");
    let strangers = TestCa::new(dir.path(), "strangers");
    let up = start_upstream().await;
    let mut args = tls_args(&ca.server("proxy"));
    args.extend(["--tls-client-ca".into(), clients.pem.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = ProxyBuilder::new(&up.url(), dir.path()).args(&args).spawn();

    let url = https(&p, "/k");
    let anonymous = https_client(&ca.pem, None, Alpn::Http1);
    assert!(send_via(&anonymous, "PUT", &url, Some("1")).await.is_err());
    let stranger = strangers.client("stranger");
    let wrong = https_client(&ca.pem, Some(&stranger), Alpn::H2);
    assert!(send_via(&wrong, "PUT", &url, Some("1")).await.is_err());
    assert_eq!(up.arrivals(), 0, "nothing from an unauthenticated client");
    let failures = metric(
        &p,
        "fencegate_tls_handshake_failures_total{reason=\"error\"}",
    )
    .await;
    assert!(
        failures >= Some(2.0),
        "refused handshakes are counted: {failures:?}"
    );

    let member = clients.client("member");
    for alpn in [Alpn::Http1, Alpn::H2] {
        let good = https_client(&ca.pem, Some(&member), alpn);
        let (_, a) = send_via(&good, "PUT", &url, Some("1")).await.unwrap();
        assert_eq!(a.status, 200);
    }
    // A client that does not trust fencegate's certificate never sends.
    let distrustful = https_client(&strangers.pem, Some(&member), Alpn::Http1);
    assert!(send_via(&distrustful, "PUT", &url, Some("2"))
        .await
        .is_err());
    assert_eq!(up.count(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_plain_listener_can_be_turned_off() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "ca");
    let up = start_upstream().await;
    let args = tls_args(&ca.server("proxy"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .listen("off")
        .args(&args)
        .spawn();
    assert!(!p.plain, "stdout says proxy=off");
    assert_eq!(
        listening_sockets(p.child.id()),
        2,
        "only the TLS and admin listeners"
    );
    let (_, a) = send_via(
        &https_client(&ca.pem, None, Alpn::Http1),
        "PUT",
        &https(&p, "/k"),
        Some("1"),
    )
    .await
    .unwrap();
    assert_eq!(a.status, 200);
    assert_eq!(up.count(), 1);
}

/// A TLS connection kept open by hand, to show a reload does not drop it.
struct KeptConnection(tokio_rustls::client::TlsStream<tokio::net::TcpStream>);

impl KeptConnection {
    async fn open(addr: std::net::SocketAddr, ca: &std::path::Path) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .unwrap();
        Self(tls)
    }

    /// A keep-alive GET; returns the status line.
    async fn get(&mut self, path: &str) -> String {
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
        self.0.write_all(req.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        // The recording upstream's GET answer ends with `len=0`.
        while !got.ends_with(b"len=0") {
            let n = tokio::time::timeout(Duration::from_secs(10), self.0.read(&mut buf))
                .await
                .expect("answer on the kept connection")
                .unwrap();
            assert!(n > 0, "the kept connection was closed");
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got)
            .lines()
            .next()
            .unwrap()
            .to_string()
    }
}

/// Replaces `to`'s files with `from`'s, each by an atomic rename (key
/// first, as cert-manager and certbot hooks commonly do).
fn copy_leaf(from: &Leaf, to: &Leaf) {
    for (src, dst) in [(&from.key, &to.key), (&from.cert, &to.cert)] {
        let tmp = dst.with_extension("incoming");
        std::fs::copy(src, &tmp).unwrap();
        std::fs::rename(&tmp, dst).unwrap();
    }
}

/// A config with a TLS listener serving `leaf` and one route to `up`.
fn tls_config(leaf: &Leaf, watch_interval: &str, up: &Upstream) -> String {
    format!(
        "[tls]\nlisten = \"127.0.0.1:0\"\ncert = \"{}\"\nkey = \"{}\"\nwatch_interval = \"{watch_interval}\"\n\n[[routes]]\nupstream = \"{}\"\n",
        leaf.cert.display(),
        leaf.key.display(),
        up.url()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn certificates_reload_when_the_files_change() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = TestCa::new(dir.path(), "old-ca");
    let new_ca = TestCa::new(dir.path(), "new-ca");
    let live = old_ca.server("live");
    let up = start_upstream().await;
    let config = dir.path().join("fencegate.toml");
    write_config(&config, &tls_config(&live, "100ms", &up));
    let mut p = ProxyBuilder::with_config(&config, dir.path()).spawn();
    let url = https(&p, "/r");
    let trusts_old = https_client(&old_ca.pem, None, Alpn::Http1);
    let trusts_new = https_client(&new_ca.pem, None, Alpn::Http1);
    assert!(send_via(&trusts_old, "GET", &url, None).await.is_ok());
    assert!(send_via(&trusts_new, "GET", &url, None).await.is_err());
    let mut kept = KeptConnection::open(p.tls.unwrap(), &old_ca.pem).await;
    assert!(kept.get("/kept").await.contains("200"));

    // The files change: new connections get the new certificate, the open
    // one goes on.
    copy_leaf(&new_ca.server("next"), &live);
    eventually_async("the new certificate served", || async {
        https_client(&new_ca.pem, None, Alpn::Http1)
            .request(http::Request::get(&url).body(full("")).unwrap())
            .await
            .is_ok()
    })
    .await;
    assert!(kept.get("/kept").await.contains("200"));
    let fresh_old = https_client(&old_ca.pem, None, Alpn::Http1);
    assert!(send_via(&fresh_old, "GET", &url, None).await.is_err());

    // A broken file is refused and the running certificate stays. (The
    // watcher may also have caught the key renamed before the cert: count
    // from here.)
    let tls_errors = "fencegate_reloads_total{result=\"error\",what=\"tls\"}";
    let before = metric(&p, tls_errors).await.unwrap_or(0.0);
    std::fs::write(&live.cert, "not a certificate").unwrap();
    eventually_async("the failed reload counted", || async {
        metric(&p, tls_errors).await.unwrap_or(0.0) > before
    })
    .await;
    assert_eq!(
        metric(&p, "fencegate_last_reload_successful{what=\"tls\"}").await,
        Some(0.0)
    );
    let fresh_new = https_client(&new_ca.pem, None, Alpn::H2);
    assert_eq!(
        send_via(&fresh_new, "GET", &url, None)
            .await
            .unwrap()
            .1
            .status,
        200
    );
    let log = p.stderr();
    assert!(
        log.contains("TLS certificates not reloaded") && log.contains("holds no PEM certificate"),
        "the broken file is named in the log: {log}"
    );

    assert!(p.sigterm().success());
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_reloads_certificates_without_dropping_connections() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = TestCa::new(dir.path(), "old-ca");
    let new_ca = TestCa::new(dir.path(), "new-ca");
    let first = old_ca.server("first");
    let up = start_upstream().await;
    let config = dir.path().join("fencegate.toml");
    // Checked hourly: only SIGHUP reloads within this test.
    let with_leaf = |leaf: &Leaf| tls_config(leaf, "1h", &up);
    write_config(&config, &with_leaf(&first));
    let mut p = ProxyBuilder::with_config(&config, dir.path()).spawn();
    let url = https(&p, "/r");
    let mut kept = KeptConnection::open(p.tls.unwrap(), &old_ca.pem).await;
    assert!(kept.get("/kept").await.contains("200"));
    let config_ok = "fencegate_reloads_total{result=\"ok\",what=\"config\"}";

    // New contents under the same paths: served after SIGHUP, not before.
    copy_leaf(&new_ca.server("second"), &first);
    let trusts = |ca: &TestCa| https_client(&ca.pem, None, Alpn::H2);
    assert!(send_via(&trusts(&old_ca), "GET", &url, None).await.is_ok());
    signal(p.child.id(), "HUP");
    eventually_async("SIGHUP reload", || async {
        metric(&p, config_ok).await == Some(1.0)
    })
    .await;
    assert!(send_via(&trusts(&new_ca), "GET", &url, None).await.is_ok());
    assert!(send_via(&trusts(&old_ca), "GET", &url, None).await.is_err());

    // The config names other files: they are loaded and served.
    write_config(&config, &with_leaf(&old_ca.server("third")));
    signal(p.child.id(), "HUP");
    eventually_async("second SIGHUP reload", || async {
        metric(&p, config_ok).await == Some(2.0)
    })
    .await;
    assert!(send_via(&trusts(&old_ca), "GET", &url, None).await.is_ok());
    assert!(
        kept.get("/kept").await.contains("200"),
        "the open connection survived both reloads"
    );
    assert_eq!(
        metric(&p, "fencegate_last_reload_successful{what=\"config\"}").await,
        Some(1.0)
    );
    assert!(p.sigterm().success());
}

#[tokio::test(flavor = "multi_thread")]
async fn https_upstream_with_a_private_ca_gets_sni_and_http1_unless_h2_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "upstream-ca");
    // The upstream offers h2 and http/1.1.
    let (up, conns) = start_tls_upstream(&ca.server("upstream"), None, true).await;
    let ca_path = ca.pem.display().to_string();
    let p = ProxyBuilder::new(&up.https_url(), dir.path())
        .args(&["--upstream-ca", &ca_path])
        .spawn();
    assert_eq!(put(&p.url("/o"), "7").await.status, 200);
    let stale = put(&p.url("/o"), "6").await;
    assert_eq!(stale.status, 409);
    let read = send("GET", &p.url("/o"), &[], "").await;
    assert_eq!(read.status, 200);
    assert_eq!(read.text(), "applied GET /o len=0");
    assert_eq!(up.count(), 2, "the stale write never reached the upstream");
    // HTTP/1.1 by default, with the client's Host relayed as sent.
    assert_eq!(up.records()[0].headers["host"], p.addr.to_string().as_str());
    let seen = conns.lock().unwrap().clone();
    assert!(!seen.is_empty());
    for c in &seen {
        assert_eq!(c.sni.as_deref(), Some("localhost"));
        assert_eq!(c.alpn.as_deref(), Some("http/1.1"));
    }

    // upstream_http2 = true: h2 when the upstream offers it.
    let dir2 = tempfile::tempdir().unwrap();
    let config = dir2.path().join("h2.toml");
    write_config(
        &config,
        &format!(
            "[[routes]]\nupstream = \"{}\"\nupstream_ca = \"{ca_path}\"\nupstream_http2 = true\n",
            up.https_url()
        ),
    );
    let p2 = ProxyBuilder::with_config(&config, dir2.path()).spawn();
    conns.lock().unwrap().clear();
    assert_eq!(put(&p2.url("/o"), "8").await.status, 200);
    assert_eq!(put(&p2.url("/o"), "7").await.status, 409);
    let seen = conns.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].alpn.as_deref(), Some("h2"));
    assert_eq!(seen[0].sni.as_deref(), Some("localhost"));
    assert_eq!(up.count(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ip_literal_https_upstream_is_verified_by_its_ip_address() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "upstream-ca");
    let (up, conns) = start_tls_upstream(&ca.server("upstream"), None, false).await;
    let ca_path = ca.pem.display().to_string();
    let p = ProxyBuilder::new(&format!("https://{}", up.addr), dir.path())
        .args(&["--upstream-ca", &ca_path])
        .spawn();
    assert_eq!(put(&p.url("/o"), "1").await.status, 200);
    // No SNI for an IP address (RFC 6066); the certificate's IP SAN matched.
    assert_eq!(conns.lock().unwrap()[0].sni, None);

    // From the same CA, certificates that do not name 127.0.0.1 by IP: a
    // DNS name only (even one that resolves to it), or another address.
    for (file, names) in [
        ("dns-only", &["localhost"][..]),
        ("other-ip", &["localhost", "127.0.0.2"]),
    ] {
        let (up, _) = start_tls_upstream(&ca.server_for(file, names), None, false).await;
        let d = tempfile::tempdir().unwrap();
        let p = ProxyBuilder::new(&format!("https://{}", up.addr), d.path())
            .args(&["--upstream-ca", &ca_path])
            .spawn();
        let a = put(&p.url("/o"), "1").await;
        assert_eq!(a.status, 502, "{file}: {}", a.text());
        assert_eq!(
            up.arrivals(),
            0,
            "{file}: the write reached an unverified upstream"
        );
        assert!(
            p.stderr().contains("invalid peer certificate"),
            "{file}: {}",
            p.stderr()
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn untrusted_upstream_certificate_is_a_502_with_a_clear_log() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "self-signed");
    let (up, _) = start_tls_upstream(&ca.server("upstream"), None, true).await;
    // Verified against the "system" roots, which do not know this CA: here
    // a bundle of another CA, so the test does not depend on the host's
    // store (rustls-native-certs reads SSL_CERT_FILE like OpenSSL).
    let system = TestCa::new(dir.path(), "public-ca");
    let p = ProxyBuilder::new(&up.https_url(), dir.path())
        .env("SSL_CERT_FILE", &system.pem.display().to_string())
        .spawn();
    let a = put(&p.url("/o"), "1").await;
    assert_eq!(a.status, 502, "{}", a.text());
    assert_eq!(a.header("content-type"), Some("application/problem+json"));
    assert_eq!(up.arrivals(), 0);
    let log = p.stderr();
    assert!(
        log.contains("invalid peer certificate") && log.contains("UnknownIssuer"),
        "the log says why: {log}"
    );
    assert!(
        log.contains("give the CA that signed it as upstream_ca (--upstream-ca)"),
        "and what to do: {log}"
    );
    assert!(
        !a.text().contains("UnknownIssuer") && !a.text().contains("upstream_ca"),
        "the client is told no more than that: {}",
        a.text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ca_certificate_served_as_the_upstreams_own_gets_advice() {
    // `openssl req -x509` without `-addext basicConstraints=CA:FALSE`:
    // trusted as upstream_ca, but rustls refuses a CA certificate as the
    // server's own (CaUsedAsEndEntity). The log says what to do; the
    // client gets a plain 502.
    let dir = tempfile::tempdir().unwrap();
    let cert = self_signed_ca_as_server(dir.path(), "openssl-x509");
    let (up, _) = start_tls_upstream(&cert, None, true).await;
    let p = ProxyBuilder::new(&up.https_url(), dir.path())
        .args(&["--upstream-ca", &cert.cert.display().to_string()])
        .spawn();
    let a = put(&p.url("/o"), "1").await;
    assert_eq!(a.status, 502, "{}", a.text());
    assert_eq!(up.arrivals(), 0);
    assert_eq!(
        a.json()["detail"],
        "cannot connect to the upstream (fencegate's log has the cause)"
    );
    let log = p.stderr();
    assert!(
        log.contains("CaUsedAsEndEntity")
            && log.contains("presents a CA certificate")
            && log.contains("basicConstraints=critical,CA:FALSE"),
        "the log says why and what to do: {log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_client_certificate_and_http1_only_upstreams() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "upstream-ca");
    let clients = TestCa::new(dir.path(), "clients");
    let (up, conns) = start_tls_upstream(&ca.server("upstream"), Some(&clients.pem), false).await;
    let ca_path = ca.pem.display().to_string();
    let without = ProxyBuilder::new(&up.https_url(), dir.path())
        .args(&["--upstream-ca", &ca_path])
        .spawn();
    assert_eq!(put(&without.url("/o"), "1").await.status, 502);
    assert_eq!(up.arrivals(), 0);

    let leaf = clients.client("fencegate");
    let dir2 = tempfile::tempdir().unwrap();
    let with = ProxyBuilder::new(&up.https_url(), dir2.path())
        .args(&[
            "--upstream-ca",
            &ca_path,
            "--upstream-client-cert",
            &leaf.cert.display().to_string(),
            "--upstream-client-key",
            &leaf.key.display().to_string(),
        ])
        .spawn();
    assert_eq!(put(&with.url("/o"), "1").await.status, 200);
    let conns = conns.lock().unwrap().clone();
    let used = conns.last().unwrap();
    assert!(used.client_cert);
    assert_eq!(used.alpn.as_deref(), Some("http/1.1"));
    assert_eq!(up.count(), 1);
}

/// An upstream that answers every request on a connection with `len`
/// bytes of `x` (Content-Length), whatever was asked.
async fn start_big_upstream(len: usize) -> Upstream {
    start_upstream_with(move |mut s, _| {
        Box::pin(async move {
            let mut buf = Vec::new();
            loop {
                let mut chunk = [0u8; 4096];
                let Ok(n) = s.read(&mut chunk).await else {
                    return;
                };
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
                while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    buf.drain(..end + 4);
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n\r\n");
                    if s.write_all(head.as_bytes()).await.is_err()
                        || s.write_all(&vec![b'x'; len]).await.is_err()
                    {
                        return;
                    }
                }
            }
        })
    })
    .await
}

/// Reads one answer with a Content-Length body from `s`, slowly (a
/// client on a slow link), and returns its body's length.
async fn read_answer_slowly<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut Vec<u8>,
) -> usize {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            assert!(head.starts_with("http/1.1 200"), "{head}");
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .expect("a content-length")
                .trim()
                .parse()
                .unwrap();
            while buf.len() < end + 4 + len {
                let mut chunk = vec![0u8; 16 * 1024];
                let n = s.read(&mut chunk).await.unwrap();
                assert!(
                    n > 0,
                    "the connection ended {} bytes short",
                    end + 4 + len - buf.len()
                );
                buf.extend_from_slice(&chunk[..n]);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            buf.drain(..end + 4 + len);
            return len;
        }
        let mut chunk = vec![0u8; 16 * 1024];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the connection ended before an answer");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// The TLS listener's HTTP/1.1 answers reach a slow reader whole, and the
/// connection carries the next request: what TLS holds back until a
/// flush is flushed, not left behind until the idle timeout cuts it.
#[tokio::test(flavor = "multi_thread")]
async fn large_answers_over_tls_reach_a_slow_reader_whole() {
    let dir = tempfile::tempdir().unwrap();
    // More than loopback's socket buffers hold, so that the proxy's last
    // writes meet a full socket.
    let len = 16 << 20;
    let up = start_big_upstream(len).await;
    let (ca, p) = with_tls_listener(dir.path(), &up, &["--header-read-timeout", "30s"]);
    let mut s = tls_connect(&p, &ca).await;
    let mut buf = Vec::new();
    for _ in 0..2 {
        s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let got = tokio::time::timeout(
            Duration::from_secs(20),
            read_answer_slowly(&mut s, &mut buf),
        )
        .await
        .expect("the answer stalled: bytes held back by TLS were never flushed");
        assert_eq!(got, len);
    }
}

/// A TLS connection between requests waits on its socket (issue 44: it
/// holds no read buffer then), and still wakes for each thing a client
/// sends: a request right after the handshake, one after a pause, two
/// pipelined in one record, and a close_notify, which ends it. One left
/// idle is closed at the idle timeout, never before.
#[tokio::test(flavor = "multi_thread")]
async fn tls_connections_between_requests_wake_for_whatever_comes() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let (ca, p) = with_tls_listener(dir.path(), &up, &["--header-read-timeout", "3s"]);
    let put = |n: u32| {
        format!("PUT /k HTTP/1.1\r\nHost: x\r\nX-Fence-Token: {n}\r\nContent-Length: 1\r\n\r\nx")
    };
    let opened = tokio::time::Instant::now();
    let mut idle = tls_connect(&p, &ca).await;
    let mut s = tls_connect(&p, &ca).await;
    s.write_all(put(1).as_bytes()).await.unwrap();
    assert_eq!(answers(&mut s, 1).await, ["http/1.1 200 ok"]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.write_all(put(2).as_bytes()).await.unwrap();
    assert_eq!(answers(&mut s, 1).await, ["http/1.1 200 ok"]);
    s.write_all(format!("{}{}", put(2), put(1)).as_bytes())
        .await
        .unwrap();
    assert_eq!(
        answers(&mut s, 2).await,
        ["http/1.1 200 ok", "http/1.1 409 conflict"]
    );
    // close_notify while idle: the proxy ends the connection, well before
    // the idle timeout (3 s, never sooner) would.
    s.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest)).await;
    assert!(ended.is_ok(), "a close_notify did not end the connection");
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(15), idle.read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "the idle connection was not closed: {read:?}"
    );
    assert!(opened.elapsed() >= Duration::from_secs(3));
    let seen: Vec<_> = up.records().iter().map(|r| r.token.clone()).collect();
    assert_eq!(seen.len(), 3, "{seen:?}");
}

/// A client that drips one TLS record a byte at a time never gives the
/// proxy a byte of a request: the connection is idle, and closed at the
/// idle timeout, however long the record takes (progress is counted in
/// plaintext; found by a black-box attack: 20 such connections held a
/// listener's every slot).
#[tokio::test(flavor = "multi_thread")]
async fn a_tls_record_dripped_a_byte_at_a_time_does_not_pin_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let (ca, p) = with_tls_listener(dir.path(), &up, &["--header-read-timeout", "1s"]);
    let mut s = tls_connect(&p, &ca).await;
    let (tcp, _) = s.get_mut();
    let (mut rd, mut wr) = tcp.split();
    // An application-data record of 64 bytes, sent over about 20 s.
    let mut record = vec![0x17, 0x03, 0x03, 0x00, 0x40];
    record.extend([0x55; 64]);
    let drip = async {
        for b in &record {
            if wr.write_all(std::slice::from_ref(b)).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    // Until the end (the session tickets the server sent come first).
    let closed = async {
        let mut buf = [0u8; 4096];
        while matches!(rd.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    tokio::select! {
        () = closed => {}
        () = drip => panic!("the connection outlived a 20 s drip of one record"),
    }
    assert_eq!(
        metric(
            &p,
            "fencegate_connections_closed_total{listener=\"tls\",reason=\"idle\"}"
        )
        .await,
        Some(1.0),
        "{}",
        p.stderr()
    );
}
