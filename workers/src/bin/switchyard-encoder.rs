//! `switchyard-encoder`: a native vision or audio encoder worker. Loads a model (a LLaVA-style
//! or CLIP/SigLIP directory for images, a Whisper directory or CTranslate2 `model.bin` for
//! audio), serves the encode protocol (`POST /v1/encode`: micro-batches in, features pushed to
//! the LLM workers the items name), keeps a feature cache announced as KV events, exposes
//! `/healthz` and `/metrics`, and registers with a fleet over NATS or one gateway's admin API.
//! SIGTERM or ctrl-c leaves the fleet, lets queued items finish (`--drain-timeout-s`) and exits.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use switchyard_protocol::{Role, kv_events};
use switchyard_workers::encoder::native::NativeDevice;
use switchyard_workers::encoder::{EncoderConfig, EncoderServer};
use switchyard_workers::shutdown::shutdown_signal;
use switchyard_workers::{gateway_link, kv_link};

/// A native encoder worker.
#[derive(Debug, Parser)]
#[command(name = "switchyard-encoder", version)]
struct Args {
    /// The model: a directory (`config.json`, `*.safetensors`, `preprocessor_config.json`) or
    /// a CTranslate2 Whisper `model.bin`.
    #[arg(long)]
    model: PathBuf,
    /// `cpu`, or `cuda:N` (a build with `--features cuda`): the forward on that GPU, with CUDA
    /// graphs at power-of-two token budgets up to the largest of `--token-budgets`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8100)]
    port: u16,
    /// The LLM model whose requests it encodes for (as the gateway's `[[models]]` names it).
    #[arg(long)]
    served_model_name: String,
    /// Feature cache size in MiB.
    #[arg(long, default_value_t = 1024)]
    feature_cache_mib: u64,
    /// The token budgets it batches to (comma-separated, ascending), advertised at
    /// registration.
    #[arg(long, value_delimiter = ',', default_values_t = vec![576u32, 2304, 4608, 9216, 18432])]
    token_budgets: Vec<u32>,
    /// Consecutive video frames averaged into one frame's worth of features: must match the
    /// gateway's `temporal_pooling` for the model, which counts the video's tokens with it.
    #[arg(long, default_value_t = 2)]
    temporal_pooling: usize,
    /// Largest encode batch body, in MiB.
    #[arg(long, default_value_t = 64)]
    max_body_mib: usize,
    /// Compute threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Register over this NATS server.
    #[arg(long, conflicts_with = "gateway")]
    nats: Option<String>,
    #[command(flatten)]
    link: switchyard_workers::gateway_link::GatewayArgs,
    /// NATS subject prefix.
    #[arg(long, default_value = "switchyard")]
    subject_prefix: String,
    /// Worker name (default: `encoder-PORT`).
    #[arg(long)]
    name: Option<String>,
    /// The URL gateways reach it at (default: `http://HOST:PORT`).
    #[arg(long)]
    advertise_url: Option<String>,
    /// The machine it runs on, for transfer costs (`node` in routing tables).
    #[arg(long, default_value = "")]
    node: String,
    /// Cost per token, for cost-aware routing.
    #[arg(long, default_value_t = 1.0)]
    cost: f64,
    /// Heartbeat period.
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
    /// How long queued items may take to finish after SIGTERM.
    #[arg(long, default_value_t = 30)]
    drain_timeout_s: u64,
}

fn main() -> std::process::ExitCode {
    switchyard_workers::binary::main("switchyard-encoder", None, run)
}

async fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    // Read before anything loads, so a missing token fails at once.
    let gateway_token = args.link.token()?;
    let gpu: Option<usize> = match args.device.as_str() {
        "cpu" => None,
        "cuda" => Some(0),
        other => match other.strip_prefix("cuda:").map(str::parse) {
            Some(Ok(ordinal)) => Some(ordinal),
            _ => anyhow::bail!("--device must be `cpu` or `cuda:N`, not `{other}`"),
        },
    };
    if gpu.is_some() && !cfg!(feature = "cuda") {
        anyhow::bail!(
            "--device {}: this switchyard-encoder was built without CUDA; rebuild with `--features cuda`",
            args.device
        );
    }
    anyhow::ensure!(
        !args.served_model_name.is_empty(),
        "--served-model-name must not be empty"
    );
    if let Some(threads) = args.threads {
        anyhow::ensure!(threads > 0, "--threads must be at least 1");
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .context("cannot size the compute thread pool")?;
    }
    let path = args.model.clone();
    let pooling = args.temporal_pooling;
    let device =
        tokio::task::spawn_blocking(move || NativeDevice::load(&path).map(|d| d.with_temporal_pooling(pooling)))
            .await
            .context("the loading thread failed")??;
    #[cfg(feature = "cuda")]
    let device = match gpu {
        Some(ordinal) => {
            let budget = args.token_budgets.iter().copied().max().unwrap_or(1) as usize;
            tokio::task::spawn_blocking(move || device.on_cuda(ordinal, budget))
                .await
                .context("the loading thread failed")?
                .with_context(|| format!("--device {}", args.device))?
        }
        None => device,
    };
    let role = device.role();
    let feature_dim = switchyard_workers::encoder::EncodeDevice::feature_dim(&device);
    tracing::info!(model = %args.model.display(), %role, feature_dim, "encoder model loaded");

    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr().context("cannot read the listening address")?;
    let name = args.name.clone().unwrap_or_else(|| format!("encoder-{}", addr.port()));
    anyhow::ensure!(
        kv_events::valid_worker_name(&name),
        "worker name `{name}` must be letters, digits, `-` and `_`"
    );
    let kv_log = args
        .link
        .gateway
        .as_ref()
        .map(|_| Arc::new(std::sync::Mutex::new(kv_events::EventLog::new(name.clone()))));
    let server = EncoderServer::start(
        listener,
        EncoderConfig {
            role,
            model: args.served_model_name.clone(),
            feature_dim,
            cache_bytes: args.feature_cache_mib << 20,
            max_body_bytes: args.max_body_mib << 20,
            token_budgets: args.token_budgets.clone(),
            kv_log: kv_log.clone(),
            device: Some(Arc::new(device)),
            ..EncoderConfig::default()
        },
    )
    .context("cannot start the HTTP server")?;

    let registration = kv_events::Registration {
        worker: name,
        url: args.advertise_url.clone().unwrap_or_else(|| format!("http://{addr}")),
        model: args.served_model_name.clone(),
        role,
        // One cached media item per announced block.
        block_size: 1,
        capacity_blocks: 0,
        capabilities: match role {
            Role::Audio => vec!["audio".into()],
            _ => vec!["image".into()],
        },
        cost: args.cost,
        node: args.node.clone(),
        token_budgets: args.token_budgets.clone(),
        spot: false,
        preempting: false,
        heartbeat_ms: args.heartbeat_ms.max(1),
        last_event_id: 0,
    };
    let (sink, events) = tokio::sync::mpsc::unbounded_channel();
    server.subscribe_kv_events(sink);
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let link = if let Some(url) = &args.nats {
        let client = async_nats::connect(url.as_str())
            .await
            .with_context(|| format!("cannot connect to NATS at `{url}`"))?;
        let config = kv_link::LinkConfig {
            subjects: kv_events::Subjects::new(args.subject_prefix.clone()),
            registration,
            drop_every: None,
            preempting: None,
        };
        Some(tokio::spawn(async move {
            if let Err(err) = kv_link::run(client, config, events, stopped).await {
                tracing::error!(error = %err, "the NATS link stopped");
            }
        }))
    } else if let (Some(url), Some(token), Some(log)) = (&args.link.gateway, &gateway_token, &kv_log) {
        let config = gateway_link::GatewayLinkConfig {
            admin_url: url.clone(),
            token: token.clone(),
            registration,
        };
        Some(tokio::spawn(gateway_link::run(config, log.clone(), events, stopped)))
    } else {
        None
    };
    let shutdown = shutdown_signal().context("cannot listen for SIGINT and SIGTERM")?;
    println!("encoder listening on http://{addr}");
    println!("encoder ready: {role} for model `{}`", args.served_model_name);
    shutdown.await;
    tracing::info!("shutting down: leaving, then draining");
    let _ = stop.send(());
    if let Some(task) = link {
        let _ = task.await;
    }
    let deadline = Instant::now() + Duration::from_secs(args.drain_timeout_s);
    while server.stats().queued.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = server.stats().queued.load(Ordering::Relaxed);
    if left > 0 {
        tracing::warn!(left, "drain timeout: queued items are cut off");
    }
    Ok(())
}
