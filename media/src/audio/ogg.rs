//! Ogg (Vorbis, Opus, or FLAC in Ogg): pages, by hand.
//!
//! Walks every page: each must start with the `OggS` capture pattern, be version 0, fit in the
//! data (its 27-byte header, segment table and body) and match its CRC-32. The first page's
//! first packet names the codec and gives sample rate and channels (Vorbis identification
//! header, `OpusHead`, or FLAC-in-Ogg's STREAMINFO). Duration is the last granule position of
//! that stream over its granule rate (Opus: 48 kHz, less the pre-skip). The stream's last page
//! must carry the end-of-stream flag: a file cut exactly at a page boundary is still truncated.
//! Pages of other multiplexed streams are checked but otherwise ignored; in a chained file only
//! the first stream is measured.

use super::Audio;
use super::flac::StreamInfo;
use crate::crc::ogg_update;
use crate::error::MediaError;
use crate::info::Container;
use crate::read::{bytes, le16, le32, le64, u8_at};
use crate::sniff::looks_like;

const C: Container = Container::Ogg;

/// The first stream's codec, as its first packet says.
#[derive(Debug, Clone, Copy)]
struct Codec {
    /// Granule positions per second.
    granule_rate: u32,
    /// Samples to drop from the start (Opus pre-skip), in granule units.
    pre_skip: u64,
    /// The sample rate to report (Opus: the input rate it declares, else 48 kHz).
    sample_rate: u32,
    channels: u32,
}

pub(super) fn probe(b: &[u8]) -> Result<Audio, MediaError> {
    if !b.starts_with(b"OggS") {
        return Err(super::not_this(C, b"OggS", b));
    }
    let mut pos = 0usize;
    let mut page_no = 0u64;
    let mut stream: Option<(u32, Codec)> = None;
    let mut last_granule: Option<u64> = None;
    let mut eos = false;
    while pos < b.len() {
        if bytes(b, pos, 4).is_some_and(|c| c != b"OggS") {
            return Err(MediaError::malformed(
                C,
                format!("no capture pattern (OggS) at byte {pos}, page {page_no}"),
            ));
        }
        let cut = || MediaError::truncated(C, format!("page {page_no} at byte {pos} runs past the end"));
        let header = bytes(b, pos, 27).ok_or_else(cut)?;
        if header[4] != 0 {
            return Err(MediaError::malformed(
                C,
                format!("page {page_no} has version {}", header[4]),
            ));
        }
        let flags = header[5];
        let granule = le64(header, 6).unwrap_or(u64::MAX);
        let serial = le32(header, 14).unwrap_or_default();
        let stored_crc = le32(header, 22).unwrap_or_default();
        let segments = usize::from(header[26]);
        let table = bytes(b, pos + 27, segments).ok_or_else(cut)?;
        let body_len: usize = table.iter().map(|&s| usize::from(s)).sum();
        let body_start = pos + 27 + segments;
        let end = body_start + body_len;
        if end > b.len() {
            return Err(cut());
        }
        // The CRC covers the whole page with its CRC field taken as zero.
        let mut crc = ogg_update(0, &b[pos..pos + 22]);
        crc = ogg_update(crc, &[0; 4]);
        crc = ogg_update(crc, &b[pos + 26..end]);
        if crc != stored_crc {
            return Err(MediaError::malformed(
                C,
                format!("page {page_no} at byte {pos} fails its CRC check"),
            ));
        }
        let body = &b[body_start..end];
        let ours = match stream {
            None => {
                if flags & 0x02 == 0 {
                    return Err(MediaError::malformed(C, "the first page does not begin a stream"));
                }
                stream = Some((serial, identify(body)?));
                true
            }
            Some((s, _)) => s == serial,
        };
        if ours {
            if granule != u64::MAX {
                last_granule = Some(granule);
            }
            eos |= flags & 0x04 != 0;
        }
        pos = end;
        page_no += 1;
    }
    let Some((_, codec)) = stream else {
        return Err(MediaError::truncated(C, "no complete page"));
    };
    if !eos {
        return Err(MediaError::truncated(C, "the last page lacks the end-of-stream flag"));
    }
    let granule = last_granule.ok_or_else(|| MediaError::malformed(C, "no audio pages (no granule position)"))?;
    let samples = granule.saturating_sub(codec.pre_skip);
    Ok(Audio {
        duration_s: samples as f64 / f64::from(codec.granule_rate),
        sample_rate: codec.sample_rate,
        channels: codec.channels,
    })
}

/// The codec of a stream, from the start of its first packet.
fn identify(p: &[u8]) -> Result<Codec, MediaError> {
    let short = |what: &str| MediaError::malformed(C, format!("the {what} header is cut short"));
    if p.starts_with(b"\x01vorbis") {
        let channels = u32::from(u8_at(p, 11).ok_or_else(|| short("Vorbis"))?);
        let rate = le32(p, 12).ok_or_else(|| short("Vorbis"))?;
        return codec(rate, 0, rate, channels);
    }
    if p.starts_with(b"OpusHead") {
        let channels = u32::from(u8_at(p, 9).ok_or_else(|| short("Opus"))?);
        let pre_skip = u64::from(le16(p, 10).ok_or_else(|| short("Opus"))?);
        let input_rate = le32(p, 12).ok_or_else(|| short("Opus"))?;
        let reported = if input_rate == 0 { 48_000 } else { input_rate };
        return codec(48_000, pre_skip, reported, channels);
    }
    if p.starts_with(b"\x7FFLAC") {
        if bytes(p, 9, 4) != Some(b"fLaC") {
            return Err(MediaError::malformed(C, "FLAC-in-Ogg header without fLaC"));
        }
        let info = bytes(p, 17, 34)
            .and_then(StreamInfo::parse)
            .ok_or_else(|| short("FLAC"))?;
        return codec(info.sample_rate, 0, info.sample_rate, info.channels);
    }
    let what = if p.starts_with(b"Speex   ") {
        "Speex audio".to_owned()
    } else if p.starts_with(b"\x80theora") {
        "Theora video".to_owned()
    } else {
        looks_like(p)
    };
    Err(MediaError::Unsupported(format!(
        "Ogg with {what} is not supported; send Vorbis, Opus or FLAC in Ogg"
    )))
}

fn codec(granule_rate: u32, pre_skip: u64, sample_rate: u32, channels: u32) -> Result<Codec, MediaError> {
    if granule_rate == 0 || channels == 0 {
        return Err(MediaError::malformed(
            C,
            format!("the stream declares {granule_rate} Hz and {channels} channels"),
        ));
    }
    Ok(Codec {
        granule_rate,
        pre_skip,
        sample_rate,
        channels,
    })
}
