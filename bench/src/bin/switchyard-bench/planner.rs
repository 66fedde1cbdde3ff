//! `switchyard-bench planner`: the planner against a load that rises and falls.
//!
//! For each fleet — the `load-based` and `sla-based` planners, and fixed fleets at the minimum
//! and at the maximum (a pool whose bounds are equal) — it starts `nats-server`, a gateway whose
//! `[planner]` runs `switchyard-mocker` processes through the `process` connector, and replays
//! an Azure LLM inference trace (2023; `TIMESTAMP,ContextTokens,GeneratedTokens`) open loop,
//! time-compressed, with synthesized prompts (random bytes: the mock model's tokenizer reads
//! one token a byte, and nothing is cached across requests). It prints, side by side: TTFT
//! target attainment, worker-seconds (processes alive, sampled from `GET /admin/planner`), as
//! a share of the fixed maximum's, the first scale-up's time, and the first adjustment interval
//! whose p90 TTFT broke the target.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use switchyard_harness::{Admin, Client, Gateway, NatsServer, binary};

const TOKEN: &str = "planner-bench-admin-token-012345";

/// Arguments of `switchyard-bench planner`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlannerArgs {
    /// Azure LLM inference trace (CSV: TIMESTAMP,ContextTokens,GeneratedTokens).
    trace: PathBuf,
    /// Skip the trace's first seconds.
    #[arg(long, default_value_t = 0.0)]
    start_s: f64,
    /// Trace seconds to replay.
    #[arg(long, default_value_t = 600.0)]
    duration_s: f64,
    /// Trace time runs this many times faster.
    #[arg(long, default_value_t = 10.0)]
    speedup: f64,
    /// Longest prompt sent (tokens); longer ones are cut.
    #[arg(long, default_value_t = 4096)]
    max_prompt: usize,
    /// Longest answer asked for (tokens).
    #[arg(long, default_value_t = 256)]
    max_output: u32,
    /// TTFT target of every request, ms.
    #[arg(long, default_value_t = 1000)]
    ttft_target_ms: u32,
    /// The pool's bounds.
    #[arg(long, default_value_t = 1)]
    min_workers: u32,
    #[arg(long, default_value_t = 4)]
    max_workers: u32,
    /// The planner's adjustment interval, seconds.
    #[arg(long, default_value_t = 2.0)]
    adjustment_interval_s: f64,
    /// The mockers' speed-up (below 1: slower engines, so a small machine can load them).
    #[arg(long, default_value_t = 0.2)]
    mocker_speedup: f64,
    /// Requests per second one worker serves within the target (the sla-based profile;
    /// measure it with a fixed fleet of one).
    #[arg(long, default_value_t = 2.0)]
    profile_rate: f64,
    /// Fleets to run: load-based, sla-based, fixed-min, fixed-max.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "load-based,sla-based,fixed-min,fixed-max"
    )]
    fleets: Vec<String>,
    /// `[planner] policy_config` for load-based, as TOML (e.g. its thresholds).
    #[arg(long, default_value = "")]
    load_based_config: String,
}

/// One request of the trace.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    at: Duration,
    prompt: usize,
    output: u32,
}

fn parse_time(text: &str) -> Option<f64> {
    // `2023-11-16 18:15:46.6805900`: seconds within the day are enough (the trace spans an hour).
    let time = text.split_whitespace().nth(1)?;
    let mut parts = time.split(':');
    let hours: f64 = parts.next()?.parse().ok()?;
    let minutes: f64 = parts.next()?.parse().ok()?;
    let seconds: f64 = parts.next()?.parse().ok()?;
    Some(hours * 3600.0 + minutes * 60.0 + seconds)
}

fn load_trace(args: &PlannerArgs) -> anyhow::Result<Vec<Arrival>> {
    let text = std::fs::read_to_string(&args.trace).with_context(|| format!("reading {}", args.trace.display()))?;
    let mut rows = Vec::new();
    for (number, line) in text.lines().enumerate().skip(1) {
        let mut fields = line.split(',');
        let (Some(time), Some(context), Some(generated)) = (fields.next(), fields.next(), fields.next()) else {
            anyhow::bail!("{}:{}: expected 3 fields", args.trace.display(), number + 1);
        };
        let time =
            parse_time(time).with_context(|| format!("{}:{}: bad TIMESTAMP", args.trace.display(), number + 1))?;
        rows.push((time, context.trim().parse::<usize>()?, generated.trim().parse::<u32>()?));
    }
    let first = rows.first().map_or(0.0, |row| row.0);
    Ok(rows
        .into_iter()
        .map(|(time, prompt, output)| (time - first, prompt, output))
        .filter(|(offset, _, _)| *offset >= args.start_s && *offset < args.start_s + args.duration_s)
        .map(|(offset, prompt, output)| Arrival {
            at: Duration::from_secs_f64((offset - args.start_s) / args.speedup),
            prompt: prompt.clamp(1, args.max_prompt),
            output: output.clamp(1, args.max_output),
        })
        .collect())
}

/// What one fleet's run measured.
#[derive(Debug)]
struct Outcome {
    fleet: String,
    requests: usize,
    failed: usize,
    attainment: f64,
    ttft_p90_ms: f64,
    worker_seconds: f64,
    first_scale_up_s: Option<f64>,
    first_broken_interval_s: Option<f64>,
}

fn gateway_config(args: &PlannerArgs, fleet: &str, nats: &str, mocker: &str) -> String {
    let (policy, min, max, policy_config) = match fleet {
        "load-based" => (
            "load-based",
            args.min_workers,
            args.max_workers,
            args.load_based_config.clone(),
        ),
        "sla-based" => ("sla-based", args.min_workers, args.max_workers, String::new()),
        "fixed-min" => ("sla-based", args.min_workers, args.min_workers, String::new()),
        _ => ("sla-based", args.max_workers, args.max_workers, String::new()),
    };
    format!(
        r#"[server]
plaintext = true
[forwarding]
response_timeout_ms = 900000
[kv]
nats_url = "{nats}"
[[models]]
name = "mock"
ttft_target_ms = {target}
[planner]
policy = "{policy}"
metric_interval_ms = 250
adjustment_interval_s = {interval}
connector = "process"
[planner.policy_config]
{policy_config}
[[planner.pools]]
model = "mock"
min_workers = {min}
max_workers = {max}
name_prefix = "bench"
prefill_tokens_per_s = {prefill}
profile = [{{ isl = 1, osl = 1, rate = {rate} }}]
command = ["{mocker}", "--nats", "{nats}", "--name", "{{name}}", "--heartbeat-ms", "250", "--speedup", "{speedup}"]
"#,
        target = args.ttft_target_ms,
        interval = args.adjustment_interval_s,
        // The mocker prefills ~48k tokens a second at speed 1.
        prefill = 48_000.0 * args.mocker_speedup,
        rate = args.profile_rate,
        speedup = args.mocker_speedup,
    )
}

/// Processes alive in the pool and whether any scale-up is on record.
async fn pool_state(admin: &Admin) -> (usize, bool) {
    let (_, status) = admin
        .call("GET", "/admin/planner", Vec::new())
        .await
        .unwrap_or_default();
    let pool = &status["pools"][0];
    let alive = pool["ready"].as_array().map_or(0, Vec::len)
        + pool["starting"].as_u64().unwrap_or(0) as usize
        + pool["draining"].as_u64().unwrap_or(0) as usize;
    let scaled_up = status["plans"].as_array().is_some_and(|plans| {
        plans.iter().any(|plan| {
            plan["decisions"]
                .as_array()
                .is_some_and(|d| d.iter().any(|d| d["to"].as_u64() > d["from"].as_u64()))
        })
    });
    (alive, scaled_up)
}

/// `tokens` random letters (one token a byte on the mock model), different per `seed`, so no
/// prefix is shared; `profile` uses it too.
pub(crate) fn prompt_text(tokens: usize, seed: u64) -> String {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..tokens)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(b'a' + (state % 26) as u8)
        })
        .collect()
}

async fn run_fleet(args: &PlannerArgs, fleet: &str, arrivals: &[Arrival]) -> anyhow::Result<Outcome> {
    let nats = NatsServer::start()?;
    let mocker = binary("switchyard-mocker")?;
    let config = gateway_config(args, fleet, &nats.url, &mocker.display().to_string());
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let client = Client::plain(gateway.addr);
    // The pool's starting size first.
    let want = if fleet == "fixed-max" {
        args.max_workers
    } else {
        args.min_workers
    } as usize;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, status) = admin
            .call("GET", "/admin/planner", Vec::new())
            .await
            .unwrap_or_default();
        if status["pools"][0]["ready"].as_array().map_or(0, Vec::len) >= want {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "{fleet}: the pool did not come up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let started = tokio::time::Instant::now();
    // Worker-seconds and the first scale-up's time, sampled while the trace plays.
    let sampled = std::sync::Arc::new(parking_lot::Mutex::new((0.0f64, None::<f64>)));
    let sampler = {
        let admin = admin.clone();
        let sampled = sampled.clone();
        tokio::spawn(async move {
            let mut last = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let (alive, scaled_up) = pool_state(&admin).await;
                let now = Instant::now();
                let mut sampled = sampled.lock();
                sampled.0 += alive as f64 * now.duration_since(last).as_secs_f64();
                last = now;
                if scaled_up && sampled.1.is_none() {
                    sampled.1 = Some(started.elapsed().as_secs_f64());
                }
            }
        })
    };
    let mut tasks = Vec::with_capacity(arrivals.len());
    for (index, arrival) in arrivals.iter().enumerate() {
        tokio::time::sleep_until(started + arrival.at).await;
        let client = client.clone();
        let arrival = *arrival;
        tasks.push(tokio::spawn(async move {
            let body = serde_json::json!({
                "model": "mock",
                "messages": [{"role": "user", "content": prompt_text(arrival.prompt, index as u64)}],
                "max_tokens": arrival.output,
                "stream": true,
            });
            let sent = started.elapsed().as_secs_f64();
            let reply = async {
                let mut connection = client.connect().await?;
                connection
                    .send("POST", "/v1/chat/completions", serde_json::to_vec(&body)?)
                    .await
            }
            .await;
            match reply {
                Ok(reply) if reply.status == 200 => (sent, reply.first_byte_ms()),
                _ => (sent, None),
            }
        }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    for task in tasks {
        results.push(task.await.unwrap_or((0.0, None)));
    }
    sampler.abort();
    let (worker_seconds, first_scale_up_s) = *sampled.lock();
    let target = f64::from(args.ttft_target_ms);
    let failed = results.iter().filter(|(_, ttft)| ttft.is_none()).count();
    let met = results
        .iter()
        .filter(|(_, ttft)| ttft.is_some_and(|ms| ms <= target))
        .count();
    let mut ttfts: Vec<f64> = results.iter().filter_map(|(_, ttft)| *ttft).collect();
    ttfts.sort_by(f64::total_cmp);
    let p90 = |values: &[f64]| {
        if values.is_empty() {
            0.0
        } else {
            values[((values.len() - 1) as f64 * 0.9).round() as usize]
        }
    };
    // The first adjustment interval (by send time) whose p90 TTFT broke the target.
    let interval = args.adjustment_interval_s;
    let mut by_interval: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for (sent, ttft) in &results {
        by_interval
            .entry((sent / interval) as u64)
            .or_default()
            .push(ttft.unwrap_or(f64::INFINITY));
    }
    let first_broken_interval_s = by_interval.iter_mut().find_map(|(number, values)| {
        values.sort_by(f64::total_cmp);
        (p90(values) > target).then_some(*number as f64 * interval)
    });
    drop(gateway);
    Ok(Outcome {
        fleet: fleet.to_string(),
        requests: results.len(),
        failed,
        attainment: met as f64 / results.len().max(1) as f64,
        ttft_p90_ms: p90(&ttfts),
        worker_seconds,
        first_scale_up_s,
        first_broken_interval_s,
    })
}

/// Runs every fleet and prints the table.
pub async fn run(args: PlannerArgs) -> anyhow::Result<()> {
    let arrivals = load_trace(&args)?;
    anyhow::ensure!(!arrivals.is_empty(), "no request of the trace falls in the window");
    let span = arrivals.last().map_or(0.0, |a| a.at.as_secs_f64());
    println!(
        "{} requests over {:.0} s of trace ({:.1} s at {}x); TTFT target {} ms; pool {}..={}; mockers at {}x",
        arrivals.len(),
        args.duration_s,
        span,
        args.speedup,
        args.ttft_target_ms,
        args.min_workers,
        args.max_workers,
        args.mocker_speedup
    );
    let mut outcomes = Vec::new();
    for fleet in &args.fleets {
        anyhow::ensure!(
            ["load-based", "sla-based", "fixed-min", "fixed-max"].contains(&fleet.as_str()),
            "unknown fleet `{fleet}`: load-based, sla-based, fixed-min, fixed-max"
        );
        eprintln!("== {fleet}");
        let outcome = run_fleet(&args, fleet, &arrivals).await?;
        eprintln!("   {outcome:?}");
        outcomes.push(outcome);
    }
    let max_seconds = outcomes
        .iter()
        .find(|o| o.fleet == "fixed-max")
        .map(|o| o.worker_seconds);
    println!();
    println!(
        "| fleet | TTFT target met | TTFT p90 ms | failed | worker-seconds | of fixed-max | first scale-up s | first interval over target s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for o in &outcomes {
        let share = max_seconds.map_or("-".to_string(), |max| {
            format!("{:.0} %", o.worker_seconds / max.max(1e-9) * 100.0)
        });
        let when = |t: Option<f64>| t.map_or("never".to_string(), |t| format!("{t:.1}"));
        println!(
            "| {} | {:.1} % | {:.0} | {}/{} | {:.1} | {} | {} | {} |",
            o.fleet,
            o.attainment * 100.0,
            o.ttft_p90_ms,
            o.failed,
            o.requests,
            o.worker_seconds,
            share,
            when(o.first_scale_up_s),
            when(o.first_broken_interval_s),
        );
    }
    Ok(())
}
