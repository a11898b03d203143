//! What a request head may carry on to the backend, on every reader (the
//! lane, a connection hyper holds, HTTP/1.0, HTTP/2): no body on a method
//! that has none (a backend that does not read it would take it as the
//! next request), no header name with `_` (read as `-` by CGI-style
//! backends), and always a `Host`.

mod common;

use std::time::Duration;

use common::*;

/// A request that a backend which does not read GET bodies takes as its
/// own: a write with no token.
const SMUGGLED: &str = "PUT /SMUG HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";

/// What precedes a case on its connection, and how many answers that gets:
/// nothing (the lane reads the case), or a read whose `Connection` option
/// the lane does not take, so hyper reads the case.
const READERS: &[(&str, &str, usize)] = &[
    ("lane", "", 0),
    (
        "hyper",
        "GET /warm HTTP/1.1\r\nHost: x\r\nConnection: x-a\r\n\r\n",
        1,
    ),
];

/// The status lines in a raw exchange, in order (an answer's head may
/// follow the previous body on its line: bodies here end without one).
fn statuses(answer: &str) -> Vec<String> {
    answer
        .match_indices("HTTP/1.")
        .filter_map(|(at, _)| answer[at..].lines().next())
        .filter(|l| l.len() > 9 && l.as_bytes()[8] == b' ')
        .map(str::to_string)
        .collect()
}

/// Waits until the backend has read a request sent after the case (so
/// anything smuggled on an upstream connection would have been read), and
/// asserts that no smuggled request line reached it.
async fn nothing_smuggled(p: &Proxy, up: &BodyBlindUpstream, case: &str) {
    let control = format!("/control-{}", up.lines().len());
    let a = send("GET", &p.url(&control), &[], "").await;
    assert_eq!(a.status, 200, "{case}: control read: {}", a.text());
    let line = format!("GET {control}");
    eventually(
        "the control read at the backend",
        Duration::from_secs(5),
        || up.lines().contains(&line),
    )
    .await;
    let lines = up.lines();
    assert!(
        lines.iter().all(|l| !l.contains("SMUG")),
        "{case}: a request fencegate never admitted reached the backend: {lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bodies_on_bodiless_methods_are_refused_on_every_reader() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_body_blind_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let with_length = |method: &str, version: &str, extra: &str| {
        format!(
            "{method} /k/atk {version}\r\nHost: x\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{SMUGGLED}",
            SMUGGLED.len()
        )
    };
    let mut cases = Vec::new();
    for method in ["GET", "HEAD", "OPTIONS"] {
        cases.push((method.to_string(), with_length(method, "HTTP/1.1", "")));
    }
    // A write with a valid token: admitted, its body must not carry a
    // second request past the fence.
    cases.push((
        "DELETE".into(),
        with_length("DELETE", "HTTP/1.1", "X-Fence-Token: 1\r\n"),
    ));
    cases.push((
        "chunked OPTIONS".into(),
        format!(
            "OPTIONS /k/atk HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n{SMUGGLED}\r\n0\r\n\r\n",
            SMUGGLED.len()
        ),
    ));
    for (reader, before, skip) in READERS {
        for (name, request) in &cases {
            let case = format!("{name} via {reader}");
            let answer = raw(
                p.addr,
                format!("{before}{request}").as_bytes(),
                Duration::from_secs(3),
            )
            .await;
            let got = statuses(&answer);
            assert!(
                got.get(*skip)
                    .is_some_and(|l| l.starts_with("HTTP/1.1 400 ")),
                "{case}: {answer}"
            );
            // (An answer to HEAD has no body.)
            assert!(
                answer.contains("application/problem+json")
                    && (name == "HEAD" || answer.contains("bad-framing")),
                "{case}: {answer}"
            );
            nothing_smuggled(&p, &up, &case).await;
        }
    }
    // HTTP/1.0 is hyper's from its first byte.
    for method in ["GET", "HEAD", "OPTIONS"] {
        let case = format!("{method} over HTTP/1.0");
        let answer = raw(
            p.addr,
            with_length(method, "HTTP/1.0", "").as_bytes(),
            Duration::from_secs(3),
        )
        .await;
        assert!(
            statuses(&answer)
                .first()
                .is_some_and(|l| l.contains(" 400 ")),
            "{case}: {answer}"
        );
        nothing_smuggled(&p, &up, &case).await;
    }
    // An empty body (`Content-Length: 0`) is no body: served.
    let answer = raw(
        p.addr,
        b"GET /k/empty HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        Duration::from_secs(3),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
}

/// A WebSocket handshake carries no body, even on a route that allows
/// bodies on GET: the bytes after it are the tunnel's, or the next request.
#[tokio::test(flavor = "multi_thread")]
async fn a_websocket_handshake_with_a_body_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_body_blind_upstream().await;
    let cfg = dir.path().join("routes.toml");
    write_config(
        &cfg,
        &format!(
            "[[routes]]\nname = \"ws\"\nupstream = \"{}\"\nwebsocket = true\nallow_bodies_on = [\"GET\"]\n",
            up.url()
        ),
    );
    let p = ProxyBuilder::with_config(&cfg, dir.path()).spawn();
    let handshake = format!(
        "GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nContent-Length: {}\r\n\r\n{SMUGGLED}",
        SMUGGLED.len()
    );
    for (reader, before, skip) in READERS {
        let answer = raw(
            p.addr,
            format!("{before}{handshake}").as_bytes(),
            Duration::from_secs(3),
        )
        .await;
        assert!(
            statuses(&answer)
                .get(*skip)
                .is_some_and(|l| l.starts_with("HTTP/1.1 400 ")),
            "via {reader}: {answer}"
        );
        nothing_smuggled(&p, &up, reader).await;
    }
}

/// HTTP/2 frames its bodies itself, but the backend is spoken to in
/// HTTP/1.1: a GET's body, declared or not, must not reach it.
#[tokio::test(flavor = "multi_thread")]
async fn an_h2_get_with_a_body_is_refused() {
    use http_body_util::BodyExt;
    let dir = tempfile::tempdir().unwrap();
    let up = start_body_blind_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let client: hyper_util::client::legacy::Client<_, Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let declared = || full(SMUGGLED);
    // No content-length: the body's size is not known up front.
    let undeclared =
        || ChunkBody::new(vec![bytes::Bytes::from_static(SMUGGLED.as_bytes())]).boxed();
    for (name, method, body, length) in [
        ("declared GET", "GET", declared(), Some(SMUGGLED.len())),
        ("undeclared GET", "GET", undeclared(), None),
        (
            "declared OPTIONS",
            "OPTIONS",
            declared(),
            Some(SMUGGLED.len()),
        ),
        ("undeclared DELETE", "DELETE", undeclared(), None),
    ] {
        let mut req = http::Request::builder()
            .method(method)
            .uri(p.url("/k/h2"))
            .header("x-fence-token", "1");
        if let Some(n) = length {
            req = req.header("content-length", n);
        }
        let resp = client.request(req.body(body).unwrap()).await.unwrap();
        let status = resp.status();
        let text = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(status, 400, "{name}: {}", String::from_utf8_lossy(&text));
        nothing_smuggled(&p, &up, name).await;
    }
    // Without a body: served.
    let req = http::Request::builder()
        .method("GET")
        .uri(p.url("/k/h2"))
        .body(full(""))
        .unwrap();
    assert_eq!(client.request(req).await.unwrap().status(), 200);
}

/// A route that says its backend reads GET bodies (a search API) passes
/// them; others still refuse them.
#[tokio::test(flavor = "multi_thread")]
async fn a_route_can_allow_bodies_on_get() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let cfg = dir.path().join("routes.toml");
    write_config(
        &cfg,
        &format!(
            "[[routes]]\nname = \"search\"\npath_prefix = \"/search\"\nupstream = \"{u}\"\nallow_bodies_on = [\"GET\", \"delete\"]\n\n[[routes]]\nname = \"rest\"\nupstream = \"{u}\"\n",
            u = up.url()
        ),
    );
    let p = ProxyBuilder::with_config(&cfg, dir.path()).spawn();
    let query = r#"{"query":{"match_all":{}}}"#;
    let a = send("GET", &p.url("/search/_search"), &[], query).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let a = send(
        "DELETE",
        &p.url("/search/_query"),
        &[("x-fence-token", "1")],
        query,
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let seen: Vec<_> = up
        .records()
        .into_iter()
        .map(|r| (r.method, r.body_len))
        .collect();
    assert_eq!(
        seen,
        [
            ("GET".to_string(), query.len() as u64),
            ("DELETE".to_string(), query.len() as u64)
        ]
    );
    // Not HEAD, and not on the other route.
    let a = send("GET", &p.url("/other"), &[], query).await;
    assert_eq!(a.status, 400, "{}", a.text());
    assert_eq!(up.count(), 2);
}

/// Header names with `_` are dropped (nginx's `underscores_in_headers
/// off`): a CGI or WSGI backend reads `X_Forwarded_For` as
/// `X-Forwarded-For`, past the forwarded-header rules.
#[tokio::test(flavor = "multi_thread")]
async fn header_names_with_underscores_are_dropped_on_every_reader() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let heads = "X_Forwarded_For: 6.6.6.6\r\nX_Fence_Token: 99\r\nX_Custom: a\r\n";
    for (reader, before, skip) in READERS {
        let request = format!(
            "{before}PUT /u HTTP/1.1\r\nHost: x\r\nX-Fence-Token: 5\r\n{heads}Content-Length: 1\r\nConnection: close\r\n\r\nx"
        );
        let answer = raw(p.addr, request.as_bytes(), Duration::from_secs(3)).await;
        assert!(
            statuses(&answer)
                .get(*skip)
                .is_some_and(|l| l.starts_with("HTTP/1.1 200 ")),
            "via {reader}: {answer}"
        );
    }
    let answer = raw(
        p.addr,
        format!("GET /u HTTP/1.0\r\nHost: x\r\n{heads}\r\n").as_bytes(),
        Duration::from_secs(3),
    )
    .await;
    assert!(answer.contains(" 200 "), "{answer}");
    let client: hyper_util::client::legacy::Client<_, Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let req = http::Request::builder()
        .method("GET")
        .uri(p.url("/u"))
        .header("x_forwarded_for", "6.6.6.6")
        .header("x_custom", "a")
        .body(full(""))
        .unwrap();
    assert_eq!(client.request(req).await.unwrap().status(), 200);
    let records: Vec<_> = up
        .records()
        .into_iter()
        .filter(|r| r.target == "/u")
        .collect();
    assert_eq!(records.len(), 4);
    for r in &records {
        let names: Vec<_> = r.headers.keys().map(|k| k.as_str().to_string()).collect();
        assert!(
            names.iter().all(|n| !n.contains('_')),
            "{} {}: {names:?}",
            r.method,
            r.target
        );
        assert!(
            r.headers
                .get_all("x-forwarded-for")
                .iter()
                .all(|v| !v.to_str().unwrap().contains("6.6.6.6")),
            "{:?}",
            r.headers
        );
    }
}

/// A request without `Host` (HTTP/1.0: HAProxy's default health check is
/// `OPTIONS / HTTP/1.0`) reaches the backend with the upstream's authority
/// as its `Host`, as nginx sends it; one with a `Host` keeps it.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_without_host_gets_the_upstreams() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_body_blind_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    for request in [
        "OPTIONS / HTTP/1.0\r\n\r\n",
        "GET /plain HTTP/1.1\r\nConnection: close\r\n\r\n",
        "GET /given HTTP/1.0\r\nHost: api.example\r\n\r\n",
    ] {
        let answer = raw(p.addr, request.as_bytes(), Duration::from_secs(3)).await;
        assert!(answer.contains(" 200 "), "{request:?}: {answer}");
    }
    let authority = up.addr.to_string();
    assert_eq!(
        up.hosts(),
        [
            Some(authority.clone()),
            Some(authority),
            Some("api.example".to_string())
        ]
    );
}
