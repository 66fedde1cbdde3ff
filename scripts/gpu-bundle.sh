#!/usr/bin/env bash
# Builds what a GPU machine without Rust needs to check the CUDA backends, into `.gpu/` (ignored
# by git; carry it with the device tool): the `cuda_backend` and `encoder_cuda` test and the
# `llm_cuda` and `encoders_cuda` bench binaries (release, stripped) and the fixtures. Then, on
# the GPU machine, from the repository root:
#
#   export LD_LIBRARY_PATH=$(python3 -c "import nvidia; print(nvidia.__path__[0] + '/cu13/lib')"):$LD_LIBRARY_PATH
#   SWITCHYARD_FIXTURES_DIR=.gpu/fixtures SWITCHYARD_CUDA_TESTS=gpu .gpu/cuda_backend --test-threads 1
#   SWITCHYARD_FIXTURES_DIR=.gpu/fixtures SWITCHYARD_CUDA_TESTS=gpu .gpu/encoder_cuda --test-threads 1
#   SWITCHYARD_FIXTURES_DIR=.gpu/fixtures .gpu/llm_cuda --bench
#   .gpu/encoders_cuda --bench
#
# (libcuda comes with the driver; NVRTC and cuBLAS from the `nvidia-cuda-nvrtc` and
# `nvidia-cublas` wheels of the machine's Python.)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu
test_bin=$(cargo test --release -p switchyard-llm --features cuda --test cuda_backend --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and "cuda_backend" in m["executable"]][-1])')
bench_bin=$(cargo bench -p switchyard-llm --features cuda --bench llm_cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and "llm_cuda" in m["executable"]][-1])')
encoder_test=$(cargo test --release -p switchyard-workers --features cuda --test encoder_cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and "encoder_cuda" in m["executable"]][-1])')
encoder_bench=$(cargo bench -p switchyard-encoders --features cuda --bench encoders_cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and "encoders_cuda" in m["executable"]][-1])')
strip -o .gpu/cuda_backend "$test_bin"
strip -o .gpu/llm_cuda "$bench_bin"
strip -o .gpu/encoder_cuda "$encoder_test"
strip -o .gpu/encoders_cuda "$encoder_bench"
cp -r gpu-workers/llm/tests/fixtures .gpu/fixtures
mkdir -p .gpu/fixtures/encoders
for f in tiny-llava tiny-whisper images audio videos; do
    cp -r "gpu-workers/tests/fixtures/encoders/$f" .gpu/fixtures/encoders/
done
du -sh .gpu
