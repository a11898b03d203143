//! The TCP dial of every upstream connection, plain or under TLS.
//!
//! Invariant, kept here only: a connection fencegate lets go of carries
//! nothing more to the backend. Each is dialled with `SO_LINGER` 0, so
//! closing it discards whatever its kernel still holds, unsent or sent and
//! unacknowledged, and resets the connection. Without it, a write given up
//! on at its deadline while the backend was unreachable (a partition, a
//! lossy link) kept its bytes in fencegate's kernel, which delivered them
//! once the link healed, after newer tokens the fence had let through
//! meanwhile. A clean close loses nothing by it: an exchange that ended
//! leaves nothing unsent. What remains possible is in docs/contract.md:
//! bytes the backend's own kernel had received before the deadline.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// A route's connector: plain HTTP or verified TLS over [`Dialer`].
pub type Connector = hyper_rustls::HttpsConnector<Dialer>;

/// hyper's TCP connector, with every connection set to reset on close.
#[derive(Clone)]
pub struct Dialer(HttpConnector);

impl Dialer {
    pub fn new(http: HttpConnector) -> Self {
        Self(http)
    }
}

impl tower_service::Service<http::Uri> for Dialer {
    type Response = TokioIo<TcpStream>;
    type Error = <HttpConnector as tower_service::Service<http::Uri>>::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connect = self.0.call(uri);
        Box::pin(async move {
            let io = connect.await?;
            abort_on_close(io.inner());
            Ok(io)
        })
    }
}

/// Sets `SO_LINGER` 0 on an upstream connection (the invariant above). A
/// failure is logged: the connection still works, without that promise.
fn abort_on_close(io: &TcpStream) {
    if let Err(e) = socket2::SockRef::from(io).set_linger(Some(Duration::ZERO)) {
        tracing::warn!(error = %e, "SO_LINGER 0 not set on an upstream connection");
    }
}
