//! `switchyard-bench`: benchmark programs that print figures measured side by side in one run.
//!
//! - `overhead`: the gateway's added latency, throughput and CPU per request against a mocker
//!   reached directly and, with `--nginx`, against nginx as a TLS reverse proxy.
//! - `replay`: replays a Mooncake-format trace against a running gateway, open loop, and writes
//!   one JSON line per request plus a summary table.
//! - `synth`: derives a new trace from a trace's prefix tree and distributions, with knobs;
//!   `--image-share`, `--audio-share`, `--video-share` and `--media-repeat` make it multimodal.
//! - `compare`: starts a gateway with mockers per policy, replays a trace under each, and
//!   writes a Markdown report with plots.
//! - `planner`: the planner's fleets (load-based, sla-based, fixed at the minimum and the
//!   maximum) against an Azure arrival trace, side by side.
//! - `profile`: one worker's request rate within a TTFT target at given prompt and output
//!   lengths, printed as the `[[planner.pools]] profile` `sla-based` reads.
//! - `chaos`: a trace replayed while engines are killed or reclaimed, with and without stream
//!   migration, against the fault-free run.
//!
//! Build the binaries first: `cargo build --release --workspace --bins`.

mod chaos;
mod cpu;
mod nginx;
mod overhead;
mod planner;
mod profile;
mod target;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use switchyard_bench::compare::{self, CompareConfig, MockerSettings, PolicySpec};
use switchyard_bench::replay::{self, ReplayOptions, Summary};
use switchyard_bench::stats;
use switchyard_bench::synth::{SynthConfig, Synthesizer};
use switchyard_bench::trace::{self, TraceRequest};
use switchyard_bench::workload::{self, MediaMix};

#[derive(Debug, Parser)]
#[command(name = "switchyard-bench", version, about = "Switchyard benchmark programs")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Gateway overhead: TTFB through the gateway vs directly to the same mocker, and req/s.
    Overhead(overhead::OverheadArgs),
    /// Replay a trace against a running gateway: per-request JSON lines and a summary table.
    Replay(ReplayArgs),
    /// Learn a trace's prefix tree and distributions, and write a new trace sampled from them.
    Synth(SynthArgs),
    /// Replay a trace once per policy on fresh gateways and mockers; write a Markdown report
    /// with tables and plots.
    Compare(CompareArgs),
    /// The planner against a load that rises and falls: load-based, sla-based and fixed fleets
    /// side by side (attainment, worker-seconds, time to the first scale-up).
    Planner(planner::PlannerArgs),
    /// One worker's request rate within a TTFT target at prompt/output lengths: the profile
    /// the `sla-based` planner reads.
    Profile(profile::ProfileArgs),
    /// A trace replayed while engines are killed or reclaimed, with and without stream
    /// migration, against the fault-free run: errors, tokens lost or repeated, latency.
    Chaos(chaos::ChaosArgs),
}

/// Which part of a trace to replay, and how fast.
#[derive(Debug, Clone, clap::Args)]
struct TraceArgs {
    /// Mooncake-format trace: JSON lines of `timestamp` (ms), `input_length`, `output_length`,
    /// `hash_ids`.
    trace: PathBuf,
    /// Prompt tokens each hash id stands for (512 in Mooncake's traces). With the gateway's
    /// byte-level fallback tokenizer one token is one byte of prompt text.
    #[arg(long, default_value_t = 512)]
    block_tokens: usize,
    /// Skip the requests that arrive before this many milliseconds into the trace.
    #[arg(long, default_value_t = 0)]
    start_ms: u64,
    /// Replay only the requests arriving within this many milliseconds after --start-ms.
    #[arg(long)]
    duration_ms: Option<u64>,
    /// Replay at most this many requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Arrival speed-up: 4 sends the trace's requests four times as fast (open loop: a slow
    /// server never delays an arrival).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
}

impl TraceArgs {
    fn load(&self) -> anyhow::Result<Vec<TraceRequest>> {
        anyhow::ensure!(self.block_tokens > 0, "--block-tokens must be at least 1");
        anyhow::ensure!(
            self.speedup.is_finite() && self.speedup > 0.0,
            "--speedup must be a positive number"
        );
        let all = trace::read_trace(&self.trace)?;
        let kept = trace::window(&all, self.start_ms, self.duration_ms, self.max_requests);
        anyhow::ensure!(
            !kept.is_empty(),
            "no request of {} falls in the chosen window",
            self.trace.display()
        );
        Ok(kept)
    }
}

#[derive(Debug, clap::Args)]
struct ReplayArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// The gateway: `https://HOST:PORT` (TLS) or `http://HOST:PORT`.
    #[arg(long, default_value = "https://127.0.0.1:8443")]
    url: String,
    /// PEM file of the CA (or self-signed certificate) to trust for the gateway's certificate.
    #[arg(long)]
    ca_cert: Option<PathBuf>,
    /// Accept any server certificate (still encrypted): for a dev gateway's generated one.
    #[arg(long)]
    insecure: bool,
    /// Model named in the requests.
    #[arg(long, default_value = "mock")]
    model: String,
    /// Write one JSON line per request here.
    #[arg(long, default_value = "replay.jsonl")]
    output: PathBuf,
    /// Also write the summary as JSON here.
    #[arg(long)]
    summary_json: Option<PathBuf>,
    /// A request unanswered after this many seconds is recorded as failed.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Do not draw the progress bar.
    #[arg(long)]
    no_progress: bool,
}

#[derive(Debug, clap::Args)]
struct SynthArgs {
    /// The source trace (Mooncake format).
    trace: PathBuf,
    /// Write the synthesized trace here.
    #[arg(long, short)]
    output: PathBuf,
    /// Prompt tokens each hash id stands for.
    #[arg(long, default_value_t = 512)]
    block_tokens: usize,
    /// Requests to generate (default: as many as the source).
    #[arg(long)]
    num_requests: Option<usize>,
    /// Scales the length of shared prefixes.
    #[arg(long, default_value_t = 1.0)]
    prefix_len_multiplier: f64,
    /// Makes N independent copies of the prefix tree (N times fewer shared hits).
    #[arg(long, default_value_t = 1)]
    prefix_root_multiplier: usize,
    /// Scales the unique (non-shared) part of prompts.
    #[arg(long, default_value_t = 1.0)]
    prompt_len_multiplier: f64,
    /// Scales output lengths.
    #[arg(long, default_value_t = 1.0)]
    osl_multiplier: f64,
    /// Divides inter-arrival times (2 = twice the request rate).
    #[arg(long, default_value_t = 1.0)]
    speedup_ratio: f64,
    /// Random seed; the same seed gives the same trace.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Share of requests that carry one image (a multimodal workload), in [0, 1].
    #[arg(long, default_value_t = 0.0)]
    image_share: f64,
    /// Share of requests that carry one audio clip.
    #[arg(long, default_value_t = 0.0)]
    audio_share: f64,
    /// Share of requests that carry one video.
    #[arg(long, default_value_t = 0.0)]
    video_share: f64,
    /// Probability that a media item repeats an earlier one of its kind (same bytes).
    #[arg(long, default_value_t = 0.0)]
    media_repeat: f64,
    /// Image sides in pixels to draw from.
    #[arg(long, value_delimiter = ',', default_values_t = [224u32, 336, 448])]
    image_sides: Vec<u32>,
    /// Audio lengths in seconds, drawn uniformly from MIN..=MAX.
    #[arg(long, value_parser = parse_range, default_value = "2..15")]
    audio_seconds: (u32, u32),
    /// Video lengths in seconds, drawn uniformly from MIN..=MAX.
    #[arg(long, value_parser = parse_range, default_value = "2..8")]
    video_seconds: (u32, u32),
}

/// `MIN..MAX` (inclusive) as a pair.
fn parse_range(text: &str) -> Result<(u32, u32), String> {
    let (min, max) = text
        .split_once("..")
        .ok_or_else(|| format!("`{text}` is not MIN..MAX"))?;
    let parse = |part: &str| part.trim().parse::<u32>().map_err(|err| format!("`{part}`: {err}"));
    Ok((parse(min)?, parse(max)?))
}

#[derive(Debug, clap::Args)]
struct CompareArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// LLM workers (embedded mockers) behind the gateway.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Router policies to compare, comma-separated: built-in names or paths to `.wasm` files,
    /// each optionally with settings for its `[policy.config]`: `ROUTER:KEY=VALUE:KEY=VALUE`
    /// (values in TOML, e.g. `predicted-ttft:decode_weight=0.2`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,least-load,kv-aware,predicted-ttft"
    )]
    policies: Vec<String>,
    /// Replay every policy this many times (in rounds, policies in turn) and pool the requests
    /// of all rounds in the figures; the report also lists each round's TTFT.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Folder for report.md, plots, per-request records and metrics.
    #[arg(long, default_value = "bench-report")]
    out: PathBuf,
    /// Model name of the mockers and the requests.
    #[arg(long, default_value = "mock")]
    model: String,
    /// Mocker time runs this many times faster than the perf model. Load relative to capacity
    /// is set by --speedup / --mocker-speedup.
    #[arg(long, default_value_t = 1.0)]
    mocker_speedup: f64,
    /// Tokens per KV block in the mockers (and the gateway's block hashes).
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// KV blocks per mocker.
    #[arg(long, default_value_t = 16_384)]
    num_gpu_blocks: usize,
    /// Token budget of one mocker step.
    #[arg(long, default_value_t = 8_192)]
    max_num_batched_tokens: usize,
    /// Most sequences running at once per mocker.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// A request unanswered after this many seconds is recorded as failed.
    #[arg(long, default_value_t = 900)]
    timeout_s: u64,
    /// Do not draw progress bars.
    #[arg(long)]
    no_progress: bool,
    /// Embedded vision encoders (images, video) in each run.
    #[arg(long, default_value_t = 1)]
    vision_encoders: usize,
    /// Embedded audio encoders in each run.
    #[arg(long, default_value_t = 1)]
    audio_encoders: usize,
    /// Multiplies the embedded encoders' measured encode times (slower encoders).
    #[arg(long, default_value_t = 1.0)]
    encoder_cost_scale: f64,
    /// CPU time one policy call may take (the gateway's `policy.deadline_ms`): the peers'
    /// routers (`peer-*`) update their own prefix index in the call, which on long prompts
    /// can take more than the default 1 ms.
    #[arg(long, default_value_t = 1)]
    policy_deadline_ms: u64,
    /// Spot engines beside --workers: slower and cheaper (a mixed fleet for cost-aware routing).
    #[arg(long, default_value_t = 0)]
    spot_workers: usize,
    /// A spot engine's speed relative to a regular one.
    #[arg(long, default_value_t = 0.4)]
    spot_speed: f64,
    /// A spot engine's cost per token (regular ones cost 1).
    #[arg(long, default_value_t = 0.4)]
    spot_cost: f64,
    /// Every request's TTFT target in milliseconds (sent as `x-switchyard-ttft-ms`); the
    /// report then gives each policy's attainment.
    #[arg(long)]
    ttft_target_ms: Option<f64>,
    /// Goodput's TTFT target in milliseconds (with --goodput-itl-ms): the report then gives
    /// each policy's requests per second that met both.
    #[arg(long, requires = "goodput_itl_ms")]
    goodput_ttft_ms: Option<f64>,
    /// Goodput's mean inter-token latency target in milliseconds (with --goodput-ttft-ms).
    #[arg(long, requires = "goodput_ttft_ms")]
    goodput_itl_ms: Option<f64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    match args.command {
        Command::Overhead(args) => overhead::overhead(args).await,
        Command::Replay(args) => replay_command(args).await,
        Command::Synth(args) => synth_command(&args),
        Command::Compare(args) => compare_command(args).await,
        Command::Planner(args) => planner::run(args).await,
        Command::Profile(args) => profile::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
    }
}

async fn replay_command(args: ReplayArgs) -> anyhow::Result<()> {
    let requests = args.trace.load()?;
    let client = target::client(&args.url, args.ca_cert.as_deref(), args.insecure).await?;
    let options = ReplayOptions {
        model: args.model.clone(),
        block_tokens: args.trace.block_tokens,
        speedup: args.trace.speedup,
        request_timeout: Duration::from_secs(args.timeout_s),
        progress: !args.no_progress,
        ttft_target_ms: None,
        keep_text: false,
    };
    eprintln!(
        "replaying {} requests of {} against {} at {}× speed",
        requests.len(),
        args.trace.trace.display(),
        args.url,
        args.trace.speedup
    );
    let run = replay::replay(&client, &requests, &options).await?;
    replay::write_records(&args.output, &run.records)?;
    let summary = Summary::of(&run);
    if let Some(path) = &args.summary_json {
        std::fs::write(path, serde_json::to_vec_pretty(&summary)?)?;
    }
    println!("# switchyard-bench replay");
    println!();
    println!(
        "trace {} ({} requests from {} ms, {}× speed, {} tokens per hash id) against {}",
        args.trace.trace.display(),
        requests.len(),
        args.trace.start_ms,
        args.trace.speedup,
        args.trace.block_tokens,
        args.url
    );
    println!();
    print!("{}", summary.to_markdown());
    println!();
    println!("per-request records: {}", args.output.display());
    anyhow::ensure!(
        summary.succeeded > 0,
        "no request was answered: {}",
        summary.errors.join("; ")
    );
    Ok(())
}

fn synth_command(args: &SynthArgs) -> anyhow::Result<()> {
    let source = trace::read_trace(&args.trace)?;
    let synthesizer = Synthesizer::learn(&source, args.block_tokens)?;
    let config = SynthConfig {
        prefix_len_multiplier: args.prefix_len_multiplier,
        prefix_root_multiplier: args.prefix_root_multiplier,
        prompt_len_multiplier: args.prompt_len_multiplier,
        osl_multiplier: args.osl_multiplier,
        speedup_ratio: args.speedup_ratio,
        num_requests: args.num_requests,
        seed: args.seed,
        block_tokens: args.block_tokens,
    };
    let mut synthesized = synthesizer.generate(&config)?;
    let mix = MediaMix {
        image_share: args.image_share,
        audio_share: args.audio_share,
        video_share: args.video_share,
        repeat_rate: args.media_repeat,
        image_sides: args.image_sides.clone(),
        audio_seconds: args.audio_seconds,
        video_seconds: args.video_seconds,
        seed: args.seed,
    };
    if !mix.is_empty() {
        workload::add_media(&mut synthesized, &mix)?;
    }
    trace::write_trace(&args.output, &synthesized)?;
    println!("# switchyard-bench synth\n");
    println!(
        "source: {}; synthesized: {}\n",
        args.trace.display(),
        args.output.display()
    );
    let source_stats = stats::trace_stats(&source, args.block_tokens);
    let synthesized_stats = stats::trace_stats(&synthesized, args.block_tokens);
    print!(
        "{}",
        stats::markdown_table(&[("source", &source_stats), ("synthesized", &synthesized_stats)])
    );
    if !mix.is_empty() {
        let items: Vec<_> = synthesized.iter().flat_map(|r| &r.media).collect();
        let distinct: std::collections::HashSet<(u64, u8)> = items.iter().map(|m| (m.id, m.kind as u8)).collect();
        println!();
        for modality in ["text", "image", "audio", "video"] {
            let count = synthesized.iter().filter(|r| r.modality() == modality).count();
            println!("{modality}: {count} requests");
        }
        println!(
            "media items: {}, distinct: {} ({:.1} % repeats)",
            items.len(),
            distinct.len(),
            100.0 * (1.0 - distinct.len() as f64 / items.len().max(1) as f64)
        );
    }
    Ok(())
}

async fn compare_command(args: CompareArgs) -> anyhow::Result<()> {
    let requests = args.trace.load()?;
    let window = match (args.trace.duration_ms, args.trace.max_requests) {
        (None, None) if args.trace.start_ms == 0 => String::new(),
        _ => format!(
            ", from {} s{}{}",
            args.trace.start_ms / 1000,
            args.trace
                .duration_ms
                .map_or(String::new(), |d| format!(" for {} s", d / 1000)),
            args.trace
                .max_requests
                .map_or(String::new(), |n| format!(", first {n} requests"))
        ),
    };
    let config = CompareConfig {
        trace_label: format!("{}{window}", args.trace.trace.display()),
        requests,
        workers: args.workers,
        policies: args
            .policies
            .iter()
            .map(|p| PolicySpec::parse(p))
            .collect::<anyhow::Result<_>>()?,
        replay: ReplayOptions {
            model: args.model.clone(),
            block_tokens: args.trace.block_tokens,
            speedup: args.trace.speedup,
            request_timeout: Duration::from_secs(args.timeout_s),
            progress: !args.no_progress,
            ttft_target_ms: args.ttft_target_ms,
            keep_text: false,
        },
        mocker: MockerSettings {
            speedup: args.mocker_speedup,
            block_size: args.block_size,
            num_gpu_blocks: args.num_gpu_blocks,
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_num_seqs: args.max_num_seqs,
            spot_workers: args.spot_workers,
            spot_speed: args.spot_speed,
            spot_cost: args.spot_cost,
        },
        out_dir: args.out.clone(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        repeats: args.repeat as usize,
        vision_encoders: args.vision_encoders,
        audio_encoders: args.audio_encoders,
        encoder_cost_scale: args.encoder_cost_scale,
        policy_deadline_ms: args.policy_deadline_ms,
        goodput: args
            .goodput_ttft_ms
            .zip(args.goodput_itl_ms)
            .map(|(ttft_ms, itl_ms)| compare::GoodputTargets { ttft_ms, itl_ms }),
    };
    let runs = compare::compare(&config).await?;
    print!("{}", compare::render_report(&config, &runs));
    println!("report: {}", args.out.join("report.md").display());
    Ok(())
}
