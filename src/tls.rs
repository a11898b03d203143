//! TLS on both sides of the proxy, with rustls and the ring provider.
//!
//! - [`TlsTerminator`]: the TLS listener's server config (certificate chain,
//!   key, optional client-certificate CA, ALPN `h2` and `http/1.1`). It is
//!   swapped whole on reload, so a connection keeps the config it was
//!   accepted with and new connections get the new one; files that do not
//!   load leave the running config in place.
//! - [`upstream_connector`]: the connector of a route, which speaks plain
//!   HTTP to `http://` upstreams and verified TLS (system roots or a private
//!   CA, SNI from the upstream host, optional client certificate, HTTP/2 when
//!   the upstream offers it) to `https://` ones.
//!
//! Every error names the config field whose file is at fault.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::config::{TlsConfig, Upstream, UpstreamTls};

/// A TLS file that cannot be used, naming its config field.
#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid `{field}`: {reason}")]
pub struct TlsError {
    pub field: String,
    pub reason: String,
}

fn error(field: &str, reason: impl Into<String>) -> TlsError {
    TlsError {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// One provider for the whole process, chosen explicitly rather than
/// through rustls' process-wide default (which panics if two are linked).
fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

fn certificates(field: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            error(
                field,
                format!("cannot read certificates from {}: {e}", path.display()),
            )
        })?;
    if certs.is_empty() {
        return Err(error(
            field,
            format!("{} holds no PEM certificate", path.display()),
        ));
    }
    Ok(certs)
}

fn private_key(field: &str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        error(
            field,
            format!(
                "cannot read a PEM private key (PKCS#8, PKCS#1 or SEC1) from {}: {e}",
                path.display()
            ),
        )
    })
}

fn roots_from(field: &str, path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(field, path)? {
        roots
            .add(cert)
            .map_err(|e| error(field, format!("{}: {e}", path.display())))?;
    }
    Ok(roots)
}

/// The system's CA certificates, read once (they are a few hundred files).
fn system_roots() -> Result<Arc<RootCertStore>, String> {
    static ROOTS: OnceLock<Result<Arc<RootCertStore>, String>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut roots = RootCertStore::empty();
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default();
                return Err(format!(
                    "no system CA certificates found{why}: install ca-certificates or set upstream_ca"
                ));
            }
            Ok(Arc::new(roots))
        })
        .clone()
}

/// Builds the listener's rustls config from the files.
pub fn server_config(tls: &TlsConfig) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = certificates("tls.cert", &tls.cert)?;
    let key = private_key("tls.key", &tls.key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| error("tls", e.to_string()))?;
    let builder = match &tls.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let roots = roots_from("tls.client_ca", path)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| error("tls.client_ca", e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        error(
            "tls.key",
            format!("does not fit the certificate in tls.cert: {e}"),
        )
    })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// What the files looked like when last loaded: a change of size, mtime or
/// inode (an atomic rename, a Kubernetes secret's symlink swap) is a change.
#[derive(Debug, PartialEq, Eq)]
struct FileStamp(Vec<Option<(SystemTime, u64, u64)>>);

impl FileStamp {
    fn of(tls: &TlsConfig) -> Self {
        let paths = [Some(&tls.cert), Some(&tls.key), tls.client_ca.as_ref()];
        FileStamp(
            paths
                .into_iter()
                .flatten()
                .map(|p| {
                    std::fs::metadata(p)
                        .ok()
                        .and_then(|m| Some((m.modified().ok()?, m.len(), m.ino())))
                })
                .collect(),
        )
    }
}

/// The TLS listener's current config and the files it came from.
pub struct TlsTerminator {
    current: ArcSwap<ServerConfig>,
    files: Mutex<(TlsConfig, FileStamp)>,
}

impl TlsTerminator {
    pub fn new(tls: &TlsConfig) -> Result<Self, TlsError> {
        let stamp = FileStamp::of(tls);
        Ok(Self {
            current: ArcSwap::new(server_config(tls)?),
            files: Mutex::new((tls.clone(), stamp)),
        })
    }

    /// An acceptor with the config in force now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.load_full())
    }

    /// Re-reads the current files and swaps them in. On error the running
    /// config stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let mut files = self.files.lock().expect("tls files lock");
        // Stamp before loading: a file rewritten while we read it is seen
        // as changed again on the next check.
        let stamp = FileStamp::of(&files.0);
        let loaded = server_config(&files.0);
        // A failed load is not retried until the files change again, so a
        // bad certificate is logged once, not on every check.
        files.1 = stamp;
        self.current.store(loaded?);
        Ok(())
    }

    /// Swaps in a config already loaded from `tls` (a config reload, which
    /// may name other files).
    pub fn install(&self, tls: &TlsConfig, loaded: Arc<ServerConfig>) {
        let mut files = self.files.lock().expect("tls files lock");
        *files = (tls.clone(), FileStamp::of(tls));
        self.current.store(loaded);
    }

    fn files_changed(&self) -> bool {
        let files = self.files.lock().expect("tls files lock");
        FileStamp::of(&files.0) != files.1
    }

    /// Checks the files every `interval` and reloads them when they change,
    /// until `stop` fires.
    pub async fn watch(
        self: Arc<Self>,
        interval: Duration,
        stop: CancellationToken,
        on_reload: impl Fn(&Result<(), TlsError>) + Send,
    ) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
            if self.files_changed() {
                on_reload(&self.reload());
            }
        }
    }
}

/// The connector of a route: plain HTTP or verified TLS, as the upstream's
/// scheme says.
pub type UpstreamConnector = HttpsConnector<HttpConnector>;

/// Builds a route's connector. `field` is the route's field prefix
/// (`routes[0]`), for errors.
pub fn upstream_connector(
    field: &str,
    upstream: &Upstream,
    tls: &UpstreamTls,
    http: HttpConnector,
) -> Result<UpstreamConnector, TlsError> {
    let f = |name: &str| format!("{field}.{name}");
    let https = upstream.scheme == http::uri::Scheme::HTTPS;
    let roots = match (&tls.ca, https) {
        (Some(ca), _) => Arc::new(roots_from(&f("upstream_ca"), ca)?),
        (None, true) => system_roots().map_err(|e| error(&f("upstream"), e))?,
        // Never used: the connector speaks plain HTTP to this upstream.
        (None, false) => Arc::new(RootCertStore::empty()),
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| error(field, e.to_string()))?
        .with_root_certificates(roots);
    let config = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(
                certificates(&f("upstream_client_cert"), cert)?,
                private_key(&f("upstream_client_key"), key)?,
            )
            .map_err(|e| {
                error(
                    &f("upstream_client_key"),
                    format!("does not fit upstream_client_cert: {e}"),
                )
            })?,
        _ => builder.with_no_client_auth(),
    };
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1();
    Ok(if tls.http2 {
        // ALPN offers h2 first; the client speaks HTTP/2 only if the
        // upstream picks it.
        builder.enable_http2().wrap_connector(http)
    } else {
        builder.wrap_connector(http)
    })
}
