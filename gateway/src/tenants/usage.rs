//! Reading the tokens a worker reports for an answer, whole or streamed.
//!
//! A whole answer carries `usage`. A streamed one carries it only in a last chunk with empty
//! `choices`, and only if the request asked (`stream_options.include_usage`); to count a
//! tenant's tokens either way, the gateway asks for it on every streamed request
//! ([`ask_for_usage`]) and, where the client did not, takes that chunk out of the client's
//! stream ([`UsageTap`]), so the client sees what OpenAI would have sent it.

use std::sync::LazyLock;

use bytes::Bytes;
use memchr::memmem;
use serde::Deserialize;
use switchyard_protocol::api::Usage;

/// The body of a streamed request with `stream_options.include_usage` set, or `None` if the
/// body is not a JSON object (validation has already passed it, so this does not happen).
pub(crate) fn ask_for_usage(body: &[u8]) -> Option<Bytes> {
    let mut request: serde_json::Value = serde_json::from_slice(body).ok()?;
    let fields = request.as_object_mut()?;
    let options = fields
        .entry("stream_options")
        .or_insert_with(|| serde_json::Value::Object(Default::default()));
    if !options.is_object() {
        *options = serde_json::Value::Object(Default::default());
    }
    options
        .as_object_mut()?
        .insert("include_usage".into(), serde_json::Value::Bool(true));
    serde_json::to_vec(&request).ok().map(Bytes::from)
}

/// The `usage` of a whole answer, if it has one.
pub(crate) fn of_answer(body: &[u8]) -> Option<Usage> {
    #[derive(Deserialize)]
    struct Answer {
        usage: Option<Usage>,
    }
    serde_json::from_slice::<Answer>(body).ok()?.usage
}

/// Watches a streamed answer's events for `usage`, taking the usage-only chunk out where the
/// client did not ask for it.
#[derive(Debug)]
pub(crate) struct UsageTap {
    /// Bytes of an event not yet ended by a blank line.
    partial: Vec<u8>,
    /// Whether the usage-only chunk is taken out of the stream.
    strip: bool,
    /// The last usage seen (a worker reporting it on every chunk counts up to the total).
    usage: Option<Usage>,
}

/// Whether `bytes` end with a blank line, which ends an SSE event (`\n\n` or `\n\r\n`).
fn ends_event(bytes: &[u8]) -> bool {
    bytes.ends_with(b"\n\n") || bytes.ends_with(b"\n\r\n")
}

/// Where the last complete event in `bytes` ends (one past its blank line).
fn last_event_end(bytes: &[u8]) -> Option<usize> {
    let lf = memmem::rfind(bytes, b"\n\n").map(|at| at + 2);
    let crlf = memmem::rfind(bytes, b"\n\r\n").map(|at| at + 3);
    lf.max(crlf)
}

impl UsageTap {
    /// A tap; `strip` takes the usage-only chunk out.
    pub(crate) fn new(strip: bool) -> UsageTap {
        UsageTap {
            partial: Vec::new(),
            strip,
            usage: None,
        }
    }

    /// The usage reported so far.
    pub(crate) fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Takes one frame of the worker's stream; answers what goes on to the client (complete
    /// events only: part of an event waits for the rest).
    pub(crate) fn feed(&mut self, data: Bytes) -> Bytes {
        // Built once, as the relay's stream timing builds its own: this runs for every frame.
        static USAGE: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"\"usage\""));
        let finder = &*USAGE;
        if self.partial.is_empty() && ends_event(&data) && finder.find(&data).is_none() {
            // The common frame: whole events, none about usage.
            return data;
        }
        self.partial.extend_from_slice(&data);
        let Some(end) = last_event_end(&self.partial) else {
            return Bytes::new();
        };
        let rest = self.partial.split_off(end);
        let complete = std::mem::replace(&mut self.partial, rest);
        let mut out = Vec::with_capacity(complete.len());
        for event in complete
            .split_inclusive(|&byte| byte == b'\n')
            .fold(Vec::<Vec<u8>>::new(), |mut events, line| {
                // Group lines into events, each ending at a blank line.
                match events.last_mut() {
                    Some(event) if !ends_event(event) => event.extend_from_slice(line),
                    _ => events.push(line.to_vec()),
                }
                events
            })
        {
            if finder.find(&event).is_some() && self.read(&event) && self.strip {
                continue;
            }
            out.extend_from_slice(&event);
        }
        out.into()
    }

    /// What is left at the end of the stream: part of an event that never ended.
    pub(crate) fn finish(&mut self) -> Bytes {
        std::mem::take(&mut self.partial).into()
    }

    /// Reads an event's usage; answers whether it is the usage-only chunk.
    fn read(&mut self, event: &[u8]) -> bool {
        #[derive(Deserialize)]
        struct Chunk {
            #[serde(default)]
            choices: Vec<serde::de::IgnoredAny>,
            usage: Option<Usage>,
        }
        let Some(data) = event
            .split(|&byte| byte == b'\n')
            .find_map(|line| line.strip_prefix(b"data:"))
        else {
            return false;
        };
        let Ok(chunk) = serde_json::from_slice::<Chunk>(data.trim_ascii()) else {
            return false;
        };
        match chunk.usage {
            Some(usage) => {
                self.usage = Some(usage);
                chunk.choices.is_empty()
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTENT: &str = "data: {\"id\":\"x\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
    const FINISH: &str =
        "data: {\"id\":\"x\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"usage\":null}\n\n";
    const USAGE: &str = "data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn run(tap: &mut UsageTap, frames: &[&[u8]]) -> String {
        let mut out = Vec::new();
        for frame in frames {
            out.extend_from_slice(&tap.feed(Bytes::copy_from_slice(frame)));
        }
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn takes_out_the_usage_chunk_only_where_asked_and_reads_it_either_way() {
        let stream = [CONTENT, FINISH, USAGE, DONE].concat();
        for strip in [true, false] {
            let mut tap = UsageTap::new(strip);
            let frames: Vec<&[u8]> = [CONTENT, FINISH, USAGE, DONE].iter().map(|s| s.as_bytes()).collect();
            let out = run(&mut tap, &frames);
            let expected = if strip {
                [CONTENT, FINISH, DONE].concat()
            } else {
                stream.clone()
            };
            assert_eq!(out, expected);
            assert_eq!(
                tap.usage().map(|u| (u.prompt_tokens, u.completion_tokens)),
                Some((7, 3))
            );
        }
    }

    #[test]
    fn events_split_across_frames_anywhere_come_out_whole() {
        let stream = [CONTENT, USAGE, DONE].concat();
        for cut in 1..stream.len() {
            let mut tap = UsageTap::new(true);
            let (a, b) = stream.as_bytes().split_at(cut);
            let out = run(&mut tap, &[a, b]);
            assert_eq!(out, [CONTENT, DONE].concat(), "cut at {cut}");
            assert_eq!(tap.usage().map(|u| u.total_tokens), Some(10), "cut at {cut}");
        }
    }

    #[test]
    fn crlf_events_pass_as_they_come_and_an_unended_one_at_the_end() {
        let mut tap = UsageTap::new(true);
        let crlf = "data: {\"choices\":[{}]}\r\n\r\n";
        assert_eq!(run(&mut tap, &[crlf.as_bytes()]), crlf);
        let usage = USAGE.replace("\n\n", "\r\n\r\n");
        assert_eq!(run(&mut tap, &[usage.as_bytes(), b"data: [DO"]), "");
        assert_eq!(tap.usage().map(|u| u.total_tokens), Some(10));
        assert_eq!(&tap.finish()[..], b"data: [DO");
    }

    #[test]
    fn asking_for_usage_keeps_the_request_and_replaces_a_null() {
        let body = br#"{"model":"m","stream":true,"stream_options":null,"messages":[]}"#;
        let asked: serde_json::Value = serde_json::from_slice(&ask_for_usage(body).expect("an object")).expect("json");
        assert_eq!(asked["stream_options"]["include_usage"], true);
        assert_eq!(asked["model"], "m");
        assert_eq!(ask_for_usage(b"[1]"), None);
        let whole = br#"{"id":"x","usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#;
        assert_eq!(of_answer(whole).map(|u| u.total_tokens), Some(3));
    }
}
