//! The decoder's weights and its batched CPU forward step (the paged KV cache it reads and
//! writes is [`crate::kv`]).
//!
//! Pre-norm decoder layers: RMSNorm → grouped-query self-attention with RoPE (rotate-half
//! layout, as transformers' Llama and Qwen2) → residual → RMSNorm → SwiGLU MLP → residual; a
//! final RMSNorm and the LM head (or the tied embedding). Every f32 matrix product, a
//! prefill's attention scores and weighted sums of values included, goes through the `gemm`
//! crate with strides (no copies to transpose, no hand-written loops over the inner dimension;
//! multi-threaded with rayon for all but small products); a decode step's attention reads the
//! cache in place ([`PagedKv`]). It reads the weights once per product even for one row,
//! which is what decoding needs: against `matrixmultiply`, which packs the weight matrix on every
//! call, batch-1 decode of a 110M model went from 11 to 42 tokens/s on two cores. Weights stored
//! as GGML blocks (Q4_0, Q4_1, Q8_0 in a GGUF file) stay quantized ([`Matrix::Quantized`]), and
//! their products go through [`crate::quant`] (activations quantized per block to 16 bits,
//! integer dot products) or, for many rows on CPUs without AVX-512 VNNI, through `gemm` on tiles
//! widened in cache; every other weight is widened to f32 at load, and all other arithmetic is
//! f32.
//!
//! # Rejected designs
//!
//! - The weights stored transposed, so that `gemm` would not pack them at larger batches: batch
//!   8 / 32 decode slower (145 / 284 tok/s).
//! - Attention split over the threads at every step: tiny-llama's batch-8 decode fell from
//!   44,944 to 35,193 tok/s, so a step splits it only from 2¹⁸ multiply-adds.

use std::path::Path;

use rayon::prelude::*;
use wide::f32x8;

use super::LoadError;
use super::config::ModelConfig;
use super::gguf::GgufFile;
use super::quant::QuantMatrix;
use super::weights::{TensorSource, Weights};
use crate::kv::{DecodeQuery, softmax};
pub use crate::kv::{PagedKv, SequenceKv};

/// One decoder layer's weights, row-major `[out, in]` as stored by transformers.
#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) post_attention_norm: Vec<f32>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// A weight matrix `[rows, cols]`, row-major: f32, or GGML blocks kept as stored.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// Widened (or stored) as f32.
    F32(Vec<f32>),
    /// Quantized blocks.
    Quantized(QuantMatrix),
}

impl Matrix {
    /// Bytes the weights take in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::F32(values) => values.len() * 4,
            Matrix::Quantized(matrix) => matrix.bytes(),
        }
    }

    /// Row `row` of `cols` values, widened to f32 into `out`.
    fn row_into(&self, row: usize, cols: usize, out: &mut [f32]) {
        match self {
            Matrix::F32(values) => out.copy_from_slice(&values[row * cols..(row + 1) * cols]),
            Matrix::Quantized(matrix) => matrix.dequantize_row(row, out),
        }
    }

    /// Every value as f32 (borrowed when already f32): for backends that upload f32.
    pub(crate) fn to_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            Matrix::F32(values) => std::borrow::Cow::Borrowed(values),
            Matrix::Quantized(matrix) => std::borrow::Cow::Owned(matrix.dequantize()),
        }
    }

    /// The same weights widened to f32.
    fn widened(&self) -> Matrix {
        Matrix::F32(self.to_f32().into_owned())
    }

    /// `x · Wᵀ` for `x` of `[rows, cols]`, with `W` of `[outputs, cols]`: `[rows, outputs]`.
    fn product(&self, x: &[f32], rows: usize, cols: usize, outputs: usize) -> Vec<f32> {
        match self {
            Matrix::F32(weight) => times_transposed(x, rows, cols, weight, outputs, parallelism(rows, outputs, cols)),
            Matrix::Quantized(matrix) if quantized_kernels_for(rows) => matrix.matmul(x, rows),
            Matrix::Quantized(matrix) => widened_tiles_product(matrix, x, rows),
        }
    }
}

/// `x · Wᵀ` through `gemm` for `x` of `[rows, cols]` and a row-major `weight` of `[outputs,
/// cols]`, on `threads`: `[rows, outputs]`.
fn times_transposed(
    x: &[f32],
    rows: usize,
    cols: usize,
    weight: &[f32],
    outputs: usize,
    threads: gemm::Parallelism,
) -> Vec<f32> {
    let mut y = vec![0.0; rows * outputs];
    gemm_with(
        rows,
        cols,
        outputs,
        Strided::new(x, cols as isize, 1),
        // Wᵀ: element (k, n) of the [cols, outputs] view is W[n][k].
        Strided::new(weight, 1, cols as isize),
        &mut y,
        outputs,
        threads,
    );
    y
}

/// From this many activation rows on, a quantized product widens tiles of weights and uses
/// `gemm` (unless the CPU has the panel kernels: [`quantized_kernels_for`]), which is
/// compute-efficient where the block kernels are not. Measured on SmolLM2, two cores, with the
/// grouped-scale kernels (`benchmarks/history/llm-cpu.md`): decode at 16 / 32 / 48 / 64 rows made
/// 263 / 273–281 / 263 / 249 tok/s through block kernels and 142 / 226 / 276 / 311 through
/// tiles, and a 512-token prefill 318 against 474.
const GEMM_ROWS: usize = 40;

/// Whether a quantized product of `rows` activation rows runs on [`crate::quant`]'s kernels
/// rather than on widened tiles: below [`GEMM_ROWS`], and at any size where the CPU has the
/// panel kernels (AVX-512 VNNI), whose 16-bit products outrun `gemm`'s f32 ones.
fn quantized_kernels_for(rows: usize) -> bool {
    rows < GEMM_ROWS || crate::quant::panels_here()
}

/// Weight rows widened at a time for a many-row product: 64 rows of a 1,536-wide matrix are
/// 393 KB of f32, which stays in L2 while `gemm` reads it.
const WIDENED_TILE: usize = 64;

/// `x · Wᵀ` for many activation rows: each thread widens a tile of weight rows into cache and
/// multiplies it with `gemm`, so the weights are read from memory once, quantized, and the
/// arithmetic runs at `gemm`'s speed.
fn widened_tiles_product(matrix: &QuantMatrix, x: &[f32], rows: usize) -> Vec<f32> {
    let (outputs, cols) = (matrix.rows(), matrix.cols());
    let tiles: Vec<Vec<f32>> = (0..outputs.div_ceil(WIDENED_TILE))
        .into_par_iter()
        .map(|tile| {
            let start = tile * WIDENED_TILE;
            let count = WIDENED_TILE.min(outputs - start);
            let weight = matrix.dequantize_rows(start, count);
            times_transposed(x, rows, cols, &weight, count, gemm::Parallelism::None)
        })
        .collect();
    let mut y = vec![0.0; rows * outputs];
    for (tile, values) in tiles.iter().enumerate() {
        let start = tile * WIDENED_TILE;
        let count = values.len() / rows.max(1);
        for (r, row) in values.chunks_exact(count.max(1)).enumerate() {
            y[r * outputs + start..r * outputs + start + count].copy_from_slice(row);
        }
    }
    y
}

/// A linear map `y = x·Wᵀ + b` with `W` of shape `[out, in]`.
#[derive(Debug)]
pub(crate) struct Linear {
    pub(crate) weight: Matrix,
    pub(crate) bias: Option<Vec<f32>>,
    input: usize,
    output: usize,
}

impl Linear {
    fn load(
        weights: &dyn TensorSource,
        prefix: &str,
        output: usize,
        input: usize,
        bias: bool,
    ) -> Result<Linear, LoadError> {
        Ok(Linear {
            weight: weights.matrix(&format!("{prefix}.weight"), &[output, input])?,
            bias: if bias {
                Some(weights.f32(&format!("{prefix}.bias"), &[output])?)
            } else {
                None
            },
            input,
            output,
        })
    }

    /// `x` is `[rows, input]`; returns `[rows, output]`.
    fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut y = self.weight.product(x, rows, self.input, self.output);
        self.add_bias(&mut y);
        y
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.output) {
                for (value, b) in row.iter_mut().zip(bias) {
                    *value += b;
                }
            }
        }
    }

    /// [`Linear::forward`] of each of `linears` on the same `x`: as one parallel product when
    /// their weights are quantized and the rows few ([`QuantMatrix::matmul_all`]), one by one
    /// otherwise. The results are the same either way.
    fn forward_all<const N: usize>(linears: [&Linear; N], x: &[f32], rows: usize) -> [Vec<f32>; N] {
        let Some(matrices) = linears
            .iter()
            .map(|&linear| match &linear.weight {
                Matrix::Quantized(matrix) if quantized_kernels_for(rows) && linear.input == linears[0].input => {
                    Some(matrix)
                }
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .and_then(|matrices| <[&QuantMatrix; N]>::try_from(matrices).ok())
        else {
            return linears.map(|linear| linear.forward(x, rows));
        };
        let mut ys = QuantMatrix::matmul_all(matrices, x, rows);
        for (y, linear) in ys.iter_mut().zip(linears) {
            linear.add_bias(y);
        }
        ys
    }
}

/// A read-only matrix view: `data[row * row_stride + col * col_stride]`.
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [f32],
    row_stride: isize,
    col_stride: isize,
}

impl<'a> Strided<'a> {
    fn new(data: &'a [f32], row_stride: isize, col_stride: isize) -> Strided<'a> {
        Strided {
            data,
            row_stride,
            col_stride,
        }
    }

    /// Whether every element of an `rows × cols` view lies inside `data`.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows as isize - 1) * self.row_stride + (cols as isize - 1) * self.col_stride;
        self.row_stride >= 0 && self.col_stride >= 0 && (last as usize) < self.data.len()
    }
}

/// `c[m, n] = a[m, k] · b[k, n]` with `c` row-major of row stride `c_row_stride`.
fn gemm(m: usize, k: usize, n: usize, a: Strided<'_>, b: Strided<'_>, c: &mut [f32], c_row_stride: usize) {
    gemm_with(m, k, n, a, b, c, c_row_stride, parallelism(m, n, k));
}

/// [`gemm()`] on the given threads.
#[allow(clippy::too_many_arguments)]
fn gemm_with(
    m: usize,
    k: usize,
    n: usize,
    a: Strided<'_>,
    b: Strided<'_>,
    c: &mut [f32],
    c_row_stride: usize,
    threads: gemm::Parallelism,
) {
    assert!(a.fits(m, k) && b.fits(k, n), "gemm operand out of bounds");
    assert!(
        m == 0 || n == 0 || (m - 1) * c_row_stride + n <= c.len(),
        "gemm output out of bounds"
    );
    // SAFETY: the asserts above keep every element the product touches inside the three
    // slices, and `c` is borrowed mutably, so it does not alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            c_row_stride as isize,
            false,
            a.data.as_ptr(),
            a.col_stride,
            a.row_stride,
            b.data.as_ptr(),
            b.col_stride,
            b.row_stride,
            0.0,
            1.0,
            false,
            false,
            false,
            threads,
        );
    }
}

/// Threads for a product: one for small ones (dispatch costs more than it saves), else all.
fn parallelism(m: usize, n: usize, k: usize) -> gemm::Parallelism {
    if m * n * k < 1 << 18 {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(0)
    }
}

/// Whether `config.json` describes a LLaVA-style vision-language model (read leniently: a file
/// that does not parse is left to the decoder's own config reader to report).
fn is_llava(config: &Path) -> bool {
    std::fs::read_to_string(config)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .is_some_and(|value| value.get("model_type").and_then(|v| v.as_str()) == Some("llava"))
}

/// Feature rows that stand in for a media item's placeholder tokens in a forward pass.
#[derive(Debug, Clone, Copy)]
pub struct MediaRows<'a> {
    /// The first placeholder's offset within the chunk.
    pub offset: usize,
    /// `[len, hidden_size]` row-major: one row per placeholder.
    pub rows: &'a [f32],
}

/// Why a forward pass was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// Media rows that do not fit their chunk.
    #[error(
        "media rows at offset {offset} ({values} values, hidden size {hidden}) do not fit a chunk of {tokens} tokens"
    )]
    MediaOutOfRange {
        /// Where the rows were to start.
        offset: usize,
        /// How many values they hold.
        values: usize,
        /// The model's hidden size.
        hidden: usize,
        /// The chunk's length.
        tokens: usize,
    },
    /// No tokens.
    #[error("the prompt is empty")]
    Empty,
    /// A token id outside the vocabulary.
    #[error("token id {id} at position {position} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Where it is in the prompt.
        position: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The block table does not cover the chunk's positions.
    #[error("the block table covers {covered} positions, the chunk needs {positions}")]
    BlocksMissing {
        /// Positions the chunk reaches.
        positions: usize,
        /// Positions the table covers.
        covered: usize,
    },
    /// The block table names a block the cache does not have.
    #[error("block {block} is outside the cache's {num_blocks} blocks")]
    BlockOutOfRange {
        /// The block id.
        block: u32,
        /// Blocks in the cache.
        num_blocks: usize,
    },
    /// More tokens than the model's context.
    #[error("{tokens} tokens exceed the model's context of {max}")]
    TooLong {
        /// Tokens given.
        tokens: usize,
        /// The model's `max_position_embeddings`.
        max: usize,
    },
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when the LM head is the embedding (tied).
    lm_head: Option<Matrix>,
    inv_freq: Vec<f32>,
}

impl Model {
    /// Loads a model: a Hugging Face directory (`config.json`, `*.safetensors`, and a
    /// `tokenizer.json` that is checked to load; for a LLaVA-style checkpoint, its language
    /// model) or a single `.gguf` file.
    ///
    /// # Errors
    ///
    /// A [`LoadError`] naming the missing or inconsistent file, key or tensor.
    pub fn load(path: &Path) -> Result<Model, LoadError> {
        Model::load_with_tokenizer(path).map(|(model, _)| model)
    }

    /// Loads the model as [`Model::load`] does, and returns its tokenizer too (a GGUF file's
    /// embedded one, rebuilt).
    ///
    /// # Errors
    ///
    /// A [`LoadError`] naming the missing or inconsistent file, key or tensor.
    pub fn load_with_tokenizer(path: &Path) -> Result<(Model, switchyard_tokenize::Tokenizer), LoadError> {
        if path.is_file() && path.extension().is_some_and(|ext| ext == "gguf") {
            let file = GgufFile::open(path)?;
            let config = file.model_config()?;
            let tokenizer = file.tokenizer()?;
            return Ok((Model::from_weights(config, &file)?, tokenizer));
        }
        let dir = path;
        // The config first: a missing or bad directory is reported by its config.json.
        let config = if is_llava(&dir.join("config.json")) {
            None
        } else {
            Some(ModelConfig::from_file(&dir.join("config.json"))?)
        };
        let tokenizer = dir.join("tokenizer.json");
        if !tokenizer.is_file() {
            return Err(LoadError::Missing {
                path: tokenizer,
                reason: "no tokenizer.json in the model directory".into(),
            });
        }
        let tokenizer = switchyard_tokenize::Tokenizer::from_file(&tokenizer).map_err(|err| LoadError::Tokenizer {
            path: tokenizer.clone(),
            reason: err.to_string(),
        })?;
        let Some(config) = config else {
            return Ok((Model::load_language_model(dir)?, tokenizer));
        };
        let weights = Weights::open(dir)?;
        Ok((Model::from_weights(config, &weights)?, tokenizer))
    }

    /// Builds the model from a config and its mapped weights.
    ///
    /// # Errors
    ///
    /// [`LoadError::Weights`] for a missing or misshapen tensor.
    pub fn from_weights(config: ModelConfig, weights: &dyn TensorSource) -> Result<Model, LoadError> {
        let c = &config;
        let (h, q_dim, kv_dim) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let embed = weights.matrix("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let layers = (0..c.num_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                Ok(Layer {
                    input_norm: weights.f32(&format!("{p}.input_layernorm.weight"), &[h])?,
                    q: Linear::load(weights, &format!("{p}.self_attn.q_proj"), q_dim, h, c.attention_bias)?,
                    k: Linear::load(weights, &format!("{p}.self_attn.k_proj"), kv_dim, h, c.attention_bias)?,
                    v: Linear::load(weights, &format!("{p}.self_attn.v_proj"), kv_dim, h, c.attention_bias)?,
                    o: Linear::load(weights, &format!("{p}.self_attn.o_proj"), h, q_dim, false)?,
                    post_attention_norm: weights.f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                    gate: Linear::load(weights, &format!("{p}.mlp.gate_proj"), c.intermediate_size, h, false)?,
                    up: Linear::load(weights, &format!("{p}.mlp.up_proj"), c.intermediate_size, h, false)?,
                    down: Linear::load(weights, &format!("{p}.mlp.down_proj"), h, c.intermediate_size, false)?,
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let norm = weights.f32("model.norm.weight", &[h])?;
        // Some tied checkpoints still carry lm_head.weight; use it if present, as transformers
        // does after tying (they are equal).
        let lm_head = if c.tie_word_embeddings && !weights.contains("lm_head.weight") {
            None
        } else {
            Some(weights.matrix("lm_head.weight", &[c.vocab_size, h])?)
        };
        // transformers computes the frequencies in f32; so do we, from the f64 formula.
        let inv_freq = config.inv_freq().into_iter().map(|f| f as f32).collect();
        Ok(Model {
            config,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The embedding table, `[vocab, hidden]`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn embedding(&self) -> &Matrix {
        &self.embed
    }

    /// Bytes the weights take in memory (matrices as kept, norms and frequencies aside).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
            .map(|linear| linear.weight.bytes())
            .sum();
        layers + self.embed.bytes() + self.lm_head.as_ref().map_or(0, Matrix::bytes)
    }

    /// Bytes a decode step reads from the weights: every matrix once, except an embedding table
    /// that is not also the LM head, of which it reads one row per token (norms aside).
    pub fn decode_step_bytes(&self) -> usize {
        match &self.lm_head {
            Some(_) => self.weight_bytes() - self.embed.bytes() + self.embed.bytes() / self.config.vocab_size.max(1),
            None => self.weight_bytes(),
        }
    }

    /// The same model with every quantized matrix widened to f32: what the quantized products
    /// are checked against, and the f32 path of the benchmarks.
    pub fn widened(&self) -> Model {
        let widen = |linear: &Linear| Linear {
            weight: linear.weight.widened(),
            bias: linear.bias.clone(),
            input: linear.input,
            output: linear.output,
        };
        Model {
            config: self.config.clone(),
            embed: self.embed.widened(),
            layers: self
                .layers
                .iter()
                .map(|l| Layer {
                    input_norm: l.input_norm.clone(),
                    q: widen(&l.q),
                    k: widen(&l.k),
                    v: widen(&l.v),
                    o: widen(&l.o),
                    post_attention_norm: l.post_attention_norm.clone(),
                    gate: widen(&l.gate),
                    up: widen(&l.up),
                    down: widen(&l.down),
                })
                .collect(),
            norm: self.norm.clone(),
            lm_head: self.lm_head.as_ref().map(Matrix::widened),
            inv_freq: self.inv_freq.clone(),
        }
    }

    /// The decoder layers (for other backends to copy).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The final norm's weight.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn final_norm(&self) -> &[f32] {
        &self.norm
    }

    /// The LM head, `[vocab, hidden]`; `None` when it is the embedding table (tied).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn untied_lm_head(&self) -> Option<&Matrix> {
        self.lm_head.as_ref()
    }

    /// The rotary inverse frequencies of one head, after scaling.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Runs the whole prompt through the model (positions 0..n, causal attention) and returns
    /// the logits of every position, `[tokens.len(), vocab_size]` row-major: [`Model::forward_with_media`]
    /// without media.
    ///
    /// # Errors
    ///
    /// [`ForwardError`] for an empty prompt, an id outside the vocabulary, or a prompt longer
    /// than the model's context.
    pub fn forward(&self, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        self.forward_with_media(tokens, &[])
    }

    /// Loads the language model of a LLaVA-style vision-language checkpoint (`config.json` with
    /// `model_type` `llava` and a Llama/Qwen2 `text_config`; the decoder's tensors under either
    /// of the layouts [`Renamed::language_model`](super::weights::Renamed::language_model) knows). Images reach it as feature rows at
    /// their placeholder positions ([`Model::forward_with_media`]); the vision tower and
    /// projector run on an encoder.
    ///
    /// # Errors
    ///
    /// A [`LoadError`] naming the file and the key or tensor.
    pub fn load_language_model(dir: &Path) -> Result<Model, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|err| LoadError::Missing {
            path: path.clone(),
            reason: err.to_string(),
        })?;
        let bad = |key: &str, reason: String| LoadError::Config {
            path: path.clone(),
            key: key.into(),
            reason,
        };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|err| bad("(file)", err.to_string()))?;
        let model_type = value.get("model_type").and_then(|v| v.as_str()).unwrap_or_default();
        if model_type != "llava" {
            return Err(bad("model_type", format!("`{model_type}` is not `llava`")));
        }
        let text_config = value
            .get("text_config")
            .filter(|v| v.is_object())
            .ok_or_else(|| bad("text_config", "missing".into()))?;
        let config = ModelConfig::parse(&text_config.to_string(), &path).map_err(|err| match err {
            LoadError::Config { path, key, reason } => LoadError::Config {
                path,
                key: format!("text_config.{key}"),
                reason,
            },
            other => other,
        })?;
        let weights = Weights::open(dir)?;
        Model::from_weights(config, &super::weights::Renamed::language_model(&weights))
    }

    /// Runs the whole prompt through [`Model::forward_batch_with_media`] with a throwaway cache
    /// of one block and returns every position's logits, as [`Model::forward`]; each [`MediaRows`] replaces the embeddings of the
    /// placeholder tokens at its offset with its feature rows (LLaVA's merge: text rows from the
    /// embedding table, media spans from the encoder), then the decoder runs as for text.
    ///
    /// # Errors
    ///
    /// As [`Model::forward`], and [`ForwardError::MediaOutOfRange`] for rows that do not fit.
    pub fn forward_with_media(&self, tokens: &[u32], media: &[MediaRows<'_>]) -> Result<Vec<f32>, ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        let mut kv = PagedKv::new(&self.config, tokens.len(), 1);
        let mut sequence = SequenceKv {
            blocks: vec![0],
            computed: 0,
        };
        let mut logits = self.forward_batch_with_media(
            &mut kv,
            &mut [Chunk {
                sequence: &mut sequence,
                tokens,
            }],
            &[media],
            Logits::All,
        )?;
        Ok(logits.pop().unwrap_or_default())
    }

    /// Computes one engine step: for each chunk, its tokens at positions
    /// `sequence.computed..` of its sequence, attending to everything the sequence has in the
    /// cache before them. Projections and the MLP run once over the rows of every chunk
    /// together (the batch); attention runs per sequence over its paged keys and values. The
    /// chunks' keys and values are written into their sequences' blocks and `computed` advances.
    /// Returns, per chunk, the logits of its last position (`[vocab]`) or of every position
    /// (`[tokens, vocab]`).
    ///
    /// # Errors
    ///
    /// [`ForwardError`] for an empty chunk, an id outside the vocabulary, a position past the
    /// model's context, or a block table that does not cover the chunk; nothing is written then.
    pub fn forward_batch(
        &self,
        kv: &mut PagedKv,
        chunks: &mut [Chunk<'_>],
        wanted: Logits,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.forward_batch_with_media(kv, chunks, &[], wanted)
    }

    /// [`Model::forward_batch`] with media rows: `media[i]` (absent for chunks past its end)
    /// lists the feature rows replacing placeholder embeddings in chunk `i`, at offsets within
    /// the chunk. A media span split over two prefill chunks is given to each as the rows that
    /// fall in it.
    ///
    /// # Errors
    ///
    /// As [`Model::forward_batch`], and [`ForwardError::MediaOutOfRange`] for rows that do not
    /// fit the chunk or are not whole rows of the hidden size; nothing is written then.
    pub fn forward_batch_with_media(
        &self,
        kv: &mut PagedKv,
        chunks: &mut [Chunk<'_>],
        media: &[&[MediaRows<'_>]],
        wanted: Logits,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        // The whole step runs on a worker of rayon's pool: a parallel product started there
        // splits its work with the pool's other workers by stealing, where one started from
        // outside the pool hands its work over and sleeps until it is done — two wake-ups
        // per product, ~210 products a token for SmolLM2.
        rayon::scope(|_| self.forward_in_pool(kv, chunks, media, wanted))
    }

    fn forward_in_pool(
        &self,
        kv: &mut PagedKv,
        chunks: &mut [Chunk<'_>],
        media: &[&[MediaRows<'_>]],
        wanted: Logits,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        let c = &self.config;
        let h = c.hidden_size;
        let rows: usize = chunks.iter().map(|chunk| chunk.tokens.len()).sum();
        let mut x = Vec::with_capacity(rows * h);
        let mut positions = Vec::with_capacity(rows);
        for (index, chunk) in chunks.iter().enumerate() {
            // Offsets whose rows come from media features, not the embedding table (their ids
            // are placeholders, outside the vocabulary).
            let mut from_media = vec![false; chunk.tokens.len()];
            for span in media.get(index).copied().unwrap_or_default() {
                let len = span.rows.len() / h;
                for covered in from_media.iter_mut().skip(span.offset).take(len) {
                    *covered = true;
                }
            }
            if chunk.tokens.is_empty() {
                return Err(ForwardError::Empty);
            }
            let end = chunk.sequence.computed + chunk.tokens.len();
            if end > c.max_position_embeddings {
                return Err(ForwardError::TooLong {
                    tokens: end,
                    max: c.max_position_embeddings,
                });
            }
            if end > chunk.sequence.blocks.len() * kv.block_size {
                return Err(ForwardError::BlocksMissing {
                    positions: end,
                    covered: chunk.sequence.blocks.len() * kv.block_size,
                });
            }
            if let Some(&block) = chunk.sequence.blocks.iter().find(|&&b| b as usize >= kv.num_blocks) {
                return Err(ForwardError::BlockOutOfRange {
                    block,
                    num_blocks: kv.num_blocks,
                });
            }
            for (offset, &id) in chunk.tokens.iter().enumerate() {
                if from_media[offset] {
                    x.extend(std::iter::repeat_n(0.0, h));
                    positions.push(chunk.sequence.computed + offset);
                    continue;
                }
                let row = id as usize;
                if row >= c.vocab_size {
                    return Err(ForwardError::TokenOutOfRange {
                        id,
                        position: chunk.sequence.computed + offset,
                        vocab: c.vocab_size,
                    });
                }
                let start = x.len();
                x.resize(start + h, 0.0);
                self.embed.row_into(row, h, &mut x[start..]);
                positions.push(chunk.sequence.computed + offset);
            }
        }
        let mut chunk_start = 0;
        for (index, chunk) in chunks.iter().enumerate() {
            for span in media.get(index).copied().unwrap_or_default() {
                let len = span.rows.len() / h;
                if span.rows.len() % h != 0 || len == 0 || span.offset + len > chunk.tokens.len() {
                    return Err(ForwardError::MediaOutOfRange {
                        offset: span.offset,
                        values: span.rows.len(),
                        hidden: h,
                        tokens: chunk.tokens.len(),
                    });
                }
                let start = (chunk_start + span.offset) * h;
                x[start..start + span.rows.len()].copy_from_slice(span.rows);
            }
            chunk_start += chunk.tokens.len();
        }
        for (index, layer) in self.layers.iter().enumerate() {
            let normed = rms_norm(&x, &layer.input_norm, c.rms_norm_eps);
            let attention = self.attention(index, layer, &normed, &positions, kv, chunks);
            add_in_place(&mut x, &layer.o.forward(&attention, rows));
            let normed = rms_norm(&x, &layer.post_attention_norm, c.rms_norm_eps);
            let [mut gate, up] = Linear::forward_all([&layer.gate, &layer.up], &normed, rows);
            silu_times(&mut gate, &up);
            add_in_place(&mut x, &layer.down.forward(&gate, rows));
        }
        // Only the rows whose logits are wanted go through the final norm and the LM head.
        let mut kept = Vec::new();
        let mut counts = Vec::with_capacity(chunks.len());
        let mut first = 0;
        for chunk in chunks.iter_mut() {
            let n = chunk.tokens.len();
            let rows = match wanted {
                Logits::All => first..first + n,
                Logits::Last => first + n - 1..first + n,
            };
            counts.push(rows.len());
            kept.extend_from_slice(&x[rows.start * h..rows.end * h]);
            first += n;
            chunk.sequence.computed += n;
        }
        let normed = rms_norm(&kept, &self.norm, c.rms_norm_eps);
        let total: usize = counts.iter().sum();
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let logits = head.product(&normed, total, h, c.vocab_size);
        let mut out = Vec::with_capacity(counts.len());
        let mut rest = logits.as_slice();
        for count in counts {
            let (mine, tail) = rest.split_at(count * c.vocab_size);
            out.push(mine.to_vec());
            rest = tail;
        }
        Ok(out)
    }

    /// Grouped-query attention of every chunk's rows (`normed`, `[rows, hidden]`, at absolute
    /// `positions`) in layer `index`; writes the rows' keys and values into the cache first, so
    /// each row attends to its sequence's cached positions and to the chunk's earlier rows.
    /// Returns `[rows, num_heads · head_dim]`.
    fn attention(
        &self,
        index: usize,
        layer: &Layer,
        normed: &[f32],
        positions: &[usize],
        kv: &mut PagedKv,
        chunks: &[Chunk<'_>],
    ) -> Vec<f32> {
        let c = &self.config;
        let d = c.head_dim;
        let rows = positions.len();
        let (q_width, kv_width) = (c.num_heads * d, c.num_kv_heads * d);
        let [mut q, mut k, v] = Linear::forward_all([&layer.q, &layer.k, &layer.v], normed, rows);
        let mut rotation = Vec::with_capacity(self.inv_freq.len());
        for (row, &position) in positions.iter().enumerate() {
            rotation_at(position, &self.inv_freq, &mut rotation);
            rope(&mut q[row * q_width..(row + 1) * q_width], &rotation);
            rope(&mut k[row * kv_width..(row + 1) * kv_width], &rotation);
        }
        let mut first = 0;
        for chunk in chunks {
            for offset in 0..chunk.tokens.len() {
                let row = first + offset;
                kv.write(
                    index,
                    &chunk.sequence.blocks,
                    chunk.sequence.computed + offset,
                    &k[row * kv_width..(row + 1) * kv_width],
                    &v[row * kv_width..(row + 1) * kv_width],
                );
            }
            first += chunk.tokens.len();
        }

        let scale = 1.0 / (d as f32).sqrt();
        let group = c.num_heads / c.num_kv_heads;
        let mut out = vec![0.0; rows * q_width];
        // Each chunk's rows of the output in groups of up to `ATTENTION_ROWS`, so sequences,
        // and a long prefill's groups of rows, are attended to in parallel. A group attends
        // only to the positions up to its last row: a 512-token prefill computes a little over
        // half the scores a single group would (the causal triangle's far side is skipped).
        let mut work = Vec::with_capacity(chunks.len());
        let mut rest = out.as_mut_slice();
        let mut first = 0;
        for chunk in chunks {
            let n = chunk.tokens.len();
            let (mine, tail) = rest.split_at_mut(n * q_width);
            rest = tail;
            for (g, group_rows) in mine.chunks_mut(ATTENTION_ROWS * q_width).enumerate() {
                let offset = g * ATTENTION_ROWS;
                let len = group_rows.len() / q_width;
                work.push((
                    group_rows,
                    &q[(first + offset) * q_width..(first + offset + len) * q_width],
                    chunk.sequence.computed + offset,
                    chunk.sequence.blocks.as_slice(),
                ));
            }
            first += n;
        }
        let kv = &*kv;
        let attend = |(out_rows, q_rows, start, blocks): (&mut [f32], &[f32], usize, &[u32])| {
            let n = q_rows.len() / q_width;
            let context = start + n;
            if n == 1 {
                // A decode step: read the keys and values where they lie, with no gathering
                // copy and no `gemm` calls sized for one row.
                let query = DecodeQuery {
                    layer: index,
                    blocks,
                    context,
                    heads: c.num_heads,
                    group,
                    dim: d,
                    scale,
                    values: q_rows,
                };
                return kv.attend_one(&query, out_rows);
            }
            // The sequence's keys and values, gathered from its blocks into [context, kv_width].
            let (keys, values) = kv.gather(index, blocks, context);
            let mut scores = vec![0.0; n * context];
            for head in 0..c.num_heads {
                let kv_head = head / group;
                gemm(
                    n,
                    d,
                    context,
                    Strided::new(&q_rows[head * d..], q_width as isize, 1),
                    Strided::new(&keys[kv_head * d..], 1, kv_width as isize),
                    &mut scores,
                    context,
                );
                for (i, row) in scores.chunks_exact_mut(context).enumerate() {
                    // Row i is position start + i: it sees keys 0..=start + i.
                    let (visible, hidden) = row.split_at_mut(start + i + 1);
                    for s in visible.iter_mut() {
                        *s *= scale;
                    }
                    softmax(visible);
                    hidden.fill(0.0);
                }
                gemm(
                    n,
                    context,
                    d,
                    Strided::new(&scores, context as isize, 1),
                    Strided::new(&values[kv_head * d..], kv_width as isize, 1),
                    &mut out_rows[head * d..],
                    q_width,
                );
            }
        };
        // Multiply-adds of the scores and the weighted sums: below this, threads cost more than
        // they save (measured: tiny models at batch 8 got slower).
        let products: usize = work
            .iter()
            .map(|(_, q_rows, start, _)| {
                let n = q_rows.len() / q_width;
                2 * n * (start + n) * q_width
            })
            .sum();
        if work.len() > 1 && products >= 1 << 18 {
            work.into_par_iter().for_each(attend);
        } else {
            work.into_iter().for_each(attend);
        }
        out
    }
}

/// Query rows attended to together (one gathering of the keys, two products per head): enough
/// rows to keep the products efficient, few enough that a prefill's groups skip most of the
/// causal triangle's far side and spread over the threads.
const ATTENTION_ROWS: usize = 64;

/// Which logits a step returns for each chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's (what sampling needs).
    Last,
    /// Every position's (for scoring and tests).
    All,
}

/// One sequence's share of a step: the tokens to compute next.
#[derive(Debug)]
pub struct Chunk<'a> {
    /// The sequence they extend.
    pub sequence: &'a mut SequenceKv,
    /// Its next tokens (a prefill chunk, or one token when decoding).
    pub tokens: &'a [u32],
}

/// The `(sin, cos)` of each rotary frequency's angle at `position`, into `rotation`: one
/// table serves every head of a row's queries and keys (SmolLM2: 12 heads), where a `sin_cos`
/// per head and pair took 1.6 % of a batched decode step's samples.
fn rotation_at(position: usize, inv_freq: &[f32], rotation: &mut Vec<(f32, f32)>) {
    rotation.clear();
    rotation.extend(inv_freq.iter().map(|freq| (position as f32 * freq).sin_cos()));
}

/// Rotates every head in `row` (heads of `2 · rotation.len()` values) by the angles of
/// `rotation` ([`rotation_at`]), in transformers' rotate-half layout: pairs are
/// `(x[i], x[i + d/2])`.
fn rope(row: &mut [f32], rotation: &[(f32, f32)]) {
    let half = rotation.len();
    for head in row.chunks_exact_mut(2 * half) {
        for (i, &(sin, cos)) in rotation.iter().enumerate() {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}

/// `x / sqrt(mean(x²) + eps) · weight`, row by row.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let width = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(width) {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let inverse = 1.0 / (mean_square + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(v, w)| v * inverse * w));
    }
    out
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate[i] = silu(gate[i]) · up[i]`, eight values at a time: the exponential in vector
/// registers ([`wide`]'s, within two units in the last place of `expf`) instead of a libm call
/// per value.
fn silu_times(gate: &mut [f32], up: &[f32]) {
    let (gate8, gate_rest) = gate.as_chunks_mut::<8>();
    let (up8, up_rest) = up.as_chunks::<8>();
    for (g, u) in gate8.iter_mut().zip(up8) {
        let x = f32x8::from(*g);
        *g = (x / (f32x8::ONE + (-x).exp()) * f32x8::from(*u)).to_array();
    }
    for (g, u) in gate_rest.iter_mut().zip(up_rest) {
        *g = silu(*g) * u;
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_gemm_matches_a_direct_product() {
        // a = [[1, 2, 3], [4, 5, 6]], w = [[1, 0, 1], [0, 1, 0]] ([out=2, in=3]); y = a·wᵀ.
        let linear = Linear {
            weight: Matrix::F32(vec![1.0, 0.0, 1.0, 0.0, 1.0, 0.0]),
            bias: Some(vec![0.5, -0.5]),
            input: 3,
            output: 2,
        };
        let y = linear.forward(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2);
        assert_eq!(y, vec![4.5, 1.5, 10.5, 4.5]);
    }

    /// Units in the last place between `a` and `b` (finite, same sign).
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn vector_silu_and_softmax_keep_to_two_ulps_of_the_scalar_ones() {
        // Values across SiLU's range, the tails included, and a length with a remainder.
        let gate: Vec<f32> = (0..203).map(|i| (i as f32 - 101.0) * 0.37).collect();
        let up: Vec<f32> = (0..203).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut vector = gate.clone();
        silu_times(&mut vector, &up);
        for ((&v, &g), &u) in vector.iter().zip(&gate).zip(&up) {
            let scalar = silu(g) * u;
            assert!(
                ulps(v, scalar) <= 2 || (v - scalar).abs() < 1e-30,
                "silu({g}) · {u}: {v} against {scalar}"
            );
        }
        let row: Vec<f32> = (0..37).map(|i| ((i * 13) % 29) as f32 * 0.9 - 12.0).collect();
        let mut vector = row.clone();
        softmax(&mut vector);
        let max = row.iter().fold(f32::NEG_INFINITY, |m, s| m.max(*s));
        let exps: Vec<f32> = row.iter().map(|s| (s - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        for (&v, e) in vector.iter().zip(&exps) {
            assert!(ulps(v, e / sum) <= 4, "softmax: {v} against {}", e / sum);
        }
    }

    #[test]
    fn rope_at_position_zero_is_the_identity_and_preserves_norms() {
        let inv_freq = [1.0, 0.1];
        let mut rotation = Vec::new();
        let mut row = [1.0, 2.0, 3.0, 4.0];
        rotation_at(0, &inv_freq, &mut rotation);
        rope(&mut row, &rotation);
        assert_eq!(row, [1.0, 2.0, 3.0, 4.0]);
        rotation_at(7, &inv_freq, &mut rotation);
        rope(&mut row, &rotation);
        let norm = |a: f32, b: f32| (a * a + b * b).sqrt();
        assert!((norm(row[0], row[2]) - norm(1.0, 3.0)).abs() < 1e-5);
        assert!((norm(row[1], row[3]) - norm(2.0, 4.0)).abs() < 1e-5);
    }
}
