//! The operator's limits on one media item.
//!
//! [`MediaLimits`] bounds what the gateway accepts before it spends an encoder on an item: bytes,
//! pixels, duration and frames in the file. [`MediaLimits::check_encoded_len`] lets the gateway
//! refuse an oversized base64 payload before decoding it; [`MediaLimits::check`] applies every
//! limit to a probed [`MediaInfo`]. The defaults are 20 MiB, 8192x8192 pixels, 600 s and
//! 100,000 frames. Deserializes from configuration (snake_case keys, every key optional).

use serde::{Deserialize, Serialize};

use crate::error::MediaError;
use crate::info::{MediaInfo, MediaKind};

/// Limits on one media item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MediaLimits {
    /// Largest item in bytes (decoded, not base64).
    pub max_bytes: usize,
    /// Largest image or video frame in pixels (width times height).
    pub max_pixels: u64,
    /// Longest audio or video in seconds.
    pub max_duration_s: f64,
    /// Most frames a video file may hold (before any sampling).
    pub max_frames_in_file: u32,
}

impl Default for MediaLimits {
    fn default() -> Self {
        Self {
            max_bytes: 20 << 20,
            max_pixels: 8192 * 8192,
            max_duration_s: 600.0,
            max_frames_in_file: 100_000,
        }
    }
}

impl MediaLimits {
    /// Refuses a base64 payload of `encoded_len` characters whose decoded size would exceed
    /// `max_bytes` (checked before decoding, so an oversized item costs no allocation).
    pub fn check_encoded_len(&self, encoded_len: usize) -> Result<(), MediaError> {
        let decoded = encoded_len / 4 * 3 + (encoded_len % 4).saturating_sub(1);
        // Whitespace and padding make the estimate an upper bound; allow for a little of both.
        if decoded > self.max_bytes.saturating_add(self.max_bytes / 64 + 3) {
            return Err(self.too_many_bytes(decoded));
        }
        Ok(())
    }

    /// Checks a probed item against every limit that applies to its kind.
    pub fn check(&self, info: &MediaInfo) -> Result<(), MediaError> {
        if info.bytes > self.max_bytes {
            return Err(self.too_many_bytes(info.bytes));
        }
        if info.kind != MediaKind::Audio && info.pixels() > self.max_pixels {
            return Err(MediaError::TooLarge {
                what: if info.kind == MediaKind::Image {
                    "image size"
                } else {
                    "video frame size"
                },
                value: format!("{}x{} ({} pixels)", info.width, info.height, info.pixels()),
                limit: format!("{} pixels", self.max_pixels),
            });
        }
        // A NaN duration fails too.
        if info.kind != MediaKind::Image && (info.duration_s.is_nan() || info.duration_s > self.max_duration_s) {
            return Err(MediaError::TooLarge {
                what: if info.kind == MediaKind::Audio {
                    "audio duration"
                } else {
                    "video duration"
                },
                value: format!("{:.1} s", info.duration_s),
                limit: format!("{} s", self.max_duration_s),
            });
        }
        if info.kind == MediaKind::Video && info.frame_count > self.max_frames_in_file {
            return Err(MediaError::TooLarge {
                what: "video frame count",
                value: info.frame_count.to_string(),
                limit: format!("{} frames", self.max_frames_in_file),
            });
        }
        Ok(())
    }

    fn too_many_bytes(&self, bytes: usize) -> MediaError {
        MediaError::TooLarge {
            what: "media size",
            value: format!("{bytes} bytes"),
            limit: format!("{} bytes", self.max_bytes),
        }
    }
}
