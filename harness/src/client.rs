//! An HTTP client that measures: HTTP/1.1 or HTTP/2 over TLS trusting one CA (or plain TCP),
//! reading a response body frame by frame with the arrival time of each, so tests can check
//! streaming and benchmarks can time first bytes. Also the request and response shapes tests
//! share: chat request bodies, SSE payloads, and an address nothing listens on.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::tls::localhost;

/// The chat completions path.
const CHAT: &str = "/v1/chat/completions";

/// A loopback address nothing listens on, held for as long as this value lives: the socket
/// is bound but never listens, so connecting fails at once and no other socket can take the
/// port meanwhile (a port bound, noted and released could be handed to the next socket that
/// asks for any, such as the gateway's own embedded mockers).
#[derive(Debug)]
pub struct DeadAddress {
    /// The address.
    pub addr: SocketAddr,
    _socket: tokio::net::TcpSocket,
}

impl DeadAddress {
    /// Binds a loopback socket to a port the kernel picks, without listening.
    ///
    /// # Errors
    ///
    /// Fails if the socket cannot be created or bound.
    pub fn new() -> anyhow::Result<DeadAddress> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(([127, 0, 0, 1], 0).into())?;
        Ok(DeadAddress {
            addr: socket.local_addr()?,
            _socket: socket,
        })
    }
}

/// Which HTTP version to ask for in ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// `h2`.
    H2,
    /// `http/1.1`.
    Http1,
}

/// A response read to its end, with the arrival time of each body frame.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: http::StatusCode,
    /// Headers.
    pub headers: http::HeaderMap,
    /// Body frames with their arrival times.
    pub frames: Vec<(Instant, Bytes)>,
    /// When the request was sent.
    pub sent: Instant,
    /// When the response headers arrived.
    pub head_at: Instant,
}

impl Reply {
    /// The whole body.
    pub fn body(&self) -> Vec<u8> {
        self.frames
            .iter()
            .flat_map(|(_, bytes)| bytes.iter().copied())
            .collect()
    }

    /// The body as JSON.
    ///
    /// # Errors
    ///
    /// Fails if it is not JSON.
    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_slice(&self.body())
            .with_context(|| format!("not JSON: {}", String::from_utf8_lossy(&self.body())))
    }

    /// The SSE `data:` payloads of the body, in order, with the arrival time of the frame that
    /// completed each.
    pub fn events(&self) -> Vec<(Instant, String)> {
        let mut events = Vec::new();
        let mut pending = String::new();
        for (at, bytes) in &self.frames {
            pending.push_str(&String::from_utf8_lossy(bytes));
            while let Some(end) = pending.find("\n\n") {
                let event: String = pending.drain(..end + 2).collect();
                for line in event.lines() {
                    if let Some(data) = line.strip_prefix("data: ") {
                        events.push((*at, data.to_string()));
                    }
                }
            }
        }
        events
    }

    /// The worker that served the request (`x-switchyard-worker`), or "" if none is named.
    pub fn worker(&self) -> String {
        self.headers
            .get("x-switchyard-worker")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    }

    /// Milliseconds from sending to the first body frame.
    pub fn first_byte_ms(&self) -> Option<f64> {
        self.frames
            .first()
            .map(|(at, _)| at.duration_since(self.sent).as_secs_f64() * 1000.0)
    }
}

/// An HTTP client over TLS that trusts one CA (or, for benchmarks, plain TCP).
#[derive(Clone)]
pub struct Client {
    connector: Option<TlsConnector>,
    server_name: ServerName<'static>,
    pub(crate) addr: SocketAddr,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("addr", &self.addr)
            .field("tls", &self.connector.is_some())
            .finish()
    }
}

/// An open connection that can carry several requests.
#[derive(Debug)]
pub enum Connection {
    /// HTTP/1.1.
    Http1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    /// HTTP/2.
    Http2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Client {
    /// A TLS client of `addr` trusting `ca` and offering `alpn`, with TLS 1.3 and 1.2 (or
    /// only `versions` if given).
    ///
    /// # Errors
    ///
    /// Fails if rustls refuses the settings.
    pub fn tls(
        addr: SocketAddr,
        ca: &CertificateDer<'static>,
        alpn: Alpn,
        versions: Option<&[&'static rustls::SupportedProtocolVersion]>,
    ) -> anyhow::Result<Client> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        const BOTH: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13, &rustls::version::TLS12];
        let versions = versions.unwrap_or(BOTH);
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![match alpn {
            Alpn::H2 => b"h2".to_vec(),
            Alpn::Http1 => b"http/1.1".to_vec(),
        }];
        Ok(Client::with_tls_config(addr, localhost(), Arc::new(config)))
    }

    /// An HTTP/1.1 TLS client of `addr` that trusts `ca` and presents a client certificate.
    ///
    /// # Errors
    ///
    /// Fails if rustls refuses the settings.
    pub fn tls_with_identity(
        addr: SocketAddr,
        ca: &CertificateDer<'static>,
        chain: Vec<CertificateDer<'static>>,
        key: rustls::pki_types::PrivateKeyDer<'static>,
    ) -> anyhow::Result<Client> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Client::with_tls_config(addr, localhost(), Arc::new(config)))
    }

    /// A TLS client of `addr` using `config` (trust, ALPN, versions) and checking the
    /// certificate against `server_name`.
    pub fn with_tls_config(
        addr: SocketAddr,
        server_name: ServerName<'static>,
        config: Arc<rustls::ClientConfig>,
    ) -> Client {
        Client {
            connector: Some(TlsConnector::from(config)),
            server_name,
            addr,
        }
    }

    /// A plain-HTTP/1.1 client of `addr`.
    pub fn plain(addr: SocketAddr) -> Client {
        Client {
            connector: None,
            server_name: localhost(),
            addr,
        }
    }

    /// Opens a TLS session (no HTTP yet), e.g. to send raw bytes.
    ///
    /// # Errors
    ///
    /// Fails if the connection or handshake fails.
    pub async fn raw_tls(&self) -> anyhow::Result<TlsStream<TcpStream>> {
        let connector = self.connector.clone().context("not a TLS client")?;
        let tcp = TcpStream::connect(self.addr).await?;
        Ok(connector.connect(self.server_name.clone(), tcp).await?)
    }

    /// Opens a connection and returns it with the negotiated protocol.
    ///
    /// # Errors
    ///
    /// Fails if connecting, the TLS handshake or the HTTP handshake fails.
    pub async fn connect(&self) -> anyhow::Result<Connection> {
        let tcp = TcpStream::connect(self.addr).await?;
        tcp.set_nodelay(true)?;
        let Some(connector) = &self.connector else {
            let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
            tokio::spawn(connection);
            return Ok(Connection::Http1(sender));
        };
        let tls = connector.connect(self.server_name.clone(), tcp).await?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        if h2 {
            let (sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await?;
            tokio::spawn(connection);
            Ok(Connection::Http2(sender))
        } else {
            let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
            tokio::spawn(connection);
            Ok(Connection::Http1(sender))
        }
    }

    /// Sends one request on a new connection and reads the whole response.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn send(&self, method: &str, path: &str, body: impl Into<Bytes>) -> anyhow::Result<Reply> {
        let mut connection = self.connect().await?;
        connection.send(method, path, body).await
    }

    /// POSTs a JSON value.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn post_json(&self, path: &str, body: &serde_json::Value) -> anyhow::Result<Reply> {
        self.send("POST", path, serde_json::to_vec(body)?).await
    }

    /// POSTs a chat request to `/v1/chat/completions` on a new connection, with
    /// `authorization: Bearer KEY` when `key` is given.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn chat(&self, key: Option<&str>, body: &serde_json::Value) -> anyhow::Result<Reply> {
        let mut connection = self.connect().await?;
        let body = serde_json::to_vec(body)?;
        match key {
            Some(key) => connection.send_with_auth("POST", CHAT, body, key).await,
            None => connection.send("POST", CHAT, body).await,
        }
    }

    /// As [`Client::chat`], with extra headers and no key.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn chat_with_headers(&self, body: &serde_json::Value, headers: &[(&str, &str)]) -> anyhow::Result<Reply> {
        let mut connection = self.connect().await?;
        connection
            .send_with_headers("POST", CHAT, serde_json::to_vec(body)?, headers)
            .await
    }
}

impl Connection {
    /// Sends one request on this connection and reads the whole response, timing each frame.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn send(&mut self, method: &str, path: &str, body: impl Into<Bytes>) -> anyhow::Result<Reply> {
        self.send_inner(method, path, body.into(), None).await
    }

    /// As [`Connection::send`], with extra headers.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn send_with_headers(
        &mut self,
        method: &str,
        path: &str,
        body: impl Into<Bytes>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Reply> {
        self.send_full(method, path, body.into(), None, headers).await
    }

    /// As [`Connection::send`], with `authorization: Bearer TOKEN`.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn send_with_auth(
        &mut self,
        method: &str,
        path: &str,
        body: impl Into<Bytes>,
        token: &str,
    ) -> anyhow::Result<Reply> {
        self.send_inner(method, path, body.into(), Some(token)).await
    }

    async fn send_inner(
        &mut self,
        method: &str,
        path: &str,
        body: Bytes,
        token: Option<&str>,
    ) -> anyhow::Result<Reply> {
        self.send_full(method, path, body, token, &[]).await
    }

    async fn send_full(
        &mut self,
        method: &str,
        path: &str,
        body: Bytes,
        token: Option<&str>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Reply> {
        let mut request = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, "localhost")
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(token) = token {
            request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body))?;
        let sent = Instant::now();
        let response = match self {
            Connection::Http1(sender) => {
                sender.ready().await?;
                sender.send_request(request).await?
            }
            Connection::Http2(sender) => {
                let (mut parts, body) = request.into_parts();
                parts.uri = format!("https://localhost{path}").parse()?;
                sender.ready().await?;
                sender.send_request(http::Request::from_parts(parts, body)).await?
            }
        };
        let head_at = Instant::now();
        let (parts, mut body) = response.into_parts();
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                frames.push((Instant::now(), data));
            }
        }
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            frames,
            sent,
            head_at,
        })
    }
}

/// A chat request body for `model` with `max_tokens`.
pub fn chat_body(model: &str, content: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// The JSON payloads of an SSE body's `data:` lines, in order, `[DONE]` left out.
///
/// # Panics
///
/// Panics if a payload is not JSON.
pub fn sse_json(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).expect("an SSE event is JSON"))
        .collect()
}
