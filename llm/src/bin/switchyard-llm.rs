//! `switchyard-llm`: the native LLM worker. Loads a Hugging Face model directory, runs it
//! behind the shared scheduler, serves the OpenAI endpoints, and announces itself (KV events,
//! registration, heartbeats) over NATS. Every worker serves both sides of prefill/decode
//! disaggregation (its blocks' keys and values move over HTTP between workers); `--role` is
//! what it announces.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use switchyard_llm::{self as llm, Model};
use switchyard_protocol::kv_events;
use switchyard_tokenize::{ChatTemplate, JinjaTemplate, PromptEncoder};
use switchyard_workers::engine::EngineConfig;
use switchyard_workers::server::{KvTransferConfig, ServerConfig, TextCodec, WorkerServer};
use switchyard_workers::shutdown::shutdown_signal;
use switchyard_workers::{gateway_link, kv_link};

/// What the worker announces itself as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WorkerRole {
    /// An LLM worker (the default).
    Llm,
    /// A prefill worker (prefill/decode disaggregation): it computes prompts whose KV blocks
    /// decode workers pull.
    Prefill,
    /// A decode worker: it pulls a prompt's KV blocks from the prefill worker a request names,
    /// or prefills itself.
    Decode,
}

impl WorkerRole {
    fn announced(self) -> switchyard_protocol::Role {
        match self {
            WorkerRole::Llm => switchyard_protocol::Role::Llm,
            WorkerRole::Prefill => switchyard_protocol::Role::Prefill,
            WorkerRole::Decode => switchyard_protocol::Role::Decode,
        }
    }
}

/// A native LLM worker speaking the OpenAI API.
#[derive(Debug, Parser)]
#[command(name = "switchyard-llm", version)]
struct Args {
    /// Hugging Face model directory: config.json, *.safetensors, tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// What the worker announces in its registrations: `llm`, or `prefill` / `decode` for
    /// prefill/decode disaggregation. Every worker serves both sides (exports its blocks'
    /// keys and values, imports those of a prefill worker a request names); the role is what
    /// routers use it for.
    #[arg(long, value_enum, default_value_t = WorkerRole::Llm)]
    role: WorkerRole,
    /// The machine name announced in registrations and in the `kv_transfer_params` this
    /// worker answers as a prefill worker (`remote_node`).
    #[arg(long, default_value = "")]
    node: String,
    /// How long (real time) a decode worker waits for a prefill worker's blocks (the export
    /// call and its answer, payloads included) before it prefills the prompt itself.
    #[arg(long, default_value_t = 2000)]
    kv_transfer_timeout_ms: u64,
    /// Where the model runs: `cpu`, or `cuda:N` (needs a build with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model name clients ask for (default: the directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Tokens per KV block; must equal the gateway's `block_size` for prefix-aware routing.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Memory for the KV cache, in MiB (ignored when --num-gpu-blocks is given).
    #[arg(long, default_value_t = 1024)]
    kv_cache_mib: usize,
    /// KV blocks in the cache.
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    /// How the KV cache stores keys and values: `f32` (as computed), or `f16` (twice the
    /// tokens in the same `--kv-cache-mib`; values rounded to f16), on either backend.
    #[arg(long, default_value = "f32")]
    kv_cache_dtype: llm::KvPrecision,
    /// Token budget per step.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Require a whole prompt to fit one step instead of chunking it.
    #[arg(long)]
    no_chunked_prefill: bool,
    /// Disable prefix caching.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Tokens generated when a request sets no `max_tokens`.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: u32,
    /// Compute threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Per-message chat template, with `{role}` and `{content}` (must match the gateway's).
    #[arg(long, conflicts_with = "chat_template_file")]
    chat_template: Option<String>,
    /// The model's own (Jinja) chat template: its `tokenizer_config.json`, a `.jinja` file, or
    /// a GGUF model file's embedded one (must match the gateway's `[models.chat_template]`).
    #[arg(long)]
    chat_template_file: Option<PathBuf>,
    /// Text after the last chat message (must match the gateway's).
    #[arg(long)]
    chat_generation_prompt: Option<String>,
    /// Publish KV events, registration and heartbeats to this NATS server (`nats://host:4222`).
    #[arg(long, conflicts_with = "gateway")]
    nats: Option<String>,
    #[command(flatten)]
    link: switchyard_workers::gateway_link::GatewayArgs,
    /// NATS subject prefix.
    #[arg(long, default_value = "switchyard")]
    subject_prefix: String,
    /// Worker name in the gateway (default `worker-PORT`).
    #[arg(long)]
    name: Option<String>,
    /// URL the gateway reaches this worker at (default `http://HOST:PORT`).
    #[arg(long)]
    advertise_url: Option<String>,
    /// Relative cost of this worker's tokens, for cost-aware policies.
    #[arg(long, default_value_t = 1.0)]
    cost: f64,
    /// Heartbeat interval in milliseconds.
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
    /// On shutdown, wait this long for requests in flight to finish.
    #[arg(long, default_value_t = 30)]
    drain_timeout_s: u64,
}

/// The chat template the flags ask for (the default pattern when none).
fn chat_template(args: &Args) -> anyhow::Result<ChatTemplate> {
    if let Some(path) = &args.chat_template_file {
        if path.extension().is_some_and(|ext| ext == "gguf") {
            let file = llm::gguf::GgufFile::open(path)?;
            let template = file
                .chat_template()?
                .with_context(|| format!("{}: no `tokenizer.chat_template` in the file", path.display()))?;
            return Ok(ChatTemplate::Jinja(template));
        }
        return Ok(ChatTemplate::Jinja(JinjaTemplate::from_file(path)?));
    }
    let ChatTemplate::Simple {
        message,
        generation_prompt,
    } = ChatTemplate::default()
    else {
        unreachable!("the default template is a simple one");
    };
    Ok(ChatTemplate::Simple {
        message: args.chat_template.clone().unwrap_or(message),
        generation_prompt: args.chat_generation_prompt.clone().unwrap_or(generation_prompt),
    })
}

/// The engine's KV events for a link, and the pair that tells the link to stop.
fn kv_feed(
    engine: &switchyard_workers::engine::EngineHandle,
) -> (
    tokio::sync::mpsc::UnboundedReceiver<kv_events::KvEvent>,
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
) {
    let (sink, events) = tokio::sync::mpsc::unbounded_channel();
    engine.subscribe_kv_events(sink);
    let (stop, stopped) = tokio::sync::oneshot::channel();
    (events, stop, stopped)
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(text: &str) -> Result<Device, String> {
        if text == "cpu" {
            return Ok(Device::Cpu);
        }
        let ordinal = text
            .strip_prefix("cuda:")
            .or_else(|| (text == "cuda").then_some("0"))
            .ok_or_else(|| format!("`{text}` is not a device; use `cpu` or `cuda:N`"))?;
        ordinal
            .parse()
            .map(Device::Cuda)
            .map_err(|_| format!("`{text}`: the CUDA device number must be a whole number"))
    }
}

fn main() -> std::process::ExitCode {
    switchyard_workers::binary::main("switchyard-llm", Some(2), run)
}

async fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    // Read before anything loads, so a missing token fails at once.
    let gateway_token = args.link.token()?;
    anyhow::ensure!(args.block_size > 0, "--block-size must be at least 1");
    anyhow::ensure!(
        args.max_num_batched_tokens > 0,
        "--max-num-batched-tokens must be at least 1"
    );
    anyhow::ensure!(args.max_num_seqs > 0, "--max-num-seqs must be at least 1");
    #[cfg(not(feature = "cuda"))]
    if let Device::Cuda(ordinal) = args.device {
        anyhow::bail!(
            "--device cuda:{ordinal}: this build has no CUDA backend; rebuild with \
             `cargo build -p switchyard-workers --features cuda`, or run with --device cpu"
        );
    }
    if let Some(threads) = args.threads {
        anyhow::ensure!(threads > 0, "--threads must be at least 1");
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .context("cannot size the compute thread pool")?;
    }

    let dir = args.model.clone();
    let (model, tokenizer) = tokio::task::spawn_blocking(move || Model::load_with_tokenizer(&dir))
        .await
        .context("the loading thread failed")??;
    let served = match &args.served_model_name {
        Some(name) => name.clone(),
        None => args
            .model
            .canonicalize()
            .ok()
            .and_then(|path| path.file_name().map(|name| name.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into()),
    };
    let block_bytes = llm::kv_block_bytes(&model, args.block_size, args.kv_cache_dtype);
    let num_blocks = args
        .num_gpu_blocks
        .unwrap_or_else(|| (args.kv_cache_mib << 20) / block_bytes.max(1));
    anyhow::ensure!(
        num_blocks > 0,
        "--kv-cache-mib {} holds no block of {} bytes; give more memory",
        args.kv_cache_mib,
        block_bytes
    );
    let eos_token_ids = model.config().eos_token_ids.clone();
    let config = model.config();
    tracing::info!(
        model = %args.model.display(),
        layers = config.num_layers,
        hidden = config.hidden_size,
        vocab = config.vocab_size,
        kv_blocks = num_blocks,
        kv_cache_mib = (num_blocks * block_bytes) >> 20,
        kv_cache_dtype = %args.kv_cache_dtype,
        "model loaded"
    );
    let engine_config = EngineConfig {
        block_size: args.block_size,
        num_gpu_blocks: num_blocks,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        enable_chunked_prefill: !args.no_chunked_prefill,
        enable_prefix_caching: !args.no_prefix_caching,
        speedup: 1.0,
    };
    let engine = match args.device {
        Device::Cpu => llm::spawn_cpu_engine_with(model, engine_config, args.kv_cache_dtype)
            .context("cannot start the engine thread")?,
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => llm::cuda::spawn_cuda_engine(&model, ordinal, engine_config, args.kv_cache_dtype)
            .with_context(|| format!("--device cuda:{ordinal}"))?,
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => unreachable!("refused above"),
    };
    let template = chat_template(&args)?;
    let encoder = PromptEncoder { tokenizer, template };
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr().context("cannot read the listening address")?;
    // The bound port, not `--port` (which may be 0), names the worker: its events, dumps and
    // registration must all carry the same name.
    let name = args.name.clone().unwrap_or_else(|| format!("worker-{}", addr.port()));
    anyhow::ensure!(
        kv_events::valid_worker_name(&name),
        "worker name `{name}` must be letters, digits, `-` and `_`"
    );
    let kv_log = args
        .link
        .gateway
        .as_ref()
        .map(|_| Arc::new(std::sync::Mutex::new(kv_events::EventLog::new(name.clone()))));
    let server = WorkerServer::start(
        listener,
        engine.clone(),
        ServerConfig {
            model: served.clone(),
            default_max_tokens: args.default_max_tokens,
            codec: TextCodec::Model(Arc::new(encoder)),
            eos_token_ids,
            metrics_prefix: "switchyard_worker".into(),
            owner: "switchyard-llm".into(),
            kv_log: kv_log.clone(),
            kv_transfer: KvTransferConfig {
                engine_id: Some(name.clone()),
                node: args.node.clone(),
                advertise_url: args.advertise_url.clone(),
                // The real size, which bounds the payloads a pull reads; the transfer takes the
                // time it takes (no simulated link).
                block_bytes: Some(block_bytes as u64),
                timeout: Duration::from_millis(args.kv_transfer_timeout_ms),
                ..KvTransferConfig::default()
            },
            ..ServerConfig::default()
        },
    )
    .context("cannot start the HTTP server")?;

    let registration = kv_events::Registration {
        worker: name,
        url: args.advertise_url.clone().unwrap_or_else(|| format!("http://{addr}")),
        model: served.clone(),
        role: args.role.announced(),
        block_size: args.block_size,
        capacity_blocks: num_blocks as u64,
        capabilities: vec!["text".into()],
        cost: args.cost,
        node: args.node.clone(),
        token_budgets: Vec::new(),
        spot: false,
        preempting: false,
        heartbeat_ms: args.heartbeat_ms.max(1),
        last_event_id: 0,
    };
    let mut link = None;
    if let Some(url) = &args.nats {
        let client = async_nats::connect(url.as_str())
            .await
            .with_context(|| format!("cannot connect to NATS at `{url}`"))?;
        let (events, stop, stopped) = kv_feed(&engine);
        let config = kv_link::LinkConfig {
            subjects: kv_events::Subjects::new(args.subject_prefix.clone()),
            registration,
            drop_every: None,
            preempting: None,
        };
        let task = tokio::spawn(async move {
            if let Err(err) = kv_link::run(client, config, events, stopped).await {
                tracing::error!(error = %err, "the NATS link stopped");
            }
        });
        link = Some((stop, task));
    } else if let (Some(url), Some(token), Some(log)) = (&args.link.gateway, &gateway_token, &kv_log) {
        let (events, stop, stopped) = kv_feed(&engine);
        let config = gateway_link::GatewayLinkConfig {
            admin_url: url.clone(),
            token: token.clone(),
            registration,
        };
        link = Some((
            stop,
            tokio::spawn(gateway_link::run(config, log.clone(), events, stopped)),
        ));
    }
    // Listen for signals before saying ready, so a supervisor's SIGTERM is never the default
    // (abrupt) one.
    let shutdown = shutdown_signal().context("cannot listen for SIGINT and SIGTERM")?;
    println!("worker listening on http://{addr}");
    println!(
        "worker ready: model `{served}` on {:?}, role {}",
        args.device,
        args.role.announced()
    );

    shutdown.await;
    tracing::info!(in_flight = server.in_flight(), "shutting down: leaving, then draining");
    // Leave first (NATS or the gateway link), so the gateway stops sending new requests while
    // the old ones finish.
    if let Some((stop, task)) = link {
        let _ = stop.send(());
        let _ = task.await;
    }
    let left = server.shutdown(Duration::from_secs(args.drain_timeout_s)).await;
    if left > 0 {
        tracing::warn!(left, "drain timeout: requests still running are cut off");
    } else {
        tracing::info!("every request finished");
    }
    Ok(())
}
