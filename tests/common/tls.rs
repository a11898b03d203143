//! TLS fixtures: a throwaway PKI generated per test (rcgen), an HTTPS client
//! with chosen roots / client certificate / ALPN, and a TLS recording
//! upstream that notes the SNI and protocol of each connection.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::{Body, Upstream};

/// A CA that signs leaf certificates, with its PEM written to `dir`.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pub pem: PathBuf,
    dir: PathBuf,
    name: String,
}

/// A self-signed certificate for `localhost` and 127.0.0.1 with
/// basicConstraints CA:TRUE, as `openssl req -x509` makes by default: a
/// CA's certificate that a server presents as its own.
pub fn self_signed_ca_as_server(dir: &Path, file: &str) -> Leaf {
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    let leaf = Leaf {
        cert: dir.join(format!("{file}.crt")),
        key: dir.join(format!("{file}.key")),
    };
    std::fs::write(&leaf.cert, cert.pem()).unwrap();
    std::fs::write(&leaf.key, key.serialize_pem()).unwrap();
    leaf
}

/// A leaf certificate and key on disk.
#[derive(Clone)]
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("fencegate test {name}"));
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let pem = dir.join(format!("{name}.pem"));
        std::fs::write(&pem, issuer.pem()).unwrap();
        TestCa {
            issuer,
            pem,
            dir: dir.to_path_buf(),
            name: name.to_string(),
        }
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    pub fn server(&self, file: &str) -> Leaf {
        self.leaf(
            file,
            &["localhost", "127.0.0.1"],
            &[ExtendedKeyUsagePurpose::ServerAuth],
        )
    }

    /// A server certificate for exactly `names` (DNS names, or IP
    /// addresses as IP SANs).
    pub fn server_for(&self, file: &str, names: &[&str]) -> Leaf {
        self.leaf(file, names, &[ExtendedKeyUsagePurpose::ServerAuth])
    }

    /// A client certificate.
    pub fn client(&self, file: &str) -> Leaf {
        self.leaf(file, &[], &[ExtendedKeyUsagePurpose::ClientAuth])
    }

    /// A client certificate without a subject, so that etcd (auth on) can
    /// only take the user from the token fencegate sends.
    pub fn client_without_name(&self, file: &str) -> Leaf {
        self.leaf_named(file, &[], &[ExtendedKeyUsagePurpose::ClientAuth], false)
    }

    /// A certificate for `localhost` and 127.0.0.1 that is good for both
    /// ends (etcd's gateway dials its own gRPC port with its server
    /// certificate as the client's).
    pub fn peer(&self, file: &str) -> Leaf {
        self.leaf(
            file,
            &["localhost", "127.0.0.1"],
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )
    }

    fn leaf(&self, file: &str, names: &[&str], usage: &[ExtendedKeyUsagePurpose]) -> Leaf {
        self.leaf_named(file, names, usage, true)
    }

    fn leaf_named(
        &self,
        file: &str,
        names: &[&str],
        usage: &[ExtendedKeyUsagePurpose],
        common_name: bool,
    ) -> Leaf {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        if common_name {
            params
                .distinguished_name
                .push(DnType::CommonName, format!("{file} ({})", self.name));
        }
        params.extended_key_usages = usage.to_vec();
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let leaf = Leaf {
            cert: self.dir.join(format!("{file}.crt")),
            key: self.dir.join(format!("{file}.key")),
        };
        // Chain: leaf then CA, as servers usually send it.
        std::fs::write(&leaf.cert, format!("{}{}", cert.pem(), self.issuer.pem())).unwrap();
        std::fs::write(&leaf.key, key.serialize_pem()).unwrap();
        leaf
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn key(path: &Path) -> PrivateKeyDer<'static> {
    PrivateKeyDer::from_pem_file(path).unwrap()
}

/// A TLS client config trusting `ca` (for raw TLS streams).
pub fn client_config(ca: &Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca) {
        roots.add(c).unwrap();
    }
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// Which HTTP versions a client offers in ALPN.
#[derive(Clone, Copy, PartialEq)]
pub enum Alpn {
    Http1,
    H2,
}

pub type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>;

/// An HTTPS client trusting `ca`, presenting `client` if given.
pub fn https_client(ca: &Path, client: Option<&Leaf>, alpn: Alpn) -> HttpsClient {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca) {
        roots.add(c).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some(leaf) => builder
            .with_client_auth_cert(certs(&leaf.cert), key(&leaf.key))
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only();
    let connector = match alpn {
        Alpn::Http1 => connector.enable_http1().build(),
        Alpn::H2 => connector.enable_http2().build(),
    };
    Client::builder(TokioExecutor::new())
        .retry_canceled_requests(false)
        .http2_only(alpn == Alpn::H2)
        .build(connector)
}

/// What a TLS upstream saw of each connection.
#[derive(Debug, Clone)]
pub struct TlsConn {
    pub sni: Option<String>,
    pub alpn: Option<String>,
    /// Whether the client presented a certificate.
    pub client_cert: bool,
}

/// A recording upstream behind TLS with `leaf` (HTTP/1.1 and h2 by ALPN,
/// `h2: false` offers only http/1.1), requiring a client certificate from
/// `client_ca` if given.
pub async fn start_tls_upstream(
    leaf: &Leaf,
    client_ca: Option<&Path>,
    h2: bool,
) -> (Upstream, Arc<Mutex<Vec<TlsConn>>>) {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs(ca) {
                roots.add(c).unwrap();
            }
            builder.with_client_cert_verifier(
                rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .build()
                .unwrap(),
            )
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs(&leaf.cert), key(&leaf.key))
        .unwrap();
    config.alpn_protocols = if h2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let conns = Arc::new(Mutex::new(Vec::new()));
    let seen = conns.clone();
    let upstream = super::start_upstream_with(move |stream, serve| {
        let acceptor = acceptor.clone();
        let seen = seen.clone();
        Box::pin(async move {
            let Ok(tls) = acceptor.accept(stream).await else {
                return;
            };
            let (_, session) = tls.get_ref();
            seen.lock().unwrap().push(TlsConn {
                sni: session.server_name().map(str::to_string),
                alpn: session
                    .alpn_protocol()
                    .map(|p| String::from_utf8_lossy(p).into_owned()),
                client_cert: session.peer_certificates().is_some(),
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), serve)
                .await;
        })
    })
    .await;
    (upstream, conns)
}
