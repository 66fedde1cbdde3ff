//! Where the model's tensors come from: its `*.safetensors` files ([`Weights`], read by the
//! native engines' shared reader, `switchyard_native::weights`), a GGUF file
//! ([`crate::gguf`]), or a vision-language checkpoint's language model under another prefix
//! ([`Renamed`]). Missing tensors, wrong shapes and other dtypes are errors that name the
//! tensor and the file.

pub use switchyard_native::weights::{Float, Safetensors as Weights, widen};

use super::LoadError;
use super::model::Matrix;

/// Where a model's tensors come from, by their Hugging Face names.
pub trait TensorSource {
    /// Whether a tensor of that name exists.
    fn contains(&self, name: &str) -> bool;

    /// The tensor `name` widened to f32, checked to have `shape` (row-major, as in PyTorch).
    ///
    /// # Errors
    ///
    /// [`LoadError::Weights`] naming the tensor when it is absent, has another shape, or is
    /// stored in a type the source cannot widen.
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError>;

    /// The matrix `name` of `shape` (`[rows, cols]`) as the model keeps it: quantized blocks
    /// where the source stores them, else f32.
    ///
    /// # Errors
    ///
    /// As [`TensorSource::f32`].
    fn matrix(&self, name: &str, shape: &[usize]) -> Result<Matrix, LoadError> {
        self.f32(name, shape).map(Matrix::F32)
    }
}

impl TensorSource for Weights {
    fn contains(&self, name: &str) -> bool {
        Weights::contains(self, name)
    }

    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        Ok(Weights::f32(self, name, shape)?)
    }
}

/// A checkpoint whose decoder lives under another prefix: a vision-language model's language
/// model (`language_model.model.…` and `language_model.lm_head.weight` in LLaVA checkpoints,
/// `model.language_model.…` and `lm_head.weight` as transformers 5 saves them), read by the
/// decoder's own names (`model.…`, `lm_head.weight`).
#[derive(Debug)]
pub struct Renamed<'a, S: TensorSource> {
    inner: &'a S,
    body: String,
    head: String,
}

impl<'a, S: TensorSource> Renamed<'a, S> {
    /// The language model of a LLaVA-style checkpoint, whichever of the two layouts it uses.
    pub fn language_model(inner: &'a S) -> Renamed<'a, S> {
        if inner.contains("model.language_model.embed_tokens.weight") {
            Renamed {
                inner,
                body: "model.language_model.".into(),
                head: "lm_head.weight".into(),
            }
        } else {
            Renamed {
                inner,
                body: "language_model.model.".into(),
                head: "language_model.lm_head.weight".into(),
            }
        }
    }

    fn rename(&self, name: &str) -> String {
        if name == "lm_head.weight" {
            self.head.clone()
        } else if let Some(rest) = name.strip_prefix("model.") {
            format!("{}{rest}", self.body)
        } else {
            name.to_string()
        }
    }
}

impl<S: TensorSource> TensorSource for Renamed<'_, S> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(&self.rename(name))
    }

    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        self.inner.f32(&self.rename(name), shape)
    }

    fn matrix(&self, name: &str, shape: &[usize]) -> Result<Matrix, LoadError> {
        self.inner.matrix(&self.rename(name), shape)
    }
}
