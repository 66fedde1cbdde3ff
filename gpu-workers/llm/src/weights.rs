//! The model's `*.safetensors` files, memory-mapped, read tensor by tensor as f32.
//!
//! Every `.safetensors` file in the model directory is mapped (one file or a sharded set); a
//! tensor is found by name in whichever file holds it and widened to f32 from f32, f16 or bf16.
//! Missing tensors, wrong shapes and other dtypes are errors that name the tensor and the file.
//! Each file's header is parsed and validated once, at open; reading a tensor is a lookup and a
//! slice of the map.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensors};

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
        Weights::f32(self, name, shape)
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

/// One mapped weight file.
struct WeightFile {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Offset of the data section (after the 8-byte length and the JSON header).
    data_start: usize,
}

/// The mapped weight files of one model.
pub struct Weights {
    files: Vec<WeightFile>,
    /// Tensor name → the file holding it (index into `files`) and where it lies there.
    index: HashMap<String, (usize, TensorInfo)>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("files", &self.files.iter().map(|file| &file.path).collect::<Vec<_>>())
            .field("tensors", &self.index.len())
            .finish()
    }
}

impl Weights {
    /// Maps every `*.safetensors` file in `dir`.
    ///
    /// # Errors
    ///
    /// [`LoadError::Missing`] when there is none or one cannot be opened, [`LoadError::Weights`]
    /// when one is not a valid safetensors file or two hold the same tensor.
    pub fn open(dir: &Path) -> Result<Weights, LoadError> {
        let entries = std::fs::read_dir(dir).map_err(|err| LoadError::Missing {
            path: dir.to_path_buf(),
            reason: err.to_string(),
        })?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(LoadError::Missing {
                path: dir.join("*.safetensors"),
                reason: "no weight file in the model directory".into(),
            });
        }
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for path in paths {
            let file = std::fs::File::open(&path).map_err(|err| LoadError::Missing {
                path: path.clone(),
                reason: err.to_string(),
            })?;
            // SAFETY: the map is read-only and private to this process; a model file that is
            // truncated under a running engine is outside what it can defend against (as for
            // every mmap-based loader).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|err| LoadError::Missing {
                path: path.clone(),
                reason: err.to_string(),
            })?;
            // Validates the header against the file: every tensor's byte range lies in the data
            // section and matches its shape and dtype.
            let (header_len, metadata) =
                SafeTensors::read_metadata(&map).map_err(|err| weights_error(&path, "(header)", err.to_string()))?;
            for (name, info) in metadata.tensors() {
                if let Some((previous, _)) = index.insert(name.clone(), (files.len(), info.clone())) {
                    let other: &WeightFile = &files[previous];
                    return Err(weights_error(&path, &name, format!("also in {}", other.path.display())));
                }
            }
            files.push(WeightFile {
                path,
                map,
                data_start: 8 + header_len,
            });
        }
        Ok(Weights { files, index })
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Every tensor's name and shape, in no particular order.
    pub fn shapes(&self) -> impl Iterator<Item = (&str, &[usize])> {
        self.index
            .iter()
            .map(|(name, (_, info))| (name.as_str(), info.shape.as_slice()))
    }

    /// The tensor `name` widened to f32, checked to have `shape`.
    ///
    /// # Errors
    ///
    /// [`LoadError::Weights`] naming the tensor when it is absent, has another shape, or a
    /// dtype other than f32, f16 and bf16.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let Some((file, info)) = self.index.get(name) else {
            let dir = self
                .files
                .first()
                .and_then(|file| file.path.parent())
                .unwrap_or(Path::new("."));
            return Err(weights_error(dir, name, "missing".into()));
        };
        let WeightFile { path, map, data_start } = &self.files[*file];
        if info.shape != shape {
            return Err(weights_error(
                path,
                name,
                format!("shape {:?}, the config implies {shape:?}", info.shape),
            ));
        }
        let (start, end) = info.data_offsets;
        let bytes = &map[data_start + start..data_start + end];
        let float = match info.dtype {
            Dtype::F32 => Float::F32,
            Dtype::F16 => Float::F16,
            Dtype::BF16 => Float::Bf16,
            other => {
                return Err(weights_error(
                    path,
                    name,
                    format!("dtype {other:?} is not supported (f32, f16, bf16 are)"),
                ));
            }
        };
        let values = widen(float, bytes);
        Ok(values)
    }
}

/// A little-endian floating-point storage type.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Float {
    F32,
    F16,
    Bf16,
}

/// Every value of `bytes`, stored as `float`, widened to f32 (safetensors and GGUF alike).
pub(crate) fn widen(float: Float, bytes: &[u8]) -> Vec<f32> {
    match float {
        Float::F32 => bytes
            .as_chunks::<4>()
            .0
            .iter()
            .map(|b| f32::from_le_bytes(*b))
            .collect(),
        Float::F16 => bytes
            .as_chunks::<2>()
            .0
            .iter()
            .map(|b| half::f16::from_le_bytes(*b).to_f32())
            .collect(),
        Float::Bf16 => bytes
            .as_chunks::<2>()
            .0
            .iter()
            .map(|b| half::bf16::from_le_bytes(*b).to_f32())
            .collect(),
    }
}

fn weights_error(path: &Path, tensor: &str, reason: String) -> LoadError {
    LoadError::Weights {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    }
}
