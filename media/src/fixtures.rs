//! Small, valid media files built in code, for tests (the `fixtures` feature).
//!
//! Every builder writes a complete file of the requested size or length, so tests of this crate,
//! the gateway and the end-to-end suite can send real media without shipping binary files. The
//! images and most audio are decodable by ordinary decoders: [`png`] (stored zlib blocks), [`jpeg`]
//! (the `jpeg-encoder` crate), [`gif`] (uncompressed LZW codes), [`webp`] (a lossless image of one
//! colour), [`wav`] (16-bit PCM silence), [`mp3`] (frames of silence), [`flac`] (constant
//! subframes) and [`ogg_opus`] (zero-length Opus frames, which decoders treat as silence).
//! [`ogg_vorbis`], [`Mp4Video`] and [`WebmVideo`] are structurally valid (headers, indexes,
//! checksums) but their payloads are placeholders, not decodable bitstreams. Builders panic on
//! nonsensical arguments (a zero size), as test helpers do.

use base64::Engine as _;

use crate::crc;

/// `bytes` as a base64 data URL of media type `mime`.
pub fn data_url(mime: &str, bytes: &[u8]) -> String {
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// `bytes` as standard base64 (as `input_audio.data` carries them).
pub fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

// ---------------------------------------------------------------------------------------------
// Images

/// A `width` x `height` RGB PNG (a colour gradient), with stored (uncompressed) zlib blocks.
pub fn png(width: u32, height: u32) -> Vec<u8> {
    png_tagged(width, height, &[])
}

/// [`png`] with `tag` in a `tEXt` chunk after the header (none when `tag` is empty): images of
/// one size whose bytes, and so whose media ids, differ.
pub fn png_tagged(width: u32, height: u32, tag: &[u8]) -> Vec<u8> {
    assert!(width > 0 && height > 0, "a PNG needs pixels");
    fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let start = out.len();
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        let crc = crc::png32(&out[start..]);
        out.extend_from_slice(&crc.to_be_bytes());
    }
    let mut raw = Vec::new();
    for y in 0..height {
        raw.push(0); // filter: none
        for x in 0..width {
            raw.extend_from_slice(&[(x * 255 / width) as u8, (y * 255 / height) as u8, 128]);
        }
    }
    // zlib: header, stored deflate blocks, Adler-32.
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, block) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        z.extend_from_slice(&len.to_le_bytes());
        z.extend_from_slice(&(!len).to_le_bytes());
        z.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());

    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, deflate, no filter method, no interlace
    chunk(&mut out, b"IHDR", &ihdr);
    if !tag.is_empty() {
        let text: Vec<u8> = b"Comment\0".iter().chain(tag).copied().collect();
        chunk(&mut out, b"tEXt", &text);
    }
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

/// A `width` x `height` baseline JPEG (a colour gradient), from the `jpeg-encoder` crate.
pub fn jpeg(width: u16, height: u16) -> Vec<u8> {
    assert!(width > 0 && height > 0, "a JPEG needs pixels");
    let mut rgb = Vec::with_capacity(usize::from(width) * usize::from(height) * 3);
    for y in 0..u32::from(height) {
        for x in 0..u32::from(width) {
            rgb.extend_from_slice(&[
                (x * 255 / u32::from(width)) as u8,
                (y * 255 / u32::from(height)) as u8,
                64,
            ]);
        }
    }
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, 85)
        .encode(&rgb, width, height, jpeg_encoder::ColorType::Rgb)
        .expect("jpeg-encoder encodes an RGB buffer of the right size");
    out
}

/// A `width` x `height` GIF89a (a checkerboard of two colours), one frame.
pub fn gif(width: u16, height: u16) -> Vec<u8> {
    assert!(width > 0 && height > 0, "a GIF needs pixels");
    let mut out = b"GIF89a".to_vec();
    out.extend_from_slice(&width.to_le_bytes());
    out.extend_from_slice(&height.to_le_bytes());
    out.extend_from_slice(&[0x80, 0, 0]); // global colour table of 2 entries
    out.extend_from_slice(&[0, 0, 0, 255, 255, 255]);
    out.push(0x2C);
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&width.to_le_bytes());
    out.extend_from_slice(&height.to_le_bytes());
    out.push(0); // no local colour table
    out.push(2); // LZW minimum code size
    // Each pixel as CLEAR then its literal: 3-bit codes throughout, no dictionary growth.
    let mut bits = BitWriter::default();
    for y in 0..height {
        for x in 0..width {
            bits.write(4, 3); // CLEAR
            bits.write(u32::from((x + y) & 1), 3);
        }
    }
    bits.write(5, 3); // END
    for block in bits.finish().chunks(255) {
        out.push(block.len() as u8);
        out.extend_from_slice(block);
    }
    out.push(0);
    out.push(0x3B);
    out
}

/// A `width` x `height` lossless WebP (VP8L) of one opaque colour (sides up to 16384).
pub fn webp(width: u32, height: u32) -> Vec<u8> {
    assert!(
        (1..=16_384).contains(&width) && (1..=16_384).contains(&height),
        "VP8L sides are 1 to 16384"
    );
    let mut bits = BitWriter::default();
    bits.write(width - 1, 14);
    bits.write(height - 1, 14);
    bits.write(0, 1); // alpha unused
    bits.write(0, 3); // version
    bits.write(0, 1); // no transform
    bits.write(0, 1); // no colour cache
    bits.write(0, 1); // no meta prefix codes
    // Five prefix codes (green, red, blue, alpha, distance), each a "simple" code of one symbol,
    // so every pixel takes no bits: green 0, red 0, blue 0, alpha 255.
    for symbol in [0u32, 0, 0, 255, 0] {
        bits.write(1, 1); // simple code
        bits.write(0, 1); // one symbol
        if symbol < 2 {
            bits.write(0, 1);
            bits.write(symbol, 1);
        } else {
            bits.write(1, 1);
            bits.write(symbol, 8);
        }
    }
    let mut payload = vec![0x2F];
    payload.extend_from_slice(&bits.finish());
    riff(b"WEBP", &[(b"VP8L", &payload)])
}

/// A RIFF file of `form` with these chunks (padded to even lengths).
fn riff(form: &[u8; 4], chunks: &[(&[u8; 4], &[u8])]) -> Vec<u8> {
    let mut body = form.to_vec();
    for (id, data) in chunks {
        body.extend_from_slice(*id);
        body.extend_from_slice(&(data.len() as u32).to_le_bytes());
        body.extend_from_slice(data);
        if data.len() % 2 == 1 {
            body.push(0);
        }
    }
    let mut out = b"RIFF".to_vec();
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Bits packed least-significant first (GIF's LZW codes, VP8L).
#[derive(Debug, Default)]
struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    fn write(&mut self, value: u32, bits: u32) {
        self.acc |= u64::from(value & ((1u32 << bits) - 1)) << self.n;
        self.n += bits;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

// ---------------------------------------------------------------------------------------------
// Audio

/// A 16-bit PCM WAV of silence: `duration_s` seconds (rounded to whole samples).
pub fn wav(sample_rate: u32, channels: u16, duration_s: f64) -> Vec<u8> {
    assert!(sample_rate > 0 && channels > 0, "a WAV needs a rate and channels");
    let frames = (duration_s * f64::from(sample_rate)).round() as usize;
    let block_align = channels * 2;
    let mut fmt = Vec::new();
    fmt.extend_from_slice(&1u16.to_le_bytes()); // PCM
    fmt.extend_from_slice(&channels.to_le_bytes());
    fmt.extend_from_slice(&sample_rate.to_le_bytes());
    fmt.extend_from_slice(&(sample_rate * u32::from(block_align)).to_le_bytes());
    fmt.extend_from_slice(&block_align.to_le_bytes());
    fmt.extend_from_slice(&16u16.to_le_bytes());
    let data = vec![0u8; frames * usize::from(block_align)];
    riff(b"WAVE", &[(b"fmt ", &fmt), (b"data", &data)])
}

/// An MP3 of `frames` Layer III frames of silence (MPEG-1 at 128 kbit/s for 32, 44.1 and 48 kHz;
/// MPEG-2 at 64 kbit/s for 16, 22.05 and 24 kHz; MPEG-2.5 at 32 kbit/s for 8, 11.025 and 12 kHz).
/// Duration: `frames` times 1152 (MPEG-1) or 576 samples.
pub fn mp3(sample_rate: u32, channels: u32, frames: u32) -> Vec<u8> {
    let (version_bits, rate_index, bitrate_index, bitrate, per_slot) = match sample_rate {
        44_100 => (3, 0, 9, 128_000, 144),
        48_000 => (3, 1, 9, 128_000, 144),
        32_000 => (3, 2, 9, 128_000, 144),
        22_050 => (2, 0, 8, 64_000, 72),
        24_000 => (2, 1, 8, 64_000, 72),
        16_000 => (2, 2, 8, 64_000, 72),
        11_025 => (0, 0, 4, 32_000, 72),
        12_000 => (0, 1, 4, 32_000, 72),
        8_000 => (0, 2, 4, 32_000, 72),
        other => panic!("no MP3 sample rate {other}"),
    };
    let mode = if channels == 1 { 3 } else { 0 };
    let header: u32 = (0x7FF << 21)
        | (version_bits << 19)
        | (1 << 17) // layer III
        | (1 << 16) // no CRC
        | (bitrate_index << 12)
        | (rate_index << 10)
        | (mode << 6);
    let len = (per_slot * bitrate / sample_rate) as usize;
    let mut out = Vec::with_capacity(len * frames as usize);
    for _ in 0..frames {
        out.extend_from_slice(&header.to_be_bytes());
        out.resize(out.len() + len - 4, 0);
    }
    out
}

/// A 16-bit FLAC of silence: `total_samples` samples in blocks of `block_size` (the last one
/// shorter), each frame with constant subframes and valid CRCs. With `declare_total` false,
/// STREAMINFO leaves the total unknown (0), as streaming encoders do.
pub fn flac(sample_rate: u32, channels: u32, total_samples: u64, block_size: u32, declare_total: bool) -> Vec<u8> {
    assert!((1..=8).contains(&channels) && (16..=65_535).contains(&block_size) && sample_rate > 0);
    let mut out = b"fLaC".to_vec();
    out.extend_from_slice(&[0x80, 0, 0, 34]); // last metadata block: STREAMINFO, 34 bytes
    out.extend_from_slice(&(block_size as u16).to_be_bytes());
    out.extend_from_slice(&(block_size as u16).to_be_bytes());
    out.extend_from_slice(&[0; 6]); // frame sizes unknown
    let total = if declare_total { total_samples } else { 0 };
    let packed =
        (u64::from(sample_rate) << 44) | (u64::from(channels - 1) << 41) | (15u64 << 36) | (total & 0xF_FFFF_FFFF);
    out.extend_from_slice(&packed.to_be_bytes());
    out.extend_from_slice(&[0; 16]); // MD5 unknown
    let mut done = 0u64;
    let mut number = 0u64;
    while done < total_samples {
        let n = (total_samples - done).min(u64::from(block_size)) as u32;
        let start = out.len();
        out.extend_from_slice(&[0xFF, 0xF8, 0x70, (((channels - 1) as u8) << 4) | (4 << 1)]);
        out.extend_from_slice(&utf8_number(number));
        out.extend_from_slice(&((n - 1) as u16).to_be_bytes());
        let header_crc = crc::flac8(&out[start..]);
        out.push(header_crc);
        for _ in 0..channels {
            out.extend_from_slice(&[0x00, 0x00, 0x00]); // CONSTANT subframe, value 0 (16 bits)
        }
        let crc = crc::flac16(&out[start..]);
        out.extend_from_slice(&crc.to_be_bytes());
        done += u64::from(n);
        number += 1;
    }
    out
}

/// FLAC's UTF-8-style coding of a frame number.
fn utf8_number(n: u64) -> Vec<u8> {
    if n < 0x80 {
        return vec![n as u8];
    }
    let mut len = 2;
    while n >= 1 << (5 * len + 1) {
        len += 1;
    }
    let mut out = vec![0u8; len];
    let mut v = n;
    for byte in out[1..].iter_mut().rev() {
        *byte = 0x80 | (v & 0x3F) as u8;
        v >>= 6;
    }
    out[0] = (0xFF00u16 >> len) as u8 | v as u8;
    out
}

/// An Ogg stream writer: pages of whole packets with valid CRCs.
#[derive(Debug)]
struct OggWriter {
    out: Vec<u8>,
    serial: u32,
    sequence: u32,
}

impl OggWriter {
    fn new(serial: u32) -> Self {
        Self {
            out: Vec::new(),
            serial,
            sequence: 0,
        }
    }

    fn page(&mut self, flags: u8, granule: u64, packets: &[&[u8]]) {
        let mut table = Vec::new();
        for p in packets {
            table.extend(std::iter::repeat_n(255u8, p.len() / 255));
            table.push((p.len() % 255) as u8);
        }
        assert!(table.len() <= 255, "too many packets for one page");
        let start = self.out.len();
        self.out.extend_from_slice(b"OggS\0");
        self.out.push(flags);
        self.out.extend_from_slice(&granule.to_le_bytes());
        self.out.extend_from_slice(&self.serial.to_le_bytes());
        self.out.extend_from_slice(&self.sequence.to_le_bytes());
        self.out.extend_from_slice(&[0; 4]);
        self.out.push(table.len() as u8);
        self.out.extend_from_slice(&table);
        for p in packets {
            self.out.extend_from_slice(p);
        }
        let crc = crc::ogg_update(0, &self.out[start..]);
        self.out[start + 22..start + 26].copy_from_slice(&crc.to_le_bytes());
        self.sequence += 1;
    }

    /// Audio packets of `per_packet` granules each, up to `total` granules, 50 packets a page;
    /// granule positions start at `offset`; the last page ends the stream.
    fn audio(&mut self, packet: &[u8], per_packet: u64, total: u64, offset: u64) {
        let count = total.div_ceil(per_packet).max(1);
        let mut written = 0u64;
        while written < count {
            let n = (count - written).min(50);
            written += n;
            let last = written == count;
            let granule = offset + (written * per_packet).min(total);
            let packets = vec![packet; n as usize];
            self.page(if last { 0x04 } else { 0 }, granule, &packets);
        }
    }
}

/// An Ogg Opus stream of `duration_s` seconds: zero-length 20 ms frames (silence to a decoder)
/// after the OpusHead (pre-skip 312, input rate 48 kHz) and OpusTags headers.
pub fn ogg_opus(channels: u8, duration_s: f64) -> Vec<u8> {
    let pre_skip = 312u16;
    let mut head = b"OpusHead\x01".to_vec();
    head.push(channels);
    head.extend_from_slice(&pre_skip.to_le_bytes());
    head.extend_from_slice(&48_000u32.to_le_bytes());
    head.extend_from_slice(&[0, 0, 0]); // gain, mapping family 0
    let mut tags = b"OpusTags".to_vec();
    tags.extend_from_slice(&10u32.to_le_bytes());
    tags.extend_from_slice(b"switchyard");
    tags.extend_from_slice(&0u32.to_le_bytes());
    let mut w = OggWriter::new(0x5157_4954);
    w.page(0x02, 0, &[&head]);
    w.page(0, 0, &[&tags]);
    // TOC: configuration 31 (CELT, fullband, 20 ms), one frame, stereo flag per channels.
    let toc = 0xF8 | if channels > 1 { 0x04 } else { 0 };
    let total = (duration_s * 48_000.0).round() as u64;
    w.audio(&[toc], 960, total, u64::from(pre_skip));
    w.out
}

/// An Ogg Vorbis stream of `duration_s` seconds at `sample_rate`: a valid identification header
/// and page structure, placeholder comment/setup headers and audio packets (not decodable).
pub fn ogg_vorbis(sample_rate: u32, channels: u8, duration_s: f64) -> Vec<u8> {
    let mut id = b"\x01vorbis".to_vec();
    id.extend_from_slice(&0u32.to_le_bytes());
    id.push(channels);
    id.extend_from_slice(&sample_rate.to_le_bytes());
    id.extend_from_slice(&[0; 12]); // bitrates
    id.extend_from_slice(&[0xB8, 0x01]); // block sizes 256/2048, framing
    let mut w = OggWriter::new(0x766F_7262);
    w.page(0x02, 0, &[&id]);
    w.page(0, 0, &[b"\x03vorbis\0\0\0\0\0\0\0\0\x01", b"\x05vorbis\0"]);
    let total = (duration_s * f64::from(sample_rate)).round() as u64;
    w.audio(&[0x00, 0x00], 1024, total, 0);
    w.out
}

// ---------------------------------------------------------------------------------------------
// Video

/// An MP4 with one video track: `ftyp`, `moov` (mvhd, trak with tkhd, mdhd, hdlr, vmhd, dref,
/// stsd with an `avc1` entry and `avcC`, stts, stss, stsc, stsz, stco) and `mdat`. Frames are
/// placeholder NAL units of `frame_bytes` bytes, not a decodable H.264 stream, unless
/// [`Mp4Video::stream`] carries a real one.
#[derive(Debug, Clone)]
pub struct Mp4Video {
    /// Coded width in pixels.
    pub width: u16,
    /// Coded height in pixels.
    pub height: u16,
    /// Frames in the track.
    pub frames: u32,
    /// Frames per second (the track's timescale is 90 kHz).
    pub fps: f64,
    /// A sync frame every this many frames (from frame 0), written as `stss`; `None` writes no
    /// `stss` (every frame a sync frame).
    pub keyframe_interval: Option<u32>,
    /// The sample entry's code: `avc1` (default), or `hev1`, `vp09`, ... to test refusals.
    pub codec: [u8; 4],
    /// Bytes per frame in `mdat` (at least 5).
    pub frame_bytes: u32,
    /// `moov` before `mdat` ("fast start", the default) or after it.
    pub moov_first: bool,
    /// A real H.264 stream to carry instead of placeholder frames: its samples set the frame
    /// count, sizes and sync frames, its parameter sets the `avcC` (`frames`,
    /// `keyframe_interval` and `frame_bytes` are then ignored).
    pub stream: Option<H264Stream>,
}

/// A real H.264 stream for [`Mp4Video::stream`], as MP4 stores it.
#[derive(Debug, Clone, Default)]
pub struct H264Stream {
    /// The sequence parameter set NAL unit (no start code).
    pub sps: Vec<u8>,
    /// The picture parameter set NAL unit (no start code).
    pub pps: Vec<u8>,
    /// One per frame, in decode order: its NAL units, each behind a 4-byte big-endian length;
    /// and whether it is a sync (IDR) frame.
    pub samples: Vec<(Vec<u8>, bool)>,
}

impl H264Stream {
    /// Splits an encoder's Annex B access units (one per frame, NAL units behind `00 00 01` or
    /// `00 00 00 01` start codes) into parameter sets and MP4 samples. The last SPS and PPS seen
    /// are kept; other parameter sets and access unit delimiters are dropped from the samples.
    pub fn from_annex_b(access_units: &[Vec<u8>]) -> H264Stream {
        let mut stream = H264Stream::default();
        for unit in access_units {
            let mut sample = Vec::new();
            let mut sync = false;
            for nal in annex_b_units(unit) {
                match nal.first().map(|b| b & 0x1f) {
                    Some(7) => stream.sps = nal.to_vec(),
                    Some(8) => stream.pps = nal.to_vec(),
                    Some(9) | None => {}
                    Some(kind) => {
                        sync |= kind == 5;
                        sample.extend_from_slice(&(nal.len() as u32).to_be_bytes());
                        sample.extend_from_slice(nal);
                    }
                }
            }
            if !sample.is_empty() {
                stream.samples.push((sample, sync));
            }
        }
        stream
    }
}

/// The NAL units of an Annex B byte stream (start codes removed).
fn annex_b_units(b: &[u8]) -> Vec<&[u8]> {
    let mut starts = Vec::new(); // (start code begins, NAL unit begins)
    let mut i = 0;
    while i + 3 <= b.len() {
        if b[i] == 0 && b[i + 1] == 0 && b[i + 2] == 1 {
            let code = if i > 0 && b[i - 1] == 0 { i - 1 } else { i };
            starts.push((code, i + 3));
            i += 3;
        } else {
            i += 1;
        }
    }
    starts
        .iter()
        .enumerate()
        .map(|(k, &(_, begin))| &b[begin..starts.get(k + 1).map_or(b.len(), |next| next.0)])
        .filter(|nal| !nal.is_empty())
        .collect()
}

impl Default for Mp4Video {
    fn default() -> Self {
        Self {
            width: 320,
            height: 240,
            frames: 30,
            fps: 30.0,
            keyframe_interval: Some(10),
            codec: *b"avc1",
            frame_bytes: 64,
            moov_first: true,
            stream: None,
        }
    }
}

fn mp4_box(kind: &[u8; 4], parts: &[&[u8]]) -> Vec<u8> {
    let len: usize = 8 + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    out.extend_from_slice(kind);
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

fn full_box(kind: &[u8; 4], flags: u32, parts: &[&[u8]]) -> Vec<u8> {
    let vf = flags.to_be_bytes(); // version 0 in the top byte
    let mut all: Vec<&[u8]> = vec![&vf];
    all.extend_from_slice(parts);
    mp4_box(kind, &all)
}

fn be32s(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_be_bytes()).collect()
}

const MATRIX: [u32; 9] = [0x0001_0000, 0, 0, 0, 0x0001_0000, 0, 0, 0, 0x4000_0000];

impl Mp4Video {
    /// The file.
    pub fn build(&self) -> Vec<u8> {
        assert!(self.fps > 0.0 && self.frame_bytes >= 5);
        let placeholder_sps = [0x67, 0x42, 0xC0, 0x1E, 0xD9, 0x00, 0xA0, 0x47, 0xFE, 0xC8];
        let placeholder_pps = [0x68, 0xCE, 0x38, 0x80];
        let (sps, pps): (&[u8], &[u8]) = match &self.stream {
            Some(s) => (&s.sps, &s.pps),
            None => (&placeholder_sps, &placeholder_pps),
        };
        let frames = self.stream.as_ref().map_or(self.frames, |s| s.samples.len() as u32);
        let sizes: Vec<u32> = match &self.stream {
            Some(s) => s.samples.iter().map(|(b, _)| b.len() as u32).collect(),
            None => vec![self.frame_bytes; frames as usize],
        };
        let timescale = 90_000u32;
        let delta = (f64::from(timescale) / self.fps).round() as u32;
        let ticks = delta * frames;
        let ms = (f64::from(frames) * 1000.0 / self.fps).round() as u32;
        let ftyp = mp4_box(b"ftyp", &[b"isom", &0x200u32.to_be_bytes(), b"isomiso2avc1mp41"]);
        let keyframes: Vec<u32> = match (&self.stream, self.keyframe_interval) {
            (Some(s), _) => (1..)
                .zip(&s.samples)
                .filter(|(_, (_, sync))| *sync)
                .map(|(i, _)| i)
                .collect(),
            (None, Some(k)) => (0..frames).step_by(k.max(1) as usize).map(|i| i + 1).collect(),
            (None, None) => Vec::new(),
        };
        let with_stss = self.stream.is_some() || self.keyframe_interval.is_some();
        let moov = |offset: u32| -> Vec<u8> {
            let mut mvhd = be32s(&[0, 0, 1000, ms, 0x0001_0000]);
            mvhd.extend_from_slice(&[1, 0, 0, 0]); // volume, reserved
            mvhd.extend_from_slice(&[0; 8]);
            mvhd.extend_from_slice(&be32s(&MATRIX));
            mvhd.extend_from_slice(&[0; 24]);
            mvhd.extend_from_slice(&2u32.to_be_bytes());
            let mvhd = full_box(b"mvhd", 0, &[&mvhd]);

            let mut tkhd = be32s(&[0, 0, 1, 0, ms, 0, 0]);
            tkhd.extend_from_slice(&[0; 8]); // layer, alternate group, volume, reserved
            tkhd.extend_from_slice(&be32s(&MATRIX));
            tkhd.extend_from_slice(&be32s(&[u32::from(self.width) << 16, u32::from(self.height) << 16]));
            let tkhd = full_box(b"tkhd", 3, &[&tkhd]);

            let mut mdhd = be32s(&[0, 0, timescale, ticks]);
            mdhd.extend_from_slice(&[0x55, 0xC4, 0, 0]); // "und", pre_defined
            let mdhd = full_box(b"mdhd", 0, &[&mdhd]);
            let hdlr = full_box(b"hdlr", 0, &[&[0; 4], b"vide", &[0; 12], b"VideoHandler\0"]);

            let vmhd = full_box(b"vmhd", 1, &[&[0; 8]]);
            let dref = full_box(b"dref", 0, &[&1u32.to_be_bytes(), &full_box(b"url ", 1, &[])]);
            let dinf = mp4_box(b"dinf", &[&dref]);

            let profile = sps.get(1..4).unwrap_or(&[0x42, 0xC0, 0x1E]);
            let mut avcc = vec![1];
            avcc.extend_from_slice(profile);
            avcc.extend_from_slice(&[0xFF, 0xE1]);
            avcc.extend_from_slice(&(sps.len() as u16).to_be_bytes());
            avcc.extend_from_slice(sps);
            avcc.push(1);
            avcc.extend_from_slice(&(pps.len() as u16).to_be_bytes());
            avcc.extend_from_slice(pps);
            let avcc = mp4_box(b"avcC", &[&avcc]);
            let mut entry = vec![0; 6];
            entry.extend_from_slice(&1u16.to_be_bytes()); // data reference index
            entry.extend_from_slice(&[0; 16]);
            entry.extend_from_slice(&self.width.to_be_bytes());
            entry.extend_from_slice(&self.height.to_be_bytes());
            entry.extend_from_slice(&be32s(&[0x0048_0000, 0x0048_0000, 0]));
            entry.extend_from_slice(&1u16.to_be_bytes()); // frame count
            entry.extend_from_slice(&[0; 32]); // compressor name
            entry.extend_from_slice(&[0x00, 0x18, 0xFF, 0xFF]); // depth, pre_defined -1
            let entry = mp4_box(&self.codec, &[&entry, &avcc]);
            let stsd = full_box(b"stsd", 0, &[&1u32.to_be_bytes(), &entry]);

            let stts = full_box(b"stts", 0, &[&be32s(&[1, frames, delta])]);
            let mut stss_body = be32s(&[keyframes.len() as u32]);
            stss_body.extend_from_slice(&be32s(&keyframes));
            let stss = full_box(b"stss", 0, &[&stss_body]);
            let stsc = full_box(b"stsc", 0, &[&be32s(&[1, 1, frames, 1])]);
            let mut stsz_body = be32s(&[0, frames]);
            stsz_body.extend_from_slice(&be32s(&sizes));
            let stsz = full_box(b"stsz", 0, &[&stsz_body]);
            let stco = full_box(b"stco", 0, &[&be32s(&[1, offset])]);
            let mut tables: Vec<&[u8]> = vec![&stsd, &stts];
            if with_stss {
                tables.push(&stss);
            }
            tables.extend_from_slice(&[&stsc, &stsz, &stco]);
            let stbl = mp4_box(b"stbl", &tables);
            let minf = mp4_box(b"minf", &[&vmhd, &dinf, &stbl]);
            let mdia = mp4_box(b"mdia", &[&mdhd, &hdlr, &minf]);
            let trak = mp4_box(b"trak", &[&tkhd, &mdia]);
            mp4_box(b"moov", &[&mvhd, &trak])
        };
        let mut payload = Vec::with_capacity(sizes.iter().map(|&s| s as usize).sum());
        match &self.stream {
            Some(s) => s.samples.iter().for_each(|(b, _)| payload.extend_from_slice(b)),
            None => {
                for i in 0..frames {
                    let key = keyframes.is_empty() || keyframes.contains(&(i + 1));
                    payload.extend_from_slice(&(self.frame_bytes - 4).to_be_bytes());
                    payload.push(if key { 0x65 } else { 0x41 });
                    payload.resize(payload.len() + self.frame_bytes as usize - 5, 0);
                }
            }
        }
        let mdat = mp4_box(b"mdat", &[&payload]);
        let moov_len = moov(0).len();
        let mut out = ftyp;
        if self.moov_first {
            let offset = (out.len() + moov_len + 8) as u32;
            out.extend_from_slice(&moov(offset));
            out.extend_from_slice(&mdat);
        } else {
            let offset = (out.len() + 8) as u32;
            out.extend_from_slice(&mdat);
            out.extend_from_slice(&moov(offset));
        }
        out
    }
}

/// A WebM with one video track: EBML header, Segment with Info (1 ms timestamps, Duration),
/// Tracks (codec, DefaultDuration, PixelWidth/Height) and Clusters of SimpleBlocks (a new
/// cluster at each keyframe). Frames are placeholder bytes, not a decodable VP9 stream.
#[derive(Debug, Clone)]
pub struct WebmVideo {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Frames in the track.
    pub frames: u32,
    /// Frames per second.
    pub fps: f64,
    /// A keyframe every this many frames, from frame 0 (0: only frame 0).
    pub keyframe_interval: u32,
    /// The Matroska codec id (`V_VP9` by default).
    pub codec_id: String,
    /// Bytes per frame.
    pub frame_bytes: usize,
    /// Write the segment's Duration.
    pub declare_duration: bool,
    /// Write the track's DefaultDuration.
    pub default_duration: bool,
    /// Write the Segment and Clusters with unknown sizes, as live muxers do.
    pub unknown_sizes: bool,
}

impl Default for WebmVideo {
    fn default() -> Self {
        Self {
            width: 320,
            height: 240,
            frames: 30,
            fps: 30.0,
            keyframe_interval: 10,
            codec_id: "V_VP9".to_owned(),
            frame_bytes: 32,
            declare_duration: true,
            default_duration: true,
            unknown_sizes: false,
        }
    }
}

const UNKNOWN_SIZE: [u8; 8] = [0x01, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF];

fn ebml_id(id: u32) -> Vec<u8> {
    let bytes = id.to_be_bytes();
    let skip = bytes.iter().take_while(|&&b| b == 0).count().min(3);
    bytes[skip..].to_vec()
}

fn ebml(id: u32, body: &[u8]) -> Vec<u8> {
    let mut out = ebml_id(id);
    out.push(0x01); // an 8-byte size
    out.extend_from_slice(&(body.len() as u64).to_be_bytes()[1..]);
    out.extend_from_slice(body);
    out
}

fn ebml_uint(id: u32, v: u64) -> Vec<u8> {
    let bytes = v.to_be_bytes();
    let skip = bytes.iter().take_while(|&&b| b == 0).count().min(7);
    ebml(id, &bytes[skip..])
}

impl WebmVideo {
    /// The file.
    pub fn build(&self) -> Vec<u8> {
        assert!(self.fps > 0.0 && self.width > 0 && self.height > 0);
        let header = [
            ebml_uint(0x4286, 1),
            ebml_uint(0x42F7, 1),
            ebml_uint(0x42F2, 4),
            ebml_uint(0x42F3, 8),
            ebml(0x4282, b"webm"),
            ebml_uint(0x4287, 4),
            ebml_uint(0x4285, 2),
        ]
        .concat();
        let mut out = ebml(0x1A45_DFA3, &header);

        let duration_ms = f64::from(self.frames) * 1000.0 / self.fps;
        let mut info = [
            ebml_uint(0x2A_D7B1, 1_000_000),
            ebml(0x4D80, b"switchyard-fixtures"),
            ebml(0x5741, b"switchyard-fixtures"),
        ]
        .concat();
        if self.declare_duration {
            info.extend_from_slice(&ebml(0x4489, &duration_ms.to_be_bytes()));
        }
        let video = [
            ebml_uint(0xB0, u64::from(self.width)),
            ebml_uint(0xBA, u64::from(self.height)),
        ]
        .concat();
        let mut entry = [
            ebml_uint(0xD7, 1),
            ebml_uint(0x73C5, 1),
            ebml_uint(0x83, 1),
            ebml(0x86, self.codec_id.as_bytes()),
        ]
        .concat();
        if self.default_duration {
            entry.extend_from_slice(&ebml_uint(0x23_E383, (1e9 / self.fps).round() as u64));
        }
        entry.extend_from_slice(&ebml(0xE0, &video));
        let mut segment = ebml(0x1549_A966, &info);
        segment.extend_from_slice(&ebml(0x1654_AE6B, &ebml(0xAE, &entry)));

        let mut cluster: Option<(u64, Vec<u8>)> = None;
        let flush = |segment: &mut Vec<u8>, cluster: Option<(u64, Vec<u8>)>| {
            if let Some((ts, blocks)) = cluster {
                let body = [ebml_uint(0xE7, ts), blocks].concat();
                if self.unknown_sizes {
                    segment.extend_from_slice(&ebml_id(0x1F43_B675));
                    segment.extend_from_slice(&UNKNOWN_SIZE);
                    segment.extend_from_slice(&body);
                } else {
                    segment.extend_from_slice(&ebml(0x1F43_B675, &body));
                }
            }
        };
        for i in 0..self.frames {
            let ts = (f64::from(i) * 1000.0 / self.fps).round() as u64;
            let key = i == 0 || (self.keyframe_interval > 0 && i % self.keyframe_interval == 0);
            let too_far = cluster.as_ref().is_some_and(|(start, _)| ts - start > 30_000);
            if key || too_far || cluster.is_none() {
                flush(&mut segment, cluster.take());
                cluster = Some((ts, Vec::new()));
            }
            if let Some((start, blocks)) = cluster.as_mut() {
                let mut block = vec![0x81];
                block.extend_from_slice(&((ts - *start) as i16).to_be_bytes());
                block.push(if key { 0x80 } else { 0x00 });
                block.resize(block.len() + self.frame_bytes, 0xA5);
                blocks.extend_from_slice(&ebml(0xA3, &block));
            }
        }
        flush(&mut segment, cluster.take());
        if self.unknown_sizes {
            out.extend_from_slice(&ebml_id(0x1853_8067));
            out.extend_from_slice(&UNKNOWN_SIZE);
            out.extend_from_slice(&segment);
        } else {
            out.extend_from_slice(&ebml(0x1853_8067, &segment));
        }
        out
    }
}
