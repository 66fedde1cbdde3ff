//! Video: MP4 (H.264) and WebM, from the container's index.
//!
//! [`probe_video`] tells the two containers apart by their first bytes and hands them to
//! [`mp4`] (boxes: a hand walk of the framing, then Mozilla's `mp4parse` for the `moov`) or
//! [`webm`] (EBML elements, read by hand: the crate tried first panicked on hostile input). Both
//! read what the frame sampler needs (coded width and height, duration, frame rate, frame count
//! and the sync frames the index marks) without decoding a frame, and both turn "a box or element
//! runs past the end" into a truncation error. For an MP4, [`mp4_h264_track`] also lays out what
//! an H.264 decoder needs (the `avcC` parameter sets and every sample's bytes and times); the
//! decoding itself is the native encoder's.

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

/// One coded frame of an MP4 video track.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VideoSample {
    /// Where its bytes are in the file: NAL units, each behind a big-endian length of
    /// [`H264Track::nal_length_size`] bytes.
    pub range: std::ops::Range<usize>,
    /// The index marks it a sync sample (a frame decoding can start at).
    pub sync: bool,
    /// Its presentation time in the track's timescale (decode time plus the `ctts` offset).
    pub composition: i64,
}

/// An MP4's H.264 video track, laid out for a decoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct H264Track {
    /// Width in pixels the sample entry declares.
    pub width: u32,
    /// Height in pixels the sample entry declares.
    pub height: u32,
    /// Bytes of the length in front of each NAL unit in a sample (1, 2 or 4).
    pub nal_length_size: usize,
    /// The `avcC` box's sequence and picture parameter sets (SPS first), as NAL units without
    /// start codes. Empty for `avc3` tracks that carry them in band.
    pub parameter_sets: Vec<Vec<u8>>,
    /// The coded frames, in decode order.
    pub samples: Vec<VideoSample>,
}

impl H264Track {
    /// The samples' indices in presentation order (by composition time; ties keep decode
    /// order). Without B-frames this is `0, 1, 2, ...`.
    pub fn presentation_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.samples.len()).collect();
        order.sort_by_key(|&i| self.samples[i].composition);
        order
    }
}

/// Reads an MP4's first video track for decoding: its H.264 parameter sets and its samples
/// (byte ranges, sync flags, presentation times), after the same structural checks as
/// [`probe_video`].
///
/// # Errors
///
/// As [`probe_video`] for an MP4, and [`MediaError::Malformed`] for a missing or broken `avcC`
/// box or an inconsistent sample table; [`MediaError::Truncated`] when a sample lies past the
/// end of the data.
pub fn mp4_h264_track(b: &[u8]) -> Result<H264Track, MediaError> {
    match sniff(b) {
        Some(Container::Mp4) => mp4::h264(b),
        _ => Err(MediaError::Unsupported(format!(
            "not an MP4 video (looks like: {})",
            looks_like(b)
        ))),
    }
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
