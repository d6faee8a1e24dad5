//! TLS at both edges of the gateway: the certificate it serves callers
//! ([`ServingTls`], reloaded on SIGHUP and when its files change) and the
//! client it speaks to `https://` workers with ([`WorkerTls`]: their CA, an
//! optional client certificate, session resumption).
//!
//! Owns PEM loading (bounded in size, every error naming its file), the
//! rustls configurations, and the TLS series ([`TlsStats`]): handshakes and
//! their failures by side and reason, the time to connect to a worker, and
//! certificate reloads. It never decides what a failed handshake means for a
//! worker: to the proxy's attempt loop it is a connect error, which the
//! breaker is charged with like any other.

mod serving;
mod stats;
mod upstream;

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub use serving::{ServingTls, ServingTlsConfig};
pub use stats::{Failure, Side, TlsStats};
pub use upstream::{WorkerConnector, WorkerStream, WorkerTls, WorkerTlsConfig};

/// The largest PEM file read: a certificate chain is a few kilobytes; a
/// path pointing at something else must not be read whole.
const MAX_PEM_BYTES: u64 = 1 << 20;

/// Why a certificate, a key or a CA bundle cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    // The causes are part of each message and not `source`s, so that a
    // chain printed whole (`{:#}`) does not say them twice.
    #[error("cannot read {}: {cause}", path.display())]
    Read { path: PathBuf, cause: io::Error },
    #[error("{}: larger than {MAX_PEM_BYTES} bytes, not a PEM file", path.display())]
    TooLarge { path: PathBuf },
    #[error("{}: not a PEM {what}: {detail}", path.display())]
    Pem {
        path: PathBuf,
        what: &'static str,
        detail: String,
    },
    #[error("{}: no PEM {what} in the file", path.display())]
    Missing { path: PathBuf, what: &'static str },
    #[error("{context}: {cause}")]
    Rejected {
        context: String,
        cause: rustls::Error,
    },
    #[error("{}: {cause}", path.display())]
    ClientCa {
        path: PathBuf,
        cause: rustls::server::VerifierBuilderError,
    },
}

/// The crypto of every configuration, named rather than taken from the
/// process default, so that no dependency's feature can swap it.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The bytes of a PEM file, at most [`MAX_PEM_BYTES`].
fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    let read = |cause| TlsError::Read {
        path: path.to_owned(),
        cause,
    };
    let mut bytes = Vec::new();
    File::open(path)
        .map_err(read)?
        .take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

fn pem_error(path: &Path, what: &'static str, error: pem::Error) -> TlsError {
    match error {
        pem::Error::NoItemsFound => TlsError::Missing {
            path: path.to_owned(),
            what,
        },
        other => TlsError::Pem {
            path: path.to_owned(),
            what,
            detail: other.to_string(),
        },
    }
}

/// Every certificate of a PEM file, in order (a chain: leaf first).
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    const WHAT: &str = "certificate";
    let bytes = read_pem(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, WHAT, e))?;
    if certs.is_empty() {
        return Err(pem_error(path, WHAT, pem::Error::NoItemsFound));
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(&read_pem(path)?).map_err(|e| pem_error(path, "private key", e))
}

/// The CA certificates of a PEM bundle; any that is not a usable trust
/// anchor fails the whole bundle rather than trusting less than asked.
fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(path)? {
        store.add(cert).map_err(|cause| TlsError::Rejected {
            context: format!("{}: a CA certificate", path.display()),
            cause,
        })?;
    }
    Ok(store)
}

/// A certificate chain and its key, checked to belong together.
fn key_pair(
    cert_path: &Path,
    key_path: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    Ok((certificates(cert_path)?, private_key(key_path)?))
}

/// The context of a rustls refusal of a certificate and key.
fn pair_rejected(cert_path: &Path, key_path: &Path, cause: rustls::Error) -> TlsError {
    TlsError::Rejected {
        context: format!(
            "certificate {} with key {}",
            cert_path.display(),
            key_path.display()
        ),
        cause,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("balancer-tls-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn every_unusable_file_is_named_in_its_error() {
        let dir = scratch("errors");
        let missing = dir.join("absent.pem");
        let empty = file(&dir, "empty.pem", "");
        let garbage = file(
            &dir,
            "garbage.pem",
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        );
        let huge = file(&dir, "huge.pem", &"A".repeat(MAX_PEM_BYTES as usize + 1));
        for (path, expected) in [
            (&missing, "cannot read"),
            (&empty, "no PEM certificate"),
            (&garbage, "not a PEM certificate"),
            (&huge, "larger than"),
        ] {
            let error = certificates(path).unwrap_err().to_string();
            assert!(
                error.contains(&path.display().to_string()) && error.contains(expected),
                "{error}"
            );
        }
        let error = private_key(&empty).unwrap_err().to_string();
        assert!(error.contains("no PEM private key"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
