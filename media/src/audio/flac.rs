//! FLAC (native container): STREAMINFO and frame headers, by hand.
//!
//! After `fLaC` (optionally behind ID3v2 tags) come metadata blocks; the first must be
//! STREAMINFO, which gives sample rate, channels and total samples, and every block must fit in
//! the data. Then the frames: FLAC frames carry no length, but each starts with a sync code and
//! a header protected by a CRC-8 and ends with a CRC-16 over the whole frame, so the walk runs
//! one CRC-16 over the audio bytes and takes a frame boundary wherever the CRC so far is zero
//! and a valid header (CRC-8, and the next frame or sample number) follows. That finds every
//! frame without decoding a sample, and two checks fall out of it: the last frame must end with
//! a matching CRC-16 (else it was cut), and the frames' block sizes sum to the stream's sample
//! count, which is the duration when STREAMINFO leaves total samples unknown (0) and must reach
//! STREAMINFO's count when it does not (else the audio was cut at a frame boundary). Trailing
//! ID3v1/ID3v2/APE tags are accepted after the last frame.

use super::{Audio, not_this};
use crate::crc::{flac8, flac16_byte};
use crate::error::MediaError;
use crate::info::Container;
use crate::read::{be16, be24, be64, bytes, u8_at};
use crate::sniff::id3v2_end;

const C: Container = Container::Flac;

/// STREAMINFO's fields that matter here.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamInfo {
    pub(crate) sample_rate: u32,
    pub(crate) channels: u32,
    pub(crate) total_samples: u64,
}

impl StreamInfo {
    /// Parses the 34-byte STREAMINFO block body.
    pub(crate) fn parse(s: &[u8]) -> Option<Self> {
        let x = be64(s, 10)?;
        Some(Self {
            sample_rate: (x >> 44) as u32,
            channels: ((x >> 41) & 7) as u32 + 1,
            total_samples: x & 0xF_FFFF_FFFF,
        })
    }
}

pub(super) fn probe(b: &[u8]) -> Result<Audio, MediaError> {
    let start = match id3v2_end(b) {
        Some(end) if end > b.len() => return Err(MediaError::truncated(C, "the ID3v2 tag runs past the end")),
        Some(end) => end,
        None if b.starts_with(b"ID3") => return Err(MediaError::truncated(C, "the data ends inside the ID3v2 tag")),
        None => 0,
    };
    if bytes(b, start, 4) != Some(b"fLaC") {
        return Err(not_this(C, b"fLaC", &b[start..]));
    }
    // Metadata blocks: a header byte (last-block flag, type), a 24-bit length, the body.
    let mut pos = start + 4;
    let mut info: Option<StreamInfo> = None;
    loop {
        let (Some(kind), Some(len)) = (u8_at(b, pos), be24(b, pos + 1)) else {
            let why = if info.is_none() {
                "no STREAMINFO block"
            } else {
                "the metadata ends early"
            };
            return Err(MediaError::truncated(C, why));
        };
        let body = pos + 4;
        let end = body + len as usize;
        if end > b.len() {
            return Err(MediaError::truncated(
                C,
                format!("metadata block of type {} at byte {pos} runs past the end", kind & 0x7F),
            ));
        }
        match (info.is_some(), kind & 0x7F) {
            (false, 0) if len >= 34 => {
                info = StreamInfo::parse(&b[body..end]);
            }
            (false, _) => return Err(MediaError::malformed(C, "the first metadata block is not STREAMINFO")),
            (true, 127) => {
                return Err(MediaError::malformed(
                    C,
                    format!("invalid metadata block type at byte {pos}"),
                ));
            }
            _ => {}
        }
        pos = end;
        if kind & 0x80 != 0 {
            break;
        }
    }
    let info = info.ok_or_else(|| MediaError::malformed(C, "no STREAMINFO block"))?;
    if info.sample_rate == 0 {
        return Err(MediaError::malformed(C, "STREAMINFO declares a sample rate of 0"));
    }
    let samples = walk_frames(b, pos)?;
    if info.total_samples != 0 && samples < info.total_samples {
        return Err(MediaError::truncated(
            C,
            format!(
                "the frames end at sample {samples} of the {} STREAMINFO declares",
                info.total_samples
            ),
        ));
    }
    let total = if info.total_samples != 0 {
        info.total_samples
    } else {
        samples
    };
    Ok(Audio {
        duration_s: total as f64 / f64::from(info.sample_rate),
        sample_rate: info.sample_rate,
        channels: info.channels,
    })
}

/// Walks the frames from `pos` to the end (or to a trailing tag); returns the samples they hold.
fn walk_frames(b: &[u8], pos: usize) -> Result<u64, MediaError> {
    if pos >= b.len() {
        return Err(MediaError::truncated(C, "no audio frames after the metadata"));
    }
    let mut frame = FrameHeader::parse(b, pos)
        .ok_or_else(|| MediaError::malformed(C, format!("no frame header after the metadata (byte {pos})")))?;
    let mut samples = 0u64;
    let mut crc = 0u16;
    let mut frame_start = pos;
    let mut p = pos;
    loop {
        // The CRC-16 of [frame_start, p) is `crc`.
        let at_boundary = crc == 0 && p >= frame_start + frame.header_len + 2;
        if at_boundary {
            if p == b.len() || is_trailing_tag(&b[p..]) {
                return Ok(samples + u64::from(frame.block_size));
            }
            if let Some(next) = FrameHeader::parse(b, p)
                && next.follows(&frame)
            {
                samples += u64::from(frame.block_size);
                frame = next;
                frame_start = p;
                crc = 0;
            }
        }
        let Some(&byte) = b.get(p) else {
            return Err(MediaError::truncated(
                C,
                format!("the last frame (from sample {samples}) is cut short: its CRC-16 does not match"),
            ));
        };
        crc = flac16_byte(crc, byte);
        p += 1;
    }
}

fn is_trailing_tag(rest: &[u8]) -> bool {
    rest.starts_with(b"TAG") || rest.starts_with(b"ID3") || rest.starts_with(b"APETAGEX")
}

/// A FLAC frame header.
#[derive(Debug, Clone, Copy)]
struct FrameHeader {
    /// Fixed block size: frame number; variable: first sample number.
    number: u64,
    variable: bool,
    block_size: u32,
    header_len: usize,
}

impl FrameHeader {
    fn parse(b: &[u8], at: usize) -> Option<Self> {
        let sync = be16(b, at)?;
        if sync & 0xFFFE != 0xFFF8 {
            return None;
        }
        let variable = sync & 1 == 1;
        let codes = u8_at(b, at + 2)?;
        let (bs_code, sr_code) = (codes >> 4, codes & 0xF);
        let flags = u8_at(b, at + 3)?;
        if bs_code == 0 || sr_code == 15 || flags >> 4 >= 11 || (flags >> 1) & 7 == 3 || flags & 1 != 0 {
            return None;
        }
        // The frame or sample number, UTF-8 style: 1 to 7 bytes.
        let lead = u8_at(b, at + 4)?;
        let extra = lead.leading_ones() as usize;
        let (mut number, extra) = match extra {
            0 => (u64::from(lead), 0),
            2..=6 => (u64::from(lead & (0x7F >> extra)), extra - 1),
            7 => (0, 6),
            _ => return None,
        };
        if extra == 6 && !variable {
            return None;
        }
        let mut p = at + 5;
        for _ in 0..extra {
            let c = u8_at(b, p)?;
            if c & 0xC0 != 0x80 {
                return None;
            }
            number = (number << 6) | u64::from(c & 0x3F);
            p += 1;
        }
        let block_size = match bs_code {
            1 => 192,
            2..=5 => 576 << (bs_code - 2),
            6 => {
                p += 1;
                u32::from(u8_at(b, p - 1)?) + 1
            }
            7 => {
                p += 2;
                u32::from(be16(b, p - 2)?) + 1
            }
            _ => 256 << (bs_code - 8),
        };
        p += match sr_code {
            12 => 1,
            13 | 14 => 2,
            _ => 0,
        };
        let crc = u8_at(b, p)?;
        if flac8(bytes(b, at, p - at)?) != crc {
            return None;
        }
        Some(Self {
            number,
            variable,
            block_size,
            header_len: p + 1 - at,
        })
    }

    /// Whether this header can follow `prev` in the same stream.
    fn follows(&self, prev: &Self) -> bool {
        self.variable == prev.variable
            && if self.variable {
                self.number == prev.number + u64::from(prev.block_size)
            } else {
                self.number == prev.number + 1
            }
    }
}
