#!/usr/bin/env bash
# Runs every test of the workspace on a machine that has only rustup and a C toolchain: installs
# the toolchain rust-toolchain.toml pins (with its wasm32-wasip2 target) and the `nats-server`
# the messaging tests start (Debian's package), then runs `cargo test --workspace --locked`.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p switchyard`).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# rustup ≥ 1.28 installs a pinned toolchain only when asked; this asks (and is a no-op when it
# is already there).
rustup toolchain install >&2

if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
    echo "installing nats-server (Debian package) for the messaging tests" >&2
    as_root apt-get update -qq >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >&2
fi

exec cargo test --workspace --locked "$@"
