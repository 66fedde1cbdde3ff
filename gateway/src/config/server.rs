//! `[server]` and `[admin]`: the client listener and the admin listener, their TLS and limits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{Checked, Invalid, Mode, positive};

/// `[admin]`: the admin API on its own listener.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of the admin listener (plain HTTP unless `tls` is set; keep it on a private
    /// interface either way).
    pub listen: SocketAddr,
    /// Bearer token every admin request must carry; never printed or logged. Absent (dev mode
    /// only), one is generated at start and written to a file only this user can read, which
    /// the ready lines name.
    #[serde(default)]
    pub token: Option<String>,
    /// The credential workers that register over HTTP present: it opens the worker routes
    /// (`/admin/workers*`) and nothing else, so a worker (or whoever reads its environment)
    /// cannot change policies. At least 16 characters, and not the admin token. Absent (with
    /// `worker_token_file` absent too): only the admin token opens those routes.
    #[serde(default)]
    pub worker_token: Option<String>,
    /// A file holding `worker_token` (surrounding whitespace ignored), read at start; the way to
    /// keep the token out of the configuration file. Conflicts with `worker_token`.
    #[serde(default)]
    pub worker_token_file: Option<PathBuf>,
    /// Time a new admin connection gets to send its first request, and each later request
    /// head; a silent one is closed then.
    #[serde(default = "default_admin_header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// Admin connections open at once; one more is closed as soon as it is accepted. Its own
    /// cap, apart from `server.max_connections`: peers on the admin port cannot take the
    /// file descriptors the client listener needs.
    #[serde(default = "default_admin_max_connections")]
    pub max_connections: usize,
    /// `[admin.tls]`: serve the admin API over TLS, optionally requiring client certificates.
    #[serde(default)]
    pub tls: Option<AdminTlsConfig>,
}

fn default_admin_header_read_timeout_ms() -> u64 {
    10_000
}

fn default_admin_max_connections() -> usize {
    1_024
}

/// `[admin.tls]`: the admin listener's certificate, and the CA its clients' certificates must
/// chain to (mTLS; the bearer token is still required).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminTlsConfig {
    /// Certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Private key (PEM).
    pub key: PathBuf,
    /// CA certificates (PEM) a client certificate must chain to; absent: no client
    /// certificate is asked for.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

impl AdminTlsConfig {
    /// The certificate and key, as the client listener's are configured.
    pub fn pair(&self) -> TlsConfig {
        TlsConfig {
            cert: self.cert.clone(),
            key: self.key.clone(),
        }
    }
}

/// Largest `server.stream_coalesce_us`.
const MAX_STREAM_COALESCE_US: u64 = 100_000;

/// `[server]`: the client-facing listener and its limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Serve plain HTTP instead of TLS. Must be set explicitly.
    pub plaintext: bool,
    /// Certificate and key; absent in dev mode means a generated self-signed certificate.
    pub tls: Option<TlsConfig>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Largest request head (request line and headers), in bytes.
    pub max_header_bytes: usize,
    /// Time allowed for a new connection's first request head to arrive.
    pub header_read_timeout_ms: u64,
    /// Time a connection may sit idle: between requests on HTTP/1.1 (keep-alive), with no
    /// stream open on HTTP/2 (answered pings do not count as use).
    pub idle_timeout_ms: u64,
    /// Time allowed for a request's whole body to arrive once its head has; a body still
    /// arriving then is answered 408 (`body_read_timeout`).
    pub body_read_timeout_ms: u64,
    /// Time allowed for the TLS handshake.
    pub tls_handshake_timeout_ms: u64,
    /// On SIGTERM or ctrl-c: time the responses in flight (streams included) get to finish
    /// before the gateway exits anyway.
    pub drain_timeout_ms: u64,
    /// Client connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// A streamed answer's events that arrive within this many microseconds of its last write
    /// to the client wait for the window to end and are written together (0: every event at
    /// once). An event that opens a write waits, at most this long, only for the events
    /// upstream read with it (a few microseconds when there are none); the stream's first
    /// bytes are never held.
    pub stream_coalesce_us: u64,
    /// Serve `/metrics` on this listener. Turn it off to serve them only on the admin
    /// listener (`GET /metrics` there, with the admin token), off the public port.
    pub metrics: bool,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8443)),
            plaintext: false,
            tls: None,
            max_body_bytes: 32 << 20,
            max_header_bytes: 64 << 10,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 120_000,
            body_read_timeout_ms: 30_000,
            tls_handshake_timeout_ms: 10_000,
            drain_timeout_ms: 30_000,
            max_connections: 10_000,
            stream_coalesce_us: 1_000,
            metrics: true,
        }
    }
}

/// `[server.tls]`: PEM files.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

impl ServerConfig {
    /// [`ServerConfig::header_read_timeout_ms`] as a duration.
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }

    /// [`ServerConfig::idle_timeout_ms`] as a duration.
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }

    /// [`ServerConfig::body_read_timeout_ms`] as a duration.
    pub fn body_read_timeout(&self) -> Duration {
        Duration::from_millis(self.body_read_timeout_ms)
    }

    /// [`ServerConfig::tls_handshake_timeout_ms`] as a duration.
    pub fn tls_handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.tls_handshake_timeout_ms)
    }

    /// [`ServerConfig::drain_timeout_ms`] as a duration.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    /// [`ServerConfig::stream_coalesce_us`] as a duration.
    pub fn stream_coalesce(&self) -> Duration {
        Duration::from_micros(self.stream_coalesce_us)
    }
}

impl ServerConfig {
    /// Refuses TLS that is both off and configured, or missing in production; certificate
    /// files that do not exist; limits and timeouts of 0; a header limit below hyper's read
    /// buffer; a coalescing window past [`MAX_STREAM_COALESCE_US`]; and metrics served on no
    /// listener (`has_admin`: the admin listener serves them).
    pub(super) fn check(&self, mode: Mode, has_admin: bool) -> Checked {
        if self.plaintext && self.tls.is_some() {
            return Err(Invalid::new(
                "server.plaintext",
                "`plaintext = true` conflicts with `[server.tls]`; choose one",
            ));
        }
        if mode == Mode::Production && !self.plaintext && self.tls.is_none() {
            return Err(Invalid::new(
                "server.tls",
                "production mode needs a certificate and key (`[server.tls] cert = ..., key = ...`) or an explicit `plaintext = true`",
            ));
        }
        if let Some(tls) = &self.tls {
            for (key, path) in [("server.tls.cert", &tls.cert), ("server.tls.key", &tls.key)] {
                if !path.is_file() {
                    return Err(Invalid::new(key, format!("file `{}` does not exist", path.display())));
                }
            }
        }
        positive(&[
            ("server.max_body_bytes", self.max_body_bytes as u64),
            ("server.max_header_bytes", self.max_header_bytes as u64),
            ("server.header_read_timeout_ms", self.header_read_timeout_ms),
            ("server.idle_timeout_ms", self.idle_timeout_ms),
            ("server.body_read_timeout_ms", self.body_read_timeout_ms),
            ("server.tls_handshake_timeout_ms", self.tls_handshake_timeout_ms),
            ("server.max_connections", self.max_connections as u64),
        ])?;
        if self.max_header_bytes < 8192 {
            return Err(Invalid::new(
                "server.max_header_bytes",
                "must be at least 8192 (hyper's minimum read buffer)",
            ));
        }
        if !self.metrics && !has_admin {
            return Err(Invalid::new(
                "server.metrics",
                "is false, so /metrics would be served nowhere: add an [admin] listener (it serves them) or set it true",
            ));
        }
        if self.stream_coalesce_us > MAX_STREAM_COALESCE_US {
            return Err(Invalid::new(
                "server.stream_coalesce_us",
                format!("must be at most {MAX_STREAM_COALESCE_US} (100 ms): it delays the events it holds"),
            ));
        }
        Ok(())
    }
}

impl AdminConfig {
    /// [`AdminConfig::header_read_timeout_ms`] as a duration.
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }

    /// The worker registration token: `worker_token`, or the contents of `worker_token_file`
    /// (trimmed); `None` when neither is set.
    ///
    /// # Errors
    ///
    /// The key and the reason when the file cannot be read.
    pub fn worker_token(&self) -> Result<Option<String>, (&'static str, String)> {
        match (&self.worker_token, &self.worker_token_file) {
            (Some(token), _) => Ok(Some(token.clone())),
            (None, Some(path)) => std::fs::read_to_string(path)
                .map(|text| Some(text.trim().to_string()))
                .map_err(|err| {
                    (
                        "admin.worker_token_file",
                        format!("cannot read `{}`: {err}", path.display()),
                    )
                }),
            (None, None) => Ok(None),
        }
    }

    /// Refuses a token shorter than 16 characters, and a missing one outside dev mode (where
    /// one is generated at start); a worker token that is set twice, unreadable, shorter than
    /// 16 characters or the admin token itself; a header read timeout or connection cap of 0.
    pub(super) fn check(&self, mode: Mode) -> Checked {
        positive(&[
            ("admin.header_read_timeout_ms", self.header_read_timeout_ms),
            ("admin.max_connections", self.max_connections as u64),
        ])?;
        match &self.token {
            Some(token) if token.len() < 16 => {
                return Err(Invalid::new("admin.token", "must be at least 16 characters"));
            }
            None if mode != Mode::Dev => {
                return Err(Invalid::new(
                    "admin.token",
                    "is required outside `mode = \"dev\"` (in dev mode one is generated at start)",
                ));
            }
            _ => {}
        }
        if self.worker_token.is_some() && self.worker_token_file.is_some() {
            return Err(Invalid::new(
                "admin.worker_token_file",
                "conflicts with `admin.worker_token`; choose one",
            ));
        }
        let key = if self.worker_token.is_some() {
            "admin.worker_token"
        } else {
            "admin.worker_token_file"
        };
        match self.worker_token().map_err(|(key, reason)| Invalid::new(key, reason))? {
            Some(worker) if worker.len() < 16 => Err(Invalid::new(key, "must be at least 16 characters")),
            Some(worker) if self.token.as_deref() == Some(worker.as_str()) => Err(Invalid::new(
                key,
                "must differ from `admin.token`: the worker token opens only the worker routes",
            )),
            _ => Ok(()),
        }
    }
}
