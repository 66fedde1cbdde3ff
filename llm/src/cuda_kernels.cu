// Kernels of the native LLM's CUDA backend, compiled at run time by NVRTC (no CUDA headers
// needed). Everything is f32 (the KV cache also f16) and row-major, laid out exactly as the CPU
// backend lays it out, so the two can be compared value by value. Launch shapes are set by
// `cuda.rs`.

#define WARP 32
// No CUDA headers under NVRTC, so no INFINITY macro.
#define NEG_INF __int_as_float(0xff800000)

struct Sum {
    __device__ static float identity() { return 0.0f; }
    __device__ static float apply(float a, float b) { return a + b; }
};

struct Max {
    __device__ static float identity() { return NEG_INF; }
    __device__ static float apply(float a, float b) { return fmaxf(a, b); }
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reduction; `scratch` holds one float per warp. Every thread gets the result.
template <typename Op>
__device__ float block_reduce(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
    v = warp_reduce<Op>(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float result = Op::identity();
    for (int w = 0; w < warps; ++w) result = Op::apply(result, scratch[w]);
    return result;
}

// The paged cache holds f32 as computed, or f16 bit patterns (`--kv-cache-dtype f16`), rounded
// to nearest even on the way in as the CPU backend's are, and widened as they are read. Each
// kernel that touches the cache is a template over its element, with an `extern "C"` entry per
// element (`_f16` names the f16 one).
#ifdef __CUDACC_RTC__
__device__ __forceinline__ float widen(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short narrow(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif
__device__ __forceinline__ float load_cache(const float* p) { return *p; }
__device__ __forceinline__ float load_cache(const unsigned short* p) { return widen(*p); }
__device__ __forceinline__ void store_cache(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_cache(unsigned short* p, float v) { *p = narrow(v); }

// out[r] = table[ids[r]]; one block per row.
extern "C" __global__ void embed(const unsigned int* ids, const float* table, float* out, int width) {
    const size_t row = blockIdx.x;
    const float* src = table + (size_t)ids[row] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[row * width + i] = src[i];
}

// out[r] = in[rows[r]]; one block per gathered row.
extern "C" __global__ void gather_rows(const float* in, const int* rows, float* out, int width) {
    const size_t r = blockIdx.x;
    const float* src = in + (size_t)rows[r] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[r * width + i] = src[i];
}

// out = x / sqrt(mean(x²) + eps) · weight, row by row; one block per row.
extern "C" __global__ void rms_norm(const float* x, const float* weight, float* out, int width, float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const float* in = x + row * width;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) sum += in[i] * in[i];
    sum = block_reduce<Sum>(sum, scratch);
    const float inverse = 1.0f / sqrtf(sum / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[row * width + i] = in[i] * inverse * weight[i];
}

// x[r] += bias, for every row; one block per row.
extern "C" __global__ void add_bias(float* x, const float* bias, int width) {
    const size_t row = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x) x[row * width + i] += bias[i];
}

// Rotates the query and key heads of each row of `qkv` ([rows, q | k | v]) by the row's
// position (rotate-half layout: pairs (i, i + d/2)), rotates the queries in place, and writes
// the rotated keys and the values into the caches at the row's slot. One block per row.
template <typename Cache>
__device__ void rope_and_store_into(float* qkv, const int* positions, const int* slots, const float* inv_freq,
                                    Cache* key_cache, Cache* value_cache, int num_heads, int num_kv_heads,
                                    int head_dim) {
    const size_t row = blockIdx.x;
    const int half = head_dim / 2;
    const int q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    float* q = qkv + row * (size_t)(q_width + 2 * kv_width);
    const float* k = q + q_width;
    const float* v = k + kv_width;
    const float position = (float)positions[row];
    Cache* key = key_cache + (size_t)slots[row] * kv_width;
    Cache* value = value_cache + (size_t)slots[row] * kv_width;
    for (int pair = threadIdx.x; pair < (num_heads + num_kv_heads) * half; pair += blockDim.x) {
        const int head = pair / half, i = pair % half;
        float s, c;
        sincosf(position * inv_freq[i], &s, &c);
        if (head < num_heads) {
            float* h = q + head * head_dim;
            const float a = h[i], b = h[i + half];
            h[i] = a * c - b * s;
            h[i + half] = b * c + a * s;
        } else {
            const int kv = head - num_heads;
            const float* h = k + kv * head_dim;
            const float a = h[i], b = h[i + half];
            store_cache(&key[kv * head_dim + i], a * c - b * s);
            store_cache(&key[kv * head_dim + i + half], b * c + a * s);
        }
    }
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) store_cache(&value[i], v[i]);
}

extern "C" __global__ void rope_and_store(float* qkv, const int* positions, const int* slots, const float* inv_freq,
                                          float* key_cache, float* value_cache, int num_heads, int num_kv_heads,
                                          int head_dim) {
    rope_and_store_into(qkv, positions, slots, inv_freq, key_cache, value_cache, num_heads, num_kv_heads, head_dim);
}

extern "C" __global__ void rope_and_store_f16(float* qkv, const int* positions, const int* slots,
                                              const float* inv_freq, unsigned short* key_cache,
                                              unsigned short* value_cache, int num_heads, int num_kv_heads,
                                              int head_dim) {
    rope_and_store_into(qkv, positions, slots, inv_freq, key_cache, value_cache, num_heads, num_kv_heads, head_dim);
}

#define TILE 512

// Causal attention of one query row and one head over its sequence's paged keys and values
// (positions 0..=positions[row]), with a running (online) softmax over tiles of positions.
// Grid (rows, num_heads); 128 threads; head_dim ≤ 512.
template <typename Cache>
__device__ void paged_attention_over(const float* qkv, const Cache* key_cache, const Cache* value_cache,
                                     const int* block_tables, const int* row_sequence, const int* positions,
                                     float* out, int max_blocks, int block_size, int num_heads, int num_kv_heads,
                                     int head_dim, float scale) {
    __shared__ float scores[TILE];
    __shared__ int tile_slots[TILE];
    __shared__ float query[512];
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const int head = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    const int context = positions[row] + 1;
    const int* table = block_tables + (size_t)row_sequence[row] * max_blocks;
    const float* q = qkv + row * (size_t)(q_width + 2 * kv_width) + head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) query[d] = q[d];
    __syncthreads();
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    float running_max = NEG_INF, running_sum = 0.0f;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int start = 0; start < context; start += TILE) {
        const int n = min(TILE, context - start);
        for (int t = threadIdx.x; t < n; t += blockDim.x) {
            const int pos = start + t;
            tile_slots[t] = table[pos / block_size] * block_size + pos % block_size;
        }
        __syncthreads();
        for (int t = warp; t < n; t += warps) {
            const Cache* key = key_cache + (size_t)tile_slots[t] * kv_width + kv_head * head_dim;
            float dot = 0.0f;
            for (int d = lane; d < head_dim; d += WARP) dot += query[d] * load_cache(&key[d]);
            dot = warp_reduce<Sum>(dot);
            if (lane == 0) scores[t] = dot * scale;
        }
        __syncthreads();
        float tile_max = NEG_INF;
        for (int t = threadIdx.x; t < n; t += blockDim.x) tile_max = fmaxf(tile_max, scores[t]);
        tile_max = block_reduce<Max>(tile_max, scratch);
        const float new_max = fmaxf(running_max, tile_max);
        const float correction = expf(running_max - new_max);
        __syncthreads();
        float tile_sum = 0.0f;
        for (int t = threadIdx.x; t < n; t += blockDim.x) {
            const float p = expf(scores[t] - new_max);
            scores[t] = p;
            tile_sum += p;
        }
        tile_sum = block_reduce<Sum>(tile_sum, scratch);
        running_sum = running_sum * correction + tile_sum;
        for (int j = 0; j < 4; ++j) {
            const int d = threadIdx.x + j * blockDim.x;
            if (d < head_dim) {
                float a = acc[j] * correction;
                for (int t = 0; t < n; ++t)
                    a += scores[t] * load_cache(&value_cache[(size_t)tile_slots[t] * kv_width + kv_head * head_dim + d]);
                acc[j] = a;
            }
        }
        running_max = new_max;
        __syncthreads();
    }
    float* o = out + row * (size_t)q_width + head * head_dim;
    for (int j = 0; j < 4; ++j) {
        const int d = threadIdx.x + j * blockDim.x;
        if (d < head_dim) o[d] = acc[j] / running_sum;
    }
}

extern "C" __global__ void paged_attention(const float* qkv, const float* key_cache, const float* value_cache,
                                           const int* block_tables, const int* row_sequence, const int* positions,
                                           float* out, int max_blocks, int block_size, int num_heads,
                                           int num_kv_heads, int head_dim, float scale) {
    paged_attention_over(qkv, key_cache, value_cache, block_tables, row_sequence, positions, out, max_blocks,
                         block_size, num_heads, num_kv_heads, head_dim, scale);
}

extern "C" __global__ void paged_attention_f16(const float* qkv, const unsigned short* key_cache,
                                               const unsigned short* value_cache, const int* block_tables,
                                               const int* row_sequence, const int* positions, float* out,
                                               int max_blocks, int block_size, int num_heads, int num_kv_heads,
                                               int head_dim, float scale) {
    paged_attention_over(qkv, key_cache, value_cache, block_tables, row_sequence, positions, out, max_blocks,
                         block_size, num_heads, num_kv_heads, head_dim, scale);
}

#define KEY_TILE 128

// The same attention as `paged_attention`, laid out for decode steps, where a step has few rows
// and the kernel above is bound by the latency of its reads: there a warp takes one key at a
// time (a dependent load and a reduction per key) and 64 threads walk every value in turn.
// Here each of the 128 threads scores a key of its own (its loads independent of the others'),
// and the values are summed by `128 / head_dim` groups of threads, each over its share of the
// tile's keys, their partial sums combined at the end. Grid (rows, num_heads, splits); 128
// threads; head_dim ≤ 128. With one split a block writes its row's head to `out`; with more
// (flash-decoding: a step of few rows has too few blocks to keep the GPU's multiprocessors
// busy, and each block walks its whole context alone), split `z` takes its share of the keys,
// whole tiles of them, and writes to `partial` its unnormalized values, their max score and
// their sum of weights, which `combine_splits` merges.
#define PARTIAL_WIDTH(head_dim) ((head_dim) + 2)
template <typename Cache>
__device__ void paged_attention_by_key_over(const float* qkv, const Cache* key_cache, const Cache* value_cache,
                                            const int* block_tables, const int* row_sequence, const int* positions,
                                            float* out, float* partial, int max_blocks, int block_size,
                                            int num_heads, int num_kv_heads, int head_dim, float scale) {
    __shared__ float scores[KEY_TILE];
    __shared__ int tile_slots[KEY_TILE];
    __shared__ float query[128];
    __shared__ float group_sums[128];
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const int head = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    const int context = positions[row] + 1;
    const int* table = block_tables + (size_t)row_sequence[row] * max_blocks;
    const float* q = qkv + row * (size_t)(q_width + 2 * kv_width) + head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) query[d] = q[d];
    __syncthreads();
    // Value dimension `d` of group `g`: the groups split each tile's keys between them.
    const int groups = blockDim.x / head_dim;
    const int d = threadIdx.x % head_dim, g = threadIdx.x / head_dim;
    float running_max = NEG_INF, running_sum = 0.0f, acc = 0.0f;
    // This split's keys: whole tiles, so a short context leaves the last splits none.
    const int splits = gridDim.z, split = blockIdx.z;
    const int share = (context + splits - 1) / splits;
    const int chunk = (share + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    const int first = min(context, split * chunk), end = min(context, first + chunk);
    for (int start = first; start < end; start += KEY_TILE) {
        const int n = min(KEY_TILE, end - start);
        const int t = threadIdx.x;
        float score = NEG_INF;
        if (t < n) {
            const int pos = start + t;
            const int slot = table[pos / block_size] * block_size + pos % block_size;
            tile_slots[t] = slot;
            const Cache* key = key_cache + (size_t)slot * kv_width + kv_head * head_dim;
            float dot = 0.0f;
#pragma unroll 8
            for (int k = 0; k < head_dim; ++k) dot += query[k] * load_cache(&key[k]);
            score = dot * scale;
        }
        // Key `start` is inside, so the new max is finite; the first tile's correction is
        // exp(−inf) = 0.
        const float tile_max = block_reduce<Max>(score, scratch);
        const float new_max = fmaxf(running_max, tile_max);
        const float correction = expf(running_max - new_max);
        const float p = t < n ? expf(score - new_max) : 0.0f;
        scores[t] = p;
        // Its barriers also publish `scores` and `tile_slots` to the value loop.
        const float tile_sum = block_reduce<Sum>(p, scratch);
        running_sum = running_sum * correction + tile_sum;
        acc *= correction;
        if (g < groups) {
            float a = 0.0f;
#pragma unroll 4
            for (int k = g; k < n; k += groups)
                a += scores[k] * load_cache(&value_cache[(size_t)tile_slots[k] * kv_width + kv_head * head_dim + d]);
            acc += a;
        }
        running_max = new_max;
        __syncthreads();
    }
    group_sums[threadIdx.x] = g < groups ? acc : 0.0f;
    __syncthreads();
    if (g == 0) {
        float sum = 0.0f;
        for (int k = 0; k < groups; ++k) sum += group_sums[k * head_dim + d];
        if (splits == 1) {
            out[row * (size_t)q_width + head * head_dim + d] = sum / running_sum;
        } else {
            float* mine = partial + ((row * num_heads + head) * (size_t)splits + split) * PARTIAL_WIDTH(head_dim);
            mine[d] = sum;
            if (d == 0) {
                mine[head_dim] = running_max;
                mine[head_dim + 1] = running_sum;
            }
        }
    }
}

extern "C" __global__ void paged_attention_by_key(const float* qkv, const float* key_cache,
                                                  const float* value_cache, const int* block_tables,
                                                  const int* row_sequence, const int* positions, float* out,
                                                  float* partial, int max_blocks, int block_size, int num_heads,
                                                  int num_kv_heads, int head_dim, float scale) {
    paged_attention_by_key_over(qkv, key_cache, value_cache, block_tables, row_sequence, positions, out, partial,
                                max_blocks, block_size, num_heads, num_kv_heads, head_dim, scale);
}

extern "C" __global__ void paged_attention_by_key_f16(const float* qkv, const unsigned short* key_cache,
                                                      const unsigned short* value_cache, const int* block_tables,
                                                      const int* row_sequence, const int* positions, float* out,
                                                      float* partial, int max_blocks, int block_size, int num_heads,
                                                      int num_kv_heads, int head_dim, float scale) {
    paged_attention_by_key_over(qkv, key_cache, value_cache, block_tables, row_sequence, positions, out, partial,
                                max_blocks, block_size, num_heads, num_kv_heads, head_dim, scale);
}

// Merges the `splits` partial results `paged_attention_by_key` wrote for each row and head:
// each split's values and sum of weights rescaled from its max score to the largest, summed,
// and divided. A split without keys has max −inf and weighs nothing. Grid (rows, num_heads);
// head_dim threads.
extern "C" __global__ void combine_splits(const float* partial, float* out, int num_heads, int head_dim,
                                          int splits) {
    const size_t row = blockIdx.x;
    const int head = blockIdx.y, d = threadIdx.x;
    const float* first = partial + (row * num_heads + head) * (size_t)splits * PARTIAL_WIDTH(head_dim);
    float top = NEG_INF;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, first[s * PARTIAL_WIDTH(head_dim) + head_dim]);
    float value = 0.0f, weight = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float* split = first + s * PARTIAL_WIDTH(head_dim);
        const float factor = expf(split[head_dim] - top);
        value += split[d] * factor;
        weight += split[head_dim + 1] * factor;
    }
    out[row * (size_t)(num_heads * head_dim) + head * head_dim + d] = value / weight;
}

// emulated: end (`tests/kernel_emulation.rs` runs the kernels above on the CPU)

// out[r, i] = silu(gate_up[r, i]) · gate_up[r, width + i]; one block per row.
extern "C" __global__ void silu_mul(const float* gate_up, float* out, int width) {
    const size_t row = blockIdx.x;
    const float* g = gate_up + row * 2 * (size_t)width;
    const float* u = g + width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float x = g[i];
        out[row * width + i] = x / (1.0f + expf(-x)) * u[i];
    }
}

// The index of each row's largest finite logit, the first of equals (greedy sampling).
// One block of 256 threads per row; out[row] = vocab when no logit is finite.
extern "C" __global__ void argmax(const float* logits, int vocab, unsigned int* out) {
    __shared__ float best_value[256];
    __shared__ int best_index[256];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float value = NEG_INF;
    int index = vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (isfinite(v) && (v > value || index == vocab)) {
            value = v;
            index = i;
        }
    }
    best_value[threadIdx.x] = value;
    best_index[threadIdx.x] = index;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float v = best_value[threadIdx.x + stride];
            const int i = best_index[threadIdx.x + stride];
            const bool better = i != vocab && (best_index[threadIdx.x] == vocab || v > best_value[threadIdx.x] ||
                                               (v == best_value[threadIdx.x] && i < best_index[threadIdx.x]));
            if (better) {
                best_value[threadIdx.x] = v;
                best_index[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned int)best_index[0];
}
