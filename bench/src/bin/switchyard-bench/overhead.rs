//! `overhead`: one mocker and, in front of it, two gateways (TLS and plain HTTP) and, with
//! `--nginx`, Debian's nginx as a TLS 1.3 reverse proxy; time to first byte and requests per
//! second of streamed completions at several concurrency levels directly against the mocker
//! and through each proxy, with the CPU time each proxy process spent per request, and
//! closed-loop requests per second of tiny non-streamed completions, printed as tables with
//! ratios to the direct path (latency) and to nginx (CPU).
//!
//! Where the machine has the cores, the proxy under test, the mocker and the load generator run
//! pinned to separate cores (`taskset`), so a proxy's latency is not the others' contention and
//! its CPU time is its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use switchyard_harness::{Alpn, Client, Gateway, Mockers, TestCa, chat_body};

use crate::cpu::{self, Pinning};
use crate::nginx::Nginx;

/// Flags of `overhead`.
#[derive(Debug, clap::Args)]
pub struct OverheadArgs {
    /// Concurrent streams to measure at (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,64,512")]
    concurrency: Vec<usize>,
    /// Seconds of load per concurrency level and target.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Tokens generated per streamed request.
    #[arg(long, default_value_t = 16)]
    tokens: u32,
    /// Mocker speed-up: large values leave mostly HTTP and gateway time in the TTFB.
    #[arg(long, default_value_t = 1000.0)]
    speedup: f64,
    /// Concurrent connections for the requests-per-second run.
    #[arg(long, default_value_t = 64)]
    rps_concurrency: usize,
    /// Also measure nginx as a TLS 1.3 reverse proxy in front of the same mocker (Debian's
    /// `nginx` package; config generated).
    #[arg(long)]
    nginx: bool,
    /// The nginx binary (a path, or a name looked up on PATH and in /usr/sbin).
    #[arg(long, default_value = "nginx")]
    nginx_binary: PathBuf,
    /// Cores the proxy under test is pinned to (nginx gets as many worker processes, the
    /// gateway as many runtime threads).
    #[arg(long, default_value_t = 1)]
    proxy_cores: usize,
    /// Leave every process on every core (no `taskset`).
    #[arg(long)]
    no_pin: bool,
    /// Also measure the TLS gateway with `server.stream_coalesce_us = 0` (every event written
    /// as it arrives), beside the default.
    #[arg(long)]
    coalescing_off_too: bool,
    /// `server.stream_coalesce_us` of the measured gateways (default: the gateway's own).
    #[arg(long)]
    stream_coalesce_us: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Direct,
    Nginx,
    GatewayPlain,
    GatewayTls,
    GatewayTlsEager,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Direct => "direct to mocker",
            Target::Nginx => "nginx (TLS 1.3)",
            Target::GatewayPlain => "gateway (plain HTTP)",
            Target::GatewayTls => "gateway (TLS 1.3)",
            Target::GatewayTlsEager => "gateway (TLS 1.3, coalescing off)",
        }
    }
}

struct Setup {
    _mocker: Mockers,
    mocker: SocketAddr,
    plain: Gateway,
    tls: Gateway,
    /// The TLS gateway with every event written as it arrives.
    tls_eager: Option<Gateway>,
    nginx: Option<Nginx>,
    ca: TestCa,
}

impl Setup {
    /// The targets measured, direct first (the latency baseline), then nginx (the CPU one).
    fn targets(&self) -> Vec<Target> {
        let mut targets = vec![Target::Direct];
        if self.nginx.is_some() {
            targets.push(Target::Nginx);
        }
        targets.extend([Target::GatewayPlain, Target::GatewayTls]);
        if self.tls_eager.is_some() {
            targets.push(Target::GatewayTlsEager);
        }
        targets
    }

    fn client(&self, target: Target) -> anyhow::Result<Client> {
        let tls13 = Some(&[&rustls::version::TLS13][..]);
        Ok(match target {
            Target::Direct => Client::plain(self.mocker),
            Target::Nginx => {
                let nginx = self.nginx.as_ref().context("nginx not started")?;
                Client::tls(nginx.addr, &self.ca.ca_der, Alpn::Http1, tls13)?
            }
            Target::GatewayPlain => Client::plain(self.plain.addr),
            Target::GatewayTls => Client::tls(self.tls.addr, &self.ca.ca_der, Alpn::Http1, tls13)?,
            Target::GatewayTlsEager => {
                let eager = self
                    .tls_eager
                    .as_ref()
                    .context("gateway without coalescing not started")?;
                Client::tls(eager.addr, &self.ca.ca_der, Alpn::Http1, tls13)?
            }
        })
    }

    /// The proxy process a target's requests pass through, if any.
    fn proxy_pid(&self, target: Target) -> Option<u32> {
        match target {
            Target::Direct => None,
            Target::Nginx => self.nginx.as_ref().map(Nginx::pid),
            Target::GatewayPlain => Some(self.plain.process.id()),
            Target::GatewayTls => Some(self.tls.process.id()),
            Target::GatewayTlsEager => self.tls_eager.as_ref().map(|gateway| gateway.process.id()),
        }
    }
}

/// One measurement: samples, wall seconds, and the proxy's CPU seconds over the same window.
struct Measured {
    ttfb_ms: Vec<f64>,
    /// Each request's time to its last body byte.
    last_byte_ms: Vec<f64>,
    seconds: f64,
    proxy_cpu: Option<f64>,
}

impl Measured {
    fn rps(&self) -> f64 {
        self.ttfb_ms.len() as f64 / self.seconds
    }

    /// The proxy's CPU time per request in microseconds.
    fn cpu_per_request_us(&self) -> Option<f64> {
        self.proxy_cpu
            .filter(|_| !self.ttfb_ms.is_empty())
            .map(|seconds| seconds * 1e6 / self.ttfb_ms.len() as f64)
    }
}

/// Runs the overhead benchmark.
pub async fn overhead(args: OverheadArgs) -> anyhow::Result<()> {
    let max_concurrency = args
        .concurrency
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(args.rps_concurrency);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let pinning = if args.no_pin {
        None
    } else {
        Pinning::plan(cores, args.proxy_cores)
    };
    let nginx_binary = if args.nginx {
        Some(Nginx::locate(&args.nginx_binary)?)
    } else {
        None
    };
    // Each process inherits this process's cores when started: the mocker first, then the
    // proxies, then this process moves to the load generator's.
    if let Some(pinning) = &pinning {
        cpu::pin_self(&pinning.mocker)?;
    }
    let mocker = Mockers::start(&[
        "--num-workers",
        "1",
        "--speedup",
        &args.speedup.to_string(),
        "--max-num-seqs",
        &(max_concurrency * 2).to_string(),
        "--num-gpu-blocks",
        "1000000",
    ])?;
    let mocker_addr = mocker.addrs[0];
    if let Some(pinning) = &pinning {
        cpu::pin_self(&pinning.proxy)?;
    }
    let proxy_threads = pinning.as_ref().map_or(cores, |pinning| pinning.proxy.len());
    let workers = format!("[[workers]]\nname = \"mocker\"\nurl = \"http://{mocker_addr}\"\nmodel = \"mock\"\n");
    let limits = format!("[forwarding]\npool_max_idle_per_worker = {}\n", max_concurrency * 2);
    let coalesce = args
        .stream_coalesce_us
        .map(|us| format!("stream_coalesce_us = {us}\n"))
        .unwrap_or_default();
    let plain = Gateway::start(&format!("[server]\nplaintext = true\n{coalesce}{limits}{workers}"))?;
    let ca = TestCa::new()?;
    // The TLS gateway with `server` keys of its own.
    let tls_gateway = |server: &str| {
        Gateway::start(&format!(
            "mode = \"production\"\n[server]\n{server}{}\n{limits}{workers}",
            ca.tls_toml()
        ))
    };
    let tls = tls_gateway(&coalesce)?;
    let tls_eager = args
        .coalescing_off_too
        .then(|| tls_gateway("stream_coalesce_us = 0\n"))
        .transpose()?;
    let nginx = match &nginx_binary {
        Some(binary) => Some(Nginx::start(
            binary,
            proxy_threads,
            mocker_addr,
            &ca.cert_path,
            &ca.key_path,
        )?),
        None => None,
    };
    if let Some(pinning) = &pinning {
        cpu::pin_self(&pinning.load)?;
    }
    let setup = Setup {
        mocker: mocker_addr,
        plain,
        tls,
        tls_eager,
        nginx,
        _mocker: mocker,
        ca,
    };

    println!("# switchyard-bench overhead");
    println!(
        "machine: {cores} cores; mocker speed-up {}; {} tokens per stream; {} s per level; HTTP/1.1 keep-alive, one connection per stream",
        args.speedup, args.tokens, args.seconds
    );
    match &pinning {
        Some(pinning) => println!(
            "cores (taskset): proxy under test {} ({} core(s): nginx {proxy_threads} worker process(es), the gateway {proxy_threads} runtime thread(s)); mocker {}; load generator {}",
            cpu::list(&pinning.proxy),
            pinning.proxy.len(),
            cpu::list(&pinning.mocker),
            cpu::list(&pinning.load),
        ),
        None => println!("cores: not pinned, every process shares all {cores}"),
    }
    println!();
    println!("## Streamed chat completions");
    println!();
    println!(
        "| concurrency | target | streams | req/s | TTFB p50 ms | TTFB p99 ms | p50 vs direct | p99 vs direct | last byte p50 ms | proxy CPU µs/req | CPU vs nginx |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &concurrency in &args.concurrency {
        let mut direct: Option<(f64, f64)> = None;
        let mut nginx_cpu: Option<f64> = None;
        for target in setup.targets() {
            let client = setup.client(target)?;
            // Warm up connections and the engine.
            run_streams(
                &setup,
                target,
                &client,
                concurrency.min(8),
                Duration::from_millis(300),
                args.tokens,
            )
            .await?;
            let mut measured = run_streams(
                &setup,
                target,
                &client,
                concurrency,
                Duration::from_secs_f64(args.seconds),
                args.tokens,
            )
            .await?;
            measured.ttfb_ms.sort_by(f64::total_cmp);
            measured.last_byte_ms.sort_by(f64::total_cmp);
            let last50 = percentile(&measured.last_byte_ms, 0.50);
            let p50 = percentile(&measured.ttfb_ms, 0.50);
            let p99 = percentile(&measured.ttfb_ms, 0.99);
            let (r50, r99) = match direct {
                None => {
                    direct = Some((p50, p99));
                    ("1.00×".to_string(), "1.00×".to_string())
                }
                Some((d50, d99)) => (format!("{:.2}×", p50 / d50), format!("{:.2}×", p99 / d99)),
            };
            let (cpu, vs_nginx) = cpu_cells(target, &measured, &mut nginx_cpu);
            println!(
                "| {concurrency} | {} | {} | {:.0} | {p50:.3} | {p99:.3} | {r50} | {r99} | {last50:.3} | {cpu} | {vs_nginx} |",
                target.name(),
                measured.ttfb_ms.len(),
                measured.rps(),
            );
        }
    }
    println!();
    println!(
        "## Requests per second, non-streamed, 1 token, {} connections",
        args.rps_concurrency
    );
    println!();
    println!("| target | requests | req/s | vs direct | proxy CPU µs/req | CPU vs nginx |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut direct_rps = None;
    let mut nginx_cpu: Option<f64> = None;
    for target in setup.targets() {
        let client = setup.client(target)?;
        let measured = run_whole(
            &setup,
            target,
            &client,
            args.rps_concurrency,
            Duration::from_secs_f64(args.seconds),
        )
        .await?;
        let rps = measured.rps();
        let vs_direct = match direct_rps {
            None => {
                direct_rps = Some(rps);
                1.0
            }
            Some(direct) => rps / direct,
        };
        let (cpu, vs_nginx) = cpu_cells(target, &measured, &mut nginx_cpu);
        println!(
            "| {} | {} | {rps:.0} | {vs_direct:.2}× | {cpu} | {vs_nginx} |",
            target.name(),
            measured.ttfb_ms.len(),
        );
    }
    if let Some(nginx) = &setup.nginx {
        let log = nginx.error_log();
        if !log.trim().is_empty() {
            println!("\nnginx error log:\n{log}");
        }
    }
    Ok(())
}

/// The proxy-CPU cells of a row: µs per request, and the ratio to nginx's in the same table
/// (`nginx_cpu` remembers nginx's, which is measured first).
fn cpu_cells(target: Target, measured: &Measured, nginx_cpu: &mut Option<f64>) -> (String, String) {
    let cpu = measured.cpu_per_request_us();
    if target == Target::Nginx {
        *nginx_cpu = cpu;
    }
    let ratio = match (cpu, *nginx_cpu) {
        (Some(value), Some(baseline)) if baseline > 0.0 => format!("{:.2}×", value / baseline),
        _ => "—".into(),
    };
    (cpu.map_or("—".into(), |us| format!("{us:.0}")), ratio)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// `concurrency` connections each send `body` to chat completions back to back for
/// `duration` (closed loop); returns every request's time to its first and its last body byte
/// in milliseconds.
async fn closed_loop(
    client: &Client,
    concurrency: usize,
    duration: Duration,
    body: Vec<u8>,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let deadline = Instant::now() + duration;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let body = body.clone();
        tasks.spawn(async move {
            let mut connection = client.connect().await?;
            let mut samples = Vec::new();
            while Instant::now() < deadline {
                let reply = connection.send("POST", "/v1/chat/completions", body.clone()).await?;
                anyhow::ensure!(reply.status == 200, "status {}", reply.status);
                let first = reply.first_byte_ms().context("empty answer")?;
                let last = reply
                    .frames
                    .last()
                    .map_or(first, |(at, _)| at.duration_since(reply.sent).as_secs_f64() * 1000.0);
                samples.push((first, last));
            }
            anyhow::Ok(samples)
        });
    }
    let mut all = (Vec::new(), Vec::new());
    while let Some(result) = tasks.join_next().await {
        all.extend(result??);
    }
    Ok(all)
}

/// Streamed completions of `tokens` tokens through `target`: TTFBs, wall time, proxy CPU.
async fn run_streams(
    setup: &Setup,
    target: Target,
    client: &Client,
    concurrency: usize,
    duration: Duration,
    tokens: u32,
) -> anyhow::Result<Measured> {
    let body = serde_json::to_vec(&chat_body("mock", "benchmark prompt", tokens, true))?;
    measure(setup, target, client, concurrency, duration, body).await
}

/// Tiny non-streamed completions through `target`.
async fn run_whole(
    setup: &Setup,
    target: Target,
    client: &Client,
    concurrency: usize,
    duration: Duration,
) -> anyhow::Result<Measured> {
    let body = serde_json::to_vec(&chat_body("mock", "hi", 1, false))?;
    measure(setup, target, client, concurrency, duration, body).await
}

/// One closed-loop run, with the proxy's CPU time read before and after it.
async fn measure(
    setup: &Setup,
    target: Target,
    client: &Client,
    concurrency: usize,
    duration: Duration,
    body: Vec<u8>,
) -> anyhow::Result<Measured> {
    let pid = setup.proxy_pid(target);
    let cpu_before = pid.map(cpu::seconds);
    let started = Instant::now();
    let (ttfb_ms, last_byte_ms) = closed_loop(client, concurrency, duration, body)
        .await
        .with_context(|| format!("through {}", target.name()))?;
    let seconds = started.elapsed().as_secs_f64();
    let proxy_cpu = pid.zip(cpu_before).map(|(pid, before)| cpu::seconds(pid) - before);
    Ok(Measured {
        ttfb_ms,
        last_byte_ms,
        seconds,
        proxy_cpu,
    })
}
