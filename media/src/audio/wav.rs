//! WAV (RIFF/WAVE): the `fmt ` and `data` chunks, by hand.
//!
//! Walks the RIFF chunks up to `data`: `fmt ` gives channels, sample rate and block alignment;
//! duration is the data chunk's whole sample frames over the sample rate. PCM, IEEE float,
//! A-law, µ-law and their WAVE_FORMAT_EXTENSIBLE forms are taken; compressed formats (ADPCM,
//! MP3-in-WAV, ...) are unsupported. RF64 is unsupported (it only matters past 4 GiB).
//!
//! Tolerance rules, since writers differ: the RIFF size field is not trusted (many writers leave
//! it wrong, or 0 when streaming), only the chunk sizes are; a chunk before `data` that runs past
//! the end is truncation; a `data` size larger than the bytes present is truncation, except the
//! placeholders a streaming writer leaves when it cannot seek back (0 or 0xFFFFFFFF), which
//! mean "to the end of the file"; a missing pad byte after an odd-sized `data` chunk at the end
//! is accepted, and so is a trailing partial sample frame (it is not counted); chunks after
//! `data` (LIST, id3, ...) are not read.

use super::{Audio, not_this};
use crate::error::MediaError;
use crate::info::Container;
use crate::read::{bytes, le16, le32};

const C: Container = Container::Wav;

pub(super) fn probe(b: &[u8]) -> Result<Audio, MediaError> {
    if b.starts_with(b"RF64") {
        return Err(MediaError::Unsupported(
            "RF64 WAV is not supported; send a plain RIFF WAV".to_owned(),
        ));
    }
    if !b.starts_with(b"RIFF") || bytes(b, 8, 4).is_some_and(|w| w != b"WAVE") {
        return Err(not_this(C, b"RIFF", b));
    }
    if b.len() < 12 {
        return Err(MediaError::truncated(C, "the data ends inside the RIFF header"));
    }
    let mut pos = 12usize;
    let mut fmt: Option<Fmt> = None;
    loop {
        let (Some(id), Some(size)) = (bytes(b, pos, 4), le32(b, pos + 4)) else {
            let why = if fmt.is_none() { "no fmt chunk" } else { "no data chunk" };
            return Err(MediaError::truncated(C, why));
        };
        let start = pos + 8;
        let have = b.len() - start.min(b.len());
        if id == b"data" {
            let fmt = fmt.ok_or_else(|| MediaError::malformed(C, "the data chunk comes before the fmt chunk"))?;
            let len = match size {
                0 | u32::MAX => have,
                n if n as usize > have => {
                    return Err(MediaError::truncated(
                        C,
                        format!("the data chunk declares {n} bytes but only {have} are present"),
                    ));
                }
                n => n as usize,
            };
            let frames = len / usize::from(fmt.block_align);
            return Ok(Audio {
                duration_s: frames as f64 / f64::from(fmt.sample_rate),
                sample_rate: fmt.sample_rate,
                channels: u32::from(fmt.channels),
            });
        }
        if size as usize > have {
            let id = String::from_utf8_lossy(id);
            return Err(MediaError::truncated(
                C,
                format!("the `{id}` chunk at byte {pos} runs past the end"),
            ));
        }
        if id == b"fmt " {
            fmt = Some(Fmt::parse(&b[start..start + size as usize])?);
        }
        pos = start + size as usize + (size as usize & 1);
    }
}

/// The fields of `fmt ` that matter here.
#[derive(Debug, Clone, Copy)]
struct Fmt {
    channels: u16,
    sample_rate: u32,
    block_align: u16,
}

impl Fmt {
    fn parse(f: &[u8]) -> Result<Self, MediaError> {
        let short = || MediaError::malformed(C, "the fmt chunk is shorter than 16 bytes");
        let mut tag = le16(f, 0).ok_or_else(short)?;
        let channels = le16(f, 2).ok_or_else(short)?;
        let sample_rate = le32(f, 4).ok_or_else(short)?;
        let block_align = le16(f, 12).ok_or_else(short)?;
        if tag == 0xFFFE {
            // WAVE_FORMAT_EXTENSIBLE: the real tag is the first two bytes of the sub-format GUID.
            tag = le16(f, 24)
                .ok_or_else(|| MediaError::malformed(C, "an extensible fmt chunk without its sub-format"))?;
        }
        if !matches!(tag, 1 | 3 | 6 | 7) {
            return Err(MediaError::Unsupported(format!(
                "WAV with format tag 0x{tag:04X} (compressed audio) is not supported; send PCM WAV"
            )));
        }
        if channels == 0 || sample_rate == 0 || block_align == 0 {
            return Err(MediaError::malformed(
                C,
                format!("fmt declares {channels} channels, {sample_rate} Hz, {block_align}-byte blocks"),
            ));
        }
        Ok(Self {
            channels,
            sample_rate,
            block_align,
        })
    }
}
