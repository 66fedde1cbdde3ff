//! What the gateway knows about a media item, without decoding it.
//!
//! A chat request's content parts carry images (`image_url`), audio (`input_audio`) and video
//! (`video_url`), usually inline as base64 data URLs. Before it routes such a request the gateway
//! needs, for every item, a stable id (the xxh3-128 hash of its bytes: the encoders' feature cache
//! key), its kind and container, its size, duration and frame counts, and how many tokens the
//! model will spend on it. This crate answers all of that from container headers and indexes only
//! (PNG chunks, JPEG markers, RIFF chunks, MPEG frame headers, FLAC metadata, Ogg pages, MP4
//! boxes, Matroska elements): it never decodes pixels or samples, so probing stays cheap on the
//! request path, and it rejects truncated or hostile bytes with an error saying why rather than
//! panicking. Decoding, resizing and frame extraction happen on the encoder workers.
//!
//! Entry points: [`decode_data_url`] / [`decode_base64`] turn request text into bytes,
//! [`probe_image`], [`probe_audio`] and [`probe_video`] turn bytes into a [`MediaInfo`],
//! [`MediaLimits::check`] applies the operator's size limits, and the [`tokens`] module (its items
//! re-exported here) estimates token counts and picks video frames within a model's budget. The `fixtures` feature adds
//! [`fixtures`], builders of small valid media files for tests.

#![deny(missing_docs, missing_debug_implementations, unsafe_code)]
#![warn(unreachable_pub)]

mod audio;
mod crc;
mod data_url;
mod error;
mod image;
mod info;
mod limits;
mod read;
mod sniff;
pub mod tokens;
mod video;

#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;

#[cfg(test)]
mod tests;

pub use audio::probe_audio;
pub use data_url::{DataUrl, decode_base64, decode_data_url};
pub use error::{MediaError, ParseMediaIdError};
pub use image::{probe_image, verify_png_crcs};
pub use info::{Container, MediaId, MediaInfo, MediaKind};
pub use limits::MediaLimits;
pub use tokens::{
    FrameSampling, ModelMedia, audio_tokens, image_tokens, resized, select_frames, video_tokens, visual_budget,
};
pub use video::{H264Track, VideoSample, mp4_h264_track, probe_video};
