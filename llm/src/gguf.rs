//! Single-file GGUF models (llama.cpp's format): header, hyper-parameters, tensors and the
//! embedded tokenizer.
//!
//! The file is memory-mapped and its header (metadata key/values and tensor table) parsed once
//! at open, every read bounds-checked so a truncated or hostile file is an error naming it.
//! Tensors are widened to f32 from F32, F16, BF16, Q4_0, Q4_1 and Q8_0 blocks; other
//! quantizations are refused by name. Tensors are looked up by their Hugging Face names
//! ([`TensorSource`]), translated to GGUF's (`blk.N.attn_q.weight`), and the query and key
//! projections of `llama` files are put back in Hugging Face's row order, which llama.cpp's
//! converter permutes for its interleaved RoPE. The tokenizer (`tokenizer.ggml.*`, GPT-2 BPE)
//! is rebuilt as a Hugging Face tokenizer, and its chat template (Jinja) is offered as one. The `gguf-rs` crate was not used: it enables
//! serde_json's `arbitrary_precision` for the whole build (which breaks flattened request
//! parsing) and copies mapped files into memory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::LoadError;
use super::config::{ModelConfig, RopeScaling};
use super::model::Matrix;
use super::quant::{BLOCK, QuantKind, QuantMatrix, dequantize_block};
use super::weights::{Float, TensorSource, widen};
use switchyard_tokenize::{JinjaTemplate, Tokenizer};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    Uint(u64),
    /// Any signed integer type.
    Int(i64),
    /// `f32` or `f64`.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of values.
    Array(Vec<Value>),
}

impl Value {
    fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Uint(v) => Some(v),
            Value::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::Uint(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
}

/// GGML tensor types this reader widens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TensorType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl TensorType {
    fn from_id(id: u32) -> Option<TensorType> {
        Some(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Q4_0,
            3 => TensorType::Q4_1,
            8 => TensorType::Q8_0,
            30 => TensorType::Bf16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block).
    fn block(self) -> (usize, usize) {
        match self {
            TensorType::F32 => (1, 4),
            TensorType::F16 | TensorType::Bf16 => (1, 2),
            TensorType::Q4_0 => (32, 18),
            TensorType::Q4_1 => (32, 20),
            TensorType::Q8_0 => (32, 34),
        }
    }
}

#[derive(Debug)]
struct TensorEntry {
    /// GGUF order: the fastest-varying dimension first.
    dims: Vec<usize>,
    kind: u32,
    /// Absolute offset in the file.
    start: usize,
}

/// A mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    metadata: HashMap<String, Value>,
    tensors: HashMap<String, TensorEntry>,
    architecture: String,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("architecture", &self.architecture)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

/// A bounds-checked little-endian reader over the mapped header.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(format!("truncated header at byte {}", self.at));
        };
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    fn len(&mut self) -> Result<usize, String> {
        let n = self.u64()?;
        // Nothing in a header is longer than the file itself.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.bytes.len())
            .ok_or_else(|| format!("length {n} at byte {} runs past the file", self.at - 8))
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.len()?;
        let at = self.at;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| format!("string at byte {at} is not UTF-8"))
    }

    fn value(&mut self, kind: u32, depth: usize) -> Result<Value, String> {
        Ok(match kind {
            0 => Value::Uint(u64::from(self.array::<1>()?[0])),
            1 => Value::Int(i64::from(i8::from_le_bytes(self.array()?))),
            2 => Value::Uint(u64::from(u16::from_le_bytes(self.array()?))),
            3 => Value::Int(i64::from(i16::from_le_bytes(self.array()?))),
            4 => Value::Uint(u64::from(self.u32()?)),
            5 => Value::Int(i64::from(i32::from_le_bytes(self.array()?))),
            6 => Value::Float(f64::from(f32::from_le_bytes(self.array()?))),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err("arrays nested too deep".into());
                }
                let inner = self.u32()?;
                let n = self.len()?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(inner, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::Uint(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.array()?)),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(format!("unknown metadata type {other}")),
        })
    }
}

impl GgufFile {
    /// Maps `path` and parses its header.
    ///
    /// # Errors
    ///
    /// [`LoadError::Missing`] when it cannot be opened, [`LoadError::Weights`] when it is not a
    /// GGUF v2/v3 file or its header is malformed.
    pub fn open(path: &Path) -> Result<GgufFile, LoadError> {
        let file = std::fs::File::open(path).map_err(|err| LoadError::Missing {
            path: path.to_path_buf(),
            reason: err.to_string(),
        })?;
        // SAFETY: the map is read-only; a file changed underneath a running worker is outside
        // what any loader can defend against, as with safetensors.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|err| LoadError::Missing {
            path: path.to_path_buf(),
            reason: format!("cannot map: {err}"),
        })?;
        let header = |reason: String| LoadError::Weights {
            path: path.to_path_buf(),
            tensor: "(header)".into(),
            reason,
        };
        let mut cursor = Cursor { bytes: &map, at: 0 };
        if cursor.take(4).map_err(header)? != MAGIC {
            return Err(header("not a GGUF file (no GGUF magic)".into()));
        }
        let version = cursor.u32().map_err(header)?;
        if !(2..=3).contains(&version) {
            return Err(header(format!("GGUF version {version} is not supported (2 and 3 are)")));
        }
        let tensor_count = cursor.len().map_err(header)?;
        let kv_count = cursor.len().map_err(header)?;
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = cursor.string().map_err(header)?;
            let kind = cursor.u32().map_err(header)?;
            let value = cursor.value(kind, 0).map_err(|err| header(format!("`{key}`: {err}")))?;
            metadata.insert(key, value);
        }
        let mut entries = Vec::with_capacity(tensor_count.min(1 << 16));
        for _ in 0..tensor_count {
            let name = cursor.string().map_err(header)?;
            let rank = cursor.u32().map_err(header)?;
            if rank > 4 {
                return Err(header(format!("tensor `{name}` has {rank} dimensions")));
            }
            let dims = (0..rank)
                .map(|_| cursor.len())
                .collect::<Result<Vec<_>, _>>()
                .map_err(header)?;
            let kind = cursor.u32().map_err(header)?;
            let offset = cursor.u64().map_err(header)?;
            entries.push((name, dims, kind, offset));
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .filter(|&a| a > 0)
            .unwrap_or(DEFAULT_ALIGNMENT);
        let data_start = (cursor.at as u64).div_ceil(alignment) * alignment;
        let mut tensors = HashMap::with_capacity(entries.len());
        for (name, dims, kind, offset) in entries {
            let start = data_start
                .checked_add(offset)
                .and_then(|start| usize::try_from(start).ok())
                .filter(|&start| start <= map.len())
                .ok_or_else(|| header(format!("tensor `{name}` starts past the end of the file")))?;
            tensors.insert(name, TensorEntry { dims, kind, start });
        }
        let architecture = metadata
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            metadata,
            tensors,
            architecture,
        })
    }

    /// A metadata value by key.
    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn config_error(&self, key: &str, reason: impl Into<String>) -> LoadError {
        LoadError::Config {
            path: self.path.clone(),
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    fn arch_u64(&self, key: &str) -> Result<usize, LoadError> {
        let key = format!("{}.{key}", self.architecture);
        self.metadata
            .get(&key)
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| self.config_error(&key, "missing or not an integer"))
    }

    /// The hyper-parameters, from the `ARCH.*` keys.
    ///
    /// # Errors
    ///
    /// [`LoadError::Config`] naming the key that is missing or unsupported.
    pub fn model_config(&self) -> Result<ModelConfig, LoadError> {
        let arch = self.architecture.as_str();
        if arch != "llama" && arch != "qwen2" {
            return Err(self.config_error(
                "general.architecture",
                format!("`{arch}` is not supported (llama and qwen2 are)"),
            ));
        }
        let hidden_size = self.arch_u64("embedding_length")?;
        let num_heads = self.arch_u64("attention.head_count")?;
        let num_kv_heads = self.arch_u64("attention.head_count_kv").unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 || hidden_size % num_heads != 0 {
            return Err(self.config_error(
                &format!("{arch}.attention.head_count_kv"),
                format!("{num_heads} query heads, {num_kv_heads} key/value heads and width {hidden_size} do not fit"),
            ));
        }
        let head_dim = self.arch_u64("attention.key_length").unwrap_or(hidden_size / num_heads);
        let vocab_size = match self.arch_u64("vocab_size") {
            Ok(n) => n,
            Err(_) => self.tokens().map(|tokens| tokens.len()).or_else(|_| {
                self.dims("token_embd.weight")
                    .map(|dims| dims.get(1).copied().unwrap_or(0))
            })?,
        };
        let float = |key: &str, default: f64| {
            self.metadata
                .get(&format!("{arch}.{key}"))
                .and_then(Value::as_f64)
                .unwrap_or(default)
        };
        if let Some(kind) = self
            .metadata
            .get(&format!("{arch}.rope.scaling.type"))
            .and_then(Value::as_str)
            && kind != "none"
        {
            return Err(self.config_error(
                &format!("{arch}.rope.scaling.type"),
                format!("RoPE scaling `{kind}` is not supported in GGUF files"),
            ));
        }
        if self.tensors.contains_key("rope_freqs.weight") {
            return Err(self.weights_error(
                "rope_freqs.weight",
                "per-frequency RoPE factors (Llama 3 scaling) are not supported in GGUF files".into(),
            ));
        }
        let eos = self
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(Value::as_u64)
            .map(|id| id as u32);
        Ok(ModelConfig {
            model_type: arch.to_string(),
            hidden_size,
            intermediate_size: self.arch_u64("feed_forward_length")?,
            num_layers: self.arch_u64("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-5) as f32,
            rope_theta: float("rope.freq_base", 10_000.0),
            rope_scaling: RopeScaling::None,
            attention_bias: self.tensors.contains_key("blk.0.attn_q.bias"),
            tie_word_embeddings: !self.tensors.contains_key("output.weight"),
            max_position_embeddings: self.arch_u64("context_length").unwrap_or(4096),
            eos_token_ids: eos.into_iter().collect(),
        })
    }

    fn dims(&self, name: &str) -> Result<Vec<usize>, LoadError> {
        self.tensors
            .get(name)
            .map(|entry| entry.dims.clone())
            .ok_or_else(|| self.weights_error(name, "missing".into()))
    }

    fn weights_error(&self, tensor: &str, reason: String) -> LoadError {
        LoadError::Weights {
            path: self.path.clone(),
            tensor: tensor.to_string(),
            reason,
        }
    }

    fn tokens(&self) -> Result<Vec<&str>, LoadError> {
        let key = "tokenizer.ggml.tokens";
        match self.metadata.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    item.as_str()
                        .ok_or_else(|| self.config_error(key, "holds a non-string"))
                })
                .collect(),
            _ => Err(self.config_error(key, "missing: the file has no embedded tokenizer")),
        }
    }

    /// The embedded tokenizer, rebuilt as a Hugging Face BPE tokenizer.
    ///
    /// # Errors
    ///
    /// [`LoadError::Config`] naming the key when the tokenizer is missing or of a kind not
    /// supported (GPT-2 BPE with the `gpt2`, `default` or `smollm` pre-tokenizers is).
    pub fn tokenizer(&self) -> Result<Tokenizer, LoadError> {
        let kind = self.metadata.get("tokenizer.ggml.model").and_then(Value::as_str);
        if kind != Some("gpt2") {
            return Err(self.config_error(
                "tokenizer.ggml.model",
                format!("{kind:?}: only GPT-2 BPE tokenizers are rebuilt; give a tokenizer.json instead"),
            ));
        }
        let pre = self
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(Value::as_str)
            .unwrap_or("default");
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        let pre_tokenizer = match pre {
            "default" | "gpt2" => byte_level.clone(),
            // llama.cpp's `smollm`: digits one by one, then GPT-2's split.
            "smollm" => serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level.clone()]}),
            other => {
                return Err(self.config_error(
                    "tokenizer.ggml.pre",
                    format!("pre-tokenizer `{other}` is not rebuilt; give a tokenizer.json instead"),
                ));
            }
        };
        let tokens = self.tokens()?;
        let merges: Vec<&str> = match self.metadata.get("tokenizer.ggml.merges") {
            Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
            _ => return Err(self.config_error("tokenizer.ggml.merges", "missing")),
        };
        let types: Vec<u64> = match self.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(items)) => items.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            _ => Vec::new(),
        };
        let vocab: serde_json::Map<String, serde_json::Value> = tokens
            .iter()
            .enumerate()
            .map(|(id, token)| ((*token).to_string(), serde_json::json!(id)))
            .collect();
        // Token type 3 is a control token (`<|im_start|>`): matched whole, before BPE.
        let added: Vec<serde_json::Value> = tokens
            .iter()
            .enumerate()
            .filter(|(id, _)| types.get(*id) == Some(&3))
            .map(|(id, token)| {
                serde_json::json!({"id": id, "content": token, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added, "normalizer": null, "pre_tokenizer": pre_tokenizer,
            "post_processor": null, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "vocab": vocab, "merges": merges},
        });
        let tokenizer: tokenizers::Tokenizer = json.to_string().parse().map_err(|err| {
            self.config_error("tokenizer.ggml.tokens", format!("cannot rebuild the tokenizer: {err}"))
        })?;
        Ok(Tokenizer::Hf(Box::new(tokenizer)))
    }

    /// The model's own chat template (`tokenizer.chat_template`, Jinja), with its BOS and EOS
    /// token texts, if the file has one.
    ///
    /// # Errors
    ///
    /// [`LoadError::Config`] when the template does not parse.
    pub fn chat_template(&self) -> Result<Option<JinjaTemplate>, LoadError> {
        let key = "tokenizer.chat_template";
        let Some(source) = self.metadata.get(key).and_then(Value::as_str) else {
            return Ok(None);
        };
        let tokens = self.tokens().unwrap_or_default();
        let token = |key: &str| {
            self.metadata
                .get(key)
                .and_then(Value::as_u64)
                .and_then(|id| tokens.get(id as usize))
                .map_or("", |token| *token)
        };
        JinjaTemplate::new(
            source,
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
        )
        .map(Some)
        .map_err(|err| self.config_error(key, err.to_string()))
    }

    /// The GGUF name of a Hugging Face tensor name, and whether its rows are permuted for
    /// llama.cpp's RoPE (query and key projections of `llama` files).
    fn gguf_name(&self, hf: &str) -> Option<(String, Option<usize>)> {
        let direct = match hf {
            "model.embed_tokens.weight" => Some("token_embd.weight"),
            "model.norm.weight" => Some("output_norm.weight"),
            "lm_head.weight" => Some("output.weight"),
            _ => None,
        };
        if let Some(name) = direct {
            return Some((name.to_string(), None));
        }
        let rest = hf.strip_prefix("model.layers.")?;
        let (layer, part) = rest.split_once('.')?;
        let (module, kind) = part.rsplit_once('.')?;
        let (gguf, heads) = match module {
            "input_layernorm" => ("attn_norm", None),
            "post_attention_layernorm" => ("ffn_norm", None),
            "self_attn.q_proj" => ("attn_q", Some(self.arch_u64("attention.head_count").ok()?)),
            "self_attn.k_proj" => (
                "attn_k",
                Some(
                    self.arch_u64("attention.head_count_kv")
                        .or_else(|_| self.arch_u64("attention.head_count"))
                        .ok()?,
                ),
            ),
            "self_attn.v_proj" => ("attn_v", None),
            "self_attn.o_proj" => ("attn_output", None),
            "mlp.gate_proj" => ("ffn_gate", None),
            "mlp.up_proj" => ("ffn_up", None),
            "mlp.down_proj" => ("ffn_down", None),
            _ => return None,
        };
        let permuted = if self.architecture == "llama" { heads } else { None };
        Some((format!("blk.{layer}.{gguf}.{kind}"), permuted))
    }
}

impl TensorSource for GgufFile {
    fn contains(&self, name: &str) -> bool {
        self.gguf_name(name)
            .is_some_and(|(gguf, _)| self.tensors.contains_key(&gguf))
    }

    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let (kind, data, permuted) = self.tensor_data(name, shape)?;
        let count: usize = shape.iter().product();
        let mut values = dequantize(kind, data, count);
        if let Some(heads) = permuted {
            values = unpermute_rows(&values, heads, shape[0], shape.get(1).copied().unwrap_or(1));
        }
        Ok(values)
    }

    fn matrix(&self, name: &str, shape: &[usize]) -> Result<Matrix, LoadError> {
        let (kind, data, permuted) = self.tensor_data(name, shape)?;
        let quantized = match kind {
            TensorType::Q4_0 => QuantKind::Q4_0,
            TensorType::Q4_1 => QuantKind::Q4_1,
            TensorType::Q8_0 => QuantKind::Q8_0,
            TensorType::F32 | TensorType::F16 | TensorType::Bf16 => return self.f32(name, shape).map(Matrix::F32),
        };
        let (rows, cols) = match shape {
            [rows, cols] => (*rows, *cols),
            _ => return self.f32(name, shape).map(Matrix::F32),
        };
        // Rows are whole runs of blocks, so the converter's row permutation is undone by
        // moving each row's bytes.
        let data = match permuted {
            Some(heads) => unpermute_rows(data, heads, rows, data.len() / rows.max(1)),
            None => data.to_vec(),
        };
        QuantMatrix::new(quantized, rows, cols, data)
            .map(Matrix::Quantized)
            .map_err(|err| self.weights_error(name, err.to_string()))
    }
}

impl GgufFile {
    /// The stored bytes of the tensor behind the Hugging Face name `name`, checked against
    /// `shape`, with its type and, for a query or key projection, the heads its rows were
    /// permuted over.
    fn tensor_data(&self, name: &str, shape: &[usize]) -> Result<(TensorType, &[u8], Option<usize>), LoadError> {
        let Some((gguf, permuted)) = self.gguf_name(name) else {
            return Err(self.weights_error(name, "has no GGUF counterpart".into()));
        };
        let Some(entry) = self.tensors.get(&gguf) else {
            return Err(self.weights_error(&gguf, format!("missing (wanted as `{name}`)")));
        };
        let reversed: Vec<usize> = entry.dims.iter().rev().copied().collect();
        if reversed != shape {
            return Err(self.weights_error(&gguf, format!("shape {reversed:?}, the config implies {shape:?}")));
        }
        let Some(kind) = TensorType::from_id(entry.kind) else {
            return Err(self.weights_error(
                &gguf,
                format!(
                    "GGML type {} is not supported (F32, F16, BF16, Q4_0, Q4_1, Q8_0 are)",
                    entry.kind
                ),
            ));
        };
        let count: usize = shape.iter().product();
        let (per_block, block_bytes) = kind.block();
        if !count.is_multiple_of(per_block) {
            return Err(self.weights_error(&gguf, format!("{count} values do not fill {per_block}-value blocks")));
        }
        let bytes = (count / per_block) * block_bytes;
        let Some(data) = self.map.get(entry.start..entry.start + bytes) else {
            return Err(self.weights_error(&gguf, "data runs past the end of the file".into()));
        };
        Ok((kind, data, permuted))
    }
}

/// Widens `count` values of `kind` from `data` to f32.
fn dequantize(kind: TensorType, data: &[u8], count: usize) -> Vec<f32> {
    let quantized = match kind {
        TensorType::F32 => return widen(Float::F32, data),
        TensorType::F16 => return widen(Float::F16, data),
        TensorType::Bf16 => return widen(Float::Bf16, data),
        TensorType::Q4_0 => QuantKind::Q4_0,
        TensorType::Q4_1 => QuantKind::Q4_1,
        TensorType::Q8_0 => QuantKind::Q8_0,
    };
    let mut out = vec![0.0; count];
    for (block, out) in data
        .chunks_exact(quantized.block_bytes())
        .zip(out.as_chunks_mut::<BLOCK>().0)
    {
        dequantize_block(quantized, block, out);
    }
    out
}

/// Undoes llama.cpp's converter permutation of a query or key projection (`[rows, cols]`):
/// within each head it stored Hugging Face row `j · d/2 + i` at row `2i + j`.
fn unpermute_rows<T: Copy + Default>(values: &[T], heads: usize, rows: usize, cols: usize) -> Vec<T> {
    let head_dim = rows / heads.max(1);
    let half = head_dim / 2;
    let mut out = vec![T::default(); values.len()];
    for head in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let stored = head * head_dim + 2 * i + j;
                let original = head * head_dim + j * half + i;
                out[original * cols..(original + 1) * cols]
                    .copy_from_slice(&values[stored * cols..(stored + 1) * cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_widen_as_ggml_defines_them() {
        let d = half::f16::from_f32(0.5).to_le_bytes();
        let m = half::f16::from_f32(-1.0).to_le_bytes();
        // Q4_1: value k of the block is nibble k (low nibbles first) · d + m.
        let mut q4_1 = vec![d[0], d[1], m[0], m[1]];
        q4_1.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let values = dequantize(TensorType::Q4_1, &q4_1, 32);
        assert_eq!(values[0], -1.0);
        assert_eq!(values[3], 0.5);
        assert_eq!(values[16], 6.5, "high nibble of byte 0 is 15");
        // Q4_0: (nibble − 8) · d.
        let mut q4_0 = vec![d[0], d[1]];
        q4_0.extend([0x8f_u8; 16]);
        let values = dequantize(TensorType::Q4_0, &q4_0, 32);
        assert_eq!((values[0], values[16]), (3.5, 0.0));
        // Q8_0: signed bytes · d.
        let mut q8_0 = vec![d[0], d[1]];
        q8_0.extend((0..32).map(|i: i8| (i - 16) as u8));
        let values = dequantize(TensorType::Q8_0, &q8_0, 32);
        assert_eq!((values[0], values[31]), (-8.0, 7.5));
    }

    #[test]
    fn unpermuting_inverts_the_converters_permutation() {
        // llama.cpp: w.reshape(heads, 2, d/2, cols).swapaxes(1, 2).reshape(rows, cols).
        let (heads, head_dim, cols) = (2, 6, 3);
        let rows = heads * head_dim;
        let original: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
        let mut permuted = vec![0.0; original.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..head_dim / 2 {
                    let from = h * head_dim + j * head_dim / 2 + i;
                    let to = h * head_dim + i * 2 + j;
                    permuted[to * cols..(to + 1) * cols].copy_from_slice(&original[from * cols..(from + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&permuted, heads, rows, cols), original);
    }
}
