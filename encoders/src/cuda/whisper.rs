//! The Whisper encoder on the GPU: both convolutions as im2col and a product (the first reads
//! the channel-major spectrogram, the second the time-major rows), GELU, sinusoidal positions,
//! the pre-LN blocks and the final LayerNorm. Every window is the same shape, so one graph key
//! serves all; the pooling to 25 rows a second happens on the host, as on the CPU.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{
    AttentionKernel, BlockScratch, CudaError, Forward, Gpu, GpuBlock, GpuNorm, GraphCounters, Graphs, driver, int,
    rows_launch,
};
use crate::EncodeError;
use crate::ops::Activation;
use crate::whisper::{WhisperEncoder, pool_pairs};

struct WhisperModel {
    n_mels: usize,
    frames: usize,
    len: usize,
    d: usize,
    intermediate: usize,
    conv1: (CudaSlice<f32>, CudaSlice<f32>),
    conv2: (CudaSlice<f32>, CudaSlice<f32>),
    positions: CudaSlice<f32>,
    blocks: Vec<GpuBlock>,
    norm: GpuNorm,
}

/// A Whisper encoder on one GPU.
pub struct CudaWhisper {
    gpu: Gpu,
    model: WhisperModel,
    graphs: Graphs<WhisperModel>,
}

impl std::fmt::Debug for CudaWhisper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaWhisper")
            .field("blocks", &self.model.blocks.len())
            .field("d_model", &self.model.d)
            .finish_non_exhaustive()
    }
}

struct WhisperBuffers {
    mels: CudaSlice<f32>,
    columns1: CudaSlice<f32>,
    conv1: CudaSlice<f32>,
    columns2: CudaSlice<f32>,
    x: CudaSlice<f32>,
    scratch: BlockScratch,
}

impl WhisperModel {
    #[allow(clippy::too_many_arguments)]
    fn im2col(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        columns: &mut CudaSlice<f32>,
        (channels, in_len, out_len, stride): (usize, usize, usize, usize),
        (item_stride, channel_stride, time_stride): (usize, usize, usize),
        items: usize,
    ) -> Result<(), CudaError> {
        let args = [
            channels,
            in_len,
            out_len,
            stride,
            item_stride,
            channel_stride,
            time_stride,
        ]
        .map(int)
        .into_iter()
        .collect::<Result<Vec<i32>, _>>()?;
        let mut launch = gpu.stream.launch_builder(&gpu.kernels.im2col_conv1d);
        launch.arg(x).arg(columns);
        for value in &args {
            launch.arg(value);
        }
        // SAFETY: `items·out_len` rows of `channels·3` columns out; reads stay inside `x`'s
        // `items` items by the strides given.
        unsafe { launch.launch(rows_launch(items * out_len, 256)?) }.map_err(driver)?;
        Ok(())
    }
}

impl Forward for WhisperModel {
    type Key = ();
    type Buffers = WhisperBuffers;

    fn alloc(&self, gpu: &Gpu, _: (), capacity: usize) -> Result<WhisperBuffers, CudaError> {
        let rows = capacity * self.len;
        Ok(WhisperBuffers {
            mels: gpu.zeros(capacity * self.n_mels * self.frames)?,
            columns1: gpu.zeros(capacity * self.frames * self.n_mels * 3)?,
            conv1: gpu.zeros(capacity * self.frames * self.d)?,
            columns2: gpu.zeros(rows * self.d * 3)?,
            x: gpu.zeros(rows * self.d)?,
            scratch: BlockScratch::alloc(gpu, rows, self.d, self.intermediate)?,
        })
    }

    fn enqueue(&self, gpu: &Gpu, b: &mut WhisperBuffers, _: (), items: usize) -> Result<(), CudaError> {
        let (n_mels, frames, len, d) = (self.n_mels, self.frames, self.len, self.d);
        // conv1: the spectrogram is channel-major [n_mels, frames] per window.
        self.im2col(
            gpu,
            &b.mels,
            &mut b.columns1,
            (n_mels, frames, frames, 1),
            (n_mels * frames, frames, 1),
            items,
        )?;
        gpu.linear(
            &b.columns1,
            &self.conv1.0,
            &mut b.conv1,
            (items * frames, n_mels * 3, d),
            false,
        )?;
        gpu.bias_act(&mut b.conv1, &self.conv1.1, (items * frames, d), Some(Activation::Gelu))?;
        // conv2, stride 2: its input is time-major [frames, d] per window.
        self.im2col(
            gpu,
            &b.conv1,
            &mut b.columns2,
            (d, frames, len, 2),
            (frames * d, 1, d),
            items,
        )?;
        gpu.linear(&b.columns2, &self.conv2.0, &mut b.x, (items * len, d * 3, d), false)?;
        gpu.bias_act(&mut b.x, &self.conv2.1, (items * len, d), Some(Activation::Gelu))?;
        {
            let (l, width) = (int(len)?, int(d)?);
            let mut launch = gpu.stream.launch_builder(&gpu.kernels.add_positions);
            launch.arg(&mut b.x).arg(&self.positions).arg(&l).arg(&width);
            // SAFETY: `items·len` rows of `d`; the table holds `len` rows.
            unsafe { launch.launch(rows_launch(items * len, 256)?) }.map_err(driver)?;
        }
        for block in &self.blocks {
            gpu.block(block, &mut b.x, &mut b.scratch, (items * len, len))?;
        }
        gpu.layer_norm_in_place(&mut b.x, &self.norm, items * len)
    }

    fn input(buffers: &mut WhisperBuffers) -> &mut CudaSlice<f32> {
        &mut buffers.mels
    }

    fn output(buffers: &WhisperBuffers) -> &CudaSlice<f32> {
        &buffers.x
    }

    fn input_len(&self, _: ()) -> usize {
        self.n_mels * self.frames
    }

    fn output_len(&self, _: ()) -> usize {
        self.len * self.d
    }

    fn tokens_per_item(&self, _: ()) -> usize {
        self.len
    }
}

impl CudaWhisper {
    /// Copies `encoder` to GPU `ordinal`; graphs will be captured at power-of-two token
    /// budgets up to `max_budget` encoder rows (1,500 per 30 s window).
    ///
    /// # Errors
    ///
    /// [`CudaError`] when the driver, NVRTC, cuBLAS or the device is missing, memory runs out,
    /// or the kernels do not compile.
    pub fn new(encoder: &WhisperEncoder, ordinal: usize, max_budget: usize) -> Result<CudaWhisper, CudaError> {
        let gpu = Gpu::open(ordinal)?;
        let c = encoder.config();
        if c.max_source_positions > super::MAX_SEQUENCE {
            return Err(CudaError::Unsupported(format!(
                "{} positions (the attention kernel takes up to {})",
                c.max_source_positions,
                super::MAX_SEQUENCE
            )));
        }
        let blocks = encoder
            .blocks
            .iter()
            .map(|block| GpuBlock::upload(&gpu, block))
            .collect::<Result<Vec<_>, _>>()?;
        let model = WhisperModel {
            n_mels: c.n_mels,
            frames: c.input_frames(),
            len: c.max_source_positions,
            d: c.d_model,
            intermediate: c.ffn_dim,
            conv1: (gpu.upload(&encoder.conv1.0)?, gpu.upload(&encoder.conv1.1)?),
            conv2: (gpu.upload(&encoder.conv2.0)?, gpu.upload(&encoder.conv2.1)?),
            positions: gpu.upload(&encoder.positions)?,
            blocks,
            norm: GpuNorm::upload(&gpu, &encoder.norm)?,
        };
        Ok(CudaWhisper {
            gpu,
            model,
            graphs: Graphs::new(max_budget),
        })
    }

    /// `last_hidden_state` for a batch of windows, as [`WhisperEncoder::forward`]; through the
    /// graph cache when `graphs`, else eagerly.
    ///
    /// # Errors
    ///
    /// [`CudaError::Encode`] for spectrograms of the wrong size; other [`CudaError`]s for the
    /// GPU.
    pub fn forward(&self, mels: &[&[f32]], graphs: bool) -> Result<Vec<f32>, CudaError> {
        if mels.is_empty() {
            return Err(EncodeError::Empty.into());
        }
        let per = self.model.input_len(());
        for (index, mel) in mels.iter().enumerate() {
            if mel.len() != per {
                return Err(EncodeError::Shape {
                    index,
                    reason: format!(
                        "{} values, the encoder takes {} mel bins × {} frames",
                        mel.len(),
                        self.model.n_mels,
                        self.model.frames
                    ),
                }
                .into());
            }
        }
        Ok(self.graphs.run(&self.model, &self.gpu, (), mels, graphs)?.0)
    }

    /// Features for a batch of windows, pooled and cut as [`WhisperEncoder::audio_features`].
    ///
    /// # Errors
    ///
    /// As [`CudaWhisper::forward`].
    pub fn audio_features(&self, mels: &[&[f32]], seconds: &[f64]) -> Result<Vec<Vec<f32>>, CudaError> {
        let hidden = self.forward(mels, true)?;
        Ok(pool_pairs(&hidden, self.model.len, self.model.d, seconds))
    }

    /// Chooses the attention kernel (the tiled one by default); captured graphs are dropped.
    pub fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        self.gpu.attention_kernel = kernel;
        self.graphs.clear();
    }

    /// Graph replays, eager runs and captures so far.
    pub fn counters(&self) -> &GraphCounters {
        &self.graphs.counters
    }
}
