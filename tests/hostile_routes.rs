//! Hostile input, round 2: one resource must meet one route and one key
//! whatever its spelling (path escapes, `+`, the host in `Host`, an
//! absolute-form target or HTTP/2's `:authority`), method overrides in the
//! query or a form body, and keys of bounded size. Each case checks the
//! status and that the backend never saw a stale token for the resource.

mod common;

use std::time::Duration;

use common::*;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// fencegate on a config of `routes` (`{u}`: the upstream URL).
async fn with_routes(routes: &str) -> (tempfile::TempDir, Upstream, Proxy) {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let cfg = dir.path().join("routes.toml");
    write_config(&cfg, &routes.replace("{u}", &up.url()));
    let p = ProxyBuilder::with_config(&cfg, dir.path()).spawn();
    (dir, up, p)
}

/// The tokens the backend saw, in arrival order.
fn tokens(up: &Upstream) -> Vec<String> {
    up.records()
        .iter()
        .map(|r| r.token.clone().unwrap_or_default())
        .collect()
}

/// Status code and the whole answer of a raw HTTP/1.1 exchange.
async fn raw_status(p: &Proxy, request: &str) -> (u16, String) {
    let answer = raw(p.addr, request.as_bytes(), Duration::from_secs(2)).await;
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

fn put_raw(target: &str, host: &str, token: u64) -> String {
    format!("PUT {target} HTTP/1.1\r\nHost: {host}\r\nX-Fence-Token: {token}\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx")
}

#[tokio::test(flavor = "multi_thread")]
async fn every_spelling_of_a_literal_name_meets_one_route() {
    let (_d, up, p) = with_routes(
        r#"
[[routes]]
name = "reports"
path_prefix = "/bkt/reports"
upstream = "{u}"
literal_keys = true
namespace = "reports-locks"

[[routes]]
name = "s3"
upstream = "{u}"
literal_keys = true
namespace = "s3"
"#,
    )
    .await;
    let (s, a) = raw_status(&p, &put_raw("/bkt/reports/y.csv", "x", 10)).await;
    assert_eq!(s, 200, "{a}");
    for spelling in [
        "/bkt/reports%2Fy.csv",
        "/bkt/report%73/y.csv",
        "/bkt/%72eports%2fy.csv",
    ] {
        let (s, a) = raw_status(&p, &put_raw(spelling, "x", 5)).await;
        assert_eq!(s, 409, "{spelling}: {a}");
        assert!(a.contains("reports-locks:/bkt/reports/y.csv"), "{a}");
    }
    let (s, a) = raw_status(&p, &put_raw("/bkt/reports//z.csv", "x", 10)).await;
    assert_eq!(s, 200, "{a}");
    // Runs of `/` are one to servers that merge them (SeaweedFS): one key,
    // and a leading `//` meets the same route.
    for spelling in [
        "/bkt/report%73//z.csv",
        "/bkt/reports/z.csv",
        "//bkt/reports/z.csv",
        "/bkt//reports///z.csv/",
        "/bkt%2F%2Freports/z.csv",
        // `\`, raw or encoded, is a `/` to SeaweedFS too.
        "/bkt\\reports\\z.csv",
        "/bkt/reports%5Cz.csv",
    ] {
        let (s, a) = raw_status(&p, &put_raw(spelling, "x", 5)).await;
        assert_eq!(s, 409, "{spelling}: {a}");
        assert!(
            a.contains("reports-locks:/bkt/reports/z.csv"),
            "{spelling}: {a}"
        );
    }
    // Dot segments, which a backend may resolve, are refused.
    for spelling in [
        "/bkt/x/../reports/y.csv",
        "/bkt/%2e%2e/bkt/reports/y.csv",
        "/bkt/./reports/y.csv",
    ] {
        let (s, a) = raw_status(&p, &put_raw(spelling, "x", 11)).await;
        assert_eq!(s, 400, "{spelling}: {a}");
    }
    // `+`, `%2B`, space and `%20` may be one name to the backend.
    let (s, _) = raw_status(&p, &put_raw("/bkt/a+b", "x", 10)).await;
    assert_eq!(s, 200);
    for spelling in ["/bkt/a%2Bb", "/bkt/a%20b"] {
        let (s, a) = raw_status(&p, &put_raw(spelling, "x", 5)).await;
        assert_eq!(s, 409, "{spelling}: {a}");
    }
    // A path parameter that changes no route is part of an S3 name.
    let (s, a) = raw_status(&p, &put_raw("/bkt/x;y", "x", 10)).await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(
        tokens(&up),
        ["10", "10", "10", "10"],
        "a stale spelling reached the backend"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_canonical_route_is_not_bypassed_through_a_literal_catch_all() {
    // The catch-all first: routes are tried most specific first, whatever
    // their order in the file.
    let (_d, up, p) = with_routes(
        r#"
[[routes]]
name = "s3"
upstream = "{u}"
literal_keys = true
namespace = "s3"

[[routes]]
name = "api"
path_prefix = "/bkt/api"
upstream = "{u}"
"#,
    )
    .await;
    let (s, _) = raw_status(&p, &put_raw("/bkt/api/x", "x", 10)).await;
    assert_eq!(s, 200);
    let (s, a) = raw_status(&p, &put_raw("/bkt/api/x", "x", 9)).await;
    assert_eq!(s, 409, "{a}");
    assert!(
        a.contains("\"default:/bkt/api/x\""),
        "the api route took it: {a}"
    );
    for spelling in [
        "/bkt/api%2Fx",
        "/bkt/ap%69%2fx",
        "/bkt/api//x",
        "//bkt/api/x",
        "/bkt//api/x",
        // Read as /bkt/api/x by a backend that takes `\` for `/` or drops
        // path parameters (Tomcat, Jetty, Spring).
        "/bkt\\api\\x",
        "/bkt/api%5Cx",
        "/bkt/api;/x",
        "/bkt/api;jsessionid=1/x",
        "/bkt/;/api/x",
        "/bkt/;x/api/x",
        "/bkt/%3Bx/api/x",
    ] {
        let (s, a) = raw_status(&p, &put_raw(spelling, "x", 5)).await;
        assert_eq!(s, 400, "{spelling}: {a}");
        assert!(a.contains("application/problem+json"), "{a}");
    }
    assert_eq!(tokens(&up), ["10"]);
}

const V6_ROUTES: &str = r#"
[[routes]]
name = "v6"
host = "::1"
upstream = "{u}"
namespace = "v6"

[[routes]]
name = "other"
upstream = "{u}"
namespace = "other"
"#;

#[tokio::test(flavor = "multi_thread")]
async fn one_authority_parse_for_host_absolute_form_and_h2() {
    let (_d, up, p) = with_routes(V6_ROUTES).await;
    let port = p.addr.port();
    let host = format!("[::1]:{port}");
    let (s, a) = raw_status(&p, &put_raw("/v6b", &host, 20)).await;
    assert_eq!(s, 200, "{a}");
    // The same authority in an absolute-form target: same route, same key.
    let absolute = format!("http://[::1]:{port}/v6b");
    let (s, a) = raw_status(&p, &put_raw(&absolute, &host, 7)).await;
    assert_eq!(s, 409, "{a}");
    assert!(a.contains("v6:/v6b"), "{a}");
    // And in HTTP/2's :authority. The connection goes to 127.0.0.1 while the
    // request names [::1], so the case needs no IPv6 on the machine (curl
    // refuses an IPv6 literal where IPv6 is off, whatever --connect-to says).
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .expect("h2c handshake");
    tokio::spawn(conn);
    let req = http::Request::put(format!("http://[::1]:{port}/v6b"))
        .header("x-fence-token", "7")
        .header("content-length", "1")
        .body(full("x"))
        .unwrap();
    let resp = h2.send_request(req).await.expect("h2 request");
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 409);
    // User info is refused in either place.
    let (s, _) = raw_status(&p, &put_raw("/v6b", &format!("u@{host}"), 30)).await;
    assert_eq!(s, 400);
    let (s, _) = raw_status(
        &p,
        &put_raw(&format!("http://u@[::1]:{port}/v6b"), &host, 30),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(tokens(&up), ["20"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_host_headers_or_connection_host_are_refused() {
    let (_d, up, p) = with_routes(V6_ROUTES).await;
    let port = p.addr.port();
    let two = format!(
        "PUT /h HTTP/1.1\r\nHost: [::1]:{port}\r\nHost: other.example\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n"
    );
    let (s, a) = raw_status(&p, &two).await;
    assert_eq!(s, 400, "{a}");
    let conn = "PUT /h HTTP/1.1\r\nHost: x\r\nConnection: host\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n";
    let (s, a) = raw_status(&p, conn).await;
    assert_eq!(s, 400, "{a}");
    assert_eq!(up.arrivals(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn method_overrides_in_the_query_or_a_form_body_are_writes() {
    let (_d, up, p) = with_routes(
        r#"
[[routes]]
name = "orders"
path_prefix = "/orders"
upstream = "{u}"
key = "/orders/{tenant}/{id}"
write_methods = ["PUT", "PATCH", "DELETE"]
"#,
    )
    .await;
    // A plain POST is a read on this route.
    let a = send("POST", &p.url("/orders/acme/42/search"), &[], "{}").await;
    assert_eq!(a.status, 200);
    for target in [
        "/orders/acme/42?_method=DELETE",
        "/orders/acme/42?x=1&_method=delete",
        "/orders/acme/42?%5Fmethod=PUT",
        // Array and `;` spellings, as PHP, older Rack and Go parse them.
        "/orders/acme/42?_method[]=PUT",
        "/orders/acme/42?_method%5B0%5D=DELETE",
        "/orders/acme/42?a=1;_method=PUT",
    ] {
        let a = send("POST", &p.url(target), &[], "").await;
        assert_eq!(a.status, 428, "{target}: {}", a.text());
    }
    let a = send("POST", &p.url("/orders/acme/42?_method=%FF"), &[], "").await;
    assert_eq!(a.status, 400, "{}", a.text());
    // `_method` may be in a form body, which fencegate does not read.
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let a = send("POST", &p.url("/orders/acme/42"), &form, "_method=DELETE").await;
    assert_eq!(a.status, 428, "{}", a.text());
    let a = send(
        "POST",
        &p.url("/orders/acme/42"),
        &[
            ("content-type", "multipart/form-data; boundary=x"),
            ("x-fence-token", "3"),
        ],
        "--x--",
    )
    .await;
    assert_eq!(a.status, 200, "fenced, then forwarded: {}", a.text());
    let r = up.records();
    assert_eq!(
        r.len(),
        2,
        "only the plain POST and the fenced form reached the backend"
    );
    assert_eq!(r[1].token.as_deref(), Some("3"));
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_are_bounded_and_get_on_chunked_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--max-key-bytes", "256"])
        .spawn();
    let long = format!("/{}", "k".repeat(300));
    let a = put(&p.url(&long), "1").await;
    assert_eq!(a.status, 414, "{}", a.text());
    assert_eq!(a.json()["type"], "urn:fencegate:problem:key-too-long");
    // The bound counts the whole key, namespace and separator included:
    // `default:` and a 248-byte path are 256 bytes, one more is too long.
    let at_limit = format!("/{}", "k".repeat(247));
    assert_eq!(put(&p.url(&at_limit), "1").await.status, 200);
    let over = format!("/{}", "k".repeat(248));
    let a = put(&p.url(&over), "1").await;
    assert_eq!(a.status, 414, "one byte over the bound: {}", a.text());
    let chunked =
        "GET /g HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n";
    let (s, a) = raw_status(&p, chunked).await;
    assert_eq!(s, 400, "{a}");
    assert_eq!(up.arrivals(), 1);
}

/// Reads until the peer closes; `true` if it did within `within`.
async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_without_progress_are_closed_and_capped() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--header-read-timeout", "1s", "--max-connections", "4"])
        .spawn();
    let connect = || tokio::net::TcpStream::connect(p.addr);
    // Nothing at all; half an HTTP/2 preface; a preface and settings with
    // no stream; an HTTP/2 HEADERS frame that never ends.
    let mut silent = connect().await.unwrap();
    let mut half = connect().await.unwrap();
    half.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    let mut preface = connect().await.unwrap();
    preface
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut headers = connect().await.unwrap();
    headers
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00\x10\x01\x00\x00\x00\x00\x01")
        .await
        .unwrap();
    // The listener is full: a fifth connection is closed at once. (Each
    // worker accepts from a socket of its own: the four must be accepted
    // before the fifth arrives, or a worker may take the fifth first.)
    eventually_async("four connections accepted", || async {
        metric(&p, "fencegate_connections{listener=\"proxy\"}").await == Some(4.0)
    })
    .await;
    let mut fifth = connect().await.unwrap();
    assert!(closed_within(&mut fifth, Duration::from_millis(500)).await);
    for (name, s) in [
        ("silent", &mut silent),
        ("half preface", &mut half),
        ("preface only", &mut preface),
        ("unfinished headers", &mut headers),
    ] {
        assert!(
            closed_within(s, Duration::from_secs(4)).await,
            "{name} was kept open"
        );
    }
    // Room again: a write goes through.
    assert_eq!(put(&p.url("/after"), "1").await.status, 200);
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(
        &m,
        "fencegate_connections_closed_total{listener=\"proxy\",reason=\"limit\"}",
        1.0,
    );
    assert_series(
        &m,
        "fencegate_connections_closed_total{listener=\"proxy\",reason=\"idle\"}",
        4.0,
    );
    assert!(
        m.contains("fencegate_connections{listener=\"proxy\"}"),
        "{m}"
    );
    assert_eq!(up.arrivals(), 1);
}

/// Under a small descriptor limit, a flood of idle connections cannot keep
/// a real write out: the listener takes only what the limit leaves room for
/// (closing the rest at once), and the idle ones it took are closed within
/// the header timeout.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_flood_under_a_small_descriptor_limit_does_not_starve_writes() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--header-read-timeout", "1s"])
        .nofile(200)
        .spawn();
    let mut idle = Vec::new();
    for _ in 0..250 {
        if let Ok(s) = tokio::net::TcpStream::connect(p.addr).await {
            idle.push(s);
        }
    }
    // Within a few header timeouts the write goes through (bounded: 50
    // tries, 100 ms apart), and the process is still serving.
    let mut status = 0;
    for _ in 0..50 {
        // A connection closed at once (the listener is full) is an error
        // here, not a panic: the client retries.
        let req = http::Request::put(p.url("/real"))
            .header("x-fence-token", "1")
            .body(full("x"))
            .unwrap();
        if let Ok(Ok(a)) = tokio::time::timeout(Duration::from_secs(2), client().request(req)).await
        {
            status = a.status().as_u16();
            if status == 200 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, 200, "{}", p.stderr());
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    let limited: f64 = m
        .lines()
        .find(|l| {
            l.starts_with("fencegate_connections_closed_total{listener=\"proxy\",reason=\"limit\"}")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(limited >= 200.0, "{limited} closed for the limit\n{m}");
    drop(idle);
}
