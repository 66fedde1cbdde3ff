//! The media parts of a chat request, inspected on the request path.
//!
//! This module owns what the gateway learns about images, audio and video before any worker is
//! involved: it takes each media part's bytes out of its `data:` URL or base64 field, reads its
//! headers (never a full decode) through `switchyard_media`, holds it to the `[media]` limits,
//! names it by the hash of its bytes (its media id), and estimates the tokens the model will
//! spend on it under the model's `[models.media]` settings. Anything wrong with an item is a 400
//! naming the content part (`messages[m].content[p]`) and why, so bad media never costs a worker
//! anything. Videos are sized last: their frames are chosen within the token budget the text,
//! the answer and the other media leave (`min(max_model_len − text − max_tokens − other media,
//! max_visual_tokens)`), shared evenly among the request's videos.

use http::StatusCode;
use switchyard_media::{
    MediaError, MediaId, MediaInfo, MediaKind, MediaLimits, ModelMedia, audio_tokens, decode_base64, decode_data_url,
    image_tokens, probe_audio, probe_image, probe_video, select_frames, video_tokens,
};
use switchyard_protocol::api::{ApiError, GenerateRequest, MessageContent, PartKind};

use crate::config::{Config, MediaConfig};

/// The metric label of a media kind.
pub(crate) fn kind_label(kind: MediaKind) -> &'static str {
    match kind {
        MediaKind::Image => "image",
        MediaKind::Audio => "audio",
        MediaKind::Video => "video",
    }
}

/// The media settings the request path reads: `[media]` and each model's `[models.media]`.
#[derive(Debug, Clone, Default)]
pub(crate) struct MediaSettings {
    /// `[media]`.
    pub config: MediaConfig,
    /// The header limits of `[media]`.
    pub limits: MediaLimits,
    /// Per model: its media settings and context length.
    models: std::collections::HashMap<String, ModelLimits>,
}

/// A model's media settings and context length.
#[derive(Debug, Clone)]
pub(crate) struct ModelLimits {
    /// `[models.media]`.
    pub media: ModelMedia,
    /// `[[models]] max_model_len`.
    pub max_model_len: u32,
    /// `[[models]] max_prompt_tokens` (default: `max_model_len`; no limit for a model without
    /// an entry).
    pub max_prompt_tokens: u32,
    /// `[[models]] ttft_target_ms` and `itl_target_ms`: the latency targets of requests that
    /// name none.
    pub targets: crate::slo::Targets,
}

impl MediaSettings {
    /// The settings of a configuration.
    pub fn from_config(config: &Config) -> MediaSettings {
        MediaSettings {
            config: config.media.clone(),
            limits: config.media.limits(),
            models: config
                .models
                .iter()
                .map(|model| {
                    let limits = ModelLimits {
                        media: model.media.clone(),
                        max_model_len: model.max_model_len,
                        max_prompt_tokens: model.max_prompt_tokens.unwrap_or(model.max_model_len),
                        targets: crate::slo::Targets {
                            ttft_ms: model.ttft_target_ms,
                            itl_ms: model.itl_target_ms,
                        },
                    };
                    (model.name.clone(), limits)
                })
                .collect(),
        }
    }

    /// The settings of `model`: its `[[models]]` entry, or the defaults.
    pub fn model(&self, model: &str) -> ModelLimits {
        self.models.get(model).cloned().unwrap_or_else(|| ModelLimits {
            media: ModelMedia::default(),
            max_model_len: crate::config::ModelConfig::DEFAULT_MAX_MODEL_LEN,
            // A model no `[[models]]` entry describes has no stated context: its workers judge.
            max_prompt_tokens: u32::MAX,
            targets: crate::slo::Targets::default(),
        })
    }
}

/// One media item of a request, read and sized.
#[derive(Debug, Clone)]
pub(crate) struct MediaItem {
    /// Index of its message in `messages`.
    pub message: usize,
    /// Index of its part in that message's `content`.
    pub part: usize,
    /// What its headers say (kind, container, dimensions, duration, frames, media id).
    pub info: MediaInfo,
    /// Tokens the model spends on it (0 for a video until [`size_videos`] runs).
    pub tokens: u32,
    /// For a video, the frame indices the encoder will take.
    pub frames: Vec<u32>,
    /// The item's bytes (what the encoder gets).
    pub data: bytes::Bytes,
}

impl MediaItem {
    /// The item's media id (the hash of its bytes).
    pub fn id(&self) -> MediaId {
        self.info.id
    }
}

/// Reads every media part of `request` and sizes images and audio. Videos get their tokens
/// from [`size_videos`] once the text's length is known.
///
/// # Errors
///
/// A 400 naming the content part for a part that is not a `data:` URL (or base64 audio) or a
/// URL fetched beforehand (`fetched`, by message and part index: see [`crate::fetch`]), is not
/// valid base64, is of an unsupported or mismatched format, is truncated or corrupt as far
/// as its headers show, or is over a `[media]` limit; and a 400 for more than `max_items`
/// items.
pub(crate) fn inspect(
    request: &GenerateRequest,
    settings: &MediaConfig,
    limits: &MediaLimits,
    model: &ModelMedia,
    fetched: &mut std::collections::HashMap<(usize, usize), Vec<u8>>,
) -> Result<Vec<MediaItem>, ApiError> {
    let GenerateRequest::Chat(chat) = request else {
        return Ok(Vec::new());
    };
    let mut items = Vec::new();
    for (m, message) in chat.messages.iter().enumerate() {
        let Some(MessageContent::Parts(parts)) = &message.content else {
            continue;
        };
        for (p, part) in parts.iter().enumerate() {
            let kind = match part.part_kind() {
                Some(PartKind::Image) => MediaKind::Image,
                Some(PartKind::Audio) => MediaKind::Audio,
                Some(PartKind::Video) => MediaKind::Video,
                Some(PartKind::Text) | None => continue,
            };
            if items.len() == settings.max_items {
                return Err(too_many_items(m, p, settings.max_items));
            }
            let mut read = || -> Result<(MediaInfo, Vec<u8>), MediaError> {
                let (info, bytes) = match kind {
                    MediaKind::Image => {
                        let url = part.image_url.as_ref().map_or("", |u| u.url.as_str());
                        let bytes = url_bytes(url, fetched.remove(&(m, p)), limits)?;
                        (probe_image(&bytes)?, bytes)
                    }
                    MediaKind::Video => {
                        let url = part.video_url.as_ref().map_or("", |u| u.url.as_str());
                        let bytes = url_bytes(url, fetched.remove(&(m, p)), limits)?;
                        (probe_video(&bytes)?, bytes)
                    }
                    MediaKind::Audio => {
                        let (data, format) = part
                            .input_audio
                            .as_ref()
                            .map_or(("", ""), |a| (a.data.as_str(), a.format.as_str()));
                        limits.check_encoded_len(data.len())?;
                        let bytes = decode_base64(data)?;
                        (probe_audio(&bytes, format)?, bytes)
                    }
                };
                limits.check(&info)?;
                Ok((info, bytes))
            };
            let (info, data) = read().map_err(|err| media_error(m, p, &err))?;
            let tokens = match kind {
                MediaKind::Image => image_tokens(model, info.width, info.height),
                MediaKind::Audio => audio_tokens(model, info.duration_s),
                MediaKind::Video => 0,
            };
            items.push(MediaItem {
                message: m,
                part: p,
                info,
                tokens,
                frames: Vec::new(),
                data: data.into(),
            });
        }
    }
    Ok(items)
}

/// Chooses each video's frames and tokens within the budget left by `text_tokens` prompt
/// tokens, `max_tokens` answer tokens and the other media, shared evenly among the videos.
///
/// # Errors
///
/// A 400 naming the request's context when text, answer and other media already fill it, or
/// naming a video part whose smallest frame group does not fit its share.
pub(crate) fn size_videos(
    items: &mut [MediaItem],
    model: &ModelMedia,
    max_model_len: u32,
    text_tokens: u32,
    max_tokens: u32,
) -> Result<(), ApiError> {
    let videos = items.iter().filter(|item| item.info.kind == MediaKind::Video).count() as u32;
    if videos == 0 {
        return Ok(());
    }
    let other_media: u32 = items.iter().map(|item| item.tokens).sum();
    let used = text_tokens.saturating_add(other_media);
    let budget = switchyard_media::visual_budget(model, max_model_len, used, max_tokens).map_err(|err| {
        ApiError::invalid_request(
            "context_length_exceeded",
            format!(
                "no room for video: {err} (max_model_len {max_model_len}, prompt text {text_tokens} tokens, other media {other_media}, max_tokens {max_tokens})"
            ),
        )
        .with_param(Some("messages".into()))
    })?;
    let share = budget / videos;
    for item in items.iter_mut().filter(|item| item.info.kind == MediaKind::Video) {
        let frames =
            select_frames(model, &item.info, share).map_err(|err| media_error(item.message, item.part, &err))?;
        item.tokens = video_tokens(model, &item.info, frames.len());
        item.frames = frames;
    }
    Ok(())
}

/// The bytes of a `data:` URL, or of an `http(s)` one fetched beforehand (`fetched`: none
/// when fetching is off).
fn url_bytes(url: &str, fetched: Option<Vec<u8>>, limits: &MediaLimits) -> Result<Vec<u8>, MediaError> {
    if crate::fetch::is_fetched(url) {
        return fetched.ok_or_else(|| {
            MediaError::Refused(
                "media URLs are not fetched ([media] fetch is off); send the bytes as a data: URL".into(),
            )
        });
    }
    // Oversized payloads are refused before they are decoded (an upper bound from the length).
    limits.check_encoded_len(url.len())?;
    Ok(decode_data_url(url)?.bytes)
}

fn part_path(message: usize, part: usize) -> String {
    format!("messages[{message}].content[{part}]")
}

/// The 400 for content part `part` of message `message` whose URL could not be fetched.
/// Refuses a request with more than `max_items` media parts, naming the first part past the
/// limit. It runs before any media is fetched, so a request's parts cannot make the gateway
/// open more connections than one request may carry items.
///
/// # Errors
///
/// The 400 (`too_many_media_items`) naming that part.
pub(crate) fn check_item_count(request: &GenerateRequest, settings: &MediaConfig) -> Result<(), ApiError> {
    let GenerateRequest::Chat(chat) = request else {
        return Ok(());
    };
    let mut count = 0;
    for (m, message) in chat.messages.iter().enumerate() {
        let Some(MessageContent::Parts(parts)) = &message.content else {
            continue;
        };
        for (p, part) in parts.iter().enumerate() {
            if matches!(
                part.part_kind(),
                Some(PartKind::Image | PartKind::Audio | PartKind::Video)
            ) {
                if count == settings.max_items {
                    return Err(too_many_items(m, p, settings.max_items));
                }
                count += 1;
            }
        }
    }
    Ok(())
}

fn too_many_items(m: usize, p: usize, max_items: usize) -> ApiError {
    ApiError::invalid_request(
        "too_many_media_items",
        format!(
            "content part {p} of message {m}: a request may carry at most {max_items} media items ([media] max_items)"
        ),
    )
    .with_param(Some(part_path(m, p)))
}

pub(crate) fn fetch_error(message: usize, part: usize, why: String) -> ApiError {
    media_error(
        message,
        part,
        &MediaError::Refused(format!("cannot fetch the media: {why}")),
    )
}

fn media_error(message: usize, part: usize, err: &MediaError) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_media",
        format!("content part {part} of message {message}: {err}"),
    )
    .with_param(Some(part_path(message, part)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_media::fixtures;
    use switchyard_protocol::api::{Endpoint, parse_generate_request};

    fn request(parts: serde_json::Value) -> GenerateRequest {
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": parts}]});
        parse_generate_request(Endpoint::Chat, body.to_string().as_bytes()).expect("valid request")
    }

    fn video(seconds: u32) -> serde_json::Value {
        let mp4 = fixtures::Mp4Video {
            width: 336,
            height: 336,
            frames: seconds * 30,
            fps: 30.0,
            ..fixtures::Mp4Video::default()
        }
        .build();
        serde_json::json!({"type": "video_url", "video_url": {"url": fixtures::data_url("video/mp4", &mp4)}})
    }

    #[test]
    fn videos_share_the_room_the_text_and_other_media_leave() {
        let image = fixtures::data_url("image/png", &fixtures::png(100, 50));
        let parsed = request(serde_json::json!([
            video(60),
            {"type": "image_url", "image_url": {"url": image}},
            video(60),
        ]));
        let model = ModelMedia::default();
        let mut items = inspect(
            &parsed,
            &MediaConfig::default(),
            &MediaLimits::default(),
            &model,
            &mut Default::default(),
        )
        .expect("valid media");
        assert_eq!(
            items.iter().map(|item| (item.message, item.part)).collect::<Vec<_>>(),
            [(0, 0), (0, 1), (0, 2)]
        );
        assert_eq!(items[1].tokens, 576);
        // 16384 − 1000 text − 500 answer − 576 image = 14308, capped at 8192; 4096 per video:
        // 7 pooled groups of 576 tokens, so 14 frames each.
        size_videos(&mut items, &model, 16_384, 1_000, 500).expect("room");
        for video in [&items[0], &items[2]] {
            assert_eq!(video.frames.len(), 14);
            assert_eq!(video.tokens, 7 * 576);
        }
        let total: u32 = items.iter().map(|item| item.tokens).sum();
        assert!(total - 576 <= model.max_visual_tokens);
        // No room at all: the request's context is named, not a part.
        let err = size_videos(&mut items, &model, 2_000, 1_000, 500).expect_err("no room");
        assert_eq!(err.param(), Some("messages"));
    }

    #[test]
    fn each_refusal_names_its_part() {
        let parsed = request(serde_json::json!([
            {"type": "text", "text": "hi"},
            {"type": "input_audio", "input_audio": {"data": fixtures::base64(&fixtures::png(4, 4)), "format": "wav"}},
        ]));
        let err = inspect(
            &parsed,
            &MediaConfig::default(),
            &MediaLimits::default(),
            &ModelMedia::default(),
            &mut Default::default(),
        )
        .expect_err("a PNG is not WAV audio");
        assert_eq!(err.param(), Some("messages[0].content[1]"));
        let settings = MediaConfig {
            max_items: 1,
            ..MediaConfig::default()
        };
        let image = fixtures::data_url("image/png", &fixtures::png(8, 8));
        let two = request(serde_json::json!([
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "image_url", "image_url": {"url": image}},
        ]));
        let err = inspect(
            &two,
            &settings,
            &MediaLimits::default(),
            &ModelMedia::default(),
            &mut Default::default(),
        )
        .expect_err("over max_items");
        assert_eq!(err.code(), "too_many_media_items");
        assert_eq!(err.param(), Some("messages[0].content[1]"));
    }
}
