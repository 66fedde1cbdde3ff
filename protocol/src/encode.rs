//! The encode protocol between gateways, encoder workers and LLM workers.
//!
//! A request with media crosses three processes. The gateway posts micro-batches of media to
//! an encoder ([`EncodeBatch`] to [`ENCODE`]); each item names the LLM worker and request its
//! features are for ([`Delivery`]). The encoder encodes the batch (or finds an item in its
//! feature cache), **pushes** each item's features to the LLM worker as raw little-endian f16
//! rows (`POST` [`features_path`], headers [`MEDIA_ID_HEADER`], [`TOKENS_HEADER`] and
//! [`FEATURE_DIM_HEADER`], body `tokens × dim × 2` bytes) and answers the gateway with one
//! [`ItemOutcome`] per item, in batch order. Meanwhile the gateway has already forwarded the LLM
//! request with a [`MediaPlan`] in the [`MEDIA_PLAN_HEADER`]: per placeholder, the media id,
//! encoder, token count and span start, so the worker prefills the text before the first
//! placeholder while encoding runs. If an item cannot be encoded (after one retry elsewhere),
//! the gateway posts to [`abandon_path`] and the worker answers from the text alone.
//!
//! Encoders announce their feature cache as ordinary KV events: a cached item is a stored
//! one-block sequence whose local hash is [`media_local_hash`], so a gateway finds the encoders
//! holding an item with the same index it uses for prompts ([`media_block_hash`]).

use serde::{Deserialize, Serialize};
use switchyard_media::{MediaId, MediaKind};

use crate::block_hash::chain_hash;

/// Encoder: `POST` an [`EncodeBatch`]; the answer is an [`EncodeReply`].
pub const ENCODE: &str = "/v1/encode";

/// Header of a forwarded LLM request: its [`MediaPlan`] as JSON.
pub const MEDIA_PLAN_HEADER: &str = "x-switchyard-media-plan";

/// Header of a feature push: the item's media id.
pub const MEDIA_ID_HEADER: &str = "x-switchyard-media-id";

/// Header of a feature push: the rows (tokens) in the body.
pub const TOKENS_HEADER: &str = "x-switchyard-tokens";

/// Header of a feature push: the width of a row (f16 values).
pub const FEATURE_DIM_HEADER: &str = "x-switchyard-feature-dim";

/// Header of a worker's answer to a request with media: how it merged the media, as
/// `len=N; spans=a-b,c-d` (spans `[a, b)` in the merged prompt, in placeholder order).
pub const MERGE_HEADER: &str = "x-switchyard-merge";

/// Header of an answer whose media was left out: `text-only; reason=...`.
pub const MEDIA_HEADER: &str = "x-switchyard-media";

/// LLM worker: `POST` one item's features for `request` (slot `slot` of its plan).
pub fn features_path(request: &str, slot: usize) -> String {
    format!("/v1/features/{request}/{slot}")
}

/// LLM worker: `POST` (body: the reason as text) tells the worker that `request`'s media will
/// not come; it answers from the text alone.
pub fn abandon_path(request: &str) -> String {
    format!("/v1/features/{request}/abandon")
}

/// The local hash an encoder announces for a cached media item.
pub fn media_local_hash(id: MediaId) -> u64 {
    (id.0 as u64) ^ ((id.0 >> 64) as u64)
}

/// The sequence hash under which a cached media item is indexed (a one-block sequence).
pub fn media_block_hash(id: MediaId) -> u64 {
    chain_hash(None, media_local_hash(id))
}

/// Milliseconds one forward pass over `n` images takes: published SigLIP-L/14 measurements
/// (batch 1/4/8/16/32 → 4.8/7.2/10.1/16.3/29.7 ms on an A100), linear between them and past
/// the last at the last segment's slope.
pub fn image_batch_ms(n: usize) -> f64 {
    const CURVE: [(f64, f64); 5] = [(1.0, 4.8), (4.0, 7.2), (8.0, 10.1), (16.0, 16.3), (32.0, 29.7)];
    if n == 0 {
        return 0.0;
    }
    let n = n as f64;
    let segment = CURVE
        .windows(2)
        .find(|w| n <= w[1].0)
        .unwrap_or(&CURVE[CURVE.len() - 2..]);
    let ((x0, y0), (x1, y1)) = (segment[0], segment[1]);
    y0 + (n - x0) * (y1 - y0) / (x1 - x0)
}

/// Milliseconds per video frame (a published ViT figure, frames batched).
pub const VIDEO_MS_PER_FRAME: f64 = 1.6;

/// Milliseconds per second of audio (a published Whisper encoder figure).
pub const AUDIO_MS_PER_SECOND: f64 = 2.8;

/// The reference estimate of encoding one item alone, in milliseconds (before a device's own
/// scale): an image at batch 1, a video's frames, audio's seconds. Gateways queue and route by
/// it; the simulated encoder takes this long.
pub fn estimate_ms(kind: MediaKind, frames: usize, duration_s: f64) -> f64 {
    match kind {
        MediaKind::Image => image_batch_ms(1),
        MediaKind::Video => frames.max(1) as f64 * VIDEO_MS_PER_FRAME,
        MediaKind::Audio => duration_s.max(0.0) * AUDIO_MS_PER_SECOND,
    }
}

/// Whether a request id is safe to put in a path: 1 to 128 ASCII letters, digits, `-`, `_`.
pub fn valid_request_id(id: &str) -> bool {
    (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Where an item's features go: an LLM worker and the request (and slot) they belong to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// The LLM worker's base URL (`http://host:port`).
    pub url: String,
    /// The request id of the worker's [`MediaPlan`].
    pub request: String,
    /// The item's slot in that plan.
    pub slot: usize,
}

/// One media item to encode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodeItem {
    /// The hash of the item's bytes; the encoder checks it.
    pub media_id: MediaId,
    /// What it is.
    pub kind: MediaKind,
    /// Tokens the gateway expects the features to have.
    pub tokens: u32,
    /// For a video, the frames to take (indices into the stream); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frames: Vec<u32>,
    /// For audio, its duration in seconds; for video, the stream's; 0 for images.
    #[serde(default)]
    pub duration_s: f64,
    /// Its container as the gateway's probe named it (`png`, `wav`, `mp4`, ...).
    #[serde(default)]
    pub format: String,
    /// The item's bytes, base64. Absent: the encoder must hold the features in its cache
    /// (else the item fails with [`ItemStatus::NotCached`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// Where to push the features.
    pub deliver: Delivery,
}

/// A micro-batch for one encoder, encoded in one forward pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodeBatch {
    /// The items, in the order the batcher chose.
    pub items: Vec<EncodeItem>,
}

/// How one item of a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemStatus {
    /// Encoded and delivered.
    Encoded,
    /// Found in the feature cache and delivered.
    Cached,
    /// The bytes do not decode (or do not match the id): the client's error, not retried.
    DecodeError,
    /// The encoder ran out of memory; a retry with fewer frames or pixels may fit.
    OutOfMemory,
    /// `data` was absent and the features are not cached.
    NotCached,
    /// The LLM worker did not take the features.
    DeliveryFailed,
    /// Any other encoder failure; another encoder may succeed.
    Failed,
}

impl ItemStatus {
    /// Whether the features reached the LLM worker.
    pub fn delivered(self) -> bool {
        matches!(self, ItemStatus::Encoded | ItemStatus::Cached)
    }

    /// The name used on the wire and in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ItemStatus::Encoded => "encoded",
            ItemStatus::Cached => "cached",
            ItemStatus::DecodeError => "decode_error",
            ItemStatus::OutOfMemory => "out_of_memory",
            ItemStatus::NotCached => "not_cached",
            ItemStatus::DeliveryFailed => "delivery_failed",
            ItemStatus::Failed => "failed",
        }
    }
}

/// The outcome of one item, in batch order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemOutcome {
    /// The item.
    pub media_id: MediaId,
    /// How it ended.
    pub status: ItemStatus,
    /// Tokens of the features delivered (0 if none).
    pub tokens: u32,
    /// Milliseconds the item's share of the forward pass took (0 for a cache hit).
    pub encode_ms: f64,
    /// Why it failed, for the logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// An encoder's answer to an [`EncodeBatch`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodeReply {
    /// One outcome per item, in batch order.
    pub items: Vec<ItemOutcome>,
    /// Items in the batch's forward pass (cache hits excluded).
    pub batch_size: usize,
}

/// One placeholder of a forwarded request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedItem {
    /// The item's media id.
    pub media_id: MediaId,
    /// What it is.
    pub kind: MediaKind,
    /// Tokens it spans in the prompt.
    pub tokens: u32,
    /// Where its span starts in the prompt, as the gateway computed it.
    pub start: u32,
    /// The encoder that will push its features, or [`LOCAL_ENCODER`]: the LLM worker encodes
    /// the item itself.
    pub encoder: String,
    /// The item's encode time by the reference cost curves, in microseconds: what a worker
    /// encoding locally spends on it.
    #[serde(default)]
    pub estimate_us: u64,
}

/// The `encoder` of a planned item the LLM worker encodes itself, on its own device and one
/// item at a time (`[encoders] local`: the deployment without an encoder pool).
pub const LOCAL_ENCODER: &str = "local";

/// What an LLM worker needs to know about a request's media: the id the features will arrive
/// under, and one entry per media part in request order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MediaPlan {
    /// The request id features are pushed for (see [`valid_request_id`]).
    pub request: String,
    /// The placeholders, in the order of the media parts.
    pub items: Vec<PlannedItem>,
}

/// Formats a worker's merge report for [`MERGE_HEADER`].
pub fn format_merge(len: usize, spans: &[std::ops::Range<u32>]) -> String {
    let spans: Vec<String> = spans.iter().map(|s| format!("{}-{}", s.start, s.end)).collect();
    format!("len={len}; spans={}", spans.join(","))
}

/// Parses a [`MERGE_HEADER`] value back into the merged length and spans.
pub fn parse_merge(value: &str) -> Option<(usize, Vec<std::ops::Range<u32>>)> {
    let mut len = None;
    let mut spans = Vec::new();
    for field in value.split(';').map(str::trim) {
        if let Some(n) = field.strip_prefix("len=") {
            len = n.parse().ok();
        } else if let Some(list) = field.strip_prefix("spans=") {
            for span in list.split(',').filter(|s| !s.is_empty()) {
                let (a, b) = span.split_once('-')?;
                spans.push(a.parse().ok()?..b.parse().ok()?);
            }
        }
    }
    Some((len?, spans))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_image_curve_passes_through_the_measured_points() {
        for (n, ms) in [(1, 4.8), (4, 7.2), (8, 10.1), (16, 16.3), (32, 29.7)] {
            assert!((image_batch_ms(n) - ms).abs() < 1e-9, "batch {n}");
        }
        assert!((image_batch_ms(2) - 5.6).abs() < 1e-9);
        assert!(image_batch_ms(64) > image_batch_ms(32));
        assert_eq!(image_batch_ms(0), 0.0);
        assert!((estimate_ms(MediaKind::Video, 30, 10.0) - 48.0).abs() < 1e-9);
        assert!((estimate_ms(MediaKind::Audio, 0, 30.0) - 84.0).abs() < 1e-9);
    }

    #[test]
    fn merge_reports_round_trip() {
        let value = format_merge(4883, &[7..1031, 1039..4879]);
        assert_eq!(value, "len=4883; spans=7-1031,1039-4879");
        assert_eq!(parse_merge(&value), Some((4883, vec![7..1031, 1039..4879])));
        assert_eq!(parse_merge("len=3; spans="), Some((3, vec![])));
        assert_eq!(parse_merge("spans=1-2"), None);
    }

    #[test]
    fn request_ids_are_path_safe() {
        assert!(valid_request_id("gw-1a2b-17-0"));
        assert!(!valid_request_id(""));
        assert!(!valid_request_id("../x"));
        assert!(!valid_request_id(&"a".repeat(129)));
    }

    #[test]
    fn cached_media_index_as_one_block_sequences() {
        let id = MediaId(0x1234_5678_9abc_def0_0fed_cba9_8765_4321);
        assert_eq!(media_block_hash(id), chain_hash(None, media_local_hash(id)));
        assert_ne!(media_block_hash(id), media_block_hash(MediaId(id.0 + 1)));
    }

    #[test]
    fn batches_travel_as_json() {
        let batch = EncodeBatch {
            items: vec![EncodeItem {
                media_id: MediaId(7),
                kind: MediaKind::Video,
                tokens: 576,
                frames: vec![0, 15],
                duration_s: 1.0,
                format: "mp4".into(),
                data: None,
                deliver: Delivery {
                    url: "http://127.0.0.1:1".into(),
                    request: "r-1".into(),
                    slot: 0,
                },
            }],
        };
        let json = serde_json::to_string(&batch).expect("serializes");
        assert_eq!(serde_json::from_str::<EncodeBatch>(&json).expect("parses"), batch);
    }
}
