//! Video: MP4 (H.264) and WebM, from the container's index.
//!
//! [`probe_video`] tells the two containers apart by their first bytes and hands them to
//! [`mp4`] (boxes: a hand walk of the framing, then Mozilla's `mp4parse` for the `moov`) or
//! [`webm`] (EBML elements, read by hand: the crate tried first panicked on hostile input). Both
//! read what the frame sampler needs (coded width and height, duration, frame rate, frame count
//! and the sync frames the index marks) without decoding a frame, and both turn "a box or element
//! runs past the end" into a truncation error.

mod mp4;
mod webm;

use crate::error::MediaError;
use crate::info::{Container, MediaInfo};
use crate::sniff::{looks_like, sniff};

/// What a container reader found about the video track.
#[derive(Debug, Default)]
struct Video {
    width: u32,
    height: u32,
    duration_s: f64,
    frame_rate: f64,
    frame_count: u32,
    keyframes: Vec<u32>,
}

/// Probes a video: an MP4 whose (first) video track is H.264 (`avc1`/`avc3`), or a WebM
/// (Matroska) whose first video track is VP8, VP9, AV1 or H.264. Reads coded width and height,
/// duration, frame rate, frame count and the sync frames the container's index marks, after
/// checking from the container's structure that the file is whole.
///
/// Errors: [`MediaError::Unsupported`] for other containers ("not an MP4 or WebM video (looks
/// like: ...)"), other codecs ("H.265 video is not supported (MP4 with hev1 track); send H.264
/// or WebM"), fragmented MP4 or a file without a video track; [`MediaError::Truncated`] when a
/// box or element runs past the end or the MP4 sample table needs more media data than its
/// `mdat` holds; [`MediaError::Malformed`] for inconsistent structure.
pub fn probe_video(b: &[u8]) -> Result<MediaInfo, MediaError> {
    let (container, video) = match sniff(b) {
        Some(Container::Mp4) => (Container::Mp4, mp4::probe(b)?),
        Some(Container::WebM) => (Container::WebM, webm::probe(b)?),
        _ => {
            return Err(MediaError::Unsupported(format!(
                "not an MP4 or WebM video (looks like: {})",
                looks_like(b)
            )));
        }
    };
    if video.width == 0 || video.height == 0 {
        return Err(MediaError::malformed(
            container,
            format!("the video track is {}x{} pixels", video.width, video.height),
        ));
    }
    if video.frame_count == 0 {
        return Err(MediaError::malformed(container, "the video track has no frames"));
    }
    let mut info = MediaInfo::new(container, b);
    info.width = video.width;
    info.height = video.height;
    info.duration_s = video.duration_s;
    info.frame_rate = video.frame_rate;
    info.frame_count = video.frame_count;
    info.keyframes = video.keyframes;
    Ok(info)
}
