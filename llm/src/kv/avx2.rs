//! Decode attention on AVX2 with FMA and F16C (x86-64-v3: every x86 server CPU of the last
//! decade), for heads whose size is a multiple of 8.
//!
//! The portable loops ([`super::PagedKv::attend_one`]) compile to vectors without FMA and widen
//! an f16 cache a block at a time into a buffer before reading it again. Here every product is
//! an FMA, each score one horizontal sum, and an f16 value is widened in the load itself
//! (`vcvtph2ps`), so an f16 cache costs what an f32 one does in arithmetic and reads half the
//! bytes, which is what bounds decode attention over a batch's contexts. Keys and values are
//! read position by position, each row once, front to back as it lies in its block (the order
//! the hardware prefetches best), every head taking its part. The results differ from the
//! portable loops' only in the order of their additions.
//!
//! # Rejected designs
//!
//! - AVX-512's wider vectors: no faster, as the loops wait on memory, not on arithmetic.
//!   SmolLM2's batch-8 decode at a 1,024-token context made 227–233 tok/s with them and
//!   222–229 with these in f16, 190–194 and 207–209 in f32.

use std::arch::x86_64::*;

use super::{DecodeQuery, PagedKv, Rows, softmax};

/// Values a vector holds.
const WIDTH: usize = 8;

/// Whether this CPU has what [`attend_one`] needs.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// [`super::PagedKv::attend_one`] for `query`, or `false` (nothing written) where the head size
/// is not a multiple of 8.
///
/// # Safety
///
/// The CPU must have AVX2, FMA and F16C ([`available`]).
pub(super) unsafe fn attend_one(kv: &PagedKv, query: &DecodeQuery<'_>, out: &mut [f32]) -> bool {
    if query.dim == 0 || !query.dim.is_multiple_of(WIDTH) {
        return false;
    }
    // SAFETY (each arm): the caller's contract; the storage is read as the type it holds.
    unsafe {
        match (&kv.keys[query.layer], &kv.values[query.layer]) {
            (Rows::F32(k), Rows::F32(v)) => attend::<false>(
                kv,
                k.as_ptr().cast(),
                v.as_ptr().cast(),
                k.len().min(v.len()),
                query,
                out,
            ),
            (Rows::F16(k), Rows::F16(v)) => attend::<true>(
                kv,
                k.as_ptr().cast(),
                v.as_ptr().cast(),
                k.len().min(v.len()),
                query,
                out,
            ),
            _ => return false,
        }
    }
    true
}

/// 8 stored values from value offset `at` of a layer's rows, as f32 (`HALF`: f16 bit patterns).
///
/// # Safety
///
/// As [`attend_one`], and the 8 values must lie within the rows `base` points to.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load<const HALF: bool>(base: *const u8, at: usize) -> __m256 {
    // SAFETY: the caller's contract; unaligned loads.
    unsafe {
        if HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(base.cast::<u16>().add(at).cast()))
        } else {
            _mm256_loadu_ps(base.cast::<f32>().add(at))
        }
    }
}

/// The sum of `v`'s lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum(v: __m256) -> f32 {
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
}

/// The attention of `query` over its positions, reading keys and values of `len` stored values
/// each from `keys` and `values`.
///
/// # Safety
///
/// As [`attend_one`], and `keys` and `values` must point to `len` values of the layer's rows,
/// f16 bit patterns where `HALF`, else f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend<const HALF: bool>(
    kv: &PagedKv,
    keys: *const u8,
    values: *const u8,
    len: usize,
    query: &DecodeQuery<'_>,
    out: &mut [f32],
) {
    let DecodeQuery {
        blocks,
        context,
        heads,
        group,
        dim,
        scale,
        values: query,
        ..
    } = *query;
    let width = kv.kv_width;
    let spans = kv.spans(blocks, context);
    // Every read below stays in bounds: the spans' rows within the layer's, each head's query
    // and output rows within theirs, and each key/value head within a row.
    assert!(spans.iter().all(|&(_, at, span)| at + span <= len));
    assert!(query.len() >= heads * dim && out.len() >= heads * dim && group > 0);
    assert!(heads.div_ceil(group) * dim <= width && dim.is_multiple_of(WIDTH));
    let mut scores = vec![0.0f32; heads * context];
    for &(first, at, span) in &spans {
        for p in 0..span / width {
            let row = at + p * width;
            for head in 0..heads {
                let key = row + (head / group) * dim;
                let q = query[head * dim..].as_ptr();
                let mut dot = _mm256_setzero_ps();
                for c in (0..dim).step_by(WIDTH) {
                    // SAFETY: the key head's values lie within the span's rows, the query
                    // head's within `query` (asserted above).
                    dot = unsafe { _mm256_fmadd_ps(_mm256_loadu_ps(q.add(c)), load::<HALF>(keys, key + c), dot) };
                }
                scores[head * context + first + p] = sum(dot) * scale;
            }
        }
    }
    for row in scores.chunks_exact_mut(context.max(1)) {
        softmax(row);
    }
    let out = &mut out[..heads * dim];
    out.fill(0.0);
    let sums = out.as_mut_ptr();
    for &(first, at, span) in &spans {
        for p in 0..span / width {
            let row = at + p * width;
            for head in 0..heads {
                let value = row + (head / group) * dim;
                let weight = _mm256_set1_ps(scores[head * context + first + p]);
                for c in (0..dim).step_by(WIDTH) {
                    // SAFETY: the value head's values lie within the span's rows, the head's
                    // output row within `out` (asserted above).
                    unsafe {
                        let sum = sums.add(head * dim + c);
                        _mm256_storeu_ps(
                            sum,
                            _mm256_fmadd_ps(weight, load::<HALF>(values, value + c), _mm256_loadu_ps(sum)),
                        );
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::KvPrecision;
    use super::*;
    use crate::config::{ModelConfig, RopeScaling};

    fn config(head_dim: usize, heads: usize, kv_heads: usize) -> ModelConfig {
        ModelConfig {
            model_type: "llama".into(),
            hidden_size: heads * head_dim,
            intermediate_size: 4 * heads * head_dim,
            num_layers: 2,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            vocab_size: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            attention_bias: false,
            tie_word_embeddings: true,
            max_position_embeddings: 4096,
            eos_token_ids: Vec::new(),
        }
    }

    #[test]
    fn the_avx2_kernel_gives_the_portable_loops_results() {
        if !available() {
            return;
        }
        let mut state = 11u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        // Head sizes 64, 128 and 40, grouped and not; contexts that end inside a block, at its end,
        // and in one position; blocks listed out of order.
        for (head_dim, heads, kv_heads) in [(64, 9, 3), (128, 4, 4), (64, 2, 1), (40, 4, 2)] {
            for precision in [KvPrecision::F32, KvPrecision::F16] {
                let config = config(head_dim, heads, kv_heads);
                let block_size = 16;
                let mut kv = PagedKv::with_precision(&config, block_size, 8, precision);
                let blocks = [5u32, 2, 7, 0, 3];
                let width = kv_heads * head_dim;
                for layer in 0..config.num_layers {
                    for position in 0..blocks.len() * block_size {
                        // Keys at a few times the queries' size, as RoPE'd keys are: the
                        // softmax is far from uniform.
                        let key: Vec<f32> = (0..width).map(|_| 3.0 * next()).collect();
                        let value: Vec<f32> = (0..width).map(|_| next()).collect();
                        kv.write(layer, &blocks, position, &key, &value);
                    }
                }
                let query: Vec<f32> = (0..heads * head_dim).map(|_| next()).collect();
                for context in [1, 15, 16, 17, 80] {
                    let query = DecodeQuery {
                        layer: 1,
                        blocks: &blocks,
                        context,
                        heads,
                        group: heads / kv_heads,
                        dim: head_dim,
                        scale: 1.0 / (head_dim as f32).sqrt(),
                        values: &query,
                    };
                    let mut portable = vec![0.0f32; heads * head_dim];
                    kv.attend_portable(&query, &mut portable);
                    let mut vector = vec![f32::NAN; heads * head_dim];
                    // SAFETY: the CPU has the features (checked above).
                    assert!(unsafe { attend_one(&kv, &query, &mut vector) });
                    let largest = portable.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let worst = portable
                        .iter()
                        .zip(&vector)
                        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        worst <= 1e-5 * largest.max(1.0),
                        "{precision} head_dim {head_dim} heads {heads}/{kv_heads} context {context}: \
                         off by {worst} (largest {largest})"
                    );
                }
            }
        }
        // A head size that is not a multiple of 8 is left to the portable loops.
        let config = config(12, 2, 2);
        let kv = PagedKv::new(&config, 16, 2);
        let query = vec![0.5f32; 24];
        let query = DecodeQuery {
            layer: 0,
            blocks: &[0],
            context: 3,
            heads: 2,
            group: 1,
            dim: 12,
            scale: 0.1,
            values: &query,
        };
        // SAFETY: as above.
        assert!(!unsafe { attend_one(&kv, &query, &mut [0.0; 24]) });
    }
}
