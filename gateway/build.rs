//! Builds the built-in policy guests in `plugins/` to `wasm32-wasip2` components and hands
//! their paths to the crate, which embeds them. The guests are a workspace of their own, built
//! with the same pinned toolchain into `target/wasm-plugins`.

#[path = "build_guests.rs"]
mod build_guests;

use std::path::PathBuf;

/// The built-in policies, the only packages of `plugins/` built here: (package name, which is
/// also its folder in `plugins/`; file stem of its component, the name with `-` changed to `_`
/// as cargo writes it). The SDK is built as their dependency; `plugins/template/` is a package
/// of its own, built by nobody here.
const BUILT_INS: [(&str, &str); 16] = [
    ("round-robin", "round_robin"),
    ("least-load", "least_load"),
    ("kv-aware", "kv_aware"),
    ("predicted-ttft", "predicted_ttft"),
    ("fcfs", "fcfs"),
    ("token-budget", "token_budget"),
    ("mixed-modality", "mixed_modality"),
    ("modality-aware", "modality_aware"),
    ("priority", "priority"),
    ("fair-share", "fair_share"),
    ("cost-aware", "cost_aware"),
    ("load-based", "load_based"),
    ("sla-based", "sla_based"),
    ("peer-sglang", "peer_sglang"),
    ("peer-llm-d", "peer_llm_d"),
    ("peer-aibrix", "peer_aibrix"),
];

fn main() {
    let root = build_guests::repository_root();
    let plugins = root.join("plugins");
    let target_dir = build_guests::guest_target_dir("wasm-plugins");
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    let shared = ["Cargo.toml", "Cargo.lock", ".cargo", "sdk"];
    for entry in shared.into_iter().chain(BUILT_INS.map(|(package, _)| package)) {
        println!("cargo:rerun-if-changed={}", plugins.join(entry).display());
    }
    build_guests::build_guests(&plugins, &target_dir, &BUILT_INS.map(|(package, _)| package));
    // Where the components stay after the build: the binary's ready output names one of them
    // in a `switchyard policy push` example that works as printed on this machine.
    println!(
        "cargo:rustc-env=SWITCHYARD_BUILT_IN_POLICY_DIR={}",
        target_dir.join("wasm32-wasip2/release").display()
    );
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for (_, stem) in BUILT_INS {
        let built = target_dir.join("wasm32-wasip2/release").join(format!("{stem}.wasm"));
        let copy = out_dir.join(format!("{stem}.wasm"));
        std::fs::copy(&built, &copy).unwrap_or_else(|err| panic!("copying {}: {err}", built.display()));
    }
}
