//! Engines Switchyard did not write, told from their answers, with their load read from their
//! own metrics (vLLM's and SGLang's documented Prometheus text) into the columns the routing
//! policy reads; a health path that answers 404 is reported as misconfigured, not ejected.

use std::time::Duration;

use serde_json::Value;
use switchyard_harness::{Admin, Client, Gateway, ScriptedEngine, chat_body, eventually, metric_sum};

/// vLLM's gauges, in the format of its documentation, with `running` and `waiting` requests
/// and `usage` of 8,192 blocks of 16 tokens.
fn vllm(running: u32, waiting: u32, usage: f64) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage}\n\
         # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"8192\"}} 1.0\n"
    )
}

/// SGLang's gauges, in the format of its production-metrics page.
fn sglang(running: u32, queued: u32, usage: f64) -> String {
    format!(
        "# HELP sglang:num_running_reqs The number of running requests.\n\
         # TYPE sglang:num_running_reqs gauge\n\
         sglang:num_running_reqs{{model_name=\"m\"}} {running}.0\n\
         # HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n\
         # TYPE sglang:num_queue_reqs gauge\n\
         sglang:num_queue_reqs{{model_name=\"m\"}} {queued}.0\n\
         # HELP sglang:token_usage The token usage\n\
         # TYPE sglang:token_usage gauge\n\
         sglang:token_usage{{model_name=\"m\"}} {usage}\n\
         # HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.\n\
         # TYPE sglang:max_total_num_tokens gauge\n\
         sglang:max_total_num_tokens{{model_name=\"m\"}} 65536.0\n"
    )
}

fn config(workers: &[(&str, &ScriptedEngine, &str)]) -> String {
    let mut config = String::from(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 100\nfailures_to_eject = 1\n\
         [policy]\nrouter = \"least-load\"\n",
    );
    for (name, engine, extra) in workers {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{}\"\nmodel = \"m\"\n{extra}\n",
            engine.addr
        ));
    }
    config
}

async fn worker_stats(admin: &Admin, name: &str) -> anyhow::Result<Value> {
    let (status, stats) = admin.call("GET", "/admin/stats", Vec::new()).await?;
    anyhow::ensure!(status == 200, "GET /admin/stats answered {status}");
    stats["workers"]
        .as_array()
        .and_then(|workers| workers.iter().find(|w| w["name"] == name).cloned())
        .ok_or_else(|| anyhow::anyhow!("no worker {name} in {stats}"))
}

/// Sends `count` requests one after another and returns who answered each.
async fn answered_by(client: &Client, count: usize) -> anyhow::Result<Vec<String>> {
    let mut workers = Vec::new();
    for _ in 0..count {
        let reply = client
            .post_json("/v1/chat/completions", &chat_body("m", "hello", 2, false))
            .await?;
        anyhow::ensure!(reply.status == 200, "status {}", reply.status);
        workers.push(reply.worker());
    }
    Ok(workers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_load_from_its_metrics_steers_least_load() -> anyhow::Result<()> {
    // Neither entry names its engine: the gateway tells vLLM from its metric names.
    let busy = ScriptedEngine::start("busy", "vllm", "/health", &vllm(40, 10, 0.5)).await?;
    let idle = ScriptedEngine::start("idle", "vllm", "/health", &vllm(0, 0, 0.0)).await?;
    let (gateway, admin) = Gateway::start_with_admin(
        &config(&[("busy", &busy, ""), ("idle", &idle, "")]),
        "engine-admin-token-0123",
    )?;
    let client = Client::plain(gateway.addr);
    let read = eventually(Duration::from_secs(10), || async {
        worker_stats(&admin, "busy")
            .await
            .is_ok_and(|w| w["engine_load"]["running"] == 40)
    })
    .await;
    assert!(read, "busy's metrics read: {}", worker_stats(&admin, "busy").await?);
    let stats = worker_stats(&admin, "busy").await?;
    assert_eq!(stats["engine"], "vllm");
    assert_eq!(stats["engine_load"]["waiting"], 10);
    // 8,192 blocks of 16 tokens are 2,048 of the gateway's 64.
    assert_eq!(stats["engine_load"]["capacity_blocks"], 2048);
    assert_eq!(stats["misconfigured"], false);

    // The gateway sent neither anything: only the engines' own counts tell them apart.
    assert!(
        answered_by(&client, 6).await?.iter().all(|w| w == "idle"),
        "50 requests at `busy`"
    );
    // The load moves; the next readings follow it.
    busy.set_metrics(&vllm(0, 0, 0.0));
    idle.set_metrics(&vllm(64, 0, 0.9));
    let moved = eventually(Duration::from_secs(10), || async {
        worker_stats(&admin, "idle")
            .await
            .is_ok_and(|w| w["engine_load"]["running"] == 64)
            && worker_stats(&admin, "busy")
                .await
                .is_ok_and(|w| w["engine_load"]["running"] == 0)
    })
    .await;
    assert!(moved, "new readings taken");
    assert!(answered_by(&client, 6).await?.iter().all(|w| w == "busy"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_load_and_capacity_from_its_metrics() -> anyhow::Result<()> {
    let queued = ScriptedEngine::start("queued", "sglang", "/health", &sglang(8, 30, 0.75)).await?;
    let calm = ScriptedEngine::start("calm", "sglang", "/health", &sglang(1, 0, 0.1)).await?;
    let (gateway, admin) = Gateway::start_with_admin(
        &config(&[("queued", &queued, ""), ("calm", &calm, "")]),
        "engine-admin-token-0123",
    )?;
    let client = Client::plain(gateway.addr);
    let read = eventually(Duration::from_secs(10), || async {
        worker_stats(&admin, "queued")
            .await
            .is_ok_and(|w| w["engine_load"]["waiting"] == 30)
    })
    .await;
    assert!(read, "queued's metrics read: {}", worker_stats(&admin, "queued").await?);
    let stats = worker_stats(&admin, "queued").await?;
    assert_eq!(stats["engine"], "sglang");
    assert_eq!(stats["engine_load"]["running"], 8);
    // 65,536 tokens are 1,024 blocks of 64.
    assert_eq!(stats["engine_load"]["capacity_blocks"], 1024);
    assert_eq!(stats["engine_load"]["kv_usage"], 0.75);
    assert!(answered_by(&client, 6).await?.iter().all(|w| w == "calm"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_path_answering_404_is_reported_not_ejected() -> anyhow::Result<()> {
    // Both engines serve their health at /ready. `wrong` is said to be vLLM, whose health is
    // checked at /health by default: that answers 404. `right` names its path.
    let wrong = ScriptedEngine::start("wrong", "vllm", "/ready", &vllm(0, 0, 0.0)).await?;
    let right = ScriptedEngine::start("right", "vllm", "/ready", &vllm(0, 0, 0.0)).await?;
    let (gateway, admin) = Gateway::start_with_admin(
        &config(&[
            ("wrong", &wrong, "engine = \"vllm\""),
            ("right", &right, "engine = \"vllm\"\nhealth_path = \"/ready\""),
        ]),
        "engine-admin-token-0123",
    )?;
    let client = Client::plain(gateway.addr);
    let reported = eventually(Duration::from_secs(10), || async {
        worker_stats(&admin, "wrong")
            .await
            .is_ok_and(|w| w["misconfigured"] == true)
    })
    .await;
    assert!(reported, "{}", worker_stats(&admin, "wrong").await?);
    let text = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert_eq!(
        metric_sum(&text, "switchyard_worker_misconfigured", &["worker=\"wrong\""]),
        1.0
    );
    assert_eq!(
        metric_sum(&text, "switchyard_worker_misconfigured", &["worker=\"right\""]),
        0.0
    );
    assert_eq!(
        metric_sum(&text, "switchyard_worker_healthy", &["worker=\"wrong\""]),
        1.0,
        "still in rotation after many checks"
    );
    // It still serves: with equal loads least-load takes the first listed, `wrong`.
    let workers = answered_by(&client, 4).await?;
    assert!(workers.iter().all(|w| w == "wrong"), "{workers:?}");
    assert_eq!(wrong.generations(), 4);
    assert_eq!(worker_stats(&admin, "wrong").await?["healthy"], true);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_full_by_its_own_count_holds_requests_in_admission() -> anyhow::Result<()> {
    // Other clients keep 10 requests running on the engine; the gateway admits 4 per worker.
    let shared = ScriptedEngine::start("shared", "vllm", "/health", &vllm(10, 0, 0.2)).await?;
    let config = format!(
        "{}[admission]\nmax_requests = 4\nmax_wait_ms = 400\n",
        config(&[("shared", &shared, "")])
    );
    let (gateway, admin) = Gateway::start_with_admin(&config, "engine-admin-token-0123")?;
    let client = Client::plain(gateway.addr);
    let read = eventually(Duration::from_secs(10), || async {
        worker_stats(&admin, "shared")
            .await
            .is_ok_and(|w| w["engine_load"]["running"] == 10)
    })
    .await;
    assert!(read, "metrics read");
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("m", "wait", 2, false))
        .await?;
    assert_eq!(reply.status, 503, "held, then timed out: {:?}", reply.json());
    assert_eq!(reply.json()?["error"]["code"], "queue_timeout");
    assert_eq!(shared.generations(), 0);
    // The others finish: room again.
    shared.set_metrics(&vllm(1, 0, 0.0));
    let freed = eventually(Duration::from_secs(10), || async {
        worker_stats(&admin, "shared")
            .await
            .is_ok_and(|w| w["engine_load"]["running"] == 1)
    })
    .await;
    assert!(freed);
    assert_eq!(answered_by(&client, 2).await?, ["shared", "shared"]);
    Ok(())
}
