//! HTTP/1.1 heads read and written by fencegate itself, on the request
//! path's own lane (issue 32; `docs/architecture.md`, "The request path's
//! engine").
//!
//! The lane takes only requests that every HTTP/1.1 reader reads one way:
//! [`parse_request`] says [`Parsed::Other`] for anything else (any
//! `Transfer-Encoding`, `Upgrade`, `Expect` or `TE`, a repeated or
//! non-digit `Content-Length`, bare LF, an absolute or asterisk target,
//! HTTP/1.0, `CONNECT`, a connection option other than `keep-alive` and
//! `close`, too many headers), and the connection goes to hyper at that
//! request's first byte, where the hostile-input rules of
//! `docs/contract.md` are applied as before. So this parser never has to
//! decide an ambiguous request: it only has to recognise a plain one, and
//! read it as hyper would (`tests` compare the two on random heads).
//!
//! The upstream's answers are read with [`parse_response`] and
//! [`ChunkedDecoder`]; heads go out through [`write_request_head`] and
//! [`write_response_head`].

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Uri};

/// Headers in one head, as hyper's HTTP/1.1 server allows by default.
pub const MAX_HEADERS: usize = 100;

/// A request head this lane serves.
#[derive(Debug)]
pub struct RequestHead {
    pub parts: http::request::Parts,
    /// Bytes of the head, up to and including its empty line.
    pub len: usize,
    /// The body's length (`Content-Length`, else 0).
    pub body: u64,
    /// The client asked for the connection to end after this exchange.
    pub close: bool,
}

/// What the bytes of a connection start with.
#[derive(Debug)]
// Made once per request and moved once: a box would be an allocation more.
#[allow(clippy::large_enum_variant)]
pub enum Parsed {
    /// Not a whole head yet.
    Partial,
    /// A plain request this lane serves.
    Head(RequestHead),
    /// Anything else, for hyper to read (and refuse, if it must).
    Other,
    /// Refused with 400 and the connection closed (framing that hyper
    /// would read, but the hostile-input rules refuse).
    Refused(&'static str),
}

/// Reads the request head at the start of `buf` (see the module's rules).
pub fn parse_request(buf: &[u8]) -> Parsed {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Other,
    };
    if req.version != Some(1) || !crlf_only(&buf[..len]) {
        return Parsed::Other;
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return Parsed::Other;
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Parsed::Other;
    };
    if method == Method::CONNECT || !path.starts_with('/') {
        return Parsed::Other;
    }
    let Ok(uri) = Uri::try_from(path) else {
        return Parsed::Other;
    };
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    let mut body = None;
    let mut close = false;
    for h in req.headers.iter() {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) else {
            return Parsed::Other;
        };
        if name == header::TRANSFER_ENCODING
            || name == header::UPGRADE
            || name == header::EXPECT
            || name == header::TE
        {
            return Parsed::Other;
        }
        if name == header::CONTENT_LENGTH {
            match (body, digits(h.value)) {
                (None, Some(n)) => body = Some(n),
                // hyper would merge two equal lines into one; the rule is
                // that a repeated length is refused, whatever its values.
                (Some(_), _) => return Parsed::Refused("more than one Content-Length header"),
                (None, None) => return Parsed::Other,
            }
        }
        if name == header::CONNECTION {
            for option in h.value.split(|b| *b == b',') {
                let option = option.trim_ascii();
                if option.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if !option.eq_ignore_ascii_case(b"keep-alive") {
                    return Parsed::Other;
                }
            }
        }
        headers.append(name, value);
    }
    let mut parts = http::Request::new(()).into_parts().0;
    parts.method = method;
    parts.uri = uri;
    parts.version = http::Version::HTTP_11;
    parts.headers = headers;
    Parsed::Head(RequestHead {
        parts,
        len,
        body: body.unwrap_or(0),
        close,
    })
}

/// How the bytes after a request head are framed, as hyper reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    Length(u64),
    Chunked,
    /// The connection may stop being HTTP/1 after this request (an
    /// `Upgrade` on HTTP/1.1, `CONNECT`): what follows is not read as heads.
    Opaque,
}

/// A request head as hyper will read it, judged by the lane's rules: for
/// the heads hyper reads after the lane handed a connection over
/// (`server::heads`).
#[derive(Debug, PartialEq, Eq)]
pub enum HeadCheck {
    /// Not a whole head yet.
    Partial,
    /// A head of `len` bytes, and how its body is framed.
    Head { len: usize, body: BodyFraming },
    /// Bytes that do not parse as a head: hyper refuses them itself, and
    /// closes the connection after its answer. Where the head ends is not
    /// known.
    Unreadable,
    /// A whole head refused with 400: one hyper would read but the
    /// hostile-input rules refuse (hyper merges two equal `Content-Length`
    /// lines into one), or one whose framing cannot be judged (a
    /// `Content-Length` that is no length, a `Transfer-Encoding` on
    /// HTTP/1.0 or not ending in `chunked`), which hyper would refuse too.
    Refused(&'static str),
}

/// Reads the request head at the start of `buf` the way hyper's server
/// does (same parser, same framing rules), applying the lane's refusals.
pub fn check_request_head(buf: &[u8]) -> HeadCheck {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return HeadCheck::Partial,
        Err(_) => return HeadCheck::Unreadable,
    };
    let http11 = req.version == Some(1);
    let mut opaque = req.method == Some("CONNECT");
    let mut length = None;
    let mut lengths = 0;
    let mut chunked = None;
    // Why the framing cannot be judged, if it cannot; every line is still
    // read, so a second `Content-Length` is named whatever came first.
    let mut unjudged = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            lengths += 1;
            // hyper ignores a length after a transfer coding.
            if chunked.is_none() {
                match digits(h.value) {
                    Some(n) => length = Some(n),
                    None => {
                        unjudged.get_or_insert("a Content-Length that is not a length");
                    }
                }
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if !http11 {
                unjudged.get_or_insert("Transfer-Encoding in an HTTP/1.0 request");
            }
            let last = h.value.rsplit(|b| *b == b',').next().unwrap_or_default();
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            opaque |= http11;
        }
    }
    if lengths > 1 {
        return HeadCheck::Refused("more than one Content-Length header");
    }
    if let Some(why) = unjudged {
        return HeadCheck::Refused(why);
    }
    let body = match (opaque, chunked, length) {
        (_, Some(false), _) => {
            return HeadCheck::Refused("a Transfer-Encoding that does not end in chunked")
        }
        (true, _, _) => BodyFraming::Opaque,
        (false, Some(true), _) => BodyFraming::Chunked,
        (false, None, n) => BodyFraming::Length(n.unwrap_or(0)),
    };
    HeadCheck::Head { len, body }
}

/// Every line ends in CRLF: no bare LF, which some readers take as a line
/// end and others as part of a value.
fn crlf_only(head: &[u8]) -> bool {
    let mut prev = 0u8;
    for &b in head {
        if (b == b'\n') != (prev == b'\r') {
            return false;
        }
        prev = b;
    }
    true
}

/// The largest body length hyper reads (`DecodedLength`'s `MAX_LEN`: the
/// two values above it stand for "chunked" and "until the close").
pub const MAX_LENGTH: u64 = u64::MAX - 2;

/// A `Content-Length` value read as hyper reads one (`headers.rs`'s
/// `from_digits`, then `DecodedLength::checked_new`): ASCII digits and
/// nothing else, at least one, as many as come (leading zeros too), whose
/// value is at most [`MAX_LENGTH`]. Any narrower, and a length hyper reads
/// would be one the lane's readers cannot judge.
fn digits(value: &[u8]) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for &b in value {
        if !b.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    (n <= MAX_LENGTH).then_some(n)
}

/// How a response's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body (an answer to HEAD, 204, 304).
    Empty,
    Length(u64),
    Chunked,
    /// Until the upstream closes the connection.
    Close,
}

/// An upstream's response head.
#[derive(Debug)]
pub struct ResponseHead {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub len: usize,
    pub framing: Framing,
    /// The connection cannot carry another request after this one.
    pub close: bool,
}

/// Why an upstream's head could not be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the upstream's response head is malformed: {0}")]
pub struct BadResponse(pub &'static str);

/// Reads a response head at the start of `buf`; `Ok(None)` if it is not
/// whole yet. An interim (1xx) head comes back like any other; the caller
/// skips it.
pub fn parse_response(buf: &[u8], to_head: bool) -> Result<Option<ResponseHead>, BadResponse> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut slots);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(BadResponse("it does not parse")),
    };
    let status = resp
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or(BadResponse("no status"))?;
    let mut headers = HeaderMap::with_capacity(resp.headers.len());
    let mut length: Option<u64> = None;
    let mut chunked = None;
    let mut close = resp.version != Some(1);
    for h in resp.headers.iter() {
        let name =
            HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| BadResponse("a header name"))?;
        let value = HeaderValue::from_bytes(h.value).map_err(|_| BadResponse("a header value"))?;
        if name == header::CONTENT_LENGTH {
            // Repeated lines must agree (RFC 9110 section 8.6); the client
            // gets one.
            let repeated = length.is_some();
            for item in h.value.split(|b| *b == b',') {
                let n = digits(item.trim_ascii()).ok_or(BadResponse("Content-Length"))?;
                if length.is_some_and(|l| l != n) {
                    return Err(BadResponse("Content-Length values differ"));
                }
                length = Some(n);
            }
            if repeated {
                continue;
            }
        } else if name == header::TRANSFER_ENCODING {
            // hyper's client reads a value that is not visible ASCII as no
            // `chunked` (and the body as running to the close): refused,
            // so that no reader frames the answer otherwise (found by
            // fuzzing).
            if value.to_str().is_err() {
                return Err(BadResponse("a Transfer-Encoding that is not ASCII"));
            }
            let last = h.value.rsplit(|b| *b == b',').next().unwrap_or_default();
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name == header::CONNECTION {
            close |= h
                .value
                .split(|b| *b == b',')
                .any(|o| o.trim_ascii().eq_ignore_ascii_case(b"close"));
        }
        headers.append(name, value);
    }
    let framing = if to_head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        Framing::Empty
    } else if chunked.is_some() && resp.version == Some(0) {
        // HTTP/1.0 has no transfer codings: hyper's client refuses such an
        // answer (RFC 9112 section 6.1), and so does the lane.
        return Err(BadResponse("Transfer-Encoding in an HTTP/1.0 answer"));
    } else {
        match (chunked, length) {
            // Both: the transfer coding wins and the length goes (RFC 9112
            // section 6.3), as hyper reads it; the connection is not
            // reused after such an answer.
            (Some(chunked), Some(_)) => {
                headers.remove(header::CONTENT_LENGTH);
                close = true;
                if chunked {
                    Framing::Chunked
                } else {
                    Framing::Close
                }
            }
            (Some(true), None) => Framing::Chunked,
            (Some(false), None) | (None, None) => Framing::Close,
            (None, Some(n)) => Framing::Length(n),
        }
    };
    close |= framing == Framing::Close;
    Ok(Some(ResponseHead {
        status,
        headers,
        len,
        framing,
        close,
    }))
}

/// A chunked body's decoder, fed from a buffer that fills as bytes come.
/// It reads as strictly as hyper's client (whose rules the comments
/// name): what hyper refuses is refused here, so the lane never passes on
/// a body that hyper's path would have cut.
#[derive(Debug, Default)]
pub struct ChunkedDecoder {
    state: Chunk,
    /// Extension bytes seen in the whole body (hyper allows 16 KiB).
    extensions: u64,
    /// Trailer lines seen, each with its CRLF (hyper reads at most 100
    /// lines and 16 KiB, and refuses a block that is no header block).
    trailers: Vec<u8>,
    trailer_lines: usize,
}

#[derive(Debug, Default, Clone, Copy)]
enum Chunk {
    /// Before a chunk's size line.
    #[default]
    Size,
    /// Data bytes left in the current chunk.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer lines, up to the empty one.
    Trailers,
    Done,
}

/// Longest chunk-size line or trailer line waited for.
const MAX_LINE: usize = 64 * 1024;

/// hyper's `CHUNKED_EXTENSIONS_LIMIT`: extension bytes in one body.
const MAX_EXTENSIONS: u64 = 16 * 1024;

/// hyper's limits on a body's trailers: bytes and lines.
const MAX_TRAILER_BYTES: usize = 16 * 1024;
const MAX_TRAILER_LINES: usize = MAX_HEADERS;

/// Reads a chunk-size line as hyper does: one hex digit at least (a size
/// past 64 bits refused), spaces or tabs, an extension after `;` (any
/// byte but CR and LF: a bare LF in it is refused, since some readers end
/// the line there), and CRLF. `Ok(None)`: not whole yet; else the line's
/// length, the size and the extension bytes.
fn chunk_size_line(buf: &[u8]) -> Result<Option<(usize, u64, u64)>, BadResponse> {
    #[derive(PartialEq)]
    enum At {
        Start,
        Size,
        Space,
        Extension,
        Lf,
    }
    let mut at = At::Start;
    let mut size: u64 = 0;
    let mut extension = 0u64;
    for (i, &b) in buf.iter().enumerate() {
        let digit = (b as char).to_digit(16);
        at = match (at, b, digit) {
            (At::Start | At::Size, _, Some(d)) => {
                size = size
                    .checked_mul(16)
                    .and_then(|s| s.checked_add(u64::from(d)))
                    .ok_or(BadResponse("a chunk size past 64 bits"))?;
                At::Size
            }
            (At::Start, _, None) => return Err(BadResponse("a chunk size line without a size")),
            (At::Size | At::Space, b' ' | b'\t', _) => At::Space,
            (At::Size | At::Space, b';', _) => At::Extension,
            (At::Size | At::Space | At::Extension, b'\r', _) => At::Lf,
            (At::Size | At::Space, _, _) => return Err(BadResponse("a chunk size")),
            (At::Extension, b'\n', _) => return Err(BadResponse("a bare LF in a chunk extension")),
            (At::Extension, _, _) => {
                extension += 1;
                At::Extension
            }
            (At::Lf, b'\n', _) => return Ok(Some((i + 1, size, extension))),
            (At::Lf, _, _) => return Err(BadResponse("a chunk size line not ended by CRLF")),
        };
    }
    Ok(None)
}

impl ChunkedDecoder {
    /// Takes what it can from `buf`: `Ok(Some(data))` (empty when it needs
    /// more bytes), `Ok(None)` at the body's end (trailers skipped).
    pub fn next(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, BadResponse> {
        loop {
            match self.state {
                Chunk::Done => return Ok(None),
                Chunk::Data(left) => {
                    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                    if n == 0 {
                        return Ok(Some(Bytes::new()));
                    }
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left)
                    };
                    return Ok(Some(buf.split_to(n).freeze()));
                }
                Chunk::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Some(Bytes::new()));
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(BadResponse("a chunk does not end in CRLF"));
                    }
                    buf.advance(2);
                    self.state = Chunk::Size;
                }
                Chunk::Size => match chunk_size_line(buf)? {
                    Some((used, size, extension)) => {
                        self.extensions += extension;
                        if self.extensions >= MAX_EXTENSIONS {
                            return Err(BadResponse("chunk extensions over 16 KiB"));
                        }
                        buf.advance(used);
                        self.state = if size == 0 {
                            Chunk::Trailers
                        } else {
                            Chunk::Data(size)
                        };
                    }
                    None if buf.len() <= MAX_LINE => return Ok(Some(Bytes::new())),
                    None => return Err(BadResponse("a chunk size")),
                },
                Chunk::Trailers => {
                    // A line runs to its first CR, which LF must follow. A
                    // bare LF is refused (hyper's client refuses it; some
                    // readers end the line there): found by fuzzing.
                    let end = buf.iter().position(|b| *b == b'\r' || *b == b'\n');
                    if end.is_some_and(|i| buf[i] == b'\n') {
                        return Err(BadResponse("a bare LF in a trailer line"));
                    }
                    let Some(cr) = end else {
                        if self.trailers.len() + buf.len() > MAX_TRAILER_BYTES {
                            return Err(BadResponse("trailers over 16 KiB"));
                        }
                        return Ok(Some(Bytes::new()));
                    };
                    if buf.len() < cr + 2 {
                        return Ok(Some(Bytes::new()));
                    }
                    if buf[cr + 1] != b'\n' {
                        return Err(BadResponse("a trailer line not ended by CRLF"));
                    }
                    if cr == 0 {
                        buf.advance(2);
                        self.trailers_valid()?;
                        self.state = Chunk::Done;
                        continue;
                    }
                    self.trailer_lines += 1;
                    if self.trailer_lines > MAX_TRAILER_LINES
                        || self.trailers.len() + cr + 2 > MAX_TRAILER_BYTES
                    {
                        return Err(BadResponse("too many trailers"));
                    }
                    self.trailers.extend_from_slice(&buf[..cr + 2]);
                    buf.advance(cr + 2);
                }
            }
        }
    }

    /// The trailer block is a header block, every name and value valid
    /// (they are not passed on, but hyper refuses the body otherwise).
    fn trailers_valid(&mut self) -> Result<(), BadResponse> {
        if self.trailers.is_empty() {
            return Ok(());
        }
        self.trailers.extend_from_slice(b"\r\n");
        let mut slots = [httparse::EMPTY_HEADER; MAX_TRAILER_LINES];
        match httparse::parse_headers(&self.trailers, &mut slots) {
            Ok(httparse::Status::Complete((_, headers))) => {
                for h in headers.iter() {
                    HeaderName::from_bytes(h.name.as_bytes())
                        .map_err(|_| BadResponse("a trailer name"))?;
                    HeaderValue::from_bytes(h.value).map_err(|_| BadResponse("a trailer value"))?;
                }
                self.trailers.clear();
                Ok(())
            }
            _ => Err(BadResponse("the trailers")),
        }
    }
}

/// Writes a request head: request line, headers as given, empty line.
pub fn write_request_head(out: &mut Vec<u8>, method: &Method, target: &str, headers: &HeaderMap) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    write_headers(out, headers);
}

/// Writes a response head: status line, headers as given, empty line.
pub fn write_response_head(out: &mut Vec<u8>, status: StatusCode, headers: &HeaderMap) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    write_headers(out, headers);
}

fn write_headers(out: &mut Vec<u8>, headers: &HeaderMap) {
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(any(test, feature = "fuzzing"))]
pub mod reference;
#[cfg(test)]
mod tests;
