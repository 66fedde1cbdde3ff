//! Images: PNG, JPEG, WebP and GIF, by header and structure only.
//!
//! Dimensions come from the `imagesize` crate (header reads, no pixel decoding). What
//! `imagesize` does not do is tell a whole file from a cut one, so each format's own framing is
//! walked by hand here, a few dozen lines each and touching no pixel data: PNG's chunks (lengths
//! must fit, the last must be `IEND`), JPEG's marker segments (each length must fit; after the
//! first SOS the entropy-coded data is scanned for the next marker, and the file must reach EOI,
//! `FFD9`; bytes after EOI are ignored), GIF's blocks and sub-blocks (the file must reach the
//! `0x3B` trailer) and WebP's RIFF header (the RIFF size must equal the buffer: larger is
//! truncated, smaller is trailing junk and refused as malformed). Any other image format is
//! refused as unsupported, naming what it looks like.

use crate::error::MediaError;
use crate::info::{Container, MediaInfo};
use crate::read::{be16, be32, bytes, le32, u8_at};
use crate::sniff::{looks_like, sniff};

/// Probes a PNG, JPEG, WebP or GIF image: its size in pixels, after checking from the
/// container's structure that the file is whole.
///
/// Errors: [`MediaError::Unsupported`] for anything else ("not a PNG, JPEG, WebP or GIF image
/// (looks like: a BMP image)"), [`MediaError::Truncated`] for a cut file ("truncated PNG: no
/// IEND chunk ..."), [`MediaError::Malformed`] for inconsistent structure or a zero size.
pub fn probe_image(b: &[u8]) -> Result<MediaInfo, MediaError> {
    let container = match sniff(b) {
        Some(c @ (Container::Png | Container::Jpeg | Container::WebP | Container::Gif)) => c,
        _ => {
            return Err(MediaError::Unsupported(format!(
                "not a PNG, JPEG, WebP or GIF image (looks like: {})",
                looks_like(b)
            )));
        }
    };
    match container {
        Container::Png => check_png(b)?,
        Container::Jpeg => check_jpeg(b)?,
        Container::Gif => check_gif(b)?,
        _ => check_webp(b)?,
    }
    let size = imagesize::blob_size(b)
        .map_err(|e| MediaError::malformed(container, format!("cannot read the image size: {e}")))?;
    let width = u32::try_from(size.width).unwrap_or(u32::MAX);
    let height = u32::try_from(size.height).unwrap_or(u32::MAX);
    if width == 0 || height == 0 {
        return Err(MediaError::malformed(
            container,
            format!("the image is {width}x{height} pixels"),
        ));
    }
    let mut info = MediaInfo::new(container, b);
    info.width = width;
    info.height = height;
    Ok(info)
}

/// What a decoder checks before it inflates a PNG and the header probe does not: every
/// chunk's CRC-32. A PNG whose headers are sound but whose data was damaged in transit passes
/// [`probe_image`] and fails here, as it would fail to decode.
///
/// # Errors
///
/// [`MediaError`] naming the first chunk whose CRC does not match (or the truncation).
pub fn verify_png_crcs(b: &[u8]) -> Result<(), MediaError> {
    const C: Container = Container::Png;
    check_png(b)?;
    let mut pos = 8usize;
    while let (Some(len), Some(kind)) = (be32(b, pos), bytes(b, pos + 4, 4)) {
        let data_end = pos + 8 + len as usize;
        let (Some(covered), Some(stored)) = (b.get(pos + 4..data_end), be32(b, data_end)) else {
            break;
        };
        if crc32fast::hash(covered) != stored {
            let kind = String::from_utf8_lossy(kind);
            return Err(MediaError::malformed(
                C,
                format!("the {kind} chunk at byte {pos} fails its CRC: the data is damaged"),
            ));
        }
        if kind == b"IEND" {
            break;
        }
        pos = data_end + 4;
    }
    Ok(())
}

/// PNG: signature, then chunks (length, type, data, CRC) up to and including `IEND`.
fn check_png(b: &[u8]) -> Result<(), MediaError> {
    const C: Container = Container::Png;
    let mut pos = 8usize;
    let mut first = true;
    let mut idat = false;
    loop {
        let (Some(len), Some(kind)) = (be32(b, pos), bytes(b, pos + 4, 4)) else {
            let why = if first {
                "the file ends before the IHDR chunk".to_owned()
            } else {
                "no IEND chunk".to_owned()
            };
            return Err(MediaError::truncated(C, why));
        };
        if len > 0x7FFF_FFFF || !kind.iter().all(u8::is_ascii_alphabetic) {
            return Err(MediaError::malformed(C, format!("invalid chunk header at byte {pos}")));
        }
        if first && kind != b"IHDR" {
            return Err(MediaError::malformed(C, "the first chunk is not IHDR"));
        }
        first = false;
        let end = pos.saturating_add(12).saturating_add(len as usize);
        if end > b.len() {
            let kind = String::from_utf8_lossy(kind);
            return Err(MediaError::truncated(
                C,
                format!("no IEND chunk (the {kind} chunk at byte {pos} runs past the end of the data)"),
            ));
        }
        match kind {
            b"IDAT" => idat = true,
            b"IEND" if !idat => return Err(MediaError::malformed(C, "no IDAT chunk before IEND")),
            b"IEND" => return Ok(()),
            _ => {}
        }
        pos = end;
    }
}

/// JPEG: SOI, marker segments, entropy-coded scans, EOI.
fn check_jpeg(b: &[u8]) -> Result<(), MediaError> {
    const C: Container = Container::Jpeg;
    let no_eoi = || MediaError::truncated(C, "no EOI marker (FFD9) after the image data");
    let mut pos = 2usize;
    let mut seen_sof = false;
    let mut seen_sos = false;
    loop {
        match u8_at(b, pos) {
            None => return Err(no_eoi()),
            Some(0xFF) => {}
            Some(_) => return Err(MediaError::malformed(C, format!("expected a marker at byte {pos}"))),
        }
        // Any number of 0xFF fill bytes may precede a marker code.
        while u8_at(b, pos) == Some(0xFF) {
            pos += 1;
        }
        let marker = u8_at(b, pos).ok_or_else(no_eoi)?;
        pos += 1;
        match marker {
            0xD9 if seen_sos => return Ok(()),
            0xD9 => return Err(MediaError::malformed(C, "EOI before any image data (no SOS marker)")),
            0xD8 => return Err(MediaError::malformed(C, "a second SOI marker")),
            0x01 | 0xD0..=0xD7 => continue, // stand-alone markers
            _ => {}
        }
        let len = be16(b, pos).ok_or_else(no_eoi)? as usize;
        if len < 2 {
            return Err(MediaError::malformed(
                C,
                format!("marker FF{marker:02X} has length {len}"),
            ));
        }
        let end = pos + len;
        if end > b.len() {
            return Err(MediaError::truncated(
                C,
                format!(
                    "no EOI marker (FFD9): the FF{marker:02X} segment at byte {} runs past the end",
                    pos - 2
                ),
            ));
        }
        match marker {
            0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) => seen_sof = true,
            0xDA if !seen_sof => return Err(MediaError::malformed(C, "a scan (SOS) before the frame header (SOF)")),
            0xDA => seen_sos = true,
            _ => {}
        }
        pos = end;
        if marker == 0xDA {
            // Entropy-coded data: 0xFF is always followed by 0x00 (a stuffed byte), a restart
            // marker, or fill; any other code is the next marker.
            loop {
                let ff = b
                    .get(pos..)
                    .and_then(|rest| rest.iter().position(|&x| x == 0xFF))
                    .ok_or_else(no_eoi)?;
                pos += ff;
                match u8_at(b, pos + 1).ok_or_else(no_eoi)? {
                    0x00 | 0xD0..=0xD7 => pos += 2,
                    0xFF => pos += 1,
                    _ => break,
                }
            }
        }
    }
}

/// GIF: header, logical screen descriptor, colour table, blocks, trailer.
fn check_gif(b: &[u8]) -> Result<(), MediaError> {
    const C: Container = Container::Gif;
    let no_trailer = || MediaError::truncated(C, "no trailer (0x3B) after the image data");
    let packed = u8_at(b, 10).ok_or_else(no_trailer)?;
    let mut pos = 13usize;
    if packed & 0x80 != 0 {
        pos += 3 << ((packed & 7) + 1);
    }
    let skip_sub_blocks = |mut pos: usize| -> Result<usize, MediaError> {
        loop {
            let size = u8_at(b, pos).ok_or_else(no_trailer)? as usize;
            pos += 1 + size;
            if size == 0 {
                return Ok(pos);
            }
        }
    };
    loop {
        match u8_at(b, pos).ok_or_else(no_trailer)? {
            0x3B => return Ok(()),
            0x21 => pos = skip_sub_blocks(pos + 2)?, // extension: introducer, label, sub-blocks
            0x2C => {
                // Image descriptor: 9 bytes after the separator, the last one packed.
                let packed = u8_at(b, pos + 9).ok_or_else(no_trailer)?;
                pos += 10;
                if packed & 0x80 != 0 {
                    pos += 3 << ((packed & 7) + 1);
                }
                pos = skip_sub_blocks(pos + 1)?; // LZW minimum code size, then the data
            }
            other => {
                return Err(MediaError::malformed(
                    C,
                    format!("unexpected block type 0x{other:02X} at byte {pos}"),
                ));
            }
        }
    }
}

/// WebP: a RIFF container whose size field must account for exactly the bytes present.
fn check_webp(b: &[u8]) -> Result<(), MediaError> {
    const C: Container = Container::WebP;
    let riff = le32(b, 4).ok_or_else(|| MediaError::truncated(C, "the file ends inside the RIFF header"))?;
    let declared = u64::from(riff) + 8;
    let have = b.len() as u64;
    if declared > have {
        return Err(MediaError::truncated(
            C,
            format!("the RIFF header declares {declared} bytes but {have} are present"),
        ));
    }
    if declared < have {
        return Err(MediaError::malformed(
            C,
            format!(
                "{} bytes follow the RIFF chunk (it declares {declared} bytes of {have})",
                have - declared
            ),
        ));
    }
    // The chunks inside must fit the RIFF chunk, and the first must be an image chunk.
    let mut pos = 12usize;
    let mut first = true;
    while pos < b.len() {
        let (Some(kind), Some(len)) = (bytes(b, pos, 4), le32(b, pos + 4)) else {
            return Err(MediaError::malformed(
                C,
                format!("a chunk header at byte {pos} is cut off"),
            ));
        };
        if first && !matches!(kind, b"VP8 " | b"VP8L" | b"VP8X") {
            return Err(MediaError::malformed(C, "the first chunk is not VP8, VP8L or VP8X"));
        }
        first = false;
        let end = pos as u64 + 8 + u64::from(len) + u64::from(len & 1);
        if end > have + u64::from(len & 1) {
            return Err(MediaError::malformed(
                C,
                format!("a chunk at byte {pos} runs past the RIFF chunk"),
            ));
        }
        pos = end as usize;
    }
    if first {
        return Err(MediaError::malformed(C, "no image chunk"));
    }
    Ok(())
}

#[cfg(test)]
mod integrity_tests {
    use super::*;

    #[test]
    fn a_damaged_idat_passes_the_probe_and_fails_the_crc_check() {
        let png = crate::fixtures::png(16, 16);
        verify_png_crcs(&png).expect("a sound PNG");
        let mut damaged = png.clone();
        // Inside the IDAT chunk's data: after the signature (8), IHDR (25) and IDAT's header (8).
        damaged[8 + 25 + 8 + 20] ^= 0x55;
        probe_image(&damaged).expect("the headers are intact");
        let err = verify_png_crcs(&damaged).expect_err("damaged");
        assert!(err.to_string().contains("IDAT chunk"), "{err}");
    }
}
