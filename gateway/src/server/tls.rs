//! TLS for the client listener: certificates from PEM files or a generated self-signed one.
//!
//! TLS 1.3 and 1.2 through rustls (ring provider), ALPN `h2` then `http/1.1`. The SHA-256
//! fingerprint of the leaf certificate is reported so that a client of a self-signed dev
//! gateway can pin it.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;

use crate::config::TlsConfig;

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{path}: {reason}")]
    Pem {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the certificate or key.
    #[error("TLS configuration refused: {0}")]
    Rustls(#[from] rustls::Error),
    /// Generating a self-signed certificate failed.
    #[error("could not generate a self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

/// A ready TLS acceptor and what it presents.
#[derive(Clone)]
pub struct Tls {
    /// Accepts TLS connections.
    pub acceptor: TlsAcceptor,
    /// SHA-256 of the leaf certificate, colon-separated hex.
    pub fingerprint: String,
    /// Whether the certificate was generated at start.
    pub self_signed: bool,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("fingerprint", &self.fingerprint)
            .field("self_signed", &self.self_signed)
            .finish()
    }
}

/// Loads the configured certificate and key.
///
/// # Errors
///
/// Returns [`TlsError`] naming the file if it cannot be read or parsed, or if rustls refuses
/// the pair.
pub fn from_files(config: &TlsConfig) -> Result<Tls, TlsError> {
    let pem_error = |path: &Path, reason: String| TlsError::Pem {
        path: path.display().to_string(),
        reason,
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&config.cert)
        .map_err(|err| pem_error(&config.cert, err.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|err| pem_error(&config.cert, err.to_string()))?;
    if certs.is_empty() {
        return Err(pem_error(&config.cert, "holds no CERTIFICATE block".into()));
    }
    let key = PrivateKeyDer::from_pem_file(&config.key).map_err(|err| pem_error(&config.key, err.to_string()))?;
    build(certs, key, false)
}

/// Generates a self-signed certificate for `localhost` and `127.0.0.1`.
///
/// # Errors
///
/// Returns [`TlsError`] if generation fails.
pub fn self_signed() -> Result<Tls, TlsError> {
    let generated = rcgen::generate_simple_self_signed(vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ])?;
    let cert = generated.cert.der().clone();
    let key = PrivateKeyDer::try_from(generated.signing_key.serialize_der()).map_err(|reason| TlsError::Pem {
        path: "<generated>".into(),
        reason: reason.to_string(),
    })?;
    build(vec![cert], key, true)
}

fn build(certs: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>, self_signed: bool) -> Result<Tls, TlsError> {
    let fingerprint = fingerprint(&certs[0]);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Tls {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        fingerprint,
        self_signed,
    })
}

/// The SHA-256 fingerprint of a DER certificate, as colon-separated upper-case hex.
pub fn fingerprint(cert: &[u8]) -> String {
    Sha256::digest(cert)
        .iter()
        .map(|byte| format!("{byte:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}
