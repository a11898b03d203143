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
//! Every error names the config field whose file is at fault. The TLS
//! settings themselves ([`TlsConfig`], [`UpstreamTls`], [`StoreTls`]) are
//! plain values defined here: the validated config names them and loads
//! their files through this module, which knows nothing of the config.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use hyper_rustls::HttpsConnector;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use std::net::SocketAddr;
use std::path::PathBuf;

/// The TLS listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    pub listen: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When set, clients must present a certificate these CAs signed.
    pub client_ca: Option<PathBuf>,
    /// Certificate files are re-read when they change, checked this often
    /// (and on SIGHUP).
    pub watch_interval: Duration,
    /// Connections start with a PROXY protocol header, read before TLS.
    pub proxy_protocol: bool,
}

/// TLS towards an https upstream (all unset for http ones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTls {
    /// Private CA; `None`: the system's roots.
    pub ca: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    /// HTTP/2 to the upstream: offered in ALPN to an https upstream, spoken
    /// from the first byte (h2c, prior knowledge) to an http one, as gRPC
    /// servers expect.
    pub http2: bool,
}

/// TLS towards a shared store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreTls {
    pub verify: TlsVerify,
    /// PEM CA certificates; `None`: the system's roots.
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM chain) and key, for stores that ask for one.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

/// How much of the store's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsVerify {
    /// Chain to a trusted CA and the host name (`rediss://`, `etcds://`,
    /// PostgreSQL `verify-full`).
    Full,
    /// Chain to a trusted CA, any host name (PostgreSQL `verify-ca`).
    Chain,
    /// Encrypted, not authenticated (PostgreSQL `require` or `prefer`
    /// without a CA, as libpq does). Documented as open to a
    /// man-in-the-middle.
    None,
}

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

/// The system's CA certificates, read once they are found (a few hundred
/// files). A failure is not cached: a reload after installing
/// ca-certificates finds them.
fn system_roots() -> Result<Arc<RootCertStore>, String> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    if let Some(roots) = ROOTS.get() {
        return Ok(roots.clone());
    }
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
    Ok(ROOTS.get_or_init(|| Arc::new(roots)).clone())
}

/// A listener config loaded from its files.
pub struct Loaded {
    pub config: Arc<ServerConfig>,
    /// The leaf certificate's notAfter, Unix seconds (for the expiry
    /// metric and alert).
    pub not_after: Option<i64>,
}

/// Builds the listener's rustls config from the files.
pub fn server_config(tls: &TlsConfig) -> Result<Loaded, TlsError> {
    let certs = certificates("tls.cert", &tls.cert)?;
    let not_after = not_after(&certs[0]);
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
    Ok(Loaded {
        config: Arc::new(config),
        not_after,
    })
}

/// One DER element: (tag, contents, rest).
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The notAfter of an X.509 certificate, Unix seconds. rustls does not
/// expose it and a full X.509 parser is a large dependency for one field:
/// this walks Certificate -> TBSCertificate -> Validity (RFC 5280 4.1).
pub fn not_after(cert: &[u8]) -> Option<i64> {
    const SEQUENCE: u8 = 0x30;
    let (SEQUENCE, certificate, _) = der(cert)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = der(certificate)? else {
        return None;
    };
    let mut fields = tbs;
    // [0] version, present from v2 on.
    if fields.first() == Some(&0xa0) {
        fields = der(fields)?.2;
    }
    // serialNumber, signature, issuer.
    for _ in 0..3 {
        fields = der(fields)?.2;
    }
    let (SEQUENCE, validity, _) = der(fields)? else {
        return None;
    };
    let after = der(validity)?.2;
    let (tag, time, _) = der(after)?;
    let text = std::str::from_utf8(time).ok()?;
    // ASCII digits only: `parse` alone would take a sign.
    let digits = |r: std::ops::Range<usize>| {
        let d = text.get(r)?;
        d.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| d.parse::<i64>().ok())?
    };
    // UTCTime YYMMDDHHMMSSZ (years 1950-2049), GeneralizedTime YYYYMMDDHHMMSSZ.
    let (year, at) = match tag {
        0x17 => {
            let yy = digits(0..2)?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, 2)
        }
        0x18 => (digits(0..4)?, 4),
        _ => return None,
    };
    let (month, day) = (digits(at..at + 2)?, digits(at + 2..at + 4)?);
    let (h, m, sec) = (
        digits(at + 4..at + 6)?,
        digits(at + 6..at + 8)?,
        digits(at + 8..at + 10)?,
    );
    if text.get(at + 10..)? != "Z"
        || !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || h > 23
        || m > 59
        || sec > 60
    {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + sec)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
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

/// Certificate files loaded for a config reload, not yet in force.
pub struct Prepared {
    tls: TlsConfig,
    loaded: Loaded,
    stamp: FileStamp,
}

/// The TLS listener's current config and the files it came from.
pub struct TlsTerminator {
    current: ArcSwap<ServerConfig>,
    files: Mutex<(TlsConfig, FileStamp)>,
    /// notAfter of the certificate in force (0: unknown).
    not_after: AtomicI64,
}

impl TlsTerminator {
    pub fn new(tls: &TlsConfig) -> Result<Self, TlsError> {
        let stamp = FileStamp::of(tls);
        let loaded = server_config(tls)?;
        Ok(Self {
            current: ArcSwap::new(loaded.config),
            files: Mutex::new((tls.clone(), stamp)),
            not_after: AtomicI64::new(loaded.not_after.unwrap_or(0)),
        })
    }

    /// notAfter of the certificate served now, Unix seconds.
    pub fn not_after(&self) -> Option<i64> {
        Some(self.not_after.load(Ordering::Relaxed)).filter(|&t| t != 0)
    }

    fn swap(&self, loaded: Loaded) {
        self.current.store(loaded.config);
        self.not_after
            .store(loaded.not_after.unwrap_or(0), Ordering::Relaxed);
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
        self.swap(loaded?);
        Ok(())
    }

    /// Loads `tls` for a config reload, which may name other files; the
    /// result is swapped in by [`TlsTerminator::install`] once everything
    /// else of the reload has loaded too.
    pub fn prepare(tls: &TlsConfig) -> Result<Prepared, TlsError> {
        let stamp = FileStamp::of(tls);
        Ok(Prepared {
            tls: tls.clone(),
            loaded: server_config(tls)?,
            stamp,
        })
    }

    pub fn install(&self, prepared: Prepared) {
        let mut files = self.files.lock().expect("tls files lock");
        // The stamp is the one taken before loading: if the files changed
        // since, the watcher loads them again.
        *files = (prepared.tls, prepared.stamp);
        self.swap(prepared.loaded);
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
            // Reading and parsing the files blocks: off the runtime thread,
            // which also runs the admin listener and store clients.
            let this = self.clone();
            let checked =
                tokio::task::spawn_blocking(move || this.files_changed().then(|| this.reload()))
                    .await;
            if let Ok(Some(result)) = checked {
                on_reload(&result);
            }
        }
    }
}

/// The client config for a shared store's TLS (PostgreSQL, etcd): roots
/// from `store_ca` or the system, an optional client certificate, and the
/// certificate checked as far as `tls.verify` says.
pub fn store_client_config(tls: &StoreTls) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = match (&tls.ca, tls.verify) {
        (Some(ca), _) => Arc::new(roots_from("store_ca", ca)?),
        // Nothing is checked: no roots needed (a minimal image has none).
        (None, TlsVerify::None) => Arc::new(RootCertStore::empty()),
        (None, _) => {
            system_roots().map_err(|e| error("store_ca", e.replace("upstream_ca", "store_ca")))?
        }
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| error("store", e.to_string()))?;
    let builder = match tls.verify {
        TlsVerify::Full => builder.with_root_certificates(roots),
        verify => {
            let webpki = match verify {
                TlsVerify::Chain => Some(
                    rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider())
                        .build()
                        .map_err(|e| error("store_ca", e.to_string()))?,
                ),
                _ => None,
            };
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(LaxVerifier {
                    webpki,
                    algorithms: provider().signature_verification_algorithms,
                }))
        }
    };
    let config = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(
                certificates("store_client_cert", cert)?,
                private_key("store_client_key", key)?,
            )
            .map_err(|e| {
                error(
                    "store_client_key",
                    format!("does not fit store_client_cert: {e}"),
                )
            })?,
        _ => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// A client config for connectors that only ever speak plain HTTP (etcd
/// over `http://`): no roots, never used for a handshake.
pub fn plain_client_config() -> Arc<ClientConfig> {
    Arc::new(
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_root_certificates(RootCertStore::empty())
            .with_no_client_auth(),
    )
}

/// PEM bytes of a store's CA and client certificate and key, checked to
/// parse (for clients that take PEM rather than a rustls config: Redis).
pub struct StorePem {
    pub ca: Option<Vec<u8>>,
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

pub fn store_pem(tls: &StoreTls) -> Result<StorePem, TlsError> {
    let read = |field: &str, p: &Path| {
        std::fs::read(p).map_err(|e| error(field, format!("cannot read {}: {e}", p.display())))
    };
    let ca = match &tls.ca {
        Some(p) => {
            roots_from("store_ca", p)?;
            Some(read("store_ca", p)?)
        }
        None => None,
    };
    let client = match (&tls.client_cert, &tls.client_key) {
        (Some(c), Some(k)) => {
            certificates("store_client_cert", c)?;
            private_key("store_client_key", k)?;
            Some((read("store_client_cert", c)?, read("store_client_key", k)?))
        }
        _ => None,
    };
    Ok(StorePem { ca, client })
}

/// PostgreSQL's `verify-ca` (chain checked, any name) and `require` /
/// `prefer` without a CA (nothing checked, as libpq does). The handshake's
/// signatures are checked in both: the peer holds the certificate's key.
#[derive(Debug)]
struct LaxVerifier {
    /// `Some`: the chain is checked (any name); `None`: nothing is.
    webpki: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::client::danger::ServerCertVerifier for LaxVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let Some(webpki) = &self.webpki else {
            return Ok(rustls::client::danger::ServerCertVerified::assertion());
        };
        // The chain is checked before the name: a name mismatch means the
        // chain was good.
        match webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// Builds a route's connector over the TCP dialer `tcp`: plain HTTP or
/// verified TLS, as the upstream's scheme says. `field` is the route's
/// field prefix (`routes[0]`), for errors.
pub fn upstream_connector<C>(
    field: &str,
    scheme: &http::uri::Scheme,
    tls: &UpstreamTls,
    tcp: C,
) -> Result<HttpsConnector<C>, TlsError> {
    let f = |name: &str| format!("{field}.{name}");
    let https = *scheme == http::uri::Scheme::HTTPS;
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
    let mut config = match (&tls.client_cert, &tls.client_key) {
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
    // ALPN names http/1.1 even alone (servers that require ALPN refuse a
    // hello without it); h2 is offered first only when asked for, and used
    // only if the upstream picks it.
    config.alpn_protocols = if tls.http2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    // Plain HTTP for http:// upstreams, TLS for https:// ones.
    Ok(HttpsConnector::from((tcp, config)))
}

/// Whether `e` (or an error it wraps) is a TLS certificate refusal: ours of
/// the peer's certificate, or the peer's of ours (a fatal alert about
/// certificates). Such a failure is a setting to fix, not an outage.
pub fn certificate_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    use rustls::AlertDescription as A;
    for err in chain(e) {
        match err.downcast_ref::<rustls::Error>() {
            Some(rustls::Error::InvalidCertificate(_)) => return true,
            Some(rustls::Error::AlertReceived(
                A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::CertificateRequired
                | A::AccessDenied,
            )) => return true,
            _ => {}
        }
    }
    // Some clients flatten the error into text.
    let text = e.to_string();
    text.contains("invalid peer certificate")
        || [
            "BadCertificate",
            "UnknownCA",
            "CertificateRequired",
            "CertificateUnknown",
            "CertificateExpired",
        ]
        .iter()
        .any(|a| text.contains(&format!("received fatal alert: {a}")))
}

/// What to do about a TLS failure towards an upstream, if `e` (or an
/// error it wraps) is one whose usual cause we know: the errors people hit
/// first with a private or self-made certificate.
pub fn advice(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    use rustls::CertificateError as C;
    for err in chain(e) {
        if let Some(rustls::Error::InvalidCertificate(cert)) = err.downcast_ref::<rustls::Error>() {
            return Some(match cert {
                C::Other(other)
                    if matches!(
                        other.0.downcast_ref::<webpki::Error>(),
                        Some(webpki::Error::CaUsedAsEndEntity)
                    ) =>
                {
                    "the upstream presents a CA certificate (basicConstraints CA:TRUE) as its own; \
                     `openssl req -x509` makes such a certificate unless told otherwise. Give the \
                     upstream a leaf certificate signed by a CA (with the extension \
                     `basicConstraints=critical,CA:FALSE`) and give that CA as \
                     upstream_ca (--upstream-ca); docs/gateway.md shows the commands"
                        .into()
                }
                C::UnknownIssuer => {
                    "the upstream's certificate chain does not lead to a CA fencegate \
                     trusts: give the CA that signed it as upstream_ca (--upstream-ca), and make \
                     the upstream send its intermediate certificates"
                        .into()
                }
                C::NotValidForName | C::NotValidForNameContext { .. } => {
                    "the upstream's certificate \
                     does not name the host in the route's upstream URL: use a name (or IP \
                     address) listed in its subjectAltName"
                        .into()
                }
                C::Expired
                | C::ExpiredContext { .. }
                | C::NotValidYet
                | C::NotValidYetContext { .. } => {
                    "the upstream's certificate is outside its validity period: renew it, or \
                     check the clocks of both machines"
                        .into()
                }
                C::InvalidPurpose | C::InvalidPurposeContext { .. } => {
                    "the upstream's certificate \
                     is not for TLS servers: its extendedKeyUsage must include serverAuth"
                        .into()
                }
                _ => return None,
            });
        }
    }
    None
}

/// `e` and the errors it wraps, outermost first. An io::Error's `source`
/// skips the error it wraps (hyper-rustls wraps tokio-rustls's io::Error,
/// which wraps the rustls error), so wrapped errors are followed by hand.
fn chain<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |err| {
        match err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_until(year: i32, month: u8, day: u8) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params.not_after = rcgen::date_time_ymd(year, month, day);
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn not_after_reads_utc_and_generalized_times() {
        // UTCTime (before 2050) and GeneralizedTime (from 2050 on).
        assert_eq!(not_after(&cert_until(2031, 5, 17)), Some(1_936_742_400));
        assert_eq!(not_after(&cert_until(2061, 2, 3)), Some(2_874_614_400));
        assert_eq!(not_after(&cert_until(2000, 2, 29)), Some(951_782_400));
    }

    proptest::proptest! {
        #[test]
        fn not_after_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            let _ = not_after(&bytes);
        }

        #[test]
        fn a_mangled_certificate_never_panics(at in 0usize..400, byte in proptest::num::u8::ANY) {
            let mut cert = cert_until(2031, 5, 17);
            let i = at % cert.len();
            cert[i] = byte;
            let _ = not_after(&cert);
        }
    }

    #[test]
    fn not_after_refuses_what_is_not_a_certificate() {
        let good = cert_until(2031, 5, 17);
        assert_eq!(not_after(b""), None);
        assert_eq!(not_after(b"not a certificate at all"), None);
        for cut in [1, 2, 10, good.len() / 3, good.len() / 2] {
            // Truncated: the outer length no longer fits.
            assert_eq!(not_after(&good[..cut]), None, "cut at {cut}");
        }
    }
}
