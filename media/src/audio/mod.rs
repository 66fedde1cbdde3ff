//! Audio: WAV, MP3, FLAC and Ogg, by container structure only.
//!
//! `input_audio` names its format (`wav`, `mp3`, `flac`, `ogg`); [`probe_audio`] checks that the
//! bytes are that format and reads duration, sample rate and channels from the container. The
//! four readers are small hand parsers, one module each, rather than `symphonia`: the checks the
//! gateway needs are structural (a WAV data chunk that claims more than is present, an MP3 whose
//! frames stop lining up, an Ogg page with a bad capture pattern or CRC, a FLAC frame cut short)
//! and symphonia's readers resynchronise past such damage instead of reporting it, so a walk of
//! our own was needed anyway; once it exists it yields the numbers directly (WAV from `fmt `
//! and `data`, MP3 from counting frame headers, FLAC from STREAMINFO and frame headers, Ogg from
//! the last granule position), and symphonia's format readers would add about ten crates to
//! the gateway for no extra answer. No parser reads sample data beyond a frame header.

mod flac;
mod mp3;
mod ogg;
mod wav;

use crate::error::MediaError;
use crate::info::{Container, MediaInfo};
use crate::sniff::{looks_like, sniff};

/// What an audio reader found.
#[derive(Debug)]
struct Audio {
    duration_s: f64,
    sample_rate: u32,
    channels: u32,
}

/// Probes an audio item whose format the request declares (`input_audio.format`: `wav`, `mp3`,
/// `flac` or `ogg`, any case; `wave`, `mpeg`, `oga` and `opus` are accepted as aliases):
/// duration, sample rate and channels, after checking from the container's structure that the
/// bytes are that format and whole.
///
/// Errors: [`MediaError::Unsupported`] for another declared format (or a codec the container
/// holds that is not taken: free-format MP3, compressed WAV, Speex in Ogg),
/// [`MediaError::FormatMismatch`] when the bytes are recognisably another container,
/// [`MediaError::Truncated`] / [`MediaError::Malformed`] as each reader documents.
pub fn probe_audio(b: &[u8], format: &str) -> Result<MediaInfo, MediaError> {
    let declared = match format.trim().to_ascii_lowercase().as_str() {
        "wav" | "wave" => Container::Wav,
        "mp3" | "mpeg" => Container::Mp3,
        "flac" => Container::Flac,
        "ogg" | "oga" | "opus" => Container::Ogg,
        other => {
            let shown: String = other.chars().take(20).collect();
            return Err(MediaError::Unsupported(format!(
                "audio format `{shown}` is not supported; send wav, mp3, flac or ogg"
            )));
        }
    };
    if let Some(found) = sniff(b)
        && found != declared
    {
        return Err(MediaError::FormatMismatch {
            declared: format.trim().to_owned(),
            found: looks_like(b),
        });
    }
    let audio = match declared {
        Container::Wav => wav::probe(b)?,
        Container::Mp3 => mp3::probe(b)?,
        Container::Flac => flac::probe(b)?,
        _ => ogg::probe(b)?,
    };
    let mut info = MediaInfo::new(declared, b);
    info.duration_s = audio.duration_s;
    info.sample_rate = audio.sample_rate;
    info.channels = audio.channels;
    Ok(info)
}

/// The error for bytes that do not start like `container` at all: truncated when they are a
/// proper prefix of its signature, otherwise malformed, naming what they look like.
fn not_this(container: Container, signature: &[u8], b: &[u8]) -> MediaError {
    if b.len() < signature.len() && signature.starts_with(b) {
        return MediaError::truncated(container, "the data ends inside the file header");
    }
    MediaError::malformed(
        container,
        format!("no {} header (the data looks like {})", container.name(), looks_like(b)),
    )
}
