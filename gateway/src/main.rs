//! `switchyard`: the gateway binary.
//!
//! # Rejected designs
//!
//! - mimalloc as the global allocator (glibc's allocator is ~8–10 % of the samples at 512
//!   streams): 0–14 % less CPU per request at 512 streams, inside the run-to-run spread. Not
//!   worth a C dependency and a change in how memory goes back to the system, which the
//!   hostile-plugin tests watch.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use switchyard::Config;
use switchyard::Gateway;

/// A TLS gateway that speaks the OpenAI API and routes each request to a worker.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Manage the router policy of a running gateway through its admin API.
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// Make and hash client API keys (`[[api_keys]]` store only a key's SHA-256).
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
}

#[derive(Debug, clap::Subcommand)]
enum KeysAction {
    /// Prints a new random key, and the `[[api_keys]]` entry to paste into the config or the
    /// keys file (give the key to the client; the gateway keeps only its hash).
    New {
        /// The tenant the key belongs to.
        #[arg(long)]
        tenant: String,
    },
    /// Prints the SHA-256 of a key read from standard input (one line).
    Hash,
}

#[derive(Debug, clap::Args)]
struct AdminArgs {
    /// The gateway's admin API, e.g. http://127.0.0.1:9443.
    #[arg(long, env = "SWITCHYARD_ADMIN")]
    admin: String,
    /// The admin bearer token (visible to every local user on the command line; prefer
    /// --token-file or the environment).
    #[arg(
        long,
        env = "SWITCHYARD_ADMIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    token: Option<String>,
    /// A file holding the admin bearer token (what a dev gateway writes its generated one to).
    #[arg(long, env = "SWITCHYARD_ADMIN_TOKEN_FILE", value_name = "FILE")]
    token_file: Option<PathBuf>,
}

impl AdminArgs {
    /// The token, from --token (or its variable) or read from --token-file.
    fn token(&self) -> anyhow::Result<String> {
        match (&self.token, &self.token_file) {
            (Some(token), _) => Ok(token.clone()),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                Ok(text.trim().to_string())
            }
            (None, None) => anyhow::bail!(
                "the admin API needs a token: --token-file FILE, SWITCHYARD_ADMIN_TOKEN_FILE or SWITCHYARD_ADMIN_TOKEN"
            ),
        }
    }
}

#[derive(Debug, clap::Subcommand)]
enum PolicyAction {
    /// Uploads a policy (validated by the gateway) and, with --activate, makes it active.
    Push {
        /// Name of the policy.
        name: String,
        /// The component (.wasm).
        file: PathBuf,
        /// Make it the active router at once.
        #[arg(long)]
        activate: bool,
        /// A TOML file: the policy's own config table, sent before the component.
        #[arg(long, value_name = "FILE.toml")]
        config: Option<PathBuf>,
        /// Activate it on every replica of the gateway's fleet (`[fleet]`); refused by a
        /// gateway that is in none. Implies --activate.
        #[arg(long)]
        fleet: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Makes an uploaded policy the active router.
    Activate {
        /// Name of the policy.
        name: String,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Restores the previous router version.
    Rollback {
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Shows the active, previous and uploaded policies; with --fleet, the fleet's policy and
    /// what each replica runs (or why it refused it).
    List {
        /// Show the fleet's state instead of this gateway's.
        #[arg(long)]
        fleet: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Validates a router component offline, as a gateway would on upload (imports, `init`, a
    /// self-test call, resident-memory fit), and times its calls at 8, 64 and 1,024 workers.
    Check {
        /// The component (.wasm).
        file: PathBuf,
        /// A TOML file: the policy's own config table.
        #[arg(long, value_name = "FILE.toml")]
        config: Option<PathBuf>,
        /// The CPU deadline per call, as `policy.deadline_ms`.
        #[arg(long, default_value_t = 1, value_name = "MS")]
        deadline_ms: u64,
        /// The memory cap, as `policy.memory_limit_mib`.
        #[arg(long, default_value_t = 32, value_name = "MIB")]
        memory_limit_mib: usize,
    },
}

/// Options of the gateway itself.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// The configuration file (TOML).
    #[arg(long, default_value = "config/dev.toml")]
    config: PathBuf,
    /// Overrides `server.listen`.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<SocketAddr>,
    /// Overrides `admin.listen` (when the configuration has an `[admin]` table).
    #[arg(long, value_name = "HOST:PORT")]
    admin_listen: Option<SocketAddr>,
    /// Overrides `embedded_mockers.count` (0 turns embedded mockers off).
    #[arg(long, value_name = "N")]
    mockers: Option<usize>,
    /// Overrides `embedded_mockers.speedup`.
    #[arg(long, value_name = "FACTOR")]
    mocker_speedup: Option<f64>,
    /// Log filter, e.g. `info` or `switchyard=debug` (the RUST_LOG variable wins).
    #[arg(long, default_value = "info")]
    log: String,
}

fn main() -> std::process::ExitCode {
    match start(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("switchyard: error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn start(args: Args) -> anyhow::Result<()> {
    if let Some(Command::Policy {
        action:
            PolicyAction::Check {
                file,
                config,
                deadline_ms,
                memory_limit_mib,
            },
    }) = args.command
    {
        return check(&file, config.as_deref(), deadline_ms, memory_limit_mib);
    }
    if let Some(Command::Keys { action }) = args.command {
        return keys_command(action);
    }
    if let Some(Command::Policy { action }) = args.command {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?;
        return runtime.block_on(policy_command(action));
    }
    let args = args.serve;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&args.log)),
        )
        .with_writer(std::io::stderr)
        .init();
    // Every client stream may hold a worker connection too; lift the soft descriptor limit.
    if let Err(err) = rlimit::increase_nofile_limit(u64::MAX) {
        tracing::warn!(error = %err, "could not raise the open-file limit");
    }
    let mut config = Config::load(&args.config)?;
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    if let (Some(listen), Some(admin)) = (args.admin_listen, config.admin.as_mut()) {
        admin.listen = listen;
    }
    if let Some(count) = args.mockers {
        config.embedded_mockers.get_or_insert_with(Default::default).count = count;
    }
    if let Some(speedup) = args.mocker_speedup {
        config.embedded_mockers.get_or_insert_with(Default::default).speedup = speedup;
    }
    config.validate(&args.config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(run(config))
}

/// A 1×1 PNG as a data URL, for the example request with an image.
const TINY_PNG: &str = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

async fn run(config: Config) -> anyhow::Result<()> {
    let drain_timeout = config.server.drain_timeout();
    let gateway = Gateway::start(config).await?;
    let url = gateway.url();
    let models = gateway.models();
    let model = models.first().cloned().unwrap_or_else(|| "mock".into());
    println!(
        "switchyard listening on {url} (models: {}; {} workers, {} encoders)",
        models.join(", "),
        gateway.worker_count(),
        gateway.encoder_count()
    );
    if let Some(fingerprint) = gateway.fingerprint() {
        println!("certificate SHA-256: {fingerprint}");
    }
    for (name, addr) in gateway.embedded_mockers() {
        println!("embedded mocker {name} at http://{addr}");
    }
    for (name, addr) in gateway.embedded_encoders() {
        println!("embedded encoder {name} at http://{addr}");
    }
    if let (Some(admin), Some(admin_url)) = (gateway.admin_addr(), gateway.admin_url()) {
        let token_file = gateway.generated_admin_token().map(write_token_file);
        // A configured token is a production secret: logs and terminals never see it. A
        // generated one goes to a file only its user can read, and is shown once, to a person
        // at a terminal (stdout that is a pipe usually ends in a log).
        let shown = match (&token_file, gateway.generated_admin_token()) {
            (Some(Ok(path)), Some(token)) if std::io::stdout().is_terminal() => {
                format!("token {token}, also in {}", path.display())
            }
            (Some(Err(err)), Some(token)) if std::io::stdout().is_terminal() => {
                format!("token {token}; not saved: {err:#}")
            }
            (Some(Ok(path)), _) => format!("token in {}", path.display()),
            (Some(Err(err)), _) => format!("generated token not saved ({err:#}); set `admin.token`"),
            (None, _) => "token from the config".to_string(),
        };
        println!("admin API listening on {admin_url} ({shown})");
        if admin_url.starts_with("http://") {
            let credential = match &token_file {
                Some(Ok(path)) => format!(" --token-file {}", path.display()),
                // SWITCHYARD_ADMIN_TOKEN or SWITCHYARD_ADMIN_TOKEN_FILE supplies it.
                _ => String::new(),
            };
            println!("swap the router live: {}", push_example(admin, &credential));
        } else {
            // The `policy` subcommands speak plain HTTP; a TLS admin API wants a client
            // certificate they do not carry.
            println!(
                "swap the router live: PUT {admin_url}/admin/policies/NAME?activate=true with a client certificate"
            );
        }
    }
    let insecure = if url.starts_with("https") { "-k " } else { "" };
    let key = if gateway.needs_api_key() {
        "-H \"authorization: Bearer $KEY\" "
    } else {
        ""
    };
    println!(
        "try: curl -N {insecure}{url}/v1/chat/completions {key}-H 'content-type: application/json' -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"stream\":true}}'"
    );
    if gateway.encoder_count() > 0 {
        println!(
            "try an image: curl {insecure}{url}/v1/chat/completions {key}-H 'content-type: application/json' -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":[{{\"type\":\"text\",\"text\":\"what is this?\"}},{{\"type\":\"image_url\",\"image_url\":{{\"url\":\"{TINY_PNG}\"}}}}]}}]}}'"
        );
    }
    shutdown_signal().await?;
    let timeout = drain_timeout;
    tracing::info!(?timeout, "shutting down: draining the responses in flight");
    let drained = gateway.drain(timeout).await;
    if gateway.generated_admin_token().is_some() {
        // The generated token dies with this process; so does its file.
        let _ = std::fs::remove_file(token_file_path());
    }
    if drained {
        tracing::info!("drained; exiting");
    } else {
        tracing::warn!(
            ?timeout,
            "responses still in flight after server.drain_timeout_ms; exiting anyway"
        );
    }
    Ok(())
}

/// A `switchyard policy push` command that works as printed: this binary, the built-in
/// `least-load` component where the build left it (or, where the build's output is not on
/// this machine, a copy of the embedded one written to the temporary folder), this admin
/// listener and `credential` (the token's flag, or nothing when the environment supplies it).
fn push_example(admin: SocketAddr, credential: &str) -> String {
    let binary = std::env::current_exe()
        .map(|path| path.display().to_string())
        .unwrap_or_else(|_| "switchyard".into());
    let built = option_env!("SWITCHYARD_BUILT_IN_POLICY_DIR")
        .map(|dir| std::path::Path::new(dir).join("least_load.wasm"))
        .filter(|path| path.is_file());
    let file = built.or_else(|| {
        let copy = std::env::temp_dir().join(format!("switchyard-{}-least_load.wasm", std::process::id()));
        let wasm = switchyard::built_in_policy("least-load")?;
        std::fs::write(&copy, wasm).ok().map(|()| copy)
    });
    match file {
        Some(file) => format!(
            "{binary} policy push least-load {} --activate --admin http://{admin}{credential}",
            file.display()
        ),
        None => format!("{binary} policy push NAME FILE.wasm --activate --admin http://{admin}{credential}"),
    }
}

/// Where a generated admin token is written: the runtime folder when the session has one
/// (private to its user), else the temporary folder; named by this process's id.
fn token_file_path() -> PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|dir| dir.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!("switchyard-{}-admin-token", std::process::id()))
}

/// Writes the generated admin token to [`token_file_path`], readable by this user only.
///
/// The file is created anew (`O_EXCL`, so never through a link someone planted), with mode
/// 0600 from its first byte; a stale one left by an earlier process with this id is removed
/// first.
fn write_token_file(token: &str) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    let path = token_file_path();
    match std::fs::remove_file(&path) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            return Err(err).with_context(|| format!("removing the stale {}", path.display()));
        }
        _ => {}
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(token.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Waits for SIGINT (ctrl-c) or, on Unix, SIGTERM.
async fn shutdown_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("listening for SIGTERM")?;
        tokio::select! {
            result = tokio::signal::ctrl_c() => result.context("waiting for ctrl-c"),
            _ = terminate.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await.context("waiting for ctrl-c")
}

/// `switchyard policy check`: validates and times a component offline.
fn check(
    file: &std::path::Path,
    config: Option<&std::path::Path>,
    deadline_ms: u64,
    memory_limit_mib: usize,
) -> anyhow::Result<()> {
    let wasm = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let config = match config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            text.parse::<toml::Table>()
                .with_context(|| format!("{} is not a TOML table", path.display()))?
        }
        None => toml::Table::new(),
    };
    let sandbox = switchyard::PolicySandbox {
        deadline: std::time::Duration::from_millis(deadline_ms),
        memory_limit_bytes: memory_limit_mib << 20,
        ..switchyard::PolicySandbox::default()
    };
    let report = switchyard::check_policy(&wasm, config, sandbox)
        .with_context(|| format!("{} would be refused", file.display()))?;
    print!("{report}");
    Ok(())
}

async fn policy_command(action: PolicyAction) -> anyhow::Result<()> {
    let (method, path, body, admin) = match action {
        PolicyAction::Push {
            name,
            file,
            activate,
            config,
            fleet,
            admin,
        } => {
            let wasm = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            if let Some(config) = config {
                let text = std::fs::read(&config).with_context(|| format!("reading {}", config.display()))?;
                admin_request(
                    &admin,
                    http::Method::PUT,
                    &format!("/admin/policies/{name}/config"),
                    text,
                )
                .await?;
            }
            let query = match (fleet, activate) {
                (true, _) => "?activate=true&fleet=true",
                (false, true) => "?activate=true",
                (false, false) => "",
            };
            (http::Method::PUT, format!("/admin/policies/{name}{query}"), wasm, admin)
        }
        PolicyAction::Activate { name, admin } => (
            http::Method::POST,
            format!("/admin/policies/{name}/activate"),
            Vec::new(),
            admin,
        ),
        PolicyAction::Rollback { admin } => (
            http::Method::POST,
            "/admin/policies/active/rollback".to_string(),
            Vec::new(),
            admin,
        ),
        PolicyAction::List { fleet, admin } => {
            let path = if fleet { "/admin/fleet" } else { "/admin/policies" };
            (http::Method::GET, path.to_string(), Vec::new(), admin)
        }
        PolicyAction::Check { .. } => anyhow::bail!("`policy check` runs offline"),
    };
    let body = admin_request(&admin, method, &path, body).await?;
    println!("{body}");
    Ok(())
}

/// One authenticated request to the admin API; returns the answer's body.
async fn admin_request(admin: &AdminArgs, method: http::Method, path: &str, body: Vec<u8>) -> anyhow::Result<String> {
    use http_body_util::{BodyExt, Full};
    let uri: http::Uri = format!("{}{path}", admin.admin.trim_end_matches('/'))
        .parse()
        .context("--admin is not a URL")?;
    let request = http::Request::builder()
        .method(method)
        .uri(uri)
        .header(http::header::AUTHORIZATION, format!("Bearer {}", admin.token()?))
        .body(Full::new(bytes::Bytes::from(body)))?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let response = client
        .request(request)
        .await
        .with_context(|| format!("reaching {}", admin.admin))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .context("reading the answer")?
        .to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    anyhow::ensure!(status.is_success(), "the gateway answered {status}: {body}");
    Ok(body)
}

/// `switchyard keys new` and `switchyard keys hash`.
fn keys_command(action: KeysAction) -> anyhow::Result<()> {
    use sha2::{Digest, Sha256};
    let hash = |key: &str| -> String {
        Sha256::digest(key.as_bytes())
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect()
    };
    match action {
        KeysAction::New { tenant } => {
            let mut bytes = [0u8; 24];
            rustls::crypto::ring::default_provider()
                .secure_random
                .fill(&mut bytes)
                .map_err(|_| anyhow::anyhow!("no OS randomness to make a key from"))?;
            let key = format!(
                "sy-{}",
                bytes.iter().map(|byte| format!("{byte:02x}")).collect::<String>()
            );
            println!("key (give it to the client; it is not stored): {key}");
            println!();
            println!("[[api_keys]]");
            println!("key_sha256 = \"{}\"", hash(&key));
            println!("tenant = {}", toml::Value::String(tenant));
        }
        KeysAction::Hash => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .context("reading the key from standard input")?;
            let key = line.trim_end_matches(['\r', '\n']);
            anyhow::ensure!(!key.is_empty(), "no key on standard input");
            println!("{}", hash(key));
        }
    }
    Ok(())
}
