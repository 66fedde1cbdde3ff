//! KV-aware routing end to end: mockers publish their KV events (in process, or over a real
//! `nats-server`), the gateway indexes them, and the `kv-aware` policy uses the overlap.

use std::collections::HashMap;
use std::time::Duration;

use switchyard_harness::{Admin, Client, Gateway, Mockers, NatsServer, cached_blocks, eventually, metric_sum};

const TOKEN: &str = "kv-routing-admin-token";

/// A system prompt of about `chars` bytes (the fallback tokenizer: one token per byte).
fn system_prompt(seed: &str, chars: usize) -> String {
    let mut text = String::new();
    let mut i = 0;
    while text.len() < chars {
        text.push_str(&format!("{seed} rule {i}: answer carefully and cite sources. "));
        i += 1;
    }
    text
}

fn chat(system: &str, user: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "mock",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

async fn metrics(client: &Client) -> anyhow::Result<String> {
    let reply = client.send("GET", "/metrics", Vec::new()).await?;
    Ok(String::from_utf8_lossy(&reply.body()).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_system_prompt_goes_to_the_worker_that_cached_it() -> anyhow::Result<()> {
    let config = "[server]\nplaintext = true\n[embedded_mockers]\ncount = 4\nspeedup = 20.0\n";
    let (gateway, admin) = Gateway::start_with_admin(config, TOKEN)?;
    let client = Client::plain(gateway.addr);
    let system = system_prompt("support-bot", 3000);

    let first = client
        .post_json("/v1/chat/completions", &chat(&system, "question 0", 4, false))
        .await?;
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body()));
    let home = first.worker();
    // 3000+ prompt bytes at 64 tokens per block: the index learns ~47 blocks on `home`.
    assert!(
        eventually(Duration::from_secs(10), || async {
            admin.kv_summary().await.is_ok_and(|s| cached_blocks(&s, &home) >= 40)
        })
        .await,
        "the index never learned the first request's blocks: {}",
        admin.kv_summary().await?
    );
    let mut placed: HashMap<String, usize> = HashMap::new();
    for i in 1..=12 {
        let reply = client
            .post_json(
                "/v1/chat/completions",
                &chat(&system, &format!("question {i}"), 4, false),
            )
            .await?;
        assert_eq!(reply.status, 200);
        *placed.entry(reply.worker()).or_default() += 1;
    }
    // Without overlap every worker costs the same and the tie-break spreads requests at
    // random: 12 in a row on one worker of four would be chance (1 in 4^12).
    assert_eq!(
        placed.get(&home),
        Some(&12),
        "placements: {placed:?} (cached on {home})"
    );
    let text = metrics(&client).await?;
    assert!(metric_sum(&text, "switchyard_kv_overlap_ratio_count", &[]) >= 13.0);
    assert!(
        metric_sum(&text, "switchyard_kv_overlap_ratio_sum", &[]) > 10.0,
        "most of each prompt was cached"
    );
    assert!(
        metric_sum(
            &text,
            "switchyard_kv_events_applied_total",
            &[&format!("worker=\"{home}\"")]
        ) > 0.0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_under_load_spreads_over_every_worker() -> anyhow::Result<()> {
    let config = "[server]\nplaintext = true\n[embedded_mockers]\ncount = 8\nspeedup = 1.0\n";
    let (gateway, admin) = Gateway::start_with_admin(config, TOKEN)?;
    let client = Client::plain(gateway.addr);
    let system = system_prompt("shared", 1100);
    // Warm one worker with the prefix (until the index knows it), then a burst of concurrent
    // long requests.
    let warm = client
        .post_json("/v1/chat/completions", &chat(&system, "warm up", 2, false))
        .await?;
    assert_eq!(warm.status, 200);
    let warm = warm.worker();
    assert!(
        eventually(Duration::from_secs(10), || async {
            admin.kv_summary().await.is_ok_and(|s| cached_blocks(&s, &warm) >= 12)
        })
        .await,
        "the index never learned the warm-up's blocks"
    );
    let mut burst = Vec::new();
    for i in 0..96 {
        let client = client.clone();
        let body = chat(&system, &format!("user {i}"), 48, true);
        burst.push(tokio::spawn(async move {
            client.post_json("/v1/chat/completions", &body).await
        }));
    }
    let mut placed: HashMap<String, usize> = HashMap::new();
    for request in burst {
        let reply = request.await??;
        assert_eq!(reply.status, 200);
        *placed.entry(reply.worker()).or_default() += 1;
    }
    assert_eq!(
        placed.len(),
        8,
        "every worker must take traffic (no hot spot): {placed:?}"
    );
    let busiest = placed.values().copied().max().unwrap_or(0);
    assert!(busiest < 96 * 3 / 4, "one worker took most of the burst: {placed:?}");
    // ... and the cache still counts: round-robin would give the warm worker 96 / 8 = 12.
    let on_warm = placed.get(&warm).copied().unwrap_or(0);
    println!("burst placements: {placed:?} (warm: {warm})");
    assert!(
        on_warm > 96 / 8,
        "the warm worker took only its even share: {placed:?} (warm: {warm})"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_size_mismatch_is_reported_loudly() -> anyhow::Result<()> {
    let config = "[server]\nplaintext = true\n[embedded_mockers]\ncount = 2\nblock_size = 32\nspeedup = 20.0\n\
                  [[models]]\nname = \"mock\"\nblock_size = 64\n";
    let (gateway, admin) = Gateway::start_with_admin(config, TOKEN)?;
    let client = Client::plain(gateway.addr);
    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat(&system_prompt("mismatch", 1000), "hello", 2, false),
        )
        .await?;
    assert_eq!(reply.status, 200, "the worker still serves");
    let text = metrics(&client).await?;
    assert_eq!(
        metric_sum(&text, "switchyard_kv_block_size_mismatch", &["worker=\"embedded-0\""]),
        1.0,
        "{text}"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            metrics(&client).await.is_ok_and(|t| {
                metric_sum(
                    &t,
                    "switchyard_kv_events_ignored_total",
                    &["reason=\"block_size_mismatch\""],
                ) > 0.0
            })
        })
        .await
    );
    let summary = admin.kv_summary().await?;
    assert_eq!(
        summary["index"]["nodes"], 0,
        "nothing indexed under the wrong size: {summary}"
    );
    assert_eq!(summary["workers"][0]["block_size_ok"], false);
    Ok(())
}

fn nats_gateway(nats: &NatsServer, extra: &str) -> anyhow::Result<(Gateway, Admin)> {
    let config = format!(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 200\ntimeout_ms = 200\nfailures_to_eject = 1\n\
         [kv]\nnats_url = \"{}\"\nheartbeat_misses = 3\n{extra}",
        nats.url
    );
    Gateway::start_with_admin(&config, TOKEN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_holding_the_prefix_is_never_chosen_again() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let (gateway, admin) = nats_gateway(&nats, "")?;
    let mut a = Mockers::start(&[
        "--nats",
        &nats.url,
        "--name",
        "alpha",
        "--speedup",
        "20",
        "--heartbeat-ms",
        "200",
    ])?;
    let mut b = Mockers::start(&[
        "--nats",
        &nats.url,
        "--name",
        "beta",
        "--speedup",
        "20",
        "--heartbeat-ms",
        "200",
    ])?;
    admin.wait_for_workers(2).await?;
    let client = Client::plain(gateway.addr);
    let system = system_prompt("affinity", 2000);
    let first = client
        .post_json("/v1/chat/completions", &chat(&system, "first", 2, false))
        .await?;
    assert_eq!(first.status, 200);
    let home = first.worker();
    assert!(
        eventually(Duration::from_secs(10), || async {
            admin.kv_summary().await.is_ok_and(|s| cached_blocks(&s, &home) >= 25)
        })
        .await
    );
    let (doomed, survivor) = if home == "alpha-0" {
        (&mut a, "beta-0")
    } else {
        (&mut b, "alpha-0")
    };
    doomed.process.kill();
    for i in 0..10 {
        let reply = client
            .post_json("/v1/chat/completions", &chat(&system, &format!("after {i}"), 2, false))
            .await?;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
        assert_eq!(reply.worker(), survivor, "the dead worker was chosen for its cache");
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            admin.kv_summary().await.is_ok_and(|s| {
                let names: Vec<&str> = s["workers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|w| w["name"].as_str())
                    .collect();
                names == [survivor]
            })
        })
        .await,
        "the dead worker left the pool after missing heartbeats: {}",
        admin.kv_summary().await?
    );
    let text = metrics(&client).await?;
    assert!(metric_sum(&text, "switchyard_kv_workers_expired_total", &[]) >= 1.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_events_are_lost_is_resynced() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let (gateway, admin) = nats_gateway(&nats, "")?;
    let _lossy = Mockers::start(&[
        "--nats",
        &nats.url,
        "--name",
        "lossy",
        "--speedup",
        "20",
        "--heartbeat-ms",
        "200",
        "--drop-kv-event-every",
        "7",
    ])?;
    admin.wait_for_workers(1).await?;
    let client = Client::plain(gateway.addr);
    for i in 0..6 {
        let reply = client
            .post_json(
                "/v1/chat/completions",
                &chat(&system_prompt(&format!("topic-{i}"), 1500), "go", 2, false),
            )
            .await?;
        assert_eq!(reply.status, 200);
    }
    // Ask the worker itself for its cache, over the same NATS, and wait for the gateway's
    // index to agree with it block for block.
    let nats_client = async_nats::connect(nats.url.as_str()).await?;
    let truth = nats_client
        .request("switchyard.kv.dump.lossy-0", bytes::Bytes::new())
        .await?;
    let dump: serde_json::Value = serde_json::from_slice(&truth.payload)?;
    let worker_blocks = dump["blocks"].as_array().map_or(0, Vec::len) as u64;
    assert!(
        worker_blocks >= 6 * 20,
        "the worker cached the prompts: {worker_blocks}"
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            admin
                .kv_summary()
                .await
                .is_ok_and(|s| cached_blocks(&s, "lossy-0") == worker_blocks)
        })
        .await,
        "index {} vs worker {worker_blocks}",
        cached_blocks(&admin.kv_summary().await?, "lossy-0")
    );
    let text = metrics(&client).await?;
    assert!(
        metric_sum(&text, "switchyard_kv_event_gaps_total", &["worker=\"lossy-0\""]) >= 1.0,
        "{text}"
    );
    assert!(
        metric_sum(
            &text,
            "switchyard_kv_resyncs_total",
            &["worker=\"lossy-0\"", "outcome=\"ok\""]
        ) >= 1.0,
        "{text}"
    );
    Ok(())
}
