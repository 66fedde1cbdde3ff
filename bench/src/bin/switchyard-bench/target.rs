//! Turning `--url`, `--ca-cert` and `--insecure` into a client of the gateway under test.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use switchyard_harness::Client;

/// A client of `url` (`https://HOST:PORT` or `http://HOST:PORT`): over TLS it trusts the
/// certificates in `ca_cert` (PEM), or any certificate with `insecure` (for a dev gateway's
/// self-signed one), and offers HTTP/1.1.
///
/// # Errors
///
/// Fails on a malformed URL, an unresolvable host or an unreadable CA file.
pub async fn client(url: &str, ca_cert: Option<&Path>, insecure: bool) -> anyhow::Result<Client> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("http://") {
        (false, rest)
    } else {
        anyhow::bail!("--url `{url}` must start with https:// or http://");
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => anyhow::bail!("--url `{url}` must name a port (e.g. https://127.0.0.1:8443)"),
    };
    let addr = tokio::net::lookup_host(authority)
        .await
        .with_context(|| format!("cannot resolve `{authority}`"))?
        .next()
        .with_context(|| format!("`{authority}` resolves to no address"))?;
    if !tls {
        return Ok(Client::plain(addr));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder =
        rustls::ClientConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
    let mut config = if insecure {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth()
    } else {
        let mut roots = rustls::RootCertStore::empty();
        if let Some(path) = ca_cert {
            for cert in CertificateDer::pem_file_iter(path)
                .with_context(|| format!("cannot read CA certificates from {}", path.display()))?
            {
                roots.add(cert.with_context(|| format!("bad certificate in {}", path.display()))?)?;
            }
        }
        anyhow::ensure!(
            !roots.is_empty(),
            "give --ca-cert FILE to trust the gateway's certificate, or --insecure for a dev gateway's self-signed one"
        );
        builder.with_root_certificates(roots).with_no_client_auth()
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let server_name =
        ServerName::try_from(host.to_string()).with_context(|| format!("`{host}` is not a server name"))?;
    Ok(Client::with_tls_config(addr, server_name, Arc::new(config)))
}

/// Accepts any server certificate but still checks the handshake signatures, so the session is
/// encrypted and authenticated to *some* key: the dev gateway's generated one.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
