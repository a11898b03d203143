//! One reading of every HTTP/1 request head, after the lane hands a
//! connection to hyper too (`docs/contract.md`, "Message framing").
//!
//! hyper reads some heads otherwise than the hostile-input rules want: it
//! merges two equal `Content-Length` lines into one, so the request
//! handler cannot tell they were two. The lane refuses such a head, but
//! once it has handed a connection to hyper (HTTP/1.0, a chunked body, an
//! `Expect`, a `Connection` option...), hyper alone read the heads that
//! followed. [`HeadGuard`] sits between the socket and hyper: it reads
//! each head with [`crate::h1::check_request_head`] before hyper gets a
//! byte of it, and skips its body as hyper frames it (a length, or chunks
//! read by hyper's own state machine), so it meets the next head where
//! hyper will. A refused head never reaches hyper: a stand-in request
//! takes its place, which the connection's service answers with the
//! refusal (400, problem+json, connection closed) in its turn after the
//! answers before it; nothing after it is read.
//!
//! A whole head whose framing the guard cannot judge (a `Content-Length`
//! that is no length, a `Transfer-Encoding` hyper refuses) is refused the
//! same way. Where the guard cannot follow (bytes that do not parse as a
//! head, a chunk hyper refuses itself), it passes the bytes up to that
//! point (at most to the head's first empty line) and nothing after them:
//! hyper answers and closes, and no later head is read unchecked. After an
//! upgrade (`Upgrade`, `CONNECT`) the bytes are the tunnel's; such a
//! request not answered `101` ends its connection ([`close_unless_upgraded`]).

use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::ProxyBody;
use crate::h1::{check_request_head, BodyFraming, HeadCheck};

/// The stand-in request's marker header.
const MARKER: &str = "x-fencegate-refused-head";

/// HTTP/2's connection preface: hyper's, not a head to read.
pub(super) const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The marker's value: random per process, so a client cannot send a
/// stand-in of its own.
fn nonce() -> &'static str {
    static NONCE: OnceLock<String> = OnceLock::new();
    NONCE.get_or_init(|| {
        let mut bytes = [0u8; 16];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
            .expect("the system's random source");
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    })
}

/// The refusal a connection's guard made, for its service to answer.
#[derive(Default)]
pub(super) struct Refusal(Mutex<Option<&'static str>>);

impl Refusal {
    /// The answer to `req` if it is the guard's stand-in for a refused head.
    pub(super) fn answer<B>(&self, req: &Request<B>) -> Option<Response<ProxyBody>> {
        let marker = req.headers().get(MARKER)?;
        if marker.as_bytes() != nonce().as_bytes() {
            return None;
        }
        let why = self
            .0
            .lock()
            .expect("refusal lock")
            .take()
            .unwrap_or("malformed request head");
        let mut resp = crate::error::ProxyError::BadFraming(why.into()).into_response(None);
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        Some(resp)
    }
}

/// After a request that may upgrade the connection (`Upgrade` on HTTP/1.1,
/// `CONNECT`), the guard no longer reads heads: if the answer is not `101`
/// the connection must end, or hyper would read the next head unchecked.
pub(super) fn close_unless_upgraded<B>(opaque: bool, resp: &mut Response<B>) {
    if opaque && resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// Whether hyper may upgrade the connection after `req` (its own rule).
pub(super) fn may_upgrade<B>(req: &Request<B>) -> bool {
    req.version() < http::Version::HTTP_2
        && (req.method() == http::Method::CONNECT
            || (req.version() == http::Version::HTTP_11
                && req.headers().contains_key(header::UPGRADE)))
}

/// hyper's chunked body states (`proto/h1/decode.rs`), byte by byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    Start,
    Size,
    SizeLws,
    Extension,
    SizeLf,
    Body(u64),
    BodyCr,
    BodyLf,
    Trailer,
    TrailerLf,
    EndCr,
    EndLf,
}

/// Where the guard is in the byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    Length(u64),
    Chunked(Chunk, u64),
    /// Not HTTP/1 heads any more (HTTP/2, an upgrade): passed as they come.
    Through,
    /// Nothing more is passed to hyper (after a refusal, or where the
    /// guard could not follow); bytes that come are dropped.
    Stopped,
}

pin_project_lite::pin_project! {
    /// A connection handed to hyper, its request heads read first (see the
    /// module).
    pub(super) struct HeadGuard<I> {
        #[pin]
        io: I,
        state: State,
        // Read, not yet judged.
        held: BytesMut,
        // Judged, for hyper.
        ready: BytesMut,
        // No head read yet: an HTTP/2 preface may come.
        first: bool,
        eof: bool,
        max_head: usize,
        refusal: Arc<Refusal>,
    }
}

impl<I> HeadGuard<I> {
    pub(super) fn new(io: I, max_head: usize, refusal: Arc<Refusal>) -> Self {
        HeadGuard {
            io,
            state: State::Head,
            held: BytesMut::new(),
            ready: BytesMut::new(),
            first: true,
            eof: false,
            max_head,
            refusal,
        }
    }
}

/// Judges what `held` allows, moving it to `ready`.
fn advance(
    state: &mut State,
    held: &mut BytesMut,
    ready: &mut BytesMut,
    first: &mut bool,
    eof: bool,
    max_head: usize,
    refusal: &Refusal,
) {
    loop {
        match *state {
            State::Through => {
                ready.extend_from_slice(held);
                held.clear();
                return;
            }
            State::Stopped => {
                held.clear();
                return;
            }
            State::Length(0) => *state = State::Head,
            State::Length(n) => {
                if held.is_empty() {
                    return;
                }
                let k = usize::try_from(n).unwrap_or(usize::MAX).min(held.len());
                ready.extend_from_slice(&held.split_to(k));
                *state = State::Length(n - k as u64);
            }
            State::Chunked(chunk, size) => {
                if held.is_empty() {
                    return;
                }
                match chunked(chunk, size, held) {
                    Ok((used, next)) => {
                        ready.extend_from_slice(&held.split_to(used));
                        *state = next;
                    }
                    // hyper refuses this body at the same byte: it gets the
                    // bytes up to it and nothing after.
                    Err(used) => {
                        ready.extend_from_slice(&held.split_to(used));
                        *state = State::Stopped;
                    }
                }
            }
            State::Head => {
                if held.is_empty() {
                    return;
                }
                if *first {
                    let n = held.len().min(PREFACE.len());
                    if held[..n] == PREFACE[..n] {
                        if n == PREFACE.len() {
                            *state = State::Through;
                            continue;
                        }
                        if !eof {
                            return;
                        }
                    }
                }
                match check_request_head(held) {
                    HeadCheck::Partial if held.len() <= max_head && !eof => return,
                    // Past hyper's buffer (431), cut short, or bytes that
                    // do not parse as a head: hyper refuses them and
                    // closes. It gets them up to the first empty line (the
                    // end of a head however its lines end) and nothing
                    // after: no later head reaches it unjudged.
                    HeadCheck::Partial | HeadCheck::Unreadable => {
                        let end = head_end(held).unwrap_or(held.len());
                        ready.extend_from_slice(&held[..end]);
                        held.clear();
                        *state = State::Stopped;
                    }
                    HeadCheck::Refused(why) => {
                        *refusal.0.lock().expect("refusal lock") = Some(why);
                        ready.extend_from_slice(
                            format!(
                                "GET / HTTP/1.1\r\n{MARKER}: {}\r\nconnection: close\r\n\r\n",
                                nonce()
                            )
                            .as_bytes(),
                        );
                        held.clear();
                        *state = State::Stopped;
                    }
                    HeadCheck::Head { len, body } => {
                        *first = false;
                        ready.extend_from_slice(&held.split_to(len));
                        *state = match body {
                            BodyFraming::Length(n) => State::Length(n),
                            BodyFraming::Chunked => State::Chunked(Chunk::Start, 0),
                            BodyFraming::Opaque => State::Through,
                        };
                    }
                }
            }
        }
    }
}

/// The end of the first empty line in `buf` (after an LF, an LF or CRLF):
/// where a head ends, whether its lines end in CRLF or a bare LF.
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.iter()
        .enumerate()
        .find_map(|(i, b)| match (b, &buf[i + 1..]) {
            (b'\n', [b'\n', ..]) => Some(i + 2),
            (b'\n', [b'\r', b'\n', ..]) => Some(i + 3),
            _ => None,
        })
}

/// Follows a chunked body through `buf` as hyper's decoder does: the
/// bytes it takes and the state after them (back to [`State::Head`] at
/// the body's end), or `Err` with the bytes up to and including the one
/// hyper refuses.
fn chunked(mut chunk: Chunk, mut size: u64, buf: &[u8]) -> Result<(usize, State), usize> {
    let mut i = 0;
    while i < buf.len() {
        if let Chunk::Body(left) = chunk {
            let k = usize::try_from(left)
                .unwrap_or(usize::MAX)
                .min(buf.len() - i);
            i += k;
            let left = left - k as u64;
            chunk = if left == 0 {
                Chunk::BodyCr
            } else {
                Chunk::Body(left)
            };
            continue;
        }
        let b = buf[i];
        i += 1;
        let hex = |b: u8| (b as char).to_digit(16).map(u64::from);
        chunk = match (chunk, b) {
            (Chunk::Start | Chunk::Size, b) if hex(b).is_some() => {
                size = size
                    .checked_mul(16)
                    .and_then(|s| s.checked_add(hex(b).unwrap_or(0)))
                    .ok_or(i)?;
                Chunk::Size
            }
            (Chunk::Size | Chunk::SizeLws, b'\t' | b' ') => Chunk::SizeLws,
            (Chunk::Size | Chunk::SizeLws, b';') => Chunk::Extension,
            (Chunk::Size | Chunk::SizeLws | Chunk::Extension, b'\r') => Chunk::SizeLf,
            (Chunk::Extension, b'\n') => return Err(i),
            (Chunk::Extension, _) => Chunk::Extension,
            (Chunk::SizeLf, b'\n') if size == 0 => Chunk::EndCr,
            (Chunk::SizeLf, b'\n') => Chunk::Body(std::mem::take(&mut size)),
            (Chunk::BodyCr, b'\r') => Chunk::BodyLf,
            (Chunk::BodyLf, b'\n') => Chunk::Start,
            (Chunk::Trailer, b'\r') => Chunk::TrailerLf,
            (Chunk::Trailer, _) => Chunk::Trailer,
            (Chunk::TrailerLf, b'\n') => Chunk::EndCr,
            (Chunk::EndCr, b'\r') => Chunk::EndLf,
            (Chunk::EndCr, _) => Chunk::Trailer,
            (Chunk::EndLf, b'\n') => return Ok((i, State::Head)),
            _ => return Err(i),
        };
    }
    Ok((i, State::Chunked(chunk, size)))
}

impl<I: AsyncRead> AsyncRead for HeadGuard<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let mut this = self.project();
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(buf.remaining());
                buf.put_slice(&this.ready[..n]);
                this.ready.advance(n);
                if this.ready.is_empty() {
                    // Given back, not kept for the connection's life: an
                    // HTTP/2 connection passes through here once, and an
                    // idle one would hold it (issue 44).
                    *this.ready = BytesMut::new();
                }
                return Poll::Ready(Ok(()));
            }
            if *this.eof {
                return Poll::Ready(Ok(()));
            }
            match *this.state {
                // Passed as it comes, with no copy.
                State::Through if this.held.is_empty() => return this.io.poll_read(cx, buf),
                // A body of known length is read straight into hyper's
                // buffer, up to its end.
                State::Length(left) if left > 0 && this.held.is_empty() => {
                    let k = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(buf.remaining());
                    let mut part = ReadBuf::new(buf.initialize_unfilled_to(k));
                    std::task::ready!(this.io.as_mut().poll_read(cx, &mut part))?;
                    let got = part.filled().len();
                    if got > 0 {
                        buf.advance(got);
                        *this.state = State::Length(left - got as u64);
                    }
                    return Poll::Ready(Ok(()));
                }
                _ => {}
            }
            this.held.reserve(8 * 1024);
            let got = std::task::ready!(tokio_util::io::poll_read_buf(
                this.io.as_mut(),
                cx,
                this.held
            ))?;
            if got == 0 {
                *this.eof = true;
            }
            advance(
                this.state,
                this.held,
                this.ready,
                this.first,
                *this.eof,
                *this.max_head,
                this.refusal,
            );
            if *this.eof && matches!(*this.state, State::Head) && !this.held.is_empty() {
                // A head cut short by the end: hyper sees what came.
                this.ready.extend_from_slice(this.held);
                this.held.clear();
            }
            if this.held.is_empty() {
                // Taken again when bytes are to be judged (as `ready`).
                *this.held = BytesMut::new();
            }
        }
    }
}

impl<I: AsyncWrite> AsyncWrite for HeadGuard<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What hyper is given of `input`, fed in pieces of `step` bytes.
    fn passed(input: &[u8], step: usize) -> (Vec<u8>, State, Option<&'static str>) {
        let refusal = Refusal::default();
        let (mut state, mut held, mut ready, mut first) =
            (State::Head, BytesMut::new(), BytesMut::new(), true);
        for piece in input.chunks(step) {
            held.extend_from_slice(piece);
            advance(
                &mut state, &mut held, &mut ready, &mut first, false, 8192, &refusal,
            );
        }
        let why = *refusal.0.lock().unwrap();
        (ready.to_vec(), state, why)
    }

    #[test]
    fn heads_and_bodies_are_followed_as_hyper_frames_them() {
        let plain = b"PUT /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc".as_slice();
        let chunked = b"PUT /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n".as_slice();
        let ten = b"GET /c HTTP/1.0\r\nConnection: keep-alive\r\n\r\n".as_slice();
        let all = [plain, chunked, ten, plain].concat();
        for step in [1, 2, 7, all.len()] {
            let (out, state, why) = passed(&all, step);
            assert_eq!(out, all, "step {step}");
            assert_eq!(state, State::Head, "step {step}");
            assert_eq!(why, None);
        }
    }

    #[test]
    fn a_second_content_length_is_refused_wherever_it_comes() {
        let bad = b"PUT /s HTTP/1.0\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello";
        let before = b"PUT /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n";
        let input = [before.as_slice(), bad, b"GET /next HTTP/1.1\r\n\r\n"].concat();
        for step in [1, 5, input.len()] {
            let (out, state, why) = passed(&input, step);
            assert_eq!(state, State::Stopped);
            assert_eq!(why, Some("more than one Content-Length header"));
            let text = String::from_utf8(out).unwrap();
            let stand_in = text
                .strip_prefix(std::str::from_utf8(before).unwrap())
                .unwrap();
            assert!(stand_in.starts_with("GET / HTTP/1.1\r\nx-fencegate-refused-head: "));
            assert!(!text.contains("hello") && !text.contains("/next"), "{text}");
        }
    }

    #[test]
    fn a_length_of_any_number_of_digits_is_followed_and_judged() {
        // hyper reads 19 digits and more (leading zeros): so does the guard,
        // and it finds the second line and the heads after the first.
        let bad = b"PUT /s HTTP/1.1\r\nContent-Length: 0000000000000000005\r\nContent-Length: 5\r\n\r\nhello";
        let first = b"GET /a HTTP/1.1\r\nContent-Length: 0000000000000000000\r\n\r\n";
        for input in [bad.to_vec(), [first.as_slice(), bad].concat()] {
            let (out, state, why) = passed(&input, input.len());
            assert_eq!(state, State::Stopped);
            assert_eq!(why, Some("more than one Content-Length header"));
            assert!(!out.windows(5).any(|w| w == b"hello"));
        }
        let two = [first.as_slice(), first].concat();
        assert_eq!(passed(&two, 3).0, two);
        // A whole head whose length is no length (past hyper's largest,
        // not digits): the stand-in, not the bytes.
        for value in ["18446744073709551614", "99999999999999999999", "5x"] {
            let input = format!(
                "PUT /s HTTP/1.1\r\nContent-Length: {value}\r\n\r\nGET /x HTTP/1.1\r\n\r\n"
            );
            let (out, state, why) = passed(input.as_bytes(), input.len());
            assert_eq!(state, State::Stopped);
            assert_eq!(why, Some("a Content-Length that is not a length"));
            assert!(out.starts_with(b"GET / HTTP/1.1\r\nx-fencegate-refused-head: "));
        }
    }

    #[test]
    fn what_hyper_refuses_is_passed_up_to_there_and_nothing_after() {
        // A chunk size hyper refuses: the bytes up to it, not the request
        // behind it.
        let input =
            b"PUT /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nGET /x HTTP/1.1\r\n\r\n";
        let (out, state, _) = passed(input, input.len());
        assert_eq!(state, State::Stopped);
        assert!(out.ends_with(b"\r\n\r\nz"));
        // A head that does not parse.
        let input = b"PUT /a HTTP/1.1\r\nX-A: a\r\n\tb\r\n\r\nGET /x HTTP/1.1\r\n\r\n";
        let (out, state, _) = passed(input, input.len());
        assert_eq!(state, State::Stopped);
        assert_eq!(out, b"PUT /a HTTP/1.1\r\nX-A: a\r\n\tb\r\n\r\n");
        // HTTP/2's preface, and an upgrade: not heads any more.
        for input in [
            PREFACE.to_vec(),
            b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n\x81\x80".to_vec(),
        ] {
            let (out, state, _) = passed(&input, 3);
            assert_eq!((out, state), (input.clone(), State::Through));
        }
    }
}
