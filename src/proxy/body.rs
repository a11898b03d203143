//! A request's body as the proxy receives it: streamed by hyper (HTTP/2,
//! and HTTP/1.1 requests the own lane hands over), or already read whole
//! by the lane (`crate::h1`), which serves small plain HTTP/1.1 requests.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

/// A request's body.
pub enum RequestBody {
    /// Read as it is forwarded.
    Streamed(Incoming),
    /// Read whole before the request was classified; `None` once taken.
    Whole(Option<Bytes>),
}

impl From<Incoming> for RequestBody {
    fn from(body: Incoming) -> Self {
        RequestBody::Streamed(body)
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            RequestBody::Streamed(body) => Pin::new(body).poll_frame(cx),
            RequestBody::Whole(bytes) => Poll::Ready(
                bytes
                    .take()
                    .filter(|b| !b.is_empty())
                    .map(|b| Ok(Frame::data(b))),
            ),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Streamed(body) => body.is_end_stream(),
            RequestBody::Whole(bytes) => bytes.as_ref().is_none_or(Bytes::is_empty),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Streamed(body) => body.size_hint(),
            RequestBody::Whole(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}
