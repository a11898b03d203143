//! A bare HTTP/1.1 proxy on `httparse` with the steady fenced write's
//! check, started the way `scripts/ab.sh` starts fencegate (`--upstream`;
//! other flags ignored) and printing the same `listening proxy=` line.
//!
//! One task per client connection, which owns one upstream connection:
//! read a request head and its `Content-Length` body, parse the
//! `X-Fence-Token` and compare it with the highest seen (an atomic), write
//! head and body upstream as received in one write, read the response head
//! and body, write them to the client in one write. No chunked bodies, no
//! header edits, no pooling across clients, no timeouts: a bound, not a
//! proxy.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

static HIGHEST: AtomicU64 = AtomicU64::new(0);

/// A parsed head: its length, its body's length, and the token it carries.
struct Head {
    len: usize,
    body: usize,
    token: Option<u64>,
}

fn parse(buf: &[u8], request: bool) -> io::Result<Option<Head>> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let bad = |e| io::Error::new(io::ErrorKind::InvalidData, format!("{e:?}"));
    let (status, headers) = if request {
        let mut r = httparse::Request::new(&mut headers);
        let s = r.parse(buf).map_err(bad)?;
        (s, r.headers)
    } else {
        let mut r = httparse::Response::new(&mut headers);
        let s = r.parse(buf).map_err(bad)?;
        (s, r.headers)
    };
    let httparse::Status::Complete(len) = status else {
        return Ok(None);
    };
    let mut head = Head {
        len,
        body: 0,
        token: None,
    };
    for h in headers.iter() {
        let value = std::str::from_utf8(h.value).ok().map(str::trim);
        if h.name.eq_ignore_ascii_case("content-length") {
            head.body = value
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(httparse::Error::HeaderValue))?;
        } else if h.name.eq_ignore_ascii_case("x-fence-token") {
            head.token = value.and_then(|v| v.parse().ok());
        }
    }
    Ok(Some(head))
}

/// Reads one whole message (head and body) into the front of `buf`.
async fn read_message(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    request: bool,
) -> io::Result<Option<Head>> {
    loop {
        if let Some(head) = parse(buf, request)? {
            while buf.len() < head.len + head.body {
                buf.reserve(head.len + head.body - buf.len());
                if s.read_buf(buf).await? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
            return Ok(Some(head));
        }
        buf.reserve(16 << 10);
        if s.read_buf(buf).await? == 0 {
            return Ok(None);
        }
    }
}

async fn serve(mut client: TcpStream, upstream: String) -> io::Result<()> {
    let mut up: Option<TcpStream> = None;
    let mut cbuf = Vec::with_capacity(16 << 10);
    let mut ubuf = Vec::with_capacity(16 << 10);
    while let Some(req) = read_message(&mut client, &mut cbuf, true).await? {
        let end = req.len + req.body;
        let refusal: Option<&[u8]> = match req.token {
            None => Some(b"HTTP/1.1 428 Precondition Required\r\ncontent-length: 0\r\n\r\n"),
            Some(t) if t < HIGHEST.fetch_max(t, Ordering::AcqRel) => {
                Some(b"HTTP/1.1 409 Conflict\r\ncontent-length: 0\r\n\r\n")
            }
            Some(_) => None,
        };
        if let Some(r) = refusal {
            cbuf.drain(..end);
            client.write_all(r).await?;
            continue;
        }
        let u = match &mut up {
            Some(u) => u,
            None => {
                let s = TcpStream::connect(&upstream).await?;
                s.set_nodelay(true)?;
                up.insert(s)
            }
        };
        u.write_all(&cbuf[..end]).await?;
        cbuf.drain(..end);
        let resp = read_message(u, &mut ubuf, false)
            .await?
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        let end = resp.len + resp.body;
        client.write_all(&ubuf[..end]).await?;
        ubuf.drain(..end);
    }
    Ok(())
}

fn main() -> io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let upstream = args
        .iter()
        .position(|a| a == "--upstream")
        .and_then(|i| args.get(i + 1))
        .expect("--upstream http://HOST:PORT")
        .trim_start_matches("http://")
        .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        println!("listening proxy={} admin=none", listener.local_addr()?);
        loop {
            let (c, _) = listener.accept().await?;
            c.set_nodelay(true)?;
            tokio::spawn(serve(c, upstream.clone()));
        }
    })
}
