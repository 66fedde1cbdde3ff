//! Whisper's log-mel spectrogram, as transformers' `WhisperFeatureExtractor` computes it.
//!
//! The waveform (mono, at the extractor's rate) is cut or zero-padded to `chunk_length`
//! seconds; a short-time Fourier transform with a periodic Hann window of `n_fft` samples and a
//! hop of `hop_length`, centred (the signal reflect-padded by `n_fft / 2` on each side), gives the
//! power spectrum; a bank of `feature_size` triangular filters on the Slaney mel scale (0 to
//! 8 kHz, Slaney area normalization) maps it to mel bands; then `log10(max(mel, 1e-10))`, the
//! last frame dropped, values clamped to within 8 of the maximum, and `(x + 4) / 4`. Output is
//! `[n_mels, frames]`, row-major; 3,000 frames for 30 s at 16 kHz with a hop of 160.

use std::path::Path;
use std::sync::Arc;

use realfft::RealFftPlanner;
use realfft::num_complex::Complex;

use crate::{ConfigObject, LoadError};

/// A feature extractor's settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct MelConfig {
    /// Mel bands (`feature_size`): 80, or 128 for large-v3.
    pub n_mels: usize,
    /// FFT and window length (`n_fft`).
    pub n_fft: usize,
    /// Samples between frames (`hop_length`).
    pub hop_length: usize,
    /// The rate the waveform must be at (`sampling_rate`).
    pub sampling_rate: u32,
    /// Seconds every input is cut or padded to (`chunk_length`).
    pub chunk_length: usize,
}

impl Default for MelConfig {
    fn default() -> MelConfig {
        MelConfig {
            n_mels: 80,
            n_fft: 400,
            hop_length: 160,
            sampling_rate: 16_000,
            chunk_length: 30,
        }
    }
}

impl MelConfig {
    /// Reads a Whisper `preprocessor_config.json`; missing keys take Whisper's defaults.
    ///
    /// # Errors
    ///
    /// [`LoadError`] naming the file and the key.
    pub fn from_file(path: &Path) -> Result<MelConfig, LoadError> {
        let value = crate::read_json(path)?;
        let config = ConfigObject::new(path, &value);
        let defaults = MelConfig::default();
        let mel = MelConfig {
            n_mels: config.usize_or("feature_size", Some(defaults.n_mels))?,
            n_fft: config.usize_or("n_fft", Some(defaults.n_fft))?,
            hop_length: config.usize_or("hop_length", Some(defaults.hop_length))?,
            sampling_rate: config.usize_or("sampling_rate", Some(defaults.sampling_rate as usize))? as u32,
            chunk_length: config.usize_or("chunk_length", Some(defaults.chunk_length))?,
        };
        for (key, value) in [
            ("feature_size", mel.n_mels),
            ("n_fft", mel.n_fft),
            ("hop_length", mel.hop_length),
            ("sampling_rate", mel.sampling_rate as usize),
            ("chunk_length", mel.chunk_length),
        ] {
            if value == 0 {
                return Err(config.error(key, "must be positive"));
            }
        }
        if mel.n_fft < 4 || mel.n_fft > 1 << 16 {
            return Err(config.error("n_fft", format!("{} is outside 4..=65536", mel.n_fft)));
        }
        if mel.sampling_rate < 16_000 {
            return Err(config.error(
                "sampling_rate",
                "below 16000: the filter bank reaches 8 kHz, past this rate's Nyquist frequency",
            ));
        }
        Ok(mel)
    }

    /// Samples in one input (`chunk_length × sampling_rate`).
    pub fn samples(&self) -> usize {
        self.chunk_length * self.sampling_rate as usize
    }

    /// Frames in one input's spectrogram.
    pub fn frames(&self) -> usize {
        self.samples() / self.hop_length
    }
}

/// A log-mel extractor: the filter bank, window and FFT plan, built once.
#[derive(Clone)]
pub struct LogMel {
    config: MelConfig,
    /// `[n_freq, n_mels]`.
    filters: Vec<f64>,
    window: Vec<f64>,
    fft: Arc<dyn realfft::RealToComplex<f64>>,
}

impl std::fmt::Debug for LogMel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogMel")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl LogMel {
    /// Builds the extractor for `config`.
    pub fn new(config: MelConfig) -> LogMel {
        let n_freq = config.n_fft / 2 + 1;
        let filters = mel_filter_bank(n_freq, config.n_mels, 0.0, 8000.0, config.sampling_rate as f64);
        // A periodic Hann window (numpy's `hanning(n + 1)[:-1]`).
        let window = (0..config.n_fft)
            .map(|n| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / config.n_fft as f64).cos())
            .collect();
        let fft = RealFftPlanner::<f64>::new().plan_fft_forward(config.n_fft);
        LogMel {
            config,
            filters,
            window,
            fft,
        }
    }

    /// The settings.
    pub fn config(&self) -> &MelConfig {
        &self.config
    }

    /// The log-mel spectrogram of `samples` (mono, at the config's rate), `[n_mels, frames]`.
    pub fn compute(&self, samples: &[f32]) -> Vec<f32> {
        let config = &self.config;
        let total = config.samples();
        let mut waveform: Vec<f64> = samples.iter().take(total).map(|&s| s as f64).collect();
        waveform.resize(total, 0.0);
        let half = config.n_fft / 2;
        let padded = reflect_pad(&waveform, half);
        let n_freq = config.n_fft / 2 + 1;
        // One frame more than kept: the extractor drops the last.
        let frames = 1 + (padded.len() - config.n_fft) / config.hop_length;
        let kept = frames - 1;
        let mut power = vec![0.0f64; kept * n_freq];
        let mut buffer = self.fft.make_input_vec();
        let mut spectrum: Vec<Complex<f64>> = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        for frame in 0..kept {
            let start = frame * config.hop_length;
            for (i, slot) in buffer.iter_mut().enumerate() {
                *slot = padded[start + i] * self.window[i];
            }
            // Lengths come from the plan itself, so this cannot fail.
            if self
                .fft
                .process_with_scratch(&mut buffer, &mut spectrum, &mut scratch)
                .is_err()
            {
                unreachable!("buffers sized by the plan");
            }
            for (bin, value) in spectrum.iter().enumerate() {
                // The reference stores the transform as complex64 before squaring.
                let re = value.re as f32 as f64;
                let im = value.im as f32 as f64;
                power[frame * n_freq + bin] = re * re + im * im;
            }
        }
        let n_mels = config.n_mels;
        let mut out = vec![0.0f64; n_mels * kept];
        for frame in 0..kept {
            let row = &power[frame * n_freq..(frame + 1) * n_freq];
            for mel in 0..n_mels {
                let mut sum = 0.0;
                for (bin, p) in row.iter().enumerate() {
                    sum += self.filters[bin * n_mels + mel] * p;
                }
                out[mel * kept + frame] = sum.max(1e-10).log10();
            }
        }
        // The reference casts the log spectrum to f32 before the clamp and scaling.
        let log: Vec<f32> = out.iter().map(|&v| v as f32).collect();
        let max = log.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        log.iter().map(|&v| (v.max(max - 8.0) + 4.0) / 4.0).collect()
    }
}

fn reflect_pad(signal: &[f64], pad: usize) -> Vec<f64> {
    let n = signal.len();
    let mut out = Vec::with_capacity(n + 2 * pad);
    // numpy's "reflect": the edge sample is not repeated. Signals shorter than the pad reflect
    // back and forth.
    let at = |mut i: isize| -> f64 {
        if n == 1 {
            return signal[0];
        }
        let period = 2 * (n as isize - 1);
        i = i.rem_euclid(period);
        if i >= n as isize {
            i = period - i;
        }
        signal[i as usize]
    };
    for i in 0..n + 2 * pad {
        out.push(at(i as isize - pad as isize));
    }
    out
}

fn hertz_to_mel(freq: f64) -> f64 {
    let (min_log_hertz, min_log_mel) = (1000.0, 15.0);
    let logstep = 27.0 / 6.4f64.ln();
    if freq >= min_log_hertz {
        min_log_mel + (freq / min_log_hertz).ln() * logstep
    } else {
        3.0 * freq / 200.0
    }
}

fn mel_to_hertz(mel: f64) -> f64 {
    let (min_log_hertz, min_log_mel) = (1000.0, 15.0);
    let logstep = 6.4f64.ln() / 27.0;
    if mel >= min_log_mel {
        min_log_hertz * (logstep * (mel - min_log_mel)).exp()
    } else {
        200.0 * mel / 3.0
    }
}

/// transformers' `mel_filter_bank(norm="slaney", mel_scale="slaney")`: `[n_freq, n_mels]`.
fn mel_filter_bank(n_freq: usize, n_mels: usize, min_hz: f64, max_hz: f64, sampling_rate: f64) -> Vec<f64> {
    let (mel_min, mel_max) = (hertz_to_mel(min_hz), hertz_to_mel(max_hz));
    let filter_freqs: Vec<f64> = (0..n_mels + 2)
        .map(|i| mel_to_hertz(mel_min + (mel_max - mel_min) * i as f64 / (n_mels + 1) as f64))
        .collect();
    let nyquist = (sampling_rate as u64 / 2) as f64;
    let fft_freqs: Vec<f64> = (0..n_freq).map(|i| nyquist * i as f64 / (n_freq - 1) as f64).collect();
    let mut filters = vec![0.0f64; n_freq * n_mels];
    for (bin, &f) in fft_freqs.iter().enumerate() {
        for mel in 0..n_mels {
            let down = -(filter_freqs[mel] - f) / (filter_freqs[mel + 1] - filter_freqs[mel]);
            let up = (filter_freqs[mel + 2] - f) / (filter_freqs[mel + 2] - filter_freqs[mel + 1]);
            let enorm = 2.0 / (filter_freqs[mel + 2] - filter_freqs[mel]);
            filters[bin * n_mels + mel] = down.min(up).max(0.0) * enorm;
        }
    }
    filters
}
