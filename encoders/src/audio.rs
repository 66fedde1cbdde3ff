//! Audio decoding for the audio encoder: WAV, MP3, FLAC and Ogg Vorbis through symphonia
//! (pure Rust), downmixed to mono by the mean of the channels, and resampled to the rate the
//! feature extractor wants with rubato's FFT resampler (band-limited, its delay trimmed; a
//! fraction of an output sample of phase remains, as between any two resamplers).

use std::io::Cursor;

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Resampler};
use symphonia::core::codecs::audio::AudioDecoderOptions;
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, TrackType};
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;

use crate::MediaError;

/// Decoded audio: mono samples in [−1, 1] at `rate` Hz.
#[derive(Debug, Clone, PartialEq)]
pub struct Waveform {
    /// Samples per second.
    pub rate: u32,
    /// The samples.
    pub samples: Vec<f32>,
}

impl Waveform {
    /// Length in seconds.
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / self.rate.max(1) as f64
    }
}

fn decode_error(reason: impl std::fmt::Display) -> MediaError {
    MediaError::Decode {
        kind: "audio",
        reason: reason.to_string(),
    }
}

/// Decodes a whole clip to mono, refusing clips longer than `max_seconds` as soon as the
/// decoded length passes it.
///
/// # Errors
///
/// [`MediaError::Decode`] when the container or codec is not one of the four or the data is
/// corrupt, [`MediaError::TooLarge`] past `max_seconds`, [`MediaError::Empty`] for no samples.
pub fn decode(bytes: &[u8], max_seconds: f64) -> Result<Waveform, MediaError> {
    let source = MediaSourceStream::new(Box::new(Cursor::new(bytes.to_vec())), Default::default());
    let mut format = symphonia::default::get_probe()
        .probe(
            &Hint::new(),
            source,
            FormatOptions::default(),
            MetadataOptions::default(),
        )
        .map_err(decode_error)?;
    let track = format
        .default_track(TrackType::Audio)
        .ok_or_else(|| decode_error("no audio track"))?;
    let track_id = track.id;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|params| params.audio())
        .ok_or_else(|| decode_error("no audio codec parameters"))?;
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(params, &AudioDecoderOptions::default())
        .map_err(decode_error)?;
    let mut rate = 0u32;
    let mut mono: Vec<f32> = Vec::new();
    let mut interleaved: Vec<f32> = Vec::new();
    loop {
        let packet = match format.next_packet() {
            Ok(Some(packet)) => packet,
            Ok(None) => break,
            Err(SymphoniaError::IoError(err)) if err.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(err) => return Err(decode_error(err)),
        };
        if packet.track_id != track_id {
            continue;
        }
        let buffer = decoder.decode(&packet).map_err(decode_error)?;
        let spec = buffer.spec();
        let channels = spec.channels().count().max(1);
        if rate == 0 {
            rate = spec.rate();
        } else if rate != spec.rate() {
            return Err(decode_error("the sample rate changes mid-stream"));
        }
        interleaved.resize(buffer.samples_interleaved(), 0.0);
        buffer.copy_to_slice_interleaved(&mut interleaved);
        mono.extend(
            interleaved
                .chunks_exact(channels)
                .map(|frame| frame.iter().sum::<f32>() / channels as f32),
        );
        if rate > 0 && mono.len() as f64 / rate as f64 > max_seconds {
            return Err(MediaError::TooLarge {
                kind: "audio",
                reason: format!("longer than {max_seconds} s"),
            });
        }
    }
    if mono.is_empty() || rate == 0 {
        return Err(MediaError::Empty { kind: "audio" });
    }
    Ok(Waveform { rate, samples: mono })
}

/// Resamples `waveform` to `rate` Hz (a copy when it is already there).
///
/// # Errors
///
/// [`MediaError::Decode`] when the resampler refuses the rates.
pub fn resample(waveform: &Waveform, rate: u32) -> Result<Waveform, MediaError> {
    if waveform.rate == rate {
        return Ok(waveform.clone());
    }
    let mut resampler = Fft::<f32>::new(waveform.rate as usize, rate as usize, 1024, 1, FixedSync::Input)
        .map_err(|err| decode_error(format!("resampling {} Hz to {rate} Hz: {err}", waveform.rate)))?;
    let input_len = waveform.samples.len();
    let input = InterleavedSlice::new(&waveform.samples, 1, input_len).map_err(decode_error)?;
    let needed = resampler.process_all_needed_output_len(input_len);
    let mut output_samples = vec![0.0f32; needed];
    let mut output = InterleavedSlice::new_mut(&mut output_samples, 1, needed).map_err(decode_error)?;
    let (_, produced) = resampler
        .process_all_into_buffer(&input, &mut output, input_len, None)
        .map_err(decode_error)?;
    output_samples.truncate(produced);
    Ok(Waveform {
        rate,
        samples: output_samples,
    })
}
