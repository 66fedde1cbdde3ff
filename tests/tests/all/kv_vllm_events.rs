//! The vLLM and SGLang adapter end to end: a publisher written here emits vLLM's real KV event
//! wire format (ZMQ PUB, `[topic, seq u64 BE, msgpack KVEventBatch]`, events as msgspec tagged
//! maps with vLLM's own block hashes), or SGLang's (the same frames, array-like events of
//! one-token pages), and the gateway routes a prompt to the worker that cached it.

use std::time::Duration;

use bytes::Bytes;
use rmpv::Value;
use switchyard_harness::{Admin, Client, Gateway, Mockers, eventually, metric_sum};
use zeromq::{Socket, SocketSend, ZmqMessage};

const TOKEN: &str = "vllm-events-admin-token";
const BLOCK: usize = 16;

/// A block hash as vLLM sends it: an int, or (with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) the
/// 32-byte digest whose low 64 bits are that int.
fn hash(value: u64, as_bytes: bool) -> Value {
    if as_bytes {
        let mut digest = vec![0xabu8; 24];
        digest.extend_from_slice(&value.to_be_bytes());
        Value::Binary(digest)
    } else {
        Value::from(value)
    }
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

/// `BlockStored` as msgspec encodes it (tag under `type`, fields in declaration order, the
/// fields without a default always present).
fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], as_bytes: bool) -> Value {
    map(vec![
        ("type", Value::from("BlockStored")),
        (
            "block_hashes",
            Value::Array(hashes.iter().map(|&h| hash(h, as_bytes)).collect()),
        ),
        ("parent_block_hash", parent.map_or(Value::Nil, |p| hash(p, as_bytes))),
        (
            "token_ids",
            Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        ),
        ("block_size", Value::from(BLOCK as u64)),
        ("lora_id", Value::Nil),
        ("medium", Value::from("GPU")),
        ("lora_name", Value::Nil),
    ])
}

fn removed(hashes: &[u64]) -> Value {
    map(vec![
        ("type", Value::from("BlockRemoved")),
        (
            "block_hashes",
            Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        ),
        ("medium", Value::from("GPU")),
    ])
}

/// `KVEventBatch` is array-like: `[ts, events, data_parallel_rank]`.
fn batch(events: Vec<Value>) -> Bytes {
    let value = Value::Array(vec![Value::F64(1_763_900_000.5), Value::Array(events), Value::from(0)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &value).expect("encodes");
    Bytes::from(out)
}

async fn publish(socket: &mut zeromq::PubSocket, seq: u64, payload: Bytes) -> anyhow::Result<()> {
    let mut message = ZmqMessage::from(Bytes::from_static(b"kv-events"));
    message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
    message.push_back(payload);
    socket.send(message).await?;
    Ok(())
}

async fn cached(admin: &Admin, worker: &str) -> u64 {
    match admin.call("GET", "/admin/kv", Vec::new()).await {
        Ok((200, body)) => body["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|w| w["name"] == worker)
            .and_then(|w| w["cached_blocks"].as_u64())
            .unwrap_or(0),
        _ => 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_kv_events_drive_kv_aware_routing() -> anyhow::Result<()> {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await?;
    let mockers = Mockers::start(&["--num-workers", "2", "--block-size", "16", "--speedup", "20"])?;
    let config = format!(
        "[server]\nplaintext = true\n\
         [[models]]\nname = \"mock\"\nblock_size = 16\n\
         [[workers]]\nname = \"vllm-a\"\nurl = \"http://{}\"\nmodel = \"mock\"\nblock_size = 16\n\
         [[workers]]\nname = \"vllm-b\"\nurl = \"http://{}\"\nmodel = \"mock\"\nblock_size = 16\n\
         [[kv.vllm]]\nworker = \"vllm-a\"\nendpoint = \"{endpoint}\"\ntopic = \"kv-events\"\n",
        mockers.addrs[0], mockers.addrs[1]
    );
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let client = Client::plain(gateway.addr);

    // The prompt as the gateway tokenizes it (byte-level fallback, default chat template).
    let content = "Explain the difference between paged attention and prefix caching. ".repeat(6);
    let messages = vec![switchyard_protocol::api::ChatMessage {
        role: "user".into(),
        content: Some(switchyard_protocol::api::MessageContent::Text(content.clone())),
    }];
    let tokens = switchyard_tokenize::byte_tokens(&switchyard_tokenize::render_chat(&messages));
    let blocks = tokens.len() / BLOCK;
    assert!(blocks >= 20);
    // vLLM's own hashes: opaque to the gateway, which recomputes its own from the tokens.
    let theirs: Vec<u64> = (0..blocks as u64).map(|i| 0x9e37_79b9_0000_0000 ^ (i * 7919)).collect();
    let half = blocks / 2;

    // PUB drops messages until the gateway's subscription arrives: repeat seq 0 until seen.
    let first = batch(vec![stored(&theirs[..half], None, &tokens[..half * BLOCK], false)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut joined = false;
    while !joined && std::time::Instant::now() < deadline {
        publish(&mut publisher, 0, first.clone()).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        joined = cached(&admin, "vllm-a").await == half as u64;
    }
    assert!(joined, "the gateway never indexed the first batch");
    // The rest, chained through vLLM's parent hash, with hashes sent as 32-byte digests.
    publish(
        &mut publisher,
        1,
        batch(vec![stored(
            &theirs[half..],
            Some(theirs[half - 1]),
            &tokens[half * BLOCK..blocks * BLOCK],
            true,
        )]),
    )
    .await?;
    assert!(
        eventually(Duration::from_secs(5), || async {
            cached(&admin, "vllm-a").await == blocks as u64
        })
        .await
    );

    for _ in 0..8 {
        let body = serde_json::json!({
            "model": "mock",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
        });
        let reply = client.post_json("/v1/chat/completions", &body).await?;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker(), "vllm-a", "the worker whose vLLM cache holds the prompt");
    }

    publish(&mut publisher, 2, batch(vec![removed(&theirs[blocks - 2..])])).await?;
    assert!(
        eventually(Duration::from_secs(5), || async {
            cached(&admin, "vllm-a").await == blocks as u64 - 2
        })
        .await
    );

    // Garbage is counted and skipped; the stream goes on.
    publish(&mut publisher, 3, Bytes::from_static(b"\xc1 not msgpack")).await?;
    // seq 4..9 are lost: the adapter reports a gap, drops vllm-a's blocks and goes on.
    publish(
        &mut publisher,
        10,
        batch(vec![stored(&[42], None, &tokens[..BLOCK], false)]),
    )
    .await?;
    assert!(eventually(Duration::from_secs(5), || async { cached(&admin, "vllm-a").await == 1 }).await);
    let metrics = String::from_utf8_lossy(&client.send("GET", "/metrics", Vec::new()).await?.body()).into_owned();
    assert!(metric_sum(&metrics, "switchyard_kv_event_gaps_total", &["worker=\"vllm-a\""]) >= 1.0);
    assert!(
        metric_sum(
            &metrics,
            "switchyard_kv_resyncs_total",
            &["worker=\"vllm-a\"", "outcome=\"cleared\""]
        ) >= 1.0
    );
    assert!(
        metric_sum(
            &metrics,
            "switchyard_kv_events_ignored_total",
            &["reason=\"undecodable\""]
        ) >= 1.0
    );
    Ok(())
}

/// SGLang's `BlockStored` as its msgspec structs encode it: array-like and tagged,
/// `[tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id]`, with one-token
/// pages and Python's signed `hash()` ids.
fn sglang_pages(hashes: &[i64], parent: Option<i64>, tokens: &[u32]) -> Value {
    Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        parent.map_or(Value::Nil, Value::from),
        Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        Value::from(1),
        Value::Nil,
    ])
}

/// SGLang's `KVEventBatch`: `[ts, events]`.
fn sglang_batch(events: Vec<Value>) -> Bytes {
    let value = Value::Array(vec![Value::F64(1_763_900_000.5), Value::Array(events)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &value).expect("encodes");
    Bytes::from(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_kv_events_of_one_token_pages_drive_kv_aware_routing() -> anyhow::Result<()> {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await?;
    let mockers = Mockers::start(&["--num-workers", "2", "--block-size", "16", "--speedup", "20"])?;
    let config = format!(
        "[server]\nplaintext = true\n\
         [[models]]\nname = \"mock\"\nblock_size = 16\n\
         [[workers]]\nname = \"sglang-a\"\nurl = \"http://{}\"\nmodel = \"mock\"\nblock_size = 16\n\
         [[workers]]\nname = \"sglang-b\"\nurl = \"http://{}\"\nmodel = \"mock\"\nblock_size = 16\n\
         [[kv.sglang]]\nworker = \"sglang-b\"\nendpoint = \"{endpoint}\"\n",
        mockers.addrs[0], mockers.addrs[1]
    );
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let client = Client::plain(gateway.addr);
    let content = "Which of these radix trees holds the longest cached prefix of this prompt? ".repeat(5);
    let messages = vec![switchyard_protocol::api::ChatMessage {
        role: "user".into(),
        content: Some(switchyard_protocol::api::MessageContent::Text(content.clone())),
    }];
    let tokens = switchyard_tokenize::byte_tokens(&switchyard_tokenize::render_chat(&messages));
    let blocks = tokens.len() / BLOCK;
    assert!(blocks >= 16);
    // One page per token, each with SGLang's own (here negative, as Python's hash often is) id.
    let ids: Vec<i64> = (0..tokens.len() as i64).map(|i| -(i * 104_729 + 17)).collect();
    let cut = 7 * BLOCK + 5; // the first batch ends inside a block of ours
    let first = sglang_batch(vec![sglang_pages(&ids[..cut], None, &tokens[..cut])]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut joined = false;
    while !joined && std::time::Instant::now() < deadline {
        publish(&mut publisher, 0, first.clone()).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        joined = cached(&admin, "sglang-b").await == 7;
    }
    assert!(joined, "the gateway never indexed the first batch as 7 whole blocks");
    publish(
        &mut publisher,
        1,
        sglang_batch(vec![sglang_pages(&ids[cut..], Some(ids[cut - 1]), &tokens[cut..])]),
    )
    .await?;
    assert!(
        eventually(Duration::from_secs(5), || async {
            cached(&admin, "sglang-b").await == blocks as u64
        })
        .await,
        "the second batch continued the chain from the first's pending tokens"
    );
    for _ in 0..6 {
        let body = serde_json::json!({
            "model": "mock",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
        });
        let reply = client.post_json("/v1/chat/completions", &body).await?;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.worker(),
            "sglang-b",
            "the worker whose SGLang cache holds the prompt"
        );
    }
    Ok(())
}
