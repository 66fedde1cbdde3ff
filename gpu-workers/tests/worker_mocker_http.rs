//! The `switchyard-mocker` binary over HTTP: several engines, text and token-id prompts,
//! streaming, prefix-cache hits, errors.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};

struct Mocker(Child, Vec<SocketAddr>);

impl Drop for Mocker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(args: &[&str]) -> Mocker {
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard-mocker"))
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start mocker");
    let stdout = child.stdout.take().expect("stdout");
    let mut addrs = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("line");
        if let Some(addr) = line.split("listening on http://").nth(1) {
            addrs.push(addr.trim().parse().expect("address"));
        }
        if line.starts_with("mocker ready") {
            break;
        }
    }
    Mocker(child, addrs)
}

/// A minimal HTTP/1.1 exchange with `connection: close`; returns status and body.
fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn serves_several_engines_with_prefix_caching() {
    let mocker = start(&["--num-workers", "3", "--speedup", "20", "--block-size", "16"]);
    assert_eq!(mocker.1.len(), 3, "one port per engine");
    let prompt: Vec<u32> = (0..100).collect();
    let body = serde_json::json!({"model": "mock", "prompt": prompt, "max_tokens": 4}).to_string();
    let (status, first) = post(mocker.1[1], "/v1/completions", &body);
    assert_eq!(status, 200, "{first}");
    let first: serde_json::Value = serde_json::from_str(&first).expect("json");
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, second) = post(mocker.1[1], "/v1/completions", &body);
    let second: serde_json::Value = serde_json::from_str(&second).expect("json");
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"], 96,
        "six full blocks of 16 hit the cache"
    );
    let (_, other_engine) = post(mocker.1[2], "/v1/completions", &body);
    let other: serde_json::Value = serde_json::from_str(&other_engine).expect("json");
    assert_eq!(
        other["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "engines have separate caches"
    );
}

#[test]
fn streams_chat_tokens_as_sse() {
    let mocker = start(&["--speedup", "20"]);
    let body = r#"{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":5}"#;
    let (status, text) = post(mocker.1[0], "/v1/chat/completions", body);
    assert_eq!(status, 200);
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.len(), 7, "5 tokens, the finish chunk, [DONE]: {text}");
    assert_eq!(data[6], "[DONE]");
}

#[test]
fn refuses_bad_requests_with_openai_errors() {
    let mocker = start(&["--num-gpu-blocks", "4", "--block-size", "4"]);
    let cases = [
        ("{", 400, "invalid_json"),
        (r#"{"model":"other","prompt":"x"}"#, 404, "model_not_found"),
        (
            r#"{"model":"mock","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#,
            400,
            "context_length_exceeded",
        ),
        (r#"{"model":"mock","prompt":[]}"#, 400, "context_length_exceeded"),
    ];
    for (body, status, code) in cases {
        let (got, text) = post(mocker.1[0], "/v1/completions", body);
        assert_eq!(got, status, "{body}: {text}");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(json["error"]["code"], code, "{text}");
    }
}
