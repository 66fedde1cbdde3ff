//! MP3 (MPEG-1, -2 and -2.5 Layer III): frame headers, by hand.
//!
//! Skips leading ID3v2 tags (and zero padding after them), then walks the frames header to
//! header: each header gives the frame's length, so the walk touches four bytes per frame. The
//! first frame must sit right after the tags; every later header must follow its predecessor
//! exactly and agree with the first on MPEG version, layer and sample rate ("frames
//! consistent"), else the file is malformed; the last frame must end within the data, else it is
//! truncated. Trailing ID3v1 (`TAG`), APE and Lyrics3 tags are accepted after the last frame. A
//! Xing/Info or VBRI frame at the start carries no audio and is not counted; duration is frames
//! times samples per frame (1152 for MPEG-1, 576 otherwise) over the sample rate. Free-format
//! streams and layers I and II are unsupported.

use super::{Audio, not_this};
use crate::error::MediaError;
use crate::info::Container;
use crate::read::{be32, bytes, u8_at};
use crate::sniff::id3v2_end;

const C: Container = Container::Mp3;

pub(super) fn probe(b: &[u8]) -> Result<Audio, MediaError> {
    let mut pos = match id3v2_end(b) {
        Some(end) if end > b.len() => return Err(MediaError::truncated(C, "the ID3v2 tag runs past the end")),
        Some(end) => end,
        None if b.starts_with(b"ID3") => return Err(MediaError::truncated(C, "the data ends inside the ID3v2 tag")),
        None => 0,
    };
    while u8_at(b, pos) == Some(0) {
        pos += 1;
    }
    let first = match Header::parse(b, pos) {
        Some(h) => h,
        None if pos > 0 && pos + 4 > b.len() => {
            return Err(MediaError::truncated(C, "no audio frame after the ID3v2 tag"));
        }
        None if pos == 0 && b.len() < 4 && b.first() == Some(&0xFF) => {
            return Err(MediaError::truncated(C, "the data ends inside the first frame header"));
        }
        None => return Err(not_this(C, &[0xFF], &b[pos.min(b.len())..])),
    };
    if first.layer != 3 {
        return Err(MediaError::Unsupported(format!(
            "MPEG audio layer {} is not MP3 (layer III); send MP3",
            ["", "I", "II", "III"][usize::from(first.layer)]
        )));
    }
    if first.bitrate_kbps == 0 {
        return Err(MediaError::Unsupported("free-format MP3 is not supported".to_owned()));
    }
    let mut frames = 0u64;
    let mut index = 0u64;
    loop {
        let h = match Header::parse(b, pos) {
            Some(h) if h.consistent_with(&first) && h.bitrate_kbps != 0 => h,
            None if b.len() - pos < 4 && b.get(pos) == Some(&0xFF) => {
                return Err(MediaError::truncated(
                    C,
                    format!("the data ends inside the header of frame {index}"),
                ));
            }
            _ => {
                return Err(MediaError::malformed(
                    C,
                    format!(
                        "frame {index} at byte {pos} does not follow frame {} (inconsistent frames)",
                        index.saturating_sub(1)
                    ),
                ));
            }
        };
        let end = pos + h.frame_len();
        if end > b.len() {
            return Err(MediaError::truncated(
                C,
                format!("frame {index} at byte {pos} runs past the end"),
            ));
        }
        if !(index == 0 && h.is_info_frame(b, pos)) {
            frames += 1;
        }
        index += 1;
        pos = end;
        let rest = &b[pos..];
        if rest.is_empty()
            || rest.starts_with(b"TAG")
            || rest.starts_with(b"APETAGEX")
            || rest.starts_with(b"LYRICSBEGIN")
            || rest.starts_with(b"ID3")
        {
            break;
        }
    }
    let samples = frames * u64::from(first.samples_per_frame());
    Ok(Audio {
        duration_s: samples as f64 / f64::from(first.sample_rate),
        sample_rate: first.sample_rate,
        channels: first.channels,
    })
}

/// One MPEG audio frame header.
#[derive(Debug, Clone, Copy)]
struct Header {
    /// 1 (MPEG-1), 2 (MPEG-2) or 25 (MPEG-2.5).
    version: u8,
    /// The layer number: 1, 2 or 3 (III).
    layer: u8,
    bitrate_kbps: u32,
    sample_rate: u32,
    padding: bool,
    channels: u32,
}

impl Header {
    fn parse(b: &[u8], at: usize) -> Option<Self> {
        let h = be32(b, at)?;
        if h >> 21 != 0x7FF {
            return None;
        }
        let version = match (h >> 19) & 3 {
            0 => 25,
            2 => 2,
            3 => 1,
            _ => return None,
        };
        // Layer bits: 1 = III, 2 = II, 3 = I; stored as 3, 2, 1.
        let layer = match (h >> 17) & 3 {
            1 => 3,
            2 => 2,
            3 => 1,
            _ => return None,
        };
        let bitrate_index = ((h >> 12) & 0xF) as usize;
        let rate_index = ((h >> 10) & 3) as usize;
        if bitrate_index == 15 || rate_index == 3 {
            return None;
        }
        const V1_L3: [u32; 15] = [0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320];
        const V2_L3: [u32; 15] = [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160];
        // Other layers are refused after parsing; their bitrates are not needed.
        let bitrate_kbps = if version == 1 {
            V1_L3[bitrate_index]
        } else {
            V2_L3[bitrate_index]
        };
        let sample_rate = [44_100, 48_000, 32_000][rate_index]
            / match version {
                1 => 1,
                2 => 2,
                _ => 4,
            };
        Some(Self {
            version,
            layer,
            bitrate_kbps,
            sample_rate,
            padding: (h >> 9) & 1 == 1,
            channels: if (h >> 6) & 3 == 3 { 1 } else { 2 },
        })
    }

    fn consistent_with(&self, first: &Self) -> bool {
        self.version == first.version && self.layer == first.layer && self.sample_rate == first.sample_rate
    }

    fn samples_per_frame(&self) -> u32 {
        if self.version == 1 { 1152 } else { 576 }
    }

    /// Layer III frame length in bytes (at least the 4-byte header).
    fn frame_len(&self) -> usize {
        let per_slot = if self.version == 1 { 144 } else { 72 };
        let len = per_slot * self.bitrate_kbps * 1000 / self.sample_rate + u32::from(self.padding);
        (len as usize).max(4)
    }

    /// Whether the frame at `at` is a Xing/Info or VBRI header frame (no audio).
    fn is_info_frame(&self, b: &[u8], at: usize) -> bool {
        let side_info = match (self.version == 1, self.channels == 1) {
            (true, false) => 32,
            (true, true) | (false, false) => 17,
            (false, true) => 9,
        };
        matches!(bytes(b, at + 4 + side_info, 4), Some(b"Xing" | b"Info")) || bytes(b, at + 36, 4) == Some(b"VBRI")
    }
}
