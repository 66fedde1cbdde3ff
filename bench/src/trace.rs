//! Mooncake-format request traces: reading, writing, and turning a request into a prompt.
//!
//! A trace is JSON lines of `{timestamp, input_length, output_length, hash_ids}`: arrival time
//! in milliseconds, prompt and output lengths in tokens, and one id per `block_tokens`-token
//! prompt block (512 in Mooncake's traces), where equal ids mean an equal block. A multimodal
//! trace adds `media`: items of `{kind, id, size}` (image side in pixels, audio or video
//! seconds), where equal ids are equal bytes; [`media_part`] builds each as its chat content
//! part. [`PromptBuilder`]
//! expands ids into text deterministically, so two requests that share leading ids share a
//! leading text prefix, and the gateway's own block hashes see exactly the trace's prefix
//! structure. With the byte-level fallback tokenizer one byte is one token.

use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use switchyard_harness::rng::splitmix64;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// One id per prompt block; equal ids are equal blocks.
    pub hash_ids: Vec<u64>,
    /// Media items sent with the prompt (absent in text traces).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub media: Vec<TraceMedia>,
}

/// The kind of a media item in a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceMediaKind {
    /// A PNG image.
    Image,
    /// A WAV recording.
    Audio,
    /// An MP4 (H.264) video.
    Video,
}

impl TraceMediaKind {
    /// The lowercase name (`image`, `audio`, `video`).
    pub fn as_str(self) -> &'static str {
        match self {
            TraceMediaKind::Image => "image",
            TraceMediaKind::Audio => "audio",
            TraceMediaKind::Video => "video",
        }
    }
}

/// One media item of a trace request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceMedia {
    /// What it is.
    pub kind: TraceMediaKind,
    /// Equal ids are equal bytes (a repeated item, cacheable at an encoder).
    pub id: u64,
    /// Image: width and height in pixels; audio and video: seconds.
    pub size: u32,
}

/// The chat content part of `media`: a square PNG gradient, a mono 16 kHz WAV, or a 30 fps
/// 336x336 MP4, whose bytes are a function of the id and size alone.
pub fn media_part(media: &TraceMedia) -> serde_json::Value {
    use switchyard_media::fixtures;
    let variant = splitmix64(media.id);
    match media.kind {
        TraceMediaKind::Image => {
            let side = media.size.max(1);
            let png = fixtures::png_tagged(side, side, format!("id {}", media.id).as_bytes());
            serde_json::json!({"type": "image_url", "image_url": {"url": fixtures::data_url("image/png", &png)}})
        }
        TraceMediaKind::Audio => {
            // Up to 1/16 s of extra samples makes every id's bytes differ (and its tokens by 0-1).
            let seconds = f64::from(media.size.max(1)) + (variant % 1000) as f64 / 16_000.0;
            let wav = fixtures::wav(16_000, 1, seconds);
            serde_json::json!({"type": "input_audio", "input_audio": {"data": fixtures::base64(&wav), "format": "wav"}})
        }
        TraceMediaKind::Video => {
            let mp4 = fixtures::Mp4Video {
                width: 336,
                height: 336,
                frames: media.size.max(1) * 30,
                fps: 30.0,
                // The frame size only changes the bytes, not the tokens.
                frame_bytes: 64 + (variant % 4096) as u32,
                ..fixtures::Mp4Video::default()
            }
            .build();
            serde_json::json!({"type": "video_url", "video_url": {"url": fixtures::data_url("video/mp4", &mp4)}})
        }
    }
}

impl TraceRequest {
    /// What the request carries besides text: `text`, the kind of its one media kind, or `mixed`.
    pub fn modality(&self) -> &'static str {
        match self.media.first() {
            None => "text",
            Some(first) if self.media.iter().all(|m| m.kind == first.kind) => first.kind.as_str(),
            Some(_) => "mixed",
        }
    }
}

/// Reads a Mooncake-format JSON-lines trace. Blank lines are skipped; requests are returned
/// sorted by timestamp (stable, so equal timestamps keep file order).
///
/// # Errors
///
/// Fails with the file and line number of the first line that is not a valid request.
pub fn read_trace(path: &Path) -> anyhow::Result<Vec<TraceRequest>> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot open trace {}", path.display()))?;
    let mut requests = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: cannot read the line", path.display(), number + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let request: TraceRequest = serde_json::from_str(&line).with_context(|| {
            format!(
                "{}:{}: not a trace request (want {{\"timestamp\", \"input_length\", \"output_length\", \"hash_ids\"}})",
                path.display(),
                number + 1
            )
        })?;
        requests.push(request);
    }
    anyhow::ensure!(!requests.is_empty(), "trace {} has no requests", path.display());
    requests.sort_by_key(|r| r.timestamp);
    Ok(requests)
}

/// Writes `requests` as JSON lines.
///
/// # Errors
///
/// Fails if the file cannot be written.
pub fn write_trace(path: &Path, requests: &[TraceRequest]) -> anyhow::Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for request in requests {
        serde_json::to_writer(&mut out, request)?;
        out.write_all(b"\n")?;
    }
    out.flush()
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// Keeps the requests that arrive in `[start_ms, start_ms + duration_ms)` (all after
/// `start_ms` when `duration_ms` is `None`), at most `limit` of them, with timestamps shifted so
/// the first kept one arrives at 0.
pub fn window(
    requests: &[TraceRequest],
    start_ms: u64,
    duration_ms: Option<u64>,
    limit: Option<usize>,
) -> Vec<TraceRequest> {
    let end = duration_ms.map_or(u64::MAX, |d| start_ms.saturating_add(d));
    let mut kept: Vec<TraceRequest> = requests
        .iter()
        .filter(|r| r.timestamp >= start_ms && r.timestamp < end)
        .take(limit.unwrap_or(usize::MAX))
        .cloned()
        .collect();
    if let Some(first) = kept.first().map(|r| r.timestamp) {
        for request in &mut kept {
            request.timestamp -= first;
        }
    }
    kept
}

/// Builds prompt text from hash ids: every id expands to the same `block_tokens` bytes
/// (lowercase words drawn from a generator seeded by the id), so equal ids give equal blocks.
#[derive(Debug, Clone)]
pub struct PromptBuilder {
    block_tokens: usize,
}

impl PromptBuilder {
    /// A builder expanding each hash id into `block_tokens` tokens (bytes).
    ///
    /// # Panics
    ///
    /// Never; a `block_tokens` of 0 is treated as 1.
    pub fn new(block_tokens: usize) -> PromptBuilder {
        PromptBuilder {
            block_tokens: block_tokens.max(1),
        }
    }

    /// Tokens each hash id expands to.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The prompt of `request`: its blocks in order, cut at `input_length` bytes. If the ids
    /// cover fewer tokens than `input_length`, the rest is filler unique to (`unique`, position),
    /// so it never creates sharing the trace does not have.
    pub fn prompt(&self, request: &TraceRequest, unique: u64) -> String {
        let want = request.input_length as usize;
        let mut text = String::with_capacity(want);
        for &id in &request.hash_ids {
            if text.len() >= want {
                break;
            }
            push_block(&mut text, splitmix64(id), self.block_tokens);
        }
        let mut filler = 0u64;
        while text.len() < want {
            // Filler seeds live far from hash ids (which count up from 0).
            push_block(
                &mut text,
                splitmix64(unique ^ 0xF111_E500_0000_0000 ^ (filler << 40)),
                self.block_tokens,
            );
            filler += 1;
        }
        text.truncate(want);
        text
    }
}

/// Appends exactly `len` bytes of lowercase words and spaces seeded by `seed`.
fn push_block(text: &mut String, seed: u64, len: usize) {
    let mut state = seed;
    let start = text.len();
    while text.len() - start < len {
        state = splitmix64(state);
        let word_len = 2 + (state % 7) as usize;
        for k in 0..word_len {
            if text.len() - start == len {
                return;
            }
            let letter = b'a' + ((state >> (8 + 5 * k)) % 26) as u8;
            text.push(char::from(letter));
        }
        if text.len() - start < len {
            text.push(' ');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input_length: u32, hash_ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length,
            output_length: 1,
            hash_ids: hash_ids.to_vec(),
            media: Vec::new(),
        }
    }

    #[test]
    fn equal_ids_give_equal_prefixes_and_different_ids_diverge_at_once() {
        let builder = PromptBuilder::new(512);
        let a = builder.prompt(&request(1300, &[0, 1, 2]), 1);
        let b = builder.prompt(&request(1400, &[0, 1, 3]), 2);
        assert_eq!(a.len(), 1300);
        assert_eq!(b.len(), 1400);
        assert_eq!(a[..1024], b[..1024]);
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        assert!(common < 1024 + 16, "blocks 2 and 3 share {} bytes", common - 1024);
        assert!(a.bytes().all(|c| c == b' ' || c.is_ascii_lowercase()));
    }

    #[test]
    fn a_short_id_list_is_padded_with_unique_filler() {
        let builder = PromptBuilder::new(16);
        let a = builder.prompt(&request(64, &[7]), 1);
        let b = builder.prompt(&request(64, &[7]), 2);
        assert_eq!(a.len(), 64);
        assert_eq!(a[..16], b[..16]);
        assert_ne!(a[16..32], b[16..32]);
        assert_eq!(a, builder.prompt(&request(64, &[7]), 1), "deterministic");
    }

    #[test]
    fn window_shifts_to_zero_and_limits() {
        let requests: Vec<TraceRequest> = (0..10)
            .map(|i| TraceRequest {
                timestamp: i * 1000,
                ..request(10, &[i])
            })
            .collect();
        let kept = window(&requests, 3000, Some(4000), Some(3));
        assert_eq!(kept.len(), 3);
        assert_eq!(kept[0].timestamp, 0);
        assert_eq!(kept[2].timestamp, 2000);
        assert_eq!(kept[0].hash_ids, vec![3]);
    }

    #[test]
    fn a_bad_line_is_reported_with_its_number() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.jsonl");
        std::fs::write(
            &path,
            "{\"timestamp\":0,\"input_length\":1,\"output_length\":1,\"hash_ids\":[0]}\n{\"timestamp\":1}\n",
        )
        .expect("write");
        let err = read_trace(&path).expect_err("bad line");
        assert!(format!("{err:#}").contains("t.jsonl:2"), "{err:#}");
    }

    #[test]
    fn written_traces_read_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.jsonl");
        let requests = vec![request(5, &[1, 2]), request(7, &[1, 3])];
        write_trace(&path, &requests).expect("write");
        assert_eq!(read_trace(&path).expect("read"), requests);
    }
}
