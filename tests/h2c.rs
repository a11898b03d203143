//! HTTP/2 with prior knowledge (h2c) on the plain listener: the same
//! answers, the same key parse of `:path`, as over HTTP/1.1.

mod common;

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
    let resp = client
        .request(req.body(full("h2 body")).unwrap())
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
    assert_eq!(body, Bytes::from("applied GET /a/obj len=7"));
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
