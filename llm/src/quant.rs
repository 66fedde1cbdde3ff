//! Weight matrices kept quantized as GGUF stores them (GGML's Q4_0, Q4_1 and Q8_0 blocks of 32
//! values), and their products with activations quantized per block to 16 bits.
//!
//! The blocks are kept at their size, but regrouped within each row: eight blocks' f16 scales
//! side by side (then their minimums, for Q4_1), then their values, so that a kernel widens
//! eight scales with one instruction and scales the activations' eight with another, instead of
//! a scalar conversion and multiplication per block (see [`QuantMatrix::new`]).
//!
//! A product reads each weight block once per batch: 18–34 bytes for 32 weights instead of
//! 128 as f32, which is what bounds decoding on a CPU. The activations of a row are quantized
//! once per product, per 32-value block, to 16-bit integers with an f32 scale (and their sum,
//! for Q4_1's minimum and Q4_0's offset), so each block's dot product is an integer
//! one: 16-bit multiply-adds (`vpmaddwd`, and `vpdpwssd` with AVX-512 VNNI) where the CPU has
//! AVX2 (detected at run time, [`Isa`]), a portable loop elsewhere, all giving the same integer
//! sums. llama.cpp quantizes the
//! activations to 8 bits; tried here, that moved SmolLM2's logits by up to ~1 (of ~25) against
//! the widened weights and flipped its greedy answer to a chat question (the f32 path answers
//! "Paris", 8-bit activations "L'Étoile…"). The flip comes from blocks holding one of the hidden
//! state's outlier channels, whose other values a `max / 127` scale leaves a few levels; 8 bits
//! only where a block has no outlier keeps the answer but gained ~1.1× at batch 32
//! (see Rejected designs below). 16 bits keep the error ~250× smaller and the dot
//! products integer. Output rows are split over rayon's threads, and within a thread a run of
//! weight rows meets a tile of activation rows so both stay in cache. From 16 activation rows
//! on (batched decoding, prefill), CPUs with AVX-512 VNNI run the `panel` kernels instead,
//! which hold 16 activation rows in a vector and so multiply at twice an f32 FMA's rate.
//!
//! # Rejected designs
//!
//! Measured on SmolLM2-135M (Q4_1) on two cores; the runs are in
//! `benchmarks/history/llm-cpu.md`.
//!
//! - 8 bits where no row of a block has an outlier (`max > 5 · rms`), 16 bits elsewhere:
//!   batch-32 decode 1.08–1.13× faster and the answer holds, but the fixture's logits moved by
//!   2.3 % (16 bits: within 1.4e-4), so `gguf_reference` fails. 8 bits in the down projection
//!   only: 1.04–1.13×.
//! - Each block widened to f32 in registers and multiplied with FMAs: 5.1 ns per Q4_1 block on
//!   one core, against 3.0 ns for the 16-bit integer products.
//! - The whole matrix widened per call instead of tiles: batch-8 decode 47 tok/s, the 113 MB f32
//!   LM head rebuilt every step.
//! - Each task's products written straight into the result, with no per-task buffer: 575–579
//!   against 579–587 tok/s at batch 32, no gain.

use std::sync::OnceLock;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod panel;

/// Values per quantized block (every GGML type here).
pub const BLOCK: usize = 32;

/// The quantized types a matrix can be kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// 32 × 4-bit values `(q − 8) · d`: an f16 scale and 16 bytes.
    Q4_0,
    /// 32 × 4-bit values `q · d + m`: f16 scale and minimum, 16 bytes.
    Q4_1,
    /// 32 × 8-bit values `q · d`: an f16 scale and 32 signed bytes.
    Q8_0,
}

impl QuantKind {
    /// f16 values heading a block: its scale, and for Q4_1 its minimum.
    fn halves(self) -> usize {
        match self {
            QuantKind::Q4_1 => 2,
            QuantKind::Q4_0 | QuantKind::Q8_0 => 1,
        }
    }

    /// Bytes of a block's integers.
    fn payload_bytes(self) -> usize {
        self.block_bytes() - 2 * self.halves()
    }

    /// Bytes per 32-value block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q4_0 => 18,
            QuantKind::Q4_1 => 20,
            QuantKind::Q8_0 => 34,
        }
    }
}

/// A `[rows, cols]` matrix of quantized blocks, row-major (each row `cols / 32` blocks).
#[derive(Clone)]
pub struct QuantMatrix {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("kind", &self.kind)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// Why blocks cannot form a matrix.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// The row length is not a whole, non-zero number of blocks.
    #[error("{cols} columns do not fill {BLOCK}-value blocks")]
    Columns {
        /// The row length.
        cols: usize,
    },
    /// The data is not `rows × cols / 32` blocks.
    #[error("{got} bytes where {rows} × {cols} values of {kind:?} take {wanted}")]
    Length {
        /// The type.
        kind: QuantKind,
        /// Rows wanted.
        rows: usize,
        /// Columns wanted.
        cols: usize,
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        wanted: usize,
    },
}

impl QuantMatrix {
    /// A matrix over `data`, GGML blocks of `kind` in row-major order.
    ///
    /// # Errors
    ///
    /// [`QuantError`] when `cols` is not a multiple of 32 or `data` has the wrong length.
    pub fn new(kind: QuantKind, rows: usize, cols: usize, data: Vec<u8>) -> Result<QuantMatrix, QuantError> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(QuantError::Columns { cols });
        }
        let wanted = rows * (cols / BLOCK) * kind.block_bytes();
        if data.len() != wanted {
            return Err(QuantError::Length {
                kind,
                rows,
                cols,
                got: data.len(),
                wanted,
            });
        }
        let mut matrix = QuantMatrix { kind, rows, cols, data };
        matrix.regroup();
        Ok(matrix)
    }

    /// Rewrites each row from GGML's block order into groups of [`GROUP`] blocks: their
    /// scales, their minimums (Q4_1), their integers (see [`place`]).
    fn regroup(&mut self) {
        let (kind, blocks, row_bytes) = (self.kind, self.cols / BLOCK, self.row_bytes());
        let header = 2 * kind.halves();
        let mut row = vec![0u8; row_bytes];
        for stored in self.data.chunks_exact_mut(row_bytes) {
            row.copy_from_slice(stored);
            for (b, block) in row.chunks_exact(kind.block_bytes()).enumerate() {
                let at = place(kind, blocks, b);
                stored[at.scale..at.scale + 2].copy_from_slice(&block[0..2]);
                if kind == QuantKind::Q4_1 {
                    stored[at.minimum..at.minimum + 2].copy_from_slice(&block[2..4]);
                }
                stored[at.values..at.values + kind.payload_bytes()].copy_from_slice(&block[header..]);
            }
        }
    }

    /// The block type.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// Rows (outputs of a linear map).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (inputs of a linear map).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn row_bytes(&self) -> usize {
        (self.cols / BLOCK) * self.kind.block_bytes()
    }

    fn row_data(&self, row: usize) -> &[u8] {
        let len = self.row_bytes();
        &self.data[row * len..(row + 1) * len]
    }

    /// Row `row` widened to f32 into `out` (`cols` values).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let (kind, blocks, data) = (self.kind, self.cols / BLOCK, self.row_data(row));
        for (b, out) in out.as_chunks_mut::<BLOCK>().0.iter_mut().enumerate().take(blocks) {
            let (q, d, coefficient) = portable::block(kind, data, blocks, b);
            for (out, q) in out.iter_mut().zip(q) {
                *out = q as f32 * d + coefficient;
            }
        }
    }

    /// The whole matrix widened to f32 (row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        self.dequantize_rows(0, self.rows)
    }

    /// Rows `start..start + count` widened to f32 (row-major).
    pub fn dequantize_rows(&self, start: usize, count: usize) -> Vec<f32> {
        let mut out = vec![0.0; count * self.cols];
        for (row, out) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(start + row, out);
        }
        out
    }

    /// `x · Wᵀ`: `x` is `[rows, cols]` (f32), the result `[rows, self.rows]`.
    ///
    /// # Panics
    ///
    /// If `x` does not hold `rows × cols` values.
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let [y] = QuantMatrix::matmul_all([self], x, rows);
        y
    }

    /// `x · Wᵀ` for each of several matrices of the same width, as one parallel product with
    /// the activations quantized once: a layer's q, k and v, or its gate and up. Fewer parallel
    /// regions matter at small batches, where each costs threads waking and waiting about as
    /// much as its arithmetic. The results are those of [`QuantMatrix::matmul`] on each.
    ///
    /// # Panics
    ///
    /// If the matrices differ in width, or `x` does not hold `rows × cols` values.
    pub fn matmul_all<const N: usize>(matrices: [&QuantMatrix; N], x: &[f32], rows: usize) -> [Vec<f32>; N] {
        QuantMatrix::matmul_all_with(isa(), matrices, x, rows)
    }

    /// [`QuantMatrix::matmul`] through the kernels of `isa`, or `None` where this CPU lacks it
    /// (see [`Isa::available`]): for comparing the kernels with each other.
    pub fn matmul_on(&self, isa: Isa, x: &[f32], rows: usize) -> Option<Vec<f32>> {
        isa.available().then(|| {
            let [y] = QuantMatrix::matmul_all_with(isa, [self], x, rows);
            y
        })
    }

    fn matmul_all_with<const N: usize>(isa: Isa, matrices: [&QuantMatrix; N], x: &[f32], rows: usize) -> [Vec<f32>; N] {
        let cols = matrices.first().map_or(0, |m| m.cols);
        assert!(matrices.iter().all(|m| m.cols == cols), "matrices of different widths");
        assert_eq!(x.len(), rows * cols, "activation shape");
        let outputs: usize = matrices.iter().map(|m| m.rows).sum();
        if rows == 0 || outputs == 0 {
            return matrices.map(|m| vec![0.0; rows * m.rows]);
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` names AVX-512 VNNI only where the CPU has it (`Isa::available`,
        // checked by the callers).
        let tiles =
            (isa == Isa::Avx512Vnni && rows >= PANEL_ROWS).then(|| unsafe { panel::Tiles::quantize(x, rows, cols) });
        #[cfg(not(target_arch = "x86_64"))]
        let tiles: Option<()> = None;
        // The block kernels' rows, where the panel kernels do not run.
        let block_rows = if tiles.is_some() { 0 } else { rows };
        let activations = Q16Rows::quantize(&x[..block_rows * cols], block_rows, cols);
        // Sliced once, not per weight row.
        let x_rows: Vec<Row<'_>> = (0..block_rows).map(|r| activations.row(r)).collect();
        // Each task: a run of one matrix's weight rows against every activation row, in tiles
        // of rows that stay in cache; its results come back as [row][output] and are copied
        // into place below.
        let work = outputs * rows * (cols / BLOCK);
        let per_task = if work < 1 << 13 {
            outputs
        } else {
            // Whole runs of the panel kernels' four weight rows.
            (outputs / (rayon::current_num_threads() * 8))
                .clamp(8, 256)
                .next_multiple_of(4)
        };
        let tasks: Vec<(usize, usize, usize)> = matrices
            .iter()
            .enumerate()
            .flat_map(|(m, matrix)| {
                (0..matrix.rows)
                    .step_by(per_task)
                    .map(move |start| (m, start, per_task.min(matrix.rows - start)))
            })
            .collect();
        let columns: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(m, start, count)| {
                let matrix = matrices[m];
                let kernels = kernels_for(matrix.kind, isa);
                let row_bytes = matrix.row_bytes();
                let weights = &matrix.data[start * row_bytes..(start + count) * row_bytes];
                let mut out = vec![0.0; count * rows];
                #[cfg(target_arch = "x86_64")]
                if let Some(tiles) = &tiles {
                    // SAFETY: tiles are laid out only for `Isa::Avx512Vnni`, which `isa` names
                    // only where the CPU has it (`Isa::available`, checked by the callers).
                    unsafe { panel::product(matrix.kind, weights, tiles, &mut out) };
                    return out;
                }
                for tile in (0..rows).step_by(ACTIVATION_TILE) {
                    let tile_end = (tile + ACTIVATION_TILE).min(rows);
                    for (o, weight) in weights.chunks_exact(row_bytes).enumerate() {
                        let mut r = tile;
                        while r + 1 < tile_end {
                            [out[r * count + o], out[(r + 1) * count + o]] =
                                (kernels.two)(weight, [x_rows[r], x_rows[r + 1]]);
                            r += 2;
                        }
                        if r < tile_end {
                            out[r * count + o] = (kernels.one)(weight, x_rows[r]);
                        }
                    }
                }
                out
            })
            .collect();
        // Each matrix's tasks are consecutive and in order of their first weight row, so its
        // result is row by row the tasks' rows one after another: built by appending, with no
        // zeroed buffer to overwrite (the LM head's is megabytes a step).
        let mut tasks = tasks.iter().zip(&columns).peekable();
        let mut index = 0;
        matrices.map(|matrix| {
            let this = index;
            index += 1;
            let mine: Vec<(usize, &Vec<f32>)> = std::iter::from_fn(|| tasks.next_if(|((m, ..), _)| *m == this))
                .map(|(&(_, _, count), column)| (count, column))
                .collect();
            let mut y = Vec::with_capacity(rows * matrix.rows);
            for r in 0..rows {
                for &(count, column) in &mine {
                    y.extend_from_slice(&column[r * count..(r + 1) * count]);
                }
            }
            y
        })
    }
}

/// From this many activation rows on, a product on AVX-512 VNNI runs through [`panel`]'s
/// kernels, which multiply 16 rows at once.
#[cfg(target_arch = "x86_64")]
const PANEL_ROWS: usize = 16;

/// Activation rows per tile: 16 rows of a 1,536-wide input are 96 KB, within L2 beside the
/// weight rows being read.
const ACTIVATION_TILE: usize = 16;

/// Blocks whose scales are kept side by side in a stored row (one 128-bit load of f16 values,
/// widened to one 256-bit vector of f32). A row's last group may be shorter.
const GROUP: usize = 8;

/// Where a block's parts lie within its stored row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place {
    /// The f16 scale.
    scale: usize,
    /// The f16 minimum (Q4_1 only).
    minimum: usize,
    /// The integers.
    values: usize,
}

/// Block `b` of a row of `blocks` blocks of `kind`: its group of [`GROUP`] blocks starts where
/// GGML's layout would start it, and holds the group's scales, then (Q4_1) its minimums, then
/// its blocks' integers, each in block order, so a row keeps its size.
fn place(kind: QuantKind, blocks: usize, b: usize) -> Place {
    let (group, index) = (b / GROUP, b % GROUP);
    let start = group * GROUP * kind.block_bytes();
    let size = GROUP.min(blocks - group * GROUP);
    Place {
        scale: start + 2 * index,
        minimum: start + 2 * size + 2 * index,
        values: start + 2 * kind.halves() * size + index * kind.payload_bytes(),
    }
}

/// Widens one block of `kind`, as GGML lays it out, into 32 values.
pub(crate) fn dequantize_block(kind: QuantKind, block: &[u8], out: &mut [f32]) {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    match kind {
        // The low nibbles are values 0..16, the high ones 16..32.
        QuantKind::Q4_0 => {
            let d = f16(&block[0..2]);
            for (i, q) in block[2..18].iter().enumerate() {
                out[i] = (f32::from(q & 0x0f) - 8.0) * d;
                out[i + 16] = (f32::from(q >> 4) - 8.0) * d;
            }
        }
        QuantKind::Q4_1 => {
            let (d, m) = (f16(&block[0..2]), f16(&block[2..4]));
            for (i, q) in block[4..20].iter().enumerate() {
                out[i] = f32::from(q & 0x0f) * d + m;
                out[i + 16] = f32::from(q >> 4) * d + m;
            }
        }
        QuantKind::Q8_0 => {
            let d = f16(&block[0..2]);
            for (out, &q) in out.iter_mut().zip(&block[2..34]) {
                *out = f32::from(q as i8) * d;
            }
        }
    }
}

/// One block of activations quantized to 16 bits into `out`: its scale (`x ≈ out · scale`)
/// and the scaled sum of its quantized values.
#[inline]
fn quantize_block(block: &[f32; BLOCK], out: &mut [i16; BLOCK]) -> (f32, f32) {
    // Compared, not `f32::max`, whose NaN rule keeps LLVM from vectorizing the loop.
    let max = block.iter().fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    let scale = max / f32::from(i16::MAX);
    let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (out, value) in out.iter_mut().zip(block) {
        // Round to nearest (ties to even) by adding and taking away 1.5 · 2²³, exact for the
        // magnitudes here (≤ 32,767), where `f32::round` is a library call per value.
        const ROUNDING: f32 = 12_582_912.0;
        *out = ((value * inverse + ROUNDING) - ROUNDING) as i16;
        sum += i32::from(*out);
    }
    // The sum of the quantized values, so that Q4_0's and Q4_1's offset terms carry the same
    // rounding as the products: the result is the widened weights times the quantized
    // activations.
    (scale, scale * sum as f32)
}

/// Activation rows quantized per 32-value block to 16 bits.
struct Q16Rows {
    blocks: usize,
    /// Scales and sums a row: `blocks` padded to a whole [`GROUP`].
    padded: usize,
    values: Vec<i16>,
    scales: Vec<f32>,
    sums: Vec<f32>,
}

/// One activation row's blocks: `x ≈ values · scale`, and each block's `scale · Σ values`
/// (scales and sums zero past the row's end, to a whole [`GROUP`]).
#[derive(Clone, Copy)]
struct Row<'a> {
    values: &'a [i16],
    scales: &'a [f32],
    sums: &'a [f32],
}

impl Q16Rows {
    fn quantize(x: &[f32], rows: usize, cols: usize) -> Q16Rows {
        let blocks = cols / BLOCK;
        let padded = blocks.next_multiple_of(GROUP);
        let mut values = vec![0i16; rows * cols];
        let mut scales = Vec::with_capacity(rows * padded);
        let mut sums = Vec::with_capacity(rows * padded);
        for (x, values) in x.chunks_exact(cols).zip(values.chunks_exact_mut(cols)) {
            for (block, out) in x.as_chunks::<BLOCK>().0.iter().zip(values.as_chunks_mut::<BLOCK>().0) {
                let (scale, sum) = quantize_block(block, out);
                scales.push(scale);
                sums.push(sum);
            }
            // Zeros to the row's last whole group, which the kernels read eight at a time.
            scales.resize(scales.len() + padded - blocks, 0.0);
            sums.resize(sums.len() + padded - blocks, 0.0);
        }
        Q16Rows {
            blocks,
            padded,
            values,
            scales,
            sums,
        }
    }

    fn row(&self, row: usize) -> Row<'_> {
        let values = row * self.blocks * BLOCK..(row + 1) * self.blocks * BLOCK;
        let blocks = row * self.padded..(row + 1) * self.padded;
        Row {
            values: &self.values[values],
            scales: &self.scales[blocks.clone()],
            sums: &self.sums[blocks],
        }
    }
}

/// The products of one weight row (its blocks) with one or two activation rows.
#[derive(Clone, Copy)]
struct Kernels {
    one: for<'a> fn(&[u8], Row<'a>) -> f32,
    two: for<'a> fn(&[u8], [Row<'a>; 2]) -> [f32; 2],
}

/// The instruction sets the kernels use, as this CPU has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 VNNI (with its VL and BW parts) on top of [`Isa::Avx2`]: the second half of a
    /// block's product accumulates in the same instruction (`vpdpwssd`).
    Avx512Vnni,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// Plain Rust (what LLVM makes of it for the target).
    Portable,
}

impl Isa {
    /// Every kernel set, best first.
    pub const ALL: [Isa; 3] = [Isa::Avx512Vnni, Isa::Avx2, Isa::Portable];

    /// Whether this CPU runs the kernels of `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// What the kernels run on here: the best kernel set this CPU has (detected once).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.available())
            .unwrap_or(Isa::Portable)
    })
}

/// Whether products of many activation rows run here on the panel kernels (this CPU has AVX-512
/// VNNI), which multiply 16 rows at once and outrun `gemm`'s f32 arithmetic.
pub fn panels_here() -> bool {
    cfg!(target_arch = "x86_64") && isa() == Isa::Avx512Vnni
}

/// The kernels for `kind` on `isa` (which must be available: see [`isa`]).
fn kernels_for(kind: QuantKind, isa: Isa) -> Kernels {
    #[cfg(target_arch = "x86_64")]
    {
        let pick = |one, two| Kernels { one, two };
        match (isa, kind) {
            (Isa::Avx512Vnni, QuantKind::Q4_0) => return pick(x86::q4_0_one_vnni, x86::q4_0_two_vnni),
            (Isa::Avx512Vnni, QuantKind::Q4_1) => return pick(x86::q4_1_one_vnni, x86::q4_1_two_vnni),
            (Isa::Avx512Vnni, QuantKind::Q8_0) => return pick(x86::q8_0_one_vnni, x86::q8_0_two_vnni),
            (Isa::Avx2, QuantKind::Q4_0) => return pick(x86::q4_0_one, x86::q4_0_two),
            (Isa::Avx2, QuantKind::Q4_1) => return pick(x86::q4_1_one, x86::q4_1_two),
            (Isa::Avx2, QuantKind::Q8_0) => return pick(x86::q8_0_one, x86::q8_0_two),
            (Isa::Portable, _) => {}
        }
    }
    let _ = isa;
    match kind {
        QuantKind::Q4_0 => Kernels {
            one: |w, x| portable::rows::<1>(QuantKind::Q4_0, w, [x])[0],
            two: |w, x| portable::rows::<2>(QuantKind::Q4_0, w, x),
        },
        QuantKind::Q4_1 => Kernels {
            one: |w, x| portable::rows::<1>(QuantKind::Q4_1, w, [x])[0],
            two: |w, x| portable::rows::<2>(QuantKind::Q4_1, w, x),
        },
        QuantKind::Q8_0 => Kernels {
            one: |w, x| portable::rows::<1>(QuantKind::Q8_0, w, [x])[0],
            two: |w, x| portable::rows::<2>(QuantKind::Q8_0, w, x),
        },
    }
}

/// The kernels in plain Rust: the reference the vector ones are tested against.
mod portable {
    use super::{BLOCK, QuantKind, Row, place};

    fn f16(bytes: &[u8]) -> f32 {
        half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32()
    }

    /// Block `b` of a stored row of `blocks` blocks: its integers (4-bit values 0..16
    /// unshifted, or signed bytes), its scale, and the coefficient of the activations' sum
    /// (Q4_1's minimum, Q4_0's −8·scale).
    pub(super) fn block(kind: QuantKind, row: &[u8], blocks: usize, b: usize) -> ([i32; BLOCK], f32, f32) {
        let at = place(kind, blocks, b);
        let values = &row[at.values..at.values + kind.payload_bytes()];
        let d = f16(&row[at.scale..]);
        let mut q = [0i32; BLOCK];
        match kind {
            QuantKind::Q4_0 | QuantKind::Q4_1 => {
                // The low nibbles are values 0..16, the high ones 16..32.
                for (i, byte) in values.iter().enumerate() {
                    q[i] = i32::from(byte & 0x0f);
                    q[i + 16] = i32::from(byte >> 4);
                }
                let coefficient = if kind == QuantKind::Q4_1 {
                    f16(&row[at.minimum..])
                } else {
                    -8.0 * d
                };
                (q, d, coefficient)
            }
            QuantKind::Q8_0 => {
                for (q, &byte) in q.iter_mut().zip(values) {
                    *q = i32::from(byte as i8);
                }
                (q, d, 0.0)
            }
        }
    }

    /// One stored weight row (blocks of `kind`) against `R` activation rows.
    pub(super) fn rows<const R: usize>(kind: QuantKind, w: &[u8], x: [Row<'_>; R]) -> [f32; R] {
        let blocks = w.len() / kind.block_bytes();
        let mut sums = [0.0; R];
        for b in 0..blocks {
            let (q, d, coefficient) = block(kind, w, blocks, b);
            for (sum, x) in sums.iter_mut().zip(&x) {
                let values = &x.values[b * BLOCK..(b + 1) * BLOCK];
                let dot: i32 = q.iter().zip(values).map(|(&q, &v)| q * i32::from(v)).sum();
                *sum += d * x.scales[b] * dot as f32 + coefficient * x.sums[b];
            }
        }
        sums
    }
}

/// x86 kernels. A group of eight blocks' f16 scales is widened by one instruction and
/// multiplied with the activation row's eight scales by another (its minimums, or for Q4_0 its
/// scales, times the row's eight sums by one FMA); each block's 32 integers become two vectors
/// of sixteen 16-bit lanes (4-bit values zero-extended from their bytes in one instruction, the
/// high nibble a shift away), multiplied with the row's 16-bit values and summed in pairs
/// (`vpmaddwd`, or with AVX-512 VNNI `vpdpwssd` accumulating the second half into the first),
/// and the eight 32-bit sums converted and scaled by one FMA whose scale is a lane of the
/// group's. A row's last, shorter group is read the same way, the lanes past its end masked.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BLOCK, GROUP, QuantKind, Row};

    /// What multiplies a block's activation sum.
    #[derive(Clone, Copy, PartialEq)]
    enum Offset {
        /// Nothing (Q8_0's values are signed).
        None,
        /// The block's scale, times a constant (Q4_0: −8, its values stored as q + 8).
        Scale(f32),
        /// The block's minimum (Q4_1).
        Minimum,
    }

    /// A block type: its layout, and how to read its integers.
    trait Block {
        const KIND: QuantKind;
        const OFFSET: Offset;

        /// The block's integers: values 0..16, then 16..32.
        ///
        /// # Safety
        ///
        /// `values` must point at the block's integers, and the CPU must have AVX2.
        unsafe fn integers(values: *const u8) -> (__m256i, __m256i);
    }

    struct Q4_0;
    struct Q4_1;
    struct Q8_0;

    /// 16 bytes of nibbles as 16-bit lanes: the low nibbles (values 0..16) and the high ones.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(qs: *const u8) -> (__m256i, __m256i) {
        // SAFETY: 16 readable bytes (the caller's contract); unaligned load.
        let bytes = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(qs.cast()) });
        // The high byte of each lane is zero, so the shift needs no mask.
        (
            _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f)),
            _mm256_srli_epi16(bytes, 4),
        )
    }

    impl Block for Q4_0 {
        const KIND: QuantKind = QuantKind::Q4_0;
        const OFFSET: Offset = Offset::Scale(-8.0);

        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn integers(values: *const u8) -> (__m256i, __m256i) {
            // SAFETY: the caller's contract.
            unsafe { nibbles(values) }
        }
    }

    impl Block for Q4_1 {
        const KIND: QuantKind = QuantKind::Q4_1;
        const OFFSET: Offset = Offset::Minimum;

        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn integers(values: *const u8) -> (__m256i, __m256i) {
            // SAFETY: the caller's contract.
            unsafe { nibbles(values) }
        }
    }

    impl Block for Q8_0 {
        const KIND: QuantKind = QuantKind::Q8_0;
        const OFFSET: Offset = Offset::None;

        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn integers(values: *const u8) -> (__m256i, __m256i) {
            // SAFETY: 32 readable signed bytes (the caller's contract); unaligned loads.
            unsafe {
                (
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(values.cast())),
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(values.add(16).cast())),
                )
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum(v: __m256) -> f32 {
        let sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
        let sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
        _mm_cvtss_f32(sum)
    }

    /// Defines `$name::<B, R>`: one stored weight row of `B` blocks against `R` activation
    /// rows, its block products by `$dot(low, high, first, second)`, compiled for `$features`.
    macro_rules! row_kernel {
        ($name:ident, $features:literal, $dot:expr) => {
            #[inline]
            #[target_feature(enable = $features)]
            fn $name<B: Block, const R: usize>(w: &[u8], x: [Row<'_>; R]) -> [f32; R] {
                /// The group of `size` blocks from block `first` of the row at `w` (`size` below
                /// [`GROUP`] only for a row's last group), into `acc` and `offsets`.
                ///
                /// # Safety
                ///
                /// The group must lie within the row, each row of `x` hold the group's values
                /// and [`GROUP`] scales and sums from `first` (zero past its end), and the CPU
                /// have `$features`.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn group<B: Block, const R: usize>(
                    w: *const u8,
                    first: usize,
                    size: usize,
                    x: &[Row<'_>; R],
                    acc: &mut [__m256; R],
                    offsets: &mut [__m256; R],
                ) {
                    let kind = B::KIND;
                    let start = first * kind.block_bytes();
                    // SAFETY (every load from `w`): the caller's contract. A group of `size`
                    // blocks spans at least 18 · `size` bytes, so 16 bytes from its start (its
                    // scales, and in a short group what follows them) or from its minimums lie
                    // within it.
                    let weight_scales = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(w.add(start).cast())) };
                    let coefficients = match B::OFFSET {
                        Offset::None => None,
                        Offset::Scale(_) => Some(weight_scales),
                        Offset::Minimum => {
                            Some(unsafe { _mm256_cvtph_ps(_mm_loadu_si128(w.add(start + 2 * size).cast())) })
                        }
                    }
                    // A short group's lanes past its end hold other bytes read as f16, maybe
                    // NaN: zeroed, where the row's sums (zero there) would not cancel them.
                    .map(|coefficients| {
                        if size < GROUP {
                            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                            let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(size as i32), lanes);
                            _mm256_and_ps(coefficients, _mm256_castsi256_ps(live))
                        } else {
                            coefficients
                        }
                    });
                    let mut scales = [_mm256_setzero_ps(); R];
                    for ((scales, offset), x) in scales.iter_mut().zip(offsets.iter_mut()).zip(x) {
                        // SAFETY: GROUP scales and sums from `first` (the caller's contract).
                        let (row_scales, row_sums) = unsafe {
                            (
                                _mm256_loadu_ps(x.scales.as_ptr().add(first)),
                                _mm256_loadu_ps(x.sums.as_ptr().add(first)),
                            )
                        };
                        *scales = _mm256_mul_ps(weight_scales, row_scales);
                        if let Some(coefficients) = coefficients {
                            *offset = _mm256_fmadd_ps(coefficients, row_sums, *offset);
                        }
                    }
                    let values = start + 2 * kind.halves() * size;
                    for j in 0..size {
                        // SAFETY: block `j`'s integers within the group (see `place`).
                        let (low, high) = unsafe { B::integers(w.add(values + j * kind.payload_bytes())) };
                        let lane = _mm256_set1_epi32(j as i32);
                        for ((acc, scales), x) in acc.iter_mut().zip(&scales).zip(x) {
                            // SAFETY: the 32 values of block `first + j` (the caller's contract).
                            let (first, second) = unsafe {
                                let values = x.values.as_ptr().add((first + j) * BLOCK);
                                (
                                    _mm256_loadu_si256(values.cast()),
                                    _mm256_loadu_si256(values.add(16).cast()),
                                )
                            };
                            let dot: __m256i = $dot(low, high, first, second);
                            let scale = _mm256_permutevar8x32_ps(*scales, lane);
                            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
                        }
                    }
                }

                let blocks = w.len() / B::KIND.block_bytes();
                assert_eq!(w.len(), blocks * B::KIND.block_bytes(), "whole blocks");
                for x in &x {
                    let padded = blocks.next_multiple_of(GROUP);
                    assert!(x.values.len() >= blocks * BLOCK && x.scales.len() >= padded && x.sums.len() >= padded);
                }
                let mut acc = [_mm256_setzero_ps(); R];
                // Σ (minimum, or scale) × scaled activation sum, a lane per block of a group.
                let mut offsets = [_mm256_setzero_ps(); R];
                let whole = blocks / GROUP;
                for g in 0..whole {
                    // SAFETY: a whole group within the row; the rows' lengths asserted above.
                    unsafe { group::<B, R>(w.as_ptr(), g * GROUP, GROUP, &x, &mut acc, &mut offsets) };
                }
                if blocks % GROUP > 0 {
                    // SAFETY: the row's last group, as above.
                    unsafe {
                        group::<B, R>(
                            w.as_ptr(),
                            whole * GROUP,
                            blocks % GROUP,
                            &x,
                            &mut acc,
                            &mut offsets,
                        )
                    };
                }
                let factor = match B::OFFSET {
                    Offset::Scale(factor) => factor,
                    Offset::None | Offset::Minimum => 1.0,
                };
                let mut out = [0.0; R];
                for ((out, acc), offset) in out.iter_mut().zip(acc).zip(offsets) {
                    *out = hsum(acc) + factor * hsum(offset);
                }
                out
            }
        };
    }

    row_kernel!(rows_avx2, "avx2,fma,f16c", |low, high, first, second| _mm256_add_epi32(
        _mm256_madd_epi16(low, first),
        _mm256_madd_epi16(high, second)
    ));
    row_kernel!(
        rows_vnni,
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        |low, high, first, second| _mm256_dpwssd_epi32(_mm256_madd_epi16(low, first), high, second)
    );

    // Safe entry points: `kernels_for` hands these out only when `Isa::available` found the
    // features they are compiled for.
    macro_rules! entry {
        ($rows:ident, $one:ident, $two:ident, $block:ident) => {
            pub(super) fn $one(w: &[u8], x: Row<'_>) -> f32 {
                // SAFETY: see above.
                unsafe { $rows::<$block, 1>(w, [x])[0] }
            }

            pub(super) fn $two(w: &[u8], x: [Row<'_>; 2]) -> [f32; 2] {
                // SAFETY: see above.
                unsafe { $rows::<$block, 2>(w, x) }
            }
        };
    }
    entry!(rows_avx2, q4_0_one, q4_0_two, Q4_0);
    entry!(rows_avx2, q4_1_one, q4_1_two, Q4_1);
    entry!(rows_avx2, q8_0_one, q8_0_two, Q8_0);
    entry!(rows_vnni, q4_0_one_vnni, q4_0_two_vnni, Q4_0);
    entry!(rows_vnni, q4_1_one_vnni, q4_1_two_vnni, Q4_1);
    entry!(rows_vnni, q8_0_one_vnni, q8_0_two_vnni, Q8_0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random stream in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// GGML's reference quantizers, for building test matrices.
    fn quantize(kind: QuantKind, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        for block in values.chunks(BLOCK) {
            let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            match kind {
                QuantKind::Q8_0 => {
                    let d = max / 127.0;
                    out.extend(half::f16::from_f32(d).to_le_bytes());
                    out.extend(
                        block
                            .iter()
                            .map(|v| (if d > 0.0 { v / d } else { 0.0 }).round() as i8 as u8),
                    );
                }
                QuantKind::Q4_0 => {
                    // The value of largest magnitude maps to −8.
                    let extreme = block
                        .iter()
                        .copied()
                        .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                    let d = extreme / -8.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend(half::f16::from_f32(d).to_le_bytes());
                    let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                    out.extend((0..16).map(|i| q(block[i]) | (q(block[i + 16]) << 4)));
                }
                QuantKind::Q4_1 => {
                    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let d = (max - min) / 15.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend(half::f16::from_f32(d).to_le_bytes());
                    out.extend(half::f16::from_f32(min).to_le_bytes());
                    let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
                    out.extend((0..16).map(|i| q(block[i]) | (q(block[i + 16]) << 4)));
                }
            }
        }
        out
    }

    const KINDS: [QuantKind; 3] = [QuantKind::Q4_0, QuantKind::Q4_1, QuantKind::Q8_0];

    #[test]
    fn every_kernel_gives_the_widened_product() {
        // Odd row counts and several tiles: the one-row and two-row kernels, tile edges; rows
        // of one block (a short group alone), of whole groups, and of both; from 16 rows on
        // (AVX-512 VNNI), the panel kernels' tiles of 16 and 32 rows, full and partial, and
        // 37 outputs, a run of weight rows short of a whole four.
        let outputs = 37;
        for (cols, rows) in [
            (32, 3),
            (256, 2),
            (576, 1),
            (576, 2),
            (576, 5),
            (576, 19),
            (576, 40),
            (32, 17),
            (320, 16),
            (320, 33),
            (96, 64),
        ] {
            let x = values(rows as u64, rows * cols);
            for kind in KINDS {
                let matrix =
                    QuantMatrix::new(kind, outputs, cols, quantize(kind, &values(7, outputs * cols))).expect("matrix");
                let widened = matrix.dequantize();
                for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
                    let got = matrix.matmul_on(isa, &x, rows).expect("available");
                    for r in 0..rows {
                        for o in 0..outputs {
                            let want: f32 = (0..cols).map(|k| x[r * cols + k] * widened[o * cols + k]).sum();
                            let value = got[r * outputs + o];
                            // 16-bit activations: each term off by at most |w| · scale/2 with
                            // scale = max|x|/32767 (|x|, |w| ≤ 1 here), so a product of 576
                            // terms is off by ~1e-4 at most.
                            assert!(
                                (value - want).abs() <= 1e-3 * want.abs().max(1.0),
                                "{kind:?}, {rows} rows, ({r}, {o}): {value} vs {want} on {isa:?}",
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn products_run_together_equal_products_run_alone() {
        // Three matrices of different heights and kinds (a layer's q, k and v), large enough
        // that the work is split into tasks, which must not straddle two matrices.
        let cols = 576;
        let matrices: Vec<QuantMatrix> = [(QuantKind::Q4_1, 576), (QuantKind::Q8_0, 192), (QuantKind::Q4_0, 37)]
            .into_iter()
            .enumerate()
            .map(|(seed, (kind, rows))| {
                QuantMatrix::new(kind, rows, cols, quantize(kind, &values(seed as u64 + 11, rows * cols)))
                    .expect("matrix")
            })
            .collect();
        for rows in [1, 3, 8] {
            let x = values(rows as u64 + 100, rows * cols);
            let together = QuantMatrix::matmul_all([&matrices[0], &matrices[1], &matrices[2]], &x, rows);
            for (matrix, got) in matrices.iter().zip(&together) {
                assert_eq!(got, &matrix.matmul(&x, rows), "{:?} at {rows} rows", matrix.kind());
            }
        }
    }

    #[test]
    fn the_portable_kernels_agree_with_the_vector_ones() {
        // 9 blocks: an odd count, so no kernel may assume pairs.
        let cols = 288;
        let x = Q16Rows::quantize(&values(1, 2 * cols), 2, cols);
        let (x0, x1) = (x.row(0), x.row(1));
        let here: Vec<Isa> = Isa::ALL.into_iter().filter(|isa| isa.available()).collect();
        for kind in KINDS {
            let matrix = QuantMatrix::new(kind, 1, cols, quantize(kind, &values(3, cols))).expect("matrix");
            let w = matrix.row_data(0);
            let portable = kernels_for(kind, Isa::Portable);
            let [pa, pb] = (portable.two)(w, [x0, x1]);
            for &isa in &here {
                let kernels = kernels_for(kind, isa);
                let [a, b] = (kernels.two)(w, [x0, x1]);
                let one = (kernels.one)(w, x0);
                for (got, want) in [(a, pa), (b, pb), (one, pa)] {
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{kind:?} on {isa:?}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn widening_matches_the_block_definitions() {
        let q4_1: Vec<u8> = [
            half::f16::from_f32(0.5).to_le_bytes(),
            half::f16::from_f32(-1.0).to_le_bytes(),
        ]
        .concat()
        .into_iter()
        .chain((0..16).map(|i| (i as u8) | (15 - i as u8) << 4))
        .collect();
        let matrix = QuantMatrix::new(QuantKind::Q4_1, 1, 32, q4_1).expect("matrix");
        let values = matrix.dequantize();
        assert_eq!(values[0], -1.0);
        assert_eq!(values[3], 0.5);
        assert_eq!(values[16], 6.5);
    }

    #[test]
    fn regrouped_rows_widen_as_ggml_blocks_do() {
        // 10 blocks a row: a whole group and a short one.
        let (rows, cols) = (3, 320);
        for kind in KINDS {
            let ggml = quantize(kind, &values(5, rows * cols));
            let mut want = vec![0.0; rows * cols];
            for (block, out) in ggml
                .chunks_exact(kind.block_bytes())
                .zip(want.as_chunks_mut::<BLOCK>().0)
            {
                dequantize_block(kind, block, out);
            }
            let matrix = QuantMatrix::new(kind, rows, cols, ggml).expect("matrix");
            assert_eq!(matrix.dequantize(), want, "{kind:?}");
        }
    }

    #[test]
    fn wrong_shapes_are_refused() {
        assert!(matches!(
            QuantMatrix::new(QuantKind::Q8_0, 1, 33, vec![0; 34]),
            Err(QuantError::Columns { cols: 33 })
        ));
        assert!(matches!(
            QuantMatrix::new(QuantKind::Q4_1, 4, 0, Vec::new()),
            Err(QuantError::Columns { cols: 0 })
        ));
        assert!(matches!(
            QuantMatrix::new(QuantKind::Q8_0, 2, 32, vec![0; 34]),
            Err(QuantError::Length { wanted: 68, .. })
        ));
    }
}
