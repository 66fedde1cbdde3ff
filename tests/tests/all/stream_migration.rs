//! Streams that survive a worker (`forwarding.migration_limit`): a worker killed mid-stream,
//! and a spot worker's reclaim notice, each leave the client one uninterrupted stream whose
//! text and usage equal the fault-free answer's (the mocker's words depend only on the tokens
//! before them, as a greedy model's do).

use std::time::Duration;

use switchyard_harness::{Client, Gateway, Mockers, Reply, metric_sum, sse_json};

/// A long streamed chat request (`max_tokens` × 5.7 ms at the mocker's real speed), with usage.
fn long_chat(content: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": "mock",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// What a client makes of a stream: its text, its usage, and the ids its chunks carried.
struct Seen {
    text: String,
    usage: serde_json::Value,
    ids: Vec<String>,
    errors: Vec<serde_json::Value>,
}

fn seen(reply: &Reply) -> Seen {
    let body = String::from_utf8_lossy(&reply.body()).into_owned();
    assert!(
        body.trim_end().ends_with("data: [DONE]"),
        "the stream ends with [DONE]: {body}"
    );
    let chunks = sse_json(&body);
    let mut seen = Seen {
        text: String::new(),
        usage: serde_json::Value::Null,
        ids: Vec::new(),
        errors: Vec::new(),
    };
    for chunk in chunks {
        if chunk.get("error").is_some() {
            seen.errors.push(chunk);
            continue;
        }
        assert!(
            !chunk.to_string().contains("token_ids"),
            "ids the client did not ask for stay out: {chunk}"
        );
        if let Some(id) = chunk["id"].as_str()
            && !seen.ids.iter().any(|seen| seen == id)
        {
            seen.ids.push(id.to_string());
        }
        if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str() {
            seen.text.push_str(text);
        }
        if chunk["usage"].is_object() {
            seen.usage = chunk["usage"].clone();
        }
    }
    seen
}

/// Requests in flight on a mocker, from its own metrics.
async fn in_flight(mocker: &Mockers) -> anyhow::Result<f64> {
    let reply = Client::plain(mocker.addrs[0])
        .send("GET", "/metrics", Vec::new())
        .await?;
    let text = String::from_utf8_lossy(&reply.body()).into_owned();
    Ok(metric_sum(&text, "switchyard_mocker_http_in_flight_requests", &[]))
}

fn config(workers: &[(&str, &Mockers, bool)]) -> String {
    let mut config = String::from(
        "[server]\nplaintext = true\n[health]\ninterval_ms = 100\ntimeout_ms = 200\nfailures_to_eject = 1\n\
         [forwarding]\nmigration_limit = 2\n",
    );
    for (name, mocker, spot) in workers {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"switchyard\"\nspot = {spot}\n",
            mocker.addrs[0]
        ));
    }
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_worker_is_killed_goes_on_elsewhere_word_for_word() -> anyhow::Result<()> {
    let mut first = Mockers::start(&["--num-workers", "1", "--speedup", "1"])?;
    let mut second = Mockers::start(&["--num-workers", "1", "--speedup", "1"])?;
    let gateway = Gateway::start(&config(&[("first", &first, false), ("second", &second, false)]))?;
    let client = Client::plain(gateway.addr);

    let request = long_chat("tell me a long story about routers", 300);
    let fault_free = seen(&client.post_json("/v1/chat/completions", &request).await?);
    assert!(fault_free.errors.is_empty());
    assert_eq!(fault_free.usage["completion_tokens"], 300);

    // The same request again; once it streams, its worker is killed.
    let streaming = {
        let client = client.clone();
        let request = request.clone();
        tokio::spawn(async move { client.post_json("/v1/chat/completions", &request).await })
    };
    let mut on_first = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        if in_flight(&first).await? > 0.0 {
            on_first = true;
            break;
        }
        if in_flight(&second).await? > 0.0 {
            break;
        }
    }
    // A third of the way in (300 tokens take about 1.7 s).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let killed = if on_first { "first" } else { "second" };
    if on_first {
        first.process.kill();
    } else {
        second.process.kill();
    }
    let reply = tokio::time::timeout(Duration::from_secs(30), streaming).await???;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), killed, "the stream began on the killed worker");
    let migrated = seen(&reply);
    assert!(
        migrated.errors.is_empty(),
        "no error reached the client: {:?}",
        migrated.errors
    );
    assert_eq!(migrated.ids.len(), 1, "one answer id throughout: {:?}", migrated.ids);
    assert_eq!(migrated.text, fault_free.text, "no word lost or repeated");
    assert_eq!(migrated.usage["prompt_tokens"], fault_free.usage["prompt_tokens"]);
    assert_eq!(
        migrated.usage["completion_tokens"],
        fault_free.usage["completion_tokens"]
    );
    assert_eq!(migrated.usage["total_tokens"], fault_free.usage["total_tokens"]);

    let metrics = String::from_utf8_lossy(&client.send("GET", "/metrics", Vec::new()).await?.body()).into_owned();
    assert_eq!(
        metric_sum(
            &metrics,
            "switchyard_stream_migrations_total",
            &["outcome=\"continued\""]
        ),
        1.0,
        "{metrics}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_workers_streams_move_at_its_reclaim_notice_before_the_kill() -> anyhow::Result<()> {
    // Noticed 4 s after start, reclaimed (killed) 3 s later; the streams (800 tokens, about
    // 4.6 s) start within the first second or three.
    let spot = Mockers::start(&[
        "--num-workers",
        "1",
        "--speedup",
        "1",
        "--spot-lifetime-s",
        "7",
        "--spot-notice-s",
        "3",
    ])?;
    let reserved = Mockers::start(&["--num-workers", "1", "--speedup", "1"])?;
    let gateway = Gateway::start(&config(&[("spot", &spot, true), ("reserved", &reserved, false)]))?;
    let client = Client::plain(gateway.addr);

    // Two streams at once: least-loaded routing puts one on each worker.
    let prompts = ["a story about spot capacity", "a story about reserved capacity"];
    let mut streams = Vec::new();
    for prompt in prompts {
        let client = client.clone();
        streams.push(tokio::spawn(async move {
            client.post_json("/v1/chat/completions", &long_chat(prompt, 800)).await
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut replies = Vec::new();
    for stream in streams {
        replies.push(tokio::time::timeout(Duration::from_secs(30), stream).await???);
    }
    assert!(
        replies.iter().any(|reply| reply.worker() == "spot"),
        "a stream began on the spot worker"
    );
    let metrics = String::from_utf8_lossy(&client.send("GET", "/metrics", Vec::new()).await?.body()).into_owned();
    assert!(
        metric_sum(
            &metrics,
            "switchyard_stream_migrations_total",
            &["reason=\"reclaim_notice\"", "outcome=\"continued\""]
        ) >= 1.0,
        "moved at the notice, not at the kill: {metrics}"
    );
    // Fault-free answers of the same prompts, on the reserved worker alone.
    for (reply, prompt) in replies.iter().zip(prompts) {
        let migrated = seen(reply);
        assert!(migrated.errors.is_empty(), "{:?}", migrated.errors);
        let fault_free = seen(
            &client
                .post_json("/v1/chat/completions", &long_chat(prompt, 800))
                .await?,
        );
        assert_eq!(migrated.text, fault_free.text, "{prompt}");
        assert_eq!(migrated.usage["completion_tokens"], 800);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_workers_greedy_stream_cut_mid_answer_goes_on_token_for_token() -> anyhow::Result<()> {
    use anyhow::Context;
    use switchyard_harness::{CutProxy, NativeWorker, fixtures};

    let model = fixtures::llm("tiny-llama");
    let model = model.to_str().context("the fixture path is not UTF-8")?;
    let args = [
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
    ];
    let workers = [NativeWorker::start(&args)?, NativeWorker::start(&args)?];
    // Whichever worker the stream goes to, its answer is reset after about a dozen chunks.
    let proxy = CutProxy::start(&[workers[0].addr, workers[1].addr], 4_000).await?;
    let mut config = String::from(
        "[server]\nplaintext = true\n[forwarding]\nmigration_limit = 1\n\
         [[models]]\nname = \"tiny\"\nblock_size = 4\n",
    );
    for (name, addr) in ["one", "two"].iter().zip(&proxy.addrs) {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"tiny\"\nblock_size = 4\nengine = \"switchyard\"\n"
        ));
    }
    let gateway = Gateway::start(&config)?;
    let request = serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "count the switchyard's tracks, slowly"}],
        "max_tokens": 60,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    // The fault-free greedy answer, from a worker itself.
    let fault_free = seen(
        &Client::plain(workers[1].addr)
            .post_json("/v1/chat/completions", &request)
            .await?,
    );
    assert_eq!(fault_free.usage["completion_tokens"], 60);

    let reply = Client::plain(gateway.addr)
        .post_json("/v1/chat/completions", &request)
        .await?;
    assert_eq!(reply.status, 200);
    assert!(proxy.has_cut(), "the answer was cut mid-stream");
    let migrated = seen(&reply);
    assert!(migrated.errors.is_empty(), "{:?}", migrated.errors);
    assert_eq!(migrated.ids.len(), 1);
    assert_eq!(migrated.text, fault_free.text, "the continuation is token-exact");
    assert_eq!(migrated.usage["prompt_tokens"], fault_free.usage["prompt_tokens"]);
    assert_eq!(migrated.usage["completion_tokens"], 60);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_reports_no_token_ids_ends_a_broken_stream_with_an_error_event() -> anyhow::Result<()> {
    use switchyard_harness::CutProxy;

    // Two mockers configured as a generic OpenAI-compatible engine: the gateway does not ask
    // them for token ids, so their streams cannot be continued.
    let mockers = Mockers::start(&["--num-workers", "2", "--speedup", "5"])?;
    let proxy = CutProxy::start(&mockers.addrs, 3_000).await?;
    let mut config = String::from("[server]\nplaintext = true\n[forwarding]\nmigration_limit = 2\n");
    for (name, addr) in ["a", "b"].iter().zip(&proxy.addrs) {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"mock\"\nengine = \"openai\"\n"
        ));
    }
    let gateway = Gateway::start(&config)?;
    let client = Client::plain(gateway.addr);
    let reply = client
        .post_json("/v1/chat/completions", &long_chat("no ids here", 200))
        .await?;
    assert_eq!(reply.status, 200);
    assert!(proxy.has_cut());
    let body = String::from_utf8_lossy(&reply.body()).into_owned();
    let chunks = sse_json(&body);
    let last = chunks.last().cloned().unwrap_or_default();
    assert_eq!(
        last["error"]["code"], "worker_failed_mid_stream",
        "the stream ends with an error event: {body}"
    );
    assert!(!body.contains("token_ids"), "no ids were asked for");
    let metrics = String::from_utf8_lossy(&client.send("GET", "/metrics", Vec::new()).await?.body()).into_owned();
    assert_eq!(
        metric_sum(&metrics, "switchyard_stream_migrations_total", &[]),
        0.0,
        "nothing was tried: {metrics}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_continued_stream_is_charged_once_and_shows_no_usage_it_did_not_ask_for() -> anyhow::Result<()> {
    use sha2::{Digest, Sha256};
    use switchyard_harness::CutProxy;

    const KEY: &str = "sk-migrating-0123456789abcdef";
    let mockers = Mockers::start(&["--num-workers", "2", "--speedup", "5"])?;
    let proxy = CutProxy::start(&mockers.addrs, 5_000).await?;
    let sha: String = Sha256::digest(KEY.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut config = format!(
        "[server]\nplaintext = true\n[forwarding]\nmigration_limit = 1\n\
         [[api_keys]]\nkey_sha256 = \"{sha}\"\ntenant = \"acme\"\n"
    );
    for (name, addr) in ["a", "b"].iter().zip(&proxy.addrs) {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"mock\"\nengine = \"switchyard\"\n"
        ));
    }
    let (gateway, admin) = Gateway::start_with_admin(&config, "migrating-admin-token")?;
    // The client does not ask for the usage chunk: the gateway asks for it to charge the tenant.
    let request = serde_json::json!({
        "model": "mock",
        "messages": [{"role": "user", "content": "charge me once"}],
        "max_tokens": 120,
        "stream": true,
    });
    let mut asked = request.clone();
    asked["stream_options"] = serde_json::json!({"include_usage": true});
    let fault_free = seen(
        &Client::plain(mockers.addrs[1])
            .post_json("/v1/chat/completions", &asked)
            .await?,
    );
    let total = fault_free.usage["total_tokens"].as_u64().unwrap_or(0);
    assert!(total > 120, "{:?}", fault_free.usage);

    let reply = Client::plain(gateway.addr).chat(Some(KEY), &request).await?;
    assert_eq!(reply.status, 200);
    assert!(proxy.has_cut(), "the answer was cut mid-stream");
    let body = String::from_utf8_lossy(&reply.body()).into_owned();
    let migrated = seen(&reply);
    assert!(migrated.errors.is_empty(), "{body}");
    assert_eq!(migrated.text, fault_free.text);
    assert!(
        sse_json(&body)
            .iter()
            .all(|chunk| chunk.get("usage").is_none_or(serde_json::Value::is_null)),
        "no usage the client did not ask for: {body}"
    );
    let (_, metrics) = admin.get_text("/metrics").await?;
    assert_eq!(
        metric_sum(&metrics, "switchyard_tenant_month_tokens", &["tenant=\"acme\""]),
        total as f64,
        "charged the one answer's tokens: {metrics}"
    );
    Ok(())
}
