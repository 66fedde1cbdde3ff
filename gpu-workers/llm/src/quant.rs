//! Weight matrices kept as GGUF stores them (GGML's Q4_0, Q4_1 and Q8_0 blocks of 32 values),
//! and their products with activations quantized per block to 16 bits.
//!
//! A product reads each weight block once per batch: 18–34 bytes for 32 weights instead of
//! 128 as f32, which is what bounds decoding on a CPU. The activations of a row are quantized
//! once per product, per 32-value block, to 16-bit integers with an f32 scale (and their sum,
//! for Q4_1's minimum and Q4_0's offset), so each block's dot product is an integer
//! one: 16-bit multiply-adds (`vpmaddwd`) with AVX2 where the CPU has it (detected at run time),
//! a portable loop elsewhere, both giving the same integer sums. llama.cpp quantizes the
//! activations to 8 bits; tried here, that moved SmolLM2's logits by up to ~1 (of ~25) against
//! the widened weights and flipped its greedy answer to a chat question (the f32 path answers
//! "Paris", 8-bit activations "L'Étoile…"). 16 bits keep the error ~250× smaller and the dot
//! products integer. Output rows are split over rayon's threads, and within a thread a run of
//! weight rows meets a tile of activation rows so both stay in cache.

use std::sync::OnceLock;

use rayon::prelude::*;

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
        Ok(QuantMatrix { kind, rows, cols, data })
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
        let block_bytes = self.kind.block_bytes();
        for (block, out) in self
            .row_data(row)
            .chunks_exact(block_bytes)
            .zip(out.as_chunks_mut::<BLOCK>().0)
        {
            dequantize_block(self.kind, block, out);
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
        let cols = matrices.first().map_or(0, |m| m.cols);
        assert!(matrices.iter().all(|m| m.cols == cols), "matrices of different widths");
        assert_eq!(x.len(), rows * cols, "activation shape");
        let mut ys = matrices.map(|m| vec![0.0; rows * m.rows]);
        let outputs: usize = matrices.iter().map(|m| m.rows).sum();
        if rows == 0 || outputs == 0 {
            return ys;
        }
        let activations = Q16Rows::quantize(x, rows, cols);
        let x_row = |r: usize| activations.row(r);
        // Each task: a run of one matrix's weight rows against every activation row, in tiles
        // of rows that stay in cache; its results come back as [output][row] and are scattered
        // below.
        let work = outputs * rows * (cols / BLOCK);
        let per_task = if work < 1 << 13 {
            outputs
        } else {
            (outputs / (rayon::current_num_threads() * 8)).clamp(8, 256)
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
                let kernels = kernels(matrix.kind);
                let row_bytes = matrix.row_bytes();
                let weights = &matrix.data[start * row_bytes..(start + count) * row_bytes];
                let mut out = vec![0.0; count * rows];
                for tile in (0..rows).step_by(ACTIVATION_TILE) {
                    let tile_end = (tile + ACTIVATION_TILE).min(rows);
                    for (o, weight) in weights.chunks_exact(row_bytes).enumerate() {
                        let out = &mut out[o * rows..(o + 1) * rows];
                        let mut r = tile;
                        while r + 1 < tile_end {
                            [out[r], out[r + 1]] = (kernels.two)(weight, [x_row(r), x_row(r + 1)]);
                            r += 2;
                        }
                        if r < tile_end {
                            out[r] = (kernels.one)(weight, x_row(r));
                        }
                    }
                }
                out
            })
            .collect();
        for (&(m, start, _), column) in tasks.iter().zip(columns) {
            let outputs = matrices[m].rows;
            let y = &mut ys[m];
            for (o, values) in column.chunks_exact(rows).enumerate() {
                for (r, value) in values.iter().enumerate() {
                    y[r * outputs + start + o] = *value;
                }
            }
        }
        ys
    }
}

/// Activation rows per tile: 16 rows of a 1,536-wide input are 96 KB, within L2 beside the
/// weight rows being read.
const ACTIVATION_TILE: usize = 16;

/// Widens one block of `kind` into 32 values.
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

/// Activation rows quantized per 32-value block to 16 bits.
struct Q16Rows {
    blocks: usize,
    values: Vec<i16>,
    scales: Vec<f32>,
    sums: Vec<f32>,
}

/// One activation row's blocks: `x ≈ values · scale`, and each block's `scale · Σ values`.
#[derive(Clone, Copy)]
struct Row<'a> {
    values: &'a [i16],
    scales: &'a [f32],
    sums: &'a [f32],
}

impl Q16Rows {
    fn quantize(x: &[f32], rows: usize, cols: usize) -> Q16Rows {
        let blocks = cols / BLOCK;
        let mut values = vec![0i16; rows * cols];
        let mut scales = Vec::with_capacity(rows * blocks);
        let mut sums = Vec::with_capacity(rows * blocks);
        for (block, out) in x.as_chunks::<BLOCK>().0.iter().zip(values.as_chunks_mut::<BLOCK>().0) {
            let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let scale = max / f32::from(i16::MAX);
            let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (out, value) in out.iter_mut().zip(block) {
                *out = (value * inverse).round() as i16;
                sum += i32::from(*out);
            }
            scales.push(scale);
            // The sum of the quantized values, so that Q4_0's and Q4_1's offset terms carry the
            // same rounding as the products: the result is the widened weights times the
            // quantized activations.
            sums.push(scale * sum as f32);
        }
        Q16Rows {
            blocks,
            values,
            scales,
            sums,
        }
    }

    fn row(&self, row: usize) -> Row<'_> {
        let blocks = row * self.blocks..(row + 1) * self.blocks;
        Row {
            values: &self.values[blocks.start * BLOCK..blocks.end * BLOCK],
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
    /// AVX2 with FMA and F16C.
    Avx2,
    /// Plain Rust (what LLVM makes of it for the target).
    Portable,
}

/// What the kernels run on here (detected once).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    })
}

fn kernels(kind: QuantKind) -> Kernels {
    kernels_for(kind, isa())
}

/// The kernels for `kind` on `isa` (which must be available: see [`isa`]).
fn kernels_for(kind: QuantKind, isa: Isa) -> Kernels {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        return match kind {
            QuantKind::Q4_0 => Kernels {
                one: x86::q4_0_one,
                two: x86::q4_0_two,
            },
            QuantKind::Q4_1 => Kernels {
                one: x86::q4_1_one,
                two: x86::q4_1_two,
            },
            QuantKind::Q8_0 => Kernels {
                one: x86::q8_0_one,
                two: x86::q8_0_two,
            },
        };
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
    use super::{BLOCK, QuantKind, Row};

    fn f16(bytes: &[u8]) -> f32 {
        half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32()
    }

    /// A block's integers (4-bit values 0..16 unshifted, or signed bytes), its scale, and the
    /// coefficient of the activations' sum (Q4_1's minimum, Q4_0's −8·scale).
    fn block(kind: QuantKind, block: &[u8]) -> ([i32; BLOCK], f32, f32) {
        let mut q = [0i32; BLOCK];
        let nibbles = |qs: &[u8], q: &mut [i32; BLOCK]| {
            for (i, byte) in qs.iter().enumerate() {
                q[i] = i32::from(byte & 0x0f);
                q[i + 16] = i32::from(byte >> 4);
            }
        };
        match kind {
            QuantKind::Q4_0 => {
                let d = f16(&block[0..2]);
                nibbles(&block[2..18], &mut q);
                (q, d, -8.0 * d)
            }
            QuantKind::Q4_1 => {
                nibbles(&block[4..20], &mut q);
                (q, f16(&block[0..2]), f16(&block[2..4]))
            }
            QuantKind::Q8_0 => {
                for (q, &byte) in q.iter_mut().zip(&block[2..34]) {
                    *q = i32::from(byte as i8);
                }
                (q, f16(&block[0..2]), 0.0)
            }
        }
    }

    /// One weight row (blocks of `kind`) against `R` activation rows.
    pub(super) fn rows<const R: usize>(kind: QuantKind, w: &[u8], x: [Row<'_>; R]) -> [f32; R] {
        let mut sums = [0.0; R];
        for (b, bytes) in w.chunks_exact(kind.block_bytes()).enumerate() {
            let (q, d, coefficient) = block(kind, bytes);
            for (sum, x) in sums.iter_mut().zip(&x) {
                let values = &x.values[b * BLOCK..(b + 1) * BLOCK];
                let dot: i32 = q.iter().zip(values).map(|(&q, &v)| q * i32::from(v)).sum();
                *sum += d * x.scales[b] * dot as f32 + coefficient * x.sums[b];
            }
        }
        sums
    }
}

/// AVX2 kernels: a block's 32 integers widened to two vectors of sixteen 16-bit lanes,
/// multiplied with each activation row's 16-bit values and summed in pairs (`vpmaddwd`), the
/// block's scale applied to the eight 32-bit sums by one FMA.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BLOCK, Row};

    /// The f16 values of `bytes[0..2]` and, for `PAIR`, `bytes[2..4]`, in one conversion.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn halves<const PAIR: bool>(bytes: &[u8]) -> (f32, f32) {
        let bits = if PAIR {
            i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
        } else {
            i32::from(u16::from_le_bytes([bytes[0], bytes[1]]))
        };
        let both = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
        (_mm_cvtss_f32(both), _mm_cvtss_f32(_mm_movehdup_ps(both)))
    }

    /// A 4-bit block's nibbles as 16-bit lanes: values 0..16, then 16..32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn nibbles(qs: &[u8]) -> (__m256i, __m256i) {
        assert!(qs.len() >= 16);
        // SAFETY: 16 readable bytes (asserted); unaligned load.
        let packed = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let mask = _mm_set1_epi8(0x0f);
        let low = _mm_and_si128(packed, mask);
        let high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
        (_mm256_cvtepu8_epi16(low), _mm256_cvtepu8_epi16(high))
    }

    /// A block type: its size, and its integers, scale and sum coefficient.
    trait Block {
        const BYTES: usize;

        /// # Safety
        ///
        /// The CPU must have AVX2, FMA and F16C.
        unsafe fn read(block: &[u8]) -> (__m256i, __m256i, f32, f32);
    }

    struct Q4_0;
    struct Q4_1;
    struct Q8_0;

    impl Block for Q4_0 {
        const BYTES: usize = 18;

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn read(block: &[u8]) -> (__m256i, __m256i, f32, f32) {
            let (d, _) = halves::<false>(block);
            let (low, high) = nibbles(&block[2..18]);
            (low, high, d, -8.0 * d)
        }
    }

    impl Block for Q4_1 {
        const BYTES: usize = 20;

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn read(block: &[u8]) -> (__m256i, __m256i, f32, f32) {
            let (d, m) = halves::<true>(block);
            let (low, high) = nibbles(&block[4..20]);
            (low, high, d, m)
        }
    }

    impl Block for Q8_0 {
        const BYTES: usize = 34;

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn read(block: &[u8]) -> (__m256i, __m256i, f32, f32) {
            assert!(block.len() >= 34);
            let (d, _) = halves::<false>(block);
            // SAFETY: 32 readable bytes after the scale (asserted); unaligned loads.
            let (first, second) = unsafe {
                (
                    _mm_loadu_si128(block[2..].as_ptr().cast()),
                    _mm_loadu_si128(block[18..].as_ptr().cast()),
                )
            };
            (_mm256_cvtepi8_epi16(first), _mm256_cvtepi8_epi16(second), d, 0.0)
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
        let sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
        _mm_cvtss_f32(sum)
    }

    /// One weight row of `B` blocks against `R` activation rows.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn rows<B: Block, const R: usize>(w: &[u8], x: [Row<'_>; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut offsets = [0.0f32; R];
        for (b, block) in w.chunks_exact(B::BYTES).enumerate() {
            // SAFETY: this function runs only with the features `read` needs.
            let (low, high, d, coefficient) = unsafe { B::read(block) };
            for ((acc, offset), x) in acc.iter_mut().zip(&mut offsets).zip(&x) {
                let values = &x.values[b * BLOCK..(b + 1) * BLOCK];
                // SAFETY: 32 readable i16 (the slice above); unaligned loads.
                let (first, second) = unsafe {
                    (
                        _mm256_loadu_si256(values.as_ptr().cast()),
                        _mm256_loadu_si256(values[16..].as_ptr().cast()),
                    )
                };
                let dot = _mm256_add_epi32(_mm256_madd_epi16(low, first), _mm256_madd_epi16(high, second));
                let scale = _mm256_set1_ps(d * x.scales[b]);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
                *offset += coefficient * x.sums[b];
            }
        }
        let mut out = [0.0; R];
        for ((out, acc), offset) in out.iter_mut().zip(acc).zip(offsets) {
            *out = hsum(acc) + offset;
        }
        out
    }

    // Safe entry points: `kernels_for` hands these out only when `isa()` found AVX2, FMA and
    // F16C.
    macro_rules! entry {
        ($one:ident, $two:ident, $block:ident) => {
            pub(super) fn $one(w: &[u8], x: Row<'_>) -> f32 {
                // SAFETY: see above.
                unsafe { rows::<$block, 1>(w, [x])[0] }
            }

            pub(super) fn $two(w: &[u8], x: [Row<'_>; 2]) -> [f32; 2] {
                // SAFETY: see above.
                unsafe { rows::<$block, 2>(w, x) }
            }
        };
    }
    entry!(q4_0_one, q4_0_two, Q4_0);
    entry!(q4_1_one, q4_1_two, Q4_1);
    entry!(q8_0_one, q8_0_two, Q8_0);
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
        // Odd row counts and several tiles: the one-row and two-row kernels, tile edges.
        let (outputs, cols) = (37, 576);
        for rows in [1, 2, 5, 19, 40] {
            let x = values(rows as u64, rows * cols);
            for kind in KINDS {
                let matrix =
                    QuantMatrix::new(kind, outputs, cols, quantize(kind, &values(7, outputs * cols))).expect("matrix");
                let widened = matrix.dequantize();
                let got = matrix.matmul(&x, rows);
                for r in 0..rows {
                    for o in 0..outputs {
                        let want: f32 = (0..cols).map(|k| x[r * cols + k] * widened[o * cols + k]).sum();
                        let value = got[r * outputs + o];
                        // 16-bit activations: each term off by at most |w| · scale/2 with
                        // scale = max|x|/32767 (|x|, |w| ≤ 1 here), so a product of 576
                        // terms is off by ~1e-4 at most.
                        assert!(
                            (value - want).abs() <= 1e-3 * want.abs().max(1.0),
                            "{kind:?}, {rows} rows, ({r}, {o}): {value} vs {want} on {:?}",
                            isa()
                        );
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
        let cols = 256;
        let x = Q16Rows::quantize(&values(1, 2 * cols), 2, cols);
        let (x0, x1) = (x.row(0), x.row(1));
        for kind in KINDS {
            let w = quantize(kind, &values(3, cols));
            let portable = kernels_for(kind, Isa::Portable);
            let here = kernels(kind);
            let [a, b] = (here.two)(&w, [x0, x1]);
            let [pa, pb] = (portable.two)(&w, [x0, x1]);
            let one = (here.one)(&w, x0);
            for (got, want) in [(a, pa), (b, pb), (one, pa)] {
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{kind:?}: {got} vs {want}"
                );
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
