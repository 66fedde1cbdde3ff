//! Builds the policy guests in `plugins/` to `wasm32-wasip2` components and hands their paths
//! to the crate, which embeds the built-in policies. The guests are a workspace of their own,
//! built with the same pinned toolchain into `target/wasm-plugins`.

#[path = "build_guests.rs"]
mod build_guests;

use std::path::PathBuf;

const BUILT_INS: [&str; 6] = [
    "round_robin",
    "least_load",
    "kv_aware",
    "predicted_ttft",
    "fcfs",
    "token_budget",
];

fn main() {
    let root = build_guests::repository_root();
    let plugins = root.join("plugins");
    let target_dir = build_guests::guest_target_dir("wasm-plugins");
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    for entry in [
        "Cargo.toml",
        "Cargo.lock",
        ".cargo",
        "sdk",
        "round-robin",
        "least-load",
        "kv-aware",
        "predicted-ttft",
        "fcfs",
        "token-budget",
        "template",
    ] {
        println!("cargo:rerun-if-changed={}", plugins.join(entry).display());
    }
    build_guests::build_guests(&plugins, &target_dir);
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for name in BUILT_INS {
        let built = target_dir.join("wasm32-wasip2/release").join(format!("{name}.wasm"));
        let copy = out_dir.join(format!("{name}.wasm"));
        std::fs::copy(&built, &copy).unwrap_or_else(|err| panic!("copying {}: {err}", built.display()));
    }
}
