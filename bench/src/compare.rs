//! The experiment runner: one trace, one fleet size, several router policies, one report.
//!
//! For every policy it starts a fresh `switchyard` gateway (TLS with a throwaway CA) whose
//! embedded mockers are the workers, so each policy meets cold caches and idle engines; replays
//! the same requests on the same schedule; keeps the per-request records and the gateway's
//! final metrics; and stops the gateway. Then it writes `report.md` with the figures, ratios to
//! the baseline policy (round-robin when compared), and SVG plots: TTFT CDF per policy, latency
//! bars, and requests in flight per worker over time for each policy.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::plots;
use crate::replay::{self, ReplayOptions, ReplayRun, Summary};
use crate::trace::TraceRequest;
use switchyard_harness::{Alpn, Client, Gateway, TestCa};

/// The simulated engines behind the gateway (its `[embedded_mockers]` table).
#[derive(Debug, Clone)]
pub struct MockerSettings {
    /// Simulated time runs this many times faster than the perf model.
    pub speedup: f64,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks per engine.
    pub num_gpu_blocks: usize,
    /// Token budget of one engine step.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once per engine.
    pub max_num_seqs: usize,
    /// Spot engines beside the regular ones: slower and cheaper (`embedded_mockers.spot_*`).
    pub spot_workers: usize,
    /// A spot engine's speed relative to a regular one.
    pub spot_speed: f64,
    /// A spot engine's cost per token (regular ones cost 1).
    pub spot_cost: f64,
}

impl Default for MockerSettings {
    fn default() -> MockerSettings {
        MockerSettings {
            speedup: 1.0,
            block_size: 64,
            num_gpu_blocks: 16_384,
            max_num_batched_tokens: 8_192,
            max_num_seqs: 256,
            spot_workers: 0,
            spot_speed: 0.4,
            spot_cost: 0.4,
        }
    }
}

/// One policy to compare: a built-in name or a path to a `.wasm` component, with optional
/// settings for its `[policy.config]`.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// The name in the report.
    pub name: String,
    /// What the gateway's `policy.router` is set to.
    pub router: String,
    /// The policy's own settings (`[policy.config]`), empty for its defaults.
    pub settings: toml::Table,
}

impl PolicySpec {
    /// Parses `ROUTER[:KEY=VALUE]...`: a built-in name or a path ending in `.wasm` (named after
    /// its file stem), then settings whose values are TOML values (`decode_weight=0.2`,
    /// `mode="fast"`). A spec with settings is named by the whole text, so that variants of one
    /// policy stay apart in the report.
    ///
    /// # Errors
    ///
    /// Fails on an empty router or a setting that is not `KEY=VALUE` with a TOML value.
    pub fn parse(text: &str) -> anyhow::Result<PolicySpec> {
        let text = text.trim();
        let mut parts = text.split(':');
        let router = parts.next().unwrap_or_default().trim().to_string();
        anyhow::ensure!(
            !router.is_empty(),
            "policy `{text}`: no router named before the settings"
        );
        let mut settings = toml::Table::new();
        for setting in parts {
            let (key, value) = setting
                .split_once('=')
                .with_context(|| format!("policy `{text}`: setting `{setting}` is not KEY=VALUE"))?;
            let parsed: toml::Table = toml::from_str(&format!("v = {value}"))
                .with_context(|| format!("policy `{text}`: the value of `{key}` is not a TOML value"))?;
            let value = parsed.get("v").cloned().context("a parsed `v = ...` holds v")?;
            settings.insert(key.trim().to_string(), value);
        }
        let name = if !settings.is_empty() {
            text.to_string()
        } else if router.ends_with(".wasm") {
            Path::new(&router)
                .file_stem()
                .map_or(router.clone(), |stem| stem.to_string_lossy().into_owned())
        } else {
            router.clone()
        };
        Ok(PolicySpec { name, router, settings })
    }
}

/// Everything one comparison needs.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// How the trace and window are described in the report (e.g. its path and window).
    pub trace_label: String,
    /// The requests to replay, timestamps from 0.
    pub requests: Vec<TraceRequest>,
    /// LLM workers (embedded mockers) per run.
    pub workers: usize,
    /// Policies, in report order.
    pub policies: Vec<PolicySpec>,
    /// The replay settings shared by every run.
    pub replay: ReplayOptions,
    /// The workers.
    pub mocker: MockerSettings,
    /// Where `report.md`, the plots, records and metrics go.
    pub out_dir: PathBuf,
    /// The command line, quoted in the report so it can be rerun.
    pub command: String,
    /// How many times every policy is replayed (rounds run the policies in turn, so slow drift
    /// of the machine touches them all alike); figures pool the requests of every round.
    pub repeats: usize,
    /// Embedded vision encoders (images, video) per run.
    pub vision_encoders: usize,
    /// Embedded audio encoders per run.
    pub audio_encoders: usize,
    /// Multiplies the simulated encoders' measured encode times.
    pub encoder_cost_scale: f64,
    /// The gateway's `policy.deadline_ms`.
    pub policy_deadline_ms: u64,
    /// The latency targets goodput is judged by, if any.
    pub goodput: Option<GoodputTargets>,
}

/// DistServe's service-level objectives: a request counts toward goodput when its time to
/// first token and its mean inter-token latency both meet their targets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GoodputTargets {
    /// Time to first token, milliseconds.
    pub ttft_ms: f64,
    /// Mean inter-token latency, milliseconds.
    pub itl_ms: f64,
}

/// The outcome of one policy's runs.
#[derive(Debug, Clone)]
pub struct PolicyRun {
    /// The policy.
    pub policy: PolicySpec,
    /// Its records, one replay per round.
    pub rounds: Vec<ReplayRun>,
    /// Its figures over the requests of every round.
    pub summary: Summary,
    /// Its figures round by round.
    pub round_summaries: Vec<Summary>,
    /// The engines' own counters at the end of each round, summed over workers and rounds.
    pub engines: EngineCounters,
    /// What the encoders did, summed over rounds.
    pub media: MediaCounters,
    /// What the gateway did about prefill/decode disaggregation, summed over rounds.
    pub disagg: DisaggCounters,
}

/// The gateway's disaggregation counters (`switchyard_disagg_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DisaggCounters {
    /// Requests whose prompt a prefill worker computed.
    pub remote: u64,
    /// Requests the policy disaggregated whose answering worker prefilled after all.
    pub local: u64,
}

impl DisaggCounters {
    /// Adds another run's counters to these.
    pub fn add(&mut self, other: &DisaggCounters) {
        self.remote += other.remote;
        self.local += other.local;
    }

    /// The counters of the gateway's Prometheus text.
    pub fn of_gateway_metrics(text: &str) -> DisaggCounters {
        let count = |outcome: &str| {
            switchyard_harness::metric_sum(
                text,
                "switchyard_disagg_requests_total",
                &[&format!("outcome=\"{outcome}\"")],
            ) as u64
        };
        DisaggCounters {
            remote: count("remote"),
            local: count("local"),
        }
    }
}

/// Requests of `run` that met both `targets` (a one-token answer has no inter-token latency
/// and meets that target), and goodput: those requests per second of the replay's arrivals.
pub fn goodput(run: &PolicyRun, targets: GoodputTargets) -> (usize, f64) {
    let records = run.rounds.iter().flat_map(|round| &round.records);
    let met = records
        .filter(|r| r.status == 200 && r.error.is_none())
        .filter(|r| r.ttft_ms.is_some_and(|ttft| ttft <= targets.ttft_ms))
        .filter(|r| r.itl_ms.is_none_or(|itl| itl <= targets.itl_ms))
        .count();
    let span_s: f64 = run
        .rounds
        .iter()
        .map(|round| round.records.iter().map(|r| r.scheduled_ms).fold(0.0, f64::max) / 1000.0)
        .sum();
    (met, if span_s > 0.0 { met as f64 / span_s } else { 0.0 })
}

/// What the encoder pool did in a run: the gateway's counters and the encoders' own.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MediaCounters {
    /// Items encoded (features computed).
    pub encoded: u64,
    /// Items served from an encoder's feature cache.
    pub cached: u64,
    /// Items that failed at an encoder (any other outcome).
    pub failed: u64,
    /// Micro-batches sent to encoders.
    pub batches: u64,
    /// Items in those batches.
    pub batch_items: u64,
    /// Seconds the encoders' devices were busy, summed over encoders.
    pub busy_s: f64,
    /// Encoder-seconds of wall time (encoders × wall time), for utilization.
    pub encoder_wall_s: f64,
}

impl MediaCounters {
    /// Adds another run's counters to these.
    pub fn add(&mut self, other: &MediaCounters) {
        self.encoded += other.encoded;
        self.cached += other.cached;
        self.failed += other.failed;
        self.batches += other.batches;
        self.batch_items += other.batch_items;
        self.busy_s += other.busy_s;
        self.encoder_wall_s += other.encoder_wall_s;
    }

    /// Adds the gateway's encoder-queue counters from its Prometheus text.
    pub fn add_gateway_metrics(&mut self, text: &str) {
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            let Some((name, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            if name.starts_with("switchyard_encoder_items_total{") {
                if name.contains("outcome=\"encoded\"") {
                    self.encoded += value as u64;
                } else if name.contains("outcome=\"cached\"") {
                    self.cached += value as u64;
                } else {
                    self.failed += value as u64;
                }
            } else if name == "switchyard_encoder_batch_items_count" {
                self.batches += value as u64;
            } else if name == "switchyard_encoder_batch_items_sum" {
                self.batch_items += value as u64;
            }
        }
    }
}

/// Counters the mockers keep themselves (their `/metrics`), summed over the fleet.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineCounters {
    /// Sequences preempted for lack of KV blocks (their tokens are computed again).
    pub preemptions: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Prompt tokens admitted.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: u64,
}

impl EngineCounters {
    /// Adds another fleet's counters to these.
    pub fn add(&mut self, other: &EngineCounters) {
        self.preemptions += other.preemptions;
        self.steps += other.steps;
        self.prompt_tokens += other.prompt_tokens;
        self.cached_prompt_tokens += other.cached_prompt_tokens;
    }

    /// Adds the counters of one mocker's Prometheus text; unknown lines are ignored.
    pub fn add_metrics_text(&mut self, text: &str) {
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            let Some((name, value)) = line.split_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let value = value as u64;
            match name {
                "switchyard_mocker_preemptions_total" => self.preemptions += value,
                "switchyard_mocker_steps_total" => self.steps += value,
                "switchyard_mocker_prompt_tokens_total" => self.prompt_tokens += value,
                "switchyard_mocker_cached_prompt_tokens_total" => self.cached_prompt_tokens += value,
                _ => {}
            }
        }
    }
}

/// Runs every policy in turn and writes the report; returns the runs in policy order.
///
/// # Errors
///
/// Fails if a gateway cannot start, the output folder cannot be written, or a run answered no
/// request at all (a broken setup, not a slow policy).
pub async fn compare(config: &CompareConfig) -> anyhow::Result<Vec<PolicyRun>> {
    anyhow::ensure!(config.workers > 0, "at least one worker is needed");
    anyhow::ensure!(!config.policies.is_empty(), "name at least one policy");
    std::fs::create_dir_all(&config.out_dir).with_context(|| format!("cannot create {}", config.out_dir.display()))?;
    anyhow::ensure!(config.repeats > 0, "at least one round is needed");
    // Per policy: each round's replay, its figures, and the counters summed.
    type Tally = (
        Vec<ReplayRun>,
        Vec<Summary>,
        EngineCounters,
        MediaCounters,
        DisaggCounters,
    );
    let mut rounds: Vec<Tally> = vec![Default::default(); config.policies.len()];
    for round in 1..=config.repeats {
        for (policy, (runs, summaries, engines_total, media_total, disagg_total)) in
            config.policies.iter().zip(&mut rounds)
        {
            let of_rounds = if config.repeats > 1 {
                format!(" (round {round} of {})", config.repeats)
            } else {
                String::new()
            };
            eprintln!(
                "== {}{of_rounds}: {} requests, {} workers",
                policy.name,
                config.requests.len(),
                config.workers
            );
            let (run, engines, media, disagg) = run_policy(config, policy).await?;
            let summary = Summary::of(&run);
            eprintln!(
                "   TTFT avg {:.1} ms, p99 {:.1} ms; E2E avg {:.1} ms; {} of {} answered",
                summary.ttft_ms.avg, summary.ttft_ms.p99, summary.e2e_ms.avg, summary.succeeded, summary.requests
            );
            anyhow::ensure!(
                summary.succeeded > 0,
                "no request was answered under `{}`: {}",
                policy.name,
                summary.errors.join("; ")
            );
            let stem = file_stem(&policy.name);
            let suffix = if config.repeats > 1 {
                format!("-round{round}")
            } else {
                String::new()
            };
            replay::write_records(
                &config.out_dir.join(format!("records-{stem}{suffix}.jsonl")),
                &run.records,
            )?;
            engines_total.add(&engines);
            media_total.add(&media);
            disagg_total.add(&disagg);
            runs.push(run);
            summaries.push(summary);
        }
    }
    let mut runs = Vec::with_capacity(rounds.len());
    for (policy, (replays, round_summaries, engines, media, disagg)) in config.policies.iter().zip(rounds) {
        let pooled = ReplayRun {
            records: replays.iter().flat_map(|r| r.records.iter().cloned()).collect(),
            wall_s: replays.iter().map(|r| r.wall_s).sum(),
        };
        let summary = Summary::of(&pooled);
        std::fs::write(
            config.out_dir.join(format!("summary-{}.json", file_stem(&policy.name))),
            serde_json::to_vec_pretty(&summary)?,
        )?;
        runs.push(PolicyRun {
            policy: policy.clone(),
            rounds: replays,
            summary,
            round_summaries,
            engines,
            media,
            disagg,
        });
    }
    write_report(config, &runs)?;
    Ok(runs)
}

/// The gateway configuration of one run. A policy setting whose key names a table
/// (`encoders.blocking=true`, `embedded_mockers.audio_encoders=0`) sets that key of the
/// gateway's configuration instead of the policy's, so runs can differ in more than the router.
pub fn gateway_config(config: &CompareConfig, policy: &PolicySpec, tls_toml: &str) -> anyhow::Result<String> {
    let (gateway, own): (toml::Table, toml::Table) = policy
        .settings
        .clone()
        .into_iter()
        .partition(|(key, _)| key.contains('.'));
    let spec = PolicySpec {
        settings: own,
        ..policy.clone()
    };
    let text = base_config(config, &spec, tls_toml);
    let mut table: toml::Table = toml::from_str(&text).context("the generated gateway configuration")?;
    for (key, value) in gateway {
        let (section, name) = key.split_once('.').context("a dotted key")?;
        let section = table
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(section) = section else {
            anyhow::bail!(
                "`{key}`: the gateway's `{}` is not a table",
                key.split('.').next().unwrap_or("")
            );
        };
        section.insert(name.to_string(), value);
    }
    Ok(toml::to_string(&table)?)
}

fn base_config(config: &CompareConfig, policy: &PolicySpec, tls_toml: &str) -> String {
    let m = &config.mocker;
    format!(
        "mode = \"production\"\n\
         [server]\n\
         idle_timeout_ms = 600000\n\
         {tls_toml}\n\
         [forwarding]\n\
         response_timeout_ms = {timeout}\n\
         [embedded_mockers]\n\
         count = {workers}\n\
         model = {model:?}\n\
         block_size = {block_size}\n\
         num_gpu_blocks = {blocks}\n\
         max_num_batched_tokens = {batched}\n\
         max_num_seqs = {seqs}\n\
         speedup = {speedup:?}\n\
         spot_count = {spot}\n\
         spot_speed = {spot_speed:?}\n\
         spot_cost = {spot_cost:?}\n\
         vision_encoders = {vision}\n\
         audio_encoders = {audio}\n\
         encoder_cost_scale = {encoder_cost:?}\n\
         [policy]\n\
         router = {router:?}\n\
         deadline_ms = {deadline}\n\
         [policy.config]\n\
         {settings}",
        timeout = config.replay.request_timeout.as_millis(),
        workers = config.workers,
        model = config.replay.model,
        block_size = m.block_size,
        blocks = m.num_gpu_blocks,
        batched = m.max_num_batched_tokens,
        seqs = m.max_num_seqs,
        speedup = m.speedup,
        spot = m.spot_workers,
        spot_speed = m.spot_speed,
        spot_cost = m.spot_cost,
        vision = config.vision_encoders,
        audio = config.audio_encoders,
        encoder_cost = config.encoder_cost_scale,
        router = policy.router,
        deadline = config.policy_deadline_ms.max(1),
        settings = policy.settings,
    )
}

async fn run_policy(
    config: &CompareConfig,
    policy: &PolicySpec,
) -> anyhow::Result<(ReplayRun, EngineCounters, MediaCounters, DisaggCounters)> {
    let ca = TestCa::new()?;
    let gateway = Gateway::start(&gateway_config(config, policy, &ca.tls_toml())?)
        .with_context(|| format!("starting the gateway for `{}`", policy.name))?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::Http1, None)?;
    let run = replay::replay(&client, &config.requests, &config.replay).await?;
    let metrics = client.send("GET", "/metrics", Vec::new()).await?;
    std::fs::write(
        config.out_dir.join(format!("metrics-{}.txt", file_stem(&policy.name))),
        metrics.body(),
    )?;
    let mut engines = EngineCounters::default();
    for (name, addr) in &gateway.mockers {
        let text = Client::plain(*addr)
            .send("GET", "/metrics", Vec::new())
            .await
            .with_context(|| format!("reading the metrics of mocker {name}"))?;
        engines.add_metrics_text(&String::from_utf8_lossy(&text.body()));
    }
    let mut media = MediaCounters::default();
    media.add_gateway_metrics(&String::from_utf8_lossy(&metrics.body()));
    let disagg = DisaggCounters::of_gateway_metrics(&String::from_utf8_lossy(&metrics.body()));
    for (name, addr) in &gateway.encoders {
        let text = Client::plain(*addr)
            .send("GET", "/metrics", Vec::new())
            .await
            .with_context(|| format!("reading the metrics of encoder {name}"))?;
        media.busy_s += switchyard_harness::metric_sum(
            &String::from_utf8_lossy(&text.body()),
            "switchyard_encoder_busy_seconds_total",
            &[],
        );
        media.encoder_wall_s += run.wall_s;
    }
    drop(gateway);
    Ok((run, engines, media, disagg))
}

fn file_stem(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The baseline the ratios are taken against: round-robin when compared, else the first.
/// What a policy's answers cost and how many met the TTFT target, from the records: each
/// request's tokens (the worker's prompt count, else the trace's, plus those received) at its
/// worker's cost (spot engines `embedded-spot-N` at `spot_cost`, the rest at 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostFigures {
    /// Share of answered requests whose TTFT met the target (`None` without a target).
    pub attainment: Option<f64>,
    /// Cost units per million tokens served.
    pub cost_per_million: f64,
    /// Share of the tokens served by spot engines.
    pub spot_share: f64,
}

/// [`CostFigures`] of one policy's runs.
pub fn cost_figures(config: &CompareConfig, run: &PolicyRun) -> CostFigures {
    let (mut cost, mut tokens, mut spot, mut met, mut judged) = (0.0, 0.0, 0.0, 0u64, 0u64);
    for record in run.rounds.iter().flat_map(|round| &round.records).filter(|r| r.ok()) {
        let served = f64::from(record.prompt_tokens.unwrap_or(record.input_tokens) + record.output_tokens);
        let on_spot = record
            .worker
            .as_deref()
            .is_some_and(|worker| worker.starts_with("embedded-spot-"));
        cost += served * if on_spot { config.mocker.spot_cost } else { 1.0 };
        tokens += served;
        if on_spot {
            spot += served;
        }
        if let (Some(target), Some(ttft)) = (config.replay.ttft_target_ms, record.ttft_ms) {
            judged += 1;
            met += u64::from(ttft <= target);
        }
    }
    CostFigures {
        attainment: config.replay.ttft_target_ms.map(|_| met as f64 / judged.max(1) as f64),
        cost_per_million: cost / tokens.max(1.0) * 1e6,
        spot_share: spot / tokens.max(1.0),
    }
}

fn cost_section(out: &mut String, config: &CompareConfig, runs: &[PolicyRun]) {
    let m = &config.mocker;
    let _ = writeln!(
        out,
        "\n### Cost and latency target ({} regular engines at cost 1, {} spot engines at {}x their speed and cost {}; TTFT target {})\n",
        config.workers,
        m.spot_workers,
        m.spot_speed,
        m.spot_cost,
        config
            .replay
            .ttft_target_ms
            .map_or("none".into(), |t| format!("{t} ms"))
    );
    let _ = writeln!(
        out,
        "| policy | TTFT target met | cost per 1M tokens | tokens on spot |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|");
    for run in runs {
        let figures = cost_figures(config, run);
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.1} % |",
            run.policy.name,
            figures
                .attainment
                .map_or("n/a".into(), |a| format!("{:.1} %", a * 100.0)),
            figures.cost_per_million,
            figures.spot_share * 100.0
        );
    }
}

fn baseline(runs: &[PolicyRun]) -> Option<&PolicyRun> {
    runs.iter().find(|r| r.policy.name == "round-robin").or(runs.first())
}

/// `base / value` formatted as a "times better" ratio (lower latency is better).
fn better(base: f64, value: f64) -> String {
    if value > 0.0 && base.is_finite() {
        format!("{:.2}×", base / value)
    } else {
        "n/a".into()
    }
}

fn write_report(config: &CompareConfig, runs: &[PolicyRun]) -> anyhow::Result<()> {
    let dir = &config.out_dir;
    let cdf: Vec<(String, Vec<f64>)> = runs
        .iter()
        .map(|r| {
            let samples = r
                .rounds
                .iter()
                .flat_map(|round| &round.records)
                .filter(|x| x.ok())
                .filter_map(|x| x.ttft_ms)
                .collect();
            (r.policy.name.clone(), samples)
        })
        .collect();
    plots::ttft_cdf(&dir.join("ttft_cdf.svg"), "Time to first token", &cdf)?;
    let metric = |label: &str, pick: fn(&Summary) -> f64| {
        (
            label.to_string(),
            runs.iter()
                .map(|r| (r.policy.name.clone(), pick(&r.summary) / 1000.0))
                .collect::<Vec<_>>(),
        )
    };
    plots::bars(
        &dir.join("latency.svg"),
        "Latency per policy",
        "seconds",
        &[
            metric("TTFT avg", |s| s.ttft_ms.avg),
            metric("TTFT p99", |s| s.ttft_ms.p99),
            metric("E2E avg", |s| s.e2e_ms.avg),
            metric("E2E p99", |s| s.e2e_ms.p99),
        ],
    )?;
    for run in runs {
        let Some(first) = run.rounds.first() else {
            continue;
        };
        let intervals: Vec<(String, f64, f64)> = first
            .records
            .iter()
            .filter_map(|r| Some((r.worker.clone()?, r.span_s()?.0, r.span_s()?.1)))
            .collect();
        plots::worker_load(
            &dir.join(format!("load-{}.svg", file_stem(&run.policy.name))),
            &format!("Requests in flight per worker: {}", run.policy.name),
            &intervals,
        )?;
    }
    let report = render_report(config, runs);
    let path = dir.join("report.md");
    std::fs::write(&path, report).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// The multimodal section: TTFT per modality, and what the encoder pool did.
fn render_media(out: &mut String, config: &CompareConfig, runs: &[PolicyRun]) {
    let mut modalities: Vec<&'static str> = config.requests.iter().map(|r| r.modality()).collect();
    modalities.sort_unstable();
    modalities.dedup();
    let _ = writeln!(
        out,
        "\n### By modality (TTFT p50 / p99, ms; {} vision and {} audio encoders at {}x the measured encode times)\n",
        config.vision_encoders, config.audio_encoders, config.encoder_cost_scale
    );
    let header: String = modalities.iter().map(|m| format!(" {m} |")).collect();
    let _ = writeln!(out, "| policy |{header} answered text-only |");
    let _ = writeln!(out, "|---|{}---:|", "---:|".repeat(modalities.len()));
    for r in runs {
        let cells: String = modalities
            .iter()
            .map(|m| match r.summary.ttft_by_modality.get(*m) {
                Some(d) => format!(" {:.0} / {:.0} |", d.p50, d.p99),
                None => " n/a |".into(),
            })
            .collect();
        let _ = writeln!(out, "| {} |{cells} {} |", r.policy.name, r.summary.text_only);
    }
    let _ = writeln!(out, "\n### What the encoders did\n");
    let _ = writeln!(
        out,
        "| policy | items encoded | feature-cache hits | failed | batches | mean batch | encoder utilization |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        let m = &r.media;
        let served = m.encoded + m.cached;
        let hits = if served > 0 {
            format!("{} ({:.1} %)", m.cached, m.cached as f64 * 100.0 / served as f64)
        } else {
            "n/a".into()
        };
        let mean_batch = if m.batches > 0 {
            format!("{:.2}", m.batch_items as f64 / m.batches as f64)
        } else {
            "n/a".into()
        };
        let utilization = if m.encoder_wall_s > 0.0 {
            format!("{:.1} %", m.busy_s * 100.0 / m.encoder_wall_s)
        } else {
            "n/a".into()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {hits} | {} | {} | {mean_batch} | {utilization} |",
            r.policy.name, m.encoded, m.failed, m.batches
        );
    }
}

/// The Markdown report (also printed by the `compare` command).
pub fn render_report(config: &CompareConfig, runs: &[PolicyRun]) -> String {
    let mut out = String::new();
    let m = &config.mocker;
    // The trace's file name, not the path it was given: a report names no local folder. The
    // label's window (", from 0 s for 600 s") holds no path separator, so it stays.
    let trace = Path::new(&config.trace_label)
        .file_name()
        .map_or(config.trace_label.clone(), |name| name.to_string_lossy().into_owned());
    let _ = writeln!(out, "# Routing quality: {trace}\n");
    let _ = writeln!(
        out,
        "- date: {}",
        humantime::format_rfc3339_seconds(std::time::SystemTime::now())
    );
    let _ = writeln!(out, "- machine: {}", machine());
    let _ = writeln!(
        out,
        "- requests: {} over {:.0} s of trace time, replayed at {}× speed ({:.1} s of arrivals), {} tokens per hash id",
        config.requests.len(),
        config.requests.last().map_or(0, |r| r.timestamp) as f64 / 1000.0,
        config.replay.speedup,
        config.requests.last().map_or(0, |r| r.timestamp) as f64 / 1000.0 / config.replay.speedup,
        config.replay.block_tokens
    );
    let _ = writeln!(
        out,
        "- workers: {} embedded mockers (Dynamo's perf model at {}× speed, block size {}, {} KV blocks, {} tokens per step, {} sequences)",
        config.workers, m.speedup, m.block_size, m.num_gpu_blocks, m.max_num_batched_tokens, m.max_num_seqs
    );
    let _ = writeln!(
        out,
        "- client: open-loop streaming chat completions over TLS 1.3 (HTTP/1.1 keep-alive); latencies from each request's scheduled arrival"
    );
    if config.repeats > 1 {
        let _ = writeln!(
            out,
            "- rounds: {} (each policy replayed {} times on fresh workers, policies in turn); the tables pool every round's requests",
            config.repeats, config.repeats
        );
    }
    let _ = writeln!(out, "- command: `{}`\n", config.command);
    let _ = writeln!(out, "## Results\n");
    let _ = writeln!(
        out,
        "| policy | TTFT avg ms | TTFT p50 ms | TTFT p99 ms | ITL avg ms | E2E avg ms | E2E p99 ms | cache hit | answered | output tok/s |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        let s = &r.summary;
        let _ = writeln!(
            out,
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {}/{} | {:.0} |",
            r.policy.name,
            s.ttft_ms.avg,
            s.ttft_ms.p50,
            s.ttft_ms.p99,
            s.itl_ms.avg,
            s.e2e_ms.avg,
            s.e2e_ms.p99,
            s.cache_hit_ratio
                .map_or("n/a".into(), |h| format!("{:.1} %", h * 100.0)),
            s.succeeded,
            s.requests,
            s.output_tokens_per_s
        );
    }
    if config.mocker.spot_workers > 0 || config.replay.ttft_target_ms.is_some() {
        cost_section(&mut out, config, runs);
    }
    if config.goodput.is_some() || runs.iter().any(|r| r.disagg.remote + r.disagg.local > 0) {
        goodput_section(&mut out, config, runs);
    }
    if let Some(base) = baseline(runs) {
        let b = &base.summary;
        let _ = writeln!(
            out,
            "\n### How many times better than {} (its latency / the policy's)\n",
            base.policy.name
        );
        let _ = writeln!(out, "| policy | TTFT avg | TTFT p99 | E2E avg | E2E p99 |");
        let _ = writeln!(out, "|---|---:|---:|---:|---:|");
        for r in runs {
            let s = &r.summary;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                r.policy.name,
                better(b.ttft_ms.avg, s.ttft_ms.avg),
                better(b.ttft_ms.p99, s.ttft_ms.p99),
                better(b.e2e_ms.avg, s.e2e_ms.avg),
                better(b.e2e_ms.p99, s.e2e_ms.p99)
            );
        }
    }
    if config.repeats > 1 {
        let _ = writeln!(out, "\n### Round by round (TTFT avg / p99, ms)\n");
        let header: String = (1..=config.repeats).map(|k| format!(" round {k} |")).collect();
        let rule: String = (1..=config.repeats).map(|_| "---:|").collect();
        let _ = writeln!(out, "| policy |{header}");
        let _ = writeln!(out, "|---|{rule}");
        for r in runs {
            let cells: String = r
                .round_summaries
                .iter()
                .map(|s| format!(" {:.0} / {:.0} |", s.ttft_ms.avg, s.ttft_ms.p99))
                .collect();
            let _ = writeln!(out, "| {} |{cells}", r.policy.name);
        }
    }
    let _ = writeln!(out, "\n### What the engines counted\n");
    let _ = writeln!(
        out,
        "| policy | prefix-cache hit (engines) | preemptions | engine steps |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|");
    for r in runs {
        let e = &r.engines;
        let hit = if e.prompt_tokens > 0 {
            format!(
                "{:.1} %",
                e.cached_prompt_tokens as f64 * 100.0 / e.prompt_tokens as f64
            )
        } else {
            "n/a".into()
        };
        let _ = writeln!(out, "| {} | {} | {} | {} |", r.policy.name, hit, e.preemptions, e.steps);
    }
    if config.requests.iter().any(|r| !r.media.is_empty()) {
        render_media(&mut out, config, runs);
    }
    let _ = writeln!(out, "\n## Plots\n");
    let _ = writeln!(out, "![TTFT CDF per policy](ttft_cdf.svg)\n");
    let _ = writeln!(out, "![Latency per policy](latency.svg)\n");
    for r in runs {
        let _ = writeln!(
            out,
            "![Requests in flight per worker: {0}{2}](load-{1}.svg)\n",
            r.policy.name,
            file_stem(&r.policy.name),
            if config.repeats > 1 { " (round 1)" } else { "" }
        );
    }
    let _ = writeln!(out, "## Per-policy details\n");
    for r in runs {
        let _ = writeln!(out, "### {}\n", r.policy.name);
        out.push_str(&r.summary.to_markdown());
        out.push('\n');
    }
    out
}

/// Goodput, the inter-token latency's spread, and how many requests were disaggregated.
fn goodput_section(out: &mut String, config: &CompareConfig, runs: &[PolicyRun]) {
    let _ = writeln!(out, "\n### Goodput and disaggregation\n");
    if let Some(targets) = config.goodput {
        let _ = writeln!(
            out,
            "Goodput: requests per second (of the replay's arrival time) answered with TTFT ≤ {} ms and mean ITL ≤ {} ms (DistServe's measure, at this offered load).\n",
            targets.ttft_ms, targets.itl_ms
        );
    }
    let _ = writeln!(
        out,
        "| policy | goodput req/s | met both | ITL p50 ms | ITL p99 ms | prefilled remotely | fell back to local |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        let (met, rate) = config.goodput.map_or((None, None), |targets| {
            let (met, rate) = goodput(r, targets);
            (Some(met), Some(rate))
        });
        let s = &r.summary;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.1} | {:.1} | {} | {} |",
            r.policy.name,
            rate.map_or("n/a".into(), |rate| format!("{rate:.2}")),
            met.map_or("n/a".into(), |met| format!(
                "{met}/{} ({:.1} %)",
                s.requests,
                met as f64 * 100.0 / s.requests.max(1) as f64
            )),
            s.itl_ms.p50,
            s.itl_ms.p99,
            r.disagg.remote,
            r.disagg.local
        );
    }
}

/// "N cores, CPU model" from `/proc/cpuinfo` where there is one.
fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|line| {
                line.strip_prefix("model name")
                    .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cores} cores, {model}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_specs_name_built_ins_and_files() {
        let built_in = PolicySpec::parse("kv-aware").expect("a spec");
        assert_eq!(built_in.name, "kv-aware");
        assert!(built_in.settings.is_empty());
        let file = PolicySpec::parse("/tmp/my-router.wasm").expect("a spec");
        assert_eq!(file.name, "my-router");
        assert_eq!(file.router, "/tmp/my-router.wasm");
        assert_eq!(file_stem("a b/c"), "a_b_c");
    }

    #[test]
    fn policy_specs_carry_settings_into_the_gateway_config() {
        let spec = PolicySpec::parse("predicted-ttft:decode_weight=0.2:mode=\"x\"").expect("a spec");
        assert_eq!(spec.router, "predicted-ttft");
        assert_eq!(spec.name, "predicted-ttft:decode_weight=0.2:mode=\"x\"");
        assert_eq!(spec.settings.get("decode_weight"), Some(&toml::Value::Float(0.2)));
        assert_eq!(spec.settings.get("mode"), Some(&toml::Value::String("x".into())));
        let config = CompareConfig {
            trace_label: String::new(),
            requests: Vec::new(),
            workers: 2,
            policies: vec![spec.clone()],
            replay: ReplayOptions::default(),
            mocker: MockerSettings::default(),
            out_dir: PathBuf::new(),
            command: String::new(),
            repeats: 1,
            vision_encoders: 1,
            audio_encoders: 1,
            encoder_cost_scale: 1.0,
            policy_deadline_ms: 1,
            goodput: None,
        };
        let text = gateway_config(&config, &spec, "").expect("a config");
        let parsed: toml::Table = toml::from_str(&text).expect("the gateway config is TOML");
        assert_eq!(parsed["policy"]["config"]["decode_weight"].as_float(), Some(0.2));
        // A dotted key sets the gateway's own table, not the policy's.
        let blocking =
            PolicySpec::parse("kv-aware:encoders.blocking=true:embedded_mockers.audio_encoders=0").expect("a spec");
        let text = gateway_config(&config, &blocking, "").expect("a config");
        let parsed: toml::Table = toml::from_str(&text).expect("the gateway config is TOML");
        assert_eq!(parsed["encoders"]["blocking"].as_bool(), Some(true));
        assert_eq!(parsed["embedded_mockers"]["audio_encoders"].as_integer(), Some(0));
        assert_eq!(parsed["embedded_mockers"]["vision_encoders"].as_integer(), Some(1));
        assert!(
            parsed["policy"]
                .get("config")
                .is_none_or(|c| c.as_table().is_some_and(|t| t.is_empty()))
        );
        assert!(PolicySpec::parse("kv-aware:weight").is_err());
        assert!(PolicySpec::parse("kv-aware:weight=not toml").is_err());
        assert!(PolicySpec::parse(":weight=1").is_err());
    }

    #[test]
    fn media_counters_read_the_gateways_encoder_metrics() {
        let mut media = MediaCounters::default();
        media.add_gateway_metrics(
            "switchyard_encoder_items_total{encoder=\"v\",outcome=\"encoded\"} 7\n\
             switchyard_encoder_items_total{encoder=\"v\",outcome=\"cached\"} 3\n\
             switchyard_encoder_items_total{encoder=\"a\",outcome=\"unreachable\"} 1\n\
             switchyard_encoder_batch_items_sum 10.0\n\
             switchyard_encoder_batch_items_count 4\n",
        );
        assert_eq!((media.encoded, media.cached, media.failed), (7, 3, 1));
        assert_eq!((media.batches, media.batch_items), (4, 10));
    }

    #[test]
    fn engine_counters_sum_mocker_metrics() {
        let mut counters = EngineCounters::default();
        let text = "# HELP switchyard_mocker_preemptions Sequences preempted\n\
                    switchyard_mocker_preemptions_total 3\n\
                    switchyard_mocker_steps_total 100\n\
                    switchyard_mocker_prompt_tokens_total 1000\n\
                    switchyard_mocker_cached_prompt_tokens_total 250\n\
                    switchyard_mocker_running_requests 4\n";
        counters.add_metrics_text(text);
        counters.add_metrics_text(text);
        assert_eq!(
            counters,
            EngineCounters {
                preemptions: 6,
                steps: 200,
                prompt_tokens: 2000,
                cached_prompt_tokens: 500
            }
        );
    }

    #[test]
    fn goodput_counts_requests_meeting_both_targets_per_second_of_arrivals() {
        let record = |scheduled_ms: f64, ttft_ms: f64, itl_ms: Option<f64>, status: u16| {
            serde_json::from_value::<crate::replay::RequestRecord>(serde_json::json!({
                "index": 0, "scheduled_ms": scheduled_ms, "lag_ms": 0.0, "ttft_ms": ttft_ms,
                "itl_ms": itl_ms, "e2e_ms": ttft_ms, "input_tokens": 10, "max_tokens": 5,
                "output_tokens": 5, "prompt_tokens": null, "cached_tokens": null, "worker": null,
                "status": status, "error": null,
            }))
            .expect("a record")
        };
        let records = vec![
            record(0.0, 100.0, Some(10.0), 200),
            record(1000.0, 300.0, Some(10.0), 200), // TTFT missed
            record(2000.0, 100.0, Some(60.0), 200), // ITL missed
            record(3000.0, 100.0, None, 200),       // one token: no ITL, met
            record(4000.0, 100.0, Some(10.0), 502), // failed
        ];
        let round = ReplayRun { records, wall_s: 5.0 };
        let run = PolicyRun {
            policy: PolicySpec::parse("kv-aware").expect("a spec"),
            summary: Summary::of(&round),
            rounds: vec![round],
            round_summaries: Vec::new(),
            engines: EngineCounters::default(),
            media: MediaCounters::default(),
            disagg: DisaggCounters::default(),
        };
        let (met, rate) = goodput(
            &run,
            GoodputTargets {
                ttft_ms: 200.0,
                itl_ms: 50.0,
            },
        );
        assert_eq!(met, 2);
        assert!((rate - 0.5).abs() < 1e-9, "2 requests over 4 s of arrivals: {rate}");
        let metrics = "switchyard_disagg_requests_total{outcome=\"remote\"} 7\nswitchyard_disagg_requests_total{outcome=\"local\"} 2\n";
        assert_eq!(
            DisaggCounters::of_gateway_metrics(metrics),
            DisaggCounters { remote: 7, local: 2 }
        );
    }

    #[test]
    fn ratios_are_baseline_over_policy() {
        assert_eq!(better(100.0, 10.0), "10.00×");
        assert_eq!(better(100.0, 0.0), "n/a");
    }
}
