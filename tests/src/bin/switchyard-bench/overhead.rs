//! `overhead`: one mocker and two gateways in front of it (TLS and plain HTTP); time to first
//! byte of streamed completions at several concurrency levels directly against the mocker and
//! through each gateway, and closed-loop requests per second of tiny non-streamed completions,
//! printed as a table with ratios to the direct path.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use switchyard_e2e::{Alpn, Client, Gateway, Mockers, TestCa, chat_body};

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
}

#[derive(Debug, Clone, Copy)]
enum Target {
    Direct,
    GatewayPlain,
    GatewayTls,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Direct => "direct to mocker",
            Target::GatewayPlain => "gateway (plain HTTP)",
            Target::GatewayTls => "gateway (TLS 1.3)",
        }
    }
}

struct Setup {
    _mocker: Mockers,
    mocker: SocketAddr,
    _plain: Gateway,
    plain: SocketAddr,
    _tls: Gateway,
    tls: SocketAddr,
    ca: TestCa,
}

impl Setup {
    fn client(&self, target: Target) -> anyhow::Result<Client> {
        Ok(match target {
            Target::Direct => Client::plain(self.mocker),
            Target::GatewayPlain => Client::plain(self.plain),
            Target::GatewayTls => Client::tls(self.tls, &self.ca.ca_der, Alpn::Http1, None)?,
        })
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
    let workers = format!("[[workers]]\nname = \"mocker\"\nurl = \"http://{mocker_addr}\"\nmodel = \"mock\"\n");
    let limits = format!("[forwarding]\npool_max_idle_per_worker = {}\n", max_concurrency * 2);
    let plain = Gateway::start(&format!("[server]\nplaintext = true\n{limits}{workers}"))?;
    let ca = TestCa::new()?;
    let tls = Gateway::start(&format!("mode = \"production\"\n{}\n{limits}{workers}", ca.tls_toml()))?;
    let setup = Setup {
        mocker: mocker_addr,
        plain: plain.addr,
        tls: tls.addr,
        _mocker: mocker,
        _plain: plain,
        _tls: tls,
        ca,
    };

    println!("# switchyard-bench overhead");
    println!(
        "machine: {} cores; mocker speed-up {}; {} tokens per stream; {} s per level; HTTP/1.1 keep-alive, one connection per stream",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        args.speedup,
        args.tokens,
        args.seconds
    );
    println!();
    println!("## Time to first byte of streamed chat completions");
    println!();
    println!("| concurrency | target | streams | TTFB p50 ms | TTFB p99 ms | p50 vs direct | p99 vs direct |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &concurrency in &args.concurrency {
        let mut direct: Option<(f64, f64)> = None;
        for target in [Target::Direct, Target::GatewayPlain, Target::GatewayTls] {
            let client = setup.client(target)?;
            // Warm up connections and the engine.
            run_streams(&client, concurrency.min(8), Duration::from_millis(300), args.tokens).await?;
            let mut samples =
                run_streams(&client, concurrency, Duration::from_secs_f64(args.seconds), args.tokens).await?;
            samples.sort_by(f64::total_cmp);
            let p50 = percentile(&samples, 0.50);
            let p99 = percentile(&samples, 0.99);
            let (r50, r99) = match direct {
                None => {
                    direct = Some((p50, p99));
                    ("1.00×".to_string(), "1.00×".to_string())
                }
                Some((d50, d99)) => (format!("{:.2}×", p50 / d50), format!("{:.2}×", p99 / d99)),
            };
            println!(
                "| {concurrency} | {} | {} | {p50:.3} | {p99:.3} | {r50} | {r99} |",
                target.name(),
                samples.len()
            );
        }
    }
    println!();
    println!(
        "## Requests per second, non-streamed, 1 token, {} connections",
        args.rps_concurrency
    );
    println!();
    println!("| target | requests | req/s | vs direct |");
    println!("|---|---:|---:|---:|");
    let mut direct_rps = None;
    for target in [Target::Direct, Target::GatewayPlain, Target::GatewayTls] {
        let client = setup.client(target)?;
        let (count, elapsed) = run_whole(&client, args.rps_concurrency, Duration::from_secs_f64(args.seconds)).await?;
        let rps = count as f64 / elapsed;
        let ratio = match direct_rps {
            None => {
                direct_rps = Some(rps);
                1.0
            }
            Some(direct) => rps / direct,
        };
        println!("| {} | {count} | {rps:.0} | {ratio:.2}× |", target.name());
    }
    Ok(())
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// `concurrency` connections each send `body` to chat completions back to back for
/// `duration` (closed loop); returns every request's time to first byte in milliseconds.
async fn closed_loop(
    client: &Client,
    concurrency: usize,
    duration: Duration,
    body: Vec<u8>,
) -> anyhow::Result<Vec<f64>> {
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
                samples.push(reply.first_byte_ms().context("empty answer")?);
            }
            anyhow::Ok(samples)
        });
    }
    let mut all = Vec::new();
    while let Some(result) = tasks.join_next().await {
        all.extend(result??);
    }
    Ok(all)
}

/// TTFBs of streamed completions of `tokens` tokens.
async fn run_streams(client: &Client, concurrency: usize, duration: Duration, tokens: u32) -> anyhow::Result<Vec<f64>> {
    let body = serde_json::to_vec(&chat_body("mock", "benchmark prompt", tokens, true))?;
    closed_loop(client, concurrency, duration, body).await
}

/// Tiny non-streamed completions: returns the count and the seconds taken.
async fn run_whole(client: &Client, concurrency: usize, duration: Duration) -> anyhow::Result<(usize, f64)> {
    let body = serde_json::to_vec(&chat_body("mock", "hi", 1, false))?;
    let started = Instant::now();
    let count = closed_loop(client, concurrency, duration, body).await?.len();
    Ok((count, started.elapsed().as_secs_f64()))
}
