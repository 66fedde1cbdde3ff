//! Fetching media from `http(s)` URLs, for `[media] fetch = true`.
//!
//! A URL in an `image_url` or `video_url` part is fetched before the request's media is read,
//! under every limit an edge gateway needs, because the URL is the client's and the network is
//! the operator's: the host must be on `allow_hosts` (exactly, or under a `*.` wildcard); its
//! name is resolved here and every address it resolves to must be public (not loopback,
//! private, link-local, shared, unspecified, multicast or documentation space, IPv4-mapped
//! forms included) unless `allow_private` says otherwise; the connection goes to the address
//! that was checked, so a second resolution cannot swap in another (DNS rebinding); HTTPS is
//! verified against the Mozilla roots and `fetch_ca_file`; redirects are not followed; the
//! answer must be 200 and at most `max_bytes` (checked on `content-length` and while reading);
//! and the whole fetch has `fetch_timeout_ms`. Anything else is a 400 naming the part.
//!
//! One request's URLs are fetched `fetch_concurrency` at a time, and never more of them than
//! `max_items` (the request path counts the parts before fetching; this module refuses more
//! too), so a request cannot make the gateway open connections or hold bytes without bound.
//! The first failure ends the request's fetching: fetches not yet started never start.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use switchyard_protocol::api::{GenerateRequest, MessageContent, PartKind};

use crate::config::MediaConfig;

/// Why the fetcher could not be built from `[media]`.
#[derive(Debug, thiserror::Error)]
#[error("[media] fetch_ca_file {path}: {reason}")]
pub struct FetchSetupError {
    path: String,
    reason: String,
}

/// Fetches media URLs under `[media]`'s rules; see the module docs.
#[derive(Clone)]
pub(crate) struct Fetcher {
    config: MediaConfig,
    tls: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Fetcher {
    /// The fetcher of `config`, or `None` when fetching is off.
    ///
    /// # Errors
    ///
    /// If `fetch_ca_file` cannot be read or holds no certificate.
    pub(crate) fn new(config: &MediaConfig) -> Result<Option<Fetcher>, FetchSetupError> {
        if !config.fetch {
            return Ok(None);
        }
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(path) = &config.fetch_ca_file {
            let fail = |reason: String| FetchSetupError {
                path: path.display().to_string(),
                reason,
            };
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                .map_err(|err| fail(err.to_string()))?
                .collect::<Result<_, _>>()
                .map_err(|err| fail(err.to_string()))?;
            if certs.is_empty() {
                return Err(fail("holds no CERTIFICATE block".into()));
            }
            for cert in certs {
                roots.add(cert).map_err(|err| fail(err.to_string()))?;
            }
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|err| FetchSetupError {
                path: String::new(),
                reason: err.to_string(),
            })?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Some(Fetcher {
            config: config.clone(),
            tls: tokio_rustls::TlsConnector::from(Arc::new(tls)),
        }))
    }

    /// Fetches every `http(s)` URL among the media parts of `request`, `fetch_concurrency` at a
    /// time; answers the bytes by (message, part), or the first part that failed and why (then
    /// the fetches in flight are dropped, and those not started never start). More URLs than
    /// `max_items` are refused before any fetch.
    pub(crate) async fn fetch_request(
        &self,
        request: &GenerateRequest,
    ) -> Result<HashMap<(usize, usize), Vec<u8>>, (usize, usize, String)> {
        let GenerateRequest::Chat(chat) = request else {
            return Ok(HashMap::new());
        };
        let mut urls = Vec::new();
        for (m, message) in chat.messages.iter().enumerate() {
            let Some(MessageContent::Parts(parts)) = &message.content else {
                continue;
            };
            for (p, part) in parts.iter().enumerate() {
                let url = match part.part_kind() {
                    Some(PartKind::Image) => part.image_url.as_ref().map(|u| u.url.as_str()),
                    Some(PartKind::Video) => part.video_url.as_ref().map(|u| u.url.as_str()),
                    _ => None,
                };
                if let Some(url) = url.filter(|url| is_fetched(url)) {
                    if urls.len() == self.config.max_items {
                        return Err((
                            m,
                            p,
                            format!(
                                "a request may have at most {} media URLs fetched ([media] max_items)",
                                self.config.max_items
                            ),
                        ));
                    }
                    urls.push((m, p, url.to_string()));
                }
            }
        }
        let fetches = urls.into_iter().map(|(m, p, url)| async move {
            let limit = Duration::from_millis(self.config.fetch_timeout_ms);
            let result = match tokio::time::timeout(limit, self.fetch(&url)).await {
                Ok(result) => result,
                Err(_) => Err(format!("{url}: no complete answer within {} ms", limit.as_millis())),
            };
            (m, p, result)
        });
        let mut fetches = futures_util::stream::iter(fetches).buffer_unordered(self.config.fetch_concurrency.max(1));
        let mut fetched = HashMap::new();
        while let Some((m, p, result)) = fetches.next().await {
            fetched.insert((m, p), result.map_err(|why| (m, p, why))?);
        }
        Ok(fetched)
    }

    async fn fetch(&self, url: &str) -> Result<Vec<u8>, String> {
        let uri: http::Uri = url.parse().map_err(|err| format!("{url}: not a URL: {err}"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("{url}: only http and https URLs are fetched")),
        };
        let host = uri.host().ok_or_else(|| format!("{url}: no host"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
        if !host_allowed(&host, &self.config.allow_hosts) {
            return Err(format!("{url}: host `{host}` is not in [media] allow_hosts"));
        }
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let address = self.resolve(&host, port).await.map_err(|why| format!("{url}: {why}"))?;
        let stream = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|err| format!("{url}: cannot connect to {address}: {err}"))?;
        let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
        let authority = uri.authority().map_or(host.clone(), |a| a.as_str().to_string());
        if https {
            let name = ServerName::try_from(host.clone()).map_err(|err| format!("{url}: {err}"))?;
            let stream = self
                .tls
                .connect(name, stream)
                .await
                .map_err(|err| format!("{url}: TLS: {err}"))?;
            self.get(url, stream, &authority, &path).await
        } else {
            self.get(url, stream, &authority, &path).await
        }
    }

    /// The address to connect to: the first `host` resolves to, every one of them allowed.
    async fn resolve(&self, host: &str, port: u16) -> Result<SocketAddr, String> {
        let addresses: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((host, port))
                .await
                .map_err(|err| format!("cannot resolve `{host}`: {err}"))?
                .collect(),
        };
        if !self.config.allow_private
            && let Some(bad) = addresses.iter().find(|address| !is_public(address.ip()))
        {
            return Err(format!(
                "`{host}` resolves to {}, a private, loopback or otherwise non-public address ([media] allow_private is off)",
                bad.ip()
            ));
        }
        addresses
            .first()
            .copied()
            .ok_or_else(|| format!("`{host}` resolves to no address"))
    }

    async fn get<S>(&self, url: &str, stream: S, authority: &str, path: &str) -> Result<Vec<u8>, String>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|err| format!("{url}: {err}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let request = http::Request::get(path)
            .header(http::header::HOST, authority)
            .header(http::header::USER_AGENT, "switchyard-media-fetch")
            .body(Empty::<Bytes>::new())
            .map_err(|err| format!("{url}: {err}"))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|err| format!("{url}: {err}"))?;
        let status = response.status();
        if status.is_redirection() {
            return Err(format!("{url}: answered {status}; redirects are not followed"));
        }
        if status != http::StatusCode::OK {
            return Err(format!("{url}: answered {status}"));
        }
        let max = self.config.max_bytes;
        let declared = response
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > max as u64) {
            return Err(format!(
                "{url}: {} bytes, more than [media] max_bytes {max}",
                declared.unwrap_or(0)
            ));
        }
        let body = Limited::new(response.into_body(), max).collect().await.map_err(|err| {
            if err.is::<http_body_util::LengthLimitError>() {
                format!("{url}: more than [media] max_bytes {max}")
            } else {
                format!("{url}: broke off: {err}")
            }
        })?;
        Ok(body.to_bytes().to_vec())
    }
}

/// Whether `url` is one the fetcher takes (`http://` or `https://`).
pub(crate) fn is_fetched(url: &str) -> bool {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// Whether `host` (lowercase) is on `allowed`: equal to an entry, or under a `*.suffix` one.
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    allowed.iter().any(|entry| {
        let entry = entry.to_ascii_lowercase();
        match entry.strip_prefix("*.") {
            Some(suffix) => host.len() > suffix.len() + 1 && host.ends_with(&format!(".{suffix}")),
            None => host == entry,
        }
    })
}

/// Whether `ip` is a public unicast address (what a fetch may reach by default).
fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && c == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || first == 0x2001 && v6.segments()[1] == 0x0db8
                || first == 0x0064 && v6.segments()[1] == 0xff9b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_match_exactly_or_under_a_wildcard() {
        let allowed = vec!["images.example.com".to_string(), "*.cdn.example.net".to_string()];
        assert!(host_allowed("images.example.com", &allowed));
        assert!(host_allowed("a.cdn.example.net", &allowed));
        assert!(host_allowed("x.y.cdn.example.net", &allowed));
        assert!(!host_allowed("cdn.example.net", &allowed), "the wildcard needs a label");
        assert!(!host_allowed("evilimages.example.com", &allowed));
        assert!(!host_allowed("images.example.com.evil.org", &allowed));
        assert!(!host_allowed("anything", &[]));
    }

    #[test]
    fn only_public_unicast_addresses_are_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "192.0.2.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "2001:db8::1",
            "64:ff9b::a00:1",
        ] {
            assert!(!is_public(private.parse().expect("an address")), "{private}");
        }
        for public in ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_public(public.parse().expect("an address")), "{public}");
        }
    }

    #[test]
    fn only_http_and_https_urls_are_fetched() {
        assert!(is_fetched("https://a/b.png"));
        assert!(is_fetched("HTTP://a/b.png"));
        assert!(!is_fetched("data:image/png;base64,AAAA"));
        assert!(!is_fetched("ftp://a/b"));
    }
}
