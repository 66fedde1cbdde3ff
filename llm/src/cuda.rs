//! The CUDA backend: the same forward pass as the CPU's, on one NVIDIA GPU through cudarc.
//!
//! Everything CUDA is loaded at run time (cudarc's dynamic loading: the driver, NVRTC and
//! cuBLAS), so this module builds on machines without CUDA and a worker asked for a GPU that
//! is not there gets an error saying which part is missing. The kernels in `cuda_kernels.cu`
//! (embedding, RMSNorm, bias, RoPE with the paged-cache write, paged attention with an online
//! softmax — a thread per key for small decode steps, each (row, head)'s keys split over
//! several blocks and merged where the step has too few rows to fill the GPU
//! (flash-decoding), a warp per key otherwise — SiLU-multiply, greedy argmax) are compiled by
//! NVRTC when the backend starts; products are cuBLAS SGEMMs, with the query/key/value and
//! gate/up projections fused into one product each and the residual adds folded into the
//! output products (β = 1). Weights are f32
//! and laid out as on the CPU, so both backends can be compared value by value; the paged KV
//! cache is f32, or f16 ([`CudaExecutor::with_precision`]: twice the tokens in the same memory,
//! rounded as the CPU's f16 cache rounds them). Greedy
//! sequences take their token from the GPU's argmax (4 bytes back per sequence); others copy
//! their logits back and sample on the host with their own seeded sampler.
//!
//! The cache's blocks move between workers through host memory (prefill/decode
//! disaggregation): an export copies each layer's rows of a block device→host into a payload
//! of [`crate::kv::transfer`]'s format, an import checks a payload's shape and dtype and copies
//! it host→device, both on the executor's stream, so they follow the steps before them. The
//! layout is the CPU cache's, so payloads move between the two backends as they are.
//!
//! Decode steps (one new token per sequence, no media, up to [`MAX_DECODE_GRAPH_BATCH`]
//! sequences) replay CUDA graphs, as vLLM does: one per power-of-two batch bucket, captured at
//! its first use on buffers allocated once, the batch padded to its bucket with rows that read
//! and write a cache block of their own. A step is ~10 launches per layer, so at small batches
//! launching costs more than the work. Prefill and media steps run kernel by kernel on buffers
//! of their own.
//!
//! # Rejected designs
//!
//! Measured on an H100 with `llm_cuda`; the runs are in `benchmarks/history/gpu.md`.
//!
//! - A product kernel for few rows (one block per 8 outputs, each weight row read once) in place
//!   of cuBLAS's SGEMM: 0.76–0.90× cuBLAS at batch 1 to 8.
//! - The thread-per-key attention kernel for prefill and large batches: prefill 97,297 against
//!   158,328 tok/s, batch 256 0.95×; once split, for steps of up to 256 rows: batch 100 at 47,474
//!   / 47,183 against 54,807 / 54,178 tok/s.
//! - Split attention aiming at 4,096 blocks instead of 2,048: within the noise.

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaFunction, CudaGraph, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use switchyard_native::cuda::Device;

use crate::config::ModelConfig;
use crate::kv::KvPrecision;
use crate::kv::transfer::{KvBlockShape, KvPayloadError};
use crate::model::{MediaRows, Model};
use switchyard_workers::engine::{BlockId, Executor, KvMedium, ModelLimits, StepItem};

/// The kernels' CUDA C source.
pub const KERNELS: &str = include_str!("cuda_kernels.cu");

/// The kernels the backend launches, by their `extern "C"` names: those of an f32 cache, then
/// the three that read or write an f16 one (`F16_CACHE_KERNELS` stand in for the fifth,
/// sixth and ninth), then the merge of split attention.
pub const KERNEL_NAMES: [&str; 13] = [
    "embed",
    "gather_rows",
    "rms_norm",
    "add_bias",
    "rope_and_store",
    "paged_attention",
    "silu_mul",
    "argmax",
    "paged_attention_by_key",
    "rope_and_store_f16",
    "paged_attention_f16",
    "paged_attention_by_key_f16",
    "combine_splits",
];

/// The indices in [`KERNEL_NAMES`] of the f16 cache's `rope_and_store`, `paged_attention` and
/// `paged_attention_by_key`.
const F16_CACHE_KERNELS: [usize; 3] = [9, 10, 11];

/// Why the CUDA backend could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// CUDA's libraries, the device, the driver, NVRTC or cuBLAS failed (see [`SetupError`]).
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The model does not fit the kernels' limits.
    #[error("unsupported model shape: {0}")]
    Unsupported(String),
}

fn driver(err: cudarc::driver::DriverError) -> CudaError {
    CudaError::Setup(SetupError::Driver(err.to_string()))
}

pub use switchyard_native::cuda::{SetupError, driver_present, nvrtc_present};

/// Compiles the kernels to PTX. Needs NVRTC only, not a GPU, so CPU machines can check them.
///
/// # Errors
///
/// [`SetupError::NoNvrtc`] without NVRTC, [`SetupError::Compile`] with the compiler's log.
pub fn compile_kernels() -> Result<cudarc::nvrtc::Ptx, CudaError> {
    Ok(switchyard_native::cuda::compile(KERNELS, "switchyard_llm.cu")?)
}

struct Kernels {
    embed: CudaFunction,
    gather_rows: CudaFunction,
    rms_norm: CudaFunction,
    add_bias: CudaFunction,
    rope_and_store: CudaFunction,
    paged_attention: CudaFunction,
    silu_mul: CudaFunction,
    argmax: CudaFunction,
    paged_attention_by_key: CudaFunction,
    combine_splits: CudaFunction,
}

struct GpuLayer {
    input_norm: CudaSlice<f32>,
    /// `[q + 2·kv, hidden]`: the query, key and value projections stacked.
    qkv: CudaSlice<f32>,
    qkv_bias: Option<CudaSlice<f32>>,
    o: CudaSlice<f32>,
    post_attention_norm: CudaSlice<f32>,
    /// `[2·intermediate, hidden]`: gate then up.
    gate_up: CudaSlice<f32>,
    down: CudaSlice<f32>,
    /// `[num_blocks · block_size, kv_width]`, f32 or f16 (the kernels take the pointer as
    /// either; here it is counted in 16-bit units, two to an f32).
    keys: CudaSlice<u16>,
    values: CudaSlice<u16>,
}

/// Media rows to copy over a step's embedded rows: the index in `x` of their first value, and
/// the values.
type MediaCopy<'a> = (usize, &'a [f32]);

/// One sequence's share of a GPU step (what [`StepItem`] carries, without the sampler).
#[derive(Debug, Clone, Copy)]
pub struct GpuChunk<'a> {
    /// Every token of the sequence so far.
    pub tokens: &'a [u32],
    /// Tokens already in the cache.
    pub start: usize,
    /// Tokens to compute now.
    pub count: usize,
    /// The block table.
    pub blocks: &'a [u32],
    /// Media feature rows standing in for placeholders among the tokens computed now, at
    /// offsets from `start` (their ids are outside the vocabulary and are not looked up).
    pub media: &'a [MediaRows<'a>],
}

/// The CUDA backend: the model's weights and the paged KV cache in GPU memory.
pub struct CudaExecutor {
    config: ModelConfig,
    ordinal: usize,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    embed: CudaSlice<f32>,
    /// `None` when tied to the embedding.
    lm_head: Option<CudaSlice<f32>>,
    norm: CudaSlice<f32>,
    inv_freq: CudaSlice<f32>,
    layers: Vec<GpuLayer>,
    block_size: usize,
    num_blocks: usize,
    /// What one block of the cache is made of, for moving blocks between workers.
    block_shape: KvBlockShape,
    /// cuBLAS's workspace, ours so that cuBLAS never allocates (a capture would not allow it).
    _workspace: CudaSlice<u8>,
    /// Decode steps as CUDA graphs, allocated at the first decode step; `None` until then.
    decode: Option<Box<DecodeGraphs>>,
    decode_graphs: bool,
    attention: AttentionKernel,
    stats: DecodeGraphStats,
}

/// Most rows of a decode step that [`AttentionKernel::ByKey`] takes. Measured on an H100
/// (`benchmarks/history/gpu.md`): a thread per key wins while a step has too few (row, head)
/// blocks to fill the GPU; with more, and for prefill, a warp per key reads the keys coalesced
/// and wins.
const BY_KEY_MAX_ROWS: usize = 64;

/// (Row, head, split) blocks a split decode step's attention aims for: about 16 per
/// multiprocessor of an H100 (132), so that a step of a few sequences does not leave most of
/// them idle while each block walks its whole context. Measured against 1,024 on an H100
/// (`benchmarks/history/gpu.md`): the same at batch 1 and 8, faster past a long context at 32
/// and 64 rows.
const SPLIT_BLOCKS: usize = 2048;

/// Most splits of one (row, head)'s keys.
const MAX_SPLITS: usize = 16;

/// How many ways a decode step of `rows` rows splits each (row, head)'s keys: enough blocks for
/// [`SPLIT_BLOCKS`], at most [`MAX_SPLITS`]. Fixed by the step's shape, not its contexts, so a
/// captured graph holds for every context; splits a short context does not reach take no keys
/// and cost a block that returns at once.
fn attention_splits(rows: usize, heads: usize) -> usize {
    (SPLIT_BLOCKS / (rows * heads).max(1)).clamp(1, MAX_SPLITS)
}

/// Room for the partial results of split attention in any decode step of up to `rows` rows:
/// a step of `r` rows has `r · heads · attention_splits(r)` (row, head, split) blocks, at most
/// [`SPLIT_BLOCKS`] where it splits and `r · heads` where it does not, and steps past
/// [`BY_KEY_MAX_ROWS`] rows do not split.
fn partial_floats(rows: usize, heads: usize, head_dim: usize) -> usize {
    (rows.min(BY_KEY_MAX_ROWS) * heads).max(SPLIT_BLOCKS) * (head_dim + 2)
}

/// Which paged-attention kernel the steps launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// `paged_attention_by_key` for decode steps of up to 64 sequences (every thread scores a
    /// key of its own and groups of threads sum the values; heads of up to 128 dimensions),
    /// each (row, head)'s keys split over several blocks where the step has few rows
    /// (flash-decoding, merged by `combine_splits`), and `paged_attention` for everything else.
    #[default]
    ByKey,
    /// As [`AttentionKernel::ByKey`], every (row, head) in one block (the bench's baseline for
    /// the splits).
    ByKeyUnsplit,
    /// `paged_attention` for every step: a warp per key in turn (the bench's baseline).
    ByWarp,
}

/// Largest batch a decode graph is captured for; larger decode steps run eagerly.
pub const MAX_DECODE_GRAPH_BATCH: usize = 256;

/// Bytes of the cuBLAS workspace (what cuBLAS takes by default on recent GPUs).
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// How decode steps ran: graph replays, eager steps (prefill, media, more sequences than
/// [`MAX_DECODE_GRAPH_BATCH`], graphs off, or a capture that failed) and graphs captured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeGraphStats {
    /// Steps answered by replaying a captured graph.
    pub replays: u64,
    /// Steps run kernel by kernel.
    pub eager_steps: u64,
    /// Graphs captured (one per batch bucket used).
    pub captures: u64,
}

/// A captured decode step. cudarc's `CudaGraph` holds raw driver handles and is not `Send`;
/// this one is launched and dropped only through its executor's `&mut self`, one thread at a
/// time, as the driver's rules for graph objects ask.
struct DecodeGraph(CudaGraph);

// SAFETY: see above: never used from two threads at once.
unsafe impl Send for DecodeGraph {}

/// The decode graphs: one set of step buffers for [`MAX_DECODE_GRAPH_BATCH`] rows, and a graph
/// per power-of-two batch bucket captured on them. A step of `n` sequences takes the smallest
/// bucket holding `n`; the rows past `n` are padding that reads and writes a block of its own.
struct DecodeGraphs {
    buffers: StepBuffers,
    /// Block-table stride of every graph: enough blocks for the model's longest sequence.
    max_blocks: usize,
    /// `(bucket, graph)`; `None` where capture failed (that bucket then runs eagerly).
    graphs: Vec<(usize, Option<DecodeGraph>)>,
}

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExecutor")
            .field("device", &self.ordinal)
            .field("layers", &self.layers.len())
            .field("block_size", &self.block_size)
            .field("num_blocks", &self.num_blocks)
            .finish_non_exhaustive()
    }
}

/// Everything one step's kernels read and write on the device: allocated per step when eager,
/// once (for [`MAX_DECODE_GRAPH_BATCH`] rows) for the decode graphs.
struct StepBuffers {
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attention: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    activation: CudaSlice<f32>,
    ids: CudaSlice<u32>,
    positions: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    row_sequence: CudaSlice<i32>,
    block_tables: CudaSlice<i32>,
    last_rows: CudaSlice<i32>,
    kept: CudaSlice<f32>,
    kept_normed: CudaSlice<f32>,
    /// `[sequences, vocab]`: each sequence's last-position logits.
    logits: CudaSlice<f32>,
    /// Split attention's partial results: per row, head and split, `head_dim` values, their max
    /// score and their sum of weights.
    partials: CudaSlice<f32>,
}

/// A step's shape: rows computed, sequences (logit rows), block-table stride.
#[derive(Debug, Clone, Copy)]
struct StepShape {
    rows: usize,
    sequences: usize,
    max_blocks: usize,
}

/// A step's inputs on the host, as [`StepBuffers`] receives them.
struct HostStep<'c> {
    ids: Vec<u32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    row_sequence: Vec<i32>,
    block_tables: Vec<i32>,
    last_rows: Vec<i32>,
    media: Vec<MediaCopy<'c>>,
}

impl CudaExecutor {
    /// Copies `model` to GPU `ordinal` with a KV cache of `num_blocks` blocks of
    /// `block_size` positions, and compiles the kernels.
    ///
    /// # Errors
    ///
    /// [`CudaError`] when the driver, NVRTC, cuBLAS or the device is missing, memory runs out,
    /// or the kernels do not compile.
    pub fn new(model: &Model, ordinal: usize, block_size: usize, num_blocks: usize) -> Result<CudaExecutor, CudaError> {
        CudaExecutor::with_precision(model, ordinal, block_size, num_blocks, KvPrecision::F32)
    }

    /// [`CudaExecutor::new`] with the cache in `precision`: f16 holds twice the tokens in the
    /// same memory, rounded once as they are written, as the CPU backend's f16 cache does.
    ///
    /// # Errors
    ///
    /// As [`CudaExecutor::new`].
    pub fn with_precision(
        model: &Model,
        ordinal: usize,
        block_size: usize,
        num_blocks: usize,
        precision: KvPrecision,
    ) -> Result<CudaExecutor, CudaError> {
        switchyard_native::cuda::check_device(ordinal)?;
        let config = model.config().clone();
        if config.head_dim > 512 || !config.head_dim.is_multiple_of(2) {
            return Err(CudaError::Unsupported(format!(
                "head_dim {} (the attention kernel takes even widths up to 512)",
                config.head_dim
            )));
        }
        let ptx = compile_kernels()?;
        let Device {
            stream,
            module,
            blas,
            workspace,
        } = switchyard_native::cuda::open(ordinal, ptx, CUBLAS_WORKSPACE)?;
        let load = |name: &str| module.load_function(name).map_err(driver);
        let [rope_and_store, paged_attention, paged_attention_by_key] = match precision {
            KvPrecision::F32 => [4, 5, 8],
            KvPrecision::F16 => F16_CACHE_KERNELS,
        };
        let kernels = Kernels {
            embed: load(KERNEL_NAMES[0])?,
            gather_rows: load(KERNEL_NAMES[1])?,
            rms_norm: load(KERNEL_NAMES[2])?,
            add_bias: load(KERNEL_NAMES[3])?,
            rope_and_store: load(KERNEL_NAMES[rope_and_store])?,
            paged_attention: load(KERNEL_NAMES[paged_attention])?,
            silu_mul: load(KERNEL_NAMES[6])?,
            argmax: load(KERNEL_NAMES[7])?,
            paged_attention_by_key: load(KERNEL_NAMES[paged_attention_by_key])?,
            combine_splits: load(KERNEL_NAMES[12])?,
        };
        let upload = |values: &[f32]| stream.clone_htod(values).map_err(driver);
        // One block more than the engine hands out: the decode graphs' padding rows write there.
        let kv_values = (num_blocks + 1) * block_size * config.num_kv_heads * config.head_dim;
        let kv_units = kv_values * precision.bytes() / 2;
        let mut layers = Vec::with_capacity(config.num_layers);
        for layer in model.layers() {
            // Quantized matrices are widened here: the CUDA kernels take f32.
            let mut qkv = layer.q.weight.to_f32().into_owned();
            qkv.extend_from_slice(&layer.k.weight.to_f32());
            qkv.extend_from_slice(&layer.v.weight.to_f32());
            let qkv_bias = match (&layer.q.bias, &layer.k.bias, &layer.v.bias) {
                (Some(q), Some(k), Some(v)) => {
                    let mut bias = q.clone();
                    bias.extend_from_slice(k);
                    bias.extend_from_slice(v);
                    Some(upload(&bias)?)
                }
                _ => None,
            };
            let mut gate_up = layer.gate.weight.to_f32().into_owned();
            gate_up.extend_from_slice(&layer.up.weight.to_f32());
            layers.push(GpuLayer {
                input_norm: upload(&layer.input_norm)?,
                qkv: upload(&qkv)?,
                qkv_bias,
                o: upload(&layer.o.weight.to_f32())?,
                post_attention_norm: upload(&layer.post_attention_norm)?,
                gate_up: upload(&gate_up)?,
                down: upload(&layer.down.weight.to_f32())?,
                keys: stream.alloc_zeros(kv_units).map_err(driver)?,
                values: stream.alloc_zeros(kv_units).map_err(driver)?,
            });
        }
        let embed = upload(&model.embedding().to_f32())?;
        let lm_head = match model.untied_lm_head() {
            Some(head) => Some(upload(&head.to_f32())?),
            None => None,
        };
        let block_shape = KvBlockShape::of(&config, block_size, precision);
        Ok(CudaExecutor {
            norm: upload(model.final_norm())?,
            inv_freq: upload(model.inv_freq())?,
            embed,
            lm_head,
            layers,
            config,
            ordinal,
            stream,
            blas,
            kernels,
            block_size,
            num_blocks,
            block_shape,
            _workspace: workspace,
            decode: None,
            decode_graphs: true,
            attention: AttentionKernel::default(),
            stats: DecodeGraphStats::default(),
        })
    }

    /// Turns the decode graphs on (the default) or off (every step then runs kernel by
    /// kernel: the bench's baseline); turning them off drops the captured graphs.
    pub fn set_decode_graphs(&mut self, on: bool) {
        self.decode_graphs = on;
        if !on {
            self.decode = None;
        }
    }

    /// Chooses the paged-attention kernel ([`AttentionKernel::ByKey`] by default); captured
    /// decode graphs are dropped.
    pub fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        self.attention = kernel;
        self.decode = None;
    }

    /// How steps ran so far.
    pub fn decode_graph_stats(&self) -> DecodeGraphStats {
        self.stats
    }

    /// The range of block `block`'s values in a layer's keys or values, in the 16-bit units
    /// the buffers are counted in (an f32 value is two).
    fn block_units(&self, block: u32) -> Result<std::ops::Range<usize>, KvPayloadError> {
        // The extra block past `num_blocks` is the decode graphs' padding, never the engine's.
        if block as usize >= self.num_blocks {
            return Err(KvPayloadError::Block {
                block,
                blocks: self.num_blocks,
            });
        }
        let units = self.block_shape.layer_bytes() / 2;
        let start = block as usize * units;
        Ok(start..start + units)
    }

    /// Block `block`'s keys and values of every layer, copied device→host into a payload of
    /// [`crate::kv::transfer`]'s format, in the precision the cache holds them.
    ///
    /// # Errors
    ///
    /// [`KvPayloadError::Block`] for a block outside the cache, [`KvPayloadError::Device`] for
    /// a failed copy.
    pub fn export_block(&self, block: u32) -> Result<Vec<u8>, KvPayloadError> {
        let range = self.block_units(block)?;
        let units = range.len();
        let device = |err: cudarc::driver::DriverError| KvPayloadError::Device(err.to_string());
        let mut host = vec![0u16; 2 * self.layers.len() * units];
        let mut parts = host.chunks_exact_mut(units.max(1));
        for layer in &self.layers {
            for buffer in [&layer.keys, &layer.values] {
                let (Some(part), Some(view)) = (parts.next(), buffer.try_slice(range.clone())) else {
                    return Err(KvPayloadError::Block {
                        block,
                        blocks: self.num_blocks,
                    });
                };
                self.stream.memcpy_dtoh(&view, part).map_err(device)?;
            }
        }
        // The copies are queued behind the steps that wrote the block; the host buffer is read
        // only once they are done.
        self.stream.synchronize().map_err(device)?;
        let mut payload = self.block_shape.start_payload();
        // Little-endian 16-bit units are the device's bytes in order (CUDA devices and hosts
        // are little-endian), so an f32 cache's values come out as f32 little-endian.
        payload.extend(host.iter().flat_map(|unit| unit.to_le_bytes()));
        Ok(payload)
    }

    /// Writes `payload` (as [`CudaExecutor::export_block`] or the CPU cache makes them) into
    /// block `block`, host→device, after checking its shape and dtype; nothing is written when
    /// they are not this cache's.
    ///
    /// # Errors
    ///
    /// [`KvPayloadError`] for a payload of another shape, dtype, format or length, a block
    /// outside the cache, or a failed copy.
    pub fn import_block(&mut self, block: u32, payload: &[u8]) -> Result<(), KvPayloadError> {
        let range = self.block_units(block)?;
        let data = self.block_shape.data(payload)?;
        let host: Vec<u16> = data
            .as_chunks::<2>()
            .0
            .iter()
            .map(|bytes| u16::from_le_bytes(*bytes))
            .collect();
        let device = |err: cudarc::driver::DriverError| KvPayloadError::Device(err.to_string());
        let mut parts = host.chunks_exact(range.len().max(1));
        for layer in &mut self.layers {
            for buffer in [&mut layer.keys, &mut layer.values] {
                let (Some(part), Some(mut view)) = (parts.next(), buffer.try_slice_mut(range.clone())) else {
                    return Err(KvPayloadError::Block {
                        block,
                        blocks: self.num_blocks,
                    });
                };
                self.stream.memcpy_htod(part, &mut view).map_err(device)?;
            }
        }
        // `host` must outlive the copies queued from it.
        self.stream.synchronize().map_err(device)
    }

    /// What the model accepts.
    pub fn limits(&self) -> ModelLimits {
        ModelLimits {
            vocab_size: Some(self.config.vocab_size),
            max_model_len: Some(self.config.max_position_embeddings),
            media_dim: Some(self.config.hidden_size),
        }
    }

    /// `y[rows, output] (+)= x[rows, input] · W[output, input]ᵀ`, row-major, as column-major
    /// cuBLAS sees it: `yᵀ = W · xᵀ`.
    fn linear(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        (rows, input, output): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let int = |v: usize| i32::try_from(v).map_err(|_| CudaError::Unsupported(format!("dimension {v} exceeds i32")));
        let config = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: int(output)?,
            n: int(rows)?,
            k: int(input)?,
            alpha: 1.0f32,
            lda: int(input)?,
            ldb: int(input)?,
            beta: if accumulate { 1.0 } else { 0.0 },
            ldc: int(output)?,
        };
        // SAFETY: the three buffers hold at least `output·input`, `rows·input` and
        // `rows·output` values (the callers size them so), and `y` does not alias the others.
        unsafe { self.blas.gemm(config, weight, x, y) }
            .map_err(|err| CudaError::Setup(SetupError::Blas(err.to_string())))
    }

    fn rows_launch(rows: usize, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), CudaError> {
        let width = self.config.hidden_size as i32;
        let eps = self.config.rms_norm_eps;
        let mut launch = self.stream.launch_builder(&self.kernels.rms_norm);
        launch.arg(x).arg(weight).arg(out).arg(&width).arg(&eps);
        // SAFETY: the kernel reads `rows·width` values of `x` and writes as many to `out`.
        unsafe { launch.launch(Self::rows_launch(rows, 256)) }.map_err(driver)?;
        Ok(())
    }

    /// Checks a step and lays out its inputs, block tables `max_blocks` wide.
    fn host_step<'c>(&self, chunks: &[GpuChunk<'c>], max_blocks: usize) -> Result<HostStep<'c>, CudaError> {
        let c = &self.config;
        let rows: usize = chunks.iter().map(|chunk| chunk.count).sum();
        let mut step = HostStep {
            ids: Vec::with_capacity(rows),
            positions: Vec::with_capacity(rows),
            slots: Vec::with_capacity(rows),
            row_sequence: Vec::with_capacity(rows),
            block_tables: vec![0i32; chunks.len() * max_blocks],
            last_rows: Vec::with_capacity(chunks.len()),
            media: Vec::new(),
        };
        for (index, chunk) in chunks.iter().enumerate() {
            let end = chunk.start + chunk.count;
            // Offsets (from `start`) whose rows come from media features.
            let mut from_media = vec![false; chunk.count];
            for span in chunk.media {
                let len = span.rows.len() / c.hidden_size;
                if span.rows.len() % c.hidden_size != 0 || len == 0 || span.offset + len > chunk.count {
                    return Err(CudaError::Unsupported(format!(
                        "chunk {index}: media rows at offset {} ({} values, hidden size {}) do not fit its {} tokens",
                        span.offset,
                        span.rows.len(),
                        c.hidden_size,
                        chunk.count
                    )));
                }
                from_media[span.offset..span.offset + len].fill(true);
                step.media
                    .push(((step.ids.len() + span.offset) * c.hidden_size, span.rows));
            }
            if chunk.count == 0 || end > chunk.tokens.len() {
                return Err(CudaError::Unsupported(format!(
                    "chunk {index} asks for tokens past its sequence"
                )));
            }
            if end > chunk.blocks.len() * self.block_size || chunk.blocks.len() > max_blocks {
                return Err(CudaError::Unsupported(format!(
                    "chunk {index}'s block table does not cover it"
                )));
            }
            for (slot, &block) in step.block_tables[index * max_blocks..].iter_mut().zip(chunk.blocks) {
                if block as usize >= self.num_blocks {
                    return Err(CudaError::Unsupported(format!("block {block} is outside the cache")));
                }
                *slot = block as i32;
            }
            for position in chunk.start..end {
                let id = chunk.tokens[position];
                if from_media[position - chunk.start] {
                    // Any row of the table will do: the media row is copied over it.
                    step.ids.push(0);
                } else if id as usize >= c.vocab_size {
                    return Err(CudaError::Unsupported(format!(
                        "token id {id} is outside the vocabulary"
                    )));
                } else {
                    step.ids.push(id);
                }
                step.positions.push(position as i32);
                let block = chunk.blocks[position / self.block_size] as usize;
                step.slots
                    .push((block * self.block_size + position % self.block_size) as i32);
                step.row_sequence.push(index as i32);
            }
            step.last_rows.push((step.ids.len() - 1) as i32);
        }
        Ok(step)
    }

    /// Device buffers for a step of `shape` (zeroed).
    fn alloc_step(&self, shape: StepShape) -> Result<StepBuffers, CudaError> {
        let c = &self.config;
        let s = &self.stream;
        let floats = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(driver);
        let ints = |n: usize| s.alloc_zeros::<i32>(n.max(1)).map_err(driver);
        let (rows, sequences) = (shape.rows, shape.sequences);
        let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        Ok(StepBuffers {
            x: floats(rows * c.hidden_size)?,
            normed: floats(rows * c.hidden_size)?,
            qkv: floats(rows * (q + 2 * kv))?,
            attention: floats(rows * q)?,
            gate_up: floats(rows * 2 * c.intermediate_size)?,
            activation: floats(rows * c.intermediate_size)?,
            ids: s.alloc_zeros::<u32>(rows.max(1)).map_err(driver)?,
            positions: ints(rows)?,
            slots: ints(rows)?,
            row_sequence: ints(rows)?,
            block_tables: ints(sequences * shape.max_blocks)?,
            last_rows: ints(sequences)?,
            kept: floats(sequences * c.hidden_size)?,
            kept_normed: floats(sequences * c.hidden_size)?,
            logits: floats(sequences * c.vocab_size)?,
            partials: floats(partial_floats(rows, c.num_heads, c.head_dim))?,
        })
    }

    /// Copies a step's inputs into the first elements of `b`'s buffers.
    fn upload_step(&self, step: &HostStep<'_>, b: &mut StepBuffers) -> Result<(), CudaError> {
        let s = &self.stream;
        s.memcpy_htod(&step.ids, &mut b.ids.slice_mut(0..step.ids.len()))
            .map_err(driver)?;
        for (host, device) in [
            (&step.positions, &mut b.positions),
            (&step.slots, &mut b.slots),
            (&step.row_sequence, &mut b.row_sequence),
            (&step.block_tables, &mut b.block_tables),
            (&step.last_rows, &mut b.last_rows),
        ] {
            s.memcpy_htod(host, &mut device.slice_mut(0..host.len()))
                .map_err(driver)?;
        }
        Ok(())
    }

    /// Enqueues one step's kernels and products over `b` (no allocation, no synchronization, so
    /// a capture can record it), with `media` copied over the embedded rows; leaves each
    /// sequence's last-position logits in `b.logits`.
    fn enqueue_step(
        &mut self,
        b: &mut StepBuffers,
        shape: StepShape,
        media: &[MediaCopy<'_>],
    ) -> Result<(), CudaError> {
        let c = &self.config;
        let rows = shape.rows;
        let (h, q, kv, inter) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        let hidden = h as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.embed);
        launch.arg(&b.ids).arg(&self.embed).arg(&mut b.x).arg(&hidden);
        // SAFETY: `ids` holds `rows` ids below the vocabulary size (checked in `host_step`).
        unsafe { launch.launch(Self::rows_launch(rows, 256)) }.map_err(driver)?;
        // Media rows over their placeholders' embedded rows (stream order: after the embedding).
        for &(at, values) in media {
            self.stream
                .memcpy_htod(values, &mut b.x.slice_mut(at..at + values.len()))
                .map_err(driver)?;
        }
        let (num_heads, num_kv_heads, head_dim) = (c.num_heads as i32, c.num_kv_heads as i32, c.head_dim as i32);
        let (max_blocks, block_size) = (shape.max_blocks as i32, self.block_size as i32);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let qkv_width = (q + 2 * kv) as i32;
        let inter_width = inter as i32;
        for index in 0..self.layers.len() {
            let layer = &self.layers[index];
            self.rms_norm(&b.x, &layer.input_norm, &mut b.normed, rows)?;
            self.linear(&b.normed, &layer.qkv, &mut b.qkv, (rows, h, q + 2 * kv), false)?;
            if let Some(bias) = &layer.qkv_bias {
                let mut launch = self.stream.launch_builder(&self.kernels.add_bias);
                launch.arg(&mut b.qkv).arg(bias).arg(&qkv_width);
                // SAFETY: `qkv` is `[rows, q + 2·kv]` and `bias` `[q + 2·kv]`.
                unsafe { launch.launch(Self::rows_launch(rows, 256)) }.map_err(driver)?;
            }
            let layer = &mut self.layers[index];
            let mut launch = self.stream.launch_builder(&self.kernels.rope_and_store);
            launch
                .arg(&mut b.qkv)
                .arg(&b.positions)
                .arg(&b.slots)
                .arg(&self.inv_freq)
                .arg(&mut layer.keys)
                .arg(&mut layer.values)
                .arg(&num_heads)
                .arg(&num_kv_heads)
                .arg(&head_dim);
            // SAFETY: every slot lies inside the cache (block ids checked in `host_step`; the
            // padding rows' block is the cache's extra one).
            unsafe { launch.launch(Self::rows_launch(rows, 128)) }.map_err(driver)?;
            let by_key = self.attention != AttentionKernel::ByWarp
                && c.head_dim <= 128
                && shape.rows == shape.sequences
                && shape.rows <= BY_KEY_MAX_ROWS;
            let splits = if by_key && self.attention == AttentionKernel::ByKey {
                attention_splits(rows, c.num_heads)
            } else {
                1
            };
            let grid = LaunchConfig {
                grid_dim: (rows as u32, c.num_heads as u32, splits as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let kernel = if by_key {
                &self.kernels.paged_attention_by_key
            } else {
                &self.kernels.paged_attention
            };
            let mut launch = self.stream.launch_builder(kernel);
            launch
                .arg(&b.qkv)
                .arg(&layer.keys)
                .arg(&layer.values)
                .arg(&b.block_tables)
                .arg(&b.row_sequence)
                .arg(&b.positions)
                .arg(&mut b.attention);
            if by_key {
                launch.arg(&mut b.partials);
            }
            launch
                .arg(&max_blocks)
                .arg(&block_size)
                .arg(&num_heads)
                .arg(&num_kv_heads)
                .arg(&head_dim)
                .arg(&scale);
            // SAFETY: block tables cover every row's positions (checked in `host_step`);
            // `partials`, passed to the thread-per-key kernel, has room for this step's
            // (row, head, split) blocks (`partial_floats`, for buffers of at least `rows`
            // rows).
            unsafe { launch.launch(grid) }.map_err(driver)?;
            if splits > 1 {
                let splits = splits as i32;
                let mut launch = self.stream.launch_builder(&self.kernels.combine_splits);
                launch
                    .arg(&b.partials)
                    .arg(&mut b.attention)
                    .arg(&num_heads)
                    .arg(&head_dim)
                    .arg(&splits);
                let merge = LaunchConfig {
                    grid_dim: (rows as u32, c.num_heads as u32, 1),
                    block_dim: (c.head_dim as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: every split of every row and head wrote its partial result.
                unsafe { launch.launch(merge) }.map_err(driver)?;
            }
            let layer = &self.layers[index];
            self.linear(&b.attention, &layer.o, &mut b.x, (rows, q, h), true)?;
            self.rms_norm(&b.x, &layer.post_attention_norm, &mut b.normed, rows)?;
            self.linear(&b.normed, &layer.gate_up, &mut b.gate_up, (rows, h, 2 * inter), false)?;
            let mut launch = self.stream.launch_builder(&self.kernels.silu_mul);
            launch.arg(&b.gate_up).arg(&mut b.activation).arg(&inter_width);
            // SAFETY: `gate_up` is `[rows, 2·inter]`, `activation` `[rows, inter]`.
            unsafe { launch.launch(Self::rows_launch(rows, 256)) }.map_err(driver)?;
            self.linear(&b.activation, &layer.down, &mut b.x, (rows, inter, h), true)?;
        }
        let kept_rows = shape.sequences;
        let mut launch = self.stream.launch_builder(&self.kernels.gather_rows);
        launch.arg(&b.x).arg(&b.last_rows).arg(&mut b.kept).arg(&hidden);
        // SAFETY: every last row is below `rows`.
        unsafe { launch.launch(Self::rows_launch(kept_rows, 256)) }.map_err(driver)?;
        self.rms_norm(&b.kept, &self.norm, &mut b.kept_normed, kept_rows)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.linear(&b.kept_normed, head, &mut b.logits, (kept_rows, h, c.vocab_size), false)?;
        Ok(())
    }

    /// The decode-graph bucket for a step: every chunk one new token without media, at most
    /// [`MAX_DECODE_GRAPH_BATCH`] of them, block tables within the graphs' stride.
    fn decode_bucket(&self, chunks: &[GpuChunk<'_>]) -> Option<usize> {
        let max_blocks = self.decode_max_blocks();
        let decode = chunks
            .iter()
            .all(|chunk| chunk.count == 1 && chunk.media.is_empty() && chunk.blocks.len() <= max_blocks);
        if !self.decode_graphs || !decode || chunks.is_empty() || chunks.len() > MAX_DECODE_GRAPH_BATCH {
            return None;
        }
        Some(chunks.len().next_power_of_two())
    }

    /// The decode graphs' block-table stride: the blocks of the longest sequence the model takes.
    fn decode_max_blocks(&self) -> usize {
        self.config
            .max_position_embeddings
            .div_ceil(self.block_size)
            .clamp(1, self.num_blocks.max(1))
    }

    /// Runs one step and returns each chunk's last-position logits on the GPU, `[chunks,
    /// vocab]`: a decode step by graph replay where [`CudaExecutor::decode_bucket`] allows,
    /// anything else kernel by kernel on buffers of its own.
    fn run(&mut self, chunks: &[GpuChunk<'_>]) -> Result<CudaSlice<f32>, CudaError> {
        if let Some(bucket) = self.decode_bucket(chunks) {
            return self.run_decode(chunks, bucket);
        }
        let max_blocks = chunks.iter().map(|chunk| chunk.blocks.len()).max().unwrap_or(1).max(1);
        let step = self.host_step(chunks, max_blocks)?;
        let shape = StepShape {
            rows: step.ids.len(),
            sequences: chunks.len(),
            max_blocks,
        };
        let mut b = self.alloc_step(shape)?;
        self.upload_step(&step, &mut b)?;
        self.enqueue_step(&mut b, shape, &step.media)?;
        self.stats.eager_steps += 1;
        Ok(b.logits)
    }

    /// A decode step of `chunks.len()` sequences through the graph of `bucket` (captured at its
    /// first use): the inputs padded to the bucket, the graph replayed, the real sequences'
    /// logits copied out of the graph's buffer.
    fn run_decode(&mut self, chunks: &[GpuChunk<'_>], bucket: usize) -> Result<CudaSlice<f32>, CudaError> {
        let max_blocks = self.decode_max_blocks();
        let mut step = self.host_step(chunks, max_blocks)?;
        // Padding rows: token 0 at position 0 of the cache's extra block, each its own
        // sequence; what they compute is never read.
        let scratch_block = self.num_blocks as i32;
        for row in chunks.len()..bucket {
            step.ids.push(0);
            step.positions.push(0);
            step.slots.push(scratch_block * self.block_size as i32);
            step.row_sequence.push(row as i32);
            step.block_tables
                .extend(std::iter::once(scratch_block).chain(std::iter::repeat_n(0, max_blocks - 1)));
            step.last_rows.push(row as i32);
        }
        let mut decode = match self.decode.take() {
            Some(decode) => decode,
            None => Box::new(DecodeGraphs {
                buffers: self.alloc_step(StepShape {
                    rows: MAX_DECODE_GRAPH_BATCH,
                    sequences: MAX_DECODE_GRAPH_BATCH,
                    max_blocks,
                })?,
                max_blocks,
                graphs: Vec::new(),
            }),
        };
        let result = self.replay_decode(&mut decode, &step, bucket, chunks.len());
        self.decode = Some(decode);
        result
    }

    fn replay_decode(
        &mut self,
        decode: &mut DecodeGraphs,
        step: &HostStep<'_>,
        bucket: usize,
        sequences: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let shape = StepShape {
            rows: bucket,
            sequences: bucket,
            max_blocks: decode.max_blocks,
        };
        self.upload_step(step, &mut decode.buffers)?;
        if !decode.graphs.iter().any(|(b, _)| *b == bucket) {
            let graph = match self.capture_decode(&mut decode.buffers, shape) {
                Ok(Some(graph)) => {
                    self.stats.captures += 1;
                    Some(DecodeGraph(graph))
                }
                Ok(None) => {
                    tracing::warn!(bucket, "CUDA graph capture produced no graph; decoding eagerly");
                    None
                }
                Err(err) => {
                    tracing::warn!(bucket, %err, "CUDA graph capture failed; decoding eagerly");
                    None
                }
            };
            decode.graphs.push((bucket, graph));
        }
        let graph = decode
            .graphs
            .iter()
            .find(|(b, _)| *b == bucket)
            .and_then(|(_, graph)| graph.as_ref());
        match graph {
            Some(DecodeGraph(graph)) => {
                graph.launch().map_err(driver)?;
                self.stats.replays += 1;
            }
            None => {
                self.enqueue_step(&mut decode.buffers, shape, &[])?;
                self.stats.eager_steps += 1;
            }
        }
        let vocab = self.config.vocab_size;
        let mut logits = self.stream.alloc_zeros::<f32>(sequences * vocab).map_err(driver)?;
        self.stream
            .memcpy_dtod(&decode.buffers.logits.slice(0..sequences * vocab), &mut logits)
            .map_err(driver)?;
        Ok(logits)
    }

    /// Captures a decode step of `shape` on `b`: one eager step first (cuBLAS picks and loads
    /// its kernels outside the capture; it computes what the replay will, so the cache writes
    /// are the same), then the capture.
    fn capture_decode(&mut self, b: &mut StepBuffers, shape: StepShape) -> Result<Option<CudaGraph>, CudaError> {
        self.enqueue_step(b, shape, &[])?;
        self.stream.synchronize().map_err(driver)?;
        self.stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver)?;
        let enqueued = self.enqueue_step(b, shape, &[]);
        // End the capture whatever happened, so the stream leaves capture mode.
        let graph = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(driver);
        enqueued?;
        graph
    }

    /// Runs one step and returns each chunk's last-position logits (`[vocab]` each). For tests
    /// and tools; the engine uses [`Executor::execute`].
    ///
    /// # Errors
    ///
    /// [`CudaError`] for a chunk outside its sequence or cache, or a failed CUDA call.
    pub fn forward(&mut self, chunks: &[GpuChunk<'_>]) -> Result<Vec<Vec<f32>>, CudaError> {
        let logits = self.run(chunks)?;
        let host = self.stream.clone_dtoh(&logits).map_err(driver)?;
        self.stream.synchronize().map_err(driver)?;
        Ok(host.chunks_exact(self.config.vocab_size).map(<[f32]>::to_vec).collect())
    }
}

impl Executor for CudaExecutor {
    fn execute(&mut self, items: &mut [StepItem<'_>]) -> Result<(), String> {
        let media: Vec<Vec<MediaRows<'_>>> = items.iter().map(crate::engine::chunk_media).collect();
        let chunks: Vec<GpuChunk<'_>> = items
            .iter()
            .zip(&media)
            .map(|(item, media)| GpuChunk {
                tokens: item.tokens,
                start: item.start,
                count: item.count,
                blocks: item.blocks,
                media,
            })
            .collect();
        let logits = self.run(&chunks).map_err(|err| err.to_string())?;
        let vocab = self.config.vocab_size;
        let mut best = self
            .stream
            .alloc_zeros::<u32>(items.len())
            .map_err(|err| err.to_string())?;
        let vocab_i32 = vocab as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.argmax);
        launch.arg(&logits).arg(&vocab_i32).arg(&mut best);
        // SAFETY: `logits` is `[items, vocab]`, `best` `[items]`.
        unsafe { launch.launch(Self::rows_launch(items.len(), 256)) }.map_err(|err| err.to_string())?;
        let best = self.stream.clone_dtoh(&best).map_err(|err| err.to_string())?;
        let needs_logits = items.iter().any(|item| item.samples() && !item.sampler.is_greedy());
        let host_logits = if needs_logits {
            Some(self.stream.clone_dtoh(&logits).map_err(|err| err.to_string())?)
        } else {
            None
        };
        self.stream.synchronize().map_err(|err| err.to_string())?;
        for (index, item) in items.iter_mut().enumerate() {
            if !item.samples() {
                continue;
            }
            item.next_token = Some(match &host_logits {
                Some(all) if !item.sampler.is_greedy() => item
                    .sampler
                    .sample(&all[index * vocab..(index + 1) * vocab])
                    .map_err(|err| err.to_string()),
                _ if best[index] as usize >= vocab => Err("the logits hold no finite value".to_string()),
                _ => Ok(best[index]),
            });
        }
        Ok(())
    }

    fn kv_medium(&self) -> KvMedium {
        KvMedium::Payloads
    }

    fn export_kv(&mut self, blocks: &[BlockId]) -> Option<Vec<Vec<u8>>> {
        blocks
            .iter()
            .map(|block| self.export_block(*block))
            .collect::<Result<Vec<_>, _>>()
            .inspect_err(|err| tracing::warn!(error = %err, "could not export KV blocks"))
            .ok()
    }

    fn import_kv(&mut self, block: BlockId, payload: &[u8]) -> Result<(), String> {
        self.import_block(block, payload).map_err(|err| err.to_string())
    }
}

/// Starts a native engine for `model` on GPU `ordinal`, on a thread of its own.
///
/// # Errors
///
/// [`CudaError`] when the backend cannot start; the I/O error of the thread as
/// [`SetupError::Driver`].
pub fn spawn_cuda_engine(
    model: &Model,
    ordinal: usize,
    config: switchyard_workers::engine::EngineConfig,
    precision: KvPrecision,
) -> Result<switchyard_workers::engine::EngineHandle, CudaError> {
    let executor = CudaExecutor::with_precision(model, ordinal, config.block_size, config.num_gpu_blocks, precision)?;
    let limits = executor.limits();
    switchyard_workers::engine::spawn_native(config, limits, executor, "switchyard-llm-cuda")
        .map_err(|err| CudaError::Setup(SetupError::Driver(format!("cannot start the engine thread: {err}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_a_buffer_serves_has_room_for_its_split_partials() {
        // Decode graphs' buffers are allocated once for the largest bucket and eager ones per
        // step; either way a step of up to their rows must find room for every (row, head,
        // split) block it launches.
        for heads in 1..=64 {
            for rows in [1, 2, 3, 5, 8, 24, 32, 43, 64, 100, MAX_DECODE_GRAPH_BATCH] {
                let room = partial_floats(rows, heads, 128);
                for step_rows in 1..=rows.min(BY_KEY_MAX_ROWS) {
                    let splits = attention_splits(step_rows, heads);
                    assert!((1..=MAX_SPLITS).contains(&splits));
                    assert!(
                        step_rows * heads * splits * (128 + 2) <= room,
                        "{step_rows} rows × {heads} heads × {splits} splits in a buffer for {rows} rows"
                    );
                }
            }
        }
        // A step of few rows splits; one that fills the GPU does not.
        assert_eq!(attention_splits(1, 12), MAX_SPLITS);
        assert_eq!(attention_splits(64, 32), 1);
    }
}
