#!/usr/bin/env bash
# Builds what a GPU machine without Rust needs to check the CUDA backends, into `.gpu/` (ignored
# by git; copy it to the GPU machine with the repository): the LLM's and the workers' test binaries
# (for their `cuda_backend` and `encoder_cuda` tests) and the `llm_cuda` and `encoders_cuda`
# bench binaries, `switchyard-llm` built with `cuda`, and the end-to-end test binary (for
# `native_multimodal`) with the gateway and `switchyard-encoder` built with `cuda`
# (release, stripped, xz-compressed so the bundle stays under 64 MiB; the last three under
# `.gpu/e2e/`) and the fixtures. Then, on the GPU machine, from the repository root:
#
#   bash scripts/gpu-check.sh
#
# which runs them all, each with a time limit (libcuda comes with the driver; NVRTC and cuBLAS
# from the CUDA toolkit or the `nvidia-*` wheels of the machine's Python).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu
# Build output that ignores itself: git never lists it, in a clone or a worktree alike.
echo '*' >.gpu/.gitignore

# Builds with `cargo ARGS --no-run --message-format=json` and prints the path of the executable
# of the target named TARGET. Cargo's errors show on stderr; a failed build stops the script.
executable() {
    local target=$1 json
    shift
    json=$(cargo "$@" --no-run --message-format=json) || return
    python3 -c '
import json, sys
target = sys.argv[1]
found = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == target]
if not found:
    sys.exit(f"cargo built no executable named {target}")
print(found[-1])
' "$target" <<<"$json"
}

# Each package's integration tests are one binary, `all`; gpu-check.sh runs the CUDA modules
# of the first two by name, and the third's multimodal test.
llm_tests=$(executable all test --release -p switchyard-llm --features cuda --test all)
bench_bin=$(executable llm_cuda bench -p switchyard-llm --features cuda --bench llm_cuda)
worker_tests=$(executable all test --release -p switchyard-workers --features cuda --test all)
encoder_bench=$(executable encoders_cuda bench -p switchyard-encoders --features cuda --bench encoders_cuda)
cargo build --release -p switchyard-llm --features cuda --bin switchyard-llm
strip -o .gpu/switchyard-llm target/release/switchyard-llm
# The end-to-end multimodal test with the encoders and the worker on the GPU: the gateway, the
# encoder built with `cuda`, and the test.
cargo build --release -p switchyard --bin switchyard
cargo build --release -p switchyard-workers --features cuda --bin switchyard-encoder
e2e_tests=$(executable all test --release -p switchyard-e2e --test all)
mkdir -p .gpu/e2e
strip -o .gpu/e2e/switchyard target/release/switchyard
strip -o .gpu/e2e/switchyard-encoder target/release/switchyard-encoder
strip -o .gpu/e2e/e2e_tests "$e2e_tests"
strip -o .gpu/llm_tests "$llm_tests"
strip -o .gpu/llm_cuda "$bench_bin"
strip -o .gpu/worker_tests "$worker_tests"
strip -o .gpu/encoders_cuda "$encoder_bench"
cp -r llm/tests/fixtures .gpu/fixtures
mkdir -p .gpu/fixtures/encoders
for f in tiny-llava tiny-whisper tiny-whisper-48 images audio videos; do
    cp -r "workers/tests/fixtures/encoders/$f" .gpu/fixtures/encoders/
done
xz -T2 -6 .gpu/e2e/* .gpu/llm_tests .gpu/llm_cuda .gpu/worker_tests .gpu/encoders_cuda .gpu/switchyard-llm
du -sh .gpu
