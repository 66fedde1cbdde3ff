//! The vision encoder on the GPU: patch embedding (im2col and a product), class token and
//! position embeddings (interpolated on the host for other grids, uploaded once per image
//! size), the pre-LN blocks up to the feature layer, the post-LayerNorm when the last state is
//! wanted, the kept rows and the LLaVA projector. Micro-batches of one image size go through
//! [`Graphs`]; the image size is the graph key.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{
    AttentionKernel, BlockScratch, CudaError, Forward, Gpu, GpuBlock, GpuLinear, GpuNorm, GraphCounters, Graphs, Path,
    driver, int, rows_launch,
};
use crate::EncodeError;
use crate::image::PixelValues;
use crate::ops::Activation;
use crate::vit::{FeatureLayer, Features, PositionTable, SelectStrategy, VisionEncoder};

/// The weights and shapes the forward needs, on the GPU.
struct VisionModel {
    patch: usize,
    hidden: usize,
    patch_weight: CudaSlice<f32>,
    patch_bias: Option<CudaSlice<f32>>,
    class_embedding: Option<CudaSlice<f32>>,
    positions: PositionTable,
    pre_norm: Option<GpuNorm>,
    blocks: Vec<GpuBlock>,
    intermediate: usize,
    post_norm: Option<GpuNorm>,
    drop_class: bool,
    projector: Option<(GpuLinear, GpuLinear, Activation)>,
    feature_dim: usize,
}

/// A vision encoder (tower and projector) on one GPU.
pub struct CudaVision {
    gpu: Gpu,
    model: VisionModel,
    graphs: Graphs<VisionModel>,
}

impl std::fmt::Debug for CudaVision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaVision")
            .field("blocks", &self.model.blocks.len())
            .field("feature_dim", &self.model.feature_dim)
            .finish_non_exhaustive()
    }
}

/// Everything one forward touches, for up to `capacity` images of one size.
struct VisionBuffers {
    pixels: CudaSlice<f32>,
    columns: CudaSlice<f32>,
    patches: CudaSlice<f32>,
    positions: CudaSlice<f32>,
    x: CudaSlice<f32>,
    scratch: BlockScratch,
    selected: CudaSlice<f32>,
    projected: CudaSlice<f32>,
    output: CudaSlice<f32>,
}

impl VisionModel {
    fn grid(&self, (height, width): (usize, usize)) -> (usize, usize) {
        (height / self.patch, width / self.patch)
    }

    fn sequence_len(&self, key: (usize, usize)) -> usize {
        let (gh, gw) = self.grid(key);
        gh * gw + usize::from(self.class_embedding.is_some())
    }
}

impl Forward for VisionModel {
    type Key = (usize, usize);
    type Buffers = VisionBuffers;

    fn alloc(&self, gpu: &Gpu, key: (usize, usize), capacity: usize) -> Result<VisionBuffers, CudaError> {
        let (gh, gw) = self.grid(key);
        let patches = capacity * gh * gw;
        let rows = capacity * self.sequence_len(key);
        let kept = capacity * self.tokens_per_item(key);
        let width = self.projector.as_ref().map_or(1, |(fc1, _, _)| fc1.output);
        Ok(VisionBuffers {
            pixels: gpu.zeros(capacity * self.input_len(key))?,
            columns: gpu.zeros(patches * 3 * self.patch * self.patch)?,
            patches: gpu.zeros(patches * self.hidden)?,
            positions: gpu.upload(&self.positions.for_grid(gh, gw))?,
            x: gpu.zeros(rows * self.hidden)?,
            scratch: BlockScratch::alloc(gpu, rows, self.hidden, self.intermediate)?,
            selected: gpu.zeros(if self.projector.is_some() {
                kept * self.hidden
            } else {
                1
            })?,
            projected: gpu.zeros(kept * width)?,
            output: gpu.zeros(kept * self.feature_dim)?,
        })
    }

    fn enqueue(&self, gpu: &Gpu, b: &mut VisionBuffers, key: (usize, usize), items: usize) -> Result<(), CudaError> {
        let (height, width) = key;
        let (gh, gw) = self.grid(key);
        let per_image = gh * gw;
        let len = self.sequence_len(key);
        let rows = items * len;
        let p = self.patch;
        let s = &gpu.stream;
        {
            let (h, w, patch, grid_w, count) = (int(height)?, int(width)?, int(p)?, int(gw)?, int(per_image)?);
            let mut launch = s.launch_builder(&gpu.kernels.im2col_patches);
            launch
                .arg(&b.pixels)
                .arg(&mut b.columns)
                .arg(&h)
                .arg(&w)
                .arg(&patch)
                .arg(&grid_w)
                .arg(&count);
            // SAFETY: `items` images of 3·h·w values in, `items·per_image` rows of 3·p·p out.
            unsafe { launch.launch(rows_launch(items * per_image, 128)?) }.map_err(driver)?;
        }
        gpu.linear(
            &b.columns,
            &self.patch_weight,
            &mut b.patches,
            (items * per_image, 3 * p * p, self.hidden),
            false,
        )?;
        if let Some(bias) = &self.patch_bias {
            gpu.bias_act(&mut b.patches, bias, (items * per_image, self.hidden), None)?;
        }
        {
            let (count, l, hidden) = (int(per_image)?, int(len)?, int(self.hidden)?);
            let has_class = i32::from(self.class_embedding.is_some());
            // Without a class token the kernel never reads its pointer; any buffer will do.
            let class = self.class_embedding.as_ref().unwrap_or(&b.positions);
            let mut launch = s.launch_builder(&gpu.kernels.assemble_tokens);
            launch
                .arg(&b.patches)
                .arg(class)
                .arg(&b.positions)
                .arg(&mut b.x)
                .arg(&count)
                .arg(&l)
                .arg(&hidden)
                .arg(&has_class);
            // SAFETY: `rows` token rows of `hidden` out, read from the patch rows and tables.
            unsafe { launch.launch(rows_launch(rows, 256)?) }.map_err(driver)?;
        }
        if let Some(norm) = &self.pre_norm {
            gpu.layer_norm_in_place(&mut b.x, norm, rows)?;
        }
        for block in &self.blocks {
            gpu.block(block, &mut b.x, &mut b.scratch, (rows, len))?;
        }
        if let Some(norm) = &self.post_norm {
            gpu.layer_norm_in_place(&mut b.x, norm, rows)?;
        }
        let keep = self.tokens_per_item(key);
        let (l, k, hidden) = (int(len)?, int(keep)?, int(self.hidden)?);
        let target = if self.projector.is_some() {
            &mut b.selected
        } else {
            &mut b.output
        };
        let mut launch = s.launch_builder(&gpu.kernels.keep_last_rows);
        launch.arg(&b.x).arg(target).arg(&l).arg(&k).arg(&hidden);
        // SAFETY: `items·keep` rows of `hidden` out of `items·len` rows.
        unsafe { launch.launch(rows_launch(items * keep, 256)?) }.map_err(driver)?;
        if let Some((fc1, fc2, act)) = &self.projector {
            fc1.forward(gpu, &b.selected, &mut b.projected, items * keep, Some(*act))?;
            fc2.forward(gpu, &b.projected, &mut b.output, items * keep, None)?;
        }
        Ok(())
    }

    fn input(buffers: &mut VisionBuffers) -> &mut CudaSlice<f32> {
        &mut buffers.pixels
    }

    fn output(buffers: &VisionBuffers) -> &CudaSlice<f32> {
        &buffers.output
    }

    fn input_len(&self, (height, width): (usize, usize)) -> usize {
        3 * height * width
    }

    fn output_len(&self, key: (usize, usize)) -> usize {
        self.tokens_per_item(key) * self.feature_dim
    }

    fn tokens_per_item(&self, key: (usize, usize)) -> usize {
        self.sequence_len(key) - usize::from(self.drop_class)
    }
}

impl CudaVision {
    /// Copies `encoder`'s tower (up to its feature layer) and projector to GPU `ordinal`;
    /// graphs will be captured at power-of-two token budgets up to `max_budget` feature rows.
    ///
    /// # Errors
    ///
    /// [`CudaError`] when the driver, NVRTC, cuBLAS or the device is missing, memory runs out,
    /// or the kernels do not compile.
    pub fn new(encoder: &VisionEncoder, ordinal: usize, max_budget: usize) -> Result<CudaVision, CudaError> {
        let gpu = Gpu::open(ordinal)?;
        let tower = &encoder.tower;
        let config = &tower.config;
        let stop = tower.blocks_for(encoder.layer)?;
        let blocks = tower.blocks[..stop]
            .iter()
            .map(|block| GpuBlock::upload(&gpu, block))
            .collect::<Result<Vec<_>, _>>()?;
        let projector = match &encoder.projector {
            Some(projector) => Some((
                GpuLinear::upload(&gpu, &projector.mlp.fc1)?,
                GpuLinear::upload(&gpu, &projector.mlp.fc2)?,
                projector.mlp.act,
            )),
            None => None,
        };
        let model = VisionModel {
            patch: config.patch_size,
            hidden: config.hidden_size,
            patch_weight: gpu.upload(&tower.patch_weight)?,
            patch_bias: tower.patch_bias.as_deref().map(|b| gpu.upload(b)).transpose()?,
            class_embedding: tower.class_embedding.as_deref().map(|c| gpu.upload(c)).transpose()?,
            positions: tower.position_table(),
            pre_norm: tower.pre_norm.as_ref().map(|n| GpuNorm::upload(&gpu, n)).transpose()?,
            blocks,
            intermediate: config.intermediate_size,
            post_norm: match encoder.layer {
                FeatureLayer::Last => Some(GpuNorm::upload(&gpu, &tower.post_norm)?),
                FeatureLayer::Hidden(_) => None,
            },
            drop_class: encoder.strategy == SelectStrategy::Default && tower.class_embedding.is_some(),
            projector,
            feature_dim: encoder.feature_dim(),
        };
        Ok(CudaVision {
            gpu,
            model,
            graphs: Graphs::new(max_budget),
        })
    }

    /// Encodes a micro-batch as [`VisionEncoder::encode`] does, each size group through the
    /// graph cache (replayed, or eager above every budget).
    ///
    /// # Errors
    ///
    /// [`CudaError::Encode`] for inputs the model cannot take (as on the CPU); other
    /// [`CudaError`]s for the GPU.
    pub fn encode(&self, images: &[&PixelValues]) -> Result<Features, CudaError> {
        self.run(images, true)
    }

    /// The same forward without graphs (for comparison, and what a miss runs).
    ///
    /// # Errors
    ///
    /// As [`CudaVision::encode`].
    pub fn encode_eager(&self, images: &[&PixelValues]) -> Result<Features, CudaError> {
        self.run(images, false)
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

    fn run(&self, images: &[&PixelValues], graphs: bool) -> Result<Features, CudaError> {
        if images.is_empty() {
            return Err(EncodeError::Empty.into());
        }
        let p = self.model.patch;
        for (index, image) in images.iter().enumerate() {
            if image.data.len() != 3 * image.height * image.width || image.height < p || image.width < p {
                return Err(EncodeError::Shape {
                    index,
                    reason: format!("not a 3-channel image of at least one {p}x{p} patch"),
                }
                .into());
            }
        }
        let dim = self.model.feature_dim;
        let mut per_item: Vec<Option<Vec<f32>>> = vec![None; images.len()];
        let mut sizes: Vec<(usize, usize)> = images.iter().map(|i| (i.height, i.width)).collect();
        sizes.sort_unstable();
        sizes.dedup();
        for key in sizes {
            if self.model.sequence_len(key) > super::MAX_SEQUENCE {
                return Err(CudaError::Unsupported(format!(
                    "{}x{} images are {} rows (the attention kernel takes up to {})",
                    key.0,
                    key.1,
                    self.model.sequence_len(key),
                    super::MAX_SEQUENCE
                )));
            }
            let members: Vec<usize> = (0..images.len())
                .filter(|&i| (images[i].height, images[i].width) == key)
                .collect();
            let inputs: Vec<&[f32]> = members.iter().map(|&i| images[i].data.as_slice()).collect();
            let (output, _) = self.graphs.run(&self.model, &self.gpu, key, &inputs, graphs)?;
            if members.len() == images.len() {
                // One size: the batch's rows are already in item order.
                return Ok(Features::from_rows(
                    dim,
                    vec![self.model.tokens_per_item(key); images.len()],
                    output,
                ));
            }
            let per = self.model.output_len(key);
            for (k, &index) in members.iter().enumerate() {
                per_item[index] = Some(output[k * per..(k + 1) * per].to_vec());
            }
        }
        Ok(Features::from_items(dim, per_item))
    }

    /// How the graph cache would run a micro-batch of `items` images of one size (for tests
    /// and metrics: whether a budget holds them).
    pub fn path_for(&self, height: usize, width: usize, items: usize) -> Path {
        let per_item = self.model.tokens_per_item((height, width)).max(1);
        if self.graphs.budgets.iter().any(|&b| b / per_item >= items) {
            Path::Replay
        } else {
            Path::Eager
        }
    }
}
