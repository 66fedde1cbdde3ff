//! Decode attention on AVX-512, for head sizes of 64 and 128 (the common ones).
//!
//! The portable loops ([`super::PagedKv::attend_one`]) spend more instructions around their
//! products than in them: each score is a dot product that ends in a horizontal sum, and each
//! weighted value row is added into an output row that goes back to memory for the next
//! position. Here a query head is held in registers while it meets every key row, and a head's
//! output row stays in registers (four or eight vectors) while every position's value row is
//! added in with one FMA a vector; an f16 cache is widened in the load itself (`vcvtph2ps`),
//! so it costs what an f32 one does in arithmetic and reads half the bytes. The results differ
//! from the portable loops' only in the order of their additions.

use std::arch::x86_64::*;

use super::{DecodeQuery, PagedKv, Rows, softmax};

/// Whether this CPU has what [`attend_one`] needs.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// [`super::PagedKv::attend_one`] for `query`, or `false` (nothing written) where its head
/// size is not one this module handles.
///
/// # Safety
///
/// The CPU must have AVX-512 F, FMA and F16C ([`available`]).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn attend_one(kv: &PagedKv, query: &DecodeQuery<'_>, out: &mut [f32]) -> bool {
    let (keys, values) = (&kv.keys[query.layer], &kv.values[query.layer]);
    // SAFETY (each arm): the caller's contract; the storage matches the type it is read as.
    unsafe {
        match (query.dim, keys, values) {
            (64, Rows::F32(k), Rows::F32(v)) => {
                attend::<4, false>(kv, k.as_ptr().cast(), v.as_ptr().cast(), k.len(), query, out)
            }
            (128, Rows::F32(k), Rows::F32(v)) => {
                attend::<8, false>(kv, k.as_ptr().cast(), v.as_ptr().cast(), k.len(), query, out)
            }
            (64, Rows::F16(k), Rows::F16(v)) => {
                attend::<4, true>(kv, k.as_ptr().cast(), v.as_ptr().cast(), k.len(), query, out)
            }
            (128, Rows::F16(k), Rows::F16(v)) => {
                attend::<8, true>(kv, k.as_ptr().cast(), v.as_ptr().cast(), k.len(), query, out)
            }
            _ => return false,
        }
    }
    true
}

/// 16 stored values from value offset `at` of a layer's rows, as f32 (`HALF`: f16 bit patterns).
///
/// # Safety
///
/// As [`attend_one`], and the 16 values must lie within the rows `base` points to.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn load16<const HALF: bool>(base: *const u8, at: usize) -> __m512 {
    // SAFETY: the caller's contract; unaligned loads.
    unsafe {
        if HALF {
            _mm512_cvtph_ps(_mm256_loadu_si256(base.cast::<u16>().add(at).cast()))
        } else {
            _mm512_loadu_ps(base.cast::<f32>().add(at))
        }
    }
}

/// The attention of `query` over its positions for heads of `16 · C` values, reading keys and
/// values of `len` stored values each from `keys` and `values`.
///
/// # Safety
///
/// As [`attend_one`], and `keys` and `values` must point to `len` values of the layer's rows.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend<const C: usize, const HALF: bool>(
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
    assert!(heads.div_ceil(group) * dim <= width && dim == 16 * C);
    let mut scores = vec![0.0f32; heads * context];
    // Position by position, every head: each row of keys and values is read once, front to
    // back, as the rows lie in their block (the cache's bytes, not its arithmetic, bound this
    // on a batch's contexts, and the hardware prefetches a stream best).
    for &(first, at, span) in &spans {
        for p in 0..span / width {
            let row = at + p * width;
            for head in 0..heads {
                let key = row + (head / group) * dim;
                let q = query[head * dim..].as_ptr();
                // SAFETY: the key head's values lie within the span's rows, the query head's
                // within `query` (asserted above).
                let mut sum = unsafe { _mm512_mul_ps(_mm512_loadu_ps(q), load16::<HALF>(keys, key)) };
                for c in 1..C {
                    sum = unsafe {
                        _mm512_fmadd_ps(_mm512_loadu_ps(q.add(16 * c)), load16::<HALF>(keys, key + 16 * c), sum)
                    };
                }
                scores[head * context + first + p] = _mm512_reduce_add_ps(sum) * scale;
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
                let weight = _mm512_set1_ps(scores[head * context + first + p]);
                for c in 0..C {
                    // SAFETY: the value head's values lie within the span's rows, the head's
                    // output row within `out` (asserted above).
                    unsafe {
                        let at = sums.add(head * dim + 16 * c);
                        _mm512_storeu_ps(
                            at,
                            _mm512_fmadd_ps(weight, load16::<HALF>(values, value + 16 * c), _mm512_loadu_ps(at)),
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
    fn the_avx512_decode_attention_gives_the_portable_loops_results() {
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
        // Head sizes 64 and 128, grouped and not; contexts that end inside a block, at its end,
        // and in one position; blocks listed out of order.
        for (head_dim, heads, kv_heads) in [(64, 9, 3), (128, 4, 4), (64, 2, 1)] {
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
                    kv.attend_one_with(&query, &mut portable);
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
        // A head size this module does not take is left to the portable loops.
        let config = config(32, 2, 2);
        let kv = PagedKv::new(&config, 16, 2);
        let query = vec![0.5f32; 64];
        let query = DecodeQuery {
            layer: 0,
            blocks: &[0],
            context: 3,
            heads: 2,
            group: 1,
            dim: 32,
            scale: 0.1,
            values: &query,
        };
        // SAFETY: as above.
        assert!(!unsafe { attend_one(&kv, &query, &mut [0.0; 64]) });
    }
}
