//! A refusal that reaches the client: the request body it refused is read
//! and thrown away while the answer goes out (nginx's `lingering_close`).
//!
//! fencegate refuses a write before reading its body. If the body is left
//! unread, HTTP/1.1 closes the connection with the upload still arriving,
//! and the kernel answers those bytes with a reset that can destroy the
//! answer before the client reads it; HTTP/2 resets the stream right after
//! the answer, which some clients (curl 7.88) take as a failure of the
//! whole exchange. A stale writer that sees a broken connection does not
//! learn that it lost its lock. So the request body is read beside the
//! answer, bounded in time, and the connection or stream ends cleanly when
//! the upload does.

use std::time::Duration;

use super::body::RequestBody;
use http::{header, HeaderMap, Method, Version};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Instant;

/// Longest a refused upload is read for (nginx's `lingering_time`).
pub(super) const LINGER_TIME: Duration = Duration::from_secs(30);
/// Longest wait for the next bytes of a refused upload (nginx's
/// `lingering_timeout`).
pub(super) const LINGER_IDLE: Duration = Duration::from_secs(5);
/// A refused HTTP/1.1 body declared at most this long is read to its end
/// and the connection kept; a longer or chunked one is answered with
/// `Connection: close` (it may not all arrive within [`LINGER_TIME`]).
pub(super) const LINGER_KEEP_BYTES: u64 = 1 << 20;

/// A request's `Content-Length`, if it has one that parses.
pub(super) fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What becomes of a refused request's unread body.
pub(super) enum Unread {
    /// Nothing to read: the request has no body (a zero length, or no
    /// body at all on HTTP/2).
    None,
    /// Not read: the connection closes after the answer (an HTTP/1.1
    /// `Expect: 100-continue` whose body was never asked for, or framing
    /// that cannot be trusted).
    Close,
    /// Read and thrown away beside the answer ([`spawn_drain`]); `close`
    /// says whether the connection should end after it.
    Linger { body: RequestBody, close: bool },
}

impl Unread {
    /// Decides for a refused request: its method, version, headers and
    /// body. `framing_refused`: the refusal is about the framing itself,
    /// so the bytes after the head are not a body to read.
    pub(super) fn of(
        method: &Method,
        version: Version,
        headers: &HeaderMap,
        body: RequestBody,
        framing_refused: bool,
    ) -> Self {
        let h1 = version < Version::HTTP_2;
        if framing_refused {
            return if h1 { Unread::Close } else { Unread::None };
        }
        if body.is_end_stream() || method == Method::HEAD {
            return Unread::None;
        }
        let expects_continue = headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if h1 && expects_continue {
            // Reading the body would make hyper send `100 Continue` and
            // ask for the upload the refusal makes useless.
            return Unread::Close;
        }
        let declared = content_length(headers);
        Unread::Linger {
            body,
            close: h1 && declared.is_none_or(|n| n > LINGER_KEEP_BYTES),
        }
    }
}

/// Reads a refused request's body to its end and throws it away, for at
/// most [`LINGER_TIME`] and [`LINGER_IDLE`] between reads; dropping it
/// then ends the connection (HTTP/1.1) or the stream (HTTP/2).
///
/// It runs beside the answer, not inside its body: hyper drops a response
/// body as soon as its declared length is written, and a chunked answer
/// would keep a client that stopped uploading waiting for its end.
pub(super) fn spawn_drain(mut body: RequestBody) {
    // No owner but the connection: the body ends, fails or times out with
    // it, and the task holds nothing else.
    tokio::spawn(async move {
        let until = Instant::now() + LINGER_TIME;
        loop {
            let next = (Instant::now() + LINGER_IDLE).min(until);
            match tokio::time::timeout_at(next, body.frame()).await {
                Ok(Some(Ok(_))) => {}
                // The upload ended or broke, or took too long.
                _ => return,
            }
        }
    });
}
