//! The encoders' forward on one NVIDIA GPU through cudarc (feature `cuda`), with CUDA graphs
//! per token budget.
//!
//! Everything CUDA is loaded at run time (cudarc's dynamic loading: the driver, NVRTC and
//! cuBLAS), so this module builds on machines without CUDA, and asking for a GPU that is not
//! there is an error saying which part is missing. The kernels in `kernels.cu` (patch and
//! convolution im2col, token assembly, LayerNorm, bias with activation, bidirectional
//! attention in tiles with an online softmax, or one query row per block for heads wider than
//! the tiles take, position adds, row selection) are compiled by NVRTC when a model is put on the
//! GPU; products are cuBLAS SGEMMs, query/key/value fused into one, residual adds folded into
//! the output products (β = 1). Weights are f32 and laid out as on the CPU ([`vision`] takes a
//! loaded [`crate::vit::VisionEncoder`], [`whisper`] a [`crate::whisper::WhisperEncoder`]), so
//! CPU, eager GPU and graph replay can be compared value by value.
//!
//! [`Graphs`] is a CUDA graph cache as vLLM keeps one for its vision encoders
//! (vllm-project/vllm#35963): per input shape, one forward captured at
//! each power-of-two token budget up to the largest (which is always one), all on one set of
//! buffers sized for the largest. A micro-batch takes the smallest budget that holds its items:
//! the items' values are copied in, the padding after them up to the budget zeroed, the graph
//! replayed and the items' outputs copied out. A micro-batch above every budget runs eagerly.
//! Replays and eager runs are counted for the encoder's metrics.
//!
//! # Rejected designs
//!
//! - Attention with one block per query row and head, each reading every key and value:
//!   Whisper 3.2–4.8× slower than the tiled kernels (one window 16.14 against 5.04 ms p50); only
//!   a single image was faster with it (1.31 against 1.49 ms).

pub mod vision;
pub mod whisper;

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaFunction, CudaGraph, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use switchyard_native::cuda::Device;

use crate::EncodeError;
use crate::ops::{Activation, LayerNorm, Linear, PreNormBlock};

/// The kernels' CUDA C source.
pub const KERNELS: &str = include_str!("kernels.cu");

/// The kernels the forward launches, by their `extern "C"` names.
pub const KERNEL_NAMES: [&str; 9] = [
    "im2col_patches",
    "assemble_tokens",
    "layer_norm",
    "bias_act",
    "attention",
    "im2col_conv1d",
    "add_positions",
    "keep_last_rows",
    "attention_tiled",
];

/// Most rows one attention sequence may have: its scores sit in 48 KiB of shared memory.
pub const MAX_SEQUENCE: usize = 12 * 1024;

/// Query rows (and key rows) per tile of `attention_tiled` (`ATTENTION_TILE` in `kernels.cu`).
const ATTENTION_TILE: usize = 32;
/// The widest head `attention_tiled` takes (`ATTENTION_MAX_HEAD_DIM` in `kernels.cu`); wider
/// heads use `attention`.
const ATTENTION_MAX_HEAD_DIM: usize = 96;
/// Most blocks in a grid's third dimension (one sequence per block there).
const MAX_GRID_Z: usize = 65_535;

/// Why an encoder could not be put on the GPU or run there.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// CUDA's libraries, the device, the driver, NVRTC or cuBLAS failed (see [`SetupError`]).
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The model or input does not fit the kernels' limits.
    #[error("unsupported on the GPU: {0}")]
    Unsupported(String),
    /// The inputs do not fit the model (as on the CPU).
    #[error(transparent)]
    Encode(#[from] EncodeError),
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
    Ok(switchyard_native::cuda::compile(KERNELS, "switchyard_encoders.cu")?)
}

struct Kernels {
    im2col_patches: CudaFunction,
    assemble_tokens: CudaFunction,
    layer_norm: CudaFunction,
    bias_act: CudaFunction,
    attention: CudaFunction,
    im2col_conv1d: CudaFunction,
    add_positions: CudaFunction,
    keep_last_rows: CudaFunction,
    attention_tiled: CudaFunction,
}

/// One GPU: a stream of its own (graph capture cannot use the legacy default stream), cuBLAS
/// on that stream, and the compiled kernels.
pub(crate) struct Gpu {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    /// cuBLAS's workspace, ours so that cuBLAS never allocates (a capture would not allow it).
    _workspace: CudaSlice<u8>,
    attention_kernel: AttentionKernel,
}

/// Which attention kernel the forward launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// `attention_tiled`: key and value tiles shared by 32 query rows, an online softmax
    /// (heads of up to 96 dimensions; wider heads fall back to [`AttentionKernel::Rows`]).
    #[default]
    Tiled,
    /// `attention`: one block per query row and head, every key read per row (the first
    /// kernel; kept for wide heads, and as the baseline the bench compares against).
    Rows,
}

/// Bytes of the cuBLAS workspace (what cuBLAS takes by default on recent GPUs).
const CUBLAS_WORKSPACE: usize = 32 << 20;

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").finish_non_exhaustive()
    }
}

fn int(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported(format!("dimension {v} exceeds i32")))
}

fn rows_launch(rows: usize, threads: u32) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (
            u32::try_from(rows).map_err(|_| CudaError::Unsupported(format!("{rows} rows")))?,
            1,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The activation codes `kernels.cu` takes.
fn act_code(act: Option<Activation>) -> i32 {
    match act {
        None => 0,
        Some(Activation::Gelu) => 1,
        Some(Activation::GeluTanh) => 2,
        Some(Activation::QuickGelu) => 3,
        Some(Activation::Relu) => 4,
    }
}

impl Gpu {
    /// Opens GPU `ordinal` and compiles the kernels.
    pub(crate) fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        switchyard_native::cuda::check_device(ordinal)?;
        let ptx = compile_kernels()?;
        let Device {
            stream,
            module,
            blas,
            workspace,
        } = switchyard_native::cuda::open(ordinal, ptx, CUBLAS_WORKSPACE)?;
        let load = |name: &str| module.load_function(name).map_err(driver);
        let kernels = Kernels {
            im2col_patches: load(KERNEL_NAMES[0])?,
            assemble_tokens: load(KERNEL_NAMES[1])?,
            layer_norm: load(KERNEL_NAMES[2])?,
            bias_act: load(KERNEL_NAMES[3])?,
            attention: load(KERNEL_NAMES[4])?,
            im2col_conv1d: load(KERNEL_NAMES[5])?,
            add_positions: load(KERNEL_NAMES[6])?,
            keep_last_rows: load(KERNEL_NAMES[7])?,
            attention_tiled: load(KERNEL_NAMES[8])?,
        };
        Ok(Gpu {
            stream,
            blas,
            kernels,
            _workspace: workspace,
            attention_kernel: AttentionKernel::default(),
        })
    }

    pub(crate) fn upload(&self, values: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        self.stream.clone_htod(values).map_err(driver)
    }

    pub(crate) fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.stream.alloc_zeros::<f32>(n.max(1)).map_err(driver)
    }

    /// `y[rows, output] (+)= x[rows, input] · W[output, input]ᵀ`, row-major, as column-major
    /// cuBLAS sees it: `yᵀ = W · xᵀ`.
    pub(crate) fn linear(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        (rows, input, output): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
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
        // SAFETY: the callers size the three buffers for at least `output·input`, `rows·input`
        // and `rows·output` values, and `y` aliases neither input.
        unsafe { self.blas.gemm(config, weight, x, y) }
            .map_err(|err| CudaError::Setup(SetupError::Blas(err.to_string())))
    }

    /// LayerNorm of `rows` rows of `x` into `out`.
    pub(crate) fn layer_norm(
        &self,
        x: &CudaSlice<f32>,
        norm: &GpuNorm,
        out: &mut CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), CudaError> {
        self.launch_layer_norm(x, norm, out, rows)
    }

    /// The same, in place.
    pub(crate) fn layer_norm_in_place(
        &self,
        x: &mut CudaSlice<f32>,
        norm: &GpuNorm,
        rows: usize,
    ) -> Result<(), CudaError> {
        self.launch_layer_norm(x, norm, x, rows)
    }

    /// The kernel takes `out` by pointer; it may be `x` itself, since each row's reads finish
    /// (two block-wide reductions) before its writes.
    fn launch_layer_norm(
        &self,
        x: &CudaSlice<f32>,
        norm: &GpuNorm,
        out: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), CudaError> {
        let width = int(norm.width)?;
        let mut launch = self.stream.launch_builder(&self.kernels.layer_norm);
        launch
            .arg(x)
            .arg(&norm.weight)
            .arg(&norm.bias)
            .arg(out)
            .arg(&width)
            .arg(&norm.eps);
        // SAFETY: the kernel reads and writes `rows·width` values; the buffers hold them, and
        // `out` is either a buffer no one else reads meanwhile or `x` (see above).
        unsafe { launch.launch(rows_launch(rows, 256)?) }.map_err(driver)?;
        Ok(())
    }

    /// `x[r] = act(x[r] + bias)` for `rows` rows of `bias.len()` values.
    pub(crate) fn bias_act(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        (rows, width): (usize, usize),
        act: Option<Activation>,
    ) -> Result<(), CudaError> {
        let (width, code) = (int(width)?, act_code(act));
        let mut launch = self.stream.launch_builder(&self.kernels.bias_act);
        launch.arg(x).arg(bias).arg(&width).arg(&code);
        // SAFETY: `rows·width` values of `x`, `width` of `bias`.
        unsafe { launch.launch(rows_launch(rows, 256)?) }.map_err(driver)?;
        Ok(())
    }

    /// Self-attention over `rows / len` sequences of `len` rows: `qkv` rows `[q | k | v]`.
    pub(crate) fn attention(
        &self,
        qkv: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        (rows, len, heads, head_dim): (usize, usize, usize, usize),
    ) -> Result<(), CudaError> {
        if len > MAX_SEQUENCE {
            return Err(CudaError::Unsupported(format!(
                "sequences of {len} rows (the attention kernel takes up to {MAX_SEQUENCE})"
            )));
        }
        let (l, h, d) = (int(len)?, int(heads)?, int(head_dim)?);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let items = rows / len.max(1);
        let tiled = self.attention_kernel == AttentionKernel::Tiled;
        if tiled && head_dim <= ATTENTION_MAX_HEAD_DIM && items <= MAX_GRID_Z && len > 0 {
            let tile = ATTENTION_TILE;
            let config = LaunchConfig {
                grid_dim: (len.div_ceil(tile) as u32, heads as u32, items as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: ((2 * tile * (head_dim + 1) + tile * head_dim + tile * (tile + 1)) * 4) as u32,
            };
            let mut launch = self.stream.launch_builder(&self.kernels.attention_tiled);
            launch.arg(qkv).arg(out).arg(&l).arg(&h).arg(&d).arg(&scale);
            // SAFETY: as below; the grid covers `items` whole sequences, the block is the 128
            // threads the kernel assumes, and the shared memory its four tiles (under 48 KiB
            // for heads of up to ATTENTION_MAX_HEAD_DIM dimensions).
            unsafe { launch.launch(config) }.map_err(driver)?;
            return Ok(());
        }
        let config = LaunchConfig {
            grid_dim: (
                u32::try_from(rows).map_err(|_| CudaError::Unsupported(format!("{rows} rows")))?,
                heads as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (len * 4) as u32,
        };
        let mut launch = self.stream.launch_builder(&self.kernels.attention);
        launch.arg(qkv).arg(out).arg(&l).arg(&h).arg(&d).arg(&scale);
        // SAFETY: `qkv` holds `rows·3·heads·head_dim` values, `out` `rows·heads·head_dim`, and
        // `rows` is a multiple of `len` (whole sequences).
        unsafe { launch.launch(config) }.map_err(driver)?;
        Ok(())
    }

    /// One pre-LN block on `x` (`rows` rows in sequences of `len`), with `scratch` for the
    /// intermediates.
    pub(crate) fn block(
        &self,
        block: &GpuBlock,
        x: &mut CudaSlice<f32>,
        scratch: &mut BlockScratch,
        (rows, len): (usize, usize),
    ) -> Result<(), CudaError> {
        let h = block.width;
        self.layer_norm(x, &block.norm1, &mut scratch.normed, rows)?;
        self.linear(&scratch.normed, &block.qkv, &mut scratch.qkv, (rows, h, 3 * h), false)?;
        self.bias_act(&mut scratch.qkv, &block.qkv_bias, (rows, 3 * h), None)?;
        self.attention(
            &scratch.qkv,
            &mut scratch.attention,
            (rows, len, block.heads, h / block.heads),
        )?;
        self.linear(&scratch.attention, &block.out, x, (rows, h, h), true)?;
        self.bias_act(x, &block.out_bias, (rows, h), None)?;
        self.layer_norm(x, &block.norm2, &mut scratch.normed, rows)?;
        self.linear(
            &scratch.normed,
            &block.fc1,
            &mut scratch.mlp,
            (rows, h, block.intermediate),
            false,
        )?;
        self.bias_act(
            &mut scratch.mlp,
            &block.fc1_bias,
            (rows, block.intermediate),
            Some(block.act),
        )?;
        self.linear(&scratch.mlp, &block.fc2, x, (rows, block.intermediate, h), true)?;
        self.bias_act(x, &block.fc2_bias, (rows, h), None)
    }
}

/// A LayerNorm's parameters on the GPU.
pub(crate) struct GpuNorm {
    weight: CudaSlice<f32>,
    bias: CudaSlice<f32>,
    eps: f32,
    width: usize,
}

impl GpuNorm {
    pub(crate) fn upload(gpu: &Gpu, norm: &LayerNorm) -> Result<GpuNorm, CudaError> {
        Ok(GpuNorm {
            weight: gpu.upload(&norm.weight)?,
            bias: gpu.upload(&norm.bias)?,
            eps: norm.eps,
            width: norm.weight.len(),
        })
    }
}

/// A linear layer's weight and bias (zeros where the model has none) on the GPU.
pub(crate) struct GpuLinear {
    pub(crate) weight: CudaSlice<f32>,
    pub(crate) bias: CudaSlice<f32>,
    pub(crate) input: usize,
    pub(crate) output: usize,
}

impl GpuLinear {
    pub(crate) fn upload(gpu: &Gpu, linear: &Linear) -> Result<GpuLinear, CudaError> {
        Ok(GpuLinear {
            weight: gpu.upload(&linear.weight)?,
            bias: match &linear.bias {
                Some(bias) => gpu.upload(bias)?,
                None => gpu.zeros(linear.output)?,
            },
            input: linear.input,
            output: linear.output,
        })
    }

    /// `y = x·Wᵀ + b`, then the activation.
    pub(crate) fn forward(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        act: Option<Activation>,
    ) -> Result<(), CudaError> {
        gpu.linear(x, &self.weight, y, (rows, self.input, self.output), false)?;
        gpu.bias_act(y, &self.bias, (rows, self.output), act)
    }
}

/// A pre-LN transformer block on the GPU, query/key/value stacked into one product.
pub(crate) struct GpuBlock {
    norm1: GpuNorm,
    qkv: CudaSlice<f32>,
    qkv_bias: CudaSlice<f32>,
    out: CudaSlice<f32>,
    out_bias: CudaSlice<f32>,
    norm2: GpuNorm,
    fc1: CudaSlice<f32>,
    fc1_bias: CudaSlice<f32>,
    fc2: CudaSlice<f32>,
    fc2_bias: CudaSlice<f32>,
    act: Activation,
    heads: usize,
    width: usize,
    intermediate: usize,
}

impl GpuBlock {
    pub(crate) fn upload(gpu: &Gpu, block: &PreNormBlock) -> Result<GpuBlock, CudaError> {
        let a = &block.attention;
        let width = a.q.output;
        let bias_or_zeros = |l: &Linear| l.bias.clone().unwrap_or_else(|| vec![0.0; l.output]);
        let mut qkv = a.q.weight.clone();
        qkv.extend_from_slice(&a.k.weight);
        qkv.extend_from_slice(&a.v.weight);
        let mut qkv_bias = bias_or_zeros(&a.q);
        qkv_bias.extend(bias_or_zeros(&a.k));
        qkv_bias.extend(bias_or_zeros(&a.v));
        Ok(GpuBlock {
            norm1: GpuNorm::upload(gpu, &block.norm1)?,
            qkv: gpu.upload(&qkv)?,
            qkv_bias: gpu.upload(&qkv_bias)?,
            out: gpu.upload(&a.out.weight)?,
            out_bias: gpu.upload(&bias_or_zeros(&a.out))?,
            norm2: GpuNorm::upload(gpu, &block.norm2)?,
            fc1: gpu.upload(&block.mlp.fc1.weight)?,
            fc1_bias: gpu.upload(&bias_or_zeros(&block.mlp.fc1))?,
            fc2: gpu.upload(&block.mlp.fc2.weight)?,
            fc2_bias: gpu.upload(&bias_or_zeros(&block.mlp.fc2))?,
            act: block.mlp.act,
            heads: a.heads,
            width,
            intermediate: block.mlp.fc1.output,
        })
    }
}

/// Intermediates of the blocks, sized for a capacity of rows.
pub(crate) struct BlockScratch {
    normed: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attention: CudaSlice<f32>,
    mlp: CudaSlice<f32>,
}

impl BlockScratch {
    pub(crate) fn alloc(gpu: &Gpu, rows: usize, width: usize, intermediate: usize) -> Result<BlockScratch, CudaError> {
        Ok(BlockScratch {
            normed: gpu.zeros(rows * width)?,
            qkv: gpu.zeros(rows * 3 * width)?,
            attention: gpu.zeros(rows * width)?,
            mlp: gpu.zeros(rows * intermediate)?,
        })
    }
}

/// A forward over fixed buffers: what [`Graphs`] captures and replays.
pub(crate) trait Forward {
    /// What fixes the shapes besides the item count (an image size; nothing for Whisper).
    type Key: Copy + Eq + Hash + std::fmt::Debug;
    /// Every buffer the forward reads or writes.
    type Buffers;

    /// Buffers for up to `capacity` items.
    fn alloc(&self, gpu: &Gpu, key: Self::Key, capacity: usize) -> Result<Self::Buffers, CudaError>;
    /// Enqueues the forward of the first `items` items.
    fn enqueue(&self, gpu: &Gpu, buffers: &mut Self::Buffers, key: Self::Key, items: usize) -> Result<(), CudaError>;
    /// The buffer the items' input values go into.
    fn input(buffers: &mut Self::Buffers) -> &mut CudaSlice<f32>;
    /// The buffer the items' outputs come from.
    fn output(buffers: &Self::Buffers) -> &CudaSlice<f32>;
    /// Input values per item.
    fn input_len(&self, key: Self::Key) -> usize;
    /// Output values per item.
    fn output_len(&self, key: Self::Key) -> usize;
    /// Tokens per item, the unit of the budgets.
    fn tokens_per_item(&self, key: Self::Key) -> usize;
}

/// A captured graph. cudarc's `CudaGraph` holds raw driver handles and is not `Send`; this one
/// only lives inside [`Graphs`]'s mutex, which serializes every use.
struct Captured(CudaGraph);

// SAFETY: the graph is launched and dropped only under the `Graphs` mutex (one thread at a
// time), as the driver's thread-safety rules for graph objects require.
unsafe impl Send for Captured {}

struct Entry<B> {
    buffers: B,
    /// `(capacity in items, the graph)`, or `None` where capture failed (that capacity then
    /// runs eagerly).
    graphs: Vec<(usize, Option<Captured>)>,
}

/// How a micro-batch ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// A captured graph replayed.
    Replay,
    /// Eagerly: above every budget, or its graph could not be captured.
    Eager,
}

/// Counters of [`Graphs`]: graph replays (hits) and eager runs (misses).
#[derive(Debug, Default)]
pub struct GraphCounters {
    /// Micro-batches answered by a graph replay.
    pub replays: AtomicU64,
    /// Micro-batches run eagerly.
    pub eager: AtomicU64,
    /// Graphs captured.
    pub captures: AtomicU64,
}

/// The graph cache: one forward captured per (shape, budget), replayed with zeroed inputs.
pub(crate) struct Graphs<F: Forward> {
    /// Token budgets, ascending; the last is the largest.
    budgets: Vec<usize>,
    entries: Mutex<HashMap<F::Key, Entry<F::Buffers>>>,
    pub(crate) counters: GraphCounters,
}

/// The token budgets graphs are captured at: every power of two below `max`, then `max`
/// itself. For a shape, [`Graphs`] uses those that hold at least one item.
pub fn budgets_up_to(max: usize) -> Vec<usize> {
    let mut out: Vec<usize> = (0..usize::BITS).map(|k| 1usize << k).take_while(|&b| b < max).collect();
    out.push(max.max(1));
    out
}

impl<F: Forward> Graphs<F> {
    /// Drops every captured graph and buffer (after the forward changed).
    pub(crate) fn clear(&mut self) {
        if let Ok(entries) = self.entries.get_mut() {
            entries.clear();
        }
    }

    pub(crate) fn new(max_budget: usize) -> Graphs<F> {
        Graphs {
            budgets: budgets_up_to(max_budget),
            entries: Mutex::new(HashMap::new()),
            counters: GraphCounters::default(),
        }
    }

    /// Runs one micro-batch, `inputs[i]` holding item `i`'s `input_len` values. With
    /// `use_graphs`, by graph replay when a budget holds the items (counted as a replay), else
    /// eagerly (counted as a miss); without, always eagerly (counted nowhere: the comparison
    /// path). Both run on the shape's buffers, sized once for the largest budget, as a caching
    /// allocator would serve them, so graph and eager differ only in how the work is launched;
    /// a micro-batch above every budget gets buffers of its own for the call. Each item is
    /// copied straight from its slice into the input buffer (no gathering on the host), and a
    /// replay zeroes only the padding after them. Returns the items' outputs, in order, and
    /// the path.
    pub(crate) fn run(
        &self,
        model: &F,
        gpu: &Gpu,
        key: F::Key,
        inputs: &[&[f32]],
        use_graphs: bool,
    ) -> Result<(Vec<f32>, Path), CudaError> {
        let items = inputs.len();
        let per_item = model.tokens_per_item(key).max(1);
        let largest = self.budgets.last().copied().unwrap_or(1) / per_item;
        if items > largest {
            if use_graphs {
                self.counters.eager.fetch_add(1, Ordering::Relaxed);
            }
            let mut buffers = model.alloc(gpu, key, items)?;
            let output = forward_on(model, gpu, &mut buffers, key, inputs, None)?;
            return Ok((output, Path::Eager));
        }
        let mut entries = self
            .entries
            .lock()
            .map_err(|_| CudaError::Setup(SetupError::Driver("the graph cache lock is poisoned".into())))?;
        let entry = match entries.entry(key) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => slot.insert(Entry {
                // One set of buffers per shape, sized for the largest budget: every graph of
                // the shape is captured on it, and eager runs use it too.
                buffers: model.alloc(gpu, key, largest)?,
                graphs: Vec::new(),
            }),
        };
        let budget = if use_graphs {
            self.budgets.iter().copied().find(|&b| b / per_item >= items)
        } else {
            None
        };
        let graph = match budget {
            Some(budget) => {
                let capacity = budget / per_item;
                if !entry.graphs.iter().any(|(c, _)| *c == capacity) {
                    let captured = capture(model, gpu, &mut entry.buffers, key, capacity);
                    if captured.is_some() {
                        self.counters.captures.fetch_add(1, Ordering::Relaxed);
                    }
                    entry.graphs.push((capacity, captured));
                }
                entry
                    .graphs
                    .iter()
                    .find(|(c, _)| *c == capacity)
                    .and_then(|(c, g)| g.as_ref().map(|Captured(graph)| (*c, graph)))
            }
            None => None,
        };
        let path = if graph.is_some() { Path::Replay } else { Path::Eager };
        if use_graphs {
            let counter = match path {
                Path::Replay => &self.counters.replays,
                Path::Eager => &self.counters.eager,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        let output = forward_on(model, gpu, &mut entry.buffers, key, inputs, graph)?;
        Ok((output, path))
    }
}

/// Copies `inputs` into `buffers`, runs the forward (replaying `graph`, captured at its
/// capacity in items, after zeroing the padding up to that capacity; else eagerly over the
/// items alone) and copies the items' outputs back.
fn forward_on<F: Forward>(
    model: &F,
    gpu: &Gpu,
    buffers: &mut F::Buffers,
    key: F::Key,
    inputs: &[&[f32]],
    graph: Option<(usize, &CudaGraph)>,
) -> Result<Vec<f32>, CudaError> {
    let stream = &gpu.stream;
    let per = model.input_len(key);
    let buffer = F::input(buffers);
    for (i, input) in inputs.iter().enumerate() {
        if input.len() != per {
            return Err(CudaError::Unsupported(format!(
                "item {i} has {} input values, the forward takes {per}",
                input.len()
            )));
        }
        stream
            .memcpy_htod(*input, &mut buffer.slice_mut(i * per..(i + 1) * per))
            .map_err(driver)?;
    }
    match graph {
        Some((capacity, graph)) => {
            let (used, padded) = (inputs.len() * per, capacity * per);
            if padded > used {
                stream
                    .memset_zeros(&mut buffer.slice_mut(used..padded))
                    .map_err(driver)?;
            }
            graph.launch().map_err(driver)?;
        }
        None => model.enqueue(gpu, buffers, key, inputs.len())?,
    }
    let out_len = inputs.len() * model.output_len(key);
    stream.clone_dtoh(&F::output(buffers).slice(0..out_len)).map_err(driver)
}

/// Captures the forward at `capacity` items: one eager run first (cuBLAS and the kernels do
/// their first-use setup outside the capture), then the capture. `None` when the driver refuses
/// (logged); the capacity then runs eagerly.
fn capture<F: Forward>(
    model: &F,
    gpu: &Gpu,
    buffers: &mut F::Buffers,
    key: F::Key,
    capacity: usize,
) -> Option<Captured> {
    match try_capture(model, gpu, buffers, key, capacity) {
        Ok(Some(graph)) => Some(Captured(graph)),
        Ok(None) => {
            tracing::warn!(?key, capacity, "CUDA graph capture produced no graph; running eagerly");
            None
        }
        Err(err) => {
            tracing::warn!(?key, capacity, %err, "CUDA graph capture failed; running eagerly");
            None
        }
    }
}

fn try_capture<F: Forward>(
    model: &F,
    gpu: &Gpu,
    buffers: &mut F::Buffers,
    key: F::Key,
    capacity: usize,
) -> Result<Option<CudaGraph>, CudaError> {
    model.enqueue(gpu, buffers, key, capacity)?;
    gpu.stream.synchronize().map_err(driver)?;
    gpu.stream
        .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(driver)?;
    let enqueued = model.enqueue(gpu, buffers, key, capacity);
    // End the capture whatever happened, so the stream leaves capture mode.
    let graph = gpu
        .stream
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .map_err(driver);
    enqueued?;
    graph
}
