#!/usr/bin/env bash
# Builds one of llama.cpp's programs from the `llama-cpp-python` source distribution on PyPI
# (which vendors llama.cpp), checks the archive's sha256 and prints the binary's path.
# Usage: scripts/build-llama-cpp.sh [llama-bench|llama-server] [folder]
#   llama-bench (the default): the anchor the native LLM's CPU benchmark measures beside itself:
#     SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2) SWITCHYARD_LLAMA_BENCH=$(scripts/build-llama-cpp.sh) \
#       cargo bench -p switchyard-llm --bench llm_cpu
#   llama-server: the third-party engine the gateway's end-to-end tests put behind it
#     (SWITCHYARD_LLAMA_SERVER=$(scripts/build-llama-cpp.sh llama-server)).
# Needs a C++ compiler and cmake (Debian: `apt-get install g++ cmake`). Built for this CPU
# (GGML_NATIVE), CPU backend only, no network code (LLAMA_CURL off).
set -euo pipefail
program=${1:-llama-bench}
case "$program" in
    llama-bench | llama-server) ;;
    *) echo "usage: $0 [llama-bench|llama-server] [folder]" >&2; exit 2 ;;
esac
version=0.3.36
sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
dest=${2:-${TMPDIR:-/tmp}/switchyard-llama-cpp}
archive="$dest/llama_cpp_python-$version.tar.gz"
source="$dest/llama_cpp_python-$version/vendor/llama.cpp"
binary="$source/build/bin/$program"
command -v cmake >/dev/null || { echo "cmake not found: apt-get install cmake" >&2; exit 1; }
if [ ! -x "$binary" ]; then
    mkdir -p "$dest"
    if [ ! -f "$archive" ] || ! echo "$sha  $archive" | sha256sum --check --status; then
        # Only this package from source; its build backend is not needed to download it.
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$version" -d "$dest" >&2
        echo "$sha  $archive" | sha256sum --check --status || { echo "sha256 mismatch for $archive" >&2; exit 1; }
    fi
    [ -d "$source" ] || tar -xzf "$archive" -C "$dest"
    cmake -S "$source" -B "$source/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
    cmake --build "$source/build" --target "$program" -j "$(nproc)" >&2
fi
echo "$binary"
