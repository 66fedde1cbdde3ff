//! `switchyard`: the gateway binary.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use switchyard::Gateway;
use switchyard::config::Config;

/// A TLS gateway that speaks the OpenAI API and routes each request to a worker.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version)]
struct Args {
    /// The configuration file (TOML).
    #[arg(long, default_value = "config/dev.toml")]
    config: PathBuf,
    /// Overrides `server.listen`.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<SocketAddr>,
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
    if let Some(count) = args.mockers {
        config
            .embedded_mockers
            .get_or_insert_with(Default::default)
            .count = count;
    }
    if let Some(speedup) = args.mocker_speedup {
        config
            .embedded_mockers
            .get_or_insert_with(Default::default)
            .speedup = speedup;
    }
    config.validate(&args.config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(run(config))
}

async fn run(config: Config) -> anyhow::Result<()> {
    let gateway = Gateway::start(config).await?;
    let url = gateway.url();
    let models = gateway.state().pool.models().join(", ");
    let workers = gateway.state().pool.workers().len();
    let model = gateway
        .state()
        .pool
        .models()
        .first()
        .copied()
        .unwrap_or("mock")
        .to_string();
    println!("switchyard listening on {url} (models: {models}; {workers} workers)");
    if let Some(fingerprint) = gateway.fingerprint() {
        println!("certificate SHA-256: {fingerprint}");
    }
    let insecure = if url.starts_with("https") { "-k " } else { "" };
    println!(
        "try: curl -N {insecure}{url}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"stream\":true}}'"
    );
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    tracing::info!("shutting down");
    Ok(())
}
