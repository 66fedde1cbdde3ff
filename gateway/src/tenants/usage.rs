//! Reading the tokens a worker reports for an answer, whole or streamed.
//!
//! A whole answer carries `usage`. A streamed one carries it only in a last chunk with empty
//! `choices`, and only if the request asked (`stream_options.include_usage`); to count a
//! tenant's tokens either way, the gateway asks for it on every streamed request
//! ([`ask_for_usage`]) and, where the client did not, takes that chunk out of the client's
//! stream ([`UsageTap`]), so the client sees what OpenAI would have sent it.
//!
//! The tap holds at most [`MAX_EVENT_BYTES`] of an event a worker has not ended: a worker that
//! streams bytes without ever ending its event cannot make the gateway buffer without limit,
//! and each byte is searched for an event's end once, however the event is cut into frames.

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

/// Longest SSE event a worker may stream before ending it with a blank line. An answer's chunks
/// are a few hundred bytes; a whole tool call or a long content delta stays far below this.
pub(crate) const MAX_EVENT_BYTES: usize = 1 << 20;

/// A worker's event ran past [`MAX_EVENT_BYTES`] without ending: the stream cannot go on.
#[derive(Debug, thiserror::Error)]
#[error("the worker sent an SSE event of more than {limit} bytes without ending it")]
pub(crate) struct EventTooLarge {
    /// The tap's limit.
    limit: usize,
    /// The complete events that came before it, for the client.
    pub(crate) passed: Bytes,
}

/// Watches a streamed answer's events for `usage`, taking the usage-only chunk out where the
/// client did not ask for it.
#[derive(Debug)]
pub(crate) struct UsageTap {
    /// Bytes of an event not yet ended by a blank line.
    partial: Vec<u8>,
    /// How much of `partial` is known to hold no event end (searched on an earlier frame).
    searched: usize,
    /// The most bytes of an event not yet ended it holds ([`MAX_EVENT_BYTES`]).
    limit: usize,
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
        UsageTap::with_limit(strip, MAX_EVENT_BYTES)
    }

    /// A tap holding at most `limit` bytes of an event not yet ended (the fuzz target's small
    /// limits reach the refusal with small inputs).
    pub(crate) fn with_limit(strip: bool, limit: usize) -> UsageTap {
        UsageTap {
            partial: Vec::new(),
            searched: 0,
            limit,
            strip,
            usage: None,
        }
    }

    /// Bytes of an event not yet ended it holds now.
    pub(crate) fn held(&self) -> usize {
        self.partial.len()
    }

    /// The usage reported so far.
    pub(crate) fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Takes one frame of the worker's stream; answers what goes on to the client (complete
    /// events only: part of an event waits for the rest).
    ///
    /// # Errors
    ///
    /// [`EventTooLarge`] once the event not yet ended holds more than [`MAX_EVENT_BYTES`]; the
    /// tap then holds nothing, and the stream should end.
    pub(crate) fn feed(&mut self, data: Bytes) -> Result<Bytes, EventTooLarge> {
        // Built once, as the relay's stream timing builds its own: this runs for every frame.
        static USAGE: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"\"usage\""));
        let finder = &*USAGE;
        if self.partial.is_empty() && ends_event(&data) && finder.find(&data).is_none() {
            // The common frame: whole events, none about usage.
            return Ok(data);
        }
        self.partial.extend_from_slice(&data);
        // The bytes searched before hold no end; an end may start in their last two.
        let from = self.searched.saturating_sub(2);
        let Some(end) = last_event_end(&self.partial[from..]).map(|end| from + end) else {
            self.searched = self.partial.len();
            return self.within_limit(Bytes::new());
        };
        let rest = self.partial.split_off(end);
        self.searched = rest.len();
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
        self.within_limit(out.into())
    }

    /// `out`, unless the event not yet ended is over [`MAX_EVENT_BYTES`].
    fn within_limit(&mut self, out: Bytes) -> Result<Bytes, EventTooLarge> {
        if self.partial.len() <= self.limit {
            return Ok(out);
        }
        self.partial = Vec::new();
        self.searched = 0;
        Err(EventTooLarge {
            limit: self.limit,
            passed: out,
        })
    }

    /// What is left at the end of the stream: part of an event that never ended.
    pub(crate) fn finish(&mut self) -> Bytes {
        self.searched = 0;
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
            out.extend_from_slice(&tap.feed(Bytes::copy_from_slice(frame)).expect("within the limit"));
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
    fn an_event_that_never_ends_is_refused_past_the_limit_and_not_buffered() {
        let mut tap = UsageTap::new(true);
        assert_eq!(
            &tap.feed(Bytes::from_static(CONTENT.as_bytes())).expect("fits")[..],
            CONTENT.as_bytes()
        );
        let frame = Bytes::from(vec![b'x'; 256 << 10]);
        let mut refused = None;
        for sent in 1..=100 {
            match tap.feed(frame.clone()) {
                Ok(out) => assert!(out.is_empty(), "part of an event waits"),
                Err(err) => {
                    refused = Some((sent, err));
                    break;
                }
            }
            assert!(tap.partial.len() <= MAX_EVENT_BYTES, "{} bytes held", tap.partial.len());
        }
        let (sent, err) = refused.expect("refused");
        assert_eq!(sent, MAX_EVENT_BYTES / (256 << 10) + 1, "refused once past the limit");
        assert!(err.to_string().contains("without ending it"), "{err}");
        assert!(tap.partial.is_empty(), "nothing kept");
    }

    #[test]
    fn complete_events_before_an_oversized_one_still_go_on() {
        let mut tap = UsageTap::new(true);
        let mut frame = CONTENT.as_bytes().to_vec();
        frame.extend(std::iter::repeat_n(b'y', MAX_EVENT_BYTES + 1));
        let err = tap.feed(frame.into()).expect_err("too large");
        assert_eq!(&err.passed[..], CONTENT.as_bytes());
    }

    #[test]
    fn a_long_event_in_small_frames_is_searched_once() {
        // 1 MiB in 4 KiB frames: each frame's bytes are searched for the event's end once, so
        // this takes milliseconds, not the seconds a search of the whole buffer per frame takes.
        let mut tap = UsageTap::new(true);
        let frame = Bytes::from(vec![b'z'; 4 << 10]);
        let started = std::time::Instant::now();
        for _ in 0..(MAX_EVENT_BYTES / frame.len() - 1) {
            assert!(tap.feed(frame.clone()).expect("fits").is_empty());
        }
        assert!(tap.searched >= tap.partial.len() - 2, "searched up to the end");
        let out = tap.feed(Bytes::from_static(b"\n\n")).expect("fits");
        assert_eq!(out.len(), MAX_EVENT_BYTES - frame.len() + 2);
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }

    #[test]
    fn every_complete_event_goes_on_as_soon_as_its_end_arrives_however_it_is_cut() {
        // Streams of newlines, carriage returns and text cut at random: after each frame the
        // client has exactly the bytes up to the last event end among those not yet passed on
        // (an end split across frames included), never more, never less.
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let mut tap = UsageTap::with_limit(false, 64);
            let mut sent = Vec::new();
            let mut out = Vec::new();
            for _ in 0..(next() % 12) {
                let frame: Vec<u8> = (0..(next() % 9)).map(|_| b"\n\ra:"[(next() % 4) as usize]).collect();
                sent.extend_from_slice(&frame);
                let passed_before = out.len();
                match tap.feed(frame.into()) {
                    Ok(passed) => out.extend_from_slice(&passed),
                    Err(err) => {
                        out.extend_from_slice(&err.passed);
                        assert!(sent.len() - out.len() > 64, "refused within the limit");
                        break;
                    }
                }
                let expected = passed_before + last_event_end(&sent[passed_before..]).unwrap_or(0);
                assert_eq!(out, &sent[..expected], "after {sent:?}");
                assert!(tap.held() <= 64);
            }
        }
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
