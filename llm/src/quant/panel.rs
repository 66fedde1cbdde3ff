//! Products of many activation rows at once (batched decoding, prefill) on AVX-512 VNNI, where
//! the block kernels of the parent module run out of arithmetic: they multiply a weight block
//! with one or two activation rows and spend as many instructions scaling and summing each
//! block's product as computing it.
//!
//! Here a vector holds 16 activation rows, not 32 values of one row. The activations are laid
//! out once per product as pairs of 16-bit values, a pair's 16 (or 32) rows side by side
//! ([`Tiles`]); each weight row's blocks are widened once per task to 16-bit integers in cache
//! (a 64-byte line a block). Then one `vpdpwssd` multiplies a pair of weights, broadcast, with
//! that pair of 16 rows' activations and adds into 16 rows' integer sums: 32 multiply-adds an
//! instruction, twice an f32 FMA's, and a block's scale is applied once per 16 rows, not per
//! row. The integer sums are those of the block kernels, so results differ from theirs only by
//! the order in which the f32 block products are added.
//!
//! # Rejected designs
//!
//! - Eight weight rows a pass instead of four: no faster, as LLVM split each `vpdpwssd` into a
//!   multiply and an add once the registers ran short.
//! - A fresh zeroed scratch per task instead of one kept per thread: ~4 % of a batched step.

use std::arch::x86_64::*;
use std::cell::RefCell;

use rayon::prelude::*;

use super::{BLOCK, GROUP, QuantKind, place};

/// Activation rows a tile: two 512-bit vectors of 16-bit pairs.
pub(super) const LANES: usize = 32;

/// Pairs of values in a block.
const PAIRS: usize = BLOCK / 2;

/// Weight rows multiplied together: each holds two vectors of integer sums and two of f32
/// sums, so four rows keep 16 of the 32 vector registers busy and leave room for the
/// activations. (Eight rows, their f32 sums in cache, measured no faster: LLVM split each
/// `vpdpwssd` into a multiply and an add once the registers ran short.)
pub(super) const WEIGHT_ROWS: usize = 4;

/// Weight rows widened at a time: 32 rows of a 1,536-wide matrix are 96 KB of 16-bit values,
/// which stay in L2 beside a tile's activations (as many bytes) while each tile meets them.
const WIDENED_ROWS: usize = 32;

/// Activation rows laid out for [`product`]: tiles of [`LANES`] rows; within a tile, for each
/// block and each of its 16 pairs of values, the pair of every row (as one `i32`, zero past
/// the last row) side by side; then each block's scales and scaled sums, a lane per row.
pub(super) struct Tiles {
    rows: usize,
    blocks: usize,
    pairs: Vec<i32>,
    scales: Vec<f32>,
    sums: Vec<f32>,
}

impl Tiles {
    /// The `rows` rows of `x` (`[rows, cols]`) quantized per block to 16 bits, to the values
    /// the block kernels' activations get ([`super::quantize_block`]), and laid out in tiles.
    /// A tile's blocks are quantized in parallel: this runs once per product, before its
    /// weights are split over the threads.
    ///
    /// # Safety
    ///
    /// As [`product`].
    pub(super) unsafe fn quantize(x: &[f32], rows: usize, cols: usize) -> Tiles {
        let blocks = cols / BLOCK;
        let tiles = rows.div_ceil(LANES);
        let mut pairs = vec![0i32; tiles * blocks * PAIRS * LANES];
        let mut scales = vec![0.0f32; tiles * blocks * LANES];
        let mut sums = vec![0.0f32; tiles * blocks * LANES];
        pairs
            .par_chunks_mut(PAIRS * LANES)
            .zip(scales.par_chunks_mut(LANES).zip(sums.par_chunks_mut(LANES)))
            .enumerate()
            .with_min_len(4)
            .for_each(|(at, (pairs, (scales, sums)))| {
                let (tile, b) = (at / blocks, at % blocks);
                for lane in 0..LANES.min(rows - tile * LANES) {
                    let row = tile * LANES + lane;
                    let Some(block) = x[row * cols + b * BLOCK..].first_chunk::<BLOCK>() else {
                        continue;
                    };
                    // SAFETY: the CPU's features (the caller's contract).
                    let (block_pairs, scale, sum) = unsafe { quantize_pairs(block) };
                    (scales[lane], sums[lane]) = (scale, sum);
                    for (p, pair) in block_pairs.into_iter().enumerate() {
                        pairs[p * LANES + lane] = pair;
                    }
                }
            });
        Tiles {
            rows,
            blocks,
            pairs,
            scales,
            sums,
        }
    }
}

/// [`super::quantize_block`] in vector registers, its 32 values as 16 pairs (each pair one
/// `i32`, little-endian, as `vpdpwssd` reads a lane's two halves): for finite activations the
/// same scale, values and sum, since each step is the same IEEE operation (`vcvtps2dq` rounds
/// to nearest, ties to even, as the scalar code's rounding trick does). The scalar loop, with
/// Rust's saturating casts, took 3-6 ns a value, a fifth of a 32-row product.
///
/// # Safety
///
/// As [`product`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn quantize_pairs(block: &[f32; BLOCK]) -> ([i32; PAIRS], f32, f32) {
    // SAFETY: 32 readable values; unaligned loads.
    let (low, high) = unsafe { (_mm512_loadu_ps(block.as_ptr()), _mm512_loadu_ps(block.as_ptr().add(16))) };
    let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    let scale = max / f32::from(i16::MAX);
    let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    let inverse = _mm512_set1_ps(inverse);
    let low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
    let high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
    let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(low, high));
    let values = _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm512_cvtepi32_epi16(low)),
        _mm512_cvtepi32_epi16(high),
    );
    let mut pairs = [0i32; PAIRS];
    // SAFETY: 16 writable i32s; unaligned store.
    unsafe { _mm512_storeu_si512(pairs.as_mut_ptr().cast(), values) };
    (pairs, scale, scale * sum as f32)
}

/// A run of weight rows widened to 16-bit integers, their f32 scales and minimums beside.
struct Widened {
    values: Vec<i16>,
    scales: Vec<f32>,
    minimums: Vec<f32>,
}

impl Widened {
    /// Room for `rows` rows of `blocks` blocks (what it held before is overwritten by the
    /// caller).
    fn shape(&mut self, blocks: usize, rows: usize) {
        self.values.resize(rows * blocks * BLOCK, 0);
        self.scales.resize(rows * blocks, 0.0);
        self.minimums.resize(rows * blocks, 0.0);
    }
}

thread_local! {
    /// Each thread's widened rows, kept between products: a fresh one zeroed per task took
    /// about 4 % of a batched decoding step.
    static WIDENED: RefCell<Widened> = const {
        RefCell::new(Widened {
            values: Vec::new(),
            scales: Vec::new(),
            minimums: Vec::new(),
        })
    };
}

/// `out[r · count + o]` = the product of weight row `o` of the `count` stored rows `weights`
/// (regrouped rows of `kind`, `x.blocks` blocks each) with activation row `r`, for every row of
/// each.
///
/// # Safety
///
/// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn product(kind: QuantKind, weights: &[u8], x: &Tiles, out: &mut [f32]) {
    let blocks = x.blocks;
    let row_bytes = blocks * kind.block_bytes();
    let count = weights.len() / row_bytes;
    assert_eq!(weights.len(), count * row_bytes, "whole rows");
    assert_eq!(out.len(), count * x.rows, "output shape");
    // One tile meets each widened row once: widen them four at a time, into L1.
    let widened = if x.rows > LANES { WIDENED_ROWS } else { WEIGHT_ROWS };
    WIDENED.with_borrow_mut(|scratch| {
        scratch.shape(blocks, widened);
        // SAFETY: the caller's contract.
        unsafe { widen_and_multiply(kind, weights, x, scratch, widened, out) };
    });
}

/// [`product`]'s work, `widened` rows at a time through `scratch` (shaped for them).
///
/// # Safety
///
/// As [`product`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn widen_and_multiply(
    kind: QuantKind,
    weights: &[u8],
    x: &Tiles,
    scratch: &mut Widened,
    widened: usize,
    out: &mut [f32],
) {
    let blocks = x.blocks;
    let row_bytes = blocks * kind.block_bytes();
    let count = weights.len() / row_bytes;
    for first in (0..count).step_by(widened) {
        let live = widened.min(count - first);
        for r in 0..live.next_multiple_of(WEIGHT_ROWS) {
            let values = &mut scratch.values[r * blocks * BLOCK..(r + 1) * blocks * BLOCK];
            let scales = &mut scratch.scales[r * blocks..(r + 1) * blocks];
            let minimums = &mut scratch.minimums[r * blocks..(r + 1) * blocks];
            if r < live {
                let row = &weights[(first + r) * row_bytes..(first + r + 1) * row_bytes];
                // SAFETY: the CPU's features (the caller's contract); the row is whole.
                unsafe { widen_row(kind, row, values, scales, minimums) };
            } else {
                // Rows past the run's end multiply to zero and are not written out.
                values.fill(0);
                scales.fill(0.0);
                minimums.fill(0.0);
            }
        }
        // The next rows' bytes are asked for now, so that they arrive from memory while these
        // rows are multiplied rather than when they are widened.
        let next = weights.get((first + widened) * row_bytes..).unwrap_or_default();
        for line in next.iter().take(widened * row_bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(line).cast());
        }
        // Tiles outside, weight rows inside: a tile's activations stay in cache while every
        // widened row meets them.
        for tile in 0..x.rows.div_ceil(LANES) {
            let rows = LANES.min(x.rows - tile * LANES);
            for group in (0..live).step_by(WEIGHT_ROWS) {
                let mut sums = [[0.0f32; LANES]; WEIGHT_ROWS];
                // SAFETY: the CPU's features (the caller's contract); `scratch` holds `widened`
                // (a multiple of WEIGHT_ROWS) rows of `x.blocks` blocks (shaped by `product`),
                // `group` starts a whole WEIGHT_ROWS of them, and `tile` is one of `x`'s.
                unsafe {
                    match (kind == QuantKind::Q4_1, rows > LANES / 2) {
                        (false, false) => tile_product::<1, false>(scratch, group, x, tile, &mut sums),
                        (false, true) => tile_product::<2, false>(scratch, group, x, tile, &mut sums),
                        (true, false) => tile_product::<1, true>(scratch, group, x, tile, &mut sums),
                        (true, true) => tile_product::<2, true>(scratch, group, x, tile, &mut sums),
                    }
                }
                for (r, sums) in sums.iter().enumerate().take(live - group) {
                    for (lane, &sum) in sums.iter().enumerate().take(rows) {
                        out[(tile * LANES + lane) * count + first + group + r] = sum;
                    }
                }
            }
        }
    }
}

/// One stored row of `kind` widened: its integers as signed 16-bit values (Q4_0's shifted by
/// −8, so it needs no offset term), its scales and (Q4_1) minimums as f32.
///
/// # Safety
///
/// As [`product`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn widen_row(kind: QuantKind, row: &[u8], values: &mut [i16], scales: &mut [f32], minimums: &mut [f32]) {
    let blocks = scales.len();
    assert!(row.len() == blocks * kind.block_bytes() && values.len() == blocks * BLOCK && minimums.len() == blocks);
    for first in (0..blocks).step_by(GROUP) {
        let size = GROUP.min(blocks - first);
        let at = place(kind, blocks, first);
        let mut halves = [0.0f32; GROUP];
        // SAFETY: a group of `size` blocks spans at least 18 · `size` bytes from its scales, so
        // 16 bytes from its scales (or its minimums) lie within the row.
        unsafe {
            _mm256_storeu_ps(
                halves.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(at.scale).cast())),
            )
        };
        scales[first..first + size].copy_from_slice(&halves[..size]);
        if kind == QuantKind::Q4_1 {
            // SAFETY: as above.
            unsafe {
                _mm256_storeu_ps(
                    halves.as_mut_ptr(),
                    _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(at.minimum).cast())),
                )
            };
            minimums[first..first + size].copy_from_slice(&halves[..size]);
        }
        for b in first..first + size {
            let source = place(kind, blocks, b).values;
            let target = values[b * BLOCK..(b + 1) * BLOCK].as_mut_ptr();
            // SAFETY: block `b`'s integers lie within the row (see `place`), and its 32 values'
            // room within `values`.
            unsafe {
                let widened = match kind {
                    QuantKind::Q8_0 => _mm512_cvtepi8_epi16(_mm256_loadu_si256(row.as_ptr().add(source).cast())),
                    QuantKind::Q4_0 | QuantKind::Q4_1 => {
                        let bytes = _mm_loadu_si128(row.as_ptr().add(source).cast());
                        let mask = _mm_set1_epi8(0x0f);
                        // Values 0..16 are the low nibbles, 16..32 the high ones.
                        let low = _mm_and_si128(bytes, mask);
                        let high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                        let nibbles = _mm512_cvtepu8_epi16(_mm256_set_m128i(high, low));
                        if kind == QuantKind::Q4_0 {
                            _mm512_sub_epi16(nibbles, _mm512_set1_epi16(8))
                        } else {
                            nibbles
                        }
                    }
                };
                _mm512_storeu_si512(target.cast(), widened);
            }
        }
    }
}

/// `sums[r][lane]` = the products of the [`WEIGHT_ROWS`] widened rows from `group` with tile
/// `tile`'s rows, over `C` vectors of 16 rows (1 where the tile holds at most 16), with Q4_1's
/// minimum term where `MINIMUM`.
///
/// # Safety
///
/// As [`product`], and `w` and `x` must have the same number of blocks, `w` hold
/// [`WEIGHT_ROWS`] rows from `group`, and `tile` be one of `x`'s.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_product<const C: usize, const MINIMUM: bool>(
    w: &Widened,
    group: usize,
    x: &Tiles,
    tile: usize,
    sums: &mut [[f32; LANES]; WEIGHT_ROWS],
) {
    let blocks = x.blocks;
    let mut acc = [[_mm512_setzero_ps(); C]; WEIGHT_ROWS];
    let weights = w.values.as_ptr();
    for b in 0..blocks {
        let mut dots = [[_mm512_setzero_si512(); C]; WEIGHT_ROWS];
        // SAFETY (every load): `x` holds `blocks` blocks of PAIRS × LANES pairs and LANES
        // scales and sums per tile, `w` WEIGHT_ROWS rows of `blocks` blocks (the caller's
        // contract).
        let pairs = unsafe { x.pairs.as_ptr().add((tile * blocks + b) * PAIRS * LANES) };
        for p in 0..PAIRS {
            let mut activations = [_mm512_setzero_si512(); C];
            for (c, activations) in activations.iter_mut().enumerate() {
                *activations = unsafe { _mm512_loadu_si512(pairs.add(p * LANES + 16 * c).cast()) };
            }
            for (r, dots) in dots.iter_mut().enumerate() {
                let pair = unsafe {
                    weights
                        .add(((group + r) * blocks + b) * BLOCK + 2 * p)
                        .cast::<i32>()
                        .read_unaligned()
                };
                let pair = _mm512_set1_epi32(pair);
                for (dot, activations) in dots.iter_mut().zip(&activations) {
                    *dot = _mm512_dpwssd_epi32(*dot, pair, *activations);
                }
            }
        }
        let at = (tile * blocks + b) * LANES;
        for (r, (acc, dots)) in acc.iter_mut().zip(&dots).enumerate() {
            let scale = _mm512_set1_ps(w.scales[(group + r) * blocks + b]);
            let minimum = _mm512_set1_ps(w.minimums[(group + r) * blocks + b]);
            for (c, (acc, dot)) in acc.iter_mut().zip(dots).enumerate() {
                // SAFETY: LANES scales and sums a block of a tile (see above), 16 lanes from
                // 16 · c within LANES.
                let (row_scales, row_sums) = unsafe {
                    (
                        _mm512_loadu_ps(x.scales.as_ptr().add(at + 16 * c)),
                        _mm512_loadu_ps(x.sums.as_ptr().add(at + 16 * c)),
                    )
                };
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*dot), _mm512_mul_ps(row_scales, scale), *acc);
                if MINIMUM {
                    *acc = _mm512_fmadd_ps(row_sums, minimum, *acc);
                }
            }
        }
    }
    for (sums, acc) in sums.iter_mut().zip(acc) {
        for (c, acc) in acc.into_iter().enumerate() {
            // SAFETY: 16 lanes from 16 · c, within LANES.
            unsafe { _mm512_storeu_ps(sums.as_mut_ptr().add(16 * c), acc) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::quantize_block;
    use super::*;

    #[test]
    fn vector_quantization_gives_the_scalar_values() {
        if !super::super::Isa::Avx512Vnni.available() {
            return;
        }
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        // Random blocks at several magnitudes, a block of zeros, and ties: values that land
        // exactly halfway between two integers once scaled.
        let mut blocks: Vec<[f32; BLOCK]> = [1.0, 1e-3, 40.0, 1e4]
            .into_iter()
            .flat_map(|magnitude| (0..50).map(move |_| magnitude))
            .map(|magnitude| std::array::from_fn(|_| next() * magnitude))
            .collect();
        blocks.push([0.0; BLOCK]);
        blocks.push(std::array::from_fn(|i| if i == 0 { 32767.0 } else { i as f32 + 0.5 }));
        for block in blocks {
            let mut values = [0i16; BLOCK];
            let (scale, sum) = quantize_block(&block, &mut values);
            // SAFETY: the CPU has the features (checked above).
            let (pairs, vector_scale, vector_sum) = unsafe { quantize_pairs(&block) };
            let widened: Vec<i16> = pairs
                .iter()
                .flat_map(|pair| [*pair as i16, (*pair >> 16) as i16])
                .collect();
            assert_eq!(widened, values, "{block:?}");
            assert_eq!(
                (vector_scale.to_bits(), vector_sum.to_bits()),
                (scale.to_bits(), sum.to_bits())
            );
        }
    }
}
