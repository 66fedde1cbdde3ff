//! The native LLM: a Llama/Qwen2-family decoder loaded from a Hugging Face directory.
//!
//! This crate owns loading ([`config`]: `config.json`; [`weights`]: memory-mapped
//! `*.safetensors`; `tokenizer.json` through [`switchyard_tokenize`]; or one GGUF file, [`gguf`]) and the CPU forward pass
//! ([`model`], with GGUF's quantized matrices kept as stored and multiplied by [`quant`]): a batched step over chunks of several sequences whose keys and values live in a
//! paged cache ([`PagedKv`], block tables in [`SequenceKv`]), so chunked prefill, decoding and
//! shared (cached) prefix blocks all take the same path. [`engine`] puts the model behind the
//! shared scheduler of [`switchyard_workers::engine`] (continuous batching, prefix caching with LRU
//! eviction, preemption, sampling), whose blocks move between workers for prefill/decode
//! disaggregation as payloads of [`kv::transfer`]'s format. Every load error names the file and,
//! where there is one, the key or tensor.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]
#![warn(unreachable_pub)]

use std::path::PathBuf;

pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod quant;
pub mod weights;

pub use config::{ModelConfig, RopeScaling};
pub use engine::{CpuExecutor, kv_block_bytes, spawn_cpu_engine, spawn_cpu_engine_with};
pub use kv::transfer::{KvBlockShape, KvPayloadError};
pub use kv::{KvPrecision, PagedKv, SequenceKv};
pub use model::{Chunk, ForwardError, Logits, Matrix, MediaRows, Model};
pub use switchyard_workers::engine::sampling::{FinishReason, Sampler, SamplingError, SamplingParams};

/// Why a model directory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file the model needs is absent or unreadable.
    #[error("{}: {reason}", path.display())]
    Missing {
        /// The file (or pattern) looked for.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// `config.json` is malformed, incomplete, inconsistent or asks for something unsupported.
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
    /// `tokenizer.json` does not load.
    #[error("{}: {reason}", path.display())]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What went wrong.
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
