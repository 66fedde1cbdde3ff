//! A model's `*.safetensors` files, memory-mapped, read tensor by tensor as f32.
//!
//! Every `.safetensors` file of a model directory is mapped (one file or a sharded set); a
//! tensor is found by name in whichever file holds it and widened to f32 from f32, f16 or bf16.
//! Each file's header is parsed and validated once, at open (every tensor's byte range lies in
//! the data section and matches its shape and dtype); reading a tensor is a lookup and a slice
//! of the map. Missing tensors, wrong shapes and other dtypes are errors that name the tensor
//! and the file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensors};

/// Why weights could not be opened or a tensor read.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// There is no weight file, or one is unreadable.
    #[error("{}: {reason}", path.display())]
    Missing {
        /// The file (or pattern) looked for.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A weight file's header does not parse, or a tensor is absent, misshapen or of a dtype
    /// that is not a float.
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

/// Every `*.safetensors` file of a model directory (or one file), memory-mapped.
pub struct Safetensors {
    origin: PathBuf,
    files: Vec<WeightFile>,
    index: HashMap<String, (usize, TensorInfo)>,
}

impl std::fmt::Debug for Safetensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Safetensors")
            .field("origin", &self.origin)
            .field("files", &self.files.len())
            .field("tensors", &self.index.len())
            .finish()
    }
}

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
    /// [`WeightsError::Missing`] when there is no weight file or one cannot be read,
    /// [`WeightsError::Weights`] when a header does not parse or two files hold the same tensor.
    pub fn open(path: &Path) -> Result<Safetensors, WeightsError> {
        let missing = |path: &Path, err: std::io::Error| WeightsError::Missing {
            path: path.to_path_buf(),
            reason: err.to_string(),
        };
        let mut paths: Vec<PathBuf> = if path.is_dir() {
            std::fs::read_dir(path)
                .map_err(|err| missing(path, err))?
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
                .collect()
        } else {
            vec![path.to_path_buf()]
        };
        paths.sort();
        if paths.is_empty() {
            return Err(WeightsError::Missing {
                path: path.join("*.safetensors"),
                reason: "no weight file in the model directory".into(),
            });
        }
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for path in paths {
            let file = std::fs::File::open(&path).map_err(|err| missing(&path, err))?;
            // SAFETY: the map is read-only and private to this process; a weight file that is
            // truncated under a running engine is outside what it can defend against (as for
            // every mmap-based loader).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|err| missing(&path, err))?;
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

    /// The directory (or file) the weights were opened from.
    pub fn origin(&self) -> &Path {
        &self.origin
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

    /// The tensor `name` widened to f32, checked to have `shape` (row-major, as in PyTorch).
    ///
    /// # Errors
    ///
    /// [`WeightsError::Weights`] naming the tensor when it is absent, has another shape, or a
    /// dtype other than f32, f16 and bf16.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, WeightsError> {
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
}

fn weights_error(path: &Path, tensor: &str, reason: String) -> WeightsError {
    WeightsError::Weights {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    }
}

/// A little-endian floating-point storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Float {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

/// Every value of `bytes`, stored as `float`, widened to f32 (safetensors, GGUF and
/// CTranslate2 files alike).
pub fn widen(float: Float, bytes: &[u8]) -> Vec<f32> {
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

/// `values` as little-endian f16 bytes (round to nearest even): the wire form of feature rows.
pub fn to_f16_le(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_float_type_widens_to_the_same_values() {
        let values = [1.5f32, -0.25, 0.0, 65504.0];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        assert_eq!(widen(Float::F32, &f32_bytes), values);
        assert_eq!(widen(Float::F16, &to_f16_le(&values)), values);
        assert_eq!(widen(Float::Bf16, &bf16_bytes)[..3], values[..3]);
    }

    #[test]
    fn a_directory_without_weights_names_the_pattern_looked_for() {
        let dir = std::env::temp_dir().join(format!("switchyard-native-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        let err = Safetensors::open(&dir).expect_err("no weight file");
        assert!(err.to_string().contains("*.safetensors"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
