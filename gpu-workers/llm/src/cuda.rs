//! The CUDA backend: the same forward pass as the CPU's, on one NVIDIA GPU through cudarc.
//!
//! Everything CUDA is loaded at run time (cudarc's dynamic loading: the driver, NVRTC and
//! cuBLAS), so this module builds on machines without CUDA and a worker asked for a GPU that
//! is not there gets an error saying which part is missing. The kernels in `cuda_kernels.cu`
//! (embedding, RMSNorm, bias, RoPE with the paged-cache write, paged attention with an online
//! softmax, SiLU-multiply, greedy argmax) are compiled by NVRTC when the backend starts;
//! products are cuBLAS SGEMMs, with the query/key/value and gate/up projections fused into one
//! product each and the residual adds folded into the output products (β = 1). Weights are f32
//! and laid out as on the CPU, so both backends can be compared value by value. Greedy
//! sequences take their token from the GPU's argmax (4 bytes back per sequence); others copy
//! their logits back and sample on the host with their own seeded sampler.

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::config::ModelConfig;
use crate::model::{MediaRows, Model};
use switchyard_workers::engine::{Executor, ModelLimits, StepItem};

/// The kernels' CUDA C source.
pub const KERNELS: &str = include_str!("cuda_kernels.cu");

/// The kernels the backend launches, by their `extern "C"` names.
pub const KERNEL_NAMES: [&str; 8] = [
    "embed",
    "gather_rows",
    "rms_norm",
    "add_bias",
    "rope_and_store",
    "paged_attention",
    "silu_mul",
    "argmax",
];

/// Why the CUDA backend could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The NVIDIA driver library (libcuda) is not installed.
    #[error("no CUDA driver: libcuda could not be loaded (no NVIDIA GPU or driver on this machine)")]
    NoDriver,
    /// NVRTC (libnvrtc) is not installed.
    #[error("no NVRTC: libnvrtc could not be loaded (install the CUDA runtime compiler)")]
    NoNvrtc,
    /// cuBLAS (libcublas) is not installed.
    #[error("no cuBLAS: libcublas could not be loaded (install the CUDA toolkit's cuBLAS)")]
    NoCublas,
    /// No device with that ordinal.
    #[error("CUDA device {ordinal} does not exist ({count} device(s) found)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// NVRTC rejected the kernels.
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// The model does not fit the kernels' limits.
    #[error("unsupported model shape: {0}")]
    Unsupported(String),
}

fn driver(err: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(err.to_string())
}

/// Whether NVRTC can be loaded on this machine (no GPU needed).
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether the CUDA driver can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Compiles the kernels to PTX. Needs NVRTC only, not a GPU, so CPU machines can check them.
///
/// # Errors
///
/// [`CudaError::NoNvrtc`] without NVRTC, [`CudaError::Compile`] with the compiler's log.
pub fn compile_kernels() -> Result<cudarc::nvrtc::Ptx, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    cudarc::nvrtc::compile_ptx_with_opts(
        KERNELS,
        cudarc::nvrtc::CompileOptions {
            name: Some("switchyard_llm.cu".into()),
            ..Default::default()
        },
    )
    .map_err(|err| CudaError::Compile(err.to_string()))
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
    /// `[num_blocks · block_size, kv_width]`.
    keys: CudaSlice<f32>,
    values: CudaSlice<f32>,
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

/// Everything one step uploads or allocates, sized by its rows.
struct StepBuffers {
    rows: usize,
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
    max_blocks: usize,
    last_rows: CudaSlice<i32>,
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
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        let count = CudaContext::device_count().map_err(driver)?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let config = model.config().clone();
        if config.head_dim > 512 || !config.head_dim.is_multiple_of(2) {
            return Err(CudaError::Unsupported(format!(
                "head_dim {} (the attention kernel takes even widths up to 512)",
                config.head_dim
            )));
        }
        let ptx = compile_kernels()?;
        let context = CudaContext::new(ordinal).map_err(driver)?;
        // One stream does everything, so cudarc's cross-stream event tracking is not needed.
        // SAFETY: no slice is shared between streams in this backend.
        unsafe { context.disable_event_tracking() };
        let stream = context.default_stream();
        let module = context.load_module(ptx).map_err(driver)?;
        let load = |name: &str| module.load_function(name).map_err(driver);
        let kernels = Kernels {
            embed: load(KERNEL_NAMES[0])?,
            gather_rows: load(KERNEL_NAMES[1])?,
            rms_norm: load(KERNEL_NAMES[2])?,
            add_bias: load(KERNEL_NAMES[3])?,
            rope_and_store: load(KERNEL_NAMES[4])?,
            paged_attention: load(KERNEL_NAMES[5])?,
            silu_mul: load(KERNEL_NAMES[6])?,
            argmax: load(KERNEL_NAMES[7])?,
        };
        let blas = CudaBlas::new(stream.clone()).map_err(|err| CudaError::Blas(err.to_string()))?;
        let upload = |values: &[f32]| stream.clone_htod(values).map_err(driver);
        let kv_rows = num_blocks * block_size * config.num_kv_heads * config.head_dim;
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
                keys: stream.alloc_zeros(kv_rows).map_err(driver)?,
                values: stream.alloc_zeros(kv_rows).map_err(driver)?,
            });
        }
        let embed = upload(&model.embedding().to_f32())?;
        let lm_head = match model.untied_lm_head() {
            Some(head) => Some(upload(&head.to_f32())?),
            None => None,
        };
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
        })
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
        unsafe { self.blas.gemm(config, weight, x, y) }.map_err(|err| CudaError::Blas(err.to_string()))
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

    /// Uploads a step's token ids, positions, cache slots and block tables; returns with them
    /// the media rows to copy over the embedded rows.
    fn prepare<'c>(&self, chunks: &[GpuChunk<'c>]) -> Result<(StepBuffers, Vec<MediaCopy<'c>>), CudaError> {
        let c = &self.config;
        let rows: usize = chunks.iter().map(|chunk| chunk.count).sum();
        let max_blocks = chunks.iter().map(|chunk| chunk.blocks.len()).max().unwrap_or(1).max(1);
        let mut ids = Vec::with_capacity(rows);
        let mut positions = Vec::with_capacity(rows);
        let mut slots = Vec::with_capacity(rows);
        let mut row_sequence = Vec::with_capacity(rows);
        let mut block_tables = vec![0i32; chunks.len() * max_blocks];
        let mut last_rows = Vec::with_capacity(chunks.len());
        let mut media = Vec::new();
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
                media.push(((ids.len() + span.offset) * c.hidden_size, span.rows));
            }
            if chunk.count == 0 || end > chunk.tokens.len() {
                return Err(CudaError::Unsupported(format!(
                    "chunk {index} asks for tokens past its sequence"
                )));
            }
            if end > chunk.blocks.len() * self.block_size {
                return Err(CudaError::Unsupported(format!(
                    "chunk {index}'s block table does not cover it"
                )));
            }
            for (slot, &block) in block_tables[index * max_blocks..].iter_mut().zip(chunk.blocks) {
                if block as usize >= self.num_blocks {
                    return Err(CudaError::Unsupported(format!("block {block} is outside the cache")));
                }
                *slot = block as i32;
            }
            for position in chunk.start..end {
                let id = chunk.tokens[position];
                if from_media[position - chunk.start] {
                    // Any row of the table will do: the media row is copied over it.
                    ids.push(0);
                } else if id as usize >= c.vocab_size {
                    return Err(CudaError::Unsupported(format!(
                        "token id {id} is outside the vocabulary"
                    )));
                } else {
                    ids.push(id);
                }
                positions.push(position as i32);
                let block = chunk.blocks[position / self.block_size] as usize;
                slots.push((block * self.block_size + position % self.block_size) as i32);
                row_sequence.push(index as i32);
            }
            last_rows.push((ids.len() - 1) as i32);
        }
        let s = &self.stream;
        let zeros = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(driver);
        let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let buffers = StepBuffers {
            rows,
            x: zeros(rows * c.hidden_size)?,
            normed: zeros(rows * c.hidden_size)?,
            qkv: zeros(rows * (q + 2 * kv))?,
            attention: zeros(rows * q)?,
            gate_up: zeros(rows * 2 * c.intermediate_size)?,
            activation: zeros(rows * c.intermediate_size)?,
            ids: s.clone_htod(&ids).map_err(driver)?,
            positions: s.clone_htod(&positions).map_err(driver)?,
            slots: s.clone_htod(&slots).map_err(driver)?,
            row_sequence: s.clone_htod(&row_sequence).map_err(driver)?,
            block_tables: s.clone_htod(&block_tables).map_err(driver)?,
            max_blocks,
            last_rows: s.clone_htod(&last_rows).map_err(driver)?,
        };
        Ok((buffers, media))
    }

    /// Runs one step and leaves each chunk's last-position logits on the GPU,
    /// `[chunks, vocab]`.
    fn run(&mut self, chunks: &[GpuChunk<'_>]) -> Result<CudaSlice<f32>, CudaError> {
        let c = &self.config;
        let (mut b, media) = self.prepare(chunks)?;
        let rows = b.rows;
        let (h, q, kv, inter) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        let hidden = h as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.embed);
        launch.arg(&b.ids).arg(&self.embed).arg(&mut b.x).arg(&hidden);
        // SAFETY: `ids` holds `rows` ids below the vocabulary size (checked in `prepare`).
        unsafe { launch.launch(Self::rows_launch(rows, 256)) }.map_err(driver)?;
        // Media rows over their placeholders' embedded rows (stream order: after the embedding).
        for (at, values) in media {
            self.stream
                .memcpy_htod(values, &mut b.x.slice_mut(at..at + values.len()))
                .map_err(driver)?;
        }
        let (num_heads, num_kv_heads, head_dim) = (c.num_heads as i32, c.num_kv_heads as i32, c.head_dim as i32);
        let (max_blocks, block_size) = (b.max_blocks as i32, self.block_size as i32);
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
            // SAFETY: every slot lies inside the cache (block ids checked in `prepare`).
            unsafe { launch.launch(Self::rows_launch(rows, 128)) }.map_err(driver)?;
            let mut launch = self.stream.launch_builder(&self.kernels.paged_attention);
            launch
                .arg(&b.qkv)
                .arg(&layer.keys)
                .arg(&layer.values)
                .arg(&b.block_tables)
                .arg(&b.row_sequence)
                .arg(&b.positions)
                .arg(&mut b.attention)
                .arg(&max_blocks)
                .arg(&block_size)
                .arg(&num_heads)
                .arg(&num_kv_heads)
                .arg(&head_dim)
                .arg(&scale);
            let grid = LaunchConfig {
                grid_dim: (rows as u32, c.num_heads as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: block tables cover every row's positions (checked in `prepare`).
            unsafe { launch.launch(grid) }.map_err(driver)?;
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
        let kept_rows = chunks.len();
        let zeros = |n: usize| self.stream.alloc_zeros::<f32>(n).map_err(driver);
        let mut kept = zeros(kept_rows * h)?;
        let mut launch = self.stream.launch_builder(&self.kernels.gather_rows);
        launch.arg(&b.x).arg(&b.last_rows).arg(&mut kept).arg(&hidden);
        // SAFETY: every last row is below `rows`.
        unsafe { launch.launch(Self::rows_launch(kept_rows, 256)) }.map_err(driver)?;
        let mut kept_normed = zeros(kept_rows * h)?;
        self.rms_norm(&kept, &self.norm, &mut kept_normed, kept_rows)?;
        let mut logits = zeros(kept_rows * c.vocab_size)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.linear(&kept_normed, head, &mut logits, (kept_rows, h, c.vocab_size), false)?;
        Ok(logits)
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
}

/// Starts a native engine for `model` on GPU `ordinal`, on a thread of its own.
///
/// # Errors
///
/// [`CudaError`] when the backend cannot start; the I/O error of the thread as
/// [`CudaError::Driver`].
pub fn spawn_cuda_engine(
    model: &Model,
    ordinal: usize,
    config: switchyard_workers::engine::EngineConfig,
) -> Result<switchyard_workers::engine::EngineHandle, CudaError> {
    let executor = CudaExecutor::new(model, ordinal, config.block_size, config.num_gpu_blocks)?;
    let limits = executor.limits();
    switchyard_workers::engine::spawn_native(config, limits, executor, "switchyard-llm-cuda")
        .map_err(|err| CudaError::Driver(format!("cannot start the engine thread: {err}")))
}
