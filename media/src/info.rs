//! What a probe learns about one media item.
//!
//! This module owns the vocabulary shared by the probes, the token estimates and the gateway:
//! [`MediaKind`] (image, audio, video), [`Container`] (the ten containers the probes accept),
//! [`MediaId`] (the xxh3-128 hash of the item's bytes, the key of the encoders' feature cache,
//! written as 32 lowercase hex digits) and [`MediaInfo`], the probe's result.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ParseMediaIdError;

/// The kind of a media item: which encoder it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MediaKind {
    /// A still image (`image_url`).
    Image,
    /// A sound clip (`input_audio`).
    Audio,
    /// A video (`video_url`); its audio track, if any, is ignored.
    Video,
}

impl fmt::Display for MediaKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Image => "image",
            Self::Audio => "audio",
            Self::Video => "video",
        })
    }
}

/// The container (file format) of a media item. Displays in lowercase (`png`, `webm`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Container {
    /// PNG image.
    Png,
    /// JPEG (JFIF/EXIF) image.
    Jpeg,
    /// WebP image (lossy, lossless or extended).
    WebP,
    /// GIF image (only its size is read; animation is not treated as video).
    Gif,
    /// WAV (RIFF/WAVE) audio.
    Wav,
    /// MPEG-1/2/2.5 Layer III audio.
    Mp3,
    /// FLAC audio (native container).
    Flac,
    /// Ogg audio (Vorbis, Opus or FLAC in Ogg).
    Ogg,
    /// MP4 (ISO BMFF) video with an H.264 track.
    Mp4,
    /// WebM (or Matroska) video.
    WebM,
}

impl Container {
    /// The kind of media this container holds here.
    pub fn kind(self) -> MediaKind {
        match self {
            Self::Png | Self::Jpeg | Self::WebP | Self::Gif => MediaKind::Image,
            Self::Wav | Self::Mp3 | Self::Flac | Self::Ogg => MediaKind::Audio,
            Self::Mp4 | Self::WebM => MediaKind::Video,
        }
    }

    /// The container's usual name, as messages write it ("PNG", "WebP", "Ogg", ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Jpeg => "JPEG",
            Self::WebP => "WebP",
            Self::Gif => "GIF",
            Self::Wav => "WAV",
            Self::Mp3 => "MP3",
            Self::Flac => "FLAC",
            Self::Ogg => "Ogg",
            Self::Mp4 => "MP4",
            Self::WebM => "WebM",
        }
    }

    /// The container's canonical media type (`image/png`, `audio/mpeg`, `video/webm`, ...).
    pub fn mime(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Jpeg => "image/jpeg",
            Self::WebP => "image/webp",
            Self::Gif => "image/gif",
            Self::Wav => "audio/wav",
            Self::Mp3 => "audio/mpeg",
            Self::Flac => "audio/flac",
            Self::Ogg => "audio/ogg",
            Self::Mp4 => "video/mp4",
            Self::WebM => "video/webm",
        }
    }

    /// The container a media type names, accepting the common aliases (`image/jpg`,
    /// `audio/x-wav`, `audio/mp3`, `audio/opus`, ...); parameters after `;` are ignored and case
    /// does not matter. `None` for anything else.
    pub fn from_mime(mime: &str) -> Option<Self> {
        let essence = mime.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        Some(match essence.as_str() {
            "image/png" => Self::Png,
            "image/jpeg" | "image/jpg" | "image/pjpeg" => Self::Jpeg,
            "image/webp" => Self::WebP,
            "image/gif" => Self::Gif,
            "audio/wav" | "audio/wave" | "audio/x-wav" | "audio/vnd.wave" => Self::Wav,
            "audio/mpeg" | "audio/mp3" | "audio/mpeg3" | "audio/x-mpeg-3" => Self::Mp3,
            "audio/flac" | "audio/x-flac" => Self::Flac,
            "audio/ogg" | "audio/opus" | "audio/vorbis" | "application/ogg" => Self::Ogg,
            "video/mp4" | "video/quicktime" => Self::Mp4,
            "video/webm" | "video/x-matroska" => Self::WebM,
            _ => return None,
        })
    }
}

impl fmt::Display for Container {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Png => "png",
            Self::Jpeg => "jpeg",
            Self::WebP => "webp",
            Self::Gif => "gif",
            Self::Wav => "wav",
            Self::Mp3 => "mp3",
            Self::Flac => "flac",
            Self::Ogg => "ogg",
            Self::Mp4 => "mp4",
            Self::WebM => "webm",
        })
    }
}

/// A media item's identity: the xxh3-128 hash of its bytes (as decoded from base64, not of the
/// base64 text). Equal bytes give equal ids on every gateway and worker, so the id keys the
/// encoders' feature cache. Displays as 32 lowercase hex digits and parses back with
/// [`FromStr`]; serializes as that string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MediaId(pub u128);

impl MediaId {
    /// The id of these bytes.
    pub fn of(bytes: &[u8]) -> Self {
        Self(xxhash_rust::xxh3::xxh3_128(bytes))
    }
}

impl fmt::Display for MediaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for MediaId {
    type Err = ParseMediaIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ParseMediaIdError(s.chars().take(64).collect()));
        }
        u128::from_str_radix(s, 16)
            .map(Self)
            .map_err(|_| ParseMediaIdError(s.to_owned()))
    }
}

impl Serialize for MediaId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MediaId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What a probe read from a media item's container, without decoding it.
///
/// Fields that do not apply to the item's kind are zero (or empty): `width`/`height` for audio,
/// `duration_s` for images, the frame fields for anything but video, `sample_rate`/`channels`
/// for anything but audio.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MediaInfo {
    /// Image, audio or video.
    pub kind: MediaKind,
    /// The container the bytes are in.
    pub container: Container,
    /// The xxh3-128 hash of the bytes.
    pub id: MediaId,
    /// The item's size in bytes.
    pub bytes: usize,
    /// Width in pixels (images; video frames as coded). 0 for audio.
    pub width: u32,
    /// Height in pixels (images; video frames as coded). 0 for audio.
    pub height: u32,
    /// Duration in seconds (audio, video). 0 for images.
    pub duration_s: f64,
    /// Frames per second of the video track (its declared frame duration, or frames over
    /// duration). 0 otherwise.
    pub frame_rate: f64,
    /// Frames in the video track, from the container's index. 0 otherwise.
    pub frame_count: u32,
    /// Indices (from 0, ascending) of the video's sync frames as the container's index marks them:
    /// MP4's `stss`, WebM's SimpleBlock keyframe flags. Empty when the container marks none; for
    /// an MP4 without `stss` that means every frame is a sync frame.
    pub keyframes: Vec<u32>,
    /// Samples per second (audio). 0 otherwise.
    pub sample_rate: u32,
    /// Channels (audio). 0 otherwise.
    pub channels: u32,
}

impl MediaInfo {
    /// A zeroed record for `bytes` in `container`, with its kind, id and size filled in.
    pub(crate) fn new(container: Container, bytes: &[u8]) -> Self {
        Self {
            kind: container.kind(),
            container,
            id: MediaId::of(bytes),
            bytes: bytes.len(),
            width: 0,
            height: 0,
            duration_s: 0.0,
            frame_rate: 0.0,
            frame_count: 0,
            keyframes: Vec::new(),
            sample_rate: 0,
            channels: 0,
        }
    }

    /// Width times height, in pixels.
    pub fn pixels(&self) -> u64 {
        u64::from(self.width) * u64::from(self.height)
    }
}
