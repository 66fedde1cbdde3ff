//! The native encode device: real models from `switchyard-encoders` behind the encoder
//! server, for `switchyard-encoder`.
//!
//! A vision device is a LLaVA-style checkpoint (or a bare CLIP/SigLIP model) with its
//! `preprocessor_config.json`: each image of a pass is decoded and preprocessed as the
//! processor says, and all of them go through the tower (and projector) as one micro-batch.
//! An audio device is a Whisper checkpoint (a Hugging Face directory, or a CTranslate2
//! `model.bin`): each clip is decoded, resampled to 16 kHz and cut into 30 s windows, every
//! window of the pass is one row of the batched forward, and a clip's features are its windows'
//! pooled rows (25 per second of audio) end to end. Features go out as f16 rows of the model's
//! width, with the model's own row count. Bytes that do not decode are the client's error
//! ([`ItemStatus::DecodeError`]). A video (H.264 MP4) has the frames the gateway picked
//! decoded, converted to RGB and preprocessed like images; they join the pass's one forward,
//! and each group of `temporal_pooling` consecutive frames is then averaged into one frame's
//! rows.

use std::path::Path;
use std::time::Instant;

use bytes::Bytes;
use switchyard_encoders::audio;
use switchyard_encoders::image::{ImageProcessor, PixelValues};
use switchyard_encoders::mel::{LogMel, MelConfig};
use switchyard_encoders::tensor::to_f16_le;
use switchyard_encoders::video;
use switchyard_encoders::vit::{Features, VisionEncoder, pool_in_time};
use switchyard_encoders::whisper::WhisperEncoder;
use switchyard_encoders::{LoadError, MediaError};
use switchyard_media::{MediaId, MediaKind};
use switchyard_protocol::Role;
use switchyard_protocol::encode::{EncodeItem, ItemStatus};

use super::{EncodeDevice, Encoded};

/// The longest clip an audio device takes, in seconds (20 windows of 30 s).
pub const MAX_AUDIO_SECONDS: f64 = 600.0;

enum Model {
    Vision {
        encoder: VisionEncoder,
        processor: ImageProcessor,
    },
    Audio {
        encoder: WhisperEncoder,
        mel: LogMel,
    },
}

/// Video frames pooled into one frame's worth of rows unless told otherwise (the gateway's
/// `temporal_pooling` default).
pub const DEFAULT_TEMPORAL_POOLING: usize = 2;

/// Where the forward runs.
enum Backend {
    Cpu,
    #[cfg(feature = "cuda")]
    CudaVision(Box<switchyard_encoders::cuda::vision::CudaVision>),
    #[cfg(feature = "cuda")]
    CudaWhisper(Box<switchyard_encoders::cuda::whisper::CudaWhisper>),
}

/// A loaded model that encodes passes of media items.
pub struct NativeDevice {
    model: Model,
    temporal_pooling: usize,
    backend: Backend,
}

impl std::fmt::Debug for NativeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeDevice")
            .field("role", &self.role())
            .field("feature_dim", &self.feature_dim())
            .finish()
    }
}

impl NativeDevice {
    /// Loads `path`: a CTranslate2 Whisper `model.bin`, or a directory whose `config.json`
    /// says `whisper` (audio) or a vision model (`llava`, `clip`, `siglip`, …; its
    /// `preprocessor_config.json` is required).
    ///
    /// # Errors
    ///
    /// A [`LoadError`] naming the file and the key or tensor.
    pub fn load(path: &Path) -> Result<NativeDevice, LoadError> {
        if path.is_file() {
            let encoder = WhisperEncoder::load_ct2(path)?;
            let mel = LogMel::new(MelConfig {
                n_mels: encoder.config().n_mels,
                ..MelConfig::default()
            });
            return Ok(NativeDevice {
                model: Model::Audio { encoder, mel },
                temporal_pooling: DEFAULT_TEMPORAL_POOLING,
                backend: Backend::Cpu,
            });
        }
        let config_path = path.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|err| LoadError::Missing {
            path: config_path.clone(),
            reason: err.to_string(),
        })?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|err| LoadError::Config {
            path: config_path.clone(),
            key: "(file)".into(),
            reason: err.to_string(),
        })?;
        let processor_path = path.join("preprocessor_config.json");
        if value.get("model_type").and_then(|v| v.as_str()) == Some("whisper") {
            let encoder = WhisperEncoder::load(path)?;
            let mel_config = if processor_path.is_file() {
                MelConfig::from_file(&processor_path)?
            } else {
                MelConfig {
                    n_mels: encoder.config().n_mels,
                    ..MelConfig::default()
                }
            };
            if mel_config.n_mels != encoder.config().n_mels {
                return Err(LoadError::Config {
                    path: processor_path,
                    key: "feature_size".into(),
                    reason: format!(
                        "{} mel bins, the encoder takes {}",
                        mel_config.n_mels,
                        encoder.config().n_mels
                    ),
                });
            }
            if mel_config.frames() != encoder.config().input_frames() {
                return Err(LoadError::Config {
                    path: processor_path,
                    key: "chunk_length".into(),
                    reason: format!(
                        "{} frames per window, the encoder takes {}",
                        mel_config.frames(),
                        encoder.config().input_frames()
                    ),
                });
            }
            return Ok(NativeDevice {
                model: Model::Audio {
                    encoder,
                    mel: LogMel::new(mel_config),
                },
                temporal_pooling: DEFAULT_TEMPORAL_POOLING,
                backend: Backend::Cpu,
            });
        }
        let encoder = VisionEncoder::load(path)?;
        let processor = ImageProcessor::from_file(&processor_path)?;
        Ok(NativeDevice {
            model: Model::Vision { encoder, processor },
            temporal_pooling: DEFAULT_TEMPORAL_POOLING,
            backend: Backend::Cpu,
        })
    }

    /// Moves the forward to GPU `ordinal` (the weights stay on the host too, for sizes and
    /// preprocessing), with CUDA graphs at power-of-two token budgets up to `max_budget`.
    ///
    /// # Errors
    ///
    /// A [`switchyard_encoders::cuda::CudaError`] saying what is missing (driver, NVRTC,
    /// cuBLAS, the device) or what failed.
    #[cfg(feature = "cuda")]
    pub fn on_cuda(
        mut self,
        ordinal: usize,
        max_budget: usize,
    ) -> Result<NativeDevice, switchyard_encoders::cuda::CudaError> {
        use switchyard_encoders::cuda::{vision::CudaVision, whisper::CudaWhisper};
        self.backend = match &self.model {
            Model::Vision { encoder, .. } => {
                Backend::CudaVision(Box::new(CudaVision::new(encoder, ordinal, max_budget)?))
            }
            Model::Audio { encoder, .. } => {
                Backend::CudaWhisper(Box::new(CudaWhisper::new(encoder, ordinal, max_budget)?))
            }
        };
        Ok(self)
    }

    /// The vision forward on this device's backend.
    fn vision_forward(&self, encoder: &VisionEncoder, batch: &[&PixelValues]) -> Result<Features, String> {
        match &self.backend {
            #[cfg(feature = "cuda")]
            Backend::CudaVision(gpu) => gpu.encode(batch).map_err(|err| err.to_string()),
            _ => encoder.encode(batch).map_err(|err| err.to_string()),
        }
    }

    /// The audio forward (pooled features per window) on this device's backend.
    fn audio_forward(
        &self,
        encoder: &WhisperEncoder,
        mels: &[&[f32]],
        seconds: &[f64],
    ) -> Result<Vec<Vec<f32>>, String> {
        match &self.backend {
            #[cfg(feature = "cuda")]
            Backend::CudaWhisper(gpu) => gpu.audio_features(mels, seconds).map_err(|err| err.to_string()),
            _ => encoder.audio_features(mels, seconds).map_err(|err| err.to_string()),
        }
    }

    /// Sets how many consecutive video frames pool into one frame's worth of rows; it must be
    /// the gateway's `temporal_pooling` for the model, whose token count assumes it (0 counts
    /// as 1).
    pub fn with_temporal_pooling(mut self, frames: usize) -> NativeDevice {
        self.temporal_pooling = frames.max(1);
        self
    }

    /// `vision` or `audio`.
    pub fn role(&self) -> Role {
        match self.model {
            Model::Vision { .. } => Role::Vision,
            Model::Audio { .. } => Role::Audio,
        }
    }

    /// Rows one image of `height × width` pixels becomes (after preprocessing), for a vision
    /// device.
    pub fn tokens_per_image(&self, height: u32, width: u32) -> Option<usize> {
        match &self.model {
            Model::Vision { encoder, processor } => {
                let (h, w) = processor.output_size(height, width);
                Some(encoder.tokens_per_image(h as usize, w as usize))
            }
            Model::Audio { .. } => None,
        }
    }
}

fn bytes_of(item: &EncodeItem) -> Result<Vec<u8>, (ItemStatus, String)> {
    let data = item
        .data
        .as_deref()
        .ok_or_else(|| (ItemStatus::NotCached, "no bytes for the item".to_string()))?;
    let bytes = switchyard_media::decode_base64(data).map_err(|err| (ItemStatus::DecodeError, err.to_string()))?;
    let id = MediaId::of(&bytes);
    if id != item.media_id {
        return Err((
            ItemStatus::DecodeError,
            format!("the bytes hash to {id}, not {}", item.media_id),
        ));
    }
    Ok(bytes)
}

/// Bytes that pass the gateway's header checks but do not decode (or decode to more than the
/// device takes) are the client's error.
fn media_error(err: MediaError) -> (ItemStatus, String) {
    (ItemStatus::DecodeError, err.to_string())
}

impl NativeDevice {
    /// A video item's frames, decoded, converted and preprocessed: every frame the gateway
    /// picked, in its order.
    fn video_frames(
        processor: &ImageProcessor,
        bytes: &[u8],
        frames: &[u32],
    ) -> Result<Vec<PixelValues>, (ItemStatus, String)> {
        if frames.is_empty() {
            return Err((
                ItemStatus::Failed,
                "the video item names no frames to encode".to_string(),
            ));
        }
        let decoded = video::decode_frames(bytes, frames, processor.max_pixels).map_err(media_error)?;
        let mut out: Vec<PixelValues> = Vec::with_capacity(decoded.len());
        for (frame, yuv) in frames.iter().zip(&decoded) {
            let values = processor.preprocess_rgb(&yuv.to_rgb()).map_err(media_error)?;
            if let Some(first) = out.first()
                && (first.height, first.width) != (values.height, values.width)
            {
                return Err((
                    ItemStatus::DecodeError,
                    format!(
                        "the video changes size: frame {frame} preprocesses to {}x{}, the first frame to {}x{}",
                        values.width, values.height, first.width, first.height
                    ),
                ));
            }
            out.push(values);
        }
        Ok(out)
    }

    /// One forward over every image and every picked video frame of the pass; a video's
    /// frames are then pooled in time.
    fn encode_vision(&self, encoder: &VisionEncoder, processor: &ImageProcessor, items: &[EncodeItem]) -> Vec<Encoded> {
        let started = Instant::now();
        let mut results: Vec<Option<Encoded>> = vec![None; items.len()];
        // (item, pixel values): one entry per image, one per video frame.
        let mut pixels: Vec<(usize, PixelValues)> = Vec::new();
        for (index, item) in items.iter().enumerate() {
            let prepared = match item.kind {
                MediaKind::Image => bytes_of(item)
                    .and_then(|bytes| processor.preprocess(&bytes).map_err(media_error))
                    .map(|values| vec![values]),
                MediaKind::Video => {
                    bytes_of(item).and_then(|bytes| Self::video_frames(processor, &bytes, &item.frames))
                }
                MediaKind::Audio => Err((ItemStatus::Failed, "a vision encoder does not encode audio".to_string())),
            };
            match prepared {
                Ok(values) => pixels.extend(values.into_iter().map(|v| (index, v))),
                Err(err) => results[index] = Some(Err(err)),
            }
        }
        if !pixels.is_empty() {
            let batch: Vec<&PixelValues> = pixels.iter().map(|(_, p)| p).collect();
            match self.vision_forward(encoder, &batch) {
                Ok(features) => {
                    let share = started.elapsed().as_secs_f64() * 1e3 / pixels.len() as f64;
                    let mut per_item: Vec<Vec<&[f32]>> = vec![Vec::new(); items.len()];
                    for (k, (index, _)) in pixels.iter().enumerate() {
                        per_item[*index].push(features.item(k));
                    }
                    for (index, frames) in per_item.iter().enumerate() {
                        if frames.is_empty() {
                            continue;
                        }
                        let rows = if items[index].kind == MediaKind::Video {
                            pool_in_time(frames, self.temporal_pooling)
                        } else {
                            frames[0].to_vec()
                        };
                        let count = (rows.len() / features.dim) as u32;
                        let ms = share * frames.len() as f64;
                        results[index] = Some(Ok((Bytes::from(to_f16_le(&rows)), count, ms)));
                    }
                }
                Err(err) => {
                    for (index, _) in &pixels {
                        results[*index] = Some(Err((ItemStatus::Failed, err.to_string())));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err((ItemStatus::Failed, "not processed".into()))))
            .collect()
    }

    fn encode_audio(&self, encoder: &WhisperEncoder, mel: &LogMel, items: &[EncodeItem]) -> Vec<Encoded> {
        let started = Instant::now();
        let rate = mel.config().sampling_rate;
        let window = mel.config().samples();
        let mut results: Vec<Option<Encoded>> = vec![None; items.len()];
        // Per item: its windows' (mel, seconds).
        let mut windows: Vec<(usize, Vec<f32>, f64)> = Vec::new();
        for (index, item) in items.iter().enumerate() {
            if item.kind != MediaKind::Audio {
                results[index] = Some(Err((
                    ItemStatus::Failed,
                    format!("an audio encoder does not encode {}", item.kind),
                )));
                continue;
            }
            let decoded = bytes_of(item)
                .and_then(|bytes| audio::decode(&bytes, MAX_AUDIO_SECONDS).map_err(media_error))
                .and_then(|waveform| audio::resample(&waveform, rate).map_err(media_error));
            match decoded {
                Ok(waveform) => {
                    for chunk in waveform.samples.chunks(window) {
                        windows.push((index, mel.compute(chunk), chunk.len() as f64 / rate as f64));
                    }
                }
                Err(err) => results[index] = Some(Err(err)),
            }
        }
        if !windows.is_empty() {
            let mels: Vec<&[f32]> = windows.iter().map(|(_, m, _)| m.as_slice()).collect();
            let seconds: Vec<f64> = windows.iter().map(|(_, _, s)| *s).collect();
            match self.audio_forward(encoder, &mels, &seconds) {
                Ok(features) => {
                    let share = started.elapsed().as_secs_f64() * 1e3 / windows.len() as f64;
                    let dim = encoder.config().d_model;
                    let mut per_item: Vec<(Vec<f32>, f64)> = vec![(Vec::new(), 0.0); items.len()];
                    for ((index, _, _), rows) in windows.iter().zip(features) {
                        per_item[*index].0.extend_from_slice(&rows);
                        per_item[*index].1 += share;
                    }
                    for (index, (rows, ms)) in per_item.into_iter().enumerate() {
                        if results[index].is_none() && !rows.is_empty() {
                            let count = (rows.len() / dim) as u32;
                            results[index] = Some(Ok((Bytes::from(to_f16_le(&rows)), count, ms)));
                        }
                    }
                }
                Err(err) => {
                    for (index, _, _) in &windows {
                        results[*index] = Some(Err((ItemStatus::Failed, err.to_string())));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err((ItemStatus::Failed, "not processed".into()))))
            .collect()
    }
}

impl EncodeDevice for NativeDevice {
    fn encode(&self, items: &[EncodeItem]) -> Vec<Encoded> {
        match &self.model {
            Model::Vision { encoder, processor } => self.encode_vision(encoder, processor, items),
            Model::Audio { encoder, mel } => self.encode_audio(encoder, mel, items),
        }
    }

    fn feature_dim(&self) -> usize {
        match &self.model {
            Model::Vision { encoder, .. } => encoder.feature_dim(),
            Model::Audio { encoder, .. } => encoder.config().d_model,
        }
    }

    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        match &self.backend {
            Backend::Cpu => Vec::new(),
            #[cfg(feature = "cuda")]
            Backend::CudaVision(gpu) => graph_counters(gpu.counters()),
            #[cfg(feature = "cuda")]
            Backend::CudaWhisper(gpu) => graph_counters(gpu.counters()),
        }
    }
}

/// A GPU backend's graph cache counters, as `/metrics` counters.
#[cfg(feature = "cuda")]
fn graph_counters(graphs: &switchyard_encoders::cuda::GraphCounters) -> Vec<(&'static str, &'static str, u64)> {
    use std::sync::atomic::Ordering::Relaxed;
    vec![
        (
            "cuda_graph_replays",
            "Forward passes answered by a CUDA graph replay (a budget held the micro-batch)",
            graphs.replays.load(Relaxed),
        ),
        (
            "cuda_eager_passes",
            "Forward passes run eagerly on the GPU (above every budget, or no graph)",
            graphs.eager.load(Relaxed),
        ),
        (
            "cuda_graph_captures",
            "CUDA graphs captured (one per image size and budget)",
            graphs.captures.load(Relaxed),
        ),
    ]
}
