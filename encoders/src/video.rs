//! Video: the frames a request asked for, decoded from an H.264 MP4 and turned into RGB.
//!
//! The MP4 index is read by `switchyard-media` (the same structural checks the gateway's probe
//! makes, then each sample's bytes and times); the samples go, in decode order and rewritten
//! from MP4's length-prefixed NAL units to Annex B start codes, through Cisco's OpenH264
//! decoder (the `openh264` crate, which builds the C++ from source: no system library). H.264
//! decoding is exact, so the planes are FFmpeg's to the bit. Frames are counted in presentation
//! order, as transformers' `load_video`, PyAV and OpenCV count them: the decoder hands pictures
//! out in that order, B-frames included. Decoding stops at the last frame asked for, and only
//! the frames asked for are copied out. Without B-frames, decoding skips ahead to the IDR frame
//! before each wanted frame, so sparse picks (keyframes, low fps) skip whole groups of pictures. [`YuvFrame::to_rgb`] converts as FFmpeg's swscale does for
//! `yuv420p` to `rgb24` at the same size (what PyAV's `to_ndarray(format="rgb24")`, and so
//! transformers, return): BT.601 studio range in swscale's fixed point, each chroma sample
//! covering its 2x2 block. Streams that signal BT.709 colour are converted as BT.601 too, as
//! swscale does when PyAV gives it no colour space.

use std::collections::BTreeMap;

use openh264::OpenH264API;
use openh264::decoder::{Decoder, DecoderConfig, Flush};
use openh264::formats::YUVSource;
use switchyard_media::{H264Track, mp4_h264_track};

use crate::MediaError;

/// One decoded frame, 4:2:0: a full-size luma plane and two chroma planes of half the width
/// and height (rounded up), each row-major without padding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct YuvFrame {
    /// Width in pixels (after the SPS's cropping).
    pub width: usize,
    /// Height in pixels (after the SPS's cropping).
    pub height: usize,
    /// Luma, `width * height` bytes.
    pub y: Vec<u8>,
    /// Blue-difference chroma, `ceil(width / 2) * ceil(height / 2)` bytes.
    pub u: Vec<u8>,
    /// Red-difference chroma, as `u`.
    pub v: Vec<u8>,
}

fn decode_error(reason: impl std::fmt::Display) -> MediaError {
    MediaError::Decode {
        kind: "video",
        reason: reason.to_string(),
    }
}

/// Decodes the frames at `frames` (indices in presentation order, any order, repeats allowed)
/// from an H.264 MP4 and returns them in the order asked. Frames larger than `max_pixels`
/// are refused before any decoding.
///
/// # Errors
///
/// [`MediaError::Decode`] when the container or the bitstream is broken, or an index is past
/// the last frame; [`MediaError::TooLarge`] for frames over `max_pixels`; [`MediaError::Empty`]
/// when no frame is asked for.
pub fn decode_frames(bytes: &[u8], frames: &[u32], max_pixels: u64) -> Result<Vec<YuvFrame>, MediaError> {
    if frames.is_empty() {
        return Err(MediaError::Empty { kind: "video" });
    }
    let track = mp4_h264_track(bytes).map_err(|err| match err {
        switchyard_media::MediaError::Unsupported(what) => {
            decode_error(format!("{what}; the native encoder decodes H.264 in MP4 only"))
        }
        err => decode_error(err),
    })?;
    let declared = u64::from(track.width) * u64::from(track.height);
    if declared > max_pixels {
        return Err(MediaError::TooLarge {
            kind: "video",
            reason: format!(
                "{}x{} frames are {declared} pixels (the most is {max_pixels})",
                track.width, track.height
            ),
        });
    }
    let count = track.samples.len();
    let last = frames.iter().copied().max().unwrap_or(0) as usize;
    if last >= count {
        return Err(decode_error(format!(
            "frame {last} was asked for but the video has {count} frames"
        )));
    }
    let mut wanted: Vec<u32> = frames.to_vec();
    wanted.sort_unstable();
    wanted.dedup();
    let mut stream = Stream::open(&track, bytes, max_pixels)?;
    let reordered = track.samples.windows(2).any(|w| w[1].composition < w[0].composition);
    let mut found: BTreeMap<u32, YuvFrame> = BTreeMap::new();
    if reordered {
        // B-frames: pictures come out in presentation order, later than their samples go in;
        // count them from the first sample.
        let mut shown = 0u32;
        for i in 0..count {
            for picture in stream.feed(i, wanted.binary_search(&shown).is_ok())? {
                if wanted.binary_search(&shown).is_ok() {
                    found.insert(shown, picture.ok_or_else(|| decode_error("a picture was not kept"))?);
                }
                shown += 1;
            }
            if shown as usize > last {
                break;
            }
        }
        if shown as usize <= last {
            for picture in stream.flush()? {
                if wanted.binary_search(&shown).is_ok() {
                    found.insert(shown, picture.ok_or_else(|| decode_error("a picture was not kept"))?);
                }
                shown += 1;
            }
        }
    } else {
        // Presentation order is decode order and each sample's picture comes straight out: skip
        // to the IDR frame before each wanted frame when it lies past the decoding position,
        // so keyframe sampling decodes only the keyframes.
        let idr: Vec<bool> = track
            .samples
            .iter()
            .map(|s| s.sync && starts_with_idr(&bytes[s.range.clone()], track.nal_length_size))
            .collect();
        let mut next = 0usize;
        for &frame in &wanted {
            let frame = frame as usize;
            if let Some(start) = (next..=frame).rev().find(|&i| idr[i]) {
                next = start;
            }
            while next <= frame {
                if let Some(Some(picture)) = stream.feed(next, next == frame)?.pop() {
                    found.insert(next as u32, picture);
                }
                next += 1;
            }
        }
    }
    frames
        .iter()
        .map(|&f| {
            found
                .get(&f)
                .cloned()
                .ok_or_else(|| decode_error(format!("the decoder gave no picture for frame {f} of {count}")))
        })
        .collect()
}

/// An OpenH264 decoder over one track's samples.
struct Stream<'a> {
    decoder: Decoder,
    track: &'a H264Track,
    bytes: &'a [u8],
    max_pixels: u64,
    annex_b: Vec<u8>,
}

impl<'a> Stream<'a> {
    /// A decoder primed with the track's parameter sets (they go in with the first sample).
    fn open(track: &'a H264Track, bytes: &'a [u8], max_pixels: u64) -> Result<Stream<'a>, MediaError> {
        let config = DecoderConfig::new().flush_after_decode(Flush::NoFlush);
        let decoder = Decoder::with_api_config(OpenH264API::from_source(), config)
            .map_err(|err| decode_error(format!("the H.264 decoder does not start: {err}")))?;
        let mut annex_b = Vec::new();
        for set in &track.parameter_sets {
            annex_b.extend_from_slice(&[0, 0, 0, 1]);
            annex_b.extend_from_slice(set);
        }
        Ok(Stream {
            decoder,
            track,
            bytes,
            max_pixels,
            annex_b,
        })
    }

    /// Decodes sample `i` (decode order); returns the pictures that came out (none or one),
    /// copied if `keep`.
    fn feed(&mut self, i: usize, keep: bool) -> Result<Vec<Option<YuvFrame>>, MediaError> {
        let sample = &self.track.samples[i];
        length_prefixed_to_annex_b(
            &self.bytes[sample.range.clone()],
            self.track.nal_length_size,
            &mut self.annex_b,
        )
        .map_err(|why| decode_error(format!("frame {i} (decode order): {why}")))?;
        let picture = self
            .decoder
            .decode(&self.annex_b)
            .map_err(|err| decode_error(format!("frame {i} (decode order) does not decode: {err}")))?;
        self.annex_b.clear();
        match picture {
            Some(yuv) if keep => Ok(vec![Some(copy_planes(&yuv, self.max_pixels)?)]),
            Some(_) => Ok(vec![None]),
            None => Ok(Vec::new()),
        }
    }

    /// The pictures still held in the decoder, all copied.
    fn flush(&mut self) -> Result<Vec<Option<YuvFrame>>, MediaError> {
        let rest = self
            .decoder
            .flush_remaining()
            .map_err(|err| decode_error(format!("the last frames do not decode: {err}")))?;
        rest.iter()
            .map(|yuv| copy_planes(yuv, self.max_pixels).map(Some))
            .collect()
    }
}

/// Whether a sample's first slice is an IDR slice (NAL type 5), from which decoding can start
/// with no earlier picture.
fn starts_with_idr(sample: &[u8], length_size: usize) -> bool {
    for unit in nal_units(sample, length_size) {
        match unit.ok().and_then(|unit| unit.first()).map(|b| b & 0x1f) {
            Some(kind @ 1..=5) => return kind == 5,
            Some(_) => {}
            None => return false,
        }
    }
    false
}

/// Rewrites one MP4 sample into Annex B (each NAL unit behind a `00 00 00 01` start code),
/// appending to `out`.
fn length_prefixed_to_annex_b(sample: &[u8], length_size: usize, out: &mut Vec<u8>) -> Result<(), String> {
    for unit in nal_units(sample, length_size) {
        out.extend_from_slice(&[0, 0, 0, 1]);
        out.extend_from_slice(unit?);
    }
    Ok(())
}

/// The NAL units of one MP4 sample (each behind a big-endian length of `length_size` bytes);
/// a length or unit cut off by the sample's end is an error, and ends the walk.
fn nal_units(sample: &[u8], length_size: usize) -> impl Iterator<Item = Result<&[u8], String>> {
    let mut pos = 0;
    std::iter::from_fn(move || {
        if pos >= sample.len() {
            return None;
        }
        let Some(header) = sample.get(pos..pos + length_size) else {
            let at = std::mem::replace(&mut pos, sample.len());
            return Some(Err(format!("a NAL length at byte {at} is cut off")));
        };
        let len = header.iter().fold(0usize, |n, &b| (n << 8) | usize::from(b));
        let start = pos + length_size;
        let Some(unit) = sample.get(start..start + len) else {
            pos = sample.len();
            return Some(Err(format!(
                "a {len}-byte NAL unit at byte {start} runs past the sample's end"
            )));
        };
        pos = start + len;
        Some(Ok(unit))
    })
}

fn copy_planes(yuv: &openh264::decoder::DecodedYUV<'_>, max_pixels: u64) -> Result<YuvFrame, MediaError> {
    let (width, height) = yuv.dimensions();
    if (width * height) as u64 > max_pixels {
        return Err(MediaError::TooLarge {
            kind: "video",
            reason: format!("a {width}x{height} frame is over {max_pixels} pixels"),
        });
    }
    let (y_stride, u_stride, v_stride) = yuv.strides();
    let (chroma_width, chroma_height) = (width.div_ceil(2), height.div_ceil(2));
    let plane = |data: &[u8], stride: usize, w: usize, h: usize| -> Vec<u8> {
        (0..h)
            .flat_map(|row| &data[row * stride..row * stride + w])
            .copied()
            .collect()
    };
    Ok(YuvFrame {
        width,
        height,
        y: plane(yuv.y(), y_stride, width, height),
        u: plane(yuv.u(), u_stride, chroma_width, chroma_height),
        v: plane(yuv.v(), v_stride, chroma_width, chroma_height),
    })
}

impl YuvFrame {
    /// The frame in RGB, as FFmpeg's swscale converts `yuv420p` to `rgb24` at the same size:
    /// BT.601 coefficients, studio range (luma 16..235, chroma 16..240), in swscale's fixed
    /// point, each chroma sample used for its 2x2 block of pixels.
    pub fn to_rgb(&self) -> image::RgbImage {
        let chroma_width = self.width.div_ceil(2);
        let mut rgb = Vec::with_capacity(self.width * self.height * 3);
        for row in 0..self.height {
            for col in 0..self.width {
                let c = (row / 2) * chroma_width + col / 2;
                rgb.extend_from_slice(&bt601_studio(self.y[row * self.width + col], self.u[c], self.v[c]));
            }
        }
        image::RgbImage::from_raw(self.width as u32, self.height as u32, rgb)
            .unwrap_or_else(|| image::RgbImage::new(self.width as u32, self.height as u32))
    }
}

/// FFmpeg's fixed-point BT.601 studio-range conversion as swscale's x86 `yuv420p` to `rgb24`
/// code does it (the path PyAV takes there): samples scaled by 8, each product by a 2^13-scaled
/// coefficient keeping its high 16 bits (`pmulhw`, which floors), the sums saturated to a byte.
/// Against the exact conversion, rounded, this is at most 3 levels lower; against PyAV's
/// output it is exact.
fn bt601_studio(y: u8, u: u8, v: u8) -> [u8; 3] {
    // swscale's coefficients: round(c * 2^13) of 255/219, 1.596, -0.392, -0.813 and 2.017.
    const Y: i32 = 9539;
    const V_R: i32 = 13075;
    const U_G: i32 = -3209;
    const V_G: i32 = -6660;
    const U_B: i32 = 16525;
    let high = |a: i32, b: i32| (a * b) >> 16;
    let y = high((i32::from(y) << 3) - (16 << 3), Y);
    let (u, v) = ((i32::from(u) << 3) - (128 << 3), (i32::from(v) << 3) - (128 << 3));
    let to_u8 = |x: i32| x.clamp(0, 255) as u8;
    [
        to_u8(y + high(v, V_R)),
        to_u8(y + high(u, U_G) + high(v, V_G)),
        to_u8(y + high(u, U_B)),
    ]
}
