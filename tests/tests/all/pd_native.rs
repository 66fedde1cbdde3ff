//! Prefill/decode disaggregation between native workers: two `switchyard-llm` processes on the
//! tiny Llama fixture, announced `prefill` and `decode`, behind a gateway whose built-in
//! `pd-threshold` router disaggregates every prompt. The decode worker pulls the prompt's KV
//! blocks — their keys and values, over HTTP — from the prefill worker and generates what a
//! third worker serving the request whole generates, token for token; a prompt whose prefix it
//! holds already pulls only the blocks it lacks. A decode worker never takes blocks in without
//! their contents: from a mocker (blocks by name only) or from a worker caching another dtype
//! it prefills the prompt itself, and says why.
//!
//! Compared: the greedy token ids (`return_token_ids`) of 48 generated tokens, exactly. The
//! workers answer no `logprobs`, so logits are compared below the HTTP layer, in
//! `switchyard-llm`'s `llm_kv_transfer` tests (bit for bit after an f32 import).

use anyhow::Context;
use serde_json::{Value, json};
use switchyard_harness::{Client, Gateway, Mockers, NativeWorker, Reply, fixtures};

/// Tokens per KV block.
const BLOCK: usize = 4;

/// Bytes of one block's payload for the tiny Llama in f32: a 24-byte header, then keys and
/// values of 2 layers × 4 positions × 2 KV heads × 16 dimensions × 4 bytes.
const PAYLOAD_BYTES: u64 = 24 + 2 * 2 * 4 * 2 * 16 * 4;

/// Tokens generated per request: enough that a single wrong key or value would show.
const GENERATED: u64 = 48;

fn worker(model: &str, extra: &[&str]) -> anyhow::Result<NativeWorker> {
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
    ];
    args.extend_from_slice(extra);
    NativeWorker::start(&args)
}

fn gateway_config(model: &str, decode: &NativeWorker, prefill: &NativeWorker) -> String {
    format!(
        "[server]\nplaintext = true\n\
         [policy]\nrouter = \"pd-threshold\"\ndeadline_ms = 50\n\
         [policy.config]\nmax_local_prefill_tokens = 0\nmax_prefill_queue = 100\n\
         [[models]]\nname = \"tiny\"\nblock_size = 4\ntokenizer = \"{model}/tokenizer.json\"\n\
         [[workers]]\nname = \"decode\"\nurl = \"http://{}\"\nmodel = \"tiny\"\nengine = \"switchyard\"\nblock_size = 4\nrole = \"decode\"\n\
         [[workers]]\nname = \"prefill\"\nurl = \"http://{}\"\nmodel = \"tiny\"\nengine = \"switchyard\"\nblock_size = 4\nrole = \"prefill\"\n",
        decode.addr, prefill.addr
    )
}

/// A completion of `prompt` (token ids), greedy, reporting its token ids.
fn completion(prompt: &[u32]) -> Value {
    json!({
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": GENERATED,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
    })
}

/// `prompt` for `model`'s vocabulary: `len` ids from `seed`, none of them special.
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (seed + i * 37) % 280).collect()
}

fn header(reply: &Reply, name: &str) -> String {
    reply
        .headers
        .get(name)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// The `key=N` field of the answering worker's `x-switchyard-kv-transfer`.
fn transferred(reply: &Reply, key: &str) -> u64 {
    let transfer = header(reply, "x-switchyard-kv-transfer");
    transfer
        .split(';')
        .find_map(|part| part.trim().strip_prefix(key)?.strip_prefix('='))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in x-switchyard-kv-transfer: `{transfer}`"))
}

/// A completion answer's generated token ids and cached prompt tokens.
fn generated(reply: &Reply) -> anyhow::Result<(Vec<u64>, u64)> {
    anyhow::ensure!(reply.status == 200, "{}", String::from_utf8_lossy(&reply.body()));
    let answer = reply.json()?;
    let ids: Vec<u64> = answer["choices"][0]["token_ids"]
        .as_array()
        .with_context(|| format!("no token ids in {answer}"))?
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    anyhow::ensure!(ids.len() as u64 == GENERATED, "{answer}");
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    Ok((ids, cached))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_request_generates_the_tokens_of_whole_serving_moving_only_missing_blocks() -> anyhow::Result<()>
{
    let model = fixtures::llm("tiny-llama");
    let model = model.to_str().context("the fixture path is not UTF-8")?;
    let prefill = worker(model, &["--role", "prefill", "--name", "prefill", "--node", "n0"])?;
    let decode = worker(model, &["--role", "decode", "--name", "decode", "--node", "n0"])?;
    let whole = worker(model, &[])?;
    let gateway = Gateway::start(&gateway_config(model, &decode, &prefill))?;
    let client = Client::plain(gateway.addr);
    let whole = Client::plain(whole.addr);

    // 90 tokens: 22 full blocks move, the last 2 tokens are prefilled on the decode worker.
    let first = prompt(5, 90);
    let reply = client.post_json("/v1/completions", &completion(&first)).await?;
    let (tokens, cached) = generated(&reply)?;
    assert_eq!(reply.worker(), "decode", "a prefill worker never answers");
    assert_eq!(header(&reply, "x-switchyard-disagg"), "remote; prefill=prefill");
    assert_eq!(
        transferred(&reply, "blocks"),
        22,
        "every full block of the prompt moved"
    );
    assert_eq!(
        transferred(&reply, "bytes"),
        22 * PAYLOAD_BYTES,
        "each with its keys and values"
    );
    assert_eq!(cached, 88, "the decode worker computed only the tail");
    let (expected, _) = generated(&whole.post_json("/v1/completions", &completion(&first)).await?)?;
    assert_eq!(
        tokens, expected,
        "disaggregated and whole serving generate the same tokens"
    );

    // A prompt sharing the first 16 blocks: the decode worker holds them, so the 10 past them
    // move, and nothing else.
    let mut second = first[..16 * BLOCK].to_vec();
    second.extend(prompt(101, 42));
    let reply = client.post_json("/v1/completions", &completion(&second)).await?;
    let (tokens, cached) = generated(&reply)?;
    assert_eq!(header(&reply, "x-switchyard-disagg"), "remote; prefill=prefill");
    assert_eq!(
        transferred(&reply, "blocks"),
        10,
        "only the blocks missing on the decode worker"
    );
    assert_eq!(transferred(&reply, "bytes"), 10 * PAYLOAD_BYTES);
    assert_eq!(cached, 104);
    let (expected, _) = generated(&whole.post_json("/v1/completions", &completion(&second)).await?)?;
    assert_eq!(tokens, expected);

    // A prompt of whole blocks only: all move, and the last one is recomputed to sample from.
    let third = prompt(211, 64);
    let reply = client.post_json("/v1/completions", &completion(&third)).await?;
    let (tokens, cached) = generated(&reply)?;
    assert_eq!(transferred(&reply, "blocks"), 16);
    assert_eq!(cached, 60);
    let (expected, _) = generated(&whole.post_json("/v1/completions", &completion(&third)).await?)?;
    assert_eq!(tokens, expected);
    Ok(())
}

/// The request a router sends a decode worker: `body` with a prefill worker's parameters.
fn pulling_from(body: &Value, remote: std::net::SocketAddr) -> Value {
    let mut body = body.clone();
    body["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_url": format!("http://{remote}")});
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_decode_worker_never_imports_blocks_without_their_contents() -> anyhow::Result<()> {
    let model = fixtures::llm("tiny-llama");
    let model = model.to_str().context("the fixture path is not UTF-8")?;
    let prefill = worker(model, &["--role", "prefill"])?;
    let decode = worker(model, &["--role", "decode"])?;
    let decode_f16 = worker(model, &["--role", "decode", "--kv-cache-dtype", "f16"])?;
    let mocker = Mockers::start(&["--role", "prefill", "--block-size", "4", "--speedup", "50"])?;
    let ids = prompt(9, 41);

    // The native prefill worker computes the prompt; its export answers names to a worker
    // that moves blocks by name, and keys and values to one that asks for them.
    let answer = Client::plain(prefill.addr)
        .post_json("/v1/completions", &completion(&ids))
        .await?;
    anyhow::ensure!(answer.status == 200, "{}", String::from_utf8_lossy(&answer.body()));
    let hashes: Vec<u64> = switchyard_protocol::block_hash::block_hashes(&ids, BLOCK)
        .iter()
        .map(|hash| hash.sequence)
        .collect();
    let names = Client::plain(prefill.addr)
        .post_json("/v1/kv/export", &json!({"block_hashes": hashes}))
        .await?;
    assert_eq!(header(&names, "content-type"), "application/json");
    let names = names.json()?;
    assert_eq!(names["block_hashes"].as_array().map(Vec::len), Some(10));
    assert_eq!(names["block_bytes"], 2 * 2 * 4 * 2 * 16 * 4, "the real size of a block");
    let blocks = Client::plain(prefill.addr)
        .post_json("/v1/kv/export", &json!({"block_hashes": hashes, "payloads": true}))
        .await?;
    assert_eq!(header(&blocks, "content-type"), "application/x-switchyard-kv-blocks");
    let blocks = switchyard_protocol::kv_blocks::decode(blocks.body().into())?;
    assert_eq!(blocks.block_hashes, hashes);
    assert!(
        blocks
            .payloads
            .iter()
            .all(|payload| payload.len() as u64 == PAYLOAD_BYTES)
    );

    let (expected, _) = generated(
        &Client::plain(prefill.addr)
            .post_json("/v1/completions", &completion(&ids))
            .await?,
    )?;
    // The mocker holds the same blocks by name (it hashes token ids as every worker does).
    let mut mock_body = completion(&ids);
    mock_body["model"] = json!("mock");
    let mocked = Client::plain(mocker.addrs[0])
        .post_json("/v1/completions", &mock_body)
        .await?;
    anyhow::ensure!(mocked.status == 200, "{}", String::from_utf8_lossy(&mocked.body()));

    for (decode, remote, same_dtype, why) in [
        (
            &decode,
            mocker.addrs[0],
            true,
            "a mocker's blocks hold no keys or values",
        ),
        (
            &decode_f16,
            prefill.addr,
            false,
            "f32 keys and values are not an f16 cache's",
        ),
    ] {
        let reply = Client::plain(decode.addr)
            .post_json("/v1/completions", &pulling_from(&completion(&ids), remote))
            .await?;
        assert_eq!(
            header(&reply, "x-switchyard-kv-transfer"),
            "local; reason=payload",
            "{why}"
        );
        let (tokens, cached) = generated(&reply)?;
        assert_eq!(cached, 0, "{why}: nothing was imported");
        if same_dtype {
            // (An f16 cache rounds the keys and values, so its tokens may differ.)
            assert_eq!(tokens, expected, "{why}: prefilled here, the same tokens");
        }
    }
    // The same pull from the native prefill worker, by a decode worker of its dtype whose
    // cache is emptied of the prompt it just prefilled itself: all 10 blocks move.
    let reset = Client::plain(decode.addr).send("POST", "/kv/reset", "").await?;
    assert_eq!(reset.status, 200, "{}", String::from_utf8_lossy(&reset.body()));
    let reply = Client::plain(decode.addr)
        .post_json("/v1/completions", &pulling_from(&completion(&ids), prefill.addr))
        .await?;
    assert_eq!(transferred(&reply, "blocks"), 10);
    let (tokens, cached) = generated(&reply)?;
    assert_eq!((tokens, cached), (expected, 40));
    Ok(())
}
