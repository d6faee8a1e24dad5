//! The gateway as a TLS client of `https://` workers: the trust roots
//! (`--worker-ca-path`, else the system's), the optional client certificate
//! (`--client-cert-path`, `--client-key-path`), and [`WorkerConnector`], the
//! connector of every upstream pool, health probes and model discovery
//! included.
//!
//! Owns connection set-up only: TCP, then TLS for `https://`, both within
//! one connect timeout, so a handshake that stalls or fails is a connect
//! failure to the caller (the attempt loop charges it to the worker as one).
//! Every pool shares one session cache per worker, so a session is resumed
//! whichever serving thread (or probe) connects next; per worker, because
//! rustls keys sessions by server name alone and workers on one host differ
//! by port only.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use http::uri::Scheme;
use hyper_rustls::MaybeHttpsStream;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use rustls::client::Resumption;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use super::stats::{Failure, Side, TlsStats};
use super::{TlsError, key_pair, pair_rejected, provider, roots};
use crate::bodies::BoxError;

/// `--worker-ca-path`, `--client-cert-path`, `--client-key-path`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerTlsConfig {
    /// PEM CA bundle trusted for workers instead of the system's roots.
    pub ca_path: Option<std::path::PathBuf>,
    /// PEM certificate chain and key presented to workers that ask for one
    /// (mutual TLS); both or neither.
    pub client_cert_path: Option<std::path::PathBuf>,
    pub client_key_path: Option<std::path::PathBuf>,
}

/// Sessions kept per worker for resumption: one per pool and probe is
/// plenty.
const SESSIONS_PER_WORKER: usize = 32;

/// Workers whose sessions are kept apart; past this (a fleet that churns
/// through addresses) the caches start over, costing one full handshake
/// each.
const MAX_SESSION_CACHES: usize = 4096;

/// The client side of TLS to workers, shared by every pool.
pub struct WorkerTls {
    config: ClientConfig,
    /// The connector of each worker (`host:port`), with its own sessions.
    /// Locked when a connection is opened, never per request.
    per_worker: Mutex<HashMap<String, TlsConnector>>,
    stats: Arc<TlsStats>,
}

impl WorkerTls {
    /// Loads the roots and the client certificate, or fails naming the file
    /// that cannot be used.
    pub fn load(files: &WorkerTlsConfig, stats: Arc<TlsStats>) -> Result<Self, TlsError> {
        let roots = match &files.ca_path {
            Some(path) => roots(path)?,
            None => system_roots(),
        };
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|cause| TlsError::Rejected {
                context: "protocol versions".to_owned(),
                cause,
            })?
            .with_root_certificates(roots);
        let mut config = match (&files.client_cert_path, &files.client_key_path) {
            (Some(cert), Some(key)) => {
                let (chain, private) = key_pair(cert, key)?;
                builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| pair_rejected(cert, key, e))?
            }
            // The configuration checks that both or neither are given.
            _ => builder.with_no_client_auth(),
        };
        // The upstream pools speak HTTP/1.1.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            config,
            per_worker: Mutex::new(HashMap::new()),
            stats,
        })
    }

    /// The TLS connector of the worker at `authority`.
    fn for_worker(&self, authority: &str) -> TlsConnector {
        let mut connectors = self
            .per_worker
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(connector) = connectors.get(authority) {
            return connector.clone();
        }
        if connectors.len() >= MAX_SESSION_CACHES {
            connectors.clear();
        }
        let mut config = self.config.clone();
        config.resumption = Resumption::in_memory_sessions(SESSIONS_PER_WORKER);
        let connector = TlsConnector::from(Arc::new(config));
        connectors.insert(authority.to_owned(), connector.clone());
        connector
    }

    /// A connector for one pool, TCP and TLS within `connect_timeout`.
    pub fn connector(self: &Arc<Self>, connect_timeout: Duration) -> WorkerConnector {
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(connect_timeout));
        tcp.set_nodelay(true);
        // `https://` URIs reach this connector; TLS is layered on below.
        tcp.enforce_http(false);
        WorkerConnector {
            tcp,
            tls: self.clone(),
            timeout: connect_timeout,
        }
    }
}

/// The system's CA certificates (as OpenSSL finds them); none found leaves
/// `https://` workers failing their handshakes until `--worker-ca-path` is
/// given, which is logged.
fn system_roots() -> RootCertStore {
    let found = rustls_native_certs::load_native_certs();
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(found.certs);
    if added == 0 {
        tracing::warn!(
            errors = ?found.errors,
            "no system CA certificates: https:// workers need --worker-ca-path"
        );
    }
    store
}

/// A connection to a worker: plain or TLS.
pub type WorkerStream = MaybeHttpsStream<TokioIo<TcpStream>>;

/// Opens worker connections: TCP for `http://`, TCP then TLS for
/// `https://`, the whole within the connect timeout.
#[derive(Clone)]
pub struct WorkerConnector {
    tcp: HttpConnector,
    tls: Arc<WorkerTls>,
    timeout: Duration,
}

/// A worker's TLS handshake failed; shown in the attempt's log line.
#[derive(Debug, thiserror::Error)]
#[error("TLS handshake with {host} failed ({}): {detail}", reason.as_str())]
struct HandshakeError {
    host: String,
    reason: Failure,
    detail: String,
}

impl WorkerTls {
    /// The TLS handshake with the worker at `authority` (`host:port`) over
    /// `io`, by `deadline`; counted, and logged when it fails. An IP
    /// literal host is checked against the certificate's IP names.
    pub async fn handshake<IO>(
        &self,
        authority: &str,
        io: IO,
        deadline: Instant,
    ) -> Result<tokio_rustls::client::TlsStream<IO>, BoxError>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let host = match authority.rsplit_once(':') {
            Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
            _ => authority,
        }
        .trim_matches(['[', ']']);
        let name = ServerName::try_from(host.to_owned())?;
        let connector = self.for_worker(authority);
        let failure = match tokio::time::timeout_at(deadline, connector.connect(name, io)).await {
            Ok(Ok(stream)) => {
                self.stats.handshake(Side::Worker);
                return Ok(stream);
            }
            Ok(Err(error)) => (Failure::of(&error), error.to_string()),
            Err(_) => (
                Failure::Timeout,
                "no answer within the connect timeout".to_owned(),
            ),
        };
        let (reason, detail) = failure;
        self.stats.handshake_failed(Side::Worker, reason);
        let error = HandshakeError {
            host: host.to_owned(),
            reason,
            detail,
        };
        tracing::warn!(%error, "worker connection failed");
        Err(error.into())
    }

    /// The TLS series, for the fast path's connections.
    pub fn stats(&self) -> &TlsStats {
        &self.stats
    }
}

impl tower_service::Service<Uri> for WorkerConnector {
    type Response = WorkerStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<WorkerStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let authority = uri.authority().map(|a| a.as_str().to_owned());
        let https = uri.scheme() == Some(&Scheme::HTTPS);
        let connecting = self.tcp.call(uri);
        let (timeout, tls) = (self.timeout, self.tls.clone());
        Box::pin(async move {
            let started = Instant::now();
            let tcp = connecting.await?;
            if !https {
                tls.stats.worker_connected(false, started.elapsed());
                return Ok(MaybeHttpsStream::Http(tcp));
            }
            let authority = authority.unwrap_or_default();
            let stream = tls
                .handshake(&authority, TokioIo::new(tcp), started + timeout)
                .await?;
            tls.stats.worker_connected(true, started.elapsed());
            Ok(MaybeHttpsStream::Https(TokioIo::new(stream)))
        })
    }
}
