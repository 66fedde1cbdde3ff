#!/usr/bin/env bash
# Runs, on a GPU machine without Rust, what `scripts/gpu-bundle.sh` packed into `.gpu/`: the CUDA
# tests of the LLM and the encoders (with `SWITCHYARD_CUDA_TESTS=gpu`, so a missing GPU, driver,
# NVRTC or cuBLAS fails them instead of skipping), both CUDA benches, and, when the bundle holds
# `switchyard-llm`, the worker binary on `--device cuda:0` answering the same greedy requests
# as on `--device cpu` (with f32 and with f16 KV caches), and the end-to-end multimodal test
# (gateway, two `switchyard-encoder`s and `switchyard-llm`, the three on `cuda:0`). From the
# repository root:
#
#   bash scripts/gpu-check.sh            # logs under $OUT if set, else .gpu/out
#   SKIP="encoders_cuda llm_cuda" bash scripts/gpu-check.sh   # leaves those steps out
#
# Each step has its own time limit so that one hang leaves the others' figures. NVRTC and
# cuBLAS are loaded at run time: the CUDA toolkit's when it has both, else those of the
# `nvidia-*` wheels of the machine's Python. Exits non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-.gpu/out}
mkdir -p "$out"
failed=()

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$out/gpu.txt"
nproc | sed 's/^/cpu cores: /' | tee -a "$out/gpu.txt"

for packed in .gpu/*.xz .gpu/e2e/*.xz; do
    [ -f "$packed" ] || continue
    # Python's lzma, not xz: the GPU machine's image may lack xz-utils.
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$packed" "${packed%.xz}"
    chmod +x "${packed%.xz}"
done

libs=$(python3 - <<'EOF'
import glob, os, site
roots = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
for base in site.getsitepackages():
    roots += sorted(glob.glob(base + "/nvidia/**/lib", recursive=True))
def has(root, name):
    return bool(glob.glob(os.path.join(root, name + ".so*")))
nvrtc = next((r for r in roots if has(r, "libnvrtc")), None)
cublas = next((r for r in roots if has(r, "libcublas")), None)
print(":".join(dict.fromkeys(r for r in (nvrtc, cublas) if r)))
EOF
)
echo "NVRTC and cuBLAS from: ${libs:-nowhere}" | tee -a "$out/gpu.txt"
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SWITCHYARD_FIXTURES_DIR=.gpu/fixtures SWITCHYARD_CUDA_TESTS=gpu RUST_BACKTRACE=1

step() {
    local name=$1 limit=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*) echo "== $name skipped (SKIP)"; return ;; esac
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - start))s"
    tail -n 40 "$out/$name.log"
    [ "$rc" = 0 ] || failed+=("$name")
}

step cuda_backend "${LIMIT_TESTS:-120}" .gpu/llm_tests cuda_backend:: --test-threads 1 --nocapture
step encoder_cuda "${LIMIT_TESTS:-120}" .gpu/worker_tests encoder_cuda:: --test-threads 1 --nocapture
step llm_cuda "${LIMIT_LLM_BENCH:-100}" .gpu/llm_cuda --bench
step encoders_cuda "${LIMIT_BENCH:-150}" .gpu/encoders_cuda --bench --runs "${RUNS:-30}"

if [ -x .gpu/switchyard-llm ]; then
    step worker_binary 60 python3 scripts/gpu-worker-smoke.py .gpu/switchyard-llm .gpu/fixtures/tiny-llama
    step worker_binary_f16 60 python3 scripts/gpu-worker-smoke.py .gpu/switchyard-llm .gpu/fixtures/tiny-llama f16
fi

if [ -x .gpu/e2e/e2e_tests ] && [ -x .gpu/switchyard-llm ]; then
    cp .gpu/switchyard-llm .gpu/e2e/
    SWITCHYARD_BIN_DIR=.gpu/e2e SWITCHYARD_E2E_DEVICE=cuda:0 \
        step native_multimodal 120 .gpu/e2e/e2e_tests native_multimodal:: --nocapture
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed"
