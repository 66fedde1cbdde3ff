#!/usr/bin/env bash
# Builds Switchyard's static release binaries for the edge — the gateway (`switchyard`, with its
# embedded simulated workers), the simulated engine (`switchyard-mocker`) and the native LLM
# worker (`switchyard-llm`) — for x86_64-unknown-linux-musl and aarch64-unknown-linux-musl,
# from a checkout with only rustup, Python 3 and Debian's apt. Then it smoke-tests each: the
# x86-64 gateway natively, the ARM one under `qemu-aarch64` (Debian's qemu-user): it starts the
# embedded default (config/dev.toml) and streams one answer. Binaries and sizes land in
# dist/edge/TARGET/.
#
# The C and C++ the binaries carry (ring, OpenH264) are cross-compiled and everything linked
# statically against musl by Zig (PyPI's `ziglang`), driven by `cargo-zigbuild`; both pinned,
# both installed under target/edge-tools.
#
# Usage: scripts/build-edge.sh [TARGET...]   (default: both targets)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(x86_64-unknown-linux-musl aarch64-unknown-linux-musl)
fi
zig_version=0.15.2
zigbuild_version=0.24.1
tools="$PWD/target/edge-tools"

rustup toolchain install >&2
rustup target add "${targets[@]}" >&2

# Zig in a virtual environment of its own; cargo-zigbuild finds it as `python3 -m ziglang`.
if [ ! -x "$tools/venv/bin/python3" ]; then
    python3 -m venv "$tools/venv" || {
        apt_install python3-venv
        python3 -m venv "$tools/venv"
    }
fi
if ! "$tools/venv/bin/python3" -m ziglang version 2>/dev/null | grep -qx "$zig_version"; then
    "$tools/venv/bin/pip" install --quiet "ziglang==$zig_version"
fi
if ! "$tools/bin/cargo-zigbuild" --version 2>/dev/null | grep -q "$zigbuild_version"; then
    cargo install cargo-zigbuild --version "$zigbuild_version" --locked --root "$tools"
fi
export PATH="$tools/venv/bin:$tools/bin:$PATH"

needs_qemu=false
for target in "${targets[@]}"; do
    [ "$target" = aarch64-unknown-linux-musl ] && needs_qemu=true
done
if $needs_qemu && ! command -v qemu-aarch64 >/dev/null 2>&1; then
    echo "installing qemu-user (Debian package) for the ARM smoke test" >&2
    apt_install qemu-user
fi

binaries=(switchyard switchyard-mocker switchyard-llm)

# Starts the embedded default with `runner` (empty: natively) and streams one answer. Under
# qemu every instruction is emulated, tens of times slower than the CPU it stands for, so the
# policies' CPU deadline (1 ms per call in config/dev.toml) is raised to 100 ms there; the
# configuration is otherwise the embedded default's.
smoke() {
    local runner=$1 binary=$2 port log config
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    log=$(mktemp)
    config=config/dev.toml
    if [ -n "$runner" ]; then
        config=$(mktemp --suffix=.toml)
        sed -E 's/^deadline_ms = 1([^0-9]|$)/deadline_ms = 100\1/' config/dev.toml >"$config"
        grep -q '^deadline_ms = 100' "$config" || { echo "config/dev.toml has no policy deadline_ms = 1 line" >&2; return 1; }
    fi
    $runner "$binary" --config "$config" --listen "127.0.0.1:$port" --log warn >"$log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 600); do
        grep -q '^try: ' "$log" && break
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; return 1; }
        sleep 0.1
    done
    local answer
    answer=$(curl -sS -N -k --max-time 60 "https://127.0.0.1:$port/v1/chat/completions" \
        -H 'content-type: application/json' \
        -d '{"model":"mock","messages":[{"role":"user","content":"hello from the edge"}],"max_tokens":8,"stream":true}')
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    if ! grep -q '^data: \[DONE\]' <<<"$answer" || ! grep -q '"delta"' <<<"$answer"; then
        echo "smoke test of $binary${runner:+ under $runner} failed; it answered:" >&2
        echo "$answer" >&2
        cat "$log" >&2
        return 1
    fi
    echo "smoke test passed: $binary${runner:+ (under $runner)} streamed $(grep -c '^data: {' <<<"$answer") chunks"
}

for target in "${targets[@]}"; do
    echo "== $target" >&2
    cargo zigbuild --profile edge --locked --target "$target" \
        -p switchyard -p switchyard-workers -p switchyard-llm --bins
    out="dist/edge/$target"
    mkdir -p "$out"
    for binary in "${binaries[@]}"; do
        cp "target/$target/edge/$binary" "$out/"
    done
    file "$out/switchyard" | grep -q 'statically linked' || {
        echo "$out/switchyard is not statically linked: $(file "$out/switchyard")" >&2
        exit 1
    }
    case "$target" in
        x86_64-*) smoke "" "$out/switchyard" ;;
        aarch64-*) smoke qemu-aarch64 "$out/switchyard" ;;
    esac
done

echo
echo "sizes (bytes):"
for target in "${targets[@]}"; do
    for binary in "${binaries[@]}"; do
        printf '%-28s %-18s %10d\n' "$target" "$binary" "$(stat -c %s "dist/edge/$target/$binary")"
    done
done
