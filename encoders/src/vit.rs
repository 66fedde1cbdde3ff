//! The vision tower: a CLIP or SigLIP ViT, with the LLaVA-style projector that maps its
//! features into an LLM's embedding space, and video through it with temporal pooling.
//!
//! Architecture, as transformers' `CLIPVisionModel` / `SiglipVisionModel`: a patch embedding
//! (a convolution whose kernel and stride are the patch size; SigLIP's has a bias), CLIP's class
//! token, learned position embeddings (interpolated bicubically, as `interpolate_pos_encoding`
//! does, when an image's patch grid differs from the config's), CLIP's `pre_layrnorm`, pre-LN
//! encoder blocks (LayerNorm → attention → residual, LayerNorm → GELU MLP → residual) and the
//! post-LayerNorm. LLaVA takes the hidden state of `vision_feature_layer` (−2 by default: the
//! output of the second-to-last block, no post-LayerNorm), drops the class token under the
//! `default` strategy, and projects with `linear_2(act(linear_1(x)))`.
//!
//! A micro-batch of images of one size is one forward: every linear layer runs over all its
//! rows at once. Images of different sizes form separate forwards.

use std::path::Path;

use crate::image::PixelValues;
use crate::ops::{Activation, LayerNorm, Linear, Mlp, PreNormBlock, SelfAttention, Strided, gemm};
use crate::tensor::{Safetensors, TensorSource};
use crate::{ConfigObject, EncodeError, LoadError};

/// Which ViT family the weights are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionFamily {
    /// CLIP: class token, pre-LayerNorm, bias-free patch embedding.
    Clip,
    /// SigLIP: no class token, patch embedding with a bias.
    Siglip,
}

/// A vision tower's hyperparameters (`vision_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// CLIP or SigLIP.
    pub family: VisionFamily,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_layers: usize,
    /// `num_attention_heads`.
    pub num_heads: usize,
    /// `image_size`: the side the position embeddings were trained for.
    pub image_size: usize,
    /// `patch_size`.
    pub patch_size: usize,
    /// `num_channels` (3).
    pub num_channels: usize,
    /// `layer_norm_eps`.
    pub layer_norm_eps: f32,
    /// `hidden_act`.
    pub activation: Activation,
}

impl VisionConfig {
    fn from_json(config: &ConfigObject<'_>, family: VisionFamily) -> Result<VisionConfig, LoadError> {
        let (patch, act, eps) = match family {
            VisionFamily::Clip => (32, "quick_gelu", 1e-5),
            VisionFamily::Siglip => (16, "gelu_pytorch_tanh", 1e-6),
        };
        let act_name = config.str_or("hidden_act", act)?;
        let activation = Activation::parse(act_name)
            .ok_or_else(|| config.error("hidden_act", format!("`{act_name}` is not supported")))?;
        let vision = VisionConfig {
            family,
            hidden_size: config.usize_or("hidden_size", Some(768))?,
            intermediate_size: config.usize_or("intermediate_size", Some(3072))?,
            num_layers: config.usize_or("num_hidden_layers", Some(12))?,
            num_heads: config.usize_or("num_attention_heads", Some(12))?,
            image_size: config.usize_or("image_size", Some(224))?,
            patch_size: config.usize_or("patch_size", Some(patch))?,
            num_channels: config.usize_or("num_channels", Some(3))?,
            layer_norm_eps: config.f64_or("layer_norm_eps", eps)? as f32,
            activation,
        };
        for (key, value) in [
            ("hidden_size", vision.hidden_size),
            ("intermediate_size", vision.intermediate_size),
            ("num_hidden_layers", vision.num_layers),
            ("num_attention_heads", vision.num_heads),
            ("patch_size", vision.patch_size),
        ] {
            if value == 0 {
                return Err(config.error(key, "must be positive"));
            }
        }
        if !vision.hidden_size.is_multiple_of(vision.num_heads) {
            return Err(config.error(
                "num_attention_heads",
                format!(
                    "{} does not divide hidden_size {}",
                    vision.num_heads, vision.hidden_size
                ),
            ));
        }
        if vision.num_channels != 3 {
            return Err(config.error("num_channels", "only 3 (RGB) is supported"));
        }
        if vision.image_size < vision.patch_size {
            return Err(config.error("image_size", "smaller than patch_size"));
        }
        Ok(vision)
    }

    /// Patches per side at the trained size.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }
}

/// The ViT itself.
#[derive(Debug)]
pub struct VisionTower {
    pub(crate) config: VisionConfig,
    /// `[hidden, 3·p·p]`, the convolution kernel flattened.
    pub(crate) patch_weight: Vec<f32>,
    pub(crate) patch_bias: Option<Vec<f32>>,
    pub(crate) class_embedding: Option<Vec<f32>>,
    /// `[positions, hidden]` (the class token's first for CLIP).
    positions: Vec<f32>,
    pub(crate) pre_norm: Option<LayerNorm>,
    pub(crate) blocks: Vec<PreNormBlock>,
    pub(crate) post_norm: LayerNorm,
}

/// Which hidden state a caller wants: `hidden_states[i]` as transformers numbers them (0 is the
/// embeddings, `i` the output of block `i`; negative counts from the end), or the last block's
/// output with the post-LayerNorm applied (`last_hidden_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureLayer {
    /// `hidden_states[i]`.
    Hidden(isize),
    /// `last_hidden_state`.
    Last,
}

impl VisionTower {
    /// Loads the tower's tensors under `prefix` (e.g. `vision_model` or
    /// `model.vision_tower.vision_model`).
    ///
    /// # Errors
    ///
    /// [`LoadError::Weights`] naming a missing or misshapen tensor.
    pub fn load(weights: &dyn TensorSource, prefix: &str, config: VisionConfig) -> Result<VisionTower, LoadError> {
        let hidden = config.hidden_size;
        let eps = config.layer_norm_eps;
        let p = config.patch_size;
        let name = |rest: &str| join(prefix, rest);
        let patch_weight = weights.f32(&name("embeddings.patch_embedding.weight"), &[hidden, 3, p, p])?;
        let (patch_bias, class_embedding, num_positions, pre_norm) = match config.family {
            VisionFamily::Clip => (
                None,
                Some(weights.f32(&name("embeddings.class_embedding"), &[hidden])?),
                config.grid() * config.grid() + 1,
                Some(LayerNorm::load(weights, &name("pre_layrnorm"), hidden, eps)?),
            ),
            VisionFamily::Siglip => (
                Some(weights.f32(&name("embeddings.patch_embedding.bias"), &[hidden])?),
                None,
                config.grid() * config.grid(),
                None,
            ),
        };
        let positions = weights.f32(&name("embeddings.position_embedding.weight"), &[num_positions, hidden])?;
        let blocks = (0..config.num_layers)
            .map(|i| {
                let layer = name(&format!("encoder.layers.{i}"));
                let layer = layer.as_str();
                Ok(PreNormBlock {
                    norm1: LayerNorm::load(weights, &format!("{layer}.layer_norm1"), hidden, eps)?,
                    attention: SelfAttention {
                        q: Linear::load(weights, &format!("{layer}.self_attn.q_proj"), hidden, hidden, true)?,
                        k: Linear::load(weights, &format!("{layer}.self_attn.k_proj"), hidden, hidden, true)?,
                        v: Linear::load(weights, &format!("{layer}.self_attn.v_proj"), hidden, hidden, true)?,
                        out: Linear::load(weights, &format!("{layer}.self_attn.out_proj"), hidden, hidden, true)?,
                        heads: config.num_heads,
                    },
                    norm2: LayerNorm::load(weights, &format!("{layer}.layer_norm2"), hidden, eps)?,
                    mlp: Mlp {
                        fc1: Linear::load(
                            weights,
                            &format!("{layer}.mlp.fc1"),
                            config.intermediate_size,
                            hidden,
                            true,
                        )?,
                        fc2: Linear::load(
                            weights,
                            &format!("{layer}.mlp.fc2"),
                            hidden,
                            config.intermediate_size,
                            true,
                        )?,
                        act: config.activation,
                    },
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let post_norm = LayerNorm::load(weights, &name("post_layernorm"), hidden, eps)?;
        Ok(VisionTower {
            config,
            patch_weight,
            patch_bias,
            class_embedding,
            positions,
            pre_norm,
            blocks,
            post_norm,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Rows per image of `height × width` pixels (patches, plus CLIP's class token).
    pub fn sequence_len(&self, height: usize, width: usize) -> usize {
        let p = self.config.patch_size;
        (height / p) * (width / p) + usize::from(self.class_embedding.is_some())
    }

    /// The chosen hidden state for a batch of images of one size: `[batch, len, hidden]`
    /// flattened, `len` as [`VisionTower::sequence_len`].
    ///
    /// # Errors
    ///
    /// [`EncodeError`] for an empty batch, images of different sizes, or an image smaller than
    /// a patch, and for a layer index out of range.
    pub fn forward(&self, images: &[&PixelValues], layer: FeatureLayer) -> Result<Vec<f32>, EncodeError> {
        let first = images.first().ok_or(EncodeError::Empty)?;
        let (height, width) = (first.height, first.width);
        let p = self.config.patch_size;
        for (index, image) in images.iter().enumerate() {
            if (image.height, image.width) != (height, width) {
                return Err(EncodeError::Shape {
                    index,
                    reason: format!("{}x{} in a batch of {height}x{width} images", image.height, image.width),
                });
            }
            if image.data.len() != 3 * image.height * image.width || image.height < p || image.width < p {
                return Err(EncodeError::Shape {
                    index,
                    reason: format!("not a 3-channel image of at least one {p}x{p} patch"),
                });
            }
        }
        let stop = self.blocks_for(layer)?;
        let batch = images.len();
        let len = self.sequence_len(height, width);
        let hidden = self.config.hidden_size;
        let mut x = vec![0.0f32; batch * len * hidden];
        let positions = self.positions_for(height / p, width / p);
        for (item, image) in images.iter().enumerate() {
            let rows = &mut x[item * len * hidden..(item + 1) * len * hidden];
            self.embed(image, rows);
            crate::ops::add(rows, &positions);
        }
        if let Some(norm) = &self.pre_norm {
            x = norm.forward(&x);
        }
        for block in &self.blocks[..stop] {
            block.forward(&mut x, batch, len);
        }
        if layer == FeatureLayer::Last {
            x = self.post_norm.forward(&x);
        }
        Ok(x)
    }

    /// How many blocks run to reach `layer`.
    pub(crate) fn blocks_for(&self, layer: FeatureLayer) -> Result<usize, EncodeError> {
        let depth = self.blocks.len() as isize;
        match layer {
            FeatureLayer::Last => Ok(self.blocks.len()),
            FeatureLayer::Hidden(i) => {
                let resolved = if i < 0 { depth + 1 + i } else { i };
                if !(0..=depth).contains(&resolved) {
                    return Err(EncodeError::Shape {
                        index: 0,
                        reason: format!("hidden state {i} of a tower with {depth} layers"),
                    });
                }
                Ok(resolved as usize)
            }
        }
    }

    /// Patch embeddings (and the class token) of one image into `rows` (`[len, hidden]`).
    fn embed(&self, image: &PixelValues, rows: &mut [f32]) {
        let p = self.config.patch_size;
        let hidden = self.config.hidden_size;
        let (grid_h, grid_w) = (image.height / p, image.width / p);
        let plane = image.height * image.width;
        // im2col: one row per patch, in the kernel's [channel, y, x] order.
        let patch_len = 3 * p * p;
        let mut columns = vec![0.0f32; grid_h * grid_w * patch_len];
        for gy in 0..grid_h {
            for gx in 0..grid_w {
                let row = &mut columns[(gy * grid_w + gx) * patch_len..][..patch_len];
                for c in 0..3 {
                    for ky in 0..p {
                        let start = c * plane + (gy * p + ky) * image.width + gx * p;
                        row[(c * p + ky) * p..][..p].copy_from_slice(&image.data[start..start + p]);
                    }
                }
            }
        }
        let offset = usize::from(self.class_embedding.is_some());
        if let Some(class) = &self.class_embedding {
            rows[..hidden].copy_from_slice(class);
        }
        let patches = grid_h * grid_w;
        gemm(
            patches,
            patch_len,
            hidden,
            Strided::new(&columns, patch_len, 1),
            Strided::new(&self.patch_weight, 1, patch_len),
            &mut rows[offset * hidden..],
            hidden,
        );
        if let Some(bias) = &self.patch_bias {
            for row in rows[offset * hidden..].chunks_exact_mut(hidden) {
                crate::ops::add(row, bias);
            }
        }
    }

    /// Position embeddings for a `grid_h × grid_w` patch grid: the trained ones, or
    /// interpolated bicubically (PyTorch's `interpolate(mode="bicubic", align_corners=False)`).
    pub(crate) fn positions_for(&self, grid_h: usize, grid_w: usize) -> Vec<f32> {
        self.position_table().for_grid(grid_h, grid_w)
    }

    /// The trained position embeddings, to interpolate for other grids.
    pub(crate) fn position_table(&self) -> PositionTable {
        PositionTable {
            trained: self.positions.clone(),
            grid: self.config.grid(),
            hidden: self.config.hidden_size,
            class_rows: usize::from(self.class_embedding.is_some()),
        }
    }
}

/// A tower's trained position embeddings (`[class_rows + grid², hidden]`).
#[derive(Debug, Clone)]
pub(crate) struct PositionTable {
    trained: Vec<f32>,
    grid: usize,
    hidden: usize,
    class_rows: usize,
}

impl PositionTable {
    /// The embeddings of a `grid_h × grid_w` grid: the trained ones, or interpolated
    /// bicubically (PyTorch's `interpolate(mode="bicubic", align_corners=False)`); the class
    /// token's row is kept as trained.
    pub(crate) fn for_grid(&self, grid_h: usize, grid_w: usize) -> Vec<f32> {
        let (hidden, trained, offset) = (self.hidden, self.grid, self.class_rows);
        if grid_h == trained && grid_w == trained {
            return self.trained.clone();
        }
        let patch_positions = &self.trained[offset * hidden..];
        let mut out = Vec::with_capacity((offset + grid_h * grid_w) * hidden);
        out.extend_from_slice(&self.trained[..offset * hidden]);
        let rows_weights = bicubic_weights(trained, grid_h);
        let cols_weights = bicubic_weights(trained, grid_w);
        let mut value = vec![0.0f32; hidden];
        for ys in &rows_weights {
            for xs in &cols_weights {
                value.iter_mut().for_each(|v| *v = 0.0);
                for &(sy, wy) in ys {
                    for &(sx, wx) in xs {
                        let w = wy * wx;
                        let source = &patch_positions[(sy * trained + sx) * hidden..][..hidden];
                        for (v, s) in value.iter_mut().zip(source) {
                            *v += w * s;
                        }
                    }
                }
                out.extend_from_slice(&value);
            }
        }
        out
    }
}

/// `prefix.rest`, or `rest` for an empty prefix.
fn join(prefix: &str, rest: &str) -> String {
    if prefix.is_empty() {
        rest.to_string()
    } else {
        format!("{prefix}.{rest}")
    }
}

/// The first of `candidates` under which the checkpoint holds a tower (checkpoints name it
/// `vision_model.…`, `vision_tower.vision_model.…`, or, saved by transformers 5, without the
/// inner `vision_model`).
fn find_prefix<'a>(weights: &dyn TensorSource, candidates: &[&'a str]) -> Result<&'a str, LoadError> {
    candidates
        .iter()
        .copied()
        .find(|prefix| weights.contains(&join(prefix, "embeddings.patch_embedding.weight")))
        .ok_or_else(|| LoadError::Weights {
            path: weights.origin().to_path_buf(),
            tensor: join(candidates[0], "embeddings.patch_embedding.weight"),
            reason: format!("missing (also looked under {})", candidates[1..].join(", ")),
        })
}

/// For each output index, the four (source index, weight) pairs of PyTorch's bicubic
/// interpolation (A = −0.75, half-pixel centres, indices clamped at the borders).
fn bicubic_weights(input: usize, output: usize) -> Vec<[(usize, f32); 4]> {
    const A: f32 = -0.75;
    let cubic1 = |x: f32| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
    let cubic2 = |x: f32| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
    let scale = input as f32 / output as f32;
    (0..output)
        .map(|o| {
            let source = (o as f32 + 0.5) * scale - 0.5;
            let floor = source.floor();
            let t = source - floor;
            let weights = [cubic2(t + 1.0), cubic1(t), cubic1(1.0 - t), cubic2(2.0 - t)];
            let mut out = [(0usize, 0.0f32); 4];
            for (k, slot) in out.iter_mut().enumerate() {
                let index = (floor as isize - 1 + k as isize).clamp(0, input as isize - 1) as usize;
                *slot = (index, weights[k]);
            }
            out
        })
        .collect()
}

/// The LLaVA multimodal projector: `linear_2(act(linear_1(x)))`.
#[derive(Debug)]
pub struct Projector {
    pub(crate) mlp: Mlp,
}

impl Projector {
    /// Loads `linear_1` and `linear_2` under `prefix`.
    ///
    /// # Errors
    ///
    /// [`LoadError::Weights`] naming a missing or misshapen tensor.
    pub fn load(
        weights: &dyn TensorSource,
        prefix: &str,
        input: usize,
        output: usize,
        bias: bool,
        act: Activation,
    ) -> Result<Projector, LoadError> {
        Ok(Projector {
            mlp: Mlp {
                fc1: Linear::load(weights, &format!("{prefix}.linear_1"), output, input, bias)?,
                fc2: Linear::load(weights, &format!("{prefix}.linear_2"), output, output, bias)?,
                act,
            },
        })
    }

    /// Projects `rows` rows.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.mlp.forward(x, rows)
    }

    /// Width of the projected rows.
    pub fn output(&self) -> usize {
        self.mlp.fc2.output()
    }
}

/// Which rows of the chosen hidden state become features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectStrategy {
    /// `default`: every patch, the class token dropped.
    Default,
    /// `full`: every row.
    Full,
}

/// Features for a batch of media items: `tokens[i]` rows of `dim` values for item `i`,
/// concatenated.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// Row width (the LLM's hidden size once projected).
    pub dim: usize,
    /// Rows per item, in batch order.
    pub tokens: Vec<usize>,
    /// All rows, item after item.
    pub data: Vec<f32>,
}

impl Features {
    /// Features from each item's rows (`None`: an item left out), in item order.
    pub(crate) fn from_items(dim: usize, items: Vec<Option<Vec<f32>>>) -> Features {
        let mut tokens = Vec::with_capacity(items.len());
        let mut data = Vec::new();
        for rows in items.into_iter().flatten() {
            tokens.push(rows.len() / dim);
            data.extend_from_slice(&rows);
        }
        Features { dim, tokens, data }
    }

    /// Features from the rows of every item, in item order (`tokens[i]` rows each).
    #[cfg(feature = "cuda")]
    pub(crate) fn from_rows(dim: usize, tokens: Vec<usize>, data: Vec<f32>) -> Features {
        debug_assert_eq!(tokens.iter().sum::<usize>() * dim, data.len());
        Features { dim, tokens, data }
    }

    /// Item `i`'s rows.
    pub fn item(&self, i: usize) -> &[f32] {
        let start: usize = self.tokens[..i].iter().sum::<usize>() * self.dim;
        &self.data[start..start + self.tokens[i] * self.dim]
    }
}

/// A vision encoder: the tower, the feature selection and the projector (if the model is a
/// vision-language model), loaded from a model directory.
#[derive(Debug)]
pub struct VisionEncoder {
    pub(crate) tower: VisionTower,
    pub(crate) projector: Option<Projector>,
    pub(crate) layer: FeatureLayer,
    pub(crate) strategy: SelectStrategy,
}

impl VisionEncoder {
    /// Loads `dir`: `config.json` and `*.safetensors`. The config is a LLaVA model (`llava`:
    /// tower, projector, `vision_feature_layer`, `vision_feature_select_strategy`), a CLIP or
    /// SigLIP model (`clip`, `siglip`: its `vision_config`), or a bare vision model
    /// (`clip_vision_model`, `siglip_vision_model`; features are `last_hidden_state`).
    ///
    /// # Errors
    ///
    /// [`LoadError`] naming the file and the key or tensor.
    pub fn load(dir: &Path) -> Result<VisionEncoder, LoadError> {
        let config_path = dir.join("config.json");
        let value = crate::read_json(&config_path)?;
        let config = ConfigObject::new(&config_path, &value);
        let weights = Safetensors::open(dir)?;
        VisionEncoder::from_parts(&config, &weights)
    }

    pub(crate) fn from_parts(
        config: &ConfigObject<'_>,
        weights: &dyn TensorSource,
    ) -> Result<VisionEncoder, LoadError> {
        let model_type = config.str_or("model_type", "")?;
        let family_of = |kind: &str| match kind {
            "clip_vision_model" | "clip" => Some(VisionFamily::Clip),
            "siglip_vision_model" | "siglip" => Some(VisionFamily::Siglip),
            _ => None,
        };
        match model_type {
            "llava" => {
                let vision = config
                    .object("vision_config")
                    .ok_or_else(|| config.error("vision_config", "missing"))?;
                let vision_type = vision.str_or("model_type", "clip_vision_model")?;
                let family = family_of(vision_type).ok_or_else(|| {
                    vision.error(
                        "model_type",
                        format!("`{vision_type}` is not supported (CLIP and SigLIP are)"),
                    )
                })?;
                let vision_config = VisionConfig::from_json(&vision, family)?;
                let text = config
                    .object("text_config")
                    .ok_or_else(|| config.error("text_config", "missing"))?;
                let text_hidden = text.usize_or("hidden_size", Some(4096))?;
                let layer = match config.get("vision_feature_layer") {
                    None => -2,
                    Some(value) => value.as_i64().ok_or_else(|| {
                        config.error(
                            "vision_feature_layer",
                            format!("expected one layer index ({value}: several layers are not supported)"),
                        )
                    })? as isize,
                };
                let strategy = match config.str_or("vision_feature_select_strategy", "default")? {
                    "default" => SelectStrategy::Default,
                    "full" => SelectStrategy::Full,
                    other => {
                        return Err(config.error(
                            "vision_feature_select_strategy",
                            format!("`{other}` (expected `default` or `full`)"),
                        ));
                    }
                };
                let act_name = config.str_or("projector_hidden_act", "gelu")?;
                let act = Activation::parse(act_name)
                    .ok_or_else(|| config.error("projector_hidden_act", format!("`{act_name}` is not supported")))?;
                let bias = config.bool_or("multimodal_projector_bias", true)?;
                let hidden = vision_config.hidden_size;
                let tower_prefix = find_prefix(
                    weights,
                    &[
                        "vision_tower.vision_model",
                        "vision_tower",
                        "model.vision_tower.vision_model",
                        "model.vision_tower",
                    ],
                )?;
                let root = if tower_prefix.starts_with("model.") {
                    "model."
                } else {
                    ""
                };
                let tower = VisionTower::load(weights, tower_prefix, vision_config)?;
                let projector = Projector::load(
                    weights,
                    &format!("{root}multi_modal_projector"),
                    hidden,
                    text_hidden,
                    bias,
                    act,
                )?;
                Ok(VisionEncoder {
                    tower,
                    projector: Some(projector),
                    layer: FeatureLayer::Hidden(layer),
                    strategy,
                })
            }
            "clip" | "siglip" | "clip_vision_model" | "siglip_vision_model" => {
                let family = family_of(model_type).unwrap_or(VisionFamily::Clip);
                let vision = if model_type.ends_with("_vision_model") {
                    config.clone()
                } else {
                    config
                        .object("vision_config")
                        .ok_or_else(|| config.error("vision_config", "missing"))?
                };
                let vision_config = VisionConfig::from_json(&vision, family)?;
                let tower_prefix = find_prefix(weights, &["vision_model", ""])?;
                let tower = VisionTower::load(weights, tower_prefix, vision_config)?;
                Ok(VisionEncoder {
                    tower,
                    projector: None,
                    layer: FeatureLayer::Last,
                    strategy: SelectStrategy::Full,
                })
            }
            other => Err(config.error(
                "model_type",
                format!("`{other}` is not a vision model this encoder runs (llava, clip, siglip)"),
            )),
        }
    }

    /// The tower.
    pub fn tower(&self) -> &VisionTower {
        &self.tower
    }

    /// Width of the feature rows.
    pub fn feature_dim(&self) -> usize {
        self.projector
            .as_ref()
            .map_or(self.tower.config.hidden_size, Projector::output)
    }

    /// Feature rows per image of `height × width` pixels.
    pub fn tokens_per_image(&self, height: usize, width: usize) -> usize {
        let len = self.tower.sequence_len(height, width);
        match (self.strategy, self.tower.class_embedding.is_some()) {
            (SelectStrategy::Default, true) => len - 1,
            _ => len,
        }
    }

    /// Encodes a micro-batch of images: images of one size share one forward.
    ///
    /// # Errors
    ///
    /// [`EncodeError`] for an empty batch or an image the tower cannot take.
    pub fn encode(&self, images: &[&PixelValues]) -> Result<Features, EncodeError> {
        if images.is_empty() {
            return Err(EncodeError::Empty);
        }
        let dim = self.feature_dim();
        let mut per_item: Vec<Option<Vec<f32>>> = vec![None; images.len()];
        let mut sizes: Vec<(usize, usize)> = images.iter().map(|i| (i.height, i.width)).collect();
        sizes.sort_unstable();
        sizes.dedup();
        for size in sizes {
            let members: Vec<usize> = (0..images.len())
                .filter(|&i| (images[i].height, images[i].width) == size)
                .collect();
            let group: Vec<&PixelValues> = members.iter().map(|&i| images[i]).collect();
            let hidden = self.tower.forward(&group, self.layer).map_err(|err| match err {
                EncodeError::Shape { index, reason } => EncodeError::Shape {
                    index: members[index],
                    reason,
                },
                other => other,
            })?;
            let len = self.tower.sequence_len(size.0, size.1);
            let keep = self.tokens_per_image(size.0, size.1);
            let width = self.tower.config.hidden_size;
            let mut selected = Vec::with_capacity(group.len() * keep * width);
            for item in 0..group.len() {
                let rows = &hidden[item * len * width..(item + 1) * len * width];
                selected.extend_from_slice(&rows[(len - keep) * width..]);
            }
            let projected = match &self.projector {
                Some(projector) => projector.forward(&selected, group.len() * keep),
                None => selected,
            };
            for (k, &index) in members.iter().enumerate() {
                per_item[index] = Some(projected[k * keep * dim..(k + 1) * keep * dim].to_vec());
            }
        }
        Ok(Features::from_items(dim, per_item))
    }

    /// Encodes a video's frames (one size) and pools them in time ([`pool_in_time`]), so
    /// `frames` frames give `ceil(frames / pooling)` frames' worth of rows.
    ///
    /// # Errors
    ///
    /// As [`VisionEncoder::encode`].
    pub fn encode_video(&self, frames: &[&PixelValues], pooling: usize) -> Result<Vec<f32>, EncodeError> {
        let features = self.encode(frames)?;
        let rows: Vec<&[f32]> = (0..frames.len()).map(|i| features.item(i)).collect();
        Ok(pool_in_time(&rows, pooling))
    }
}

/// Pools a video's per-frame features in time: each group of `pooling` consecutive frames
/// becomes the mean of their rows (the last group may be shorter). Every frame must have the
/// same number of rows (frames of one video are one size).
pub fn pool_in_time(frames: &[&[f32]], pooling: usize) -> Vec<f32> {
    let pooling = pooling.max(1);
    let per_frame = frames.first().map_or(0, |f| f.len());
    let mut out = Vec::with_capacity(frames.len().div_ceil(pooling) * per_frame);
    for group in frames.chunks(pooling) {
        let mut sum = vec![0.0f32; per_frame];
        for frame in group {
            crate::ops::add(&mut sum, frame);
        }
        let n = group.len() as f32;
        out.extend(sum.into_iter().map(|v| v / n));
    }
    out
}
