//! The `switchyard-llm` binary over HTTP on the tiny Llama fixture: the same endpoints and
//! wire format as the mocker, text from the model's tokenizer, streamed text equal to the whole
//! answer, prefix-cache hits, metrics, refusals, and a clean exit on SIGTERM.

use std::process::Command;
use std::time::Duration;

use switchyard_harness::blocking::{get, post};
use switchyard_harness::{NativeWorker, fixtures, sse_json};

fn worker(extra: &[&str]) -> NativeWorker {
    let dir = fixtures::llm("tiny-llama");
    let dir = dir.to_str().expect("UTF-8 path").to_string();
    let mut args = vec![
        "--model",
        dir.as_str(),
        "--port",
        "0",
        "--block-size",
        "4",
        "--kv-cache-mib",
        "8",
        "--threads",
        "2",
    ];
    args.extend_from_slice(extra);
    NativeWorker::start(&args).expect("the worker starts")
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|err| panic!("not JSON ({err}): {text}"))
}

#[test]
fn serves_the_model_with_streaming_and_prefix_caching() {
    let _turn = switchyard_harness::turn();
    let worker = worker(&["--served-model-name", "tiny"]);
    let addr = worker.addr;
    let (status, models) = get(addr, "/v1/models");
    assert_eq!(status, 200);
    assert_eq!(json(&models)["data"][0]["id"], "tiny");

    let chat = |stream: bool| {
        serde_json::json!({
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello world, hello switchyard"}],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": true,
            "stream": stream,
        })
        .to_string()
    };
    let (status, whole) = post(addr, "/v1/chat/completions", &chat(false));
    assert_eq!(status, 200, "{whole}");
    let whole = json(&whole);
    let text = whole["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    assert_eq!(whole["usage"]["completion_tokens"], 12);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");

    let (status, streamed) = post(addr, "/v1/chat/completions", &chat(true));
    assert_eq!(status, 200);
    let events = sse_json(&streamed);
    let pieces: String = events
        .iter()
        .filter_map(|event| event["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(pieces, text, "greedy streaming spells out the same answer");
    let last = events.last().expect("a finish chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let prompt_tokens = last["usage"]["prompt_tokens"].as_u64().expect("usage");
    let cached = last["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage");
    assert!(
        cached >= (prompt_tokens / 4 - 1) * 4,
        "the repeated prompt's full blocks come from the cache: {cached} of {prompt_tokens}"
    );

    let (status, metrics) = get(addr, "/metrics");
    assert_eq!(status, 200);
    for name in [
        "switchyard_worker_generated_tokens_per_second",
        "switchyard_worker_batch_sequences",
        "switchyard_worker_mean_batch_sequences",
        "switchyard_worker_kv_usage_ratio",
        "switchyard_worker_prefix_cache_hit_ratio",
        "switchyard_worker_generated_tokens_total 24",
        // Two requests of 12 tokens: 2 first tokens, 22 gaps between tokens, 2 whole requests.
        "switchyard_worker_time_to_first_token_seconds_count 2",
        "switchyard_worker_inter_token_latency_seconds_count 22",
        "switchyard_worker_request_duration_seconds_count 2",
    ] {
        assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
    }
}

#[test]
fn stop_strings_cut_the_answer_before_them_streamed_or_not() {
    let _turn = switchyard_harness::turn();
    let worker = worker(&[]);
    let addr = worker.addr;
    let body = |stop: Option<&str>, stream: bool| {
        let mut body = serde_json::json!({
            "model": "tiny-llama", "prompt": "hello switchyard", "max_tokens": 40,
            "temperature": 0, "ignore_eos": true, "stream": stream,
        });
        if let Some(stop) = stop {
            body["stop"] = serde_json::json!([stop]);
        }
        body.to_string()
    };
    let (status, whole) = post(addr, "/v1/completions", &body(None, false));
    assert_eq!(status, 200, "{whole}");
    let whole = json(&whole)["choices"][0]["text"].as_str().expect("text").to_string();
    // A stop string from the middle of the answer (on character boundaries).
    let chars: Vec<(usize, char)> = whole.char_indices().collect();
    assert!(chars.len() >= 10, "a long enough answer: {whole:?}");
    let (start, end) = (chars[chars.len() / 2].0, chars[chars.len() / 2 + 2].0);
    let stop = &whole[start..end];
    let expected = &whole[..whole.find(stop).expect("it is in the answer")];

    let (status, cut) = post(addr, "/v1/completions", &body(Some(stop), false));
    assert_eq!(status, 200, "{cut}");
    let cut = json(&cut);
    assert_eq!(cut["choices"][0]["text"], expected, "stop {stop:?}");
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    let completion = cut["usage"]["completion_tokens"].as_u64().expect("usage");
    assert!(
        completion > 0 && completion < 40,
        "generation ended early: {completion}"
    );

    let (status, streamed) = post(addr, "/v1/completions", &body(Some(stop), true));
    assert_eq!(status, 200);
    let events = sse_json(&streamed);
    let text: String = events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, expected, "streamed, stop {stop:?}");
    assert_eq!(events.last().expect("a finish")["choices"][0]["finish_reason"], "stop");
    assert!(streamed.ends_with("data: [DONE]\n\n") || streamed.contains("data: [DONE]"));
}

#[test]
fn refuses_what_the_model_cannot_take_and_keeps_serving() {
    let _turn = switchyard_harness::turn();
    let worker = worker(&[]);
    let addr = worker.addr;
    let cases = [
        (r#"{"model":"tiny-llama","prompt":[1,2,999]}"#, "invalid_value"),
        (
            r#"{"model":"tiny-llama","prompt":"hi","max_tokens":400}"#,
            "context_length_exceeded",
        ),
        (r#"{"model":"tiny-llama","prompt":"hi","stop":[1]}"#, "invalid_type"),
        (r#"{"model":"tiny-llama","prompt":"hi","top_k":-3}"#, "invalid_value"),
    ];
    for (body, code) in cases {
        let (status, text) = post(addr, "/v1/completions", body);
        assert_eq!(status, 400, "{body}: {text}");
        assert_eq!(json(&text)["error"]["code"], code, "{text}");
    }
    let (status, text) = post(
        addr,
        "/v1/completions",
        r#"{"model":"tiny-llama","prompt":"hi","max_tokens":3,"seed":5}"#,
    );
    assert_eq!(status, 200, "{text}");
    assert_eq!(json(&text)["usage"]["completion_tokens"], 3);
}

#[test]
fn exits_cleanly_on_sigterm() {
    let _turn = switchyard_harness::turn();
    let mut worker = worker(&[]);
    let (status, _) = get(worker.addr, "/healthz");
    assert_eq!(status, 200);
    worker.process.terminate().expect("kill runs");
    let exit = worker
        .process
        .wait_exit(Duration::from_secs(60))
        .expect("the worker exits");
    assert!(exit.success(), "{exit:?}");
}

#[test]
fn a_missing_model_is_named() {
    let _turn = switchyard_harness::turn();
    let output = Command::new(env!("CARGO_BIN_EXE_switchyard-llm"))
        .args(["--model", "/nonexistent/model-dir", "--port", "0"])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/model-dir/config.json"), "{stderr}");
    let output = Command::new(env!("CARGO_BIN_EXE_switchyard-llm"))
        .args(["--model", "/nonexistent", "--device", "gpu"])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("use `cpu` or `cuda:N`"));
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_gpu_without_the_cuda_build_is_refused_with_the_fix() {
    let _turn = switchyard_harness::turn();
    let dir = fixtures::llm("tiny-llama");
    let output = Command::new(env!("CARGO_BIN_EXE_switchyard-llm"))
        .arg("--model")
        .arg(&dir)
        .args(["--device", "cuda:0", "--port", "0"])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--features cuda"), "{stderr}");
}
