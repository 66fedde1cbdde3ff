#!/usr/bin/env bash
# Builds what a GPU machine without Rust needs to check the CUDA backends, into `.gpu/` (ignored
# by git; copy it to the GPU machine with the repository): the `cuda_backend` and `encoder_cuda` test and the
# `llm_cuda` and `encoders_cuda` bench binaries, `switchyard-worker` built with `cuda`, and the
# `native_multimodal` end-to-end test with the gateway and `switchyard-encoder` built with `cuda`
# (release, stripped, xz-compressed so the bundle stays under 64 MiB; the last three under
# `.gpu/e2e/`) and the fixtures. Then, on the GPU machine, from the repository root:
#
#   bash scripts/gpu-check.sh
#
# which runs them all, each with a time limit (libcuda comes with the driver; NVRTC and cuBLAS
# from the CUDA toolkit or the `nvidia-*` wheels of the machine's Python).
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
cargo build --release -p switchyard-llm --features cuda --bin switchyard-worker 2>/dev/null
strip -o .gpu/switchyard-worker target/release/switchyard-worker
# The end-to-end multimodal test with the encoders and the worker on the GPU: the gateway, the
# encoder built with `cuda`, and the test.
cargo build --release -p switchyard --bin switchyard 2>/dev/null
cargo build --release -p switchyard-workers --features cuda --bin switchyard-encoder 2>/dev/null
e2e_test=$(cargo test --release -p switchyard-e2e --test native_multimodal --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and "native_multimodal" in m["executable"]][-1])')
mkdir -p .gpu/e2e
strip -o .gpu/e2e/switchyard target/release/switchyard
strip -o .gpu/e2e/switchyard-encoder target/release/switchyard-encoder
strip -o .gpu/e2e/native_multimodal "$e2e_test"
strip -o .gpu/cuda_backend "$test_bin"
strip -o .gpu/llm_cuda "$bench_bin"
strip -o .gpu/encoder_cuda "$encoder_test"
strip -o .gpu/encoders_cuda "$encoder_bench"
cp -r gpu-workers/llm/tests/fixtures .gpu/fixtures
mkdir -p .gpu/fixtures/encoders
for f in tiny-llava tiny-whisper tiny-whisper-48 images audio videos; do
    cp -r "gpu-workers/tests/fixtures/encoders/$f" .gpu/fixtures/encoders/
done
xz -T2 -6 .gpu/e2e/* .gpu/cuda_backend .gpu/llm_cuda .gpu/encoder_cuda .gpu/encoders_cuda .gpu/switchyard-worker
du -sh .gpu
