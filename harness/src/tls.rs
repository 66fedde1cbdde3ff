//! A throwaway certificate authority for TLS tests: a CA, a server certificate for
//! `localhost`/`127.0.0.1` that the gateway serves, client certificates for mTLS, and the
//! reissues and broken deployments the certificate-reload tests need.

use std::path::{Path, PathBuf};

use rustls::pki_types::{CertificateDer, ServerName};

/// A throwaway certificate authority and a server certificate for `localhost`/`127.0.0.1`,
/// written as PEM files into a temporary folder.
#[derive(Debug)]
pub struct TestCa {
    /// The folder holding the files.
    pub dir: tempfile::TempDir,
    /// The CA certificate (DER), for clients to trust.
    pub ca_der: CertificateDer<'static>,
    /// The CA certificate (PEM file), for clients that read one.
    pub ca_path: PathBuf,
    /// The server certificate chain (PEM file).
    pub cert_path: PathBuf,
    /// The server key (PEM file).
    pub key_path: PathBuf,
    /// The server certificate (DER) in the files now.
    pub server_der: CertificateDer<'static>,
    /// The CA's settings and key (PEM), to issue more server certificates.
    ca_params: rcgen::CertificateParams,
    ca_key_pem: String,
}

impl TestCa {
    /// Generates the CA and the server certificate.
    ///
    /// # Errors
    ///
    /// Fails if generation or writing fails.
    pub fn new() -> anyhow::Result<TestCa> {
        let dir = tempfile::tempdir()?;
        let ca_key = rcgen::KeyPair::generate()?;
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "switchyard test CA");
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let ca_key_pem = ca_key.serialize_pem();
        let issuer = rcgen::Issuer::new(ca_params.clone(), ca_key);
        let (server_cert, server_key) = TestCa::server_pair(&issuer)?;
        let cert_path = dir.path().join("server.pem");
        let key_path = dir.path().join("server.key");
        std::fs::write(&cert_path, server_cert.pem())?;
        std::fs::write(&key_path, server_key.serialize_pem())?;
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, ca_cert.pem())?;
        Ok(TestCa {
            ca_der: ca_cert.der().clone(),
            ca_path,
            dir,
            cert_path,
            key_path,
            server_der: server_cert.der().clone(),
            ca_params,
            ca_key_pem,
        })
    }

    /// The CA, to sign with.
    fn issuer(&self) -> anyhow::Result<rcgen::Issuer<'static, rcgen::KeyPair>> {
        let key = rcgen::KeyPair::from_pem(&self.ca_key_pem)?;
        Ok(rcgen::Issuer::new(self.ca_params.clone(), key))
    }

    fn server_pair(issuer: &rcgen::Issuer<'_, rcgen::KeyPair>) -> anyhow::Result<(rcgen::Certificate, rcgen::KeyPair)> {
        let server_key = rcgen::KeyPair::generate()?;
        let server_params = rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])?;
        let server_cert = server_params.signed_by(&server_key, issuer)?;
        Ok((server_cert, server_key))
    }

    /// Issues a new server certificate and key from the same CA and writes them over the
    /// files (each replaced by a rename, as deployment tools do); answers the new certificate.
    ///
    /// # Errors
    ///
    /// Fails if generation or writing fails.
    pub fn reissue(&mut self) -> anyhow::Result<CertificateDer<'static>> {
        let issuer = self.issuer()?;
        let (cert, key) = TestCa::server_pair(&issuer)?;
        replace(&self.key_path, key.serialize_pem().as_bytes())?;
        replace(&self.cert_path, cert.pem().as_bytes())?;
        self.server_der = cert.der().clone();
        Ok(self.server_der.clone())
    }

    /// Writes a certificate whose key is not the one in the key file (a broken deployment).
    ///
    /// # Errors
    ///
    /// Fails if generation or writing fails.
    pub fn write_mismatched_certificate(&self) -> anyhow::Result<()> {
        let issuer = self.issuer()?;
        let (cert, _other_key) = TestCa::server_pair(&issuer)?;
        replace(&self.cert_path, cert.pem().as_bytes())
    }

    /// A client certificate and key issued by the CA (for mTLS).
    ///
    /// # Errors
    ///
    /// Fails if generation fails.
    pub fn client_identity(
        &self,
    ) -> anyhow::Result<(Vec<CertificateDer<'static>>, rustls::pki_types::PrivateKeyDer<'static>)> {
        let issuer = self.issuer()?;
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "switchyard operator");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &issuer)?;
        let key =
            rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).map_err(|err| anyhow::anyhow!(err))?;
        Ok((vec![cert.der().clone()], key))
    }

    /// A TOML `[server.tls]` table pointing at the files.
    pub fn tls_toml(&self) -> String {
        format!(
            "[server.tls]\ncert = {:?}\nkey = {:?}\n",
            self.cert_path.display().to_string(),
            self.key_path.display().to_string()
        )
    }
}

/// Replaces `path` with `bytes` through a temporary file and a rename.
fn replace(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let temporary = path.with_extension("new");
    std::fs::write(&temporary, bytes)?;
    std::fs::rename(&temporary, path)?;
    Ok(())
}

/// The name test certificates are issued for.
pub(crate) fn localhost() -> ServerName<'static> {
    ServerName::DnsName(
        rustls::pki_types::DnsName::try_from("localhost")
            .expect("`localhost` is a valid DNS name")
            .to_owned(),
    )
}
