//! What Switchyard's native engines share: the LLM (`switchyard-llm`) and the encoders
//! (`switchyard-encoders`) read Hugging Face safetensors weights the same way ([`weights`]) and,
//! with the `cuda` feature, load CUDA's libraries and open a device the same way (`cuda`).
//!
//! Each engine keeps its own error type and its own view of a model's tensors; this crate
//! answers with errors of its own that theirs wrap, so a message reads as it did when each
//! engine had its copy.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod weights;
