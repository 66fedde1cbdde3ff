//! The end-to-end harness: real binaries, a real CA, a real TLS client.
//!
//! This crate owns what the cross-crate tests and the benchmark programs share: finding and
//! starting the `switchyard` and `switchyard-mocker` binaries as child processes (killed when
//! dropped), a throwaway certificate authority whose server certificate the gateway serves,
//! and an HTTP client over rustls that trusts only that CA and can read a response body event
//! by event with arrival times. Nothing here is a mock: every byte crosses a real socket.

#![deny(missing_docs, missing_debug_implementations)]

pub mod bench;
pub mod browser;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// The path of a workspace binary: `$SWITCHYARD_BIN_DIR/NAME` if set, else next to the
/// running test executable's `deps/` folder (where `cargo test --workspace` builds it).
///
/// # Errors
///
/// Fails with a hint if the binary has not been built.
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("SWITCHYARD_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().context("locating the test executable")?;
            let mut dir = exe.parent().context("test executable has no folder")?.to_path_buf();
            if dir.ends_with("deps") {
                dir.pop();
            }
            dir
        }
    };
    let path = dir.join(name);
    if !path.is_file() {
        bail!(
            "{} is not built; run `cargo build --workspace --bins` (or `cargo test --workspace`, which builds it)",
            path.display()
        );
    }
    Ok(path)
}

/// A child process killed on drop.
#[derive(Debug)]
pub struct Process {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Process {
    /// Starts `program` with `args`, reading its stdout lines until `ready` matches one
    /// (within `timeout`). Returns the process and every line read so far.
    ///
    /// # Errors
    ///
    /// Fails if the program cannot start, exits, or prints no ready line in time.
    pub fn start(
        program: &Path,
        args: &[String],
        ready: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<(Process, Vec<String>)> {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut process = Process { child, lines };
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match process.lines.recv_timeout(left) {
                Ok(line) => {
                    let done = ready(&line);
                    seen.push(line);
                    if done {
                        return Ok((process, seen));
                    }
                }
                Err(_) => {
                    let status = process.child.try_wait().ok().flatten();
                    bail!(
                        "{} printed no ready line within {timeout:?} (exit: {status:?}); output: {seen:?}",
                        program.display()
                    );
                }
            }
        }
    }

    /// Kills the process at once (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The OS process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM (as an orchestrator stopping it would).
    ///
    /// # Errors
    ///
    /// Fails if `kill` cannot be run or refuses.
    pub fn terminate(&self) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .context("running kill")?;
        anyhow::ensure!(status.success(), "kill -TERM failed: {status}");
        Ok(())
    }

    /// Waits up to `timeout` for the process to exit; its status, or `None` if it is still
    /// running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `switchyard-mocker` running N engines.
#[derive(Debug)]
pub struct Mockers {
    /// The process.
    pub process: Process,
    /// One address per engine.
    pub addrs: Vec<SocketAddr>,
}

impl Mockers {
    /// Starts `switchyard-mocker` with `args` (e.g. `--num-workers 2 --speedup 10`).
    ///
    /// # Errors
    ///
    /// Fails if it cannot start or does not report its ports.
    pub fn start(args: &[&str]) -> anyhow::Result<Mockers> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let (process, lines) = Process::start(
            &binary("switchyard-mocker")?,
            &args,
            |line| line.starts_with("mocker ready"),
            Duration::from_secs(30),
        )?;
        let addrs = lines
            .iter()
            .filter_map(|line| line.split("listening on http://").nth(1))
            .map(|addr| addr.trim().parse().context("mocker printed a bad address"))
            .collect::<anyhow::Result<Vec<SocketAddr>>>()?;
        Ok(Mockers { process, addrs })
    }
}

/// `switchyard-worker`: the native LLM worker.
#[derive(Debug)]
pub struct NativeWorker {
    /// The process.
    pub process: Process,
    /// The address it listens on.
    pub addr: SocketAddr,
}

impl NativeWorker {
    /// Starts `switchyard-worker` with `args` (e.g. `--model DIR --port 0`).
    ///
    /// # Errors
    ///
    /// Fails if it cannot start, load its model, or report its port.
    pub fn start(args: &[&str]) -> anyhow::Result<NativeWorker> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let (process, lines) = Process::start(
            &binary("switchyard-worker")?,
            &args,
            |line| line.starts_with("worker ready"),
            Duration::from_secs(60),
        )?;
        let addr = lines
            .iter()
            .find_map(|line| line.split("listening on http://").nth(1))
            .context("the worker printed no address")?
            .trim()
            .parse()
            .context("the worker printed a bad address")?;
        Ok(NativeWorker { process, addr })
    }
}

/// `switchyard-encoder`: a native vision or audio encoder.
#[derive(Debug)]
pub struct NativeEncoder {
    /// The process.
    pub process: Process,
    /// The address it listens on.
    pub addr: SocketAddr,
}

impl NativeEncoder {
    /// Starts `switchyard-encoder` with `args` (e.g. `--model DIR --port 0
    /// --served-model-name M`).
    ///
    /// # Errors
    ///
    /// Fails if it cannot start, load its model, or report its port.
    pub fn start(args: &[&str]) -> anyhow::Result<NativeEncoder> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let (process, lines) = Process::start(
            &binary("switchyard-encoder")?,
            &args,
            |line| line.starts_with("encoder ready"),
            Duration::from_secs(60),
        )?;
        let addr = lines
            .iter()
            .find_map(|line| line.split("listening on http://").nth(1))
            .context("the encoder printed no address")?
            .trim()
            .parse()
            .context("the encoder printed a bad address")?;
        Ok(NativeEncoder { process, addr })
    }
}

/// How many blocks the index holds for `worker`, from a `GET /admin/kv` summary (0 if absent).
pub fn cached_blocks(summary: &serde_json::Value, worker: &str) -> u64 {
    summary["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|w| w["name"] == worker)
        .and_then(|w| w["cached_blocks"].as_u64())
        .unwrap_or(0)
}

/// A real `nats-server` on a free loopback port, killed on drop.
#[derive(Debug)]
pub struct NatsServer {
    child: Child,
    /// Its `nats://127.0.0.1:PORT` URL.
    pub url: String,
    /// JetStream's storage, when it is on.
    _store: Option<tempfile::TempDir>,
}

impl NatsServer {
    /// Starts `nats-server` (`$SWITCHYARD_NATS_SERVER`, else from `PATH` or `/usr/sbin`) and
    /// waits until it accepts connections.
    ///
    /// # Errors
    ///
    /// Fails with an install hint if the binary is missing, or if it does not start in time.
    pub fn start() -> anyhow::Result<NatsServer> {
        NatsServer::launch(false)
    }

    /// As [`NatsServer::start`], with JetStream on (storage in a temporary folder).
    ///
    /// # Errors
    ///
    /// As [`NatsServer::start`].
    pub fn start_jetstream() -> anyhow::Result<NatsServer> {
        NatsServer::launch(true)
    }

    fn launch(jetstream: bool) -> anyhow::Result<NatsServer> {
        let program = std::env::var_os("SWITCHYARD_NATS_SERVER")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("PATH").and_then(|paths| {
                    std::env::split_paths(&paths)
                        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/bin")])
                        .map(|dir| dir.join("nats-server"))
                        .find(|path| path.is_file())
                })
            })
            .context("nats-server is not installed (Debian: `apt-get install nats-server`; .ci/run installs it)")?;
        // `-p -1` lets the server pick its own port and `--ports_file_dir` makes it write the
        // port down: a port found free here and handed over could be taken before it binds.
        let ports = tempfile::tempdir()?;
        let store = if jetstream { Some(tempfile::tempdir()?) } else { None };
        let mut args = vec!["-a".to_string(), "127.0.0.1".into(), "-p".into(), "-1".into()];
        args.extend(["--ports_file_dir".to_string(), ports.path().display().to_string()]);
        if let Some(store) = &store {
            args.extend(["-js".to_string(), "-sd".into(), store.path().display().to_string()]);
        }
        let mut child = Command::new(&program)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        // Named `<executable>_<pid>.ports`; the executable may be a wrapper, so take any.
        let ports_file = || -> Option<PathBuf> {
            std::fs::read_dir(ports.path())
                .ok()?
                .filter_map(Result::ok)
                .map(|entry| entry.path())
                .find(|path| path.extension().is_some_and(|extension| extension == "ports"))
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let port = loop {
            let written = ports_file()
                .and_then(|path| std::fs::read(path).ok())
                .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok());
            let port = written.as_ref().and_then(|ports| {
                let url = ports["nats"].get(0)?.as_str()?;
                url.rsplit(':').next()?.parse::<u16>().ok()
            });
            if let Some(port) = port {
                break port;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("nats-server wrote no ports file within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let server = NatsServer {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            _store: store,
        };
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("nats-server did not listen on port {port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }
}

impl NatsServer {
    /// Stops the server at once (SIGKILL), as an outage would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The sum of every sample of metric `name` in Prometheus text whose labels contain all of
/// `labels` (`key="value"` strings); 0 when there is none.
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            (metric == name && labels.iter().all(|label| rest.contains(label))).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

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

/// The `switchyard` gateway running as a child process.
#[derive(Debug)]
pub struct Gateway {
    /// The process.
    pub process: Process,
    /// The address it listens on.
    pub addr: SocketAddr,
    /// Name and address of each embedded mocker, as the gateway printed them.
    pub mockers: Vec<(String, SocketAddr)>,
    /// Name and address of each embedded encoder, as the gateway printed them.
    pub encoders: Vec<(String, SocketAddr)>,
    /// The admin listener's address as the gateway printed it, when `[admin]` is configured.
    pub admin: Option<SocketAddr>,
    /// The folder holding its config file.
    pub dir: tempfile::TempDir,
}

impl Gateway {
    /// Writes `config` to a file and starts `switchyard --config FILE --listen 127.0.0.1:0`.
    ///
    /// # Errors
    ///
    /// Fails if the gateway does not print its ready line.
    pub fn start(config: &str) -> anyhow::Result<Gateway> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("gateway.toml");
        std::fs::write(&path, config)?;
        let args = vec![
            "--config".to_string(),
            path.display().to_string(),
            "--listen".to_string(),
            "127.0.0.1:0".to_string(),
            "--log".to_string(),
            "warn".to_string(),
        ];
        let (process, lines) = Process::start(
            &binary("switchyard")?,
            &args,
            // The example request is printed last, after the embedded mockers' addresses.
            |line| line.starts_with("try: "),
            Duration::from_secs(30),
        )?;
        let addr = lines
            .iter()
            .find_map(|line| line.split("listening on ").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .map(|url| {
                url.trim_start_matches("https://")
                    .trim_start_matches("http://")
                    .to_string()
            })
            .context("no listening line")?
            .parse()
            .context("bad listening address")?;
        let admin = lines
            .iter()
            .find_map(|line| line.strip_prefix("admin API listening on "))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|url| url.split_once("://"))
            .and_then(|(_, addr)| addr.parse().ok());
        let embedded = |prefix: &str| -> Vec<(String, SocketAddr)> {
            lines
                .iter()
                .filter_map(|line| line.strip_prefix(prefix))
                .filter_map(|rest| {
                    let (name, url) = rest.split_once(" at http://")?;
                    Some((name.to_string(), url.trim().parse().ok()?))
                })
                .collect()
        };
        Ok(Gateway {
            process,
            addr,
            mockers: embedded("embedded mocker "),
            encoders: embedded("embedded encoder "),
            admin,
            dir,
        })
    }
}

impl Gateway {
    /// Starts a plain-HTTP gateway from `config` with the admin API enabled on a free loopback
    /// port under `token`; returns it with a client of the admin API.
    ///
    /// # Errors
    ///
    /// Fails if the gateway does not start.
    pub fn start_with_admin(config: &str, token: &str) -> anyhow::Result<(Gateway, Admin)> {
        // Port 0, read back from the gateway's own line: a port found free here and handed over
        // can be taken by any other socket before the gateway binds it.
        let config = format!("{config}\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{token}\"\n");
        let gateway = Gateway::start(&config)?;
        let admin_addr = gateway.admin.context("the gateway printed no admin API line")?;
        let admin = Admin {
            client: Client::plain(admin_addr),
            token: token.to_string(),
        };
        Ok((gateway, admin))
    }
}

/// A client of a gateway's admin API.
#[derive(Debug, Clone)]
pub struct Admin {
    /// A plain client of the admin listener.
    pub client: Client,
    token: String,
}

impl Admin {
    /// The admin API's `http://HOST:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.client.addr)
    }

    /// The bearer token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// One authenticated request; returns the status and the body as JSON (`null` if it is not).
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn call(&self, method: &str, path: &str, body: Vec<u8>) -> anyhow::Result<(u16, serde_json::Value)> {
        let mut connection = self.client.connect().await?;
        let reply = connection.send_with_auth(method, path, body, &self.token).await?;
        Ok((
            reply.status.as_u16(),
            serde_json::from_slice(&reply.body()).unwrap_or(serde_json::Value::Null),
        ))
    }

    /// `GET path` with the token; the status and the body as text.
    ///
    /// # Errors
    ///
    /// Fails if the admin listener cannot be reached.
    pub async fn get_text(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let mut connection = self.client.connect().await?;
        let reply = connection.send_with_auth("GET", path, Vec::new(), &self.token).await?;
        Ok((
            reply.status.as_u16(),
            String::from_utf8_lossy(&reply.body()).into_owned(),
        ))
    }

    /// `GET /admin/kv`: the KV index summary.
    ///
    /// # Errors
    ///
    /// Fails on a transport error or a status other than 200.
    pub async fn kv_summary(&self) -> anyhow::Result<serde_json::Value> {
        let (status, body) = self.call("GET", "/admin/kv", Vec::new()).await?;
        anyhow::ensure!(status == 200, "GET /admin/kv answered {status}: {body}");
        Ok(body)
    }

    /// The name of the active router policy.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn active(&self) -> anyhow::Result<String> {
        let (_, list) = self.call("GET", "/admin/policies", Vec::new()).await?;
        Ok(list["active"]["name"].as_str().unwrap_or_default().to_string())
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
    addr: SocketAddr,
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

/// The name test certificates are issued for.
fn localhost() -> ServerName<'static> {
    ServerName::DnsName(
        rustls::pki_types::DnsName::try_from("localhost")
            .expect("`localhost` is a valid DNS name")
            .to_owned(),
    )
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

/// Polls `check` every 50 ms until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}
