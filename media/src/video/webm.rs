//! WebM (Matroska): tracks and block headers, by hand.
//!
//! A small EBML reader rather than a crate: `matroska-demuxer` 0.8 was tried first and panics on
//! hostile input (a SeekHead with two Seek entries pointing at a second SeekHead trips an
//! `expect_err`, in release builds too; an `i16::MIN` block timestamp overflows `abs()` in debug
//! builds), and it takes a read error while looking for the next block as the end of the file,
//! so truncation needed a walk of our own anyway. EBML is simple (every element is an id, a
//! size and a body, sizes are variable-length integers), and the walk reads only what the frame
//! sampler needs, in two passes over element headers, never copying frame data:
//!
//! - Framing: the EBML header and the Segment must fit in the data (a Segment of known size that
//!   is larger than the buffer is truncated); every element of known size must end within the data
//!   (else truncated) and within its parent (else malformed); only Clusters may have an unknown
//!   size (live muxers write them so), and such a Cluster ends at the next element that is not a
//!   cluster child. The doc type must be `webm` or `matroska`.
//! - Metadata: Info's TimestampScale and Duration; the first video track's number, CodecID,
//!   DefaultDuration, PixelWidth/PixelHeight, and whether it has ContentEncodings.
//! - Blocks: every SimpleBlock and BlockGroup Block of that track: frames (laced blocks count
//!   each frame), timestamps (cluster Timestamp plus the block's relative one), and sync frames
//!   (a SimpleBlock's keyframe flag; a BlockGroup without ReferenceBlock).
//!
//! Duration is Info's Duration, or the span of the frame timestamps plus one frame; frame rate is
//! 1 s over DefaultDuration, or frames over duration. VP8, VP9, AV1 and H.264 tracks are taken;
//! H.265 is refused as for MP4, other codecs too.

use super::Video;
use crate::error::MediaError;
use crate::info::Container;
use crate::read::{bytes, u8_at};

const C: Container = Container::WebM;

const EBML: u32 = 0x1A45_DFA3;
const DOC_TYPE: u32 = 0x4282;
const SEGMENT: u32 = 0x1853_8067;
const INFO: u32 = 0x1549_A966;
const TIMESTAMP_SCALE: u32 = 0x2A_D7B1;
const DURATION: u32 = 0x4489;
const TRACKS: u32 = 0x1654_AE6B;
const TRACK_ENTRY: u32 = 0xAE;
const TRACK_NUMBER: u32 = 0xD7;
const TRACK_TYPE: u32 = 0x83;
const CODEC_ID: u32 = 0x86;
const DEFAULT_DURATION: u32 = 0x23_E383;
const VIDEO: u32 = 0xE0;
const PIXEL_WIDTH: u32 = 0xB0;
const PIXEL_HEIGHT: u32 = 0xBA;
const CONTENT_ENCODINGS: u32 = 0x6D80;
const CLUSTER: u32 = 0x1F43_B675;
const CLUSTER_TIMESTAMP: u32 = 0xE7;
const SIMPLE_BLOCK: u32 = 0xA3;
const BLOCK_GROUP: u32 = 0xA0;
const BLOCK: u32 = 0xA1;
const REFERENCE_BLOCK: u32 = 0xFB;

/// An element for messages: "the Segment (0x18538067)", or just the id.
fn name(id: u32) -> String {
    let name = match id {
        EBML => "the EBML header",
        SEGMENT => "the Segment",
        INFO => "Info",
        TRACKS => "Tracks",
        TRACK_ENTRY => "a TrackEntry",
        CLUSTER => "a Cluster",
        SIMPLE_BLOCK => "a SimpleBlock",
        BLOCK_GROUP => "a BlockGroup",
        BLOCK => "a Block",
        0x1C53_BB6B => "Cues",
        0x114D_9B74 => "a SeekHead",
        0x1254_C367 => "Tags",
        _ => return format!("element 0x{id:X}"),
    };
    format!("{name} (0x{id:X})")
}

/// An element id (with its length marker, as Matroska writes ids) and its length in bytes.
fn element_id(b: &[u8], at: usize) -> Option<(u32, usize)> {
    let first = u8_at(b, at)?;
    let len = first.leading_zeros() as usize + 1;
    if len > 4 {
        return None;
    }
    let mut id = u32::from(first);
    for i in 1..len {
        id = (id << 8) | u32::from(u8_at(b, at + i)?);
    }
    Some((id, len))
}

/// A variable-length integer: `(value, None-if-all-ones-"unknown", length in bytes)`.
fn vint(b: &[u8], at: usize) -> Option<(u64, bool, usize)> {
    let first = u8_at(b, at)?;
    let len = first.leading_zeros() as usize + 1;
    if len > 8 {
        return None;
    }
    let mask = 0xFFu8.checked_shr(len as u32).unwrap_or(0);
    let mut value = u64::from(first & mask);
    let mut all_ones = first & mask == mask;
    for i in 1..len {
        let byte = u8_at(b, at + i)?;
        all_ones &= byte == 0xFF;
        value = (value << 8) | u64::from(byte);
    }
    Some((value, all_ones, len))
}

/// One element: its id, where it starts, where its body starts, and where it ends (`None` for
/// an unknown size).
#[derive(Debug, Clone, Copy)]
struct El {
    id: u32,
    at: usize,
    body: usize,
    end: Option<usize>,
}

/// The element header at `at`, its end checked against the data (truncated) and `parent_end`
/// (malformed).
fn element(b: &[u8], at: usize, parent_end: usize) -> Result<El, MediaError> {
    let cut = || MediaError::truncated(C, format!("the element header at byte {at} is cut off"));
    let bad = || MediaError::malformed(C, format!("invalid element header at byte {at}"));
    if at >= b.len() {
        return Err(cut());
    }
    let (id, id_len) = element_id(b, at).ok_or_else(|| if at + 4 > b.len() { cut() } else { bad() })?;
    let size_at = at + id_len;
    let (size, unknown, size_len) =
        vint(b, size_at).ok_or_else(|| if size_at + 8 > b.len() { cut() } else { bad() })?;
    let body = size_at + size_len;
    if unknown {
        return Ok(El {
            id,
            at,
            body,
            end: None,
        });
    }
    let end = (body as u64).saturating_add(size);
    if end > b.len() as u64 {
        return Err(MediaError::truncated(
            C,
            format!(
                "{} at byte {at} declares {size} bytes but only {} are present",
                name(id),
                b.len().saturating_sub(body)
            ),
        ));
    }
    if end > parent_end as u64 {
        return Err(MediaError::malformed(
            C,
            format!("{} at byte {at} overruns its parent", name(id)),
        ));
    }
    Ok(El {
        id,
        at,
        body,
        end: Some(end as usize),
    })
}

/// The children of a known-size element `[from, to)`; none may have an unknown size.
fn children(b: &[u8], from: usize, to: usize) -> Result<Vec<(El, usize)>, MediaError> {
    let mut out = Vec::new();
    let mut pos = from;
    while pos < to {
        let el = element(b, pos, to)?;
        let end = el.end.ok_or_else(|| unknown_size(&el))?;
        out.push((el, end));
        pos = end;
    }
    Ok(out)
}

fn unknown_size(el: &El) -> MediaError {
    MediaError::malformed(C, format!("{} at byte {} has an unknown size", name(el.id), el.at))
}

fn uint(b: &[u8], el: &El, end: usize) -> Result<u64, MediaError> {
    let len = end - el.body;
    if len > 8 {
        return Err(MediaError::malformed(
            C,
            format!("integer element 0x{:X} at byte {} has {len} bytes", el.id, el.at),
        ));
    }
    Ok(b[el.body..end].iter().fold(0u64, |v, &x| (v << 8) | u64::from(x)))
}

fn float(b: &[u8], el: &El, end: usize) -> Result<f64, MediaError> {
    let body = &b[el.body..end];
    match body.len() {
        0 => Ok(0.0),
        4 => Ok(f64::from(f32::from_be_bytes([body[0], body[1], body[2], body[3]]))),
        8 => Ok(f64::from_be_bytes(body.try_into().unwrap_or_default())),
        n => Err(MediaError::malformed(
            C,
            format!("float element 0x{:X} at byte {} has {n} bytes", el.id, el.at),
        )),
    }
}

fn string(b: &[u8], el: &El, end: usize) -> String {
    let body = &b[el.body..end];
    let body = &body[..body.iter().position(|&x| x == 0).unwrap_or(body.len())];
    String::from_utf8_lossy(&body[..body.len().min(64)]).into_owned()
}

fn is_cluster_child(id: u32) -> bool {
    // Timestamp, SilentTracks, Position, PrevSize, SimpleBlock, BlockGroup, EncryptedBlock, Void, CRC-32.
    matches!(id, 0xE7 | 0x5854 | 0xA7 | 0xAB | 0xA3 | 0xA0 | 0xAF | 0xEC | 0xBF)
}

/// The first video track's entry.
#[derive(Debug, Default)]
struct Track {
    number: u64,
    codec: String,
    default_duration_ns: u64,
    width: u64,
    height: u64,
    encoded: bool,
}

/// What the first pass found.
#[derive(Debug)]
struct Layout {
    scale_ns: u64,
    duration: Option<f64>,
    track: Option<Track>,
    /// Each cluster's children: `[from, to)`.
    clusters: Vec<(usize, usize)>,
}

/// Pass 1: framing, Info, Tracks, and where the clusters are.
fn layout(b: &[u8]) -> Result<Layout, MediaError> {
    let header = element(b, 0, b.len())?;
    if header.id != EBML {
        return Err(MediaError::malformed(C, "no EBML header"));
    }
    let header_end = header.end.ok_or_else(|| unknown_size(&header))?;
    for (el, end) in children(b, header.body, header_end)? {
        if el.id == DOC_TYPE {
            let doc_type = string(b, &el, end);
            if doc_type != "webm" && doc_type != "matroska" {
                return Err(MediaError::Unsupported(format!(
                    "EBML document type `{doc_type}` is not WebM or Matroska"
                )));
            }
        }
    }
    let segment = element(b, header_end, b.len())?;
    if segment.id != SEGMENT {
        return Err(MediaError::malformed(
            C,
            format!("{} where the Segment should be", name(segment.id)),
        ));
    }
    let seg_end = segment.end.unwrap_or(b.len());
    let mut out = Layout {
        scale_ns: 1_000_000,
        duration: None,
        track: None,
        clusters: Vec::new(),
    };
    let mut pos = segment.body;
    while pos < seg_end {
        let el = element(b, pos, seg_end)?;
        if el.id == CLUSTER {
            pos = cluster(b, &el, seg_end, &mut out.clusters)?;
            continue;
        }
        let end = el.end.ok_or_else(|| unknown_size(&el))?;
        match el.id {
            INFO => {
                for (c, c_end) in children(b, el.body, end)? {
                    match c.id {
                        TIMESTAMP_SCALE => out.scale_ns = uint(b, &c, c_end)?,
                        DURATION => out.duration = Some(float(b, &c, c_end)?),
                        _ => {}
                    }
                }
            }
            TRACKS if out.track.is_none() => {
                for (entry, entry_end) in children(b, el.body, end)? {
                    if entry.id == TRACK_ENTRY
                        && let Some(track) = track_entry(b, &entry, entry_end)?
                    {
                        out.track = Some(track);
                        break;
                    }
                }
            }
            _ => {}
        }
        pos = end;
    }
    if out.scale_ns == 0 {
        return Err(MediaError::malformed(C, "TimestampScale is 0"));
    }
    Ok(out)
}

/// A TrackEntry, if it is a video track.
fn track_entry(b: &[u8], entry: &El, end: usize) -> Result<Option<Track>, MediaError> {
    let mut track = Track::default();
    let mut kind = 0;
    for (c, c_end) in children(b, entry.body, end)? {
        match c.id {
            TRACK_NUMBER => track.number = uint(b, &c, c_end)?,
            TRACK_TYPE => kind = uint(b, &c, c_end)?,
            CODEC_ID => track.codec = string(b, &c, c_end),
            DEFAULT_DURATION => track.default_duration_ns = uint(b, &c, c_end)?,
            CONTENT_ENCODINGS => track.encoded = true,
            VIDEO => {
                for (v, v_end) in children(b, c.body, c_end)? {
                    match v.id {
                        PIXEL_WIDTH => track.width = uint(b, &v, v_end)?,
                        PIXEL_HEIGHT => track.height = uint(b, &v, v_end)?,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Ok((kind == 1).then_some(track))
}

/// Checks a cluster's children (known size: up to its end; unknown: up to the first element
/// that is not a cluster child), records their range, and returns where the segment walk goes on.
fn cluster(b: &[u8], el: &El, seg_end: usize, clusters: &mut Vec<(usize, usize)>) -> Result<usize, MediaError> {
    let limit = el.end.unwrap_or(seg_end);
    let mut pos = el.body;
    while pos < limit {
        let c = element(b, pos, limit)?;
        if el.end.is_none() && !is_cluster_child(c.id) {
            break;
        }
        pos = c.end.ok_or_else(|| unknown_size(&c))?;
    }
    clusters.push((el.body, pos));
    Ok(pos)
}

/// A block header: track number, relative timestamp, flags byte, frames in the lace.
fn block_header(b: &[u8], from: usize, to: usize, at: usize) -> Result<(u64, i16, u8, u32), MediaError> {
    let bad = || MediaError::malformed(C, format!("the block at byte {at} is too short for its header"));
    let body = bytes(b, from, to - from).ok_or_else(bad)?;
    let (track, _, len) = vint(body, 0).ok_or_else(bad)?;
    let ts = bytes(body, len, 2).ok_or_else(bad)?;
    let flags = u8_at(body, len + 2).ok_or_else(bad)?;
    let frames = if (flags >> 1) & 3 == 0 {
        1
    } else {
        u32::from(u8_at(body, len + 3).ok_or_else(bad)?) + 1
    };
    Ok((track, i16::from_be_bytes([ts[0], ts[1]]), flags, frames))
}

pub(super) fn probe(b: &[u8]) -> Result<Video, MediaError> {
    let layout = layout(b)?;
    let track = layout
        .track
        .ok_or_else(|| MediaError::Unsupported("the WebM has no video track".to_owned()))?;
    match track.codec.as_str() {
        "V_VP8" | "V_VP9" | "V_AV1" | "V_MPEG4/ISO/AVC" => {}
        "V_MPEGH/ISO/HEVC" => {
            return Err(MediaError::Unsupported(
                "H.265 video is not supported (WebM with V_MPEGH/ISO/HEVC track); send H.264 MP4, or WebM with VP8, VP9 or AV1"
                    .to_owned(),
            ));
        }
        other => {
            return Err(MediaError::Unsupported(format!(
                "video codec `{other}` in WebM is not supported; send VP8, VP9 or AV1 (or H.264)"
            )));
        }
    }
    if track.encoded {
        return Err(MediaError::Unsupported(
            "WebM video with content encoding (compression or encryption) is not supported".to_owned(),
        ));
    }

    // Pass 2: the blocks of the video track.
    let mut count = 0u32;
    let mut keyframes = Vec::new();
    let (mut first_ts, mut last_ts) = (i64::MAX, i64::MIN);
    let too_many = || MediaError::malformed(C, "more than 4294967295 frames");
    for &(from, to) in &layout.clusters {
        let mut cluster_ts = 0i64;
        for (el, end) in children(b, from, to)? {
            let (header, key) = match el.id {
                CLUSTER_TIMESTAMP => {
                    cluster_ts = i64::try_from(uint(b, &el, end)?).unwrap_or(i64::MAX);
                    continue;
                }
                SIMPLE_BLOCK => {
                    let h = block_header(b, el.body, end, el.at)?;
                    (h, h.2 & 0x80 != 0)
                }
                BLOCK_GROUP => {
                    let parts = children(b, el.body, end)?;
                    let Some((block, block_end)) = parts.iter().find(|(c, _)| c.id == BLOCK) else {
                        continue;
                    };
                    let referenced = parts.iter().any(|(c, _)| c.id == REFERENCE_BLOCK);
                    (block_header(b, block.body, *block_end, block.at)?, !referenced)
                }
                _ => continue,
            };
            let (number, relative, _, frames) = header;
            if number != track.number {
                continue;
            }
            if key {
                keyframes.push(count);
            }
            let ts = cluster_ts.saturating_add(i64::from(relative));
            first_ts = first_ts.min(ts);
            last_ts = last_ts.max(ts);
            count = count.checked_add(frames).ok_or_else(too_many)?;
        }
    }
    let width = u32::try_from(track.width).unwrap_or(u32::MAX);
    let height = u32::try_from(track.height).unwrap_or(u32::MAX);
    if count == 0 {
        return Ok(Video {
            width,
            height,
            ..Video::default()
        });
    }
    let scale_s = layout.scale_ns as f64 / 1e9;
    let span_s = last_ts.saturating_sub(first_ts) as f64 * scale_s;
    let default_s = track.default_duration_ns as f64 / 1e9;
    let frame_s = if default_s > 0.0 {
        default_s
    } else if count > 1 {
        span_s / f64::from(count - 1)
    } else {
        0.0
    };
    let duration_s = match layout.duration {
        Some(d) if d.is_finite() && d > 0.0 => d * scale_s,
        _ => span_s + frame_s,
    };
    let frame_rate = if default_s > 0.0 {
        1.0 / default_s
    } else if duration_s > 0.0 {
        f64::from(count) / duration_s
    } else {
        0.0
    };
    Ok(Video {
        width,
        height,
        duration_s,
        frame_rate,
        frame_count: count,
        keyframes,
    })
}
