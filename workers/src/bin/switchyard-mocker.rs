//! `switchyard-mocker`: runs N simulated engines (or encoders) in one process, one HTTP port
//! each.

use std::net::IpAddr;

use anyhow::Context;
use clap::Parser;
use switchyard_protocol::kv_events;
use switchyard_workers::encoder::{self, EncoderConfig};
use switchyard_workers::kv_link;
use switchyard_workers::mocker::{self, EngineConfig, KvTransferConfig, ServerConfig};
use switchyard_workers::shutdown::shutdown_signal;

/// What the mocker simulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum MockRole {
    /// LLM workers (the default).
    Llm,
    /// LLM workers announced as prefill workers (prefill/decode disaggregation): they compute
    /// prompts whose KV blocks decode workers pull.
    Prefill,
    /// LLM workers announced as decode workers: they pull a prompt's KV blocks from the
    /// prefill worker a request names, or prefill themselves.
    Decode,
    /// Encoders of the modality `--encodes` names.
    Encoder,
    /// Vision encoders (images and video frames).
    Vision,
    /// Audio encoders.
    Audio,
}

/// Simulated LLM workers speaking the OpenAI API (timing from Dynamo's fitted perf model), or
/// simulated vision/audio encoders (timing from measured encoder curves).
#[derive(Debug, Parser)]
#[command(name = "switchyard-mocker", version)]
struct Args {
    /// What to run: `llm` workers (or the same announced as `prefill` or `decode` workers), or
    /// `encoder`s (of `--encodes`; `vision` and `audio` name the modality directly). Every LLM
    /// worker serves both sides of prefill/decode disaggregation; the role is what it
    /// announces.
    #[arg(long, value_enum, default_value_t = MockRole::Llm)]
    role: MockRole,
    /// Encoders: the modality they encode, `vision` or `audio`.
    #[arg(long, default_value = "vision")]
    encodes: String,
    /// Encoders: width of a feature row in the features they push.
    #[arg(long, default_value_t = 64)]
    feature_dim: usize,
    /// Encoders: feature cache size in MiB.
    #[arg(long, default_value_t = 1024)]
    feature_cache_mib: u64,
    /// Multiplies every encode time of the measured curves (encoders, and LLM workers
    /// encoding media themselves).
    #[arg(long, default_value_t = 1.0)]
    cost_scale: f64,
    /// Encoders: the token budgets they batch to (comma-separated, ascending).
    #[arg(long, value_delimiter = ',', default_values_t = [576u32, 2304, 4608, 9216, 18432])]
    token_budgets: Vec<u32>,
    /// Fault injection: every N-th encoded item fails (encoders), every N-th generation request
    /// is answered 500 while `/healthz` stays 200 (LLM workers).
    #[arg(long)]
    fail_every: Option<u64>,
    /// Encoders, fault injection: videos with more frames than this run out of memory.
    #[arg(long)]
    oom_above_frames: Option<u32>,
    /// The machine name announced in registrations (same-node transfers are faster).
    #[arg(long, default_value = "")]
    node: String,
    /// Bytes of one KV block, what pulling it from a prefill worker moves (default: Llama-3-8B
    /// at f16, 128 KiB per token × --block-size).
    #[arg(long)]
    kv_block_bytes: Option<u64>,
    /// GB/s (10⁹ bytes) of KV transfers between workers of the same --node (NVLink-class).
    #[arg(long, default_value_t = 300.0)]
    kv_link_local_gbps: f64,
    /// GB/s of KV transfers between nodes (25: 200 Gb/s RDMA).
    #[arg(long, default_value_t = 25.0)]
    kv_link_remote_gbps: f64,
    /// How long (real time) a decode worker waits for a prefill worker's blocks before it
    /// prefills the prompt itself.
    #[arg(long, default_value_t = 2000)]
    kv_transfer_timeout_ms: u64,
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
    /// Relative cost of a token, announced in registrations (spot < reserved).
    #[arg(long, default_value_t = 1.0)]
    cost: f64,
    /// Announce the engines as spot (preemptible) capacity.
    #[arg(long)]
    spot: bool,
    /// Simulate spot preemption (implies `--spot`): this many seconds after start the process
    /// is reclaimed — it exits at once, as a reclaimed VM does, dropping every connection.
    #[arg(long)]
    spot_lifetime_s: Option<f64>,
    /// How long before the reclaim its notice comes: the engines announce `preempting` (NATS
    /// mode) and `/healthz` answers 503, so gateways stop routing to them while requests in
    /// flight finish. 0: no notice.
    #[arg(long, default_value_t = 2.0)]
    spot_notice_s: f64,
}

/// When the reclaim notice comes and when the process is reclaimed, from start.
fn spot_schedule(args: &Args) -> anyhow::Result<Option<(std::time::Duration, std::time::Duration)>> {
    let Some(lifetime) = args.spot_lifetime_s else {
        return Ok(None);
    };
    anyhow::ensure!(
        lifetime.is_finite() && lifetime > 0.0,
        "--spot-lifetime-s must be a positive number of seconds, got {lifetime}"
    );
    anyhow::ensure!(
        args.spot_notice_s.is_finite() && args.spot_notice_s >= 0.0,
        "--spot-notice-s must be a number of seconds of at least 0, got {}",
        args.spot_notice_s
    );
    let notice = (lifetime - args.spot_notice_s).max(0.0);
    Ok(Some((
        std::time::Duration::from_secs_f64(notice),
        std::time::Duration::from_secs_f64(lifetime),
    )))
}

fn main() -> std::process::ExitCode {
    switchyard_workers::binary::main("switchyard-mocker", None, run)
}

async fn run() -> anyhow::Result<()> {
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
    anyhow::ensure!(
        args.cost.is_finite() && args.cost >= 0.0,
        "--cost must be a number of at least 0, got {}",
        args.cost
    );
    let role = match args.role {
        MockRole::Llm => switchyard_protocol::Role::Llm,
        MockRole::Prefill => switchyard_protocol::Role::Prefill,
        MockRole::Decode => switchyard_protocol::Role::Decode,
        MockRole::Encoder | MockRole::Vision | MockRole::Audio => {
            anyhow::ensure!(
                args.spot_lifetime_s.is_none(),
                "--spot-lifetime-s simulates preemption of LLM engines only"
            );
            return run_encoders(args).await;
        }
    };
    for (flag, gbps) in [
        ("--kv-link-local-gbps", args.kv_link_local_gbps),
        ("--kv-link-remote-gbps", args.kv_link_remote_gbps),
    ] {
        anyhow::ensure!(
            gbps.is_finite() && gbps > 0.0,
            "{flag} must be a positive number of GB/s, got {gbps}"
        );
    }
    let spot_schedule = spot_schedule(&args)?;
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
        // LLM workers that encode media themselves take the same cost scale as encoders.
        local_encode_scale: args.cost_scale,
        fail_every: args.fail_every,
        kv_transfer: KvTransferConfig {
            node: args.node.clone(),
            block_bytes: args.kv_block_bytes,
            local_gbps: args.kv_link_local_gbps,
            remote_gbps: args.kv_link_remote_gbps,
            timeout: std::time::Duration::from_millis(args.kv_transfer_timeout_ms),
            ..KvTransferConfig::default()
        },
        ..ServerConfig::default()
    };
    // Bound one by one, so that each knows its name (the port may be picked by the kernel)
    // before it answers as a prefill worker.
    let mut fleet = Vec::with_capacity(args.num_workers);
    let mut names = Vec::with_capacity(args.num_workers);
    for index in 0..args.num_workers {
        let port = mocker::fleet_port(args.port, index)?;
        let listener = tokio::net::TcpListener::bind(std::net::SocketAddr::new(args.host, port))
            .await
            .with_context(|| format!("could not bind the mocker port {}:{port}", args.host))?;
        let addr = listener.local_addr().context("cannot read the listening address")?;
        let name = match &args.name {
            Some(prefix) => format!("{prefix}-{index}"),
            None => format!("mocker-{}", addr.port()),
        };
        anyhow::ensure!(
            kv_events::valid_worker_name(&name),
            "worker name `{name}` must be letters, digits, `-` and `_`"
        );
        let server = ServerConfig {
            kv_transfer: KvTransferConfig {
                engine_id: Some(name.clone()),
                ..server.kv_transfer.clone()
            },
            ..server.clone()
        };
        fleet.push(
            mocker::WorkerServer::start(listener, mocker::spawn_engine(engine.clone()), server)
                .context("could not start a mocker")?,
        );
        names.push(name);
    }
    let (notice_sender, notice) = tokio::sync::watch::channel(false);
    let mut links = Vec::new();
    if let Some(url) = &args.nats {
        let client = async_nats::connect(url.as_str())
            .await
            .with_context(|| format!("cannot connect to NATS at `{url}`"))?;
        for (worker, name) in fleet.iter().zip(&names) {
            let name = name.clone();
            let (sink, events) = tokio::sync::mpsc::unbounded_channel();
            worker.engine().subscribe_kv_events(sink);
            let (stop, stopped) = tokio::sync::oneshot::channel();
            let config = kv_link::LinkConfig {
                subjects: kv_events::Subjects::new(args.subject_prefix.clone()),
                registration: kv_events::Registration {
                    worker: name,
                    url: format!("http://{}", worker.addr()),
                    model: args.model.clone(),
                    role,
                    block_size: args.block_size,
                    capacity_blocks: args.num_gpu_blocks as u64,
                    capabilities: vec!["text".into()],
                    cost: args.cost,
                    node: args.node.clone(),
                    token_budgets: Vec::new(),
                    spot: args.spot || spot_schedule.is_some(),
                    preempting: false,
                    heartbeat_ms: args.heartbeat_ms.max(1),
                    last_event_id: 0,
                },
                drop_every: args.drop_kv_event_every,
                preempting: Some(notice.clone()),
            };
            let task = tokio::spawn(kv_link::run(client.clone(), config, events, stopped));
            links.push((stop, task));
        }
    }
    for (index, worker) in fleet.iter().enumerate() {
        println!("mocker {index} listening on http://{}", worker.addr());
    }
    // Installed before the ready line, so a supervisor's SIGTERM is never the abrupt default.
    let stop_signal = shutdown_signal().context("cannot install the signal handlers")?;
    println!("mocker ready: {} worker(s), model `{}`", fleet.len(), args.model);
    match spot_schedule {
        Some((notice_at, reclaim_at)) => {
            let started = tokio::time::Instant::now();
            tokio::select! {
                () = stop_signal => {}
                () = reclaim(started, notice_at, reclaim_at, &fleet, &notice_sender) => {}
            }
        }
        None => stop_signal.await,
    }
    // Graceful: leave routing first (gateways stop sending at once), then let the streams in
    // flight finish before exiting.
    for (stop, task) in links {
        let _ = stop.send(());
        let _ = task.await;
    }
    let in_flight: u64 = fleet.iter().map(|w| w.in_flight()).sum();
    if in_flight > 0 {
        tracing::info!(in_flight, "draining the requests in flight");
    }
    let mut left = 0;
    for worker in fleet {
        left += worker.shutdown(DRAIN_TIMEOUT).await;
    }
    if left > 0 {
        tracing::warn!(left, "stopped with requests still running after {DRAIN_TIMEOUT:?}");
    }
    Ok(())
}

/// How long a stopping mocker waits for its requests in flight.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Plays a spot reclaim: at `notice_at` the engines announce `preempting` and fail their
/// health checks; at `reclaim_at` the process exits at once, without a goodbye, as a reclaimed
/// machine does (connections drop; gateways notice from the missing heartbeats).
async fn reclaim(
    started: tokio::time::Instant,
    notice_at: std::time::Duration,
    reclaim_at: std::time::Duration,
    fleet: &[mocker::WorkerServer],
    notice: &tokio::sync::watch::Sender<bool>,
) {
    if notice_at < reclaim_at {
        tokio::time::sleep_until(started + notice_at).await;
        tracing::warn!(
            in_flight = fleet.iter().map(|w| w.in_flight()).sum::<u64>(),
            "spot reclaim notice"
        );
        println!(
            "mocker preempting: reclaimed in {:.1} s",
            (reclaim_at - notice_at).as_secs_f64()
        );
        for worker in fleet {
            worker.mark_preempting();
        }
        notice.send_replace(true);
    }
    tokio::time::sleep_until(started + reclaim_at).await;
    let in_flight: u64 = fleet.iter().map(|w| w.in_flight()).sum();
    tracing::warn!(in_flight, "spot reclaimed: exiting now");
    println!("mocker reclaimed with {in_flight} request(s) in flight");
    std::process::exit(137);
}

/// Runs simulated encoders until ctrl-c.
async fn run_encoders(args: Args) -> anyhow::Result<()> {
    let role = match (args.role, args.encodes.as_str()) {
        (MockRole::Vision, _) | (MockRole::Encoder, "vision") => switchyard_protocol::Role::Vision,
        (MockRole::Audio, _) | (MockRole::Encoder, "audio") => switchyard_protocol::Role::Audio,
        (_, other) => anyhow::bail!("--encodes must be `vision` or `audio`, not `{other}`"),
    };
    anyhow::ensure!(args.feature_dim > 0, "--feature-dim must be at least 1");
    anyhow::ensure!(
        args.cost_scale.is_finite() && args.cost_scale >= 0.0,
        "--cost-scale must be a non-negative number"
    );
    anyhow::ensure!(
        args.speedup.is_finite() && args.speedup > 0.0,
        "--speedup must be a positive number"
    );
    let config = EncoderConfig {
        role,
        model: args.model.clone(),
        feature_dim: args.feature_dim,
        cache_bytes: args.feature_cache_mib << 20,
        cost_scale: args.cost_scale,
        speedup: args.speedup,
        token_budgets: args.token_budgets.clone(),
        fail_every: args.fail_every,
        oom_above_frames: args.oom_above_frames,
        ..EncoderConfig::default()
    };
    let encoders = encoder::spawn_encoders(args.num_workers, args.host, args.port, &config)
        .await
        .context("could not bind the encoder ports")?;
    let mut links = Vec::new();
    if let Some(url) = &args.nats {
        let client = async_nats::connect(url.as_str())
            .await
            .with_context(|| format!("cannot connect to NATS at `{url}`"))?;
        for (index, server) in encoders.iter().enumerate() {
            let name = match &args.name {
                Some(prefix) => format!("{prefix}-{index}"),
                None => format!("encoder-{}", server.addr().port()),
            };
            anyhow::ensure!(
                kv_events::valid_worker_name(&name),
                "worker name `{name}` must be letters, digits, `-` and `_`"
            );
            let (sink, events) = tokio::sync::mpsc::unbounded_channel();
            server.subscribe_kv_events(sink);
            let (stop, stopped) = tokio::sync::oneshot::channel();
            let capabilities = match role {
                switchyard_protocol::Role::Audio => vec!["audio".into()],
                _ => vec!["image".into(), "video".into()],
            };
            let link = kv_link::LinkConfig {
                subjects: kv_events::Subjects::new(args.subject_prefix.clone()),
                registration: kv_events::Registration {
                    worker: name,
                    url: format!("http://{}", server.addr()),
                    model: args.model.clone(),
                    role,
                    // One cached media item per announced block.
                    block_size: 1,
                    capacity_blocks: 0,
                    capabilities,
                    cost: args.cost,
                    node: args.node.clone(),
                    token_budgets: args.token_budgets.clone(),
                    spot: args.spot,
                    preempting: false,
                    heartbeat_ms: args.heartbeat_ms.max(1),
                    last_event_id: 0,
                },
                drop_every: None,
                preempting: None,
            };
            let task = tokio::spawn(kv_link::run(client.clone(), link, events, stopped));
            links.push((stop, task));
        }
    }
    for (index, server) in encoders.iter().enumerate() {
        println!("encoder {index} ({role}) listening on http://{}", server.addr());
    }
    println!(
        "mocker ready: {} {role} encoder(s), model `{}`",
        encoders.len(),
        args.model
    );
    tokio::signal::ctrl_c().await.context("waiting for ctrl-c")?;
    for (stop, task) in links {
        let _ = stop.send(());
        let _ = task.await;
    }
    Ok(())
}
