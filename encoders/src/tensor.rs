//! Weights by name: Hugging Face safetensors files, memory-mapped, widened to f32.
//!
//! [`TensorSource`] is what the models load from; [`Safetensors`] (the native engines' shared
//! reader, `switchyard_native::weights`) reads every `*.safetensors` file of a model directory,
//! and [`crate::ct2::Ct2Model`] a CTranslate2 model file. Every error names the file and the
//! tensor.

use std::path::Path;

pub use switchyard_native::weights::{Float, Safetensors, to_f16_le, widen};

use crate::LoadError;

/// Where a model's tensors come from.
pub trait TensorSource: std::fmt::Debug {
    /// The tensor `name` widened to f32, checked to have `shape`.
    ///
    /// # Errors
    ///
    /// [`LoadError::Weights`] naming the tensor when it is absent, has another shape, or a
    /// dtype that is not a float.
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError>;

    /// Whether a tensor of that name exists.
    fn contains(&self, name: &str) -> bool;

    /// The file (or directory) to name in errors about a tensor that is missing.
    fn origin(&self) -> &Path;
}

impl TensorSource for Safetensors {
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        Ok(Safetensors::f32(self, name, shape)?)
    }

    fn contains(&self, name: &str) -> bool {
        Safetensors::contains(self, name)
    }

    fn origin(&self) -> &Path {
        Safetensors::origin(self)
    }
}

pub(crate) fn weights_error(path: &Path, tensor: &str, reason: String) -> LoadError {
    LoadError::Weights {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    }
}
