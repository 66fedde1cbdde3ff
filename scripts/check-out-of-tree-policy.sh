#!/usr/bin/env bash
# Proves that a policy written outside this repository builds: copies `plugins/template/` to a
# fresh temporary folder, points its SDK dependency at this repository's `plugins/sdk` by
# absolute path, runs its native tests and builds its wasm32-wasip2 component.
#
# The last line on stdout is the path of the built `.wasm` (everything else goes to stderr), so
# CI can go on with `switchyard policy check "$(scripts/check-out-of-tree-policy.sh | tail -n 1)"`.
# The temporary folder is left in place for that.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
template="$repo/plugins/template"
sdk="$repo/plugins/sdk"
work=$(mktemp -d)
policy="$work/policy"

echo "copying $template to $policy" >&2
mkdir "$policy"
# Everything but a build folder left by an in-tree build (dotfiles included: `.cargo/`).
tar -C "$template" --exclude=./target -cf - . | tar -C "$policy" -xf -

# `path = "../sdk"` becomes the absolute path of this repository's SDK.
escaped=$(printf '%s' "$sdk" | sed -e 's/[\\|&]/\\&/g')
sed -e "s|path = \"\\.\\./sdk\"|path = \"$escaped\"|" "$policy/Cargo.toml" >"$policy/Cargo.toml.new"
mv "$policy/Cargo.toml.new" "$policy/Cargo.toml"
if ! grep -qF "path = \"$sdk\"" "$policy/Cargo.toml"; then
    echo "the template's Cargo.toml has no \`path = \"../sdk\"\` dependency to rewrite" >&2
    exit 1
fi

# Outside the repository its rust-toolchain.toml no longer applies: build with the same pinned
# toolchain (it has the wasm32-wasip2 target) by putting a copy above the policy's folder.
cp "$repo/rust-toolchain.toml" "$work/rust-toolchain.toml"

# The caller's build settings must not leak in: RUSTFLAGS would replace the policy's own
# `.cargo/config.toml` flags (the 32 KiB stack), and a CARGO_TARGET_DIR would move the output.
unset RUSTFLAGS CARGO_ENCODED_RUSTFLAGS CARGO_BUILD_RUSTFLAGS CARGO_BUILD_TARGET CARGO_TARGET_DIR \
    RUSTC_WRAPPER RUSTC_WORKSPACE_WRAPPER

cd "$policy"
echo "cargo test --locked --lib (in $policy)" >&2
cargo test --locked --lib >&2
echo "cargo build --locked --release --target wasm32-wasip2 (in $policy)" >&2
cargo build --locked --release --target wasm32-wasip2 >&2

# Cargo names the component after the package, with `-` changed to `_`.
name=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
wasm="$policy/target/wasm32-wasip2/release/${name//-/_}.wasm"
if [ ! -f "$wasm" ]; then
    echo "cargo built no $wasm" >&2
    exit 1
fi
echo "$wasm"
