//! Certificates and TLS peers for the TLS tests: a CA made per test with
//! rcgen and the leaf certificates it issues (written as PEM files), a TLS
//! front that terminates TLS before a demo worker (a worker "behind TLS",
//! optionally requiring a client certificate), and one HTTPS exchange whose
//! certificate and protocol the test can look at.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, HandshakeKind, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::{TlsAcceptor, TlsConnector};

const BOUND: Duration = Duration::from_secs(10);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A directory of PEM files, removed on drop.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("balancer-tls-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self(dir))
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A test CA.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// Its certificate as a PEM file.
    pub pem: PathBuf,
}

/// A certificate the CA issued, with its key, both as PEM files.
#[derive(Clone)]
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub der: CertificateDer<'static>,
    key_der: Arc<PrivateKeyDer<'static>>,
}

impl Ca {
    /// A new CA named `name`, its certificate written to `<name>-ca.pem`.
    pub fn new(dir: &Scratch, name: &str) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let pem = dir.path(&format!("{name}-ca.pem"));
        std::fs::write(&pem, issuer.pem())?;
        Ok(Self { issuer, pem })
    }

    /// A certificate for `names` (DNS names or IP literals), usable by a
    /// server and a client, written to `<stem>.pem` and `<stem>.key`.
    pub fn issue(&self, dir: &Scratch, stem: &str, names: &[&str]) -> Result<Leaf> {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names)?;
        params.distinguished_name.push(DnType::CommonName, stem);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let (cert_path, key_path) = (
            dir.path(&format!("{stem}.pem")),
            dir.path(&format!("{stem}.key")),
        );
        std::fs::write(&cert_path, cert.pem())?;
        std::fs::write(&key_path, key.serialize_pem())?;
        Ok(Leaf {
            cert: cert_path,
            key: key_path,
            der: cert.der().clone(),
            key_der: Arc::new(
                PrivateKeyDer::try_from(key.serialize_der()).map_err(anyhow::Error::msg)?,
            ),
        })
    }

    /// This CA alone as trust roots.
    pub fn roots(&self) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots.add(self.issuer.der().clone())?;
        Ok(roots)
    }
}

impl Leaf {
    /// Overwrites `to`'s files with this leaf's (a rotation).
    pub fn copy_to(&self, to: &Leaf) -> Result<()> {
        std::fs::copy(&self.cert, &to.cert)?;
        std::fs::copy(&self.key, &to.key)?;
        Ok(())
    }
}

/// Counts of the handshakes a [`TlsFront`] completed.
#[derive(Default, Debug)]
pub struct FrontStats {
    pub full: AtomicU64,
    pub resumed: AtomicU64,
    /// Handshakes in which the client presented a certificate.
    pub with_client_certificate: AtomicU64,
}

/// A TLS server in front of a plain backend: each connection is TLS on the
/// outside, copied byte for byte to a new connection to the backend.
pub struct TlsFront {
    pub addr: SocketAddr,
    pub stats: Arc<FrontStats>,
    task: JoinHandle<()>,
}

impl TlsFront {
    /// Serves `leaf` on a free loopback port before `backend`; with
    /// `client_ca` every client must present a certificate it signed.
    pub async fn spawn(backend: SocketAddr, leaf: &Leaf, client_ca: Option<&Ca>) -> Result<Self> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?;
        let builder = match client_ca {
            Some(ca) => builder.with_client_cert_verifier(
                WebPkiClientVerifier::builder_with_provider(Arc::new(ca.roots()?), provider())
                    .build()?,
            ),
            None => builder.with_no_client_auth(),
        };
        let config = builder.with_single_cert(vec![leaf.der.clone()], leaf.key_der.clone_key())?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(FrontStats::default());
        let counts = stats.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, counts) = (acceptor.clone(), counts.clone());
                connections.spawn(async move {
                    let Ok(Ok(mut tls)) = tokio::time::timeout(BOUND, acceptor.accept(tcp)).await
                    else {
                        return;
                    };
                    let (_, session) = tls.get_ref();
                    let kind = if session.handshake_kind() == Some(HandshakeKind::Resumed) {
                        &counts.resumed
                    } else {
                        &counts.full
                    };
                    kind.fetch_add(1, Ordering::Relaxed);
                    if session.peer_certificates().is_some_and(|c| !c.is_empty()) {
                        counts
                            .with_client_certificate
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    if let Ok(mut plain) = TcpStream::connect(backend).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                    }
                });
            }
        });
        Ok(Self { addr, stats, task })
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub fn handshakes(&self) -> (u64, u64) {
        (
            self.stats.full.load(Ordering::Relaxed),
            self.stats.resumed.load(Ordering::Relaxed),
        )
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What one HTTPS exchange saw.
pub struct Exchange {
    pub status: u16,
    pub body: Bytes,
    /// The server's leaf certificate.
    pub certificate: CertificateDer<'static>,
    /// The ALPN protocol agreed, if any.
    pub alpn: Option<Vec<u8>>,
}

/// A client trusting `ca`, offering `alpn`, presenting `identity` if given.
pub fn client_config(
    ca: &Ca,
    alpn: &[&[u8]],
    identity: Option<&Leaf>,
) -> Result<Arc<ClientConfig>> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(ca.roots()?);
    let mut config = match identity {
        Some(leaf) => {
            builder.with_client_auth_cert(vec![leaf.der.clone()], leaf.key_der.clone_key())?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A TLS connection to `addr` as `127.0.0.1`.
pub async fn connect(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("127.0.0.1")?;
    Ok(tokio::time::timeout(BOUND, TlsConnector::from(config).connect(name, tcp)).await??)
}

/// A response on its own TLS connection, its body still to be read.
pub struct Opened {
    pub response: http::Response<hyper::body::Incoming>,
    /// The server's leaf certificate.
    pub certificate: CertificateDer<'static>,
    /// The ALPN protocol agreed, if any.
    pub alpn: Option<Vec<u8>>,
}

/// `POST path` with `body` on a new TLS connection to `addr`, over HTTP/2
/// when the server agreed to it by ALPN, HTTP/1.1 otherwise; returns once
/// the response head is in.
pub async fn open(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    path: &str,
    body: &str,
) -> Result<Opened> {
    let tls = connect(addr, config).await?;
    let (_, session) = tls.get_ref();
    let certificate = session
        .peer_certificates()
        .and_then(|c| c.first())
        .context("no server certificate")?
        .clone();
    let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
    let mut request = http::Request::post(format!("https://127.0.0.1{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))?;
    let io = TokioIo::new(tls);
    let response = if alpn.as_deref() == Some(b"h2") {
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
        tokio::spawn(conn);
        tokio::time::timeout(BOUND, sender.send_request(request)).await??
    } else {
        // hyper's connection-level client sends no Host of its own; an
        // HTTP/1.1 request must carry one.
        let host = http::HeaderValue::from_static("127.0.0.1");
        request.headers_mut().insert(http::header::HOST, host);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(conn);
        tokio::time::timeout(BOUND, sender.send_request(request)).await??
    };
    Ok(Opened {
        response,
        certificate,
        alpn,
    })
}

/// [`open`], the body read whole.
pub async fn post(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    path: &str,
    body: &str,
) -> Result<Exchange> {
    let opened = open(addr, config, path, body).await?;
    let status = opened.response.status().as_u16();
    let body = tokio::time::timeout(BOUND, opened.response.into_body().collect())
        .await??
        .to_bytes();
    Ok(Exchange {
        status,
        body,
        certificate: opened.certificate,
        alpn: opened.alpn,
    })
}

/// A sample of the Prometheus text, 0 when absent.
pub fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Fails unless `exchange` was answered 200.
pub fn answered(exchange: &Exchange) -> Result<()> {
    if exchange.status != 200 {
        bail!(
            "status {}: {}",
            exchange.status,
            String::from_utf8_lossy(&exchange.body)
        );
    }
    Ok(())
}
