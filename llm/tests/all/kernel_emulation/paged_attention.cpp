// Runs both paged-attention kernels (the second also split four ways over the keys and merged),
// over an f32 and an f16 cache (`src/cuda_kernels.cu` up to
// its `emulated: end` line, put into `kernel.inc` by `tests/kernel_emulation.rs`) on the CPU: every block's 128 threads are
// real threads, `__syncthreads` is a barrier among them, `__shfl_xor_sync` an exchange among a
// warp's 32 threads with a barrier of their own, and `__shared__` arrays are statics (blocks
// run one after another). Each case's output is compared with causal attention computed in f64
// over the same paged caches (the f16 one's values as rounded); the program prints the worst difference per kernel and case and
// exits 1 above 1e-4.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::barrier<>* warp_barriers[4];
static float exchange[128];

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() block_barrier->arrive_and_wait()

static float __int_as_float(unsigned bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

static float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const int t = threadIdx.x, warp = t / 32;
    exchange[t] = v;
    warp_barriers[warp]->arrive_and_wait();
    const float other = exchange[(t & ~31) | ((t % 32) ^ lane_mask)];
    warp_barriers[warp]->arrive_and_wait();
    return other;
}

// NVRTC's conversions (inline PTX there) as the host compiler does them: `_Float16` rounds to
// nearest even, as `cvt.rn.f16.f32` does.
static float widen(unsigned short h) {
    _Float16 f;
    std::memcpy(&f, &h, sizeof f);
    return float(f);
}

static unsigned short narrow(float v) {
    const _Float16 f = _Float16(v);
    unsigned short h;
    std::memcpy(&h, &f, sizeof h);
    return h;
}

using std::max;
using std::min;

#include "kernel.inc"

static std::vector<float> widened(const std::vector<unsigned short>& bits) {
    std::vector<float> values(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) values[i] = widen(bits[i]);
    return values;
}

struct Case {
    int heads, kv_heads, head_dim, block_size;
    std::vector<int> positions;  // one row per entry: its last position
};

int main() {
    // One position; several rows over one and several 128/512-key tiles with grouped-query
    // heads; the widest head the thread-per-key kernel takes; a head of 96 (groups leave
    // threads idle); a small head (many groups).
    const std::vector<Case> cases = {{2, 2, 64, 16, {0}},        {4, 2, 64, 4, {5, 130, 260}},
                                     {2, 1, 128, 16, {127, 128}}, {3, 3, 96, 8, {300, 1}},
                                     {1, 1, 32, 4, {600}}};
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    double worst = 0.0;
    for (const Case& c : cases) {
        const int rows = int(c.positions.size());
        const int q_width = c.heads * c.head_dim, kv_width = c.kv_heads * c.head_dim;
        const int max_blocks = 700 / c.block_size + 1, num_blocks = rows * max_blocks;
        std::vector<float> qkv(size_t(rows) * (q_width + 2 * kv_width));
        std::vector<float> keys(size_t(num_blocks) * c.block_size * kv_width), values(keys.size());
        for (auto& v : qkv) v = normal(rng);
        for (auto& v : keys) v = normal(rng);
        for (auto& v : values) v = normal(rng);
        // The f16 kernels read the caches rounded to f16; the expected attention is computed
        // over the rounded values, so both cases hold the kernels to the same bound.
        std::vector<unsigned short> keys_f16(keys.size()), values_f16(values.size());
        for (size_t i = 0; i < keys.size(); ++i) keys_f16[i] = narrow(keys[i]), values_f16[i] = narrow(values[i]);
        for (int half = 0; half < 2; ++half) {
            const std::vector<float> cache_keys = half ? widened(keys_f16) : keys;
            const std::vector<float> cache_values = half ? widened(values_f16) : values;
            // Each row its own sequence, its blocks scattered over the cache.
            std::vector<int> tables(size_t(rows) * max_blocks), sequence(rows);
            for (int i = 0; i < num_blocks; ++i) tables[i] = i;
            std::shuffle(tables.begin(), tables.end(), rng);
            for (int r = 0; r < rows; ++r) sequence[r] = r;
            const float scale = 1.0f / std::sqrt(float(c.head_dim));
            std::vector<double> expected(size_t(rows) * q_width);
            for (int r = 0; r < rows; ++r)
                for (int h = 0; h < c.heads; ++h) {
                    const int kv = h / (c.heads / c.kv_heads);
                    const float* q = &qkv[size_t(r) * (q_width + 2 * kv_width) + h * c.head_dim];
                    const int context = c.positions[r] + 1;
                    std::vector<double> scores(context);
                    double top = -INFINITY, sum = 0.0;
                    auto slot = [&](int pos) {
                        return size_t(tables[size_t(r) * max_blocks + pos / c.block_size]) * c.block_size +
                               pos % c.block_size;
                    };
                    for (int p = 0; p < context; ++p) {
                        double dot = 0.0;
                        for (int d = 0; d < c.head_dim; ++d)
                            dot += double(q[d]) * cache_keys[slot(p) * kv_width + kv * c.head_dim + d];
                        scores[p] = dot * scale;
                        top = std::max(top, scores[p]);
                    }
                    for (auto& s : scores) sum += (s = std::exp(s - top));
                    for (int d = 0; d < c.head_dim; ++d) {
                        double acc = 0.0;
                        for (int p = 0; p < context; ++p)
                            acc += scores[p] * cache_values[slot(p) * kv_width + kv * c.head_dim + d];
                        expected[size_t(r) * q_width + h * c.head_dim + d] = acc / sum;
                    }
                }
            // Kernel 2 is `paged_attention_by_key` split four ways over the keys (whole tiles a
            // split, so short contexts leave splits empty), merged by `combine_splits`.
            const int splits = 4;
            for (int kernel = 0; kernel < 3; ++kernel) {
                std::vector<float> out(size_t(rows) * q_width, NAN);
                std::vector<float> partial(size_t(rows) * c.heads * splits * (c.head_dim + 2), NAN);
                blockDim.x = 128;
                gridDim = {unsigned(rows), unsigned(c.heads), unsigned(kernel == 2 ? splits : 1)};
                for (int r = 0; r < rows; ++r)
                    for (int h = 0; h < c.heads; ++h)
                        for (unsigned z = 0; z < gridDim.z; ++z) {
                            blockIdx = {unsigned(r), unsigned(h), z};
                            std::barrier<> block(128), w0(32), w1(32), w2(32), w3(32);
                            block_barrier = &block;
                            warp_barriers[0] = &w0, warp_barriers[1] = &w1, warp_barriers[2] = &w2,
                            warp_barriers[3] = &w3;
                            std::vector<std::thread> threads;
                            for (unsigned t = 0; t < 128; ++t)
                                threads.emplace_back([&, t] {
                                    threadIdx.x = t;
                                    if (kernel == 0 && half) {
                                        paged_attention_f16(qkv.data(), keys_f16.data(), values_f16.data(),
                                                            tables.data(), sequence.data(), c.positions.data(),
                                                            out.data(), max_blocks, c.block_size, c.heads,
                                                            c.kv_heads, c.head_dim, scale);
                                    } else if (kernel == 0) {
                                        paged_attention(qkv.data(), keys.data(), values.data(), tables.data(),
                                                        sequence.data(), c.positions.data(), out.data(), max_blocks,
                                                        c.block_size, c.heads, c.kv_heads, c.head_dim, scale);
                                    } else if (half) {
                                        paged_attention_by_key_f16(qkv.data(), keys_f16.data(), values_f16.data(),
                                                                   tables.data(), sequence.data(), c.positions.data(),
                                                                   out.data(), partial.data(), max_blocks,
                                                                   c.block_size, c.heads, c.kv_heads, c.head_dim,
                                                                   scale);
                                    } else {
                                        paged_attention_by_key(qkv.data(), keys.data(), values.data(), tables.data(),
                                                               sequence.data(), c.positions.data(), out.data(),
                                                               partial.data(), max_blocks, c.block_size, c.heads,
                                                               c.kv_heads, c.head_dim, scale);
                                    }
                                });
                            for (auto& thread : threads) thread.join();
                        }
                if (kernel == 2) {
                    // No barriers in the merge: its threads run one after another.
                    for (int r = 0; r < rows; ++r)
                        for (int h = 0; h < c.heads; ++h) {
                            blockIdx = {unsigned(r), unsigned(h), 0};
                            for (int t = 0; t < c.head_dim; ++t) {
                                threadIdx.x = unsigned(t);
                                combine_splits(partial.data(), out.data(), c.heads, c.head_dim, splits);
                            }
                        }
                }
                double difference = 0.0;
                for (size_t i = 0; i < out.size(); ++i) {
                    const double d = std::fabs(double(out[i]) - expected[i]);
                    difference = std::isnan(d) ? INFINITY : std::max(difference, d);
                }
                std::printf("%s%s%s: %d rows, heads %d/%d, head_dim %d: max |difference| %.3g\n",
                            kernel == 0 ? "paged_attention" : "paged_attention_by_key", half ? "_f16" : "",
                            kernel == 2 ? ", 4 splits" : "", rows,
                            c.heads, c.kv_heads, c.head_dim, difference);
                worst = std::max(worst, difference);
            }
        }
    }
    return worst <= 1e-4 ? 0 : 1;
}
