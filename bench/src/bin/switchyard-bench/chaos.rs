//! `switchyard-bench chaos`: a trace replayed at a fleet of simulated engines while engines
//! fail, with and without stream migration, against the fault-free run.
//!
//! Each run starts a fresh `nats-server`, gateway and `--workers` mocker processes (one engine
//! each: they register, publish their KV events and heartbeat over NATS), replays the
//! same requests on the same schedule, and keeps every answer's text. The runs:
//!
//! - **fault-free**, the reference: every answer's text is the engines' greedy output (the
//!   mocker's words depend only on the tokens before them, as a greedy model's do), and the
//!   gateway's CPU without reading the chunks;
//! - **kill**: every `--every-s` a random engine is killed (SIGKILL: no goodbye, connections
//!   reset) and started again on its port `--restart-after-s` later;
//! - **reclaim**: every engine is spot capacity, reclaimed (killed) one every `--every-s`, its
//!   notice `--notice-s` before (the mocker's `--spot-lifetime-s` and `--spot-notice-s`), and
//!   started again at once;
//!
//! each run once with `migration_limit = 0` and once with `--migration-limit`. Per run:
//! the faults, the gateway's migrations, client-visible errors, answers whose text differs from
//! the fault-free one (tokens lost or repeated), TTFT and E2E p50/p99, and the gateway's CPU per
//! request (the price of reading every chunk).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use switchyard_bench::replay::{self, ReplayOptions, ReplayRun, RequestRecord, Summary};
use switchyard_bench::trace::TraceRequest;
use switchyard_harness::rng::SplitMix64;
use switchyard_harness::{Client, Gateway, Mockers, NatsServer, metric_sum};

use super::TraceArgs;
use super::cpu;

/// The admin token of the gateways this command starts.
const ADMIN_TOKEN: &str = "chaos-admin-token";

/// Arguments of `switchyard-bench chaos`.
#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// Simulated engines (one mocker process each).
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Seconds between faults.
    #[arg(long, default_value_t = 10.0)]
    every_s: f64,
    /// Seconds a killed engine stays down before it is started again.
    #[arg(long, default_value_t = 2.0)]
    restart_after_s: f64,
    /// Seconds between a spot engine's reclaim notice and its reclaim.
    #[arg(long, default_value_t = 2.0)]
    notice_s: f64,
    /// `forwarding.migration_limit` of the runs with migration.
    #[arg(long, default_value_t = 3)]
    migration_limit: u32,
    /// Which faults to run (`kill`, `reclaim`), each without and with migration.
    #[arg(long, value_delimiter = ',', default_value = "kill,reclaim")]
    faults: Vec<Fault>,
    /// The router policy.
    #[arg(long, default_value = "kv-aware")]
    policy: String,
    /// Seed of the engines killed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mocker time runs this many times faster than the perf model.
    #[arg(long, default_value_t = 1.0)]
    mocker_speedup: f64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 16_384)]
    num_gpu_blocks: usize,
    /// A request unanswered after this many seconds is recorded as failed.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// Folder for report.md and the per-request records.
    #[arg(long, default_value = "bench-chaos")]
    out: PathBuf,
    /// Do not draw progress bars.
    #[arg(long)]
    no_progress: bool,
}

/// What goes wrong during a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// Engines killed and restarted.
    Kill,
    /// Spot engines reclaimed after a notice.
    Reclaim,
}

/// One run: its faults and its migration limit.
#[derive(Debug, Clone, Copy)]
struct RunSpec {
    fault: Option<Fault>,
    migration_limit: u32,
}

impl RunSpec {
    fn name(&self) -> String {
        let fault = match self.fault {
            None => "fault-free",
            Some(Fault::Kill) => "kill",
            Some(Fault::Reclaim) => "reclaim",
        };
        format!("{fault}, migration_limit {}", self.migration_limit)
    }
}

/// What one run measured.
struct RunResult {
    spec: RunSpec,
    run: ReplayRun,
    summary: Summary,
    /// Faults injected while the trace was replayed.
    faults: usize,
    /// The gateway's `switchyard_stream_migrations_total`: continued, failed.
    migrations: (f64, f64),
    /// Gateway CPU seconds over the replay.
    gateway_cpu_s: f64,
}

/// Runs the comparison and prints its table.
pub async fn run(args: ChaosArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.workers >= 2,
        "--workers must be at least 2 (a stream needs somewhere to go)"
    );
    anyhow::ensure!(
        args.every_s > 0.0 && args.restart_after_s >= 0.0 && args.notice_s > 0.0,
        "--every-s and --notice-s must be positive, --restart-after-s not negative"
    );
    let requests = args.trace.load()?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    // Fault-free twice: the reference (latency, texts) and the price of reading every chunk.
    let mut specs = Vec::new();
    for fault in std::iter::once(None).chain(args.faults.iter().copied().map(Some)) {
        for migration_limit in [0, args.migration_limit] {
            specs.push(RunSpec { fault, migration_limit });
        }
    }
    let mut results: Vec<RunResult> = Vec::new();
    for spec in specs {
        eprintln!(
            "== {}: {} requests, {} engines",
            spec.name(),
            requests.len(),
            args.workers
        );
        let result = run_one(&args, &requests, spec).await?;
        eprintln!(
            "   {} faults, {} of {} answered, migrations {:.0} continued / {:.0} failed",
            result.faults,
            result.summary.succeeded,
            result.summary.requests,
            result.migrations.0.abs(),
            result.migrations.1.abs()
        );
        let stem = spec.name().replace([',', ' '], "-").replace("--", "-");
        // Without the answers' text: it is only compared, and would make the files megabytes.
        let records: Vec<RequestRecord> = result
            .run
            .records
            .iter()
            .map(|record| RequestRecord {
                text: None,
                ..record.clone()
            })
            .collect();
        replay::write_records(&args.out.join(format!("records-{stem}.jsonl")), &records)?;
        results.push(result);
    }
    let report = render(&args, &requests, &results);
    std::fs::write(args.out.join("report.md"), &report)?;
    print!("{report}");
    Ok(())
}

/// One run on a fresh gateway and fleet.
async fn run_one(args: &ChaosArgs, requests: &[TraceRequest], spec: RunSpec) -> anyhow::Result<RunResult> {
    let nats = NatsServer::start().context("the chaos benchmark needs `nats-server` on the PATH")?;
    let config = format!(
        "[server]\nplaintext = true\n\
         [health]\ninterval_ms = 250\ntimeout_ms = 500\nfailures_to_eject = 1\n\
         [forwarding]\nmigration_limit = {}\nretries = 2\n\
         [policy]\nrouter = \"{}\"\n\
         [kv]\nnats_url = \"{}\"\nheartbeat_misses = 3\n\
         [[models]]\nname = \"mock\"\nblock_size = {}\nmax_model_len = 262144\n",
        spec.migration_limit, args.policy, nats.url, args.block_size
    );
    let (gateway, admin) = Gateway::start_with_admin(&config, ADMIN_TOKEN)?;
    let fleet = Fleet {
        nats_url: nats.url.clone(),
        speedup: args.mocker_speedup,
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        every: Duration::from_secs_f64(args.every_s),
        notice: Duration::from_secs_f64(args.notice_s),
        restart_after: Duration::from_secs_f64(args.restart_after_s),
        workers: args.workers,
    };
    let engines = fleet.start(spec.fault)?;
    admin.wait_for_workers(args.workers).await?;
    // The engines' first health checks tell the gateway they are Switchyard's.
    tokio::time::sleep(Duration::from_millis(600)).await;

    let stop = Arc::new(AtomicBool::new(false));
    let chaos = {
        let stop = stop.clone();
        let seed = args.seed;
        std::thread::spawn(move || fleet.chaos(engines, spec.fault, seed, &stop))
    };
    let client = Client::plain(gateway.addr);
    let options = ReplayOptions {
        model: "mock".into(),
        block_tokens: args.trace.block_tokens,
        speedup: args.trace.speedup,
        request_timeout: Duration::from_secs(args.timeout_s),
        progress: !args.no_progress,
        ttft_target_ms: None,
        keep_text: true,
    };
    let cpu_before = cpu::seconds(gateway.process.id());
    let run = replay::replay(&client, requests, &options).await;
    let gateway_cpu_s = cpu::seconds(gateway.process.id()) - cpu_before;
    stop.store(true, Ordering::SeqCst);
    let faults = chaos
        .join()
        .map_err(|_| anyhow::anyhow!("the chaos thread panicked"))??;
    let run = run?;
    let metrics = client.send("GET", "/metrics", Vec::new()).await?;
    let metrics = String::from_utf8_lossy(&metrics.body()).into_owned();
    let name = "switchyard_stream_migrations_total";
    let migrations = (
        metric_sum(&metrics, name, &["outcome=\"continued\""]),
        metric_sum(&metrics, name, &["outcome=\"failed\""]),
    );
    let summary = Summary::of(&run);
    Ok(RunResult {
        spec,
        run,
        summary,
        faults,
        migrations,
        gateway_cpu_s,
    })
}

/// How the fleet's engines are started.
#[derive(Debug, Clone)]
struct Fleet {
    nats_url: String,
    speedup: f64,
    block_size: usize,
    num_gpu_blocks: usize,
    every: Duration,
    notice: Duration,
    restart_after: Duration,
    workers: usize,
}

/// One engine of the fleet: its name, its port, and its process while it runs.
struct Engine {
    name: String,
    port: u16,
    process: Option<Mockers>,
}

impl Fleet {
    /// Starts every engine; for `reclaim`, engine `i` is reclaimed `(i + 1) · every` after
    /// its start, so one goes every `every`.
    fn start(&self, fault: Option<Fault>) -> anyhow::Result<Vec<Engine>> {
        (0..self.workers)
            .map(|index| {
                let name = format!("engine-{index}");
                let lifetime = (fault == Some(Fault::Reclaim)).then(|| self.every * (index as u32 + 1) + self.notice);
                let process = self.engine(&name, 0, lifetime)?;
                let port = process.addrs.first().context("the mocker reported no address")?.port();
                Ok(Engine {
                    name,
                    port,
                    process: Some(process),
                })
            })
            .collect()
    }

    /// Starts engine `name` on `port` (0: any), reclaimed after `lifetime` if given.
    fn engine(&self, name: &str, port: u16, lifetime: Option<Duration>) -> anyhow::Result<Mockers> {
        let mut args: Vec<String> = [
            "--num-workers",
            "1",
            "--name",
            name,
            "--port",
            &port.to_string(),
            "--speedup",
            &self.speedup.to_string(),
            "--block-size",
            &self.block_size.to_string(),
            "--num-gpu-blocks",
            &self.num_gpu_blocks.to_string(),
            "--nats",
            &self.nats_url,
            "--heartbeat-ms",
            "500",
        ]
        .iter()
        .map(|arg| arg.to_string())
        .collect();
        if let Some(lifetime) = lifetime {
            args.extend([
                "--spot-lifetime-s".to_string(),
                lifetime.as_secs_f64().to_string(),
                "--spot-notice-s".to_string(),
                self.notice.as_secs_f64().to_string(),
            ]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Mockers::start(&args)
    }

    /// Starts engine `name` again on its `port`, retrying while the port is not free yet.
    fn restart(&self, name: &str, port: u16, lifetime: Option<Duration>) -> anyhow::Result<Mockers> {
        let mut last = None;
        for _ in 0..20 {
            match self.engine(name, port, lifetime) {
                Ok(process) => return Ok(process),
                Err(err) => last = Some(err),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("never tried")))
            .with_context(|| format!("cannot start {name} again on port {port}"))
    }

    /// Injects `fault` into `engines` until `stop` is set; answers how many it injected.
    fn chaos(
        &self,
        mut engines: Vec<Engine>,
        fault: Option<Fault>,
        seed: u64,
        stop: &AtomicBool,
    ) -> anyhow::Result<usize> {
        let mut rng = SplitMix64::new(seed);
        let mut faults = 0;
        let started = Instant::now();
        let mut next = started + self.every;
        let sleep_until = |until: Instant| {
            while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        while !stop.load(Ordering::SeqCst) {
            match fault {
                None => sleep_until(Instant::now() + Duration::from_millis(100)),
                Some(Fault::Kill) => {
                    sleep_until(next);
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    next += self.every;
                    let index = (rng.next() % engines.len() as u64) as usize;
                    let engine = &mut engines[index];
                    if let Some(mut process) = engine.process.take() {
                        process.process.kill();
                        faults += 1;
                    }
                    sleep_until(Instant::now() + self.restart_after);
                    engine.process = Some(self.restart(&engine.name, engine.port, None)?);
                }
                Some(Fault::Reclaim) => {
                    sleep_until(Instant::now() + Duration::from_millis(50));
                    // A reclaimed engine has exited: counted, and started again with a
                    // lifetime that reclaims it once per round of the fleet.
                    let lifetime = self.every * self.workers as u32;
                    for engine in &mut engines {
                        let exited = engine
                            .process
                            .as_mut()
                            .is_some_and(|process| process.process.wait_exit(Duration::ZERO).is_some());
                        if exited {
                            faults += 1;
                            engine.process = Some(self.restart(&engine.name, engine.port, Some(lifetime))?);
                        }
                    }
                }
            }
        }
        Ok(faults)
    }
}

/// How a run's answers compare with the fault-free ones, in mock words (one per token).
#[derive(Debug, Default, Clone, Copy)]
struct Fidelity {
    /// Requests the fault-free run answered and this one did not: errors the faults caused.
    errors: usize,
    /// Answers compared (answered in both runs).
    compared: usize,
    /// Answers whose text differs.
    differing: usize,
    /// Tokens of the fault-free text missing.
    lost: usize,
    /// Tokens not in the fault-free text.
    repeated: usize,
}

/// Compares `run`'s answers with `reference`'s, request by request.
fn fidelity(reference: &[RequestRecord], run: &[RequestRecord]) -> Fidelity {
    let mut fidelity = Fidelity::default();
    for (expected, got) in reference.iter().zip(run) {
        if !expected.ok() {
            continue;
        }
        if !got.ok() {
            fidelity.errors += 1;
            continue;
        }
        let (Some(expected), Some(got)) = (&expected.text, &got.text) else {
            continue;
        };
        fidelity.compared += 1;
        if expected == got {
            continue;
        }
        fidelity.differing += 1;
        // One edited stretch: what is left between the common beginning and the common end.
        let a: Vec<&str> = expected.split(' ').collect();
        let b: Vec<&str> = got.split(' ').collect();
        let prefix = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        let suffix = a[prefix..]
            .iter()
            .rev()
            .zip(b[prefix..].iter().rev())
            .take_while(|(x, y)| x == y)
            .count();
        fidelity.lost += a.len() - prefix - suffix;
        fidelity.repeated += b.len() - prefix - suffix;
    }
    fidelity
}

/// The report: the setup and one table row per run.
fn render(args: &ChaosArgs, requests: &[TraceRequest], results: &[RunResult]) -> String {
    let mut out = String::new();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let _ = writeln!(out, "# Faults\n\n```\n{command}\n```\n");
    let _ = writeln!(
        out,
        "{} requests of `{}`, {} engines (one mocker process each, linked over NATS), router `{}`; \
         a fault every {} s (kill: down {} s; reclaim: notice {} s before).\n",
        requests.len(),
        args.trace.trace.display(),
        args.workers,
        args.policy,
        args.every_s,
        args.restart_after_s,
        args.notice_s
    );
    let reference = results.first();
    let _ = writeln!(
        out,
        "| run | faults | migrations continued / failed | client errors | answers ≠ fault-free | tokens lost | tokens repeated | TTFT p50 / p99 ms | E2E p50 / p99 ms | E2E p99 vs fault-free | gateway CPU ms / request |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|");
    for result in results {
        let summary = &result.summary;
        let fidelity = reference.map_or_else(Fidelity::default, |reference| {
            fidelity(&reference.run.records, &result.run.records)
        });
        let e2e_ratio = reference.map_or(f64::NAN, |reference| summary.e2e_ms.p99 / reference.summary.e2e_ms.p99);
        let cpu_ms = result.gateway_cpu_s * 1000.0 / summary.requests.max(1) as f64;
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} / {:.0} | {} | {} of {} | {} | {} | {:.0} / {:.0} | {:.0} / {:.0} | {:.2}× | {:.2} |",
            result.spec.name(),
            result.faults,
            result.migrations.0.abs(),
            result.migrations.1.abs(),
            fidelity.errors,
            fidelity.differing,
            fidelity.compared,
            fidelity.lost,
            fidelity.repeated,
            summary.ttft_ms.p50,
            summary.ttft_ms.p99,
            summary.e2e_ms.p50,
            summary.e2e_ms.p99,
            e2e_ratio,
            cpu_ms
        );
    }
    for result in results.iter().filter(|result| !result.summary.errors.is_empty()) {
        let _ = writeln!(out, "\n{} — first errors:", result.spec.name());
        for error in &result.summary.errors {
            let _ = writeln!(out, "- {error}");
        }
    }
    out
}
