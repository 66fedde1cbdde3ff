//! Prefill/decode disaggregation between `switchyard-mocker` processes, as a router drives it
//! (vLLM's `kv_transfer_params`): the prefill call, the decode call with the parameters it
//! answered, the blocks the decode worker pulls (only those it lacks, in the time the link's
//! bandwidth gives), their reuse afterwards, and the failures that leave the worker to prefill
//! the prompt itself.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_harness::{Client, DeadAddress, Mockers, Reply, metric_sum, sse_json};
use switchyard_protocol::api::{KV_TRANSFER_HEADER, KvTransferReport};

/// Tokens per KV block in these tests.
const BLOCK: u64 = 16;

/// Bytes of a block at the default size: Llama-3-8B at f16, 128 KiB per token.
const DEFAULT_BLOCK_BYTES: u64 = BLOCK * 131_072;

/// A mocker of `role` with blocks of [`BLOCK`] tokens, at speed-up 20 unless `extra` sets one.
fn mocker(role: &str, extra: &[&str]) -> Mockers {
    let mut args = vec!["--role", role, "--block-size", "16"];
    if !extra.contains(&"--speedup") {
        args.extend(["--speedup", "20"]);
    }
    args.extend_from_slice(extra);
    Mockers::start(&args).expect("the mocker starts")
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    Client::plain(addr)
        .post_json(path, body)
        .await
        .unwrap_or_else(|err| panic!("POST http://{addr}{path}: {err:#}"))
}

fn json_of(reply: &Reply) -> Value {
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
    reply.json().expect("a JSON answer")
}

/// The decode worker's report on how the prompt's KV got there.
fn report(reply: &Reply) -> KvTransferReport {
    reply
        .headers
        .get(KV_TRANSFER_HEADER)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_else(|| panic!("no {KV_TRANSFER_HEADER} header: {:?}", reply.headers))
        .parse()
        .expect("a well-formed report")
}

/// The text of a whole chat or completion answer.
fn text(answer: &Value) -> String {
    let choice = &answer["choices"][0];
    choice["message"]["content"]
        .as_str()
        .or_else(|| choice["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {answer}"))
        .to_string()
}

fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached tokens in {answer}"))
}

/// The prompt tokens a worker reuses from `blocks` cached full blocks of a `prompt`-token
/// prompt (a prompt that is all full blocks recomputes its last one, to sample from it).
fn reused(blocks: u64, prompt: u64) -> u64 {
    if blocks * BLOCK >= prompt {
        (blocks - 1) * BLOCK
    } else {
        blocks * BLOCK
    }
}

/// What a router sends the prefill worker: one token, a whole answer, `do_remote_decode`.
fn prefill_body(body: &Value) -> Value {
    let mut body = body.clone();
    body["max_tokens"] = json!(1);
    body["stream"] = json!(false);
    if let Some(fields) = body.as_object_mut() {
        fields.remove("max_completion_tokens");
        fields.remove("stream_options");
    }
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    body
}

/// What a router sends the decode worker: the original body and the prefill's parameters.
fn decode_body(body: &Value, params: &Value) -> Value {
    let mut body = body.clone();
    body["kv_transfer_params"] = params.clone();
    body
}

/// Runs `body` disaggregated on `path`: the prefill call, then the decode call with what it
/// answered. The prefill's parameters and the decode worker's reply.
async fn disaggregated(prefill: SocketAddr, decode: SocketAddr, path: &str, body: &Value) -> (Value, Reply) {
    let answer = json_of(&post(prefill, path, &prefill_body(body)).await);
    assert_eq!(
        answer["usage"]["completion_tokens"], 1,
        "the prefill worker generates one token"
    );
    let params = answer["kv_transfer_params"].clone();
    assert!(params.is_object(), "no kv_transfer_params in {answer}");
    let reply = post(decode, path, &decode_body(body, &params)).await;
    (params, reply)
}

async fn metrics(addr: SocketAddr) -> String {
    let reply = Client::plain(addr)
        .send("GET", "/metrics", "")
        .await
        .expect("metrics answer");
    String::from_utf8_lossy(&reply.body()).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_request_answers_as_a_whole_one_and_leaves_its_blocks_cached() {
    let _turn = switchyard_harness::turn();
    let prefill = mocker("prefill", &["--node", "n1", "--name", "prefill"]);
    let decode = mocker("decode", &["--node", "n2"]);
    let whole = mocker("llm", &[]);
    let (prefill, decode, whole) = (prefill.addrs[0], decode.addrs[0], whole.addrs[0]);
    let path = "/v1/chat/completions";
    let body = json!({
        "model": "mock",
        "messages": [{"role": "user", "content": "Route this request across two workers: one computes the prompt, the other decodes the answer from the blocks it pulled."}],
        "max_tokens": 12,
    });

    let reference = json_of(&post(whole, path, &body).await);
    let prompt = reference["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    let blocks = prompt / BLOCK;
    assert!(blocks >= 4, "a prompt of several blocks: {prompt} tokens");

    let (params, reply) = disaggregated(prefill, decode, path, &body).await;
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], "prefill-0");
    assert_eq!(params["remote_url"], format!("http://{prefill}"));
    assert_eq!(params["remote_host"], prefill.ip().to_string());
    assert_eq!(params["remote_port"], prefill.port());
    assert_eq!(params["remote_node"], "n1");
    assert_eq!(
        params["remote_block_ids"].as_array().map(Vec::len),
        Some(blocks as usize),
        "the prefill worker holds every full block of the prompt"
    );

    let answer = json_of(&reply);
    assert_eq!(
        text(&answer),
        text(&reference),
        "the mock's words depend only on the context"
    );
    assert_eq!(answer["usage"]["completion_tokens"], 12);
    match report(&reply) {
        KvTransferReport::Remote {
            blocks: moved,
            bytes,
            ms,
        } => {
            assert_eq!(moved, blocks, "every full block of the prompt moved");
            assert_eq!(bytes, blocks * DEFAULT_BLOCK_BYTES);
            assert!(ms > 0.0, "moving {bytes} bytes takes time");
        }
        other => panic!("expected a remote transfer, got {other:?}"),
    }
    assert_eq!(
        cached_tokens(&answer),
        reused(blocks, prompt),
        "the decode worker prefilled only the tail past the pulled blocks"
    );

    // The pulled blocks stay cached: the same prompt again, without any transfer.
    let again = post(decode, path, &body).await;
    assert!(
        again.headers.get(KV_TRANSFER_HEADER).is_none(),
        "no transfer asked, none reported"
    );
    let again = json_of(&again);
    assert_eq!(cached_tokens(&again), reused(blocks, prompt));
    assert_eq!(text(&again), text(&reference));

    let decode_metrics = metrics(decode).await;
    assert_eq!(
        metric_sum(
            &decode_metrics,
            "switchyard_mocker_kv_transfers_total",
            &["outcome=\"remote\""]
        ),
        1.0,
        "{decode_metrics}"
    );
    assert_eq!(
        metric_sum(&decode_metrics, "switchyard_mocker_kv_transfer_blocks_total", &[]),
        blocks as f64
    );
    assert_eq!(
        metric_sum(&decode_metrics, "switchyard_mocker_kv_imported_blocks_total", &[]),
        blocks as f64
    );
    let prefill_metrics = metrics(prefill).await;
    assert_eq!(
        metric_sum(&prefill_metrics, "switchyard_mocker_kv_exported_blocks_total", &[]),
        blocks as f64,
        "{prefill_metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_blocks_missing_on_the_decode_worker_move() {
    let _turn = switchyard_harness::turn();
    let prefill = mocker("prefill", &[]);
    let decode = mocker("decode", &[]);
    let (prefill, decode) = (prefill.addrs[0], decode.addrs[0]);
    let path = "/v1/completions";

    // 100 tokens: 6 full blocks.
    let first: Vec<u32> = (0..100).collect();
    let body = json!({"model": "mock", "prompt": first, "max_tokens": 4});
    let (_, reply) = disaggregated(prefill, decode, path, &body).await;
    assert!(matches!(report(&reply), KvTransferReport::Remote { blocks: 6, .. }));
    json_of(&reply);

    // The first 4 blocks shared, then 60 other tokens: 7 full blocks, 3 of them missing. The
    // decode call streams, as a client's would.
    let second: Vec<u32> = first[..64].iter().copied().chain(1000..1060).collect();
    let body = json!({
        "model": "mock",
        "prompt": second,
        "max_tokens": 4,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (params, reply) = disaggregated(prefill, decode, path, &body).await;
    assert_eq!(params["remote_block_ids"].as_array().map(Vec::len), Some(7));
    match report(&reply) {
        KvTransferReport::Remote { blocks, bytes, .. } => {
            assert_eq!(
                (blocks, bytes),
                (3, 3 * DEFAULT_BLOCK_BYTES),
                "the shared prefix stayed where it was"
            );
        }
        other => panic!("expected a remote transfer, got {other:?}"),
    }
    let events = sse_json(&String::from_utf8_lossy(&reply.body()));
    let usage = events.last().expect("a usage chunk");
    assert_eq!(cached_tokens(usage), 112, "all 7 full blocks were cached at admission");

    // A prompt the decode worker holds whole: nothing to move, no call.
    let body = json!({"model": "mock", "prompt": first, "max_tokens": 4});
    let (_, reply) = disaggregated(prefill, decode, path, &body).await;
    assert_eq!(
        reply.headers.get(KV_TRANSFER_HEADER).and_then(|v| v.to_str().ok()),
        Some("remote; blocks=0; bytes=0; ms=0")
    );
    assert_eq!(cached_tokens(&json_of(&reply)), 96);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transfer_takes_bytes_over_the_bandwidth_of_the_link_between_the_nodes() {
    let _turn = switchyard_harness::turn();
    // 4 MiB blocks over 1 GB/s within a node and 0.1 GB/s across, at speed-up 2: 6 blocks
    // take 12.6 ms locally and 126 ms across nodes.
    let link = [
        "--kv-block-bytes",
        "4194304",
        "--kv-link-local-gbps",
        "1",
        "--kv-link-remote-gbps",
        "0.1",
        "--speedup",
        "2",
    ];
    let node = |name: &'static str| {
        let mut args = link.to_vec();
        args.extend(["--node", name]);
        args
    };
    let prefill = mocker("prefill", &node("a"));
    let near = mocker("decode", &node("a"));
    let far = mocker("decode", &node("b"));
    let (prefill, near, far) = (prefill.addrs[0], near.addrs[0], far.addrs[0]);
    let path = "/v1/completions";
    let prompt: Vec<u32> = (0..100).collect();
    let body = json!({"model": "mock", "prompt": prompt, "max_tokens": 2});

    let mut taken = Vec::new();
    for decode in [near, far] {
        let answer = json_of(&post(prefill, path, &prefill_body(&body)).await);
        let started = Instant::now();
        let reply = post(decode, path, &decode_body(&body, &answer["kv_transfer_params"])).await;
        let elapsed = started.elapsed();
        json_of(&reply);
        let KvTransferReport::Remote { blocks, bytes, ms } = report(&reply) else {
            panic!("expected a remote transfer");
        };
        assert_eq!((blocks, bytes), (6, 6 * 4_194_304));
        taken.push((ms, elapsed));
    }
    let [(near_ms, near_wall), (far_ms, far_wall)] = taken[..] else {
        unreachable!()
    };
    let bytes = 6.0 * 4_194_304.0;
    let expect = |gbps: f64| bytes / (gbps * 1e9) * 1e3 / 2.0;
    assert!((near_ms - expect(1.0)).abs() < 0.01, "{near_ms} ms within the node");
    assert!((far_ms - expect(0.1)).abs() < 0.01, "{far_ms} ms across nodes");
    assert!(
        far_wall >= Duration::from_secs_f64(far_ms / 1e3),
        "the request waited for its blocks: {far_wall:?}"
    );
    assert!(far_wall > near_wall, "{far_wall:?} across nodes, {near_wall:?} within");
}

/// Answers every connection with a 200 whose body is not an export answer.
fn garbage_server() -> SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("an address");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\nconnection: close\r\n\r\nnot json");
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pull_leaves_the_decode_worker_to_prefill_the_prompt_itself() {
    let _turn = switchyard_harness::turn();
    let decode = mocker("decode", &["--kv-transfer-timeout-ms", "300"]);
    let decode = decode.addrs[0];
    let path = "/v1/completions";
    let prompt: Vec<u32> = (0..100).collect();
    let body = json!({"model": "mock", "prompt": prompt, "max_tokens": 6});
    let reference = json_of(&post(decode, path, &body).await);

    let dead = DeadAddress::new().expect("a dead address");
    // Accepts connections (the kernel's backlog) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let silent = silent.local_addr().map(|addr| (silent, addr)).expect("an address");
    let garbage = garbage_server();
    let cases = [
        (format!("http://{}", dead.addr), "connect"),
        // The worker itself answers 404 under this prefix.
        (format!("http://{decode}/elsewhere"), "status"),
        (format!("http://{}", silent.1), "timeout"),
        (format!("http://{garbage}"), "answer"),
        // The worker itself, once its cache is cleared, holds none of the blocks.
        (format!("http://{decode}"), "missing"),
    ];
    for (url, reason) in &cases {
        let reset = Client::plain(decode)
            .send("POST", "/kv/reset", "")
            .await
            .expect("reset answers");
        assert_eq!(reset.status, 200);
        let params = json!({"do_remote_prefill": true, "remote_url": url, "remote_block_ids": [1, 2, 3]});
        let started = Instant::now();
        let reply = post(decode, path, &decode_body(&body, &params)).await;
        let answer = json_of(&reply);
        assert_eq!(
            reply.headers.get(KV_TRANSFER_HEADER).and_then(|v| v.to_str().ok()),
            Some(format!("local; reason={reason}").as_str()),
            "{url}"
        );
        assert_eq!(
            text(&answer),
            text(&reference),
            "{url}: the same answer, prefilled here"
        );
        assert_eq!(cached_tokens(&answer), 0, "{url}: nothing was imported");
        if *reason == "timeout" {
            assert!(started.elapsed() >= Duration::from_millis(300));
        }
    }
    // Without an address there is nothing to connect to.
    Client::plain(decode)
        .send("POST", "/kv/reset", "")
        .await
        .expect("reset answers");
    let reply = post(decode, path, &decode_body(&body, &json!({"do_remote_prefill": true}))).await;
    assert_eq!(report(&reply), "local; reason=connect".parse().expect("a report"));

    let text = metrics(decode).await;
    for (outcome, count) in [
        ("connect", 2.0),
        ("status", 1.0),
        ("timeout", 1.0),
        ("answer", 1.0),
        ("missing", 1.0),
        ("remote", 0.0),
    ] {
        let label = format!("outcome=\"{outcome}\"");
        assert_eq!(
            metric_sum(&text, "switchyard_mocker_kv_transfers_total", &[&label]),
            count,
            "{outcome}: {text}"
        );
    }
}
