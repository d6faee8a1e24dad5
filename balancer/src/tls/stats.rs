//! The TLS series: handshakes by side, failures by side and reason, the
//! time to connect to a worker (TCP and TLS together), certificate reloads.
//!
//! Owns the counters and the mapping of a handshake error to one of a fixed
//! set of reasons (bounded label values, whatever a peer sends). Bumped with
//! plain atomics where the handshakes happen, read at scrape time.

use std::error::Error;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use balancer_core::metrics::{Histogram, MetricsSource, Writer};
use rustls::CertificateError;

/// Which edge a handshake was on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A caller's connection to the gateway's `--port`.
    Client = 0,
    /// The gateway's connection to an `https://` worker.
    Worker = 1,
}

impl Side {
    const ALL: [Side; 2] = [Side::Client, Side::Worker];

    fn as_str(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Worker => "worker",
        }
    }
}

/// Why a handshake failed, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// It did not finish within its bound.
    Timeout,
    /// The peer closed or reset the connection during it.
    Closed,
    /// The peer did not speak TLS (plain HTTP on the TLS port, say).
    NotTls,
    /// No protocol version, cipher suite or ALPN protocol in common, or the
    /// peer broke the protocol.
    Protocol,
    /// The peer's certificate is not signed by a trusted CA.
    UnknownIssuer,
    /// The peer's certificate is expired or not yet valid.
    Expired,
    /// The peer's certificate does not name the host dialled.
    NameMismatch,
    /// Any other fault of the peer's certificate.
    BadCertificate,
    /// A caller sent no certificate where `--tls-client-ca-path` asks for one.
    NoCertificate,
    /// The peer refused the handshake with an alert (it rejected ours).
    Alert,
    /// Any other socket error.
    Io,
    Other,
}

impl Failure {
    /// In declaration order: a reason's counter is at `reason as usize`.
    const ALL: [Failure; 12] = [
        Failure::Timeout,
        Failure::Closed,
        Failure::NotTls,
        Failure::Protocol,
        Failure::UnknownIssuer,
        Failure::Expired,
        Failure::NameMismatch,
        Failure::BadCertificate,
        Failure::NoCertificate,
        Failure::Alert,
        Failure::Io,
        Failure::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Timeout => "timeout",
            Failure::Closed => "closed",
            Failure::NotTls => "not_tls",
            Failure::Protocol => "protocol",
            Failure::UnknownIssuer => "unknown_issuer",
            Failure::Expired => "expired",
            Failure::NameMismatch => "name_mismatch",
            Failure::BadCertificate => "bad_certificate",
            Failure::NoCertificate => "no_certificate",
            Failure::Alert => "alert",
            Failure::Io => "io",
            Failure::Other => "other",
        }
    }

    /// The reason of a handshake error: the first rustls error or socket
    /// error found along its source chain (tokio-rustls wraps rustls errors
    /// in `io::Error`).
    pub fn of(error: &(dyn Error + 'static)) -> Failure {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(tls) = e.downcast_ref::<rustls::Error>() {
                return Failure::of_rustls(tls);
            }
            if let Some(io) = e.downcast_ref::<io::Error>() {
                if let Some(tls) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    return Failure::of_rustls(tls);
                }
                return match io.kind() {
                    io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe => Failure::Closed,
                    io::ErrorKind::TimedOut => Failure::Timeout,
                    _ => Failure::Io,
                };
            }
            next = e.source();
        }
        Failure::Other
    }

    fn of_rustls(error: &rustls::Error) -> Failure {
        use rustls::Error as E;
        match error {
            E::InvalidMessage(_) | E::InappropriateMessage { .. } => Failure::NotTls,
            E::PeerIncompatible(_) | E::PeerMisbehaved(_) | E::NoApplicationProtocol => {
                Failure::Protocol
            }
            E::NoCertificatesPresented => Failure::NoCertificate,
            E::AlertReceived(_) => Failure::Alert,
            E::InvalidCertificate(cert) => match cert {
                CertificateError::UnknownIssuer => Failure::UnknownIssuer,
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => Failure::Expired,
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => Failure::NameMismatch,
                _ => Failure::BadCertificate,
            },
            _ => Failure::Other,
        }
    }
}

/// Connect times to workers: loopback connects take tens of microseconds,
/// a TLS handshake across a region tens of milliseconds.
const CONNECT_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// The TLS series of one gateway.
pub struct TlsStats {
    handshakes: [AtomicU64; 2],
    failures: [[AtomicU64; Failure::ALL.len()]; 2],
    /// Time to connect to a worker, `[http, https]`.
    connect: [Histogram; 2],
    reloads: [AtomicU64; 2],
    /// Unix seconds when the served certificate was last loaded; 0 without
    /// `--tls-cert-path`.
    loaded_at: AtomicU64,
    /// The served certificate's notAfter, Unix seconds (0: none, or not
    /// readable).
    expires_at: AtomicU64,
}

impl Default for TlsStats {
    fn default() -> Self {
        Self {
            handshakes: Default::default(),
            failures: Default::default(),
            connect: [
                Histogram::new(CONNECT_BUCKETS),
                Histogram::new(CONNECT_BUCKETS),
            ],
            reloads: Default::default(),
            loaded_at: AtomicU64::new(0),
            expires_at: AtomicU64::new(0),
        }
    }
}

impl TlsStats {
    pub fn handshake(&self, side: Side) {
        self.handshakes[side as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn handshake_failed(&self, side: Side, why: Failure) {
        self.failures[side as usize][why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A connection to a worker was ready to carry requests after `took`.
    pub fn worker_connected(&self, tls: bool, took: Duration) {
        self.connect[usize::from(tls)].observe(took);
    }

    /// The served certificate was (re)loaded, or a reload failed.
    pub fn certificate_loaded(&self, ok: bool) {
        self.reloads[usize::from(ok)].fetch_add(1, Ordering::Relaxed);
        if ok {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            self.loaded_at.store(now.as_secs(), Ordering::Relaxed);
        }
    }

    /// The notAfter (Unix seconds) of the certificate now served.
    pub fn certificate_expires(&self, unix_secs: u64) {
        self.expires_at.store(unix_secs, Ordering::Relaxed);
    }

    /// Failed handshakes so far on `side` for `why`.
    #[cfg(test)]
    fn failures(&self, side: Side, why: Failure) -> u64 {
        self.failures[side as usize][why as usize].load(Ordering::Relaxed)
    }
}

impl MetricsSource for TlsStats {
    fn render(&self, w: &mut Writer<'_>) {
        w.family(
            "tls_handshakes_total",
            "counter",
            "TLS handshakes completed; side is client (callers) or worker (https:// workers).",
        );
        for side in Side::ALL {
            w.sample(
                "tls_handshakes_total",
                &[("side", side.as_str())],
                self.handshakes[side as usize].load(Ordering::Relaxed) as f64,
            );
        }
        w.family(
            "tls_handshake_failures_total",
            "counter",
            "TLS handshakes that failed, by side and reason.",
        );
        for side in Side::ALL {
            for (i, why) in Failure::ALL.iter().enumerate() {
                w.sample(
                    "tls_handshake_failures_total",
                    &[("side", side.as_str()), ("reason", why.as_str())],
                    self.failures[side as usize][i].load(Ordering::Relaxed) as f64,
                );
            }
        }
        w.family(
            "worker_connect_seconds",
            "histogram",
            "Time to open a connection to a worker, TLS handshake included; scheme is http or https.",
        );
        for (scheme, h) in ["http", "https"].into_iter().zip(&self.connect) {
            h.render(w, "worker_connect_seconds", &[("scheme", scheme)]);
        }
        w.family(
            "tls_certificate_reloads_total",
            "counter",
            "Loads of the served certificate (--tls-cert-path), at start and on reload; result is ok or error (the previous one is kept).",
        );
        for (result, n) in ["error", "ok"].into_iter().zip(&self.reloads) {
            w.sample(
                "tls_certificate_reloads_total",
                &[("result", result)],
                n.load(Ordering::Relaxed) as f64,
            );
        }
        w.family(
            "tls_certificate_loaded_timestamp_seconds",
            "gauge",
            "Unix time the served certificate in use was loaded; 0 without TLS.",
        );
        w.sample(
            "tls_certificate_loaded_timestamp_seconds",
            &[],
            self.loaded_at.load(Ordering::Relaxed) as f64,
        );
        w.family(
            "tls_certificate_expiry_timestamp_seconds",
            "gauge",
            "Unix time the served certificate expires (its notAfter); 0 without TLS.",
        );
        w.sample(
            "tls_certificate_expiry_timestamp_seconds",
            &[],
            self.expires_at.load(Ordering::Relaxed) as f64,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_errors_map_to_bounded_reasons_through_their_chain() {
        let wrapped = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        let cases: Vec<(Box<dyn Error + Send + Sync>, Failure)> = vec![
            (
                Box::new(wrapped(rustls::Error::InvalidCertificate(
                    CertificateError::UnknownIssuer,
                ))),
                Failure::UnknownIssuer,
            ),
            (
                Box::new(wrapped(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName,
                ))),
                Failure::NameMismatch,
            ),
            (
                Box::new(rustls::Error::NoCertificatesPresented),
                Failure::NoCertificate,
            ),
            (
                Box::new(io::Error::from(io::ErrorKind::UnexpectedEof)),
                Failure::Closed,
            ),
            (
                Box::new(io::Error::from(io::ErrorKind::PermissionDenied)),
                Failure::Io,
            ),
            ("something else".into(), Failure::Other),
        ];
        for (error, expected) in cases {
            assert_eq!(Failure::of(&*error), expected, "{error}");
        }
    }

    #[test]
    fn failures_are_counted_per_side_and_reason() {
        let stats = TlsStats::default();
        stats.handshake_failed(Side::Worker, Failure::UnknownIssuer);
        stats.handshake_failed(Side::Worker, Failure::UnknownIssuer);
        stats.handshake_failed(Side::Client, Failure::NotTls);
        assert_eq!(stats.failures(Side::Worker, Failure::UnknownIssuer), 2);
        assert_eq!(stats.failures(Side::Client, Failure::UnknownIssuer), 0);
        let mut out = String::new();
        stats.render(&mut Writer::new(&mut out, "b"));
        assert!(
            out.contains("b_tls_handshake_failures_total{side=\"client\",reason=\"not_tls\"} 1"),
            "{out}"
        );
    }
}
