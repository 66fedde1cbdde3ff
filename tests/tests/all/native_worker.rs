//! The native LLM worker behind the gateway, as the mocker would be: two `switchyard-llm`
//! processes on the tiny Llama fixture register (over a real `nats-server`, or directly with
//! the gateway's admin API), publish their KV events, and the gateway (tokenizing with the
//! model's own `tokenizer.json`) routes a repeated prompt to the worker that cached it, where
//! the prefix cache serves it; a worker's `/kv/reset` empties the index's view of it too. Over
//! HTTP (with the gateway's worker token, which opens the worker routes and nothing else), a
//! gap in a worker's events is healed from its `/kv/dump`, and a worker that stops
//! leaves at once.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use switchyard_harness::{Admin, Client, Gateway, NativeWorker, NatsServer, cached_blocks, eventually, fixtures};

const TOKEN: &str = "native-worker-admin-token";
/// The credential workers register with: it opens `/admin/workers*` and nothing else.
const WORKER_TOKEN: &str = "native-worker-registration-token";

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

/// The worker's flags; `name` `None` leaves it to the worker (`worker-PORT`).
fn worker_args<'a>(model: &'a str, name: Option<&'a str>, link: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
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
        "--heartbeat-ms",
        "200",
    ];
    if let Some(name) = name {
        args.extend_from_slice(&["--name", name]);
    }
    args.extend_from_slice(link);
    args
}

fn gateway_config(model: &str, extra: &str) -> String {
    format!(
        "[server]\nplaintext = true\n{extra}\n\
         [[models]]\nname = \"tiny\"\nblock_size = 4\ntokenizer = \"{model}/tokenizer.json\"\n"
    )
}

/// Sends the first request, waits until the index holds its prompt's blocks on the worker that
/// served it, then checks that eight more with the same prefix all go there and hit its cache.
/// Returns that worker and the first answer.
async fn prefix_affinity(client: &Client, admin: &Admin) -> anyhow::Result<(String, serde_json::Value)> {
    let first = client.post_json("/v1/chat/completions", &chat("question 0")).await?;
    anyhow::ensure!(first.status == 200, "{}", String::from_utf8_lossy(&first.body()));
    let home = first.worker();
    let answer = first.json()?;
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    anyhow::ensure!(prompt_tokens > 40, "the chat template and system prompt: {answer}");
    let learned = eventually(Duration::from_secs(10), || async {
        admin
            .kv_summary()
            .await
            .is_ok_and(|s| cached_blocks(&s, &home) >= prompt_tokens / 4 - 1)
    })
    .await;
    anyhow::ensure!(
        learned,
        "the index never learned {home}'s blocks: {}",
        admin.kv_summary().await?
    );
    let mut placed: HashMap<String, usize> = HashMap::new();
    for i in 1..=8 {
        let reply = client
            .post_json("/v1/chat/completions", &chat(&format!("question {i}")))
            .await?;
        anyhow::ensure!(reply.status == 200, "{}", String::from_utf8_lossy(&reply.body()));
        let body = reply.json()?;
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        anyhow::ensure!(
            cached >= 40,
            "the worker's prefix cache served the system prompt: {body}"
        );
        *placed.entry(reply.worker()).or_default() += 1;
    }
    anyhow::ensure!(
        placed.get(&home) == Some(&8),
        "placements: {placed:?} (cached on {home})"
    );
    Ok((home, answer))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_linked_over_http_register_route_resync_and_leave() -> anyhow::Result<()> {
    let model = fixtures::llm("tiny-llama");
    let model = model.to_str().context("the fixture path is not UTF-8")?;
    let (gateway, admin) = Gateway::start_with_admin_keys(
        &gateway_config(model, ""),
        TOKEN,
        &format!("worker_token = \"{WORKER_TOKEN}\""),
    )?;
    let admin_url = admin.url();
    let mut workers = HashMap::new();
    for name in ["alpha", "beta"] {
        let link = ["--gateway", admin_url.as_str()];
        let env = [("SWITCHYARD_GATEWAY_TOKEN", WORKER_TOKEN)];
        workers.insert(
            name,
            NativeWorker::start_with_env(&worker_args(model, Some(name), &link), &env)?,
        );
    }
    admin.wait_for_workers(2).await?;
    let client = Client::plain(gateway.addr);
    let (home, _) = prefix_affinity(&client, &admin).await?;

    // A gap in `home`'s event ids (as if a batch was lost): the gateway fetches the worker's
    // dump and its index agrees with the worker block for block.
    let gap = serde_json::json!([{"worker": home, "event_id": 100_000,
        "event": {"type": "removed", "block_hashes": [12345]}}]);
    let (status, body) = admin
        .call(
            "POST",
            &format!("/admin/workers/{home}/events"),
            serde_json::to_vec(&gap)?,
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    let worker = workers.get(home.as_str()).context("home is one of ours")?;
    let dump = Client::plain(worker.addr)
        .send("GET", "/kv/dump", Vec::new())
        .await?
        .json()?;
    let truth = dump["blocks"].as_array().map_or(0, Vec::len) as u64;
    assert!(truth >= 10, "the worker caches the prompts: {dump}");
    assert!(
        eventually(Duration::from_secs(10), || async {
            admin
                .kv_summary()
                .await
                .is_ok_and(|s| cached_blocks(&s, &home) == truth)
        })
        .await,
        "index {} vs worker {truth}",
        cached_blocks(&admin.kv_summary().await?, &home)
    );
    // The index may agree before the dump arrives (the gap's event named a block it did not
    // hold), so the resync itself is waited for, not read once.
    let resynced = || async {
        let metrics = match client.send("GET", "/metrics", Vec::new()).await {
            Ok(reply) => String::from_utf8_lossy(&reply.body()).into_owned(),
            Err(_) => return false,
        };
        switchyard_harness::metric_sum(
            &metrics,
            "switchyard_kv_resyncs_total",
            &[&format!("worker=\"{home}\""), "outcome=\"ok\""],
        ) >= 1.0
    };
    assert!(
        eventually(Duration::from_secs(10), resynced).await,
        "no resync from the worker's dump was counted"
    );
    assert_eq!(
        cached_blocks(&admin.kv_summary().await?, &home),
        truth,
        "after the resync the index agrees with the worker"
    );

    // A worker that is told to stop leaves the gateway at once (not after missed heartbeats).
    let leaving = workers.remove(home.as_str()).context("home is one of ours")?;
    let pid = leaving.process.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()?
            .success()
    );
    admin.wait_for_workers(1).await?;
    let other = if home == "alpha" { "beta" } else { "alpha" };
    let reply = client.post_json("/v1/chat/completions", &chat("after")).await?;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), other);
    // Events for a worker that is not registered are refused.
    let (status, _) = admin
        .call("POST", "/admin/workers/ghost/events", b"[]".to_vec())
        .await?;
    assert_eq!(status, 409);

    // A worker left to name itself (on a port it picked) registers and posts its events under
    // one name: the index learns the blocks of a request sent to it directly.
    let link = ["--gateway", admin_url.as_str()];
    let env = [("SWITCHYARD_GATEWAY_TOKEN", WORKER_TOKEN)];
    let unnamed = NativeWorker::start_with_env(&worker_args(model, None, &link), &env)?;
    admin.wait_for_workers(2).await?;
    let name = format!("worker-{}", unnamed.addr.port());
    let direct = Client::plain(unnamed.addr)
        .post_json("/v1/chat/completions", &chat("straight to it"))
        .await?;
    assert_eq!(direct.status, 200);
    assert!(
        eventually(Duration::from_secs(10), || async {
            admin.kv_summary().await.is_ok_and(|s| cached_blocks(&s, &name) >= 10)
        })
        .await,
        "the index never learned {name}'s blocks: {}",
        admin.kv_summary().await?
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_routes_to_native_workers_by_their_kv_events() -> anyhow::Result<()> {
    let model = fixtures::llm("tiny-llama");
    let model = model.to_str().context("the fixture path is not UTF-8")?;
    let nats = NatsServer::start()?;
    let extra = format!("[kv]\nnats_url = \"{}\"", nats.url);
    let (gateway, admin) = Gateway::start_with_admin(&gateway_config(model, &extra), TOKEN)?;
    let mut workers = HashMap::new();
    for name in ["alpha", "beta"] {
        workers.insert(
            name,
            NativeWorker::start(&worker_args(model, Some(name), &["--nats", &nats.url]))?,
        );
    }
    admin.wait_for_workers(2).await?;
    let client = Client::plain(gateway.addr);
    let (home, answer) = prefix_affinity(&client, &admin).await?;
    // Greedy through the gateway is greedy on the worker: the same answer again.
    let again = client.post_json("/v1/chat/completions", &chat("question 0")).await?;
    assert_eq!(
        again.json()?["choices"][0]["message"]["content"],
        answer["choices"][0]["message"]["content"]
    );
    // An operator drops the worker's prefix cache: its `cleared` event empties the index.
    let worker = Client::plain(workers.get(home.as_str()).context("home is one of ours")?.addr);
    let reset = worker.send("POST", "/kv/reset", Vec::new()).await?;
    assert_eq!(reset.status, 200);
    assert!(
        reset.json()?["dropped_blocks"].as_u64().unwrap_or(0) >= 10,
        "{:?}",
        reset.json()
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            admin.kv_summary().await.is_ok_and(|s| cached_blocks(&s, &home) == 0)
        })
        .await,
        "the index still holds {} blocks of {home}",
        cached_blocks(&admin.kv_summary().await?, &home)
    );
    let next = client
        .post_json("/v1/chat/completions", &chat("after the reset"))
        .await?;
    assert_eq!(
        next.json()?["usage"]["prompt_tokens_details"]["cached_tokens"],
        0,
        "nothing is served from a dropped cache"
    );
    drop(workers);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_token_registers_a_worker_from_a_file_and_opens_nothing_else() -> anyhow::Result<()> {
    let model = fixtures::llm("tiny-llama");
    let model = model.to_str().context("the fixture path is not UTF-8")?;
    let dir = tempfile::tempdir()?;
    let token_file = dir.path().join("worker-token");
    std::fs::write(&token_file, format!("{WORKER_TOKEN}\n"))?;
    let token_path = token_file.to_str().context("the temp path is not UTF-8")?;
    let (_gateway, admin) = Gateway::start_with_admin_keys(
        &gateway_config(model, ""),
        TOKEN,
        &format!("worker_token_file = \"{token_path}\""),
    )?;
    let admin_url = admin.url();

    // A token on the command line is refused, naming the ways that keep it off it.
    let refused = std::process::Command::new(switchyard_harness::binary("switchyard-llm")?)
        .args(worker_args(
            model,
            Some("argv"),
            &["--gateway", admin_url.as_str(), "--gateway-token", WORKER_TOKEN],
        ))
        .output()?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "a worker took its token from argv: {stderr}");
    assert!(stderr.contains("--gateway-token-file"), "{stderr}");

    // The file registers the worker, whose command line holds no token.
    let link = ["--gateway", admin_url.as_str(), "--gateway-token-file", token_path];
    let worker = NativeWorker::start(&worker_args(model, Some("filed"), &link))?;
    admin.wait_for_workers(1).await?;
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", worker.process.id()))?;
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(!cmdline.contains(WORKER_TOKEN), "the token is in argv: {cmdline}");

    // The worker token opens the worker routes only: it cannot upload or activate a policy,
    // nor read anything else.
    let worker_admin = admin.with_token(WORKER_TOKEN);
    let wasm = std::fs::read(format!("{}/least_load.wasm", env!("SWITCHYARD_PLUGINS_DIR")))?;
    let (status, body) = worker_admin
        .call("PUT", "/admin/policies/x?activate=true", wasm.clone())
        .await?;
    assert_eq!(status, 401, "{body}");
    for path in ["/admin/policies", "/admin/kv", "/metrics"] {
        let (status, body) = worker_admin.call("GET", path, Vec::new()).await?;
        assert_eq!(status, 401, "{path}: {body}");
    }
    let (status, body) = worker_admin.call("DELETE", "/admin/workers/nobody", Vec::new()).await?;
    assert_eq!(status, 200, "{body}");
    // The admin token still manages everything.
    let (status, body) = admin.call("PUT", "/admin/policies/x?activate=true", wasm).await?;
    assert_eq!(status, 200, "{body}");
    Ok(())
}
