//! The planner sizing a prefill pool and a decode pool of one model, each by its own figures.
//!
//! Through the real host (the built-in planners compiled to Wasm, called through the planner
//! switch): `load-based` moves a prefill pool by its queue and a decode pool by its KV usage,
//! in opposite directions in one plan; `sla-based` sizes a prefill pool by TTFT (and the
//! capacity to compute its queue within it) and a decode pool by ITL.
//!
//! On a live fleet: the gateway's `process` connector runs `switchyard-mocker --role prefill`
//! and `--role decode` processes, `pd-threshold` sends every prompt through a prefill worker,
//! and `load-based` plans every second. Long prompts with one output token fill the prefill
//! queue and leave the decode workers' KV well within bounds: the prefill pool grows, the
//! decode pool holds. Then short prompts with long streams fill the decode workers' KV while
//! the prefill queue empties: the decode pool grows and the prefill pool shrinks. Directions
//! are asserted, not counts or times (the machine may be loaded).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use switchyard::planning::{
    IntervalStats, PlannedBy, PlannerSwitch, PolicyRuntime, Pool, PoolRole, RuntimeConfig, SwitchConfig,
    built_in_planner,
};
use switchyard_harness::{Admin, Client, Gateway, NatsServer, binary, chat_body, eventually};

const TOKEN: &str = "planner-pd-token-0123456789abcdef";

fn built_in(name: &str) -> PlannerSwitch {
    let runtime = Arc::new(
        PolicyRuntime::new(RuntimeConfig {
            deadline: Duration::from_millis(50),
            memory_limit_bytes: 64 << 20,
            cache_dir: None,
            max_instances: 16,
        })
        .expect("a policy runtime"),
    );
    let policy = runtime
        .load_planner(name, built_in_planner(name).expect("a built-in"), toml::Table::new())
        .expect("the planner loads");
    PlannerSwitch::new(policy, SwitchConfig::default())
}

/// One interval: request rate, KV usage, prefill queue tokens, p90 TTFT and ITL (ms).
fn interval(rate: f32, kv_usage: f32, queue: f32, ttft_p90_ms: f32, itl_p90_ms: f32) -> IntervalStats {
    IntervalStats {
        request_rate: rate,
        mean_isl: 1000.0,
        mean_osl: 100.0,
        ttft_p50_ms: ttft_p90_ms / 2.0,
        ttft_p90_ms,
        itl_p50_ms: itl_p90_ms / 2.0,
        itl_p90_ms,
        kv_usage,
        prefill_queue_tokens: queue,
    }
}

fn pool(role: PoolRole, desired: u32, recent: Vec<IntervalStats>) -> Pool {
    Pool {
        model: "m".into(),
        role,
        ready: desired,
        starting: 0,
        draining: 0,
        desired,
        min_workers: 1,
        max_workers: 8,
        gpus_per_worker: 1,
        ttft_target_ms: 1000.0,
        itl_target_ms: 50.0,
        prefill_capacity_tokens: 1000.0,
        profiled_rate: 2.0,
        intervals_since_scale_up: u32::MAX,
        recent,
    }
}

/// The decisions as (pool, replicas), and that the policy (not the fallback) made them.
fn plan(switch: &PlannerSwitch, pools: &[Pool]) -> Vec<(u32, u32)> {
    let (decisions, by) = switch.plan(pools, 0);
    assert!(matches!(by, PlannedBy::Policy(_)), "decided by {}", by.label());
    decisions.iter().map(|d| (d.pool, d.replicas)).collect()
}

#[test]
fn planner_pd_load_based_moves_each_pool_by_its_own_rule() {
    let planner = built_in("load-based");
    // Long prompts: the prefill queue at 1.5 of 2 workers' capacity and rising, KV low
    // everywhere; the decode pool's own queue figure is not its rule's.
    let prefill = pool(
        PoolRole::Prefill,
        2,
        vec![
            interval(1.0, 0.1, 2000.0, 0.0, 0.0),
            interval(1.0, 0.1, 3000.0, 0.0, 0.0),
        ],
    );
    let decode = pool(PoolRole::Decode, 3, vec![interval(1.0, 0.2, 9000.0, 0.0, 0.0)]);
    assert_eq!(plan(&planner, &[prefill, decode.clone()]), [(1, 2), (0, 3)]);
    // Long streams: decode KV usage 0.95, the prefill queue nearly empty.
    let idle = pool(PoolRole::Prefill, 2, vec![interval(1.0, 0.99, 100.0, 0.0, 0.0)]);
    let full = pool(PoolRole::Decode, 2, vec![interval(1.0, 0.95, 0.0, 0.0, 0.0)]);
    assert_eq!(plan(&planner, &[idle.clone(), full]), [(0, 1), (1, 3)]);
    // A decode pool that just grew keeps its new worker through the grace period.
    let mut warming = decode;
    warming.intervals_since_scale_up = 1;
    assert_eq!(plan(&planner, &[idle, warming]), [(0, 1)]);
}

#[test]
fn planner_pd_sla_based_sizes_prefill_by_ttft_and_decode_by_itl() {
    let planner = built_in("sla-based");
    // Both pools at 5 req/s (→ 5 × 1.1 / 2 per worker: 3 workers), TTFT twice its target and
    // ITL within its own: the prefill pool takes the correction (→ 6), the decode pool not.
    let late_prompts = |role| pool(role, 2, vec![interval(5.0, 0.5, 0.0, 2000.0, 20.0)]);
    assert_eq!(
        plan(
            &planner,
            &[late_prompts(PoolRole::Prefill), late_prompts(PoolRole::Decode)]
        ),
        [(0, 6), (1, 3)]
    );
    // ITL twice its target and TTFT within: the converse.
    let slow_tokens = |role| pool(role, 2, vec![interval(5.0, 0.5, 0.0, 500.0, 100.0)]);
    assert_eq!(
        plan(
            &planner,
            &[slow_tokens(PoolRole::Prefill), slow_tokens(PoolRole::Decode)]
        ),
        [(0, 3), (1, 6)]
    );
    // A queue the prefill pool cannot compute within the TTFT target: 9000 tokens, at
    // 2 req/s × 1000 tokens a worker, within 1 s → 5 workers, though the rate needs 1; the
    // decode pool at that rate shrinks by one.
    let queued = pool(PoolRole::Prefill, 2, vec![interval(1.0, 0.5, 9000.0, 500.0, 20.0)]);
    let decode = pool(PoolRole::Decode, 3, vec![interval(1.0, 0.5, 9000.0, 500.0, 20.0)]);
    assert_eq!(plan(&planner, &[queued, decode]), [(1, 2), (0, 5)]);
}

/// A pool of `role` as `GET /admin/planner` shows it.
async fn pool_status(admin: &Admin, role: &str) -> Value {
    let (_, status) = admin
        .call("GET", "/admin/planner", Vec::new())
        .await
        .unwrap_or_default();
    status["pools"]
        .as_array()
        .and_then(|pools| pools.iter().find(|pool| pool["role"] == role))
        .cloned()
        .unwrap_or_default()
}

fn ready(pool: &Value) -> usize {
    pool["ready"].as_array().map_or(0, Vec::len)
}

fn desired(pool: &Value) -> u64 {
    pool["desired"].as_u64().unwrap_or(0)
}

/// Every decision on record made at or after `since` (Unix ms) as (role, from, to, reason),
/// oldest first.
async fn decisions(admin: &Admin, since: u64) -> Vec<(String, u64, u64, String)> {
    let (_, status) = admin
        .call("GET", "/admin/planner", Vec::new())
        .await
        .unwrap_or_default();
    status["plans"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|plan| plan["at_unix_ms"].as_u64().unwrap_or(0) >= since)
        .flat_map(|plan| plan["decisions"].as_array().cloned().unwrap_or_default())
        .map(|d| {
            (
                d["role"].as_str().unwrap_or_default().to_string(),
                d["from"].as_u64().unwrap_or(0),
                d["to"].as_u64().unwrap_or(0),
                d["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// The last plan's observations of the pool of `role`.
async fn observed(admin: &Admin, role: &str) -> Value {
    let (_, status) = admin
        .call("GET", "/admin/planner", Vec::new())
        .await
        .unwrap_or_default();
    status["plans"]
        .as_array()
        .and_then(|plans| plans.last())
        .and_then(|plan| plan["observations"].as_array())
        .and_then(|pools| pools.iter().find(|pool| pool["role"] == role))
        .cloned()
        .unwrap_or_default()
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A prompt of `tokens` bytes (the gateway's fallback tokenizer: one token a byte) that
/// shares no block with any other: its first block names it.
fn prompt(tag: &str, tokens: usize) -> String {
    let mut text = format!("{tag} ");
    text.push_str(&"x".repeat(tokens.saturating_sub(text.len())));
    text
}

/// Clients `clients` (numbers, for their prompts' tags) that each send one request after
/// another until `stop`: `prompt_tokens`-token prompts, `max_tokens` each, streamed or not;
/// `failed` counts answers that were not 200.
#[allow(clippy::too_many_arguments, reason = "a load's shape, each part named")]
fn closed_loop(
    client: &Client,
    tag: &'static str,
    clients: std::ops::Range<usize>,
    prompt_tokens: usize,
    max_tokens: u32,
    stream: bool,
    stop: &Arc<AtomicBool>,
    failed: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    clients
        .map(|c| {
            let (client, stop, failed) = (client.clone(), stop.clone(), failed.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let body = chat_body(
                        "mock",
                        &prompt(&format!("{tag}-{c}-{n}"), prompt_tokens),
                        max_tokens,
                        stream,
                    );
                    match client.post_json("/v1/chat/completions", &body).await {
                        Ok(reply) if reply.status == 200 => {}
                        other => {
                            match other {
                                Ok(reply) => eprintln!("{tag}: answered {}", reply.status),
                                Err(err) => eprintln!("{tag}: {err}"),
                            }
                            failed.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planner_pd_the_prefill_and_decode_pools_move_by_their_own_rules() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let mocker = binary("switchyard-mocker")?;
    let command = |role: &str, extra: &str| {
        format!(
            r#"["{mocker}", "--nats", "{nats}", "--name", "{{name}}", "--heartbeat-ms", "200", "--role", "{role}"{extra}]"#,
            mocker = mocker.display(),
            nats = nats.url,
        )
    };
    // Decode workers of 512 blocks (32 768 tokens): 6 requests of 4000-token prompts hold
    // 6 × 62 of them (0.73, within the KV thresholds); 24 streams of 1600-token prompts hold
    // 24 × 25 (1.17, above 0.9). A prefill worker's capacity is 6000 tokens an interval: the
    // 6 long prompts keep the queue far above half of it, one 1600-token prompt every 100 ms
    // far below a fifth.
    let config = format!(
        r#"[server]
plaintext = true
[kv]
nats_url = "{nats}"
[policy]
router = "pd-threshold"
deadline_ms = 50
[policy.config]
max_local_prefill_tokens = 0
max_prefill_queue = 100000
[planner]
policy = "load-based"
metric_interval_ms = 100
adjustment_interval_s = 1.0
connector = "process"
[planner.policy_config]
grace_intervals = 2
[[planner.pools]]
model = "mock"
role = "prefill"
min_workers = 1
max_workers = 3
name_prefix = "prefill"
prefill_tokens_per_s = 6000
command = {prefill}
[[planner.pools]]
model = "mock"
role = "decode"
min_workers = 1
max_workers = 3
name_prefix = "decode"
command = {decode}
"#,
        nats = nats.url,
        prefill = command("prefill", ""),
        decode = command("decode", r#", "--num-gpu-blocks", "512""#),
    );
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let client = Client::plain(gateway.addr);
    let failed = Arc::new(AtomicU64::new(0));
    assert!(
        eventually(Duration::from_secs(20), || async {
            ready(&pool_status(&admin, "prefill").await) == 1 && ready(&pool_status(&admin, "decode").await) == 1
        })
        .await,
        "each pool's first worker came up: {} {}",
        pool_status(&admin, "prefill").await,
        pool_status(&admin, "decode").await
    );

    // Long prompts, one token each: the prefill queue fills, the decode KV does not.
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let long_prompts = closed_loop(&client, "long", 0..6, 4000, 1, false, &stop, &failed);
    let grew = eventually(Duration::from_secs(15), || async {
        desired(&pool_status(&admin, "prefill").await) >= 2
    })
    .await;
    let prefill_seen = observed(&admin, "prefill").await;
    let decode_seen = observed(&admin, "decode").await;
    stop.store(true, Ordering::Relaxed);
    for client in long_prompts {
        client.await?;
    }
    assert!(
        grew,
        "the prefill pool grew under long prompts: {} (observed {prefill_seen})",
        pool_status(&admin, "prefill").await
    );
    println!(
        "long prompts: the prefill pool grew {:.1} s in; last observed prefill {prefill_seen}, decode {decode_seen}",
        started.elapsed().as_secs_f64()
    );
    let phase_a = decisions(&admin, 0).await;
    assert!(
        phase_a
            .iter()
            .any(|(role, from, to, reason)| role == "prefill" && to > from && reason.contains("queue")),
        "a prefill scale-up by its queue is on record: {phase_a:?}"
    );
    assert!(
        !phase_a.iter().any(|(role, from, to, _)| role == "decode" && to > from),
        "the decode pool did not grow under long prompts: {phase_a:?}"
    );
    assert_eq!(desired(&pool_status(&admin, "decode").await), 1, "the decode pool held");

    // Short prompts, long streams, one more every 100 ms: decode KV fills, the prefill
    // queue empties.
    let converse = Instant::now();
    let converse_ms = unix_ms();
    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = Vec::new();
    let moved = loop {
        if streams.len() < 24 {
            let next = streams.len();
            streams.extend(closed_loop(
                &client,
                "stream",
                next..next + 1,
                1600,
                400,
                true,
                &stop,
                &failed,
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let after = decisions(&admin, converse_ms).await;
        let decode_up = after
            .iter()
            .any(|(role, from, to, reason)| role == "decode" && to > from && reason.contains("kv"));
        let prefill_down = after
            .iter()
            .any(|(role, from, to, reason)| role == "prefill" && to < from && reason.contains("queue"));
        if decode_up && prefill_down {
            break true;
        }
        if converse.elapsed() > Duration::from_secs(20) {
            break false;
        }
    };
    let after = decisions(&admin, converse_ms).await;
    let (prefill_seen, decode_seen) = (observed(&admin, "prefill").await, observed(&admin, "decode").await);
    stop.store(true, Ordering::Relaxed);
    for stream in &streams {
        stream.abort();
    }
    assert!(
        moved,
        "under long streams the decode pool grew by its KV usage and the prefill pool shrank by its queue: \
         decisions {after:?}; last observed prefill {prefill_seen}, decode {decode_seen}"
    );
    assert!(
        !after.iter().any(|(role, from, to, _)| role == "decode" && to < from),
        "the decode pool never shrank under long streams: {after:?}"
    );
    println!(
        "long streams: decode up and prefill down within {:.1} s ({after:?}); {} requests failed in all",
        converse.elapsed().as_secs_f64(),
        failed.load(Ordering::Relaxed)
    );
    Ok(())
}
