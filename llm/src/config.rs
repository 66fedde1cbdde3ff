//! The model's `config.json`: the Llama/Qwen2-family hyper-parameters the forward pass needs.
//!
//! Both spellings of the rotary settings are read: `rope_theta` + `rope_scaling` (configs
//! written by transformers 4.x, most checkpoints in the wild) and `rope_parameters` (written by
//! transformers 5). Unknown architectures and rotary scalings are refused with the key named,
//! never approximated.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::LoadError;

/// How positions are turned into rotation frequencies.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = theta^(−2i/d)`.
    None,
    /// Positions divided by `factor` (all frequencies scaled alike).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3's frequency-dependent scaling: long wavelengths divided by `factor`, short ones
    /// kept, a smooth blend between.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Wavelengths longer than `original / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was trained at before scaling.
        original_max_position_embeddings: f64,
    },
}

/// The hyper-parameters of a decoder-only Llama/Qwen2-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `model_type`, e.g. `llama` or `qwen2`.
    pub model_type: String,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding and of the LM head).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Whether q/k/v projections have biases (Qwen2 does).
    pub attention_bias: bool,
    /// Whether the LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    rope_parameters: Option<serde_json::Value>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    eos_token_id: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
}

impl ModelConfig {
    /// Reads and checks `config.json` at `path`.
    ///
    /// # Errors
    ///
    /// [`LoadError::Missing`] when the file does not exist, [`LoadError::Config`] naming the
    /// key when it is malformed, missing a required key, inconsistent, or asks for a feature
    /// (architecture, rotary scaling, sliding window, MLP bias) this engine does not implement.
    pub fn from_file(path: &Path) -> Result<ModelConfig, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|err| LoadError::Missing {
            path: path.to_path_buf(),
            reason: err.to_string(),
        })?;
        ModelConfig::parse(&text, path)
    }

    /// Parses `config.json` text; `path` names the file in errors.
    ///
    /// # Errors
    ///
    /// As [`ModelConfig::from_file`].
    pub fn parse(text: &str, path: &Path) -> Result<ModelConfig, LoadError> {
        let bad = |key: &str, reason: String| LoadError::Config {
            path: PathBuf::from(path),
            key: key.to_string(),
            reason,
        };
        let raw: RawConfig = serde_json::from_str(text).map_err(|err| bad("(file)", err.to_string()))?;
        let model_type = raw.model_type.unwrap_or_default();
        if !matches!(model_type.as_str(), "llama" | "qwen2" | "mistral") {
            return Err(bad(
                "model_type",
                format!("`{model_type}` is not a Llama/Qwen2-family decoder this engine implements"),
            ));
        }
        let need = |value: Option<usize>, key: &str| -> Result<usize, LoadError> {
            match value {
                Some(0) => Err(bad(key, "must be positive".into())),
                Some(v) => Ok(v),
                None => Err(bad(key, "is required".into())),
            }
        };
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = need(raw.num_key_value_heads.or(Some(num_heads)), "num_key_value_heads")?;
        if num_heads % num_kv_heads != 0 {
            return Err(bad(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => need(Some(d), "head_dim")?,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(bad(
                    "head_dim",
                    format!("absent, and hidden_size {hidden_size} is not a multiple of {num_heads} heads"),
                ));
            }
        };
        if head_dim % 2 != 0 {
            return Err(bad("head_dim", format!("{head_dim} is odd; RoPE rotates pairs")));
        }
        if raw.mlp_bias == Some(true) {
            return Err(bad("mlp_bias", "MLP biases are not implemented".into()));
        }
        if raw.use_sliding_window == Some(true) {
            return Err(bad(
                "use_sliding_window",
                "sliding-window attention is not implemented".into(),
            ));
        }
        let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        let rope_key = if raw.rope_parameters.is_some() {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        let rope_theta = raw
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(serde_json::Value::as_f64)
            .or(raw.rope_theta)
            .unwrap_or(10_000.0);
        let rope_scaling = parse_rope_scaling(rope, rope_key).map_err(|reason| bad(rope_key, reason))?;
        let eos_token_ids = match &raw.eos_token_id {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|id| id as u32).into_iter().collect(),
            Some(serde_json::Value::Array(ids)) => ids.iter().filter_map(|v| v.as_u64().map(|id| id as u32)).collect(),
            Some(other) => return Err(bad("eos_token_id", format!("expected an id or a list, got {other}"))),
        };
        Ok(ModelConfig {
            attention_bias: raw.attention_bias.unwrap_or(model_type == "qwen2"),
            model_type,
            hidden_size,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            num_layers: need(raw.num_hidden_layers, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            eos_token_ids,
        })
    }

    /// The inverse rotation frequencies of one head, `head_dim / 2` of them, after scaling.
    pub fn inv_freq(&self) -> Vec<f64> {
        let dim = self.head_dim as f64;
        let plain = (0..self.head_dim / 2).map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / dim));
        match self.rope_scaling {
            RopeScaling::None => plain.collect(),
            RopeScaling::Linear { factor } => plain.map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: original,
            } => plain
                .map(|f| {
                    // As transformers' `_compute_llama3_parameters`.
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let low_freq_wavelen = original / low_freq_factor;
                    let high_freq_wavelen = original / high_freq_factor;
                    if wavelen > low_freq_wavelen {
                        f / factor
                    } else if wavelen < high_freq_wavelen {
                        f
                    } else {
                        let smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect(),
        }
    }
}

fn parse_rope_scaling(value: Option<&serde_json::Value>, key: &str) -> Result<RopeScaling, String> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = value
        .get("rope_type")
        .or_else(|| value.get("type"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("default");
    let number = |name: &str| -> Result<f64, String> {
        value
            .get(name)
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| format!("{key}.{name} is required for rope_type `{kind}`"))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: number("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")?,
        }),
        other => Err(format!(
            "rope_type `{other}` is not implemented (default, linear and llama3 are)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig, LoadError> {
        ModelConfig::parse(text, Path::new("m/config.json"))
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100"#;

    #[test]
    fn reads_both_rope_spellings() {
        let old = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_theta": 500000.0,
                "rope_scaling": {{"type": "linear", "factor": 2.0}}}}"#
        ))
        .expect("old spelling");
        assert_eq!(old.rope_theta, 500_000.0);
        assert_eq!(old.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(old.head_dim, 16);
        let new = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "rope_parameters": {{"rope_theta": 1e6, "rope_type": "default"}}}}"#
        ))
        .expect("new spelling");
        assert_eq!(new.rope_theta, 1e6);
        assert_eq!(new.rope_scaling, RopeScaling::None);
        assert!(new.attention_bias, "qwen2 has q/k/v biases by default");
    }

    #[test]
    fn refusals_name_the_key() {
        let cases = [
            (format!(r#"{{"model_type": "gpt2", {BASE}}}"#), "model_type"),
            (
                r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}"#.to_string(),
                "intermediate_size",
            ),
            (
                format!(r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#),
                "rope_scaling",
            ),
            (
                r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 1, "num_hidden_layers": 1,
                    "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 10}"#
                    .to_string(),
                "num_key_value_heads",
            ),
            ("{not json".to_string(), "(file)"),
        ];
        for (text, key) in cases {
            match parse(&text) {
                Err(LoadError::Config { key: named, path, .. }) => {
                    assert_eq!(named, key, "{text}");
                    assert_eq!(path, Path::new("m/config.json"));
                }
                other => panic!("{text}: expected a config error on {key}, got {other:?}"),
            }
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let config = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_parameters": {{"rope_theta": 10000.0, "rope_type": "llama3",
                "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}}}"#
        ))
        .expect("llama3");
        let plain = ModelConfig {
            rope_scaling: RopeScaling::None,
            ..config.clone()
        }
        .inv_freq();
        let scaled = config.inv_freq();
        assert_eq!(scaled[0], plain[0], "the highest frequency is kept");
        let last = plain.len() - 1;
        assert!(
            (scaled[last] - plain[last] / 8.0).abs() < 1e-15,
            "the lowest is divided"
        );
    }
}
