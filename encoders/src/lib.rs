//! Native encoders: what turns an image, an audio clip or a video into the feature rows an LLM
//! takes in place of its media placeholders.
//!
//! Preprocessing follows the reference libraries step for step, since an encoder fed pixels
//! resized or normalized differently from its training gives different features: [`image`]
//! decodes PNG, JPEG, WebP and GIF (first frame) and resizes, crops, rescales and normalizes as a
//! model's `preprocessor_config.json` says (CLIP and SigLIP processors); [`audio`] decodes WAV,
//! MP3, FLAC and Ogg Vorbis, downmixes and resamples to the model's rate, and [`mel`] computes
//! Whisper's log-mel spectrogram; [`video`] decodes the frames a request picked from an H.264
//! MP4 (OpenH264) and converts them to RGB as FFmpeg does, for the image processor. The models
//! run on the CPU: [`vit`] is the CLIP/SigLIP vision tower with a LLaVA-style projector (video
//! frames go through it and are pooled in time), and [`whisper`] the Whisper audio encoder. Both take a micro-batch of items in one forward: every
//! linear layer runs over all the batch's rows at once, which is where batching pays.
//! Weights load from Hugging Face safetensors ([`tensor`]) or, for Whisper, from a CTranslate2
//! model file ([`ct2`]). Every load error names the file and the key or tensor at fault.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]
#![warn(unreachable_pub)]

use std::path::PathBuf;

pub mod audio;
pub mod ct2;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod image;
pub mod mel;
mod ops;
mod resample;
pub mod tensor;
pub mod video;
pub mod vit;
pub mod whisper;

/// Why a model, a processor config or a weight file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file the model needs is absent or unreadable.
    #[error("{}: {reason}", path.display())]
    Missing {
        /// The file looked for.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A config file is malformed, incomplete or asks for something unsupported.
    #[error("{}: `{key}`: {reason}", path.display())]
    Config {
        /// The config file.
        path: PathBuf,
        /// The key at fault (`(file)` when the file itself does not parse).
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A weight file or tensor does not match the config.
    #[error("{}: tensor `{tensor}`: {reason}", path.display())]
    Weights {
        /// The weight file (or the model directory for a missing tensor).
        path: PathBuf,
        /// The tensor at fault.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl From<switchyard_native::weights::WeightsError> for LoadError {
    fn from(err: switchyard_native::weights::WeightsError) -> LoadError {
        use switchyard_native::weights::WeightsError;
        match err {
            WeightsError::Missing { path, reason } => LoadError::Missing { path, reason },
            WeightsError::Weights { path, tensor, reason } => LoadError::Weights { path, tensor, reason },
        }
    }
}

/// Why a media item could not be turned into model input. These are the client's errors: the
/// bytes passed the gateway's header checks but do not decode, or decode to something the model
/// cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MediaError {
    /// The bytes do not decode as the container they claim to be.
    #[error("the {kind} does not decode: {reason}")]
    Decode {
        /// `image`, `audio` or `video`.
        kind: &'static str,
        /// The decoder's message.
        reason: String,
    },
    /// The item decodes but is larger than the processor allows.
    #[error("the {kind} is too large: {reason}")]
    TooLarge {
        /// `image`, `audio` or `video`.
        kind: &'static str,
        /// Which limit, and the item's size.
        reason: String,
    },
    /// The item holds nothing to encode (no samples, no frames).
    #[error("the {kind} is empty")]
    Empty {
        /// `image`, `audio` or `video`.
        kind: &'static str,
    },
}

/// Why a forward pass was refused (inputs that do not fit the model).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// An input's shape is not what the model takes.
    #[error("input {index}: {reason}")]
    Shape {
        /// The item's index in the batch.
        index: usize,
        /// What does not fit.
        reason: String,
    },
    /// An empty batch.
    #[error("the batch is empty")]
    Empty,
}

/// Reads and parses a JSON config file, naming the file in every error.
pub(crate) fn read_json(path: &std::path::Path) -> Result<serde_json::Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|err| LoadError::Missing {
        path: path.to_path_buf(),
        reason: err.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|err| LoadError::Config {
        path: path.to_path_buf(),
        key: "(file)".into(),
        reason: err.to_string(),
    })
}

/// A typed view of one JSON object in a config file, for errors that name file and key.
#[derive(Debug, Clone)]
pub(crate) struct ConfigObject<'a> {
    path: &'a std::path::Path,
    prefix: String,
    value: &'a serde_json::Value,
}

impl<'a> ConfigObject<'a> {
    pub(crate) fn new(path: &'a std::path::Path, value: &'a serde_json::Value) -> ConfigObject<'a> {
        ConfigObject {
            path,
            prefix: String::new(),
            value,
        }
    }

    pub(crate) fn key_name(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    pub(crate) fn error(&self, key: &str, reason: impl Into<String>) -> LoadError {
        LoadError::Config {
            path: self.path.to_path_buf(),
            key: self.key_name(key),
            reason: reason.into(),
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&'a serde_json::Value> {
        self.value.get(key).filter(|value| !value.is_null())
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize, LoadError> {
        self.usize_or(key, None)
    }

    pub(crate) fn usize_or(&self, key: &str, default: Option<usize>) -> Result<usize, LoadError> {
        match self.get(key) {
            None => default.ok_or_else(|| self.error(key, "missing")),
            Some(value) => value
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.error(key, format!("expected a non-negative integer, found {value}"))),
        }
    }

    pub(crate) fn f64_or(&self, key: &str, default: f64) -> Result<f64, LoadError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => value
                .as_f64()
                .filter(|v| v.is_finite())
                .ok_or_else(|| self.error(key, format!("expected a number, found {value}"))),
        }
    }

    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, LoadError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => value
                .as_bool()
                .ok_or_else(|| self.error(key, format!("expected true or false, found {value}"))),
        }
    }

    pub(crate) fn str_or(&self, key: &str, default: &'a str) -> Result<&'a str, LoadError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => value
                .as_str()
                .ok_or_else(|| self.error(key, format!("expected a string, found {value}"))),
        }
    }

    pub(crate) fn object(&self, key: &str) -> Option<ConfigObject<'a>> {
        self.get(key).filter(|v| v.is_object()).map(|value| ConfigObject {
            path: self.path,
            prefix: self.key_name(key),
            value,
        })
    }
}
