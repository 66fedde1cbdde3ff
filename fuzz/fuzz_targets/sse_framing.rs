//! SSE framing of the error events the gateway writes into a stream that has started (a worker
//! failing mid-stream, an encoder giving up): whatever the error's text, the bytes must read
//! back, by the rules of the HTML standard's event-stream parser, as exactly one event whose
//! data is the error's JSON, so no client can be fed a forged or split event.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use switchyard_protocol::api::ApiError;

#[derive(Debug, Arbitrary)]
struct Input {
    status: u16,
    kind: String,
    code: String,
    message: String,
    param: Option<String>,
}

/// The data of each event in `stream`, as an EventSource would dispatch them.
fn events(stream: &[u8]) -> Vec<String> {
    let text = String::from_utf8(stream.to_vec()).expect("the stream is UTF-8");
    let mut dispatched = Vec::new();
    let mut data: Option<String> = None;
    // Lines end at CRLF, LF or CR.
    let normalized = text.replace("\r\n", "\n").replace('\r', "\n");
    let mut lines: Vec<&str> = normalized.split('\n').collect();
    // The text after the last line end is an incomplete line: never processed.
    lines.pop();
    for line in lines {
        if line.is_empty() {
            if let Some(done) = data.take() {
                dispatched.push(done);
            }
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        if field == "data" {
            let buffer = data.get_or_insert_with(String::new);
            if !buffer.is_empty() {
                buffer.push('\n');
            }
            buffer.push_str(value);
        }
    }
    dispatched
}

fuzz_target!(|input: Input| {
    let status = http::StatusCode::from_u16(input.status).unwrap_or(http::StatusCode::BAD_GATEWAY);
    let error = ApiError::new(status, &input.kind, &input.code, input.message.clone()).with_param(input.param.clone());
    let stream = error.to_sse_event();
    let dispatched = events(&stream);
    assert_eq!(
        dispatched.len(),
        1,
        "one error became {} events: {stream:?}",
        dispatched.len()
    );
    let json: serde_json::Value = serde_json::from_str(&dispatched[0]).expect("the event's data is JSON");
    assert_eq!(json["error"]["message"].as_str(), Some(input.message.as_str()));
    assert_eq!(json["error"]["code"].as_str(), Some(input.code.as_str()));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&error.to_json()).ok(),
        Some(json)
    );
});
