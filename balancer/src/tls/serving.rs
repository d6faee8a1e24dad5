//! The certificate the gateway serves on `--port`: loaded at start (a bad
//! file is an error naming it), swapped whole on SIGHUP or when a file
//! changes (a bad file keeps the certificate in use, and says why), and the
//! handshake of each accepted connection under a time bound.
//!
//! Owns the rustls server configuration and its reloads only. Open
//! connections keep the configuration they were accepted with, so a
//! rotation never drops one; new connections get the new certificate.
//! Sessions and tickets outlive reloads, so callers resume across them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use rustls::server::{ProducesTickets, ServerSessionMemoryCache, StoresServerSessions};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::stats::{Failure, Side, TlsStats};
use super::{TlsError, key_pair, pair_rejected, provider, roots};

/// TLS sessions kept for resumption across every serving thread.
const SESSIONS: usize = 4096;

/// `--tls-cert-path`, `--tls-key-path`, `--tls-client-ca-path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingTlsConfig {
    /// PEM certificate chain, leaf first.
    pub cert_path: PathBuf,
    /// PEM private key of the leaf.
    pub key_path: PathBuf,
    /// PEM CA bundle: when set, every caller must present a certificate it
    /// signed.
    pub client_ca_path: Option<PathBuf>,
    /// `--tls-watch-interval-secs`: how often the files are looked at for a
    /// change (a stat of each: cheap, and no inotify watch to lose when a
    /// directory is swapped, as Kubernetes does with secrets); `None`: only
    /// SIGHUP reloads.
    pub watch_interval: Option<Duration>,
}

impl ServingTlsConfig {
    fn paths(&self) -> impl Iterator<Item = &PathBuf> {
        [&self.cert_path, &self.key_path]
            .into_iter()
            .chain(&self.client_ca_path)
    }
}

/// The served certificate, swappable while connections come and go.
pub struct ServingTls {
    files: ServingTlsConfig,
    current: ArcSwap<ServerConfig>,
    sessions: Arc<dyn StoresServerSessions>,
    tickets: Arc<dyn ProducesTickets>,
    stats: Arc<TlsStats>,
}

/// What a file looked like when last loaded: a change of any part is a
/// change of the file (a rename over it changes the inode).
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamp(path: &PathBuf) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len(), meta.ino()))
}

impl ServingTls {
    /// Loads the files, or fails naming the one that cannot be used.
    pub fn load(files: ServingTlsConfig, stats: Arc<TlsStats>) -> Result<Arc<Self>, TlsError> {
        let sessions: Arc<dyn StoresServerSessions> = ServerSessionMemoryCache::new(SESSIONS);
        let tickets =
            rustls::crypto::ring::Ticketer::new().map_err(|cause| TlsError::Rejected {
                context: "session tickets".to_owned(),
                cause,
            })?;
        let (config, expires) = build(&files, &sessions, &tickets)?;
        stats.certificate_loaded(true);
        stats.certificate_expires(expires);
        Ok(Arc::new(Self {
            files,
            current: ArcSwap::from_pointee(config),
            sessions,
            tickets,
            stats,
        }))
    }

    /// Loads the files again; on any error the certificate in use stays
    /// and the error is logged. Returns whether the new one is in use.
    pub fn reload(&self) -> bool {
        match build(&self.files, &self.sessions, &self.tickets) {
            Ok((config, expires)) => {
                self.current.store(Arc::new(config));
                self.stats.certificate_loaded(true);
                self.stats.certificate_expires(expires);
                tracing::info!(cert = %self.files.cert_path.display(), "TLS certificate reloaded");
                true
            }
            Err(error) => {
                self.stats.certificate_loaded(false);
                tracing::warn!(%error, "TLS certificate not reloaded: the previous one stays in use");
                false
            }
        }
    }

    /// The TLS handshake of an accepted connection, within `within`;
    /// counted by outcome.
    pub async fn accept<IO>(&self, io: IO, within: Duration) -> Result<TlsStream<IO>, Failure>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let acceptor = TlsAcceptor::from(self.current.load_full());
        let failure = match tokio::time::timeout(within, acceptor.accept(io)).await {
            Ok(Ok(stream)) => {
                self.stats.handshake(Side::Client);
                return Ok(stream);
            }
            Ok(Err(error)) => Failure::of(&error),
            Err(_) => Failure::Timeout,
        };
        self.stats.handshake_failed(Side::Client, failure);
        Err(failure)
    }

    /// The task that reloads on SIGHUP and whenever a file changes, until
    /// `stop` flips. The SIGHUP handler is in place when this returns, so a
    /// signal sent once the gateway listens is never the default action
    /// (which ends the process).
    pub fn watch(
        self: Arc<Self>,
        mut stop: watch::Receiver<bool>,
    ) -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        Ok(async move {
            let mut seen: Vec<Stamp> = self.files.paths().map(stamp).collect();
            // Without file watching the tick never comes.
            let mut poll = tokio::time::interval(
                self.files
                    .watch_interval
                    .unwrap_or(Duration::from_secs(u32::MAX.into())),
            );
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            poll.reset();
            loop {
                tokio::select! {
                    _ = hangup.recv() => {
                        tracing::info!("SIGHUP: reloading the TLS certificate");
                        seen = self.files.paths().map(stamp).collect();
                        self.reload();
                    }
                    _ = poll.tick() => {
                        let now: Vec<Stamp> = self.files.paths().map(stamp).collect();
                        if now != seen {
                            seen = now;
                            self.reload();
                        }
                    }
                    _ = stop.changed() => return,
                }
                if *stop.borrow() {
                    return;
                }
            }
        })
    }
}

/// A server configuration from the files: ALPN `h2` and `http/1.1`, the
/// shared session cache and ticketer, and the client verifier when
/// `--tls-client-ca-path` is set; with the served certificate's notAfter
/// (Unix seconds, 0 when it cannot be read: rustls judged it usable).
fn build(
    files: &ServingTlsConfig,
    sessions: &Arc<dyn StoresServerSessions>,
    tickets: &Arc<dyn ProducesTickets>,
) -> Result<(ServerConfig, u64), TlsError> {
    let (chain, key) = key_pair(&files.cert_path, &files.key_path)?;
    let expires = chain
        .first()
        .and_then(|leaf| x509_parser::parse_x509_certificate(leaf).ok())
        .and_then(|(_, cert)| u64::try_from(cert.validity().not_after.timestamp()).ok())
        .unwrap_or(0);
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|cause| TlsError::Rejected {
            context: "protocol versions".to_owned(),
            cause,
        })?;
    let builder = match &files.client_ca_path {
        Some(path) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots(path)?), provider())
                    .build()
                    .map_err(|cause| TlsError::ClientCa {
                        path: path.clone(),
                        cause,
                    })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| pair_rejected(&files.cert_path, &files.key_path, e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.session_storage = sessions.clone();
    config.ticketer = tickets.clone();
    Ok((config, expires))
}
