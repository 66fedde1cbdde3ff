//! The Whisper audio encoder, as transformers' `WhisperEncoder`: two convolutions over the
//! log-mel spectrogram (kernel 3, padding 1; the second with stride 2, halving the frames),
//! each followed by GELU, the sinusoidal position table added, pre-LN blocks (LayerNorm →
//! attention with a bias-free key projection → residual, LayerNorm → GELU MLP → residual) and a
//! final LayerNorm. 30 s of audio (3,000 mel frames) gives 1,500 rows of `d_model`.
//!
//! Weights come from a Hugging Face directory (`config.json` + safetensors, `model.encoder.…`
//! or `encoder.…`) or from a CTranslate2 `model.bin` (faster-whisper's form: fused QKV, the
//! config read from the tensors' shapes). Item for item, [`WhisperEncoder::audio_features`]
//! pools rows in pairs (25 per second of audio, what the gateway's token estimate assumes) and
//! keeps only the rows the clip's own length covers, not its padding.

use std::path::Path;

use crate::ct2::Ct2Model;
use crate::ops::{Activation, LayerNorm, Linear, Mlp, PreNormBlock, SelfAttention, Strided, gemm};
use crate::tensor::{Safetensors, TensorSource};
use crate::{ConfigObject, EncodeError, LoadError};

/// The encoder's hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct WhisperConfig {
    /// `d_model`.
    pub d_model: usize,
    /// `encoder_layers`.
    pub layers: usize,
    /// `encoder_attention_heads`.
    pub heads: usize,
    /// `encoder_ffn_dim`.
    pub ffn_dim: usize,
    /// `num_mel_bins`.
    pub n_mels: usize,
    /// `max_source_positions`: rows out (1,500), from twice as many mel frames in.
    pub max_source_positions: usize,
}

impl WhisperConfig {
    /// Mel frames one input must have.
    pub fn input_frames(&self) -> usize {
        self.max_source_positions * 2
    }
}

/// A loaded Whisper encoder.
#[derive(Debug)]
pub struct WhisperEncoder {
    config: WhisperConfig,
    /// `[d, n_mels·3]` and `[d, d·3]`: kernels flattened in (input channel, tap) order.
    pub(crate) conv1: (Vec<f32>, Vec<f32>),
    pub(crate) conv2: (Vec<f32>, Vec<f32>),
    pub(crate) positions: Vec<f32>,
    pub(crate) blocks: Vec<PreNormBlock>,
    pub(crate) norm: LayerNorm,
}

const EPS: f32 = 1e-5;

impl WhisperEncoder {
    /// Loads a Hugging Face Whisper directory (`config.json`, `*.safetensors`).
    ///
    /// # Errors
    ///
    /// [`LoadError`] naming the file and the key or tensor.
    pub fn load(dir: &Path) -> Result<WhisperEncoder, LoadError> {
        let config_path = dir.join("config.json");
        let value = crate::read_json(&config_path)?;
        let json = ConfigObject::new(&config_path, &value);
        let model_type = json.str_or("model_type", "")?;
        if model_type != "whisper" {
            return Err(json.error("model_type", format!("`{model_type}` is not `whisper`")));
        }
        let act = json.str_or("activation_function", "gelu")?;
        if act != "gelu" {
            return Err(json.error("activation_function", format!("`{act}` (only `gelu` is supported)")));
        }
        let config = WhisperConfig {
            d_model: json.usize("d_model")?,
            layers: json.usize("encoder_layers")?,
            heads: json.usize("encoder_attention_heads")?,
            ffn_dim: json.usize("encoder_ffn_dim")?,
            n_mels: json.usize_or("num_mel_bins", Some(80))?,
            max_source_positions: json.usize_or("max_source_positions", Some(1500))?,
        };
        for (key, value) in [
            ("d_model", config.d_model),
            ("encoder_layers", config.layers),
            ("encoder_attention_heads", config.heads),
            ("encoder_ffn_dim", config.ffn_dim),
            ("num_mel_bins", config.n_mels),
            ("max_source_positions", config.max_source_positions),
        ] {
            if value == 0 {
                return Err(json.error(key, "must be positive"));
            }
        }
        if !config.d_model.is_multiple_of(config.heads) {
            return Err(json.error("encoder_attention_heads", "does not divide d_model"));
        }
        let weights = Safetensors::open(dir)?;
        let prefix = if weights.contains("model.encoder.conv1.weight") {
            "model.encoder"
        } else {
            "encoder"
        };
        let p = |rest: &str| format!("{prefix}.{rest}");
        let d = config.d_model;
        let blocks = (0..config.layers)
            .map(|i| {
                let l = |rest: &str| p(&format!("layers.{i}.{rest}"));
                Ok(PreNormBlock {
                    norm1: LayerNorm::load(&weights, &l("self_attn_layer_norm"), d, EPS)?,
                    attention: SelfAttention {
                        q: Linear::load(&weights, &l("self_attn.q_proj"), d, d, true)?,
                        k: Linear::load(&weights, &l("self_attn.k_proj"), d, d, false)?,
                        v: Linear::load(&weights, &l("self_attn.v_proj"), d, d, true)?,
                        out: Linear::load(&weights, &l("self_attn.out_proj"), d, d, true)?,
                        heads: config.heads,
                    },
                    norm2: LayerNorm::load(&weights, &l("final_layer_norm"), d, EPS)?,
                    mlp: Mlp {
                        fc1: Linear::load(&weights, &l("fc1"), config.ffn_dim, d, true)?,
                        fc2: Linear::load(&weights, &l("fc2"), d, config.ffn_dim, true)?,
                        act: Activation::Gelu,
                    },
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        Ok(WhisperEncoder {
            conv1: (
                weights.f32(&p("conv1.weight"), &[d, config.n_mels, 3])?,
                weights.f32(&p("conv1.bias"), &[d])?,
            ),
            conv2: (
                weights.f32(&p("conv2.weight"), &[d, d, 3])?,
                weights.f32(&p("conv2.bias"), &[d])?,
            ),
            positions: weights.f32(&p("embed_positions.weight"), &[config.max_source_positions, d])?,
            norm: LayerNorm::load(&weights, &p("layer_norm"), d, EPS)?,
            blocks,
            config,
        })
    }

    /// Loads the encoder half of a CTranslate2 Whisper model (`model.bin`); the
    /// hyperparameters come from the tensors' shapes and `encoder/num_heads`.
    ///
    /// # Errors
    ///
    /// [`LoadError`] naming the file and the variable.
    pub fn load_ct2(path: &Path) -> Result<WhisperEncoder, LoadError> {
        let model = Ct2Model::open(path)?;
        let weights_error = |tensor: &str, reason: &str| LoadError::Weights {
            path: path.to_path_buf(),
            tensor: tensor.into(),
            reason: reason.into(),
        };
        if !model.spec().starts_with("WhisperSpec") {
            return Err(weights_error(
                "(spec)",
                &format!("`{}` is not a Whisper model", model.spec()),
            ));
        }
        let conv1 = model
            .shape("encoder/conv1/weight")
            .ok_or_else(|| weights_error("encoder/conv1/weight", "missing"))?;
        let &[d, n_mels, 3] = conv1 else {
            return Err(weights_error("encoder/conv1/weight", "not [d_model, n_mels, 3]"));
        };
        let max_source_positions = model
            .shape("encoder/position_encodings/encodings")
            .and_then(|shape| shape.first().copied())
            .ok_or_else(|| weights_error("encoder/position_encodings/encodings", "missing"))?;
        let heads = model
            .scalar("encoder/num_heads")
            .and_then(|h| usize::try_from(h).ok())
            .filter(|&h| h > 0 && d.is_multiple_of(h))
            .ok_or_else(|| weights_error("encoder/num_heads", "missing, or does not divide d_model"))?;
        let layers = (0..)
            .take_while(|i| model.contains(&format!("encoder/layer_{i}/ffn/linear_0/weight")))
            .count();
        let ffn_dim = model
            .shape("encoder/layer_0/ffn/linear_0/weight")
            .and_then(|shape| shape.first().copied())
            .ok_or_else(|| weights_error("encoder/layer_0/ffn/linear_0/weight", "missing"))?;
        let config = WhisperConfig {
            d_model: d,
            layers,
            heads,
            ffn_dim,
            n_mels,
            max_source_positions,
        };
        let norm = |prefix: &str| -> Result<LayerNorm, LoadError> {
            Ok(LayerNorm::from_parts(
                model.f32(&format!("{prefix}/gamma"), &[d])?,
                model.f32(&format!("{prefix}/beta"), &[d])?,
                EPS,
            ))
        };
        let linear = |prefix: &str, output: usize, input: usize| -> Result<Linear, LoadError> {
            Ok(Linear::from_parts(
                model.f32(&format!("{prefix}/weight"), &[output, input])?,
                Some(model.f32(&format!("{prefix}/bias"), &[output])?),
                output,
                input,
            ))
        };
        let blocks = (0..layers)
            .map(|i| {
                let l = format!("encoder/layer_{i}");
                let qkv_w = model.f32(&format!("{l}/self_attention/linear_0/weight"), &[3 * d, d])?;
                let qkv_b = model.f32(&format!("{l}/self_attention/linear_0/bias"), &[3 * d])?;
                let part = |k: usize| {
                    Linear::from_parts(
                        qkv_w[k * d * d..(k + 1) * d * d].to_vec(),
                        Some(qkv_b[k * d..(k + 1) * d].to_vec()),
                        d,
                        d,
                    )
                };
                Ok(PreNormBlock {
                    norm1: norm(&format!("{l}/self_attention/layer_norm"))?,
                    attention: SelfAttention {
                        q: part(0),
                        k: part(1),
                        v: part(2),
                        out: linear(&format!("{l}/self_attention/linear_1"), d, d)?,
                        heads,
                    },
                    norm2: norm(&format!("{l}/ffn/layer_norm"))?,
                    mlp: Mlp {
                        fc1: linear(&format!("{l}/ffn/linear_0"), ffn_dim, d)?,
                        fc2: linear(&format!("{l}/ffn/linear_1"), d, ffn_dim)?,
                        act: Activation::Gelu,
                    },
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        Ok(WhisperEncoder {
            conv1: (
                model.f32("encoder/conv1/weight", &[d, n_mels, 3])?,
                model.f32("encoder/conv1/bias", &[d])?,
            ),
            conv2: (
                model.f32("encoder/conv2/weight", &[d, d, 3])?,
                model.f32("encoder/conv2/bias", &[d])?,
            ),
            positions: model.f32("encoder/position_encodings/encodings", &[max_source_positions, d])?,
            norm: norm("encoder/layer_norm")?,
            blocks,
            config,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &WhisperConfig {
        &self.config
    }

    /// `last_hidden_state` for a batch of log-mel spectrograms (each `[n_mels, frames]`,
    /// exactly [`WhisperConfig::input_frames`] frames): `[batch, max_source_positions, d]`.
    ///
    /// # Errors
    ///
    /// [`EncodeError`] for an empty batch or a spectrogram of the wrong size.
    pub fn forward(&self, mels: &[&[f32]]) -> Result<Vec<f32>, EncodeError> {
        if mels.is_empty() {
            return Err(EncodeError::Empty);
        }
        let c = &self.config;
        let frames = c.input_frames();
        for (index, mel) in mels.iter().enumerate() {
            if mel.len() != c.n_mels * frames {
                return Err(EncodeError::Shape {
                    index,
                    reason: format!(
                        "{} values, the encoder takes {} mel bins × {frames} frames",
                        mel.len(),
                        c.n_mels
                    ),
                });
            }
        }
        let d = c.d_model;
        let len = c.max_source_positions;
        let mut x = Vec::with_capacity(mels.len() * len * d);
        for mel in mels {
            // Time-major [frames, n_mels] in, as the convolutions read it.
            let mut input = vec![0.0f32; frames * c.n_mels];
            for bin in 0..c.n_mels {
                for t in 0..frames {
                    input[t * c.n_mels + bin] = mel[bin * frames + t];
                }
            }
            let mut h = conv1d(&input, frames, c.n_mels, &self.conv1, d, 1);
            Activation::Gelu.apply(&mut h);
            let mut h = conv1d(&h, frames, d, &self.conv2, d, 2);
            Activation::Gelu.apply(&mut h);
            crate::ops::add(&mut h, &self.positions);
            x.extend_from_slice(&h);
        }
        for block in &self.blocks {
            block.forward(&mut x, mels.len(), len);
        }
        Ok(self.norm.forward(&x))
    }

    /// Features for a batch of clips: the encoder's rows averaged in pairs (25 per second)
    /// and cut to each clip's length (`ceil(seconds × 25)` rows, at least one).
    ///
    /// # Errors
    ///
    /// As [`WhisperEncoder::forward`].
    pub fn audio_features(&self, mels: &[&[f32]], seconds: &[f64]) -> Result<Vec<Vec<f32>>, EncodeError> {
        let hidden = self.forward(mels)?;
        Ok(pool_pairs(
            &hidden,
            self.config.max_source_positions,
            self.config.d_model,
            seconds,
        ))
    }
}

/// Whisper's features from its `last_hidden_state` (`[windows, len, d]`): rows averaged in
/// pairs (25 per second) and cut to each window's length (`ceil(seconds × 25)` rows, at least
/// one).
pub(crate) fn pool_pairs(hidden: &[f32], len: usize, d: usize, seconds: &[f64]) -> Vec<Vec<f32>> {
    let pooled_len = len / 2;
    let rows_per_second = pooled_len as f64 / 30.0;
    hidden
        .chunks_exact(len * d)
        .zip(seconds)
        .map(|(rows, &secs)| {
            let keep = ((secs * rows_per_second).ceil() as usize).clamp(1, pooled_len);
            let mut out = Vec::with_capacity(keep * d);
            for pair in rows.chunks_exact(2 * d).take(keep) {
                out.extend(pair[..d].iter().zip(&pair[d..]).map(|(a, b)| (a + b) / 2.0));
            }
            out
        })
        .collect()
}

/// A 1-D convolution, kernel 3, padding 1, over time-major input `[frames, channels]`;
/// output `[frames / stride, out]` time-major.
fn conv1d(
    input: &[f32],
    frames: usize,
    channels: usize,
    (weight, bias): &(Vec<f32>, Vec<f32>),
    out: usize,
    stride: usize,
) -> Vec<f32> {
    let out_frames = (frames + 2 - 3) / stride + 1;
    // im2col: row t holds input[t·stride + k − 1, c] at column c·3 + k (zero outside).
    let width = channels * 3;
    let mut columns = vec![0.0f32; out_frames * width];
    for t in 0..out_frames {
        let row = &mut columns[t * width..(t + 1) * width];
        for k in 0..3 {
            let source = (t * stride + k) as isize - 1;
            if source < 0 || source >= frames as isize {
                continue;
            }
            let from = &input[source as usize * channels..(source as usize + 1) * channels];
            for (c, &value) in from.iter().enumerate() {
                row[c * 3 + k] = value;
            }
        }
    }
    let mut y = vec![0.0f32; out_frames * out];
    gemm(
        out_frames,
        width,
        out,
        Strided::new(&columns, width, 1),
        Strided::new(weight, 1, width),
        &mut y,
        out,
    );
    for row in y.chunks_exact_mut(out) {
        crate::ops::add(row, bias);
    }
    y
}
