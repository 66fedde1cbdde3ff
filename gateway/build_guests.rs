//! Shared by the build scripts of `switchyard` and `switchyard-e2e`: builds a workspace of
//! policy guests to `wasm32-wasip2` components with the pinned toolchain.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root (the parent of the calling package's folder).
pub(crate) fn repository_root() -> PathBuf {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .expect("packages sit one folder below the root")
        .to_path_buf()
}

/// `NAME` inside the shared target folder (`CARGO_TARGET_DIR`, or `target/` at the root), where
/// a guest workspace builds so that debug, release and clippy runs share its output.
pub(crate) fn guest_target_dir(name: &str) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repository_root().join("target"))
        .join(name)
}

/// Runs `cargo build --release --locked --target wasm32-wasip2` in `workspace`, with `-p NAME`
/// for each of `packages`, or for every member of the workspace when `packages` is empty.
pub(crate) fn build_guests(workspace: &Path, target_dir: &Path, packages: &[&str]) {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .current_dir(workspace)
        .args([
            "build",
            "--release",
            "--locked",
            "--target",
            "wasm32-wasip2",
            "--target-dir",
        ])
        .arg(target_dir);
    for package in packages {
        command.args(["-p", package]);
    }
    // The outer build's settings (clippy's wrapper, host RUSTFLAGS) must not leak into the guests.
    for variable in [
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_MAKEFLAGS",
    ] {
        command.env_remove(variable);
    }
    let status = command
        .status()
        .unwrap_or_else(|err| panic!("running cargo for {}: {err}", workspace.display()));
    assert!(
        status.success(),
        "building the policy guests in {} failed",
        workspace.display()
    );
}
