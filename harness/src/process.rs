//! Child processes: finding the workspace's binaries, starting them, reading the addresses
//! they print, and stopping them (every process here is killed when its value is dropped).
//!
//! The gateway has a module of its own ([`crate::Gateway`]); this one has the workers
//! (`switchyard-mocker`, `switchyard-llm`, `switchyard-encoder`) and a real `nats-server`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

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
        Process::start_with_env(program, args, &[], ready, timeout)
    }

    /// As [`Process::start`], with `env` (name, value) added to its environment: how secrets
    /// reach a child, since its command line is readable by every local user.
    ///
    /// # Errors
    ///
    /// As [`Process::start`].
    pub fn start_with_env(
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
        ready: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<(Process, Vec<String>)> {
        let mut child = Command::new(program)
            .args(args)
            .envs(env.iter().copied())
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

/// Starts the worker binary `name` with `args`, waits up to `timeout` for its line starting
/// with `ready`, and returns it with every address its `listening on http://ADDR` lines name,
/// in order.
fn start_listening(
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
    ready: &str,
    timeout: Duration,
) -> anyhow::Result<(Process, Vec<SocketAddr>)> {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let (process, lines) =
        Process::start_with_env(&binary(name)?, &args, env, |line| line.starts_with(ready), timeout)?;
    let addrs = lines
        .iter()
        .filter_map(|line| line.split("listening on http://").nth(1))
        .map(|addr| {
            addr.trim()
                .parse()
                .with_context(|| format!("{name} printed a bad address"))
        })
        .collect::<anyhow::Result<Vec<SocketAddr>>>()?;
    Ok((process, addrs))
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
        let (process, addrs) =
            start_listening("switchyard-mocker", args, &[], "mocker ready", Duration::from_secs(30))?;
        Ok(Mockers { process, addrs })
    }
}

/// `switchyard-llm`: the native LLM worker.
#[derive(Debug)]
pub struct NativeWorker {
    /// The process.
    pub process: Process,
    /// The address it listens on.
    pub addr: SocketAddr,
}

impl NativeWorker {
    /// Starts `switchyard-llm` with `args` (e.g. `--model DIR --port 0`).
    ///
    /// # Errors
    ///
    /// Fails if it cannot start, load its model, or report its port.
    pub fn start(args: &[&str]) -> anyhow::Result<NativeWorker> {
        NativeWorker::start_with_env(args, &[])
    }

    /// As [`NativeWorker::start`], with `env` added to its environment (e.g. the gateway
    /// token as `SWITCHYARD_GATEWAY_TOKEN`).
    ///
    /// # Errors
    ///
    /// As [`NativeWorker::start`].
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<NativeWorker> {
        let (process, addrs) = start_listening("switchyard-llm", args, env, "worker ready", Duration::from_secs(60))?;
        let addr = *addrs.first().context("the worker printed no address")?;
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
        NativeEncoder::start_with_env(args, &[])
    }

    /// As [`NativeEncoder::start`], with `env` added to its environment (e.g. the gateway
    /// token as `SWITCHYARD_GATEWAY_TOKEN`).
    ///
    /// # Errors
    ///
    /// As [`NativeEncoder::start`].
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<NativeEncoder> {
        let (process, addrs) = start_listening(
            "switchyard-encoder",
            args,
            env,
            "encoder ready",
            Duration::from_secs(60),
        )?;
        let addr = *addrs.first().context("the encoder printed no address")?;
        Ok(NativeEncoder { process, addr })
    }
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
