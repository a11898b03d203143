//! TLS for the PostgreSQL driver over tokio-rustls: the driver's
//! `MakeTlsConnect` hooks with the rustls client config that
//! [`crate::tls::store_client_config`] built (the roots, client certificate
//! and how much to verify, after libpq's `sslmode`).
//!
//! No channel binding is offered (SCRAM-SHA-256 rather than its `-PLUS`
//! form): the certificate check already binds the session to the server.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_rustls::TlsConnector;

/// Makes a TLS session per connection, named after the host connected to
/// (SNI and the certificate's name check).
#[derive(Clone)]
pub struct PgTls(pub Arc<ClientConfig>);

pub struct PgTlsConnect {
    config: Arc<ClientConfig>,
    /// `None` for a Unix socket (the driver asks for a connector there
    /// too, with no host name): a handshake there fails.
    name: Option<ServerName<'static>>,
}

pub struct PgTlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S> MakeTlsConnect<S> for PgTls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PgTlsStream<S>;
    type TlsConnect = PgTlsConnect;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<PgTlsConnect, Self::Error> {
        let name = if domain.is_empty() {
            None
        } else {
            Some(ServerName::try_from(domain.to_string())?)
        };
        Ok(PgTlsConnect {
            config: self.0.clone(),
            name,
        })
    }
}

impl<S> TlsConnect<S> for PgTlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PgTlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<PgTlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let name = self.name.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "TLS over a Unix socket: use sslmode=disable there",
                )
            })?;
            let s = TlsConnector::from(self.config)
                .connect(name, stream)
                .await?;
            Ok(PgTlsStream(s))
        })
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for PgTlsStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for PgTlsStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for PgTlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}
