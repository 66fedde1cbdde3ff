//! The ledger of a stream that may be continued: what a worker's events say, read as they
//! pass to the client.
//!
//! It frames the worker's SSE events, keeps the prompt's token ids (from the first chunk) and
//! the ids of the text relayed, takes the id fields out of the client's events unless the client
//! asked for them, tells an error event from a chunk, and notes `[DONE]`. Once the stream goes
//! on on another worker, it rewrites that worker's chunks (a completion's) into the client's
//! stream: the first worker's id, creation time and model, chat deltas for a chat stream, and
//! the usage of one answer. When every token has come and only the end is missing, it writes
//! the end itself.

use bytes::Bytes;
use serde_json::{Map, Value, json};
use switchyard_protocol::api::{self, Endpoint};

/// Longest event the ledger holds before it ends: the first chunk carries the prompt's ids (about
/// 6 bytes a token), so this is a prompt of two million tokens; the tap's limit applies to the
/// client's events, which carry no prompt.
const MAX_LEDGER_EVENT_BYTES: usize = 12 << 20;

/// The answer's identity, as its first worker gave it: every continuation's chunks carry it.
#[derive(Debug, Clone, Default)]
struct Identity {
    id: Value,
    created: Value,
    model: Value,
}

/// Reads a stream's events as they pass: the token ids (taken out of the client's events
/// unless it asked for them), whether the stream ended, and a continuation's chunks rewritten
/// into the client's stream.
#[derive(Debug)]
pub(in crate::server) struct Ledger {
    /// The client's endpoint: the shape of its chunks.
    endpoint: Endpoint,
    /// The client asked for token ids itself: they stay in its events.
    keep_ids: bool,
    /// Bytes of an event not yet ended by a blank line.
    partial: Vec<u8>,
    /// The prompt's ids, once the first worker's first chunk gave them.
    prompt: Option<Vec<u32>>,
    /// Ids of the text relayed.
    pub(super) generated: Vec<u32>,
    /// Every chunk with text so far came with its ids.
    pub(super) complete: bool,
    /// `[DONE]` has passed.
    pub(in crate::server) done: bool,
    identity: Option<Identity>,
    /// Tokens generated before the continuation streaming now (`None`: the first worker's).
    pub(super) continued_after: Option<usize>,
}

impl Ledger {
    pub(super) fn new(endpoint: Endpoint, keep_ids: bool) -> Ledger {
        Ledger {
            endpoint,
            keep_ids,
            partial: Vec::new(),
            prompt: None,
            generated: Vec::new(),
            complete: true,
            done: false,
            identity: None,
            continued_after: None,
        }
    }

    /// The events that end the client's stream after all of its tokens: the finish chunk (the
    /// reason `length`), the usage (in a chunk of its own when `usage_chunk`, as OpenAI sends
    /// it when asked, else in the finish chunk), and `[DONE]`.
    pub(super) fn finish(&mut self, usage_chunk: bool) -> Bytes {
        self.done = true;
        let identity = self.identity.clone().unwrap_or_default();
        let prompt = self.prompt.as_ref().map_or(0, Vec::len);
        let completion = self.generated.len();
        let usage = json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        });
        let (object, choice) = match self.endpoint {
            Endpoint::Chat => (
                "chat.completion.chunk",
                json!({"index": 0, "delta": {}, "finish_reason": "length"}),
            ),
            Endpoint::Completion => (
                "text_completion",
                json!({"index": 0, "text": "", "finish_reason": "length"}),
            ),
        };
        let chunk = |choices: Value, usage: Option<&Value>| {
            let mut chunk = json!({
                "id": identity.id,
                "object": object,
                "created": identity.created,
                "model": identity.model,
                "choices": choices,
            });
            if let Some(usage) = usage {
                chunk["usage"] = usage.clone();
            }
            api::sse_event(&serde_json::to_vec(&chunk).unwrap_or_default()).to_vec()
        };
        let mut out = if usage_chunk {
            [chunk(json!([choice]), None), chunk(json!([]), Some(&usage))].concat()
        } else {
            chunk(json!([choice]), Some(&usage))
        };
        out.extend_from_slice(api::SSE_DONE);
        out.into()
    }

    /// Whether the stream could be continued from here without dropping part of an event: the
    /// prompt's ids are known and no event is half read.
    pub(super) fn at_boundary(&self) -> bool {
        self.prompt.is_some() && self.partial.is_empty()
    }

    /// The ids to continue from (the prompt's, then the generated ones), if the stream can be
    /// continued: every id is known and it has not ended.
    pub(super) fn continuable(&mut self) -> Option<Vec<u32>> {
        if self.done || !self.complete {
            return None;
        }
        // What a broken worker left of an event is dropped with it.
        self.partial.clear();
        let prompt = self.prompt.as_ref()?;
        Some([prompt.as_slice(), &self.generated].concat())
    }

    /// Takes in `data` from the worker: answers what goes on to the client (whole events),
    /// and why the stream broke if an event says so (an error event, or an event past
    /// [`MAX_LEDGER_EVENT_BYTES`]); what follows a break is dropped.
    pub(in crate::server) fn feed(&mut self, data: &[u8]) -> (Bytes, Option<String>) {
        let mut pending = std::mem::take(&mut self.partial);
        pending.extend_from_slice(data);
        let mut out = Vec::with_capacity(pending.len());
        let mut start = 0;
        while let Some(end) = event_end(&pending[start..]) {
            let event = &pending[start..start + end];
            start += end;
            match self.event(event) {
                Ok(Some(rewritten)) => out.extend_from_slice(&rewritten),
                Ok(None) => out.extend_from_slice(event),
                Err(broken) => return (out.into(), Some(broken)),
            }
        }
        pending.drain(..start);
        self.partial = pending;
        if self.partial.len() > MAX_LEDGER_EVENT_BYTES {
            self.partial.clear();
            return (
                out.into(),
                Some(format!(
                    "the worker sent an SSE event of more than {MAX_LEDGER_EVENT_BYTES} bytes without ending it"
                )),
            );
        }
        (out.into(), None)
    }

    /// One whole event: `Ok(None)` to pass it as it is, `Ok(Some(bytes))` rewritten, `Err` if
    /// it is an error event (its message).
    fn event(&mut self, event: &[u8]) -> Result<Option<Vec<u8>>, String> {
        let Some(data) = event_data(event) else {
            return Ok(None);
        };
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(None);
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(&data) else {
            // Not a chunk this ledger can read: its text (if any) has no ids.
            self.complete = false;
            return Ok(None);
        };
        if let Some(error) = chunk.get("error") {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_string);
            return Err(message);
        }
        let ids = self.take_ids(&mut chunk);
        let chunk = match self.continued_after {
            None => {
                if self.identity.is_none() {
                    self.identity = Some(Identity {
                        id: chunk.get("id").cloned().unwrap_or(Value::Null),
                        created: chunk.get("created").cloned().unwrap_or(Value::Null),
                        model: chunk.get("model").cloned().unwrap_or(Value::Null),
                    });
                }
                if let (true, Some(ids)) = (self.keep_ids, ids) {
                    put_ids(&mut chunk, ids);
                }
                chunk
            }
            Some(before) => match self.rewrite(&chunk, before, ids) {
                Some(chunk) => chunk,
                // Nothing for the client in it.
                None => return Ok(Some(Vec::new())),
            },
        };
        let json = serde_json::to_vec(&Value::Object(chunk)).unwrap_or_default();
        Ok(Some(api::sse_event(&json).to_vec()))
    }

    /// Takes the id fields out of `chunk`, recording them: the generated ids of its choice
    /// (answered), and the prompt's from the first worker's first chunk.
    fn take_ids(&mut self, chunk: &mut Map<String, Value>) -> Option<Vec<u32>> {
        let top_prompt = chunk.remove("prompt_token_ids");
        let choice = chunk
            .get_mut("choices")
            .and_then(|choices| choices.get_mut(0))
            .and_then(Value::as_object_mut);
        let (choice_prompt, ids, has_text) = match choice {
            Some(choice) => {
                let has_text = choice_text(choice).is_some_and(|text| !text.is_empty());
                (choice.remove("prompt_token_ids"), choice.remove("token_ids"), has_text)
            }
            None => (None, None, false),
        };
        if self.prompt.is_none() && self.continued_after.is_none() {
            self.prompt = top_prompt
                .or(choice_prompt)
                .and_then(|ids| serde_json::from_value(ids).ok());
        }
        let ids: Option<Vec<u32>> = ids.and_then(|ids| serde_json::from_value(ids).ok());
        match &ids {
            Some(ids) => self.generated.extend_from_slice(ids),
            None if has_text => self.complete = false,
            None => {}
        }
        ids
    }

    /// A continuation's chunk (a completion's) as a chunk of the client's stream: its identity,
    /// its shape, and the usage of one answer. `None` when it carries nothing for the client.
    fn rewrite(&self, chunk: &Map<String, Value>, before: usize, ids: Option<Vec<u32>>) -> Option<Map<String, Value>> {
        let choice = chunk.get("choices").and_then(|choices| choices.get(0));
        let text = choice
            .and_then(|choice| choice.get("text"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let finish = choice
            .and_then(|choice| choice.get("finish_reason"))
            .cloned()
            .unwrap_or(Value::Null);
        let usage = chunk.get("usage").filter(|usage| usage.is_object());
        if choice.is_some() && text.is_empty() && finish.is_null() && usage.is_none() {
            return None;
        }
        let identity = self.identity.clone().unwrap_or_default();
        let mut out = Map::new();
        out.insert("id".into(), identity.id);
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        };
        out.insert("object".into(), json!(object));
        out.insert("created".into(), identity.created);
        out.insert("model".into(), identity.model);
        let choices = match choice {
            None => json!([]),
            Some(_) => {
                let mut choice = match self.endpoint {
                    Endpoint::Chat => {
                        let delta = if text.is_empty() {
                            json!({})
                        } else {
                            json!({"content": text})
                        };
                        json!({"index": 0, "delta": delta, "finish_reason": finish})
                    }
                    Endpoint::Completion => json!({"index": 0, "text": text, "finish_reason": finish}),
                };
                if let (true, Some(ids)) = (self.keep_ids, ids) {
                    choice["token_ids"] = json!(ids);
                }
                json!([choice])
            }
        };
        out.insert("choices".into(), choices);
        if let Some(usage) = usage {
            out.insert("usage".into(), one_answer_usage(usage, before));
        }
        Some(out)
    }
}

/// Puts the generated `ids` back in `chunk`'s choice (the client asked for them).
fn put_ids(chunk: &mut Map<String, Value>, ids: Vec<u32>) {
    if let Some(choice) = chunk
        .get_mut("choices")
        .and_then(|choices| choices.get_mut(0))
        .and_then(Value::as_object_mut)
    {
        choice.insert("token_ids".into(), json!(ids));
    }
}

/// A choice's text: a chat delta's content or a completion's text.
fn choice_text(choice: &Map<String, Value>) -> Option<&str> {
    choice
        .get("text")
        .or_else(|| choice.get("delta").and_then(|delta| delta.get("content")))
        .and_then(Value::as_str)
}

/// A continuation's usage as the usage of the one answer the client sees: its prompt was the
/// original prompt and the `before` tokens generated already, which count as generated.
fn one_answer_usage(usage: &Value, before: usize) -> Value {
    let count = |field: &str| usage.get(field).and_then(Value::as_u64).unwrap_or(0);
    let before = before as u64;
    let prompt = count("prompt_tokens").saturating_sub(before);
    let completion = count("completion_tokens") + before;
    let mut out = json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    });
    if let Some(cached) = usage
        .get("prompt_tokens_details")
        .and_then(|details| details.get("cached_tokens"))
        .and_then(Value::as_u64)
    {
        out["prompt_tokens_details"] = json!({"cached_tokens": cached.min(prompt)});
    }
    out
}

/// Where the first event in `bytes` ends (after its blank line), if it does.
fn event_end(bytes: &[u8]) -> Option<usize> {
    let lf = memchr::memmem::find(bytes, b"\n\n").map(|at| at + 2);
    let crlf = memchr::memmem::find(bytes, b"\n\r\n").map(|at| at + 3);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The data of an SSE event (its `data:` lines joined), `None` if it has none.
fn event_data(event: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(event).ok()?;
    let mut data: Option<String> = None;
    for line in text.lines() {
        if let Some(value) = line.strip_prefix("data:") {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match &mut data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => data = Some(value.to_string()),
            }
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(json: Value) -> Vec<u8> {
        api::sse_event(&serde_json::to_vec(&json).expect("json")).to_vec()
    }

    fn data(out: &[u8]) -> Vec<Value> {
        String::from_utf8_lossy(out)
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .filter(|data| *data != "[DONE]")
            .map(|data| serde_json::from_str(data).expect("json"))
            .collect()
    }

    #[test]
    fn ids_are_recorded_and_taken_out_of_the_clients_stream() {
        let mut ledger = Ledger::new(Endpoint::Chat, false);
        let first = event(
            json!({"id": "chatcmpl-1", "created": 7, "model": "m", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": " a"}, "token_ids": [10]}]}),
        );
        let second = event(json!({"id": "chatcmpl-1", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": {"content": " b"}, "token_ids": [11]}]}));
        // Cut mid-event: the ledger waits for the rest.
        let both = [first.as_slice(), &second].concat();
        assert!(!ledger.at_boundary(), "the prompt's ids are not known yet");
        let (out, broken) = ledger.feed(&both[..both.len() - 5]);
        assert!(broken.is_none());
        assert_eq!(data(&out).len(), 1);
        assert!(!ledger.at_boundary(), "an event is half read");
        let (rest, _) = ledger.feed(&both[both.len() - 5..]);
        assert!(ledger.at_boundary());
        let chunks = data(&[out.as_ref(), rest.as_ref()].concat());
        assert_eq!(chunks.len(), 2);
        assert!(!String::from_utf8_lossy(&out).contains("token_ids"), "{out:?}");
        assert_eq!(chunks[1]["choices"][0]["delta"]["content"], " b");
        assert_eq!(ledger.continuable(), Some(vec![1, 2, 3, 10, 11]));
    }

    #[test]
    fn a_continuation_reads_as_the_same_chat_answer_with_its_usage_summed() {
        let mut ledger = Ledger::new(Endpoint::Chat, false);
        ledger.feed(&event(
            json!({"id": "chatcmpl-9", "created": 5, "model": "m", "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": " a"}, "token_ids": [10]}]}),
        ));
        let ids = ledger.continuable().expect("continuable");
        ledger.continued_after = Some(ids.len() - 2);
        let continuation = [
            event(json!({"id": "cmpl-x", "object": "text_completion", "created": 99, "model": "m",
                "choices": [{"index": 0, "text": " b", "finish_reason": null, "token_ids": [11], "prompt_token_ids": [1, 2, 10]}]})),
            event(json!({"id": "cmpl-x", "object": "text_completion", "created": 99, "model": "m",
                "choices": [{"index": 0, "text": "", "finish_reason": "length", "token_ids": []}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                          "prompt_tokens_details": {"cached_tokens": 3}}})),
            b"data: [DONE]\n\n".to_vec(),
        ]
        .concat();
        let (out, broken) = ledger.feed(&continuation);
        assert!(broken.is_none());
        let chunks = data(&out);
        assert_eq!(chunks.len(), 2, "{chunks:?}");
        for chunk in &chunks {
            assert_eq!(chunk["id"], "chatcmpl-9");
            assert_eq!(chunk["created"], 5);
            assert_eq!(chunk["object"], "chat.completion.chunk");
        }
        assert_eq!(chunks[0]["choices"][0]["delta"]["content"], " b");
        assert_eq!(chunks[1]["choices"][0]["finish_reason"], "length");
        assert_eq!(
            chunks[1]["usage"],
            json!({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                   "prompt_tokens_details": {"cached_tokens": 2}})
        );
        assert!(ledger.done);
        assert_eq!(ledger.continuable(), None, "an ended stream is not continued");
    }

    #[test]
    fn an_error_event_breaks_the_stream_and_text_without_ids_cannot_continue() {
        let mut ledger = Ledger::new(Endpoint::Completion, false);
        let (out, broken) = ledger.feed(
            &[
                event(json!({"choices": [{"index": 0, "text": " a", "token_ids": [4], "prompt_token_ids": [1]}]})),
                event(json!({"error": {"message": "engine failed", "type": "server_error"}})),
                event(json!({"choices": [{"index": 0, "text": " lost"}]})),
            ]
            .concat(),
        );
        assert_eq!(broken.as_deref(), Some("engine failed"));
        assert_eq!(data(&out).len(), 1, "what came before the error passes");
        assert_eq!(ledger.continuable(), Some(vec![1, 4]));
        ledger.feed(&event(json!({"choices": [{"index": 0, "text": " no ids"}]})));
        assert_eq!(ledger.continuable(), None);
    }

    #[test]
    fn a_stream_broken_after_all_of_its_tokens_is_ended_by_the_gateway() {
        let mut ledger = Ledger::new(Endpoint::Chat, false);
        ledger.feed(&event(
            json!({"id": "chatcmpl-3", "created": 4, "model": "m", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": " a b"}, "token_ids": [10, 11]}]}),
        ));
        let end = ledger.finish(true);
        let chunks = data(&end);
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0]["id"], "chatcmpl-3");
        assert_eq!(chunks[0]["choices"][0]["finish_reason"], "length");
        assert_eq!(chunks[1]["choices"], json!([]));
        assert_eq!(
            chunks[1]["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
        );
        assert!(String::from_utf8_lossy(&end).ends_with("data: [DONE]\n\n"));
        assert!(ledger.done);
        let mut ledger = Ledger::new(Endpoint::Completion, false);
        ledger.feed(&event(
            json!({"choices": [{"index": 0, "text": " a", "token_ids": [10], "prompt_token_ids": [1]}]}),
        ));
        let chunks = data(&ledger.finish(false));
        assert_eq!(
            chunks.len(),
            1,
            "the usage rides in the finish chunk when no usage chunk was asked"
        );
        assert_eq!(chunks[0]["object"], "text_completion");
        assert_eq!(chunks[0]["usage"]["total_tokens"], 2);
    }
}
