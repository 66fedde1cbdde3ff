//! The `switchyard-mocker` binary over HTTP: several engines, text and token-id prompts,
//! streaming, prefix-cache hits, errors.

use switchyard_harness::Mockers;
use switchyard_harness::blocking::post;

fn mocker(args: &[&str]) -> Mockers {
    Mockers::start(args).expect("the mocker starts")
}

#[test]
fn serves_several_engines_with_prefix_caching() {
    let _turn = switchyard_harness::turn();
    let mocker = mocker(&["--num-workers", "3", "--speedup", "20", "--block-size", "16"]);
    assert_eq!(mocker.addrs.len(), 3, "one port per engine");
    let prompt: Vec<u32> = (0..100).collect();
    let body = serde_json::json!({"model": "mock", "prompt": prompt, "max_tokens": 4}).to_string();
    let (status, first) = post(mocker.addrs[1], "/v1/completions", &body);
    assert_eq!(status, 200, "{first}");
    let first: serde_json::Value = serde_json::from_str(&first).expect("json");
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, second) = post(mocker.addrs[1], "/v1/completions", &body);
    let second: serde_json::Value = serde_json::from_str(&second).expect("json");
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"], 96,
        "six full blocks of 16 hit the cache"
    );
    let (_, other_engine) = post(mocker.addrs[2], "/v1/completions", &body);
    let other: serde_json::Value = serde_json::from_str(&other_engine).expect("json");
    assert_eq!(
        other["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "engines have separate caches"
    );
}

#[test]
fn streams_chat_tokens_as_sse() {
    let _turn = switchyard_harness::turn();
    let mocker = mocker(&["--speedup", "20"]);
    let body = r#"{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":5}"#;
    let (status, text) = post(mocker.addrs[0], "/v1/chat/completions", body);
    assert_eq!(status, 200);
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.len(), 7, "5 tokens, the finish chunk, [DONE]: {text}");
    assert_eq!(data[6], "[DONE]");
}

#[test]
fn include_usage_ends_the_stream_with_a_usage_chunk() {
    let _turn = switchyard_harness::turn();
    let mocker = mocker(&["--speedup", "20"]);
    let body = r#"{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":3,
                  "stream_options":{"include_usage":true}}"#;
    let (status, text) = post(mocker.addrs[0], "/v1/chat/completions", body);
    assert_eq!(status, 200);
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(
        data.len(),
        6,
        "3 tokens, the finish chunk, the usage chunk, [DONE]: {text}"
    );
    let finish: serde_json::Value = serde_json::from_str(data[3]).expect("json");
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert!(finish.get("usage").is_none(), "usage has a chunk of its own: {finish}");
    let usage: serde_json::Value = serde_json::from_str(data[4]).expect("json");
    assert_eq!(usage["choices"], serde_json::json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert_eq!(usage["id"], finish["id"]);
    assert_eq!(data[5], "[DONE]");
}

#[test]
fn refuses_bad_requests_with_openai_errors() {
    let _turn = switchyard_harness::turn();
    let mocker = mocker(&["--num-gpu-blocks", "4", "--block-size", "4"]);
    let cases = [
        ("{", 400, "invalid_json"),
        (r#"{"model":"other","prompt":"x"}"#, 404, "model_not_found"),
        (
            r#"{"model":"mock","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#,
            400,
            "context_length_exceeded",
        ),
        (r#"{"model":"mock","prompt":[]}"#, 400, "invalid_value"),
        (
            r#"{"model":"mock","prompt":"x","temperature":-1}"#,
            400,
            "invalid_value",
        ),
        (r#"{"model":"mock","prompt":"x","top_p":0}"#, 400, "invalid_value"),
        (r#"{"model":"mock","prompt":"x","seed":"seven"}"#, 400, "invalid_type"),
        (
            r#"{"model":"mock","prompt":"x","stop":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]}"#,
            400,
            "invalid_value",
        ),
    ];
    for (body, status, code) in cases {
        let (got, text) = post(mocker.addrs[0], "/v1/completions", body);
        assert_eq!(got, status, "{body}: {text}");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(json["error"]["code"], code, "{text}");
    }
}

/// The `data:` payloads of an SSE answer, `[DONE]` left out, parsed.
fn chunks(sse: &str) -> Vec<serde_json::Value> {
    sse.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).expect("a JSON chunk"))
        .collect()
}

#[test]
fn token_ids_come_with_their_text_and_continue_a_stream_elsewhere() {
    let _turn = switchyard_harness::turn();
    let mocker = mocker(&["--num-workers", "2", "--speedup", "50"]);
    let body = r#"{"model":"mock","messages":[{"role":"user","content":"where does this go"}],
                  "stream":true,"max_tokens":12,"return_token_ids":true}"#;
    let (status, sse) = post(mocker.addrs[0], "/v1/chat/completions", body);
    assert_eq!(status, 200, "{sse}");
    let first = chunks(&sse);
    let prompt: Vec<u32> = serde_json::from_value(first[0]["prompt_token_ids"].clone()).expect("prompt ids first");
    assert!(first[1].get("prompt_token_ids").is_none(), "the prompt's ids come once");
    let mut ids = Vec::new();
    let mut texts = Vec::new();
    for chunk in &first {
        let choice = &chunk["choices"][0];
        let these: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).expect("ids in every chunk");
        if let Some(text) = choice["delta"]["content"].as_str() {
            assert_eq!(these.len(), 1, "one mock word per token: {chunk}");
            texts.push(text.to_string());
        }
        ids.extend(these);
    }
    assert_eq!(ids.len(), 12);

    // The prompt and the first 5 ids, on the other engine: the same last 7 words.
    let continued_prompt = [prompt.as_slice(), &ids[..5]].concat();
    let continued = serde_json::json!({
        "model": "mock",
        "prompt": continued_prompt,
        "max_tokens": 7,
        "stream": true,
        "return_token_ids": true,
    });
    let (status, sse) = post(mocker.addrs[1], "/v1/completions", &continued.to_string());
    assert_eq!(status, 200, "{sse}");
    let rest = chunks(&sse);
    assert_eq!(
        rest[0]["choices"][0]["prompt_token_ids"].as_array().map(Vec::len),
        Some(prompt.len() + 5),
        "a completion's prompt ids are in its choice"
    );
    let rest_text: String = rest
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(rest_text, texts[5..].concat());

    // Without the field, no ids.
    let plain = r#"{"model":"mock","messages":[{"role":"user","content":"x"}],"stream":true,"max_tokens":2}"#;
    let (_, sse) = post(mocker.addrs[0], "/v1/chat/completions", plain);
    assert!(!sse.contains("token_ids"), "{sse}");
}
