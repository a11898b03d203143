//! How hyper reads the bytes the lane reads, for the differential tests
//! (`tests.rs`) and the fuzz targets (`fuzz/`, built with the `fuzzing`
//! feature): hyper's HTTP/1.1 server and client over an in-memory pipe,
//! and the lane's readers used the way the request path uses them.

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, StatusCode};

use super::{parse_response, BadResponse, ChunkedDecoder, Framing};

/// The body `input` decodes to, fed to the decoder `step` bytes at a
/// time; an error if it is malformed or ends early.
pub fn decode_all(input: &[u8], step: usize) -> Result<Vec<u8>, BadResponse> {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut fed = 0;
    loop {
        match decoder.next(&mut buf)? {
            None => return Ok(out),
            Some(data) if !data.is_empty() => out.extend_from_slice(&data),
            Some(_) => {
                if fed == input.len() {
                    return Err(BadResponse("input ended"));
                }
                let n = step.min(input.len() - fed);
                buf.extend_from_slice(&input[fed..fed + n]);
                fed += n;
            }
        }
    }
}

/// How hyper's HTTP/1.1 server reads `bytes`: the first request's
/// method, target, headers and body, or `None` if it refuses them.
pub fn server_reads(
    rt: &tokio::runtime::Runtime,
    bytes: &[u8],
) -> Option<(http::request::Parts, Bytes)> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    rt.block_on(async {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let service =
            hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let tx = tx.clone();
                async move {
                    let (parts, body) = req.into_parts();
                    if let Ok(body) = body.collect().await {
                        let _ = tx.send((parts, body.to_bytes()));
                    }
                    Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Empty::<
                        Bytes,
                    >::new(
                    )))
                }
            });
        // Half-close: the end of the bytes (below) is not the client gone;
        // a request already read is still served.
        let conn = hyper::server::conn::http1::Builder::new()
            .half_close(true)
            .serve_connection(hyper_util::rt::TokioIo::new(server), service);
        // The connection keeps the service (and the sender) until it ends:
        // a refused head ends it, and the channel with it.
        tokio::spawn(conn);
        client.write_all(bytes).await.ok()?;
        // The end of the bytes: a head or body cut short is refused, not
        // waited for.
        client.shutdown().await.ok()?;
        tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
            .await
            .expect("hyper neither read nor refused the request")
    })
}

/// How hyper's HTTP/1.1 client reads `bytes` as the answer to a GET (the
/// server closes after them): status, headers and body, or `None` if it
/// refuses them.
pub fn client_reads(
    rt: &tokio::runtime::Runtime,
    bytes: &[u8],
) -> Option<(StatusCode, HeaderMap, Bytes)> {
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let bytes = bytes.to_vec();
    rt.block_on(async move {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut b = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match server.read(&mut b).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&b[..n]),
                }
            }
            let _ = server.write_all(&bytes).await;
            let _ = server.shutdown().await;
        });
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(client))
                .await
                .ok()?;
        tokio::spawn(conn);
        let request = http::Request::get("/")
            .header("host", "a")
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        let wait = std::time::Duration::from_secs(5);
        let resp = tokio::time::timeout(wait, send.send_request(request))
            .await
            .expect("hyper neither read nor refused the answer")
            .ok()?;
        let (parts, body) = resp.into_parts();
        let body = tokio::time::timeout(wait, body.collect())
            .await
            .expect("hyper neither read nor refused the body")
            .ok()?
            .to_bytes();
        Some((parts.status, parts.headers, body))
    })
}

/// How the lane reads the same answer (`upstream::h1`): interim heads
/// skipped, then the body by its framing, the upstream closing after it.
pub fn lane_reads(bytes: &[u8]) -> Option<(StatusCode, HeaderMap, Bytes)> {
    let mut at = 0;
    let head = loop {
        let head = parse_response(&bytes[at..], false).ok()??;
        if head.status == StatusCode::SWITCHING_PROTOCOLS {
            return None;
        }
        if !head.status.is_informational() {
            break head;
        }
        at += head.len;
    };
    let rest = &bytes[at + head.len..];
    let body = match head.framing {
        Framing::Empty => Bytes::new(),
        Framing::Length(n) => {
            let n = usize::try_from(n).ok()?;
            Bytes::copy_from_slice(rest.get(..n)?)
        }
        Framing::Close => Bytes::copy_from_slice(rest),
        Framing::Chunked => Bytes::from(decode_all(rest, rest.len().max(1)).ok()?),
    };
    Some((head.status, head.headers, body))
}
