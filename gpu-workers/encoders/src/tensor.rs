//! Weights by name: Hugging Face safetensors files, memory-mapped, widened to f32.
//!
//! [`TensorSource`] is what the models load from; [`Safetensors`] reads every `*.safetensors`
//! file of a model directory, and [`crate::ct2::Ct2Model`] a CTranslate2 model file. Every
//! error names the file and the tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, tensor::TensorInfo};

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

/// Every `*.safetensors` file of a model directory (or one file), memory-mapped.
#[derive(Debug)]
pub struct Safetensors {
    origin: PathBuf,
    files: Vec<WeightFile>,
    index: HashMap<String, (usize, TensorInfo)>,
}

#[derive(Debug)]
struct WeightFile {
    path: PathBuf,
    map: memmap2::Mmap,
    data_start: usize,
}

impl Safetensors {
    /// Opens `path`: a directory (every `*.safetensors` in it) or a single file.
    ///
    /// # Errors
    ///
    /// [`LoadError::Missing`] when there is no weight file, [`LoadError::Weights`] when a header
    /// does not parse or two files hold the same tensor.
    pub fn open(path: &Path) -> Result<Safetensors, LoadError> {
        let mut paths: Vec<PathBuf> = if path.is_dir() {
            std::fs::read_dir(path)
                .map_err(|err| LoadError::Missing {
                    path: path.to_path_buf(),
                    reason: err.to_string(),
                })?
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
                .collect()
        } else {
            vec![path.to_path_buf()]
        };
        paths.sort();
        if paths.is_empty() {
            return Err(LoadError::Missing {
                path: path.join("*.safetensors"),
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
            // SAFETY: the map is read-only and private to this process; a weight file truncated
            // under a running encoder is outside what any mmap-based loader can defend against.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|err| LoadError::Missing {
                path: path.clone(),
                reason: err.to_string(),
            })?;
            // Checks every tensor's byte range against the file and its shape and dtype.
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
        Ok(Safetensors {
            origin: path.to_path_buf(),
            files,
            index,
        })
    }
}

impl TensorSource for Safetensors {
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let Some((file, info)) = self.index.get(name) else {
            return Err(weights_error(&self.origin, name, "missing".into()));
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
        Ok(widen(float, bytes))
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn origin(&self) -> &Path {
        &self.origin
    }
}

/// A little-endian floating-point storage type.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Float {
    F32,
    F16,
    Bf16,
}

/// Every value of `bytes`, stored as `float`, widened to f32.
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

pub(crate) fn weights_error(path: &Path, tensor: &str, reason: String) -> LoadError {
    LoadError::Weights {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    }
}

/// `values` as little-endian f16 bytes (round to nearest even): the wire form of feature rows.
pub fn to_f16_le(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect()
}
