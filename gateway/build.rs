//! Builds the policy guests in `plugins/` to `wasm32-wasip2` components and hands their paths
//! to the crate, which embeds the built-in policies. The guests are a workspace of their own,
//! built with the same pinned toolchain into `target/wasm-plugins`.

use std::path::{Path, PathBuf};
use std::process::Command;

const BUILT_INS: [&str; 5] = [
    "round_robin",
    "least_load",
    "kv_aware",
    "fcfs",
    "token_budget",
];

fn main() {
    let manifest_dir = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let root = manifest_dir
        .parent()
        .expect("gateway/ has a parent")
        .to_path_buf();
    let plugins = root.join("plugins");
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("wasm-plugins");
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    for entry in [
        "Cargo.toml",
        "Cargo.lock",
        "sdk",
        "round-robin",
        "least-load",
        "kv-aware",
        "fcfs",
        "token-budget",
    ] {
        println!("cargo:rerun-if-changed={}", plugins.join(entry).display());
    }
    build_guests(&plugins, &target_dir);
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for name in BUILT_INS {
        let built = target_dir
            .join("wasm32-wasip2/release")
            .join(format!("{name}.wasm"));
        let copy = out_dir.join(format!("{name}.wasm"));
        std::fs::copy(&built, &copy)
            .unwrap_or_else(|err| panic!("copying {}: {err}", built.display()));
    }
}

/// Runs `cargo build --release --target wasm32-wasip2` in `workspace`.
pub fn build_guests(workspace: &Path, target_dir: &Path) {
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
