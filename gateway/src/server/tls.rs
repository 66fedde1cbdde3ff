//! TLS for the client listener: certificates from PEM files or a generated self-signed one.
//!
//! TLS 1.3 and 1.2 through rustls (ring provider), ALPN `h2` then `http/1.1`. The SHA-256
//! fingerprint of the leaf certificate is reported so that a client of a self-signed dev
//! gateway can pin it.
//!
//! The served pair sits behind an `ArcSwap` that rustls asks on every handshake, so a pair
//! loaded from files can be replaced while the gateway runs ([`spawn_reloader`]: when either
//! file changes, or on SIGHUP): new connections get the new certificate, open ones keep the
//! session they have. A new pair that does not load, or whose key does not match its
//! certificate, is refused with a log line naming the files, and the old one stays.

use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use crate::config::{AdminTlsConfig, TlsConfig};

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
    /// The pair served now.
    current: Arc<ArcSwap<Served>>,
    /// Whether the certificate was generated at start.
    pub self_signed: bool,
}

/// A certificate chain with its key, and the leaf's fingerprint.
struct Served {
    key: Arc<CertifiedKey>,
    fingerprint: String,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("fingerprint", &self.fingerprint())
            .field("self_signed", &self.self_signed)
            .finish()
    }
}

/// Hands rustls the pair served now, for every handshake.
#[derive(Debug)]
struct Current(Arc<ArcSwap<Served>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load().key.clone())
    }
}

impl Tls {
    /// SHA-256 of the leaf certificate served now, colon-separated hex.
    pub fn fingerprint(&self) -> String {
        self.current.load().fingerprint.clone()
    }

    /// Loads the pair in `files` and serves it from the next handshake on; answers its
    /// fingerprint.
    ///
    /// # Errors
    ///
    /// Returns [`TlsError`] naming the file if either cannot be read or parsed, or if the key
    /// does not match the certificate; the pair served before stays.
    pub fn reload(&self, files: &TlsConfig) -> Result<String, TlsError> {
        let served = load_files(files)?;
        let fingerprint = served.fingerprint.clone();
        self.current.store(Arc::new(served));
        Ok(fingerprint)
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_files(config: &TlsConfig) -> Result<Served, TlsError> {
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
    served(certs, key).map_err(|err| TlsError::Pem {
        path: format!("{} and {}", config.cert.display(), config.key.display()),
        reason: err.to_string(),
    })
}

fn served(certs: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Result<Served, rustls::Error> {
    let fingerprint = fingerprint(&certs[0]);
    // Checks that the key is the certificate's.
    let key = CertifiedKey::from_der(certs, key, &provider())?;
    Ok(Served {
        key: Arc::new(key),
        fingerprint,
    })
}

/// Loads the configured certificate and key.
///
/// # Errors
///
/// Returns [`TlsError`] naming the file if it cannot be read or parsed, or if rustls refuses
/// the pair.
pub fn from_files(config: &TlsConfig) -> Result<Tls, TlsError> {
    build(load_files(config)?, false, None)
}

/// Loads the admin listener's certificate and key and, when `client_ca` is set, requires
/// every client to present a certificate that chains to it.
///
/// # Errors
///
/// Returns [`TlsError`] naming the file that cannot be read or parsed, or holds no usable CA.
pub fn admin_from_files(config: &AdminTlsConfig) -> Result<Tls, TlsError> {
    let client_roots = match &config.client_ca {
        None => None,
        Some(path) => {
            let refused = |reason: String| TlsError::Pem {
                path: path.display().to_string(),
                reason,
            };
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(path).map_err(|err| refused(err.to_string()))? {
                roots
                    .add(cert.map_err(|err| refused(err.to_string()))?)
                    .map_err(|err| refused(err.to_string()))?;
            }
            if roots.is_empty() {
                return Err(refused("holds no CA certificate".into()));
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|err| refused(err.to_string()))?;
            Some(verifier)
        }
    };
    build(load_files(&config.pair())?, false, client_roots)
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
    build(served(vec![cert], key)?, true, None)
}

fn build(
    served: Served,
    self_signed: bool,
    clients: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
) -> Result<Tls, TlsError> {
    let current = Arc::new(ArcSwap::from_pointee(served));
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?;
    let builder = match clients {
        Some(verifier) => builder.with_client_cert_verifier(verifier),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(Arc::new(Current(current.clone())));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Tls {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        current,
        self_signed,
    })
}

/// Certificate reloads, by listener (`client`, `admin`) and outcome (`loaded`, `refused`).
pub type ReloadOutcomes = Family<Vec<(&'static str, String)>, Counter>;

/// Reloads `files` into `tls` whenever either file changes (written in place or replaced by a
/// rename: their folders are watched) and on SIGHUP. A burst of changes (the certificate, then
/// the key) is let settle for 200 ms before one reload.
///
/// # Errors
///
/// Returns [`TlsError::Pem`] if a folder cannot be watched.
pub fn spawn_reloader(
    listener: &'static str,
    tls: Tls,
    files: TlsConfig,
    outcomes: ReloadOutcomes,
) -> Result<JoinHandle<()>, TlsError> {
    let watched = [files.cert.clone(), files.key.clone()];
    crate::reload::on_change(&watched, move || {
        let before = tls.fingerprint();
        let outcome = match tls.reload(&files) {
            Ok(fingerprint) => {
                if fingerprint != before {
                    tracing::info!(listener, %fingerprint, "TLS certificate reloaded (SHA-256)");
                }
                "loaded"
            }
            Err(err) => {
                tracing::error!(listener, error = %err, fingerprint = %before, "new TLS certificate refused; serving the old one");
                "refused"
            }
        };
        outcomes
            .get_or_create(&vec![
                ("listener", listener.to_string()),
                ("outcome", outcome.to_string()),
            ])
            .inc();
    })
    .map_err(|err| TlsError::Pem {
        path: err.path.display().to_string(),
        reason: format!("cannot watch for changes: {}", err.source),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (String, String, String) {
        let generated = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("generates");
        let fingerprint = fingerprint(generated.cert.der());
        (generated.cert.pem(), generated.signing_key.serialize_pem(), fingerprint)
    }

    #[test]
    fn a_reload_serves_the_new_pair_and_refuses_a_mismatched_one() {
        let dir = tempfile::tempdir().expect("temp dir");
        let files = TlsConfig {
            cert: dir.path().join("cert.pem"),
            key: dir.path().join("key.pem"),
        };
        let (cert_a, key_a, fingerprint_a) = pair();
        let (cert_b, key_b, fingerprint_b) = pair();
        std::fs::write(&files.cert, &cert_a).expect("write");
        std::fs::write(&files.key, &key_a).expect("write");
        let tls = from_files(&files).expect("loads");
        assert_eq!(tls.fingerprint(), fingerprint_a);

        // B's certificate with A's key: refused, A stays.
        std::fs::write(&files.cert, &cert_b).expect("write");
        let err = tls.reload(&files).expect_err("mismatched pair");
        assert!(err.to_string().contains("cert.pem"), "{err}");
        assert_eq!(tls.fingerprint(), fingerprint_a);

        std::fs::write(&files.key, &key_b).expect("write");
        assert_eq!(tls.reload(&files).expect("loads"), fingerprint_b);
        assert_eq!(tls.fingerprint(), fingerprint_b);
        let served = tls.current.load();
        assert_eq!(served.key.end_entity_cert().expect("leaf").as_ref(), {
            let der: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
                .expect("reads")
                .collect::<Result<_, _>>()
                .expect("parses");
            der[0].to_vec()
        });
    }
}
