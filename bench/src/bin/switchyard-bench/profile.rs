//! `switchyard-bench profile`: how many requests a second one worker serves within a TTFT
//! target, at each prompt and output length asked for — the profile `sla-based` reads
//! (`[[planner.pools]] profile`).
//!
//! For each (ISL, OSL) point it sends open-loop streams of that shape to the worker (directly,
//! at its OpenAI API: the profile is the worker's, not the gateway's) at a trial rate for a
//! few seconds, and takes the rate as met when the p90 TTFT of the trial stays within the
//! target and every request answered. A doubling search finds a rate that fails, a bisection
//! narrows the highest that meets it. Prompts are random text (one token a byte on the mock
//! model), so no prefix is cached. It prints the TOML to paste.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use switchyard_harness::{Client, Mockers};

/// Arguments of `switchyard-bench profile`.
#[derive(Debug, Clone, clap::Args)]
pub struct ProfileArgs {
    /// The worker to profile (`HOST:PORT` of its OpenAI API); default: a `switchyard-mocker`
    /// started here with `--mocker-speedup`.
    #[arg(long)]
    worker: Option<SocketAddr>,
    /// Speed-up of the mocker started when no --worker is given.
    #[arg(long, default_value_t = 1.0)]
    mocker_speedup: f64,
    /// The model name to ask for.
    #[arg(long, default_value = "mock")]
    model: String,
    /// Points to measure, `ISL:OSL` (tokens), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "512:32,2048:32,8192:32")]
    points: Vec<String>,
    /// The TTFT target the rate must keep at p90, ms.
    #[arg(long, default_value_t = 1000)]
    ttft_target_ms: u32,
    /// Seconds each trial rate runs.
    #[arg(long, default_value_t = 4.0)]
    trial_s: f64,
    /// Bisection steps after the doubling search.
    #[arg(long, default_value_t = 4)]
    steps: u32,
}

/// One trial: the p90 TTFT at `rate` requests a second, and whether every request answered.
async fn trial(client: &Client, args: &ProfileArgs, isl: usize, osl: u32, rate: f64, seed: &mut u64) -> (f64, bool) {
    let count = (rate * args.trial_s).ceil().max(1.0) as usize;
    let gap = Duration::from_secs_f64(1.0 / rate);
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(count);
    for index in 0..count {
        tokio::time::sleep_until(started + gap * index as u32).await;
        *seed += 1;
        let body = serde_json::json!({
            "model": args.model,
            "messages": [{"role": "user", "content": crate::planner::prompt_text(isl, *seed)}],
            "max_tokens": osl,
            "stream": true,
        });
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let mut connection = client.connect().await.ok()?;
            let reply = connection
                .send("POST", "/v1/chat/completions", serde_json::to_vec(&body).ok()?)
                .await
                .ok()?;
            let first = reply.frames.first()?.0;
            (reply.status == 200).then(|| first.duration_since(sent).as_secs_f64() * 1000.0)
        }));
    }
    let mut ttfts = Vec::with_capacity(count);
    let mut all = true;
    for task in tasks {
        match task.await.ok().flatten() {
            Some(ttft) => ttfts.push(ttft),
            None => all = false,
        }
    }
    ttfts.sort_by(f64::total_cmp);
    let p90 = ttfts
        .get(((ttfts.len().max(1) - 1) as f64 * 0.9).round() as usize)
        .copied()
        .unwrap_or(f64::INFINITY);
    (p90, all)
}

/// Measures every point and prints the profile.
pub async fn run(args: ProfileArgs) -> anyhow::Result<()> {
    let mut points = Vec::new();
    for point in &args.points {
        let (isl, osl) = point
            .split_once(':')
            .ok_or_else(|| anyhow::anyhow!("point `{point}`: ISL:OSL"))?;
        points.push((isl.trim().parse::<usize>()?, osl.trim().parse::<u32>()?));
    }
    anyhow::ensure!(args.trial_s > 0.0, "--trial-s must be positive");
    let _mocker;
    let addr = match args.worker {
        Some(addr) => addr,
        None => {
            let speedup = args.mocker_speedup.to_string();
            let mocker = Mockers::start(&["--speedup", &speedup, "--model", &args.model])?;
            let addr = *mocker
                .addrs
                .first()
                .ok_or_else(|| anyhow::anyhow!("the mocker printed no address"))?;
            _mocker = mocker;
            addr
        }
    };
    let client = Client::plain(addr);
    let target = f64::from(args.ttft_target_ms);
    let mut seed = 0u64;
    let mut profile = Vec::new();
    for (isl, osl) in points {
        // Double until a rate fails, then bisect between the last that met and the first
        // that failed.
        let (mut met, mut failed) = (0.0f64, None::<f64>);
        let mut rate = 1.0;
        while failed.is_none() && rate <= 4096.0 {
            let (p90, all) = trial(&client, &args, isl, osl, rate, &mut seed).await;
            eprintln!(
                "  {isl}:{osl} at {rate:.2} req/s: p90 TTFT {p90:.0} ms{}",
                if all { "" } else { ", some failed" }
            );
            if all && p90 <= target {
                met = rate;
                rate *= 2.0;
            } else {
                failed = Some(rate);
            }
            // Let the worker drain between trials.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        if let Some(mut high) = failed {
            for _ in 0..args.steps {
                let middle = (met + high) / 2.0;
                let (p90, all) = trial(&client, &args, isl, osl, middle, &mut seed).await;
                eprintln!(
                    "  {isl}:{osl} at {middle:.2} req/s: p90 TTFT {p90:.0} ms{}",
                    if all { "" } else { ", some failed" }
                );
                if all && p90 <= target {
                    met = middle;
                } else {
                    high = middle;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        println!("{isl}:{osl}: {met:.2} req/s within p90 TTFT {target:.0} ms");
        profile.push(format!("{{ isl = {isl}, osl = {osl}, rate = {met:.2} }}"));
    }
    println!();
    println!("profile = [{}]", profile.join(", "));
    Ok(())
}
