//! The paged KV cache: every layer's keys and values in fixed-size blocks of positions, kept
//! in f32 as computed or in f16 ([`KvPrecision`]), the reads attention makes of them, and the
//! copies of whole blocks out and in that move a prefill between workers ([`transfer`]'s
//! payloads: [`PagedKv::export_block`], [`PagedKv::import_block`]).
//!
//! A sequence's positions map to blocks through its block table ([`SequenceKv`]), so blocks
//! can be shared (a cached prefix) and handed out in any order. In f16 the cache takes half the
//! memory, so a worker holds twice the tokens in the same `--kv-cache-mib`. Decode attention
//! over a batch's contexts is bound by the bytes it reads, so where the CPU has AVX2, FMA and
//! F16C, whose kernel (module `avx2`) widens f16 in its loads, f16 decodes as fast as f32 at
//! short contexts and faster at long ones (SmolLM2 at 1,024 tokens: ~1.1×); the portable loops
//! widen a block at a time into a buffer and are 3–12 % slower than in f32. The values round
//! to f16's 11 significant bits on the way in, which moves the logits by up to ~3e-4 of their
//! size on the tiny test model, so f32 stays the default. The CUDA backend keeps the same two
//! precisions, rounded alike.
//!
//! # Rejected designs
//!
//! - Four dot products at a time in decode attention, to overlap their additions: LLVM
//!   vectorized the four sums across lanes with shuffles and blends, and batch-32 decode fell
//!   from ~550 to ~470 tok/s.
//! - The blocks handed to the attention loops through a closure: 5 % slower, the closure being
//!   compiled without the enclosing function's AVX2.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use wide::f32x8;

use crate::config::ModelConfig;

#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod transfer;

use transfer::{KvBlockShape, KvPayloadError};

/// How the paged cache stores keys and values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvPrecision {
    /// As computed: the reference logits.
    #[default]
    F32,
    /// Half the memory; values rounded to f16.
    F16,
}

impl KvPrecision {
    /// Bytes one stored value takes.
    pub fn bytes(self) -> usize {
        match self {
            KvPrecision::F32 => 4,
            KvPrecision::F16 => 2,
        }
    }
}

impl std::fmt::Display for KvPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvPrecision::F32 => "f32",
            KvPrecision::F16 => "f16",
        })
    }
}

impl std::str::FromStr for KvPrecision {
    type Err = String;

    fn from_str(text: &str) -> Result<KvPrecision, String> {
        match text {
            "f32" => Ok(KvPrecision::F32),
            "f16" => Ok(KvPrecision::F16),
            other => Err(format!("`{other}` is not a KV cache precision; use `f32` or `f16`")),
        }
    }
}

/// One layer's keys or values, `[num_blocks · block_size, kv_width]`, at the cache's precision.
#[derive(Debug)]
enum Rows {
    F32(Vec<f32>),
    /// f16 bit patterns: allocated zeroed (pages mapped as they are first written, as the f32
    /// cache's are), read as `f16` through `half`'s casts.
    F16(Vec<u16>),
}

impl Rows {
    fn zeroed(len: usize, precision: KvPrecision) -> Rows {
        match precision {
            KvPrecision::F32 => Rows::F32(vec![0.0; len]),
            KvPrecision::F16 => Rows::F16(vec![0; len]),
        }
    }

    /// Stores `row` at value offset `at`.
    fn write(&mut self, at: usize, row: &[f32]) {
        match self {
            Rows::F32(values) => values[at..at + row.len()].copy_from_slice(row),
            Rows::F16(bits) => bits[at..at + row.len()]
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(row),
        }
    }

    /// The `len` values at offset `at` as f32: in place for an f32 cache, widened into
    /// `scratch` (at least `len` long) for an f16 one.
    #[inline(always)]
    fn read<'a>(&'a self, at: usize, len: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        match self {
            Rows::F32(values) => &values[at..at + len],
            Rows::F16(bits) => {
                let widened = &mut scratch[..len];
                bits[at..at + len]
                    .reinterpret_cast::<f16>()
                    .convert_to_f32_slice(widened);
                widened
            }
        }
    }

    /// Appends the `len` values at offset `at` to `out` as stored, little-endian.
    fn append_le(&self, at: usize, len: usize, out: &mut Vec<u8>) {
        match self {
            Rows::F32(values) => out.extend(values[at..at + len].iter().flat_map(|v| v.to_le_bytes())),
            Rows::F16(bits) => out.extend(bits[at..at + len].iter().flat_map(|v| v.to_le_bytes())),
        }
    }

    /// Overwrites the values from offset `at` with `bytes`, values as stored, little-endian
    /// (as many as `bytes` holds).
    fn store_le(&mut self, at: usize, bytes: &[u8]) {
        match self {
            Rows::F32(values) => {
                for (value, bytes) in values[at..].iter_mut().zip(bytes.as_chunks::<4>().0) {
                    *value = f32::from_le_bytes(*bytes);
                }
            }
            Rows::F16(bits) => {
                for (value, bytes) in bits[at..].iter_mut().zip(bytes.as_chunks::<2>().0) {
                    *value = u16::from_le_bytes(*bytes);
                }
            }
        }
    }

    /// Appends the `len` values at offset `at`, as f32, to `out`.
    fn extend_into(&self, at: usize, len: usize, out: &mut Vec<f32>) {
        match self {
            Rows::F32(values) => out.extend_from_slice(&values[at..at + len]),
            Rows::F16(bits) => {
                let start = out.len();
                out.resize(start + len, 0.0);
                bits[at..at + len]
                    .reinterpret_cast::<f16>()
                    .convert_to_f32_slice(&mut out[start..]);
            }
        }
    }
}

/// A sequence's place in the paged cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SequenceKv {
    /// Physical block of each run of `block_size` positions, in order. Blocks shared with other
    /// sequences (a cached prefix) are simply listed by several tables.
    pub blocks: Vec<u32>,
    /// Positions whose keys and values are in the cache.
    pub computed: usize,
}

/// Keys and values of every layer, in fixed-size blocks of positions.
#[derive(Debug)]
pub struct PagedKv {
    pub(crate) block_size: usize,
    pub(crate) num_blocks: usize,
    kv_width: usize,
    precision: KvPrecision,
    /// What one block is made of (for moving blocks between workers).
    shape: KvBlockShape,
    /// Per layer, `[num_blocks · block_size, kv_width]`.
    keys: Vec<Rows>,
    values: Vec<Rows>,
}

impl PagedKv {
    /// `num_blocks` blocks of `block_size` positions for every layer of `config`'s model, in
    /// f32.
    pub fn new(config: &ModelConfig, block_size: usize, num_blocks: usize) -> PagedKv {
        PagedKv::with_precision(config, block_size, num_blocks, KvPrecision::F32)
    }

    /// [`PagedKv::new`] at the given precision.
    pub fn with_precision(
        config: &ModelConfig,
        block_size: usize,
        num_blocks: usize,
        precision: KvPrecision,
    ) -> PagedKv {
        let block_size = block_size.max(1);
        let kv_width = config.num_kv_heads * config.head_dim;
        let per_layer = num_blocks * block_size * kv_width;
        PagedKv {
            block_size,
            num_blocks,
            kv_width,
            precision,
            shape: KvBlockShape::of(config, block_size, precision),
            keys: (0..config.num_layers)
                .map(|_| Rows::zeroed(per_layer, precision))
                .collect(),
            values: (0..config.num_layers)
                .map(|_| Rows::zeroed(per_layer, precision))
                .collect(),
        }
    }

    /// How keys and values are stored.
    pub fn precision(&self) -> KvPrecision {
        self.precision
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// What one block is made of: the shape and dtype of the payloads it exports and imports.
    pub fn block_shape(&self) -> KvBlockShape {
        self.shape
    }

    /// Block `block`'s keys and values of every layer, as a payload ([`transfer`]'s format),
    /// in the precision the cache holds them.
    ///
    /// # Errors
    ///
    /// [`KvPayloadError::Block`] for a block outside the cache.
    pub fn export_block(&self, block: u32) -> Result<Vec<u8>, KvPayloadError> {
        let at = self.block_offset(block)?;
        let len = self.shape.layer_values();
        let mut payload = self.shape.start_payload();
        for (keys, values) in self.keys.iter().zip(&self.values) {
            keys.append_le(at, len, &mut payload);
            values.append_le(at, len, &mut payload);
        }
        Ok(payload)
    }

    /// Writes `payload` (as [`PagedKv::export_block`] makes them) into block `block`, every
    /// layer's keys and values, after checking that it is a payload of this cache's shape and
    /// dtype. Nothing is written when it is not.
    ///
    /// # Errors
    ///
    /// [`KvPayloadError`] for a payload of another shape, dtype, format or length, or a block
    /// outside the cache.
    pub fn import_block(&mut self, block: u32, payload: &[u8]) -> Result<(), KvPayloadError> {
        let at = self.block_offset(block)?;
        let data = self.shape.data(payload)?;
        let layer_bytes = self.shape.layer_bytes();
        let mut parts = data.chunks_exact(layer_bytes);
        for (keys, values) in self.keys.iter_mut().zip(self.values.iter_mut()) {
            // `data` checked its length: two parts per layer are there.
            if let (Some(key_bytes), Some(value_bytes)) = (parts.next(), parts.next()) {
                keys.store_le(at, key_bytes);
                values.store_le(at, value_bytes);
            }
        }
        Ok(())
    }

    /// The offset of block `block`'s first value in a layer's buffer.
    fn block_offset(&self, block: u32) -> Result<usize, KvPayloadError> {
        if block as usize >= self.num_blocks {
            return Err(KvPayloadError::Block {
                block,
                blocks: self.num_blocks,
            });
        }
        Ok(block as usize * self.block_size * self.kv_width)
    }

    /// Index of position `position`'s row in a layer's buffer, through the block table.
    fn slot(&self, blocks: &[u32], position: usize) -> usize {
        let block = blocks[position / self.block_size] as usize;
        (block * self.block_size + position % self.block_size) * self.kv_width
    }

    /// Stores layer `layer`'s key and value rows (`kv_width` values each) of position
    /// `position`, through the block table `blocks`.
    pub(crate) fn write(&mut self, layer: usize, blocks: &[u32], position: usize, key: &[f32], value: &[f32]) {
        let slot = self.slot(blocks, position);
        self.keys[layer].write(slot, key);
        self.values[layer].write(slot, value);
    }

    /// One query row attending to its sequence's keys and values, read in place from their
    /// blocks; the weighted sums go to `out`.
    pub(crate) fn attend_one(&self, query: &DecodeQuery<'_>, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has what the kernel needs (checked first).
        if avx2::available() && unsafe { avx2::attend_one(self, query, out) } {
            return;
        }
        self.attend_portable(query, out);
    }

    /// [`PagedKv::attend_one`]'s portable loops.
    fn attend_portable(&self, query: &DecodeQuery<'_>, out: &mut [f32]) {
        let DecodeQuery {
            layer,
            blocks,
            context,
            heads,
            group,
            dim,
            scale,
            values: query,
        } = *query;
        let (keys, values) = (&self.keys[layer], &self.values[layer]);
        // [head][position]
        let mut scores = vec![0.0f32; heads * context];
        // A block's rows of an f16 cache, widened: one conversion call per block, not per row.
        let span = self.block_size * self.kv_width;
        let mut widened = vec![0.0f32; if self.precision == KvPrecision::F16 { span } else { 0 }];
        let width = self.kv_width;
        // Each block's first position, offset and values.
        let spans = self.spans(blocks, context);
        for &(first, at, len) in &spans {
            let block_keys = keys.read(at, len, &mut widened);
            for (offset, key) in block_keys.chunks_exact(width).enumerate() {
                for head in 0..heads {
                    let kv_head = head / group;
                    scores[head * context + first + offset] = dot(
                        &query[head * dim..(head + 1) * dim],
                        &key[kv_head * dim..(kv_head + 1) * dim],
                    ) * scale;
                }
            }
        }
        for row in scores.chunks_exact_mut(context.max(1)) {
            softmax(row);
        }
        out[..heads * dim].fill(0.0);
        for &(first, at, len) in &spans {
            let block_values = values.read(at, len, &mut widened);
            for (offset, value) in block_values.chunks_exact(width).enumerate() {
                for head in 0..heads {
                    let kv_head = head / group;
                    let weight = scores[head * context + first + offset];
                    for (out, v) in out[head * dim..(head + 1) * dim]
                        .iter_mut()
                        .zip(&value[kv_head * dim..(kv_head + 1) * dim])
                    {
                        *out += weight * v;
                    }
                }
            }
        }
    }

    /// Positions `0..context` through the block table, block by block: each block's first
    /// position, the offset of its rows in a layer's buffer, and how many values they hold.
    fn spans(&self, blocks: &[u32], context: usize) -> Vec<(usize, usize, usize)> {
        let mut spans = Vec::with_capacity(context.div_ceil(self.block_size));
        let mut first = 0;
        for &block in blocks {
            if first >= context {
                break;
            }
            let take = self.block_size.min(context - first);
            spans.push((
                first,
                block as usize * self.block_size * self.kv_width,
                take * self.kv_width,
            ));
            first += take;
        }
        spans
    }

    /// Layer `layer`'s keys and values of positions `0..context`, contiguous.
    pub(crate) fn gather(&self, layer: usize, blocks: &[u32], context: usize) -> (Vec<f32>, Vec<f32>) {
        let mut keys = Vec::with_capacity(context * self.kv_width);
        let mut values = Vec::with_capacity(context * self.kv_width);
        for (_, at, len) in self.spans(blocks, context) {
            self.keys[layer].extend_into(at, len, &mut keys);
            self.values[layer].extend_into(at, len, &mut values);
        }
        (keys, values)
    }
}

/// One decode step's query row for one sequence and layer: `heads` query heads of `dim` values,
/// `group` of them sharing each key/value head, attending to positions `0..context` kept in
/// `blocks`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeQuery<'a> {
    pub(crate) layer: usize,
    pub(crate) blocks: &'a [u32],
    pub(crate) context: usize,
    pub(crate) heads: usize,
    pub(crate) group: usize,
    pub(crate) dim: usize,
    /// 1/√dim.
    pub(crate) scale: f32,
    pub(crate) values: &'a [f32],
}

/// `row` replaced by its softmax (the maximum taken away first, so no term overflows).
#[inline(always)]
pub(crate) fn softmax(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, s| m.max(*s));
    let (eights, rest) = row.as_chunks_mut::<8>();
    let max8 = f32x8::splat(max);
    for values in eights {
        *values = (f32x8::from(*values) - max8).exp().to_array();
    }
    for s in rest {
        *s = (*s - max).exp();
    }
    let sum: f32 = row.iter().sum();
    for s in row.iter_mut() {
        *s /= sum;
    }
}

/// `a · b`, in eight running sums so that it vectorizes.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut sums = [0.0f32; 8];
    let (a_chunks, a_rest) = a.as_chunks::<8>();
    let (b_chunks, b_rest) = b.as_chunks::<8>();
    for (a, b) in a_chunks.iter().zip(b_chunks) {
        for ((sum, a), b) in sums.iter_mut().zip(a).zip(b) {
            *sum += a * b;
        }
    }
    let rest: f32 = a_rest.iter().zip(b_rest).map(|(a, b)| a * b).sum();
    sums.iter().sum::<f32>() + rest
}
