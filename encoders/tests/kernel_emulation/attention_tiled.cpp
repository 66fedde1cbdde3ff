// Runs `attention_tiled` (cut out of `src/cuda/kernels.cu` by `tests/kernel_emulation.rs` into
// `kernel.inc`) on the CPU: every block's 128 threads are real threads, `__syncthreads` is a
// barrier among them, and the launch's dynamic shared memory is one buffer per block. Each
// shape's output is compared with attention computed in f64 the plain way (scores, softmax,
// weighted values); the program prints the worst difference per shape and exits 1 above 1e-4.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim;
static std::barrier<>* block_barrier;
static float* dynamic_shared;

#define __global__
#define __syncthreads() block_barrier->arrive_and_wait()
#define NEG_INF (-INFINITY)

#include "kernel.inc"

static void launch(const float* qkv, float* out, int items, int len, int heads, int head_dim, float scale) {
    const int tile = ATTENTION_TILE;
    std::vector<float> shared(2 * tile * (head_dim + 1) + tile * head_dim + tile * (tile + 1));
    dynamic_shared = shared.data();
    blockDim.x = 128;
    for (int z = 0; z < items; ++z)
        for (int y = 0; y < heads; ++y)
            for (int x = 0; x < (len + tile - 1) / tile; ++x) {
                blockIdx = {unsigned(x), unsigned(y), unsigned(z)};
                std::fill(shared.begin(), shared.end(), NAN);
                std::barrier<> barrier(128);
                block_barrier = &barrier;
                std::vector<std::thread> threads;
                for (unsigned t = 0; t < 128; ++t)
                    threads.emplace_back([=] {
                        threadIdx.x = t;
                        attention_tiled(qkv, out, len, heads, head_dim, scale);
                    });
                for (auto& thread : threads) thread.join();
            }
}

int main() {
    // items, len, heads, head_dim: one tile and a partial one (ViT-B/32's 50 rows), several
    // items, a single row, the widest head, a length of whole tiles, odd head widths.
    const int shapes[][4] = {{1, 50, 2, 64}, {3, 50, 2, 64}, {2, 33, 1, 72}, {1, 1, 2, 64},
                             {2, 97, 3, 96}, {1, 64, 1, 16}, {2, 40, 2, 5}};
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    double worst = 0.0;
    for (const auto& shape : shapes) {
        const int items = shape[0], len = shape[1], heads = shape[2], head_dim = shape[3];
        const int width = heads * head_dim;
        std::vector<float> qkv(size_t(items) * len * 3 * width);
        for (auto& v : qkv) v = normal(rng);
        std::vector<float> out(size_t(items) * len * width, NAN), expected(out.size());
        const float scale = 1.0f / std::sqrt(float(head_dim));
        auto at = [&](int item, int row, int part, int head, int d) {
            return double(qkv[(size_t(item) * len + row) * 3 * width + part * width + head * head_dim + d]);
        };
        for (int item = 0; item < items; ++item)
            for (int head = 0; head < heads; ++head)
                for (int i = 0; i < len; ++i) {
                    std::vector<double> scores(len);
                    double max = -INFINITY, sum = 0.0;
                    for (int j = 0; j < len; ++j) {
                        double dot = 0.0;
                        for (int d = 0; d < head_dim; ++d) dot += at(item, i, 0, head, d) * at(item, j, 1, head, d);
                        scores[j] = dot * scale;
                        max = std::max(max, scores[j]);
                    }
                    for (auto& s : scores) sum += (s = std::exp(s - max));
                    for (int d = 0; d < head_dim; ++d) {
                        double acc = 0.0;
                        for (int j = 0; j < len; ++j) acc += scores[j] * at(item, j, 2, head, d);
                        expected[(size_t(item) * len + i) * width + head * head_dim + d] = float(acc / sum);
                    }
                }
        launch(qkv.data(), out.data(), items, len, heads, head_dim, scale);
        double difference = 0.0;
        for (size_t i = 0; i < out.size(); ++i) {
            const double d = std::fabs(double(out[i]) - expected[i]);
            difference = std::isnan(d) ? INFINITY : std::max(difference, d);
        }
        std::printf("items %d, len %d, heads %d, head_dim %d: max |difference| %.3g\n", items, len, heads, head_dim,
                    difference);
        worst = std::max(worst, difference);
    }
    return worst <= 1e-4 ? 0 : 1;
}
