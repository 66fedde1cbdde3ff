//! Prefill/decode disaggregation with simulated engines: a prompt the policy sends to a prefill
//! worker is decoded on the answering worker from the KV blocks it pulled, with the answer it
//! would have given whole, and those blocks serve the conversation's next turn there.

use switchyard_harness::{Client, Gateway, Mockers, Reply, metric_sum, sse_json};

/// A gateway in front of one decode and one prefill mocker, routed by `router` with its
/// `[policy.config]` table `policy_config`.
fn config(decode: &Mockers, prefill: &Mockers, router: &str, policy_config: &str) -> String {
    format!(
        "[server]\nplaintext = true\n\
         [policy]\nrouter = \"{router}\"\ndeadline_ms = 50\n[policy.config]\n{policy_config}\n\
         [[workers]]\nname = \"decode\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"switchyard\"\nrole = \"decode\"\n\
         [[workers]]\nname = \"prefill\"\nurl = \"http://{}\"\nmodel = \"mock\"\nengine = \"switchyard\"\nrole = \"prefill\"\n",
        decode.addrs[0], prefill.addrs[0]
    )
}

/// A prompt of about `words` tokens that no other test sends.
fn long_text(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{i}")).collect::<Vec<_>>().join(" ")
}

fn chat(messages: serde_json::Value, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "mock",
        "messages": messages,
        "max_tokens": 24,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

fn header(reply: &Reply, name: &str) -> String {
    reply
        .headers
        .get(name)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// The `blocks=N` the answering worker reported pulling.
fn blocks_pulled(reply: &Reply) -> u64 {
    let transfer = header(reply, "x-switchyard-kv-transfer");
    transfer
        .split(';')
        .find_map(|part| part.trim().strip_prefix("blocks="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no blocks in x-switchyard-kv-transfer: `{transfer}`"))
}

/// A whole answer's text and usage, or a stream's.
fn answer_of(reply: &Reply) -> (String, serde_json::Value) {
    let body = String::from_utf8_lossy(&reply.body()).into_owned();
    if body.starts_with("data: ") {
        let mut text = String::new();
        let mut usage = serde_json::Value::Null;
        for chunk in sse_json(&body) {
            if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
                text.push_str(piece);
            }
            if chunk["usage"].is_object() {
                usage = chunk["usage"].clone();
            }
        }
        return (text, usage);
    }
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("not JSON: {body}"));
    (
        json["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        json["usage"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_prompt_is_decoded_where_its_blocks_went_and_serves_the_next_turn() -> anyhow::Result<()> {
    let decode = Mockers::start(&["--num-workers", "1", "--speedup", "10", "--role", "decode"])?;
    let prefill = Mockers::start(&["--num-workers", "1", "--speedup", "10", "--role", "prefill"])?;
    let whole = Mockers::start(&["--num-workers", "1", "--speedup", "10"])?;
    let gateway = Gateway::start(&config(
        &decode,
        &prefill,
        "pd-threshold",
        "max_local_prefill_tokens = 256",
    ))?;
    let client = Client::plain(gateway.addr);

    let first_turn = serde_json::json!([{"role": "user", "content": long_text("turn", 1500)}]);
    let reply = client
        .post_json("/v1/chat/completions", &chat(first_turn.clone(), false))
        .await?;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
    assert_eq!(reply.worker(), "decode", "a prefill worker never answers");
    assert_eq!(header(&reply, "x-switchyard-disagg"), "remote; prefill=prefill");
    let first_blocks = blocks_pulled(&reply);
    let (text, usage) = answer_of(&reply);
    let prompt_tokens = usage["prompt_tokens"].as_u64().expect("usage");
    assert_eq!(first_blocks, prompt_tokens / 64, "every full block of the prompt moved");

    // The same request served whole by a worker of its own answers the same words.
    let direct = Client::plain(whole.addrs[0])
        .post_json("/v1/chat/completions", &chat(first_turn.clone(), false))
        .await?;
    assert_eq!(
        answer_of(&direct).0,
        text,
        "disaggregated and whole serving answer alike"
    );

    // The next turn, streamed: the decode worker holds the first turn's blocks, so only the
    // new ones move, and its usage counts the rest as cached.
    let mut next_turn = first_turn.as_array().cloned().unwrap_or_default();
    next_turn.push(serde_json::json!({"role": "assistant", "content": text}));
    next_turn.push(serde_json::json!({"role": "user", "content": long_text("more", 600)}));
    let next_turn = serde_json::Value::Array(next_turn);
    let reply = client
        .post_json("/v1/chat/completions", &chat(next_turn.clone(), true))
        .await?;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), "decode");
    assert_eq!(header(&reply, "x-switchyard-disagg"), "remote; prefill=prefill");
    let (next_text, next_usage) = answer_of(&reply);
    let next_blocks = blocks_pulled(&reply);
    let next_prompt = next_usage["prompt_tokens"].as_u64().expect("usage");
    assert!(
        next_blocks > 0 && next_blocks + first_blocks <= next_prompt / 64,
        "only the blocks past the first turn's moved: {next_blocks} of {}",
        next_prompt / 64
    );
    let cached = next_usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        cached >= first_blocks * 64,
        "the decode worker reused the first turn's blocks: {cached} cached tokens"
    );
    let direct = Client::plain(whole.addrs[0])
        .post_json("/v1/chat/completions", &chat(next_turn, true))
        .await?;
    assert_eq!(answer_of(&direct).0, next_text);

    // A short prompt stays on the decode worker, and says nothing of disaggregation.
    let reply = client
        .post_json(
            "/v1/chat/completions",
            &chat(serde_json::json!([{"role": "user", "content": "hi"}]), false),
        )
        .await?;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), "decode");
    assert!(reply.headers.get("x-switchyard-disagg").is_none());

    let metrics = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    assert_eq!(
        metric_sum(&metrics, "switchyard_disagg_requests_total", &["outcome=\"remote\""]),
        2.0
    );
    assert_eq!(metric_sum(&metrics, "switchyard_disagg_fallbacks_total", &[]), 0.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_transfer_params_never_reach_a_worker() -> anyhow::Result<()> {
    let decode = Mockers::start(&["--num-workers", "1", "--speedup", "20", "--role", "decode"])?;
    let prefill = Mockers::start(&["--num-workers", "1", "--speedup", "20", "--role", "prefill"])?;
    let gateway = Gateway::start(&config(&decode, &prefill, "least-load", ""))?;
    let client = Client::plain(gateway.addr);
    // A pull from an address of the client's choosing, and a request for the worker's own.
    for params in [
        serde_json::json!({"do_remote_prefill": true, "remote_url": "http://127.0.0.1:9"}),
        serde_json::json!({"do_remote_decode": true}),
    ] {
        let mut body = chat(
            serde_json::json!([{"role": "user", "content": long_text("own", 300)}]),
            false,
        );
        body["kv_transfer_params"] = params;
        let reply = client.post_json("/v1/chat/completions", &body).await?;
        assert_eq!(reply.status, 200);
        assert!(reply.headers.get("x-switchyard-kv-transfer").is_none());
        let answer = reply.json()?;
        assert!(answer.get("kv_transfer_params").is_none(), "{answer}");
    }
    let metrics = Client::plain(decode.addrs[0]).send("GET", "/metrics", "").await?;
    let metrics = String::from_utf8(metrics.body())?;
    assert_eq!(
        metric_sum(&metrics, "switchyard_mocker_kv_transfers_total", &[]),
        0.0,
        "the worker never tried a pull"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routers_that_do_not_disaggregate_never_send_a_request_to_a_prefill_worker() -> anyhow::Result<()> {
    let decode = Mockers::start(&["--num-workers", "1", "--speedup", "20", "--role", "decode"])?;
    let prefill = Mockers::start(&["--num-workers", "1", "--speedup", "20", "--role", "prefill"])?;
    let gateway = Gateway::start(&config(&decode, &prefill, "least-load", ""))?;
    let client = Client::plain(gateway.addr);
    // At once, so that the decode worker is busy and the prefill worker the least loaded.
    let requests: Vec<_> = (0..12)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                let messages = serde_json::json!([{"role": "user", "content": long_text(&format!("q{i}x"), 300)}]);
                client
                    .post_json("/v1/chat/completions", &chat(messages, i % 2 == 0))
                    .await
            })
        })
        .collect();
    for request in requests {
        let reply = request.await??;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker(), "decode", "the idle prefill worker is not a candidate");
        assert!(reply.headers.get("x-switchyard-disagg").is_none());
    }
    Ok(())
}
