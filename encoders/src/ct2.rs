//! A reader for CTranslate2 model files (`model.bin`, format version 6 and earlier), the form
//! faster-whisper ships Whisper in.
//!
//! Layout, little-endian: `u32` version; a `u16`-length spec name and `u32` spec revision
//! (version ≥ 2); `u32` variable count; per variable a `u16`-length name, `u8` rank, `u32`
//! dimensions, `u8` dtype (0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16; version ≥ 4, before that f32
//! or i8 by a flag), `u32` byte count, the data; then `u32` alias count and (alias, target) name
//! pairs. Strings are NUL-terminated within their length. Every error names the file and the
//! variable.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::LoadError;
use crate::tensor::{Float, TensorSource, weights_error, widen};

/// One stored variable.
#[derive(Debug, Clone)]
struct Variable {
    shape: Vec<usize>,
    dtype: u8,
    range: std::ops::Range<usize>,
}

/// A CTranslate2 model file, memory-mapped, its variables indexed by name.
#[derive(Debug)]
pub struct Ct2Model {
    path: PathBuf,
    map: memmap2::Mmap,
    spec: String,
    variables: HashMap<String, Variable>,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<std::ops::Range<usize>, LoadError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| {
                weights_error(
                    self.path,
                    what,
                    format!("the file ends inside it (at byte {})", self.at),
                )
            })?;
        let range = self.at..end;
        self.at = end;
        Ok(range)
    }

    fn u8(&mut self, what: &str) -> Result<u8, LoadError> {
        let range = self.take(1, what)?;
        Ok(self.bytes[range.start])
    }

    fn u16(&mut self, what: &str) -> Result<u16, LoadError> {
        let range = self.take(2, what)?;
        Ok(u16::from_le_bytes([
            self.bytes[range.start],
            self.bytes[range.start + 1],
        ]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, LoadError> {
        let range = self.take(4, what)?;
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.bytes[range]);
        Ok(u32::from_le_bytes(b))
    }

    fn string(&mut self, what: &str) -> Result<String, LoadError> {
        let len = self.u16(what)? as usize;
        let range = self.take(len, what)?;
        let raw = &self.bytes[range];
        let raw = raw.split(|&b| b == 0).next().unwrap_or(raw);
        String::from_utf8(raw.to_vec()).map_err(|_| weights_error(self.path, what, "a name that is not UTF-8".into()))
    }
}

fn dtype_size(dtype: u8) -> Option<usize> {
    match dtype {
        0 | 3 => Some(4),
        1 => Some(1),
        2 | 4 | 5 => Some(2),
        _ => None,
    }
}

impl Ct2Model {
    /// Opens and indexes `path`.
    ///
    /// # Errors
    ///
    /// [`LoadError::Missing`] for an unreadable file, [`LoadError::Weights`] naming the variable
    /// where the file is truncated or inconsistent.
    pub fn open(path: &Path) -> Result<Ct2Model, LoadError> {
        let file = std::fs::File::open(path).map_err(|err| LoadError::Missing {
            path: path.to_path_buf(),
            reason: err.to_string(),
        })?;
        // SAFETY: read-only and private; as for every mmap-based loader, a file truncated while
        // mapped is out of scope.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|err| LoadError::Missing {
            path: path.to_path_buf(),
            reason: err.to_string(),
        })?;
        let mut cursor = Cursor {
            bytes: &map,
            at: 0,
            path,
        };
        let version = cursor.u32("(version)")?;
        if !(1..=6).contains(&version) {
            return Err(weights_error(
                path,
                "(version)",
                format!("format version {version} (this reader knows 1 to 6)"),
            ));
        }
        let spec = if version >= 2 {
            let spec = cursor.string("(spec)")?;
            cursor.u32("(revision)")?;
            spec
        } else {
            String::new()
        };
        let count = cursor.u32("(variable count)")?;
        let mut variables = HashMap::new();
        for _ in 0..count {
            let name = cursor.string("(variable name)")?;
            let rank = cursor.u8(&name)? as usize;
            let shape = (0..rank)
                .map(|_| cursor.u32(&name).map(|d| d as usize))
                .collect::<Result<Vec<_>, _>>()?;
            let (dtype, bytes) = if version >= 4 {
                let dtype = cursor.u8(&name)?;
                (dtype, cursor.u32(&name)? as usize)
            } else {
                // Before version 4: a u8 item size (4 f32, 1 i8) and an item count.
                let size = cursor.u8(&name)?;
                let items = cursor.u32(&name)? as usize;
                (if size == 1 { 1 } else { 0 }, items * size as usize)
            };
            let item =
                dtype_size(dtype).ok_or_else(|| weights_error(path, &name, format!("unknown dtype code {dtype}")))?;
            let elements: usize = shape.iter().product();
            if elements * item != bytes {
                return Err(weights_error(
                    path,
                    &name,
                    format!("{bytes} bytes for shape {shape:?} of {item}-byte items"),
                ));
            }
            let range = cursor.take(bytes, &name)?;
            variables.insert(name, Variable { shape, dtype, range });
        }
        if version >= 3 && cursor.at < map.len() {
            let aliases = cursor.u32("(alias count)")?;
            for _ in 0..aliases {
                let alias = cursor.string("(alias)")?;
                let target = cursor.string(&alias)?;
                let variable = variables
                    .get(&target)
                    .cloned()
                    .ok_or_else(|| weights_error(path, &alias, format!("an alias of `{target}`, which is absent")))?;
                variables.insert(alias, variable);
            }
        }
        Ok(Ct2Model {
            path: path.to_path_buf(),
            map,
            spec,
            variables,
        })
    }

    /// The model spec's name (`WhisperSpec`, …).
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// A variable's shape.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.variables.get(name).map(|v| v.shape.as_slice())
    }

    /// An integer scalar (`encoder/num_heads`), widened.
    pub fn scalar(&self, name: &str) -> Option<i64> {
        let variable = self.variables.get(name)?;
        let bytes = &self.map[variable.range.clone()];
        match (variable.dtype, bytes.len()) {
            (1, 1) => Some(bytes[0] as i8 as i64),
            (2, 2) => Some(i16::from_le_bytes([bytes[0], bytes[1]]) as i64),
            (3, 4) => Some(i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as i64),
            _ => None,
        }
    }
}

impl TensorSource for Ct2Model {
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let variable = self
            .variables
            .get(name)
            .ok_or_else(|| weights_error(&self.path, name, "missing".into()))?;
        if variable.shape != shape {
            return Err(weights_error(
                &self.path,
                name,
                format!("shape {:?}, the config implies {shape:?}", variable.shape),
            ));
        }
        let float = match variable.dtype {
            0 => Float::F32,
            4 => Float::F16,
            5 => Float::Bf16,
            other => {
                return Err(weights_error(
                    &self.path,
                    name,
                    format!("dtype code {other} (quantized weights are not supported: f32, f16, bf16 are)"),
                ));
            }
        };
        Ok(widen(float, &self.map[variable.range.clone()]))
    }

    fn contains(&self, name: &str) -> bool {
        self.variables.contains_key(name)
    }

    fn origin(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&((s.len() + 1) as u16).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    /// A version-6 file with one f16 `[2, 2]` variable, one i16 scalar and an alias.
    fn sample() -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&6u32.to_le_bytes());
        string(&mut out, "WhisperSpec");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&2u32.to_le_bytes());
        string(&mut out, "w");
        out.push(2);
        out.extend_from_slice(&2u32.to_le_bytes());
        out.extend_from_slice(&2u32.to_le_bytes());
        out.push(4);
        out.extend_from_slice(&8u32.to_le_bytes());
        for v in [1.0f32, -2.0, 0.5, 3.0] {
            out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
        string(&mut out, "heads");
        out.push(0);
        out.push(2);
        out.extend_from_slice(&2u32.to_le_bytes());
        out.extend_from_slice(&6i16.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        string(&mut out, "alias");
        string(&mut out, "w");
        out
    }

    #[test]
    fn reads_variables_scalars_and_aliases() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("model.bin");
        std::fs::write(&path, sample()).expect("write");
        let model = Ct2Model::open(&path).expect("opens");
        assert_eq!(model.spec(), "WhisperSpec");
        assert_eq!(model.f32("w", &[2, 2]).expect("w"), vec![1.0, -2.0, 0.5, 3.0]);
        assert_eq!(model.f32("alias", &[2, 2]).expect("alias"), vec![1.0, -2.0, 0.5, 3.0]);
        assert_eq!(model.scalar("heads"), Some(6));
        let err = model.f32("w", &[4]).expect_err("wrong shape").to_string();
        assert!(
            err.contains("model.bin") && err.contains("`w`") && err.contains("[2, 2]"),
            "{err}"
        );
        let err = model.f32("absent", &[1]).expect_err("absent").to_string();
        assert!(err.contains("`absent`: missing"), "{err}");
    }

    #[test]
    fn a_truncated_file_names_the_variable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("model.bin");
        let bytes = sample();
        // Cut inside the f16 data of `w` (header 4 + 14 + 4 + 4, name 4, rank 1, dims 8, dtype
        // 1, size 4, then 8 bytes of data).
        std::fs::write(&path, &bytes[..48]).expect("write");
        let err = Ct2Model::open(&path).expect_err("truncated").to_string();
        assert!(err.contains("`w`") && err.contains("ends inside"), "{err}");
        std::fs::write(&path, 9u32.to_le_bytes()).expect("write");
        let err = Ct2Model::open(&path).expect_err("version").to_string();
        assert!(err.contains("format version 9"), "{err}");
    }
}
