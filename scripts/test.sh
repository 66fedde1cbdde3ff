#!/usr/bin/env bash
# Runs every test of the workspace on a machine that has only rustup and a C toolchain: installs
# the toolchain rust-toolchain.toml pins (with its wasm32-wasip2 target), the `nats-server` the
# messaging tests start, the `chromium` the dashboard test drives and the `g++` the CUDA kernel
# emulation test compiles with (Debian's packages), then runs `cargo test --workspace --locked`.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p switchyard`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

# rustup ≥ 1.28 installs a pinned toolchain only when asked; this asks (and is a no-op when it
# is already there).
rustup toolchain install >&2

missing=()
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
    missing+=(nats-server)
fi
if [ -z "${SWITCHYARD_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1 \
    && ! command -v chromium-browser >/dev/null 2>&1 && ! command -v google-chrome >/dev/null 2>&1; then
    missing+=(chromium)
fi
if [ -z "${CXX:-}" ] && ! command -v c++ >/dev/null 2>&1; then
    missing+=(g++)
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} (Debian packages) for the messaging, dashboard and kernel emulation tests" >&2
    if ! apt_install "${missing[@]}" >&2; then
        # Without chromium the dashboard test says it skipped, and without g++ the kernel
        # emulation test; without nats-server the messaging tests fail, naming the package.
        echo "could not install ${missing[*]}" >&2
    fi
fi

exec cargo test --workspace --locked "$@"
