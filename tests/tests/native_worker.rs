//! The native LLM worker behind the gateway, as the mocker would be: two `switchyard-worker`
//! processes on the tiny Llama fixture register over a real `nats-server`, publish their KV
//! events, and the gateway (tokenizing with the model's own `tokenizer.json`) routes a
//! repeated prompt to the worker that cached it, where the prefix cache serves it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use switchyard_e2e::{Admin, Client, Gateway, NativeWorker, NatsServer, eventually};

const TOKEN: &str = "native-worker-admin-token";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../gpu-workers/tests/fixtures/tiny-llama")
}

async fn kv_summary(admin: &Admin) -> anyhow::Result<serde_json::Value> {
    let (status, body) = admin.call("GET", "/admin/kv", Vec::new()).await?;
    anyhow::ensure!(status == 200, "GET /admin/kv answered {status}: {body}");
    Ok(body)
}

fn cached_blocks(summary: &serde_json::Value, worker: &str) -> u64 {
    summary["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|w| w["name"] == worker)
        .and_then(|w| w["cached_blocks"].as_u64())
        .unwrap_or(0)
}

fn chat(user: &str) -> serde_json::Value {
    serde_json::json!({
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are the switchyard test bot; answer in one short line, please."},
            {"role": "user", "content": user},
        ],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": true,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_routes_to_native_workers_by_their_kv_events() -> anyhow::Result<()> {
    let model = fixture();
    let model = model.to_str().context("the fixture path is not UTF-8")?;
    let nats = NatsServer::start()?;
    let config = format!(
        "[server]\nplaintext = true\n[kv]\nnats_url = \"{}\"\n\
         [[models]]\nname = \"tiny\"\nblock_size = 4\ntokenizer = \"{model}/tokenizer.json\"\n",
        nats.url
    );
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let mut workers = Vec::new();
    for name in ["alpha", "beta"] {
        workers.push(NativeWorker::start(&[
            "--model",
            model,
            "--served-model-name",
            "tiny",
            "--port",
            "0",
            "--block-size",
            "4",
            "--kv-cache-mib",
            "8",
            "--threads",
            "1",
            "--nats",
            &nats.url,
            "--name",
            name,
            "--heartbeat-ms",
            "200",
        ])?);
    }
    assert!(
        eventually(Duration::from_secs(15), || async {
            kv_summary(&admin)
                .await
                .is_ok_and(|s| s["workers"].as_array().is_some_and(|w| w.len() == 2))
        })
        .await,
        "both workers registered: {}",
        kv_summary(&admin).await?
    );

    let client = Client::plain(gateway.addr);
    let first = client.post_json("/v1/chat/completions", &chat("question 0")).await?;
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body()));
    let home = first.worker();
    let answer = first.json()?;
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(prompt_tokens > 40, "the chat template and system prompt: {answer}");
    // The index learns the prompt's full blocks from the worker's own events.
    assert!(
        eventually(Duration::from_secs(10), || async {
            kv_summary(&admin)
                .await
                .is_ok_and(|s| cached_blocks(&s, &home) >= prompt_tokens / 4 - 1)
        })
        .await,
        "the index never learned {home}'s blocks: {}",
        kv_summary(&admin).await?
    );

    let mut placed: HashMap<String, usize> = HashMap::new();
    for i in 1..=8 {
        let reply = client
            .post_json("/v1/chat/completions", &chat(&format!("question {i}")))
            .await?;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
        let body = reply.json()?;
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            cached >= 40,
            "the worker's prefix cache served the system prompt: {body}"
        );
        *placed.entry(reply.worker()).or_default() += 1;
    }
    assert_eq!(placed.get(&home), Some(&8), "placements: {placed:?} (cached on {home})");

    // Greedy through the gateway is greedy on the worker: the same answer as asking it directly.
    let again = client.post_json("/v1/chat/completions", &chat("question 0")).await?;
    assert_eq!(
        again.json()?["choices"][0]["message"]["content"],
        answer["choices"][0]["message"]["content"]
    );
    drop(workers);
    Ok(())
}
