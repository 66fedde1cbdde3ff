#!/usr/bin/env bash
# Runs every fuzz target under fuzz/fuzz_targets for a bounded time, starting from its
# committed corpus (fuzz/corpus/<target>, which also holds every crash input found so far, so
# each run replays them first). New inputs go to a temporary folder, not into the committed
# corpus. Usage: scripts/fuzz.sh [seconds per target, default 20] [target...]
#
# Stable Rust is enough: without a sanitizer (`-s none`) cargo-fuzz needs no nightly flags;
# Rust's own checks (bounds, overflow, debug assertions) are what catches bugs here.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
cd fuzz

seconds=${1:-20}
shift || true
cargo_fuzz_version=0.13.2
if ! cargo fuzz --version 2>/dev/null | grep -q "$cargo_fuzz_version"; then
    cargo install cargo-fuzz --version "$cargo_fuzz_version" --locked
fi
# libFuzzer is C++, built by libfuzzer-sys.
if ! command -v c++ >/dev/null 2>&1; then
    apt_install g++
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    for file in fuzz_targets/*.rs; do
        targets+=("$(basename "$file" .rs)")
    done
fi

cargo fuzz build -s none --codegen-units 16
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for target in "${targets[@]}"; do
    mkdir -p "$scratch/$target" "corpus/$target"
    echo "== $target: ${seconds}s from $(find "corpus/$target" -type f | wc -l) committed inputs"
    # -timeout: an input that runs 10 s is a hang; -rss_limit_mb: one that needs 2 GiB, a bomb.
    log="$scratch/$target.log"
    if ! cargo fuzz run -s none --codegen-units 16 "$target" "$scratch/$target" "corpus/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        echo "fuzz target $target failed; the input is under fuzz/artifacts/$target" >&2
        exit 1
    fi
    grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || true
done
echo "fuzzing: ${#targets[@]} targets, ${seconds}s each, no crash"
