//! Telling containers apart by their first bytes.
//!
//! Each probe first asks [`sniff`] which of the ten accepted containers the bytes start like, so
//! that an item sent as the wrong kind (an MP3 as an image, a PNG as `input_audio` with format
//! `wav`) gets a message naming what it is; [`looks_like`] words that for messages, falling back
//! to `imagesize`'s detection for other image formats (BMP, TIFF, HEIF/AVIF, ...) and to a few
//! well-known signatures (PDF, ZIP, text) before printing the first bytes.

use crate::info::Container;
use crate::read::{be32, bytes, u8_at};

/// The accepted container the bytes start like, from signatures only (no structure checks).
pub(crate) fn sniff(b: &[u8]) -> Option<Container> {
    if b.starts_with(b"\x89PNG\r\n\x1a\n") {
        return Some(Container::Png);
    }
    if b.starts_with(&[0xFF, 0xD8, 0xFF]) {
        return Some(Container::Jpeg);
    }
    if b.starts_with(b"GIF87a") || b.starts_with(b"GIF89a") {
        return Some(Container::Gif);
    }
    if b.starts_with(b"RIFF") {
        match bytes(b, 8, 4) {
            Some(b"WEBP") => return Some(Container::WebP),
            Some(b"WAVE") => return Some(Container::Wav),
            _ => {}
        }
    }
    if b.starts_with(b"OggS") {
        return Some(Container::Ogg);
    }
    if b.starts_with(&[0x1A, 0x45, 0xDF, 0xA3]) {
        return Some(Container::WebM);
    }
    if bytes(b, 4, 4).is_some_and(|t| matches!(t, b"ftyp" | b"moov" | b"mdat" | b"wide" | b"free" | b"skip")) {
        return Some(Container::Mp4);
    }
    let audio_start = id3v2_end(b).unwrap_or(0);
    if bytes(b, audio_start, 4) == Some(b"fLaC") {
        return Some(Container::Flac);
    }
    if audio_start > 0 || is_mpeg_audio_header(b, audio_start) {
        return Some(Container::Mp3);
    }
    None
}

/// Where the ID3v2 tags at the start of `b` end (all of them, back to back), if it starts with
/// one; the offset may lie past the end of `b` when a tag is cut short.
pub(crate) fn id3v2_end(b: &[u8]) -> Option<usize> {
    let mut pos = 0usize;
    while bytes(b, pos, 3) == Some(b"ID3") {
        let flags = u8_at(b, pos + 5)?;
        let size = be32(b, pos + 6)?;
        // A syncsafe integer: 7 bits per byte.
        let size = ((size & 0x7F00_0000) >> 3) | ((size & 0x7F_0000) >> 2) | ((size & 0x7F00) >> 1) | (size & 0x7F);
        let footer = if flags & 0x10 != 0 { 10 } else { 0 };
        pos = pos.checked_add(10 + footer + size as usize)?;
    }
    (pos > 0).then_some(pos)
}

/// Whether an MPEG audio frame header (any layer) plausibly starts at `at`.
fn is_mpeg_audio_header(b: &[u8], at: usize) -> bool {
    let Some(h) = be32(b, at) else { return false };
    h >> 21 == 0x7FF // frame sync
        && (h >> 19) & 3 != 1 // version: not reserved
        && (h >> 17) & 3 != 0 // layer: not reserved
        && (h >> 12) & 0xF != 0xF // bitrate: not bad
        && (h >> 10) & 3 != 3 // sample rate: not reserved
}

/// What the bytes look like, for messages: "a PNG image", "MP3 audio", "a BMP image", "a PDF
/// document", "text", "empty data", or "unrecognised data starting 00 01 02 ...".
pub(crate) fn looks_like(b: &[u8]) -> String {
    if let Some(c) = sniff(b) {
        return match c {
            Container::Png | Container::Jpeg | Container::WebP | Container::Gif => format!("a {} image", c.name()),
            Container::Wav | Container::Mp3 | Container::Flac | Container::Ogg => format!("{} audio", c.name()),
            Container::Mp4 => "an MP4 video".to_owned(),
            Container::WebM => "a WebM video".to_owned(),
        };
    }
    if b.is_empty() {
        return "empty data".to_owned();
    }
    if let Ok(t) = imagesize::image_type(b) {
        let name = match t {
            imagesize::ImageType::Bmp => "BMP",
            imagesize::ImageType::Tiff => "TIFF",
            imagesize::ImageType::Heif(_) => "HEIF/AVIF",
            imagesize::ImageType::Jxl => "JPEG XL",
            imagesize::ImageType::Ico => "ICO",
            imagesize::ImageType::Qoi => "QOI",
            imagesize::ImageType::Psd => "PSD",
            imagesize::ImageType::Exr => "OpenEXR",
            _ => "other",
        };
        return format!("a {name} image");
    }
    if b.starts_with(b"%PDF") {
        return "a PDF document".to_owned();
    }
    if b.starts_with(b"PK\x03\x04") {
        return "a ZIP archive".to_owned();
    }
    let head = &b[..b.len().min(64)];
    if std::str::from_utf8(head).is_ok_and(|s| s.chars().all(|c| !c.is_control() || c.is_whitespace())) {
        let t = String::from_utf8_lossy(head);
        let t = t.trim_start();
        if t.starts_with('<') {
            return "HTML or XML text".to_owned();
        }
        if t.starts_with("data:") || t.starts_with("http") {
            return "a URL (send the decoded bytes)".to_owned();
        }
        return "text".to_owned();
    }
    let hex: Vec<String> = b.iter().take(8).map(|x| format!("{x:02x}")).collect();
    format!("unrecognised data starting {}", hex.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words() {
        assert_eq!(looks_like(b""), "empty data");
        assert_eq!(
            looks_like(b"BM\x3a\0\0\0\0\0\0\0\x36\0\0\0\x28\0\0\0\x02\0\0\0\x02\0\0\0\x01\0\x18\0"),
            "a BMP image"
        );
        assert_eq!(looks_like(b"%PDF-1.7"), "a PDF document");
        assert_eq!(looks_like(b"<html>"), "HTML or XML text");
        assert_eq!(looks_like(b"hello"), "text");
        assert_eq!(looks_like(&[0, 1, 2, 0xfe]), "unrecognised data starting 00 01 02 fe");
        assert_eq!(looks_like(b"ID3\x04\0\0\0\0\0\0"), "MP3 audio");
        assert_eq!(looks_like(b"ID3\x04\0\0\0\0\0\0fLaC"), "FLAC audio");
        assert_eq!(looks_like(&[0xFF, 0xFB, 0x90, 0x64]), "MP3 audio");
        assert_eq!(looks_like(b"\0\0\0\x20ftypisom"), "an MP4 video");
    }
}
