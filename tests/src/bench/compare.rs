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

use crate::bench::plots;
use crate::bench::replay::{self, ReplayOptions, ReplayRun, Summary};
use crate::bench::trace::TraceRequest;
use crate::{Alpn, Client, Gateway, TestCa};

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
}

impl Default for MockerSettings {
    fn default() -> MockerSettings {
        MockerSettings {
            speedup: 1.0,
            block_size: 64,
            num_gpu_blocks: 16_384,
            max_num_batched_tokens: 8_192,
            max_num_seqs: 256,
        }
    }
}

/// One policy to compare: a built-in name or a path to a `.wasm` component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySpec {
    /// The name in the report.
    pub name: String,
    /// What the gateway's `policy.router` is set to.
    pub router: String,
}

impl PolicySpec {
    /// Parses `NAME` (a built-in) or a path ending in `.wasm` (named after its file stem).
    pub fn parse(text: &str) -> PolicySpec {
        let router = text.trim().to_string();
        let name = if router.ends_with(".wasm") {
            Path::new(&router)
                .file_stem()
                .map_or(router.clone(), |stem| stem.to_string_lossy().into_owned())
        } else {
            router.clone()
        };
        PolicySpec { name, router }
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
}

/// The outcome of one policy's run.
#[derive(Debug, Clone)]
pub struct PolicyRun {
    /// The policy.
    pub policy: PolicySpec,
    /// Its records.
    pub run: ReplayRun,
    /// Its figures.
    pub summary: Summary,
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
    let mut runs = Vec::new();
    for policy in &config.policies {
        eprintln!(
            "== {}: {} requests, {} workers",
            policy.name,
            config.requests.len(),
            config.workers
        );
        let run = run_policy(config, policy).await?;
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
        replay::write_records(&config.out_dir.join(format!("records-{stem}.jsonl")), &run.records)?;
        std::fs::write(
            config.out_dir.join(format!("summary-{stem}.json")),
            serde_json::to_vec_pretty(&summary)?,
        )?;
        runs.push(PolicyRun {
            policy: policy.clone(),
            run,
            summary,
        });
    }
    write_report(config, &runs)?;
    Ok(runs)
}

/// The gateway configuration of one run.
pub fn gateway_config(config: &CompareConfig, policy: &PolicySpec, tls_toml: &str) -> String {
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
         [policy]\n\
         router = {router:?}\n",
        timeout = config.replay.request_timeout.as_millis(),
        workers = config.workers,
        model = config.replay.model,
        block_size = m.block_size,
        blocks = m.num_gpu_blocks,
        batched = m.max_num_batched_tokens,
        seqs = m.max_num_seqs,
        speedup = m.speedup,
        router = policy.router,
    )
}

async fn run_policy(config: &CompareConfig, policy: &PolicySpec) -> anyhow::Result<ReplayRun> {
    let ca = TestCa::new()?;
    let gateway = Gateway::start(&gateway_config(config, policy, &ca.tls_toml()))
        .with_context(|| format!("starting the gateway for `{}`", policy.name))?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::Http1, None)?;
    let run = replay::replay(&client, &config.requests, &config.replay).await?;
    let metrics = client.send("GET", "/metrics", Vec::new()).await?;
    std::fs::write(
        config.out_dir.join(format!("metrics-{}.txt", file_stem(&policy.name))),
        metrics.body(),
    )?;
    drop(gateway);
    Ok(run)
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
                .run
                .records
                .iter()
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
        let intervals: Vec<(String, f64, f64)> = run
            .run
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

/// The Markdown report (also printed by the `compare` command).
pub fn render_report(config: &CompareConfig, runs: &[PolicyRun]) -> String {
    let mut out = String::new();
    let m = &config.mocker;
    let _ = writeln!(out, "# Routing quality: {}\n", config.trace_label);
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
    let _ = writeln!(out, "\n## Plots\n");
    let _ = writeln!(out, "![TTFT CDF per policy](ttft_cdf.svg)\n");
    let _ = writeln!(out, "![Latency per policy](latency.svg)\n");
    for r in runs {
        let _ = writeln!(
            out,
            "![Requests in flight per worker: {0}](load-{1}.svg)\n",
            r.policy.name,
            file_stem(&r.policy.name)
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
        assert_eq!(PolicySpec::parse("kv-aware").name, "kv-aware");
        let file = PolicySpec::parse("/tmp/my-router.wasm");
        assert_eq!(file.name, "my-router");
        assert_eq!(file.router, "/tmp/my-router.wasm");
        assert_eq!(file_stem("a b/c"), "a_b_c");
    }

    #[test]
    fn ratios_are_baseline_over_policy() {
        assert_eq!(better(100.0, 10.0), "10.00×");
        assert_eq!(better(100.0, 0.0), "n/a");
    }
}
