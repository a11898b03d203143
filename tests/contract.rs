//! The answers of docs/contract.md, one test per line, against the real
//! binary started with the quick-start flags.

mod common;

use std::time::Duration;

use common::*;

async fn setup() -> (tempfile::TempDir, Upstream, Proxy) {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let proxy = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    (dir, up, proxy)
}

fn assert_problem(a: &Answer, status: u16, kind: &str) {
    assert_eq!(a.status.as_u16(), status, "body: {}", a.text());
    assert_eq!(a.header("content-type"), Some("application/problem+json"));
    let j = a.json();
    assert_eq!(j["status"], status);
    assert_eq!(j["type"], format!("urn:fencegate:problem:{kind}"));
    assert!(j["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(j["detail"].as_str().is_some_and(|t| !t.is_empty()));
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_token_is_428() {
    let (_d, up, p) = setup().await;
    let a = send("PUT", &p.url("/a/obj"), &[], "x").await;
    assert_problem(&a, 428, "missing-token");
    assert_eq!(a.json()["key"], "default:/a/obj");
    assert_eq!(up.arrivals(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_or_repeated_tokens_are_400() {
    let (_d, up, p) = setup().await;
    for bad in [
        "",
        "-1",
        "+1",
        "01",
        "1e3",
        "0x1",
        "1 2",
        "18446744073709551616",
        "1.5",
    ] {
        let a = send("PUT", &p.url("/k"), &[("x-fence-token", bad)], "x").await;
        assert_problem(&a, 400, "malformed-token");
    }
    let a = send("PUT", &p.url("/k"), &[("x-fence-token", "1,2")], "x").await;
    assert_problem(&a, 400, "malformed-token");
    let a = send(
        "PUT",
        &p.url("/k"),
        &[("x-fence-token", "1"), ("x-fence-token", "1")],
        "x",
    )
    .await;
    assert_problem(&a, 400, "malformed-token");
    // Values a client library refuses to send: non-ASCII digits.
    for value in ["\u{FF11}", "\u{0661}", "1\u{00A0}"] {
        let req = format!(
            "PUT /k HTTP/1.1\r\nHost: x\r\nX-Fence-Token: {value}\r\nContent-Length: 0\r\n\r\n"
        );
        let out = raw(p.addr, req.as_bytes(), Duration::from_secs(2)).await;
        assert!(out.starts_with("HTTP/1.1 400"), "{value:?}: {out}");
    }
    assert_eq!(up.arrivals(), 0, "no refused write reached the backend");
}

#[tokio::test(flavor = "multi_thread")]
async fn full_u64_range_and_whitespace() {
    let (_d, up, p) = setup().await;
    assert_eq!(put(&p.url("/k"), "0").await.status, 200);
    assert_eq!(
        put(&p.url("/k"), " 18446744073709551615\t").await.status,
        200
    );
    let a = put(&p.url("/k"), "18446744073709551614").await;
    assert_problem(&a, 409, "stale-token");
    assert_eq!(
        a.header("x-fence-token-highest"),
        Some("18446744073709551615")
    );
    assert_eq!(a.json()["highest"], "18446744073709551615");
    assert_eq!(up.count(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn stale_is_409_equal_and_higher_are_admitted() {
    let (_d, up, p) = setup().await;
    assert_eq!(put(&p.url("/a/obj"), "5").await.status, 200);
    assert_eq!(
        put(&p.url("/a/obj"), "5").await.status,
        200,
        "equal token admitted"
    );
    let a = put(&p.url("/a/obj"), "4").await;
    assert_problem(&a, 409, "stale-token");
    let j = a.json();
    assert_eq!(j["key"], "default:/a/obj");
    assert_eq!(j["token"], "4");
    assert_eq!(j["highest"], "5");
    assert_eq!(a.header("x-fence-token-highest"), Some("5"));
    assert_eq!(
        put(&p.url("/a/obj"), "6").await.status,
        200,
        "higher token admitted"
    );
    assert_problem(&put(&p.url("/a/obj"), "5").await, 409, "stale-token");
    // Another key has its own highest.
    assert_eq!(put(&p.url("/a/other"), "1").await.status, 200);
    let tokens: Vec<_> = up
        .records()
        .iter()
        .map(|r| r.token.clone().unwrap())
        .collect();
    assert_eq!(
        tokens,
        ["5", "5", "6", "1"],
        "only admitted writes were applied"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_non_safe_method_is_a_write() {
    let (_d, up, p) = setup().await;
    for m in [
        "PUT",
        "POST",
        "PATCH",
        "DELETE",
        "MKCOL",
        "PROPPATCH",
        "LOCK",
        "UNLOCK",
        "put",
        "get",
        "Delete",
        "FROB",
    ] {
        let a = send(m, &p.url("/w"), &[], "").await;
        assert_problem(&a, 428, "missing-token");
    }
    assert_eq!(up.arrivals(), 0);
    for m in ["GET", "HEAD", "OPTIONS"] {
        let a = send(m, &p.url("/w"), &[], "").await;
        assert_eq!(a.status, 200, "{m} is a read");
    }
    assert_eq!(up.count(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn method_override_headers_make_a_write() {
    let (_d, up, p) = setup().await;
    for h in [
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
    ] {
        let a = send("GET", &p.url("/o"), &[(h, "DELETE")], "").await;
        assert_problem(&a, 428, "missing-token");
        let a = send("POST", &p.url("/o"), &[(h, "not a method")], "").await;
        assert_problem(&a, 400, "bad-request");
        // A write method line stays a write whatever the override says.
        let a = send("PUT", &p.url("/o"), &[(h, "GET")], "").await;
        assert_problem(&a, 428, "missing-token");
    }
    assert_eq!(
        up.arrivals(),
        0,
        "an overridden GET never reached the backend"
    );
    let a = send(
        "GET",
        &p.url("/o"),
        &[("x-http-method-override", "DELETE"), ("x-fence-token", "3")],
        "",
    )
    .await;
    assert_eq!(a.status, 200);
    let a = send(
        "GET",
        &p.url("/o"),
        &[("x-http-method-override", "DELETE"), ("x-fence-token", "2")],
        "",
    )
    .await;
    assert_problem(&a, 409, "stale-token");
    // An override to a read keeps a read a read.
    assert_eq!(
        send(
            "GET",
            &p.url("/o"),
            &[("x-http-method-override", "HEAD")],
            ""
        )
        .await
        .status,
        200
    );
    assert_eq!(up.count(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn copy_and_move_fence_the_destination() {
    let (_d, up, p) = setup().await;
    let host = p.addr.to_string();
    let dest = format!("http://{host}/dst");
    assert_eq!(put(&p.url("/dst"), "5").await.status, 200);
    for m in ["COPY", "MOVE"] {
        let a = send(
            m,
            &p.url("/src"),
            &[("destination", &dest), ("x-fence-token", "3")],
            "",
        )
        .await;
        assert_problem(&a, 409, "stale-token");
        assert_eq!(a.json()["key"], "default:/dst");
    }
    let a = send(
        "COPY",
        &p.url("/src"),
        &[("destination", "/d%73t"), ("x-fence-token", "6")],
        "",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    // The backend got the destination in the form it was fenced as.
    let copy = up
        .records()
        .into_iter()
        .find(|r| r.method == "COPY")
        .expect("the COPY was applied");
    assert_eq!(
        copy.headers
            .get("destination")
            .and_then(|v| v.to_str().ok()),
        Some("/dst")
    );
    // Both keys were raised.
    assert_problem(&put(&p.url("/dst"), "5").await, 409, "stale-token");
    assert_problem(&put(&p.url("/src"), "5").await, 409, "stale-token");
    let a = send(
        "MOVE",
        &p.url("/src"),
        &[
            ("destination", "http://elsewhere.example/dst"),
            ("x-fence-token", "7"),
        ],
        "",
    )
    .await;
    assert_problem(&a, 400, "bad-request");
    let a = send(
        "MOVE",
        &p.url("/src"),
        &[("destination", "/a/../dst"), ("x-fence-token", "7")],
        "",
    )
    .await;
    assert_problem(&a, 400, "bad-target");
    assert_eq!(up.count(), 2);
}

/// Only COPY and MOVE fence their `Destination`: another write carrying
/// one is fenced on its own target alone. A destination that another route
/// serves is refused: this route cannot fence it.
#[tokio::test(flavor = "multi_thread")]
async fn only_copy_and_move_fence_a_destination_and_only_on_their_route() {
    let (_d, up, p) = setup().await;
    let a = send(
        "PUT",
        &p.url("/p1"),
        &[("destination", "/p2"), ("x-fence-token", "5")],
        "x",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(
        put(&p.url("/p2"), "1").await.status,
        200,
        "a PUT fenced its Destination"
    );
    assert_eq!(up.count(), 2);
    // A COPY by override fences its Destination like a COPY.
    let a = send(
        "POST",
        &p.url("/o1"),
        &[
            ("x-http-method-override", "COPY"),
            ("destination", "/o2"),
            ("x-fence-token", "5"),
        ],
        "",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_problem(&put(&p.url("/o2"), "4").await, 409, "stale-token");
    assert_eq!(up.count(), 3);

    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let cfg = dir.path().join("routes.toml");
    write_config(&cfg, &two_routes_sharing_keys(&up.url()));
    let p = ProxyBuilder::with_config(&cfg, dir.path()).spawn();
    let a = send(
        "COPY",
        &p.url("/d/slow/x"),
        &[("destination", "/d/y"), ("x-fence-token", "1")],
        "",
    )
    .await;
    assert_problem(&a, 400, "bad-request");
    assert!(a.text().contains("same route"), "{}", a.text());
    assert_eq!(up.arrivals(), 0, "the refused COPY reached the backend");
}

#[tokio::test(flavor = "multi_thread")]
async fn reads_flow_without_a_token_and_ignore_one() {
    let (_d, up, p) = setup().await;
    assert_eq!(put(&p.url("/r"), "9").await.status, 200);
    let a = send("GET", &p.url("/r"), &[("x-fence-token", "1")], "").await;
    assert_eq!(a.status, 200, "a stale token on a read is ignored");
    let a = send("GET", &p.url("/r"), &[("x-fence-token", "garbage")], "").await;
    assert_eq!(a.status, 200);
    assert_eq!(up.count(), 3);
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await.text();
    assert_series(
        &m,
        "fencegate_read_tokens_ignored_total{route=\"default\"}",
        2.0,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_answers_are_relayed_as_they_are() {
    let (_d, up, p) = setup().await;
    for status in ["201", "404", "500", "503"] {
        let a = send(
            "PUT",
            &p.url("/u"),
            &[("x-fence-token", "1"), ("x-test-status", status)],
            "body!",
        )
        .await;
        assert_eq!(a.status.as_str(), status);
        assert_eq!(a.header("x-upstream"), Some("recording"));
        assert_eq!(a.text(), "applied PUT /u len=5");
        assert!(
            a.header("content-type").is_none(),
            "no problem+json on relayed answers"
        );
    }
    let r = &up.records()[0];
    assert_eq!(
        r.token.as_deref(),
        Some("1"),
        "token forwarded unchanged by default"
    );
    assert_eq!(r.body_len, 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn hop_by_hop_headers_are_not_forwarded() {
    let (_d, up, p) = setup().await;
    let a = send(
        "PUT",
        &p.url("/h"),
        &[
            ("x-fence-token", "1"),
            ("connection", "x-private, keep-alive, te"),
            ("x-private", "secret"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic Zm9vOmJhcg=="),
            ("te", "gzip"),
            ("x-end-to-end", "kept"),
            ("authorization", "Bearer end-to-end"),
        ],
        "x",
    )
    .await;
    assert_eq!(a.status, 200);
    let h = &up.records()[0].headers;
    for gone in [
        "x-private",
        "keep-alive",
        "proxy-authorization",
        "te",
        "upgrade",
    ] {
        assert!(h.get(gone).is_none(), "{gone} was forwarded");
    }
    assert_eq!(h.get("x-end-to-end").unwrap(), "kept");
    assert_eq!(h.get("authorization").unwrap(), "Bearer end-to-end");
    assert_eq!(
        h.get("host").unwrap().to_str().unwrap(),
        p.addr.to_string(),
        "Host is relayed as sent"
    );
    // Not even `TE: trailers` goes to an HTTP/1.1 upstream (h2c.rs checks
    // it goes on to an HTTP/2 one).
    for te in ["trailers", "gzip, Trailers", "deflate;q=0.5,trailers"] {
        up.clear();
        let a = send(
            "PUT",
            &p.url("/h"),
            &[("x-fence-token", "2"), ("connection", "te"), ("te", te)],
            "x",
        )
        .await;
        assert_eq!(a.status, 200);
        assert!(up.records()[0].headers.get("te").is_none(), "{te}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn strip_token_route_option() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .arg("--strip-token")
        .spawn();
    assert_eq!(put(&p.url("/s"), "1").await.status, 200);
    assert_eq!(up.records()[0].token, None);
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_unreachable_is_502_and_timeout_is_504_never_retried() {
    let dir = tempfile::tempdir().unwrap();
    // A port with nothing listening.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let p = ProxyBuilder::new(&format!("http://{closed}"), dir.path()).spawn();
    let a = put(&p.url("/x"), "1").await;
    assert_problem(&a, 502, "upstream-unreachable");

    let dir2 = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p2 = ProxyBuilder::new(&up.url(), dir2.path())
        .args(&["--upstream-timeout", "300ms"])
        .spawn();
    let a = send(
        "PUT",
        &p2.url("/slow"),
        &[("x-fence-token", "1"), ("x-test-delay-ms", "1500")],
        "x",
    )
    .await;
    assert_problem(&a, 504, "upstream-timeout");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(up.arrivals(), 1, "the write was sent exactly once");
}

/// An upstream that reads each request head, then hangs up without an
/// answer, counting the heads it got.
async fn hang_up_upstream() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let heads = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                counted.fetch_add(1, Ordering::SeqCst);
                // Dropped here: the connection closes with no answer.
            });
        }
    });
    (url, heads)
}

/// A write the upstream received and dropped without answering is a 502 and
/// is not sent again (it may have been applied); nor is an idempotent one.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_the_upstream_dropped_is_a_502_and_never_retried() {
    let dir = tempfile::tempdir().unwrap();
    let (url, heads) = hang_up_upstream().await;
    let p = ProxyBuilder::new(&url, dir.path()).spawn();
    for (i, method) in ["PUT", "DELETE", "POST"].into_iter().enumerate() {
        // A DELETE has no body here (refused with 400 before it is sent).
        let body = if method == "DELETE" { "" } else { "body" };
        let a = send(method, &p.url("/x"), &[("x-fence-token", "1")], body).await;
        assert_eq!(a.status, 502, "{method}: {}", a.text());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            heads.load(std::sync::atomic::Ordering::SeqCst),
            i + 1,
            "{method} was sent more than once"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn path_aliases_share_one_key_and_the_canonical_target_goes_upstream() {
    let (_d, up, p) = setup().await;
    assert_eq!(put(&p.url("/a/obj"), "5").await.status, 200);
    for alias in [
        "/a/%6Fbj",
        "/a/%6fbj",
        "/%61/obj",
        "/a/obj/",
        "/a/o%62j?x=1",
    ] {
        assert_problem(&put(&p.url(alias), "4").await, 409, "stale-token");
    }
    assert_eq!(put(&p.url("/a/%6Fbj?v=1"), "5").await.status, 200);
    assert_eq!(
        up.records()[1].target,
        "/a/obj?v=1",
        "the canonical target is forwarded"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ambiguous_targets_are_refused_with_400() {
    let (_d, up, p) = setup().await;
    for t in [
        "/a/../b",
        "/a/./b",
        "/a/%2e%2e/b",
        "/a/..;/b",
        "/a//b",
        "//b",
        "/a/%2Fb",
        "/a/%2fb",
        "/a/%5Cb",
        "/a/%252Fb",
        "/a/%00",
        "/a/%zz",
        "/a/%",
        // Escapes that are not UTF-8 once decoded: an overlong '.' reads
        // as `..` to a lax decoder.
        "/s/%C0%AE%C0%AE/x",
        "/a/%FF",
    ] {
        for m in ["PUT", "GET"] {
            let a = send(m, &p.url(t), &[("x-fence-token", "1")], "").await;
            assert_problem(&a, 400, "bad-target");
        }
    }
    // Raw bytes the client library would not send.
    for target in ["/a\\b", "/a/\u{e9}", "/a#frag/../b"] {
        let req = format!(
            "PUT {target} HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n"
        );
        let out = raw(p.addr, req.as_bytes(), Duration::from_secs(2)).await;
        if target.contains('#') {
            // The HTTP parser drops the fragment; key and forwarded target
            // both lack it, so they cannot disagree (docs/contract.md).
            assert!(out.starts_with("HTTP/1.1 200"), "{target}: {out}");
            assert_eq!(up.records().last().unwrap().target, "/a");
        } else {
            assert!(out.starts_with("HTTP/1.1 400"), "{target}: {out}");
        }
    }
    assert_eq!(up.arrivals(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn absolute_form_naming_another_host_is_refused() {
    let (_d, up, p) = setup().await;
    let req = "PUT http://evil.example/a HTTP/1.1\r\nHost: good.example\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n";
    let out = raw(p.addr, req.as_bytes(), Duration::from_secs(2)).await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    let req = "PUT http://good.example/a HTTP/1.1\r\nHost: good.example\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n";
    let out = raw(p.addr, req.as_bytes(), Duration::from_secs(2)).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(up.records()[0].target, "/a");
    assert_eq!(up.count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_headers_get_431_and_bodies_over_the_limit_413() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--max-header-bytes", "8192", "--max-body-bytes", "1000"])
        .spawn();
    let big = "a".repeat(9000);
    let req = format!("PUT /h HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\nX-Fence-Token: 1\r\nContent-Length: 0\r\n\r\n");
    let out = raw(p.addr, req.as_bytes(), Duration::from_secs(2)).await;
    assert!(out.starts_with("HTTP/1.1 431"), "{out}");
    let a = send(
        "PUT",
        &p.url("/b"),
        &[("x-fence-token", "1")],
        vec![b'x'; 1001],
    )
    .await;
    assert_problem(&a, 413, "body-too-large");
    assert_eq!(up.arrivals(), 0);
    // A refused body did not raise the fence.
    assert_eq!(
        send("GET", &p.admin_url("/v1/fences/default%3A%2Fb"), &[], "")
            .await
            .status,
        404
    );
    // Chunked bodies are counted as they stream.
    let req = "PUT /c HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n".to_string()
        + &"y".repeat(2000)
        + "\r\n0\r\n\r\n";
    let out = raw(p.addr, req.as_bytes(), Duration::from_secs(3)).await;
    assert!(out.starts_with("HTTP/1.1 413"), "{out}");
    assert_eq!(up.count(), 0, "a truncated body is never applied");
}

/// Reads `s` until the peer closes it: how long that took from `since`, or
/// None if it was still open after 6 s.
async fn closed_after(
    s: &mut tokio::net::TcpStream,
    since: std::time::Instant,
) -> Option<Duration> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    tokio::time::timeout(Duration::from_secs(6), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return since.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn slowloris_is_dropped_within_the_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    // 1 s, far from the 10 s default: a proxy that ignored the setting
    // would keep these connections open past the 6 s bound below.
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--header-read-timeout", "1s"])
        .spawn();
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    let started = std::time::Instant::now();
    s.write_all(b"PUT /x HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let took = closed_after(&mut s, started).await;
    let took = took.expect("a head that never ends left the connection open");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "closed after {took:?}, not at the 1 s header timeout"
    );
    assert_eq!(up.arrivals(), 0);

    // The same clock closes an idle keep-alive connection after an answer.
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    let sent = std::time::Instant::now();
    s.write_all(b"GET /y HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&head).contains("applied GET /y") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("no answer")
            .unwrap();
        assert!(
            n > 0,
            "closed before answering: {}",
            String::from_utf8_lossy(&head)
        );
        head.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&head).starts_with("HTTP/1.1 200"));
    // Idle from the answer on: closed 1 s after it, so at least 1 s after
    // the request was sent, and well within 4 s.
    let took = closed_after(&mut s, sent)
        .await
        .expect("an idle keep-alive connection was left open");
    assert!(
        took >= Duration::from_millis(950) && took < Duration::from_secs(4),
        "idle keep-alive closed {took:?} after the request, not at the 1 s header timeout"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_endpoints() {
    let (_d, up, p) = setup().await;
    assert_eq!(put(&p.url("/bucket/obj"), "42").await.status, 200);
    assert_problem(&put(&p.url("/bucket/obj"), "41").await, 409, "stale-token");
    assert_problem(
        &send("PUT", &p.url("/bucket/obj"), &[], "").await,
        428,
        "missing-token",
    );
    assert_problem(
        &put(&p.url("/bucket/obj"), "x").await,
        400,
        "malformed-token",
    );
    let a = send(
        "GET",
        &p.admin_url("/v1/fences/default%3A%2Fbucket%2Fobj"),
        &[],
        "",
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["highest"], "42");
    assert_eq!(a.json()["key"], "default:/bucket/obj");
    assert_eq!(
        send("GET", &p.admin_url("/v1/fences/default%3A%2Fnope"), &[], "")
            .await
            .status,
        404
    );
    assert_eq!(
        send("GET", &p.admin_url("/healthz"), &[], "").await.status,
        200
    );
    let r = send("GET", &p.admin_url("/readyz"), &[], "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let a = send(
        "POST",
        &p.admin_url("/v1/fences/default%3A%2Fbucket%2Fobj"),
        &[],
        "",
    )
    .await;
    assert_eq!(a.status, 401, "mutations need the admin token");
    for auth in [None, Some("Bearer wrong")] {
        let headers: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
        let a = send(
            "POST",
            &p.admin_url("/v1/store/confirm-reset"),
            &headers,
            "",
        )
        .await;
        assert_eq!(
            a.status,
            401,
            "confirm-reset needs the admin token: {}",
            a.text()
        );
    }
    // Of the four writes above, only the admitted one reached the backend.
    assert_eq!(up.arrivals(), 1, "a refused write reached the backend");
    assert_eq!(up.records()[0].token.as_deref(), Some("42"));
    let m = send("GET", &p.admin_url("/metrics"), &[], "").await;
    let text = m.text();
    for line in [
        "fencegate_writes_total{decision=\"admitted\",route=\"default\"} 1",
        "fencegate_writes_total{decision=\"stale\",route=\"default\"} 1",
        "fencegate_writes_total{decision=\"missing_token\",route=\"default\"} 1",
        "fencegate_writes_total{decision=\"malformed_token\",route=\"default\"} 1",
        "fencegate_store_up 1",
    ] {
        // Whole sample lines: a HELP text may start like a sample.
        assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
    }
    for family in [
        "fencegate_admission_wait_seconds_bucket",
        "fencegate_store_latency_seconds_bucket",
        "fencegate_upstream_latency_seconds_bucket",
        "fencegate_in_flight_requests",
    ] {
        assert!(text.contains(family), "missing {family}");
    }
    // promtool is the reference linter for the exposition format.
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool not found: install it (Debian package `prometheus`), scripts/test does");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_binds_loopback_by_default() {
    let out = std::process::Command::new(bin())
        .args([
            "check-config",
            "/dev/null",
            "--upstream",
            "http://127.0.0.1:1",
            "--store",
            "/tmp/x.redb",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("admin_listen = \"127.0.0.1:9090\""), "{text}");
    // And the running process really listens there, on loopback only.
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
        ])
        .arg("--store")
        .arg(dir.path().join("f.redb"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let listening = listening_addresses(child.id());
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(
        line.contains("admin=127.0.0.1:9090"),
        "did not start on the default admin address (is port 9090 taken on this machine?): {line:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 127.0.0.1:9090 as /proc/net/tcp writes it; never 0.0.0.0 or [::].
    assert!(
        listening.iter().any(|a| a == "0100007F:2382"),
        "{listening:?}"
    );
    assert!(
        listening.iter().all(|a| a.starts_with("0100007F:")),
        "a listener is not on loopback: {listening:?}"
    );
}

/// `fencegate.toml` in `dir`.
fn config_file(dir: &std::path::Path, body: &str) -> std::path::PathBuf {
    let path = dir.join("fencegate.toml");
    write_config(&path, body);
    path
}

#[tokio::test(flavor = "multi_thread")]
async fn per_route_write_methods_templates_and_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let u = up.url();
    let cfg = config_file(
        dir.path(),
        &format!(
            r#"
[[routes]]
name = "orders"
path_prefix = "/orders"
upstream = "{u}"
key = "/orders/{{tenant}}/{{id}}"
namespace = "orders"
write_methods = ["PUT", "DELETE"]

[[routes]]
name = "ledger"
path_prefix = "/ledger"
upstream = "{u}"
key = "header:X-Account"
namespace = "ledger"

[[routes]]
name = "rest"
upstream = "{u}"
key = "/{{bucket}}"
"#
        ),
    );
    let p = ProxyBuilder::with_config(&cfg, dir.path()).spawn();
    // Only PUT and DELETE are writes on /orders; put in lower case too.
    assert_eq!(
        send("POST", &p.url("/orders/t1/9/search"), &[], "")
            .await
            .status,
        200
    );
    assert_problem(
        &send("PUT", &p.url("/orders/t1/9"), &[], "").await,
        428,
        "missing-token",
    );
    assert_problem(
        &send("put", &p.url("/orders/t1/9"), &[], "").await,
        428,
        "missing-token",
    );
    // One fence per order, whatever lies below it.
    assert_eq!(put(&p.url("/orders/t1/9/items/3"), "5").await.status, 200);
    let a = put(&p.url("/orders/t1/9"), "4").await;
    assert_problem(&a, 409, "stale-token");
    assert_eq!(a.json()["key"], "orders:/orders/t1/9");
    assert_eq!(
        put(&p.url("/orders/t1/10"), "1").await.status,
        200,
        "another order"
    );
    assert_problem(&put(&p.url("/orders/t1"), "9").await, 400, "bad-target");
    // Header template.
    let a = send(
        "PATCH",
        &p.url("/ledger/x"),
        &[("x-account", "acct-1"), ("x-fence-token", "3")],
        "",
    )
    .await;
    assert_eq!(a.status, 200);
    let a = send(
        "PATCH",
        &p.url("/ledger/y"),
        &[("x-account", "acct-1"), ("x-fence-token", "2")],
        "",
    )
    .await;
    assert_problem(&a, 409, "stale-token");
    assert_eq!(a.json()["key"], "ledger:acct-1");
    let a = send("PATCH", &p.url("/ledger/y"), &[("x-fence-token", "2")], "").await;
    assert_problem(&a, 400, "bad-target");
    // Empty, comma-list and repeated key headers name no single key.
    let before = up.arrivals();
    for account in [
        &[""][..],
        &["acct-1, acct-2"],
        &["acct-1,acct-2"],
        &["acct-1", "acct-2"],
    ] {
        let mut headers = vec![("x-fence-token", "9")];
        headers.extend(account.iter().map(|a| ("x-account", *a)));
        let a = send("PATCH", &p.url("/ledger/y"), &headers, "").await;
        assert_problem(&a, 400, "bad-target");
    }
    assert_eq!(
        up.arrivals(),
        before,
        "a write without one key reached the backend"
    );
    // The key header reaches the backend even if listed in Connection.
    let a = send(
        "PATCH",
        &p.url("/ledger/z"),
        &[
            ("x-account", "acct-1"),
            ("connection", "x-account"),
            ("x-fence-token", "3"),
        ],
        "",
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(up.records().last().unwrap().headers["x-account"], "acct-1");
    // First segment = a bucket; namespaces keep lock services apart.
    assert_eq!(put(&p.url("/b1/x"), "8").await.status, 200);
    assert_problem(&put(&p.url("/b1/y"), "7").await, 409, "stale-token");
    assert_eq!(
        send("GET", &p.admin_url("/v1/fences/default%3A%2Fb1"), &[], "")
            .await
            .json()["highest"],
        "8"
    );
    assert_eq!(
        send(
            "GET",
            &p.admin_url("/v1/fences/orders%3A%2Forders%2Ft1%2F9"),
            &[],
            ""
        )
        .await
        .json()["highest"],
        "5"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn literal_routes_forward_the_raw_target_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .arg("--literal-keys")
        .spawn();
    let raw_target = "/bucket/a//b%2Fc%2fd?partNumber=1&uploadId=x%2By";
    assert_eq!(put(&p.url(raw_target), "5").await.status, 200);
    assert_eq!(up.records()[0].target, raw_target);
    // The key is the decoded object name with runs of `/` merged: another
    // spelling of it is the same object for S3 (and `a//b` is `a/b` to
    // servers that merge slashes), hence the same fence.
    let a = put(&p.url("/bucket/a//b/c%2Fd"), "4").await;
    assert_problem(&a, 409, "stale-token");
    assert_eq!(a.json()["key"], "default:/bucket/a/b/c/d");
    assert_problem(&put(&p.url("/bucket/%zz"), "9").await, 400, "bad-target");
    // Names that are not UTF-8 once decoded, and an encoded NUL.
    for bad in [
        "/bucket/%FF",
        "/bucket/a%C3%28",
        "/bucket/%ED%A0%80",
        "/bucket/a%00b",
    ] {
        assert_problem(&put(&p.url(bad), "9").await, 400, "bad-target");
    }
    assert_eq!(up.arrivals(), 1, "a refused name reached the backend");
}

#[tokio::test(flavor = "multi_thread")]
async fn ambiguous_paths_do_not_fall_through_to_a_literal_route_and_hosts_are_normalised() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let u = up.url();
    let cfg = config_file(
        dir.path(),
        &format!(
            r#"
[[routes]]
name = "api"
path_prefix = "/api"
upstream = "{u}"

[[routes]]
name = "tenant"
host = "tenant.example"
upstream = "{u}"
namespace = "tenant"

[[routes]]
name = "objects"
upstream = "{u}"
literal_keys = true
"#
        ),
    );
    let p = ProxyBuilder::with_config(&cfg, dir.path()).spawn();
    // `/api//x` is refused: it must not reach the literal catch-all.
    for t in ["/api//x", "/api/%2e%2e/x", "/api/a%2Fb"] {
        assert_problem(&put(&p.url(t), "1").await, 400, "bad-target");
    }
    // The literal route still takes what is its own.
    assert_eq!(put(&p.url("/bucket//obj"), "1").await.status, 200);
    // Host matching ignores the port. A host route takes only the host
    // spelled as it names it: a backend may read `Tenant.Example.` as
    // another host (SeaweedFS reads it as a path-style request).
    for other in ["Tenant.Example:8080", "tenant.example.", "TENANT.EXAMPLE"] {
        let a = send(
            "PUT",
            &p.url("/t"),
            &[("host", other), ("x-fence-token", "9")],
            "",
        )
        .await;
        assert_problem(&a, 400, "bad-request");
        assert!(a.text().contains("spell the host"), "{other}: {}", a.text());
    }
    let a = send(
        "PUT",
        &p.url("/t"),
        &[("host", "tenant.example:8080"), ("x-fence-token", "4")],
        "",
    )
    .await;
    assert_eq!(a.status, 200);
    let a = send(
        "PUT",
        &p.url("/t"),
        &[("host", "tenant.example"), ("x-fence-token", "3")],
        "",
    )
    .await;
    assert_problem(&a, 409, "stale-token");
    assert_eq!(a.json()["key"], "tenant:/t");
    // With host routes configured, a request without a host is refused.
    let out = raw(
        p.addr,
        b"PUT /t HTTP/1.0\r\nX-Fence-Token: 9\r\nContent-Length: 0\r\n\r\n",
        Duration::from_secs(2),
    )
    .await;
    assert!(
        out.starts_with("HTTP/1.0 400") || out.starts_with("HTTP/1.1 400"),
        "{out}"
    );
    assert_eq!(up.count(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn request_ids_forwarded_for_and_the_access_log() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--access-log", "--log-format", "json"])
        .spawn();
    let a = put(&p.url("/r"), "3").await;
    let id = a
        .header("x-request-id")
        .expect("a request id is generated")
        .to_string();
    let r = &up.records()[0];
    assert_eq!(
        r.headers["x-request-id"],
        id.as_str(),
        "the same id goes upstream"
    );
    assert_eq!(r.headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(r.headers["x-forwarded-proto"], "http");
    assert_eq!(r.headers["forwarded"], "for=127.0.0.1;proto=http");
    let a = send(
        "PUT",
        &p.url("/r"),
        &[
            ("x-fence-token", "2"),
            ("x-request-id", "client-id-42"),
            ("x-forwarded-for", "10.9.8.7"),
        ],
        "",
    )
    .await;
    assert_eq!(a.status, 409);
    assert_eq!(
        a.header("x-request-id"),
        Some("client-id-42"),
        "a client id is kept"
    );
    let a = send(
        "GET",
        &p.url("/r"),
        &[
            ("x-forwarded-for", "10.9.8.7"),
            ("forwarded", "for=10.9.8.7;proto=https"),
            ("x-forwarded-proto", "https"),
        ],
        "",
    )
    .await;
    assert_eq!(a.status, 200);
    let r = &up.records()[1];
    assert_eq!(
        r.headers["x-forwarded-for"], "10.9.8.7, 127.0.0.1",
        "appended, not replaced"
    );
    assert_eq!(
        r.headers["forwarded"],
        "for=10.9.8.7;proto=https, for=127.0.0.1;proto=http"
    );
    assert_eq!(
        r.headers["x-forwarded-proto"], "http",
        "the scheme of this hop, not the client's claim"
    );
    // Earlier hops on several header lines are all kept, in order.
    let a = send(
        "GET",
        &p.url("/r"),
        &[
            ("x-forwarded-for", "10.0.0.1"),
            ("x-forwarded-for", "10.0.0.2"),
        ],
        "",
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(
        up.records()[2].headers["x-forwarded-for"],
        "10.0.0.1, 10.0.0.2, 127.0.0.1"
    );
    let log = p.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("client-id-42"))
        .unwrap_or_else(|| panic!("no access log line for the refused write:\n{log}"));
    let v: serde_json::Value = serde_json::from_str(line).expect("JSON log line");
    assert_eq!(v["target"], "fencegate::access");
    assert_eq!(v["fields"]["status"], 409);
    assert_eq!(v["fields"]["key"], "default:/r");
    assert_eq!(v["fields"]["token"], 2);
    assert_eq!(v["fields"]["method"], "PUT");
    assert_eq!(v["fields"]["route"], "default");
    assert_eq!(v["fields"]["client"], "127.0.0.1");
    assert!(v["fields"]["peer"]
        .as_str()
        .is_some_and(|c| c.starts_with("127.0.0.1:")));
    assert_eq!(v["fields"]["decision"], "stale");
    assert_eq!(v["fields"]["version"], "HTTP/1.1");
    assert_eq!(v["fields"]["tls"], false);
    assert!(
        v["fields"].get("upstream_ms").is_none(),
        "never went upstream"
    );
    let admitted = log
        .lines()
        .filter(|l| l.contains("fencegate::access"))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["fields"]["decision"] == "admitted")
        .expect("an access line for the admitted write");
    assert_eq!(admitted["fields"]["status"], 200);
    assert!(admitted["fields"]["upstream_ms"].as_f64().unwrap() > 0.0);
    assert!(
        admitted["fields"]["latency_ms"].as_f64().unwrap()
            >= admitted["fields"]["upstream_ms"].as_f64().unwrap()
    );
}

/// A write whose client hangs up before its answer still runs to its end
/// upstream, and leaves its trace: an access-log line and a request counted
/// with status 499 (nginx's "client closed request").
#[tokio::test(flavor = "multi_thread")]
async fn a_write_whose_client_hung_up_is_logged_as_499() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--access-log", "--log-format", "json"])
        .spawn();
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    s.write_all(b"PUT /gone HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 4\r\nX-Request-Id: gone-1\r\nX-Test-Delay-Ms: 2000\r\nContent-Length: 1\r\n\r\nx")
        .await
        .unwrap();
    eventually("the write arrived", Duration::from_secs(5), || {
        up.arrivals() == 1
    })
    .await;
    drop(s);
    eventually("the write was applied", Duration::from_secs(5), || {
        up.count() == 1
    })
    .await;
    eventually_async("the 499 was counted", || async {
        metric(
            &p,
            "fencegate_requests_total{class=\"write\",route=\"default\",status=\"499\"}",
        )
        .await
            == Some(1.0)
    })
    .await;
    let log = p.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("gone-1") && l.contains("fencegate::access"))
        .unwrap_or_else(|| panic!("no access log line for the write:\n{log}"));
    let v: serde_json::Value = serde_json::from_str(line).expect("JSON log line");
    assert_eq!(v["fields"]["status"], 499);
    assert_eq!(v["fields"]["decision"], "admitted");
    assert_eq!(v["fields"]["key"], "default:/gone");
}

/// Hop-by-hop headers an upstream sends back do not reach the client.
#[tokio::test(flavor = "multi_thread")]
async fn hop_by_hop_headers_are_not_returned() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = start_upstream_with(|mut s: tokio::net::TcpStream, _| {
        Box::pin(async move {
            // One request: read its head and its (small) body, answer, close.
            let mut buf = vec![0u8; 8192];
            let mut got = 0;
            while !buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf[got..]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got += n,
                }
            }
            let _ = s
                .write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: x-private-resp, close\r\n\
X-Private-Resp: secret\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\n\
Trailer: x-checksum\r\nX-End-To-End: kept\r\n\r\nok",
                )
                .await;
        })
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let a = send("GET", &p.url("/hop"), &[], "").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.text(), "ok");
    for gone in [
        "x-private-resp",
        "keep-alive",
        "proxy-connection",
        "trailer",
        "connection",
    ] {
        assert!(a.header(gone).is_none(), "{gone} was returned");
    }
    assert_eq!(a.header("x-end-to-end"), Some("kept"));
}
