//! `switchyard-mocker`: runs N simulated engines in one process, one HTTP port each.

use std::net::IpAddr;

use anyhow::Context;
use clap::Parser;
use switchyard_protocol::kv_events;
use switchyard_workers::kv_link;
use switchyard_workers::mocker::{self, EngineConfig, ServerConfig};

/// Simulated LLM workers speaking the OpenAI API (timing from Dynamo's fitted perf model).
#[derive(Debug, Parser)]
#[command(name = "switchyard-mocker", version)]
struct Args {
    /// Number of engines to run, one port each.
    #[arg(long, default_value_t = 1)]
    num_workers: usize,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// First port; engine i listens on PORT+i. 0 picks a free port for each.
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Model name served.
    #[arg(long, default_value = "mock")]
    model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 16_384)]
    num_gpu_blocks: usize,
    /// Token budget per step.
    #[arg(long, default_value_t = 8_192)]
    max_num_batched_tokens: usize,
    /// Most sequences running at once per engine.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Simulated time runs this many times faster than the perf model.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Tokens generated when a request sets no `max_tokens`.
    #[arg(long, default_value_t = 32)]
    default_max_tokens: u32,
    /// Require a whole prompt to fit one step instead of chunking it.
    #[arg(long)]
    no_chunked_prefill: bool,
    /// Disable prefix caching.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Publish KV events, registration and heartbeats to this NATS server (`nats://host:4222`).
    #[arg(long)]
    nats: Option<String>,
    /// NATS subject prefix.
    #[arg(long, default_value = "switchyard")]
    subject_prefix: String,
    /// Worker names are NAME-0, NAME-1, ... (NATS mode; default `mocker-PORT`).
    #[arg(long)]
    name: Option<String>,
    /// Heartbeat interval in milliseconds (NATS mode).
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
    /// Fault injection: lose every N-th KV event (it is still numbered, so gateways see gaps).
    #[arg(long)]
    drop_kv_event_every: Option<u64>,
}

fn main() -> std::process::ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("switchyard-mocker: error: cannot start the runtime: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("switchyard-mocker: error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if let Err(err) = rlimit::increase_nofile_limit(u64::MAX) {
        tracing::warn!(error = %err, "could not raise the open-file limit");
    }
    anyhow::ensure!(args.num_workers > 0, "--num-workers must be at least 1");
    anyhow::ensure!(args.block_size > 0, "--block-size must be at least 1");
    anyhow::ensure!(
        args.max_num_batched_tokens > 0,
        "--max-num-batched-tokens must be at least 1"
    );
    anyhow::ensure!(args.max_num_seqs > 0, "--max-num-seqs must be at least 1");
    anyhow::ensure!(
        args.speedup.is_finite() && args.speedup > 0.0,
        "--speedup must be a positive number"
    );
    let engine = EngineConfig {
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        enable_chunked_prefill: !args.no_chunked_prefill,
        enable_prefix_caching: !args.no_prefix_caching,
        speedup: args.speedup,
    };
    let server = ServerConfig {
        model: args.model.clone(),
        default_max_tokens: args.default_max_tokens,
        ..ServerConfig::default()
    };
    let fleet = mocker::spawn_fleet(args.num_workers, args.host, args.port, &engine, &server)
        .await
        .context("could not bind the mocker ports")?;
    let mut links = Vec::new();
    if let Some(url) = &args.nats {
        let client = async_nats::connect(url.as_str())
            .await
            .with_context(|| format!("cannot connect to NATS at `{url}`"))?;
        for (index, worker) in fleet.iter().enumerate() {
            let name = match &args.name {
                Some(prefix) => format!("{prefix}-{index}"),
                None => format!("mocker-{}", worker.addr().port()),
            };
            anyhow::ensure!(
                kv_events::valid_worker_name(&name),
                "worker name `{name}` must be letters, digits, `-` and `_`"
            );
            let (sink, events) = tokio::sync::mpsc::unbounded_channel();
            worker.engine().subscribe_kv_events(sink);
            let (stop, stopped) = tokio::sync::oneshot::channel();
            let config = kv_link::LinkConfig {
                subjects: kv_events::Subjects::new(args.subject_prefix.clone()),
                registration: kv_events::Registration {
                    worker: name,
                    url: format!("http://{}", worker.addr()),
                    model: args.model.clone(),
                    role: switchyard_protocol::Role::Llm,
                    block_size: args.block_size,
                    capacity_blocks: args.num_gpu_blocks as u64,
                    capabilities: vec!["text".into()],
                    cost: 1.0,
                    heartbeat_ms: args.heartbeat_ms.max(1),
                    last_event_id: 0,
                },
                drop_every: args.drop_kv_event_every,
            };
            let task = tokio::spawn(kv_link::run(client.clone(), config, events, stopped));
            links.push((stop, task));
        }
    }
    for (index, worker) in fleet.iter().enumerate() {
        println!("mocker {index} listening on http://{}", worker.addr());
    }
    println!("mocker ready: {} worker(s), model `{}`", fleet.len(), args.model);
    tokio::signal::ctrl_c().await.context("waiting for ctrl-c")?;
    for (stop, task) in links {
        let _ = stop.send(());
        let _ = task.await;
    }
    Ok(())
}
