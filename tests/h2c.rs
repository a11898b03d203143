//! HTTP/2 with prior knowledge (h2c) on the plain listener: the same
//! answers, the same key parse of `:path`, as over HTTP/1.1.

mod common;

use std::future::Future;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

async fn h2(method: &str, url: &str, token: Option<&str>) -> (u16, http::HeaderMap, Bytes) {
    let client: Client<_, Body> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let mut req = http::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        req = req.header("x-fence-token", t);
    }
    // GET and HEAD have no body (fencegate refuses one: a backend that
    // does not read it would take it as another request).
    let body = if matches!(method, "GET" | "HEAD") {
        ""
    } else {
        "h2 body"
    };
    let resp = client
        .request(req.body(full(body)).unwrap())
        .await
        .expect("h2c request");
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let (parts, body) = resp.into_parts();
    (
        parts.status.as_u16(),
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn h2c_fences_like_http1() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let (s, _, _) = h2("PUT", &p.url("/a/obj"), Some("5")).await;
    assert_eq!(s, 200);
    let (s, h, body) = h2("PUT", &p.url("/a/%6Fbj"), Some("4")).await;
    assert_eq!(s, 409, "{}", String::from_utf8_lossy(&body));
    assert_eq!(h["x-fence-token-highest"], "5");
    assert_eq!(h["content-type"], "application/problem+json");
    let (s, _, _) = h2("PUT", &p.url("/a/obj"), None).await;
    assert_eq!(s, 428);
    let (s, _, _) = h2("PUT", &p.url("/a/../obj"), Some("9")).await;
    assert_eq!(s, 400);
    let (s, _, body) = h2("GET", &p.url("/a/obj"), None).await;
    assert_eq!(s, 200);
    assert_eq!(body, Bytes::from("applied GET /a/obj len=0"));
    let r = up.records();
    assert_eq!(
        r.len(),
        2,
        "only the admitted write and the read reached the backend"
    );
    assert_eq!(r[0].target, "/a/obj");
    assert_eq!(r[0].body_len, 7);
    // The backend speaks HTTP/1.1 and gets a Host header.
    assert_eq!(r[0].headers["host"], p.addr.to_string().as_str());
    // HTTP/1.1 on the same port still works.
    assert_eq!(put(&p.url("/a/obj"), "5").await.status, 200);
}

/// A request body of the frames given, with no length announced (as gRPC
/// and other streaming clients send): `Err` makes the client reset its
/// stream there (hyper resets with INTERNAL_ERROR); an `Ok("")` waits
/// 300 ms first, so that what came before is surely out.
struct Frames {
    steps: std::collections::VecDeque<Result<&'static str, &'static str>>,
    pause: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        loop {
            if let Some(pause) = &mut self.pause {
                std::task::ready!(pause.as_mut().poll(cx));
                self.pause = None;
            }
            return std::task::Poll::Ready(match self.steps.pop_front() {
                Some(Ok("")) => {
                    self.pause = Some(Box::pin(tokio::time::sleep(
                        std::time::Duration::from_millis(300),
                    )));
                    continue;
                }
                Some(Ok(data)) => Some(Ok(http_body::Frame::data(Bytes::from_static(
                    data.as_bytes(),
                )))),
                Some(Err(e)) => Some(Err(e.into())),
                None => None,
            });
        }
    }
}

async fn h2_sender(p: &Proxy) -> hyper::client::conn::http2::SendRequest<Frames> {
    let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(p.addr).await.unwrap());
    let (sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

fn put_frames(
    p: &Proxy,
    path: &str,
    token: &str,
    frames: &[Result<&'static str, &'static str>],
) -> http::Request<Frames> {
    http::Request::put(p.url(path))
        .header("x-fence-token", token)
        .header("te", "trailers")
        .body(Frames {
            steps: frames.iter().copied().collect(),
            pause: None,
        })
        .unwrap()
}

/// HTTP/2 writes need no content-length (gRPC never sends one): a body
/// that ends with the stream is forwarded whole; one the client cuts with
/// a reset is a cut-off body, never applied. `te: trailers` goes on.
#[tokio::test(flavor = "multi_thread")]
async fn undeclared_lengths_are_admitted_and_cut_bodies_never_applied() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    let mut sender = h2_sender(&p).await;
    let resp = sender
        .send_request(put_frames(&p, "/u/whole", "1", &[Ok("abc"), Ok("def")]))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let records = up.records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].target, "/u/whole");
    assert_eq!(records[0].body_len, 6);
    assert!(!records[0].headers.contains_key("content-length"));

    // Cut after its first frame: the client never sees an answer, and the
    // backend never applies the part it got.
    let cut = sender
        .send_request(put_frames(&p, "/u/cut", "2", &[Ok("abc"), Err("cut")]))
        .await;
    assert!(cut.is_err(), "{cut:?}");
    assert_eq!(
        applied_after_a_later_write(&mut sender, &p, &up, "/u/after", "3").await,
        ["/u/whole", "/u/after"]
    );

    // Every declared byte sent, then a reset: the backend (framed by the
    // length) must not get the bytes as a complete request, so the last
    // one waits for the stream's end.
    let mut declared = put_frames(
        &p,
        "/u/declared",
        "4",
        &[Ok("abc"), Ok("def"), Ok(""), Err("cut")],
    );
    declared
        .headers_mut()
        .insert("content-length", http::HeaderValue::from_static("6"));
    assert!(sender.send_request(declared).await.is_err());
    assert_eq!(
        applied_after_a_later_write(&mut sender, &p, &up, "/u/last", "5").await,
        ["/u/whole", "/u/after", "/u/last"]
    );
}

/// A later write on the same connection (answered 200), then time for a
/// cut write's head to reach the backend, which then sees its body fail:
/// the targets the backend applied. (What is checked is that a write is
/// *not* applied, which no event announces: hence the fixed second.)
async fn applied_after_a_later_write(
    sender: &mut hyper::client::conn::http2::SendRequest<Frames>,
    p: &Proxy,
    up: &Upstream,
    path: &str,
    token: &str,
) -> Vec<String> {
    let resp = sender
        .send_request(put_frames(p, path, token, &[Ok("x")]))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    up.records().into_iter().map(|r| r.target).collect()
}

/// `upstream_http2 = true` on an http:// upstream speaks HTTP/2 from the
/// first byte (h2c with prior knowledge), as gRPC servers expect.
#[tokio::test(flavor = "multi_thread")]
async fn an_http_upstream_can_be_spoken_to_in_h2c() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream_with(|stream, service| {
        Box::pin(async move {
            // HTTP/2 only: an HTTP/1.1 request fails here.
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        })
    })
    .await;
    let config = dir.path().join("fencegate.toml");
    std::fs::write(
        &config,
        format!(
            "[[routes]]\nupstream = \"{}\"\nupstream_http2 = true\n",
            up.url()
        ),
    )
    .unwrap();
    let p = ProxyBuilder::with_config(&config, dir.path()).spawn();
    let a = send(
        "PUT",
        &p.url("/h/obj"),
        &[
            ("x-fence-token", "1"),
            ("connection", "te"),
            ("te", "gzip, trailers"),
        ],
        "x",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    // `te: trailers`, alone, goes on to an HTTP/2 upstream (gRPC needs it).
    let te: Vec<_> = up.records()[0]
        .headers
        .get_all("te")
        .iter()
        .cloned()
        .collect();
    assert_eq!(te, ["trailers"]);
    let (s, _, body) = h2("GET", &p.url("/h/obj"), None).await;
    assert_eq!(s, 200);
    assert!(String::from_utf8_lossy(&body).starts_with("applied GET"));
    assert_eq!(up.records().len(), 2);
}

/// A client's RST_STREAM(NO_ERROR) before END_STREAM abandons its request
/// (RFC 9113 section 8.1 gives NO_ERROR a meaning only for a server that
/// answered early), even with every declared byte sent: the backend never
/// gets the body whole, so it never applies the write.
#[tokio::test(flavor = "multi_thread")]
async fn a_reset_with_no_error_before_end_stream_is_a_cut_body() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    for (n, declared) in [(0, Some("10")), (1, None)] {
        let path = format!("/r/k{n}");
        let tcp = tokio::net::TcpStream::connect(p.addr).await.unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let mut client = client.ready().await.unwrap();
        let mut req = http::Request::put(p.url(&path)).header("x-fence-token", "1");
        if let Some(len) = declared {
            req = req.header("content-length", len);
        }
        let (_resp, mut stream) = client.send_request(req.body(()).unwrap(), false).unwrap();
        stream
            .send_data(Bytes::from_static(b"0123456789"), false)
            .unwrap();
        // The write is forwarded: its head has reached the backend.
        eventually(
            "the request's head upstream",
            std::time::Duration::from_secs(10),
            || up.arrivals() == n + 1,
        )
        .await;
        stream.send_reset(h2::Reason::NO_ERROR);
        // A newer write to the same key goes after the abandoned one is
        // over, applied or not.
        assert_eq!(put(&p.url(&path), "2").await.status, 200);
        let applied: Vec<_> = up
            .records()
            .into_iter()
            .filter(|r| r.target == path)
            .map(|r| r.token)
            .collect();
        assert_eq!(applied, [Some("2".to_string())], "declared {declared:?}");
    }
}

/// HEAD over HTTP/2 with the `h2` crate, which refuses any DATA on an
/// answer to HEAD (as curl and Python's h2 do): the status, the headers
/// and the body (which must be empty).
async fn h2_head(addr: std::net::SocketAddr, url: &str) -> (u16, http::HeaderMap, Bytes) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::head(url).body(()).unwrap();
    let (resp, _) = client.send_request(req, true).unwrap();
    let (parts, mut body) = resp.await.expect("an answer to HEAD").into_parts();
    let mut data = Vec::new();
    while let Some(chunk) = body.data().await {
        data.extend_from_slice(&chunk.expect("an answer to HEAD with no DATA"));
    }
    (parts.status.as_u16(), parts.headers, Bytes::from(data))
}

/// An answer to HEAD has no body over HTTP/2 either, whatever made it (a
/// refusal, the upstream), and the head a GET would get.
#[tokio::test(flavor = "multi_thread")]
async fn answers_to_head_have_no_body_over_h2c() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path()).spawn();
    // Refused (an ambiguous path): the problem's head, no body.
    let url = p.url("/a/%2e%2e/obj");
    let (s, h, body) = h2_head(p.addr, &url).await;
    assert_eq!(s, 400);
    assert!(body.is_empty());
    let (gs, gh, gbody) = h2("GET", &url, None).await;
    assert_eq!(gs, 400);
    assert_eq!(h["content-type"], "application/problem+json");
    assert_eq!(h["content-length"], gh["content-length"]);
    assert_eq!(h["content-length"], gbody.len().to_string().as_str());
    // Forwarded to the upstream: its answer, no body.
    let (s, _, body) = h2_head(p.addr, &p.url("/a/obj")).await;
    assert_eq!(s, 200);
    assert!(body.is_empty());
    assert!(up.records().iter().any(|r| r.method == "HEAD"));
}

/// On HTTP/2 a stream is progress, bytes alone are not: a connection that
/// only sends PINGs, or drips one HEADERS frame a byte at a time, has no
/// request and is closed at the idle timeout (found by a black-box attack:
/// such connections held a listener's every slot).
#[tokio::test(flavor = "multi_thread")]
async fn pings_or_a_dripped_headers_frame_do_not_pin_an_h2c_connection() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let up = start_upstream().await;
    let p = ProxyBuilder::new(&up.url(), dir.path())
        .args(&["--header-read-timeout", "1s"])
        .spawn();
    // A frame: 24-bit length, type, flags, stream id.
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    };
    let pinger = |drip: bool| {
        let addr = p.addr;
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend(frame(4, 0, 0, &[]));
        // PING frames, or one HEADERS frame of 100 bytes a byte at a time:
        // about 20 s either way.
        let pieces: Vec<Vec<u8>> = if drip {
            let mut headers = frame(1, 0x4, 1, &[0x82; 100]);
            headers.truncate(9 + 60);
            headers.into_iter().map(|b| vec![b]).collect()
        } else {
            (0..69u8).map(|i| frame(6, 0, 0, &[i; 8])).collect()
        };
        async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(&hello).await.unwrap();
            let (mut rd, mut wr) = s.split();
            let send = async {
                for piece in &pieces {
                    if wr.write_all(piece).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            };
            let closed = async {
                let mut buf = [0u8; 4096];
                while matches!(rd.read(&mut buf).await, Ok(n) if n > 0) {}
            };
            tokio::select! {
                () = closed => true,
                () = send => false,
            }
        }
    };
    let (pings, dripped) = tokio::join!(pinger(false), pinger(true));
    assert!(pings, "PINGs kept the connection for 20 s");
    assert!(
        dripped,
        "a dripped HEADERS frame kept the connection for 20 s"
    );
    assert_eq!(
        metric(
            &p,
            "fencegate_connections_closed_total{listener=\"proxy\",reason=\"idle\"}"
        )
        .await,
        Some(2.0),
        "{}",
        p.stderr()
    );
}
