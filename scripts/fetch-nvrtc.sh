#!/usr/bin/env bash
# Fetches NVRTC (the CUDA runtime compiler, PyPI `nvidia-cuda-nvrtc`) and prints the folder
# holding libnvrtc.so.13, so machines without CUDA can compile-check the GPU kernels:
#   LD_LIBRARY_PATH=$(scripts/fetch-nvrtc.sh) SWITCHYARD_CUDA_TESTS=nvrtc \
#       cargo test -p switchyard-llm --features cuda --test cuda_backend
set -euo pipefail
dest=${1:-${TMPDIR:-/tmp}/switchyard-nvrtc}
lib="$dest/nvidia/cu13/lib"
if [ ! -f "$lib/libnvrtc.so.13" ]; then
    mkdir -p "$dest"
    python3 -m pip download --quiet --no-deps nvidia-cuda-nvrtc==13.0.88 -d "$dest" >&2
    python3 - "$dest" <<'PY'
import sys, zipfile, pathlib
dest = pathlib.Path(sys.argv[1])
wheel = next(dest.glob("nvidia_cuda_nvrtc-13.0.88-*.whl"))
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("nvidia/cu13/lib/"):
            z.extract(name, dest)
PY
fi
echo "$lib"
