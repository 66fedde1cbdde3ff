//! MP4 (ISO BMFF): the video track's sample table, through `mp4parse`.
//!
//! A hand walk of the box framing comes first (boxes are a size and a four-character code): the
//! top-level boxes must not run past the end (else truncated), fragmented files (`moof`) are
//! refused, the `moov` must be present (an `mdat` without it is a file cut before its trailing
//! `moov`), and inside `moov` the walk finds each track's handler and its first sample entry's
//! code, which `mp4parse` does not keep for codecs it does not know (hence "H.265 ... (MP4 with
//! hev1 track)"), and checks that each sample table's entry counts fit their boxes before
//! `mp4parse` reserves memory for them. Then Mozilla's `mp4parse` (Firefox's MP4 demuxer, fuzzed
//! there) parses the `moov`; from the first video track: coded size from the sample entry,
//! frame count from `stsz`, duration from `mdhd` (or the `stts` total), frame rate as frames
//! over the `stts` time, sync frames from `stss` (absent: every frame is a sync frame, and the
//! list is left empty). Truncation of the media data is detected from the index: the sum of
//! the `stsz` sample sizes must fit in the `mdat` bytes present, and no `stco`/`co64` chunk
//! offset may point past the end.

use super::Video;
use crate::error::MediaError;
use crate::info::Container;
use crate::read::{array, be32, be64, fourcc};

const C: Container = Container::Mp4;

/// A box's place in the buffer.
#[derive(Debug, Clone, Copy)]
struct Bx {
    kind: [u8; 4],
    start: usize,
    body: usize,
    end: usize,
}

/// The boxes between `from` and `to`. A box that runs past `to` is truncation when `to` is the
/// end of the data, malformed otherwise (it overruns its parent).
fn boxes(b: &[u8], from: usize, to: usize) -> Result<Vec<Bx>, MediaError> {
    let mut out = Vec::new();
    let mut pos = from;
    while pos < to {
        let cut = || {
            if to == b.len() {
                MediaError::truncated(C, format!("the box header at byte {pos} is cut off"))
            } else {
                MediaError::malformed(C, format!("a box header at byte {pos} overruns its parent box"))
            }
        };
        if to - pos < 8 {
            return Err(cut());
        }
        let size32 = be32(b, pos).ok_or_else(cut)?;
        let kind: [u8; 4] = array(b, pos + 4).ok_or_else(cut)?;
        let (size, header) = match size32 {
            0 => ((to - pos) as u64, 8),
            1 => (be64(b, pos + 8).ok_or_else(cut)?, 16),
            n => (u64::from(n), 8),
        };
        if size < header as u64 {
            return Err(MediaError::malformed(
                C,
                format!("box `{}` at byte {pos} has size {size}", fourcc(kind)),
            ));
        }
        let end = (pos as u64).saturating_add(size);
        if end > to as u64 {
            let declared = size;
            return Err(if to == b.len() {
                MediaError::truncated(
                    C,
                    format!(
                        "box `{}` at byte {pos} declares {declared} bytes but only {} are present",
                        fourcc(kind),
                        to - pos
                    ),
                )
            } else {
                MediaError::malformed(
                    C,
                    format!("box `{}` at byte {pos} overruns its parent box", fourcc(kind)),
                )
            });
        }
        let end = end as usize;
        out.push(Bx {
            kind,
            start: pos,
            body: pos + header,
            end,
        });
        pos = end;
    }
    Ok(out)
}

fn child(b: &[u8], parent: &Bx, kind: &[u8; 4]) -> Result<Option<Bx>, MediaError> {
    Ok(boxes(b, parent.body, parent.end)?.into_iter().find(|c| &c.kind == kind))
}

/// A track as the hand walk sees it.
#[derive(Debug)]
struct TrakWalk {
    handler: [u8; 4],
    /// The first sample entry's four-character code (`avc1`, `hev1`, `mp4a`, ...).
    entry: Option<[u8; 4]>,
}

fn walk_trak(b: &[u8], trak: &Bx) -> Result<TrakWalk, MediaError> {
    let missing = |what: &str| MediaError::malformed(C, format!("a track without its `{what}` box"));
    let mdia = child(b, trak, b"mdia")?.ok_or_else(|| missing("mdia"))?;
    let hdlr = child(b, &mdia, b"hdlr")?.ok_or_else(|| missing("hdlr"))?;
    let handler: [u8; 4] = array(b, hdlr.body + 8)
        .filter(|_| hdlr.body + 12 <= hdlr.end)
        .ok_or_else(|| MediaError::malformed(C, "the `hdlr` box is cut short"))?;
    let Some(stbl) = child(b, &mdia, b"minf")?
        .map(|minf| child(b, &minf, b"stbl"))
        .transpose()?
        .flatten()
    else {
        return Ok(TrakWalk { handler, entry: None });
    };
    let mut entry = None;
    for t in boxes(b, stbl.body, stbl.end)? {
        let body = &b[t.body..t.end];
        // (fixed bytes before the entries, bytes per entry) of the tables mp4parse reads.
        let layout = match &t.kind {
            b"stsd" => {
                if be32(body, 4).unwrap_or(0) > 0 && body.len() >= 16 {
                    entry = array(body, 12);
                }
                continue;
            }
            b"stsz" => {
                if be32(body, 4) != Some(0) {
                    continue; // one size for every sample: no table
                }
                (8, 4)
            }
            b"stts" | b"ctts" | b"co64" => (4, 8),
            b"stss" | b"stco" => (4, 4),
            b"stsc" => (4, 12),
            _ => continue,
        };
        let count = be32(body, layout.0).map(u64::from);
        let room = (body.len() as u64).saturating_sub(layout.0 as u64 + 4) / layout.1;
        match count {
            Some(n) if n <= room => {}
            _ => {
                return Err(MediaError::malformed(
                    C,
                    format!(
                        "the `{}` box declares {} entries but has room for {room}",
                        fourcc(t.kind),
                        count.map_or("?".to_owned(), |n| n.to_string())
                    ),
                ));
            }
        }
    }
    Ok(TrakWalk { handler, entry })
}

/// The video track as `mp4parse` read it, and the media bytes the file holds.
struct Parsed {
    track: mp4parse::Track,
    mdat_bytes: u64,
}

/// The box walk and `mp4parse`: the first video track, checked to be H.264.
fn parse(b: &[u8]) -> Result<Parsed, MediaError> {
    let top = boxes(b, 0, b.len())?;
    if top.iter().any(|x| &x.kind == b"moof") {
        return Err(MediaError::Unsupported(
            "fragmented MP4 (moof) is not supported; send a regular MP4 (with its index in moov) or WebM".to_owned(),
        ));
    }
    let mdat_bytes: u64 = top
        .iter()
        .filter(|x| &x.kind == b"mdat")
        .map(|x| (x.end - x.body) as u64)
        .sum();
    let Some(moov) = top.iter().find(|x| &x.kind == b"moov") else {
        return Err(if top.iter().any(|x| &x.kind == b"mdat") {
            MediaError::truncated(C, "no moov box (the file was cut before its index)")
        } else {
            MediaError::malformed(C, "no moov box")
        });
    };
    let mut video = None;
    for (i, trak) in boxes(b, moov.body, moov.end)?
        .iter()
        .filter(|x| &x.kind == b"trak")
        .enumerate()
    {
        let walk = walk_trak(b, trak)?;
        if video.is_none() && &walk.handler == b"vide" {
            video = Some((i, walk.entry));
        }
    }
    let Some((index, entry)) = video else {
        return Err(MediaError::Unsupported("the MP4 has no video track".to_owned()));
    };
    match entry.as_ref() {
        Some(b"avc1" | b"avc3") => {}
        Some(code @ (b"hev1" | b"hvc1" | b"dvh1" | b"dvhe")) => {
            return Err(MediaError::Unsupported(format!(
                "H.265 video is not supported (MP4 with {} track); send H.264 or WebM",
                fourcc(*code)
            )));
        }
        Some(b"encv") => {
            return Err(MediaError::Unsupported(
                "encrypted MP4 video is not supported".to_owned(),
            ));
        }
        Some(code) => {
            let name = match code {
                b"vp09" => "VP9",
                b"vp08" => "VP8",
                b"av01" => "AV1",
                b"mp4v" => "MPEG-4 Part 2",
                _ => "",
            };
            let what = if name.is_empty() {
                format!("`{}`", fourcc(*code))
            } else {
                format!("{name} (`{}`)", fourcc(*code))
            };
            return Err(MediaError::Unsupported(format!(
                "video codec {what} in MP4 is not supported; send H.264 MP4, or WebM for VP8, VP9 and AV1"
            )));
        }
        None => return Err(MediaError::malformed(C, "the video track has no sample description")),
    }

    let mut moov_bytes = &b[moov.start..moov.end];
    let ctx = mp4parse::read_mp4(&mut moov_bytes).map_err(|e| match e {
        mp4parse::Error::Unsupported(what) => MediaError::Unsupported(format!("MP4 with {what} is not supported")),
        e => MediaError::malformed(C, format!("the moov box does not parse: {e}")),
    })?;
    let track = ctx
        .tracks
        .into_iter()
        .nth(index)
        .ok_or_else(|| MediaError::malformed(C, "the video track is missing from the parsed moov"))?;
    Ok(Parsed { track, mdat_bytes })
}

pub(super) fn probe(b: &[u8]) -> Result<Video, MediaError> {
    let Parsed { track, mdat_bytes } = parse(b)?;
    let missing = |what: &str| MediaError::malformed(C, format!("the video track has no `{what}` box"));

    let (mut width, mut height) = (0u32, 0u32);
    if let Some(mp4parse::SampleEntry::Video(v)) = track.stsd.as_ref().and_then(|s| s.descriptions.first()) {
        width = u32::from(v.width);
        height = u32::from(v.height);
    }
    if (width == 0 || height == 0)
        && let Some(tkhd) = &track.tkhd
    {
        (width, height) = (tkhd.width >> 16, tkhd.height >> 16);
    }

    let stsz = track.stsz.as_ref().ok_or_else(|| missing("stsz"))?;
    let stts = track.stts.as_ref().ok_or_else(|| missing("stts"))?;
    let stts_frames: u64 = stts.samples.iter().map(|s| u64::from(s.sample_count)).sum();
    let stts_ticks = stts.samples.iter().fold(0u64, |t, s| {
        t.saturating_add(u64::from(s.sample_count) * u64::from(s.sample_delta))
    });
    let (frames, media_bytes) = if stsz.sample_size == 0 {
        let n = stsz.sample_sizes.len() as u64;
        (n, stsz.sample_sizes.iter().map(|&s| u64::from(s)).sum::<u64>())
    } else {
        (stts_frames, stts_frames.saturating_mul(u64::from(stsz.sample_size)))
    };
    if frames != stts_frames {
        return Err(MediaError::malformed(
            C,
            format!("the sample table disagrees on the frame count (stsz {frames}, stts {stts_frames})"),
        ));
    }
    if media_bytes > mdat_bytes {
        return Err(MediaError::truncated(
            C,
            format!("the sample table needs {media_bytes} bytes of media data but the mdat holds {mdat_bytes}"),
        ));
    }
    if let Some(stco) = &track.stco
        && let Some(&max) = stco.offsets.iter().max()
        && max >= b.len() as u64
    {
        return Err(MediaError::truncated(
            C,
            format!("a chunk of video data at byte {max} lies past the end"),
        ));
    }
    let frame_count = u32::try_from(frames)
        .map_err(|_| MediaError::malformed(C, format!("the video track declares {frames} frames")))?;

    let timescale = track
        .timescale
        .map(|t| t.0)
        .filter(|&t| t > 0)
        .ok_or_else(|| missing("mdhd"))?;
    let mdhd_ticks = track
        .duration
        .map(|d| d.0)
        .filter(|&d| d > 0 && d != u64::from(u32::MAX) && d != u64::MAX);
    let duration_s = mdhd_ticks.unwrap_or(stts_ticks) as f64 / timescale as f64;
    let timed_s = if stts_ticks > 0 {
        stts_ticks as f64 / timescale as f64
    } else {
        duration_s
    };
    let frame_rate = if timed_s > 0.0 {
        f64::from(frame_count) / timed_s
    } else {
        0.0
    };

    let mut keyframes: Vec<u32> = match &track.stss {
        Some(stss) => stss
            .samples
            .iter()
            .filter_map(|&s| s.checked_sub(1))
            .filter(|&s| s < frame_count)
            .collect(),
        None => Vec::new(),
    };
    keyframes.sort_unstable();
    keyframes.dedup();
    Ok(Video {
        width,
        height,
        duration_s,
        frame_rate,
        frame_count,
        keyframes,
    })
}

/// The first video track's H.264 samples, for a decoder: the `avcC` parameter sets and NAL
/// length size, and each sample's bytes and times from the index (`mp4parse`'s sample table:
/// `stsc`, `stco`/`co64`, `stsz`, `stts`, `ctts`, `stss`), in decode order.
pub(super) fn h264(b: &[u8]) -> Result<super::H264Track, MediaError> {
    let Parsed { track, .. } = parse(b)?;
    let Some(mp4parse::SampleEntry::Video(entry)) = track.stsd.as_ref().and_then(|s| s.descriptions.first()) else {
        return Err(MediaError::malformed(
            C,
            "the video track has no video sample description",
        ));
    };
    let mp4parse::VideoCodecSpecific::AVCConfig(avcc) = &entry.codec_specific else {
        return Err(MediaError::malformed(C, "the H.264 sample entry has no `avcC` box"));
    };
    let (nal_length_size, parameter_sets) = avc_config(avcc)?;
    let table = mp4parse::unstable::create_sample_table(&track, 0.into())
        .ok_or_else(|| MediaError::malformed(C, "the sample table is inconsistent (stsc, stco, stsz, stts)"))?;
    let mut samples = Vec::with_capacity(table.len());
    for (i, s) in table.iter().enumerate() {
        let (start, end) = (s.start_offset.0, s.end_offset.0);
        if end > b.len() as u64 || start >= end {
            return Err(MediaError::truncated(
                C,
                format!("sample {i} spans bytes {start}..{end} of a {}-byte file", b.len()),
            ));
        }
        samples.push(super::VideoSample {
            range: start as usize..end as usize,
            sync: s.sync,
            composition: s.start_composition.0,
        });
    }
    Ok(super::H264Track {
        width: u32::from(entry.width),
        height: u32::from(entry.height),
        nal_length_size,
        parameter_sets,
        samples,
    })
}

/// Reads an `AVCDecoderConfigurationRecord` (ISO 14496-15 §5.3.3.1): the NAL length size and
/// the SPS and PPS NAL units, in that order.
fn avc_config(avcc: &[u8]) -> Result<(usize, Vec<Vec<u8>>), MediaError> {
    let bad = |why: &str| MediaError::malformed(C, format!("the `avcC` box {why}"));
    if avcc.len() < 7 {
        return Err(bad("is shorter than its fixed fields"));
    }
    if avcc[0] != 1 {
        return Err(bad(&format!("has configuration version {} (1 expected)", avcc[0])));
    }
    let nal_length_size = usize::from(avcc[4] & 0b11) + 1;
    if nal_length_size == 3 {
        return Err(bad("declares 3-byte NAL lengths (1, 2 or 4 are allowed)"));
    }
    let mut sets = Vec::new();
    let mut pos = 5;
    for (kind, mask) in [("SPS", 0x1f), ("PPS", 0xff)] {
        let count = *avcc
            .get(pos)
            .ok_or_else(|| bad(&format!("ends before its {kind} count")))?
            & mask;
        pos += 1;
        for _ in 0..count {
            let len = usize::from(u16::from_be_bytes(
                array(avcc, pos).ok_or_else(|| bad(&format!("ends inside an {kind} length")))?,
            ));
            let unit = avcc
                .get(pos + 2..pos + 2 + len)
                .ok_or_else(|| bad(&format!("ends inside an {kind}")))?;
            sets.push(unit.to_vec());
            pos += 2 + len;
        }
    }
    Ok((nal_length_size, sets))
}
