// Kernels of the native encoders' CUDA forward, compiled at run time by NVRTC (no CUDA headers
// needed). Everything is f32 and row-major, laid out as the CPU encoders lay it out, so the two
// can be compared value by value. Launch shapes are set by `cuda/mod.rs`; products are cuBLAS.

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

// The activations `cuda/mod.rs` numbers: 0 none, 1 GELU (erf), 2 GELU (tanh), 3 quick GELU,
// 4 ReLU.
__device__ __forceinline__ float activate(float x, int act) {
    switch (act) {
        case 1: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        case 2: {
            const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            return 0.5f * x * (1.0f + tanhf(inner));
        }
        case 3: return x / (1.0f + expf(-1.702f * x));
        case 4: return fmaxf(x, 0.0f);
        default: return x;
    }
}

// ViT patches to rows: columns[(n·G + g), c·p·p + ky·p + kx] = pixels[n, c, gy·p + ky, gx·p + kx]
// for a `grid_h × grid_w` grid of `p`-pixel patches. One block per patch row.
extern "C" __global__ void im2col_patches(const float* pixels, float* columns, int height, int width, int patch,
                                          int grid_w, int patches) {
    const size_t row = blockIdx.x;
    const int n = row / patches, g = row % patches, gy = g / grid_w, gx = g % grid_w;
    const int len = 3 * patch * patch;
    const float* image = pixels + (size_t)n * 3 * height * width;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        const int c = i / (patch * patch), ky = (i / patch) % patch, kx = i % patch;
        columns[row * len + i] = image[(size_t)c * height * width + (size_t)(gy * patch + ky) * width + gx * patch + kx];
    }
}

// Token rows of each image: the class embedding first (when `has_class`), then its patch rows,
// each plus its position embedding. One block per token row.
extern "C" __global__ void assemble_tokens(const float* patches, const float* class_embedding,
                                           const float* positions, float* x, int patches_per_image, int len,
                                           int hidden, int has_class) {
    const size_t row = blockIdx.x;
    const int n = row / len, t = row % len;
    const float* source = (has_class && t == 0) ? class_embedding
                                                : patches + ((size_t)n * patches_per_image + t - has_class) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) x[row * hidden + i] = source[i] + positions[(size_t)t * hidden + i];
}

// LayerNorm over rows of `width` (two passes: mean, then variance); one block per row.
extern "C" __global__ void layer_norm(const float* x, const float* weight, const float* bias, float* out, int width,
                                      float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const float* in = x + row * width;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) sum += in[i];
    const float mean = block_reduce<Sum>(sum, scratch) / (float)width;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float d = in[i] - mean;
        squares += d * d;
    }
    const float inverse = rsqrtf(block_reduce<Sum>(squares, scratch) / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[row * width + i] = (in[i] - mean) * inverse * weight[i] + bias[i];
}

// x[r] = act(x[r] + bias) for every row (a null bias adds nothing); one block per row.
extern "C" __global__ void bias_act(float* x, const float* bias, int width, int act) {
    const size_t row = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = x[row * width + i] + (bias ? bias[i] : 0.0f);
        x[row * width + i] = activate(v, act);
    }
}

// Bidirectional attention over each item's `len` rows. `qkv` rows are [q | k | v], each `heads
// · head_dim` wide; out rows are `heads · head_dim`. One block per (query row, head): the
// scores of the row against every key sit in dynamic shared memory (`len` floats).
extern "C" __global__ void attention(const float* qkv, float* out, int len, int heads, int head_dim, float scale) {
    extern __shared__ float scores[];
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const int head = blockIdx.y;
    const size_t item_start = (row / len) * len;
    const int width = heads * head_dim;
    const float* q = qkv + row * 3 * width + head * head_dim;
    float local_max = NEG_INF;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float* k = qkv + (item_start + j) * 3 * width + width + head * head_dim;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; ++d) dot += q[d] * k[d];
        scores[j] = dot * scale;
        local_max = fmaxf(local_max, scores[j]);
    }
    const float max = block_reduce<Max>(local_max, scratch);
    float local_sum = 0.0f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        scores[j] = expf(scores[j] - max);
        local_sum += scores[j];
    }
    const float inverse = 1.0f / block_reduce<Sum>(local_sum, scratch);
    __syncthreads();
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < len; ++j) acc += scores[j] * qkv[(item_start + j) * 3 * width + 2 * width + head * head_dim + d];
        out[row * width + head * head_dim + d] = acc * inverse;
    }
}

// Attention in tiles (online softmax, as FlashAttention computes it) for heads of up to
// ATTENTION_MAX_HEAD_DIM dimensions: one block of 128 threads per (ATTENTION_TILE query rows,
// head, item), grid (⌈len / tile⌉, heads, items). Each tile of keys and values is read from
// global memory once per block, not once per query row as `attention` reads it, so long
// sequences (Whisper's 1,500 rows) stop being bound by those reads. Four threads own each query
// row: they keep its running max and sum, and a quarter of its output dimensions each. All
// shared memory is the launch's dynamic share: q and k tiles padded to head_dim + 1 columns
// (no bank conflicts), the v tile, and the tile of scores.
// (`tests/kernel_emulation.rs` runs this kernel on the CPU: it cuts it out between the
// `emulated:` lines.)
// emulated: begin
#define ATTENTION_TILE 32
#define ATTENTION_MAX_HEAD_DIM 96
extern "C" __global__ void attention_tiled(const float* qkv, float* out, int len, int heads, int head_dim,
                                           float scale) {
    extern __shared__ float tile_memory[];
    const int stride = head_dim + 1;
    float* q_tile = tile_memory;
    float* k_tile = q_tile + ATTENTION_TILE * stride;
    float* v_tile = k_tile + ATTENTION_TILE * stride;
    float* s_tile = v_tile + ATTENTION_TILE * head_dim;
    const int head = blockIdx.y, q0 = blockIdx.x * ATTENTION_TILE;
    const size_t item_start = (size_t)blockIdx.z * len;
    const int width = heads * head_dim;
    const size_t row_stride = 3 * (size_t)width;
    for (int i = threadIdx.x; i < ATTENTION_TILE * head_dim; i += blockDim.x) {
        const int r = i / head_dim, d = i % head_dim;
        q_tile[r * stride + d] = q0 + r < len ? qkv[(item_start + q0 + r) * row_stride + head * head_dim + d] : 0.0f;
    }
    const int own = threadIdx.x / 4, part = threadIdx.x % 4;
    float acc[ATTENTION_MAX_HEAD_DIM / 4];
#pragma unroll
    for (int k = 0; k < ATTENTION_MAX_HEAD_DIM / 4; ++k) acc[k] = 0.0f;
    float running_max = NEG_INF, running_sum = 0.0f;
    for (int k0 = 0; k0 < len; k0 += ATTENTION_TILE) {
        // The last tile's readers are done (and, the first time, the query tile is stored).
        __syncthreads();
        for (int i = threadIdx.x; i < ATTENTION_TILE * head_dim; i += blockDim.x) {
            const int r = i / head_dim, d = i % head_dim;
            const bool inside = k0 + r < len;
            const size_t at = (item_start + k0 + r) * row_stride + head * head_dim + d;
            k_tile[r * stride + d] = inside ? qkv[at + width] : 0.0f;
            v_tile[r * head_dim + d] = inside ? qkv[at + 2 * width] : 0.0f;
        }
        __syncthreads();
        {
            const int r = threadIdx.x % ATTENTION_TILE;
            for (int c = threadIdx.x / ATTENTION_TILE; c < ATTENTION_TILE; c += blockDim.x / ATTENTION_TILE) {
                float dot = 0.0f;
                for (int d = 0; d < head_dim; ++d) dot += q_tile[r * stride + d] * k_tile[c * stride + d];
                s_tile[r * (ATTENTION_TILE + 1) + c] = k0 + c < len ? dot * scale : NEG_INF;
            }
        }
        __syncthreads();
        const float* scores = s_tile + own * (ATTENTION_TILE + 1);
        float tile_max = NEG_INF;
        for (int c = 0; c < ATTENTION_TILE; ++c) tile_max = fmaxf(tile_max, scores[c]);
        // Key k0 is inside, so the new max is finite; the first tile's correction is exp(−inf) = 0.
        const float new_max = fmaxf(running_max, tile_max);
        const float correction = expf(running_max - new_max);
        running_sum *= correction;
#pragma unroll
        for (int k = 0; k < ATTENTION_MAX_HEAD_DIM / 4; ++k) acc[k] *= correction;
        for (int c = 0; c < ATTENTION_TILE; ++c) {
            const float p = expf(scores[c] - new_max);
            running_sum += p;
#pragma unroll
            for (int k = 0; k < ATTENTION_MAX_HEAD_DIM / 4; ++k) {
                const int d = part + 4 * k;
                if (d < head_dim) acc[k] += p * v_tile[c * head_dim + d];
            }
        }
        running_max = new_max;
    }
    if (q0 + own < len) {
        const float inverse = 1.0f / running_sum;
        float* o = out + (item_start + q0 + own) * width + head * head_dim;
#pragma unroll
        for (int k = 0; k < ATTENTION_MAX_HEAD_DIM / 4; ++k) {
            const int d = part + 4 * k;
            if (d < head_dim) o[d] = acc[k] * inverse;
        }
    }
}
// emulated: end

// Whisper's convolutions as products: columns[(n·out_len + t), c·3 + k] = x(n, c, t·stride + k − 1)
// (zero outside), kernel 3, padding 1. `x(n, c, t)` is read at `n·item_stride + c·channel_stride
// + t·time_stride`, so channel-major spectrograms and time-major rows both fit. One block per row.
extern "C" __global__ void im2col_conv1d(const float* x, float* columns, int channels, int in_len, int out_len,
                                         int stride, int item_stride, int channel_stride, int time_stride) {
    const size_t row = blockIdx.x;
    const int n = row / out_len, t = row % out_len;
    const int width = channels * 3;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const int c = i / 3, k = i % 3;
        const int source = t * stride + k - 1;
        columns[row * width + i] = (source < 0 || source >= in_len)
                                       ? 0.0f
                                       : x[(size_t)n * item_stride + (size_t)c * channel_stride + (size_t)source * time_stride];
    }
}

// x[n·len + t] += positions[t]; one block per row.
extern "C" __global__ void add_positions(float* x, const float* positions, int len, int width) {
    const size_t row = blockIdx.x;
    const int t = row % len;
    for (int i = threadIdx.x; i < width; i += blockDim.x) x[row * width + i] += positions[(size_t)t * width + i];
}

// The last `keep` of each item's `len` rows: out[n·keep + t] = in[n·len + len − keep + t]. One
// block per kept row.
extern "C" __global__ void keep_last_rows(const float* in, float* out, int len, int keep, int width) {
    const size_t row = blockIdx.x;
    const int n = row / keep, t = row % keep;
    const float* src = in + ((size_t)n * len + len - keep + t) * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[row * width + i] = src[i];
}
