//! Builds the built-in policy guests in `plugins/` to `wasm32-wasip2` components and hands
//! their paths to the crate, which embeds them. The guests are a workspace of their own, built
//! with the same pinned toolchain into `target/wasm-plugins`.

#[path = "build_guests.rs"]
mod build_guests;

use std::path::PathBuf;

/// The built-in policies, the only packages of `plugins/` built here, and the one list of them:
/// (package name, which is also its folder in `plugins/` and the name configurations use; file
/// stem of its component, the name with `-` changed to `_` as cargo writes it; the world it
/// exports, as a variant of `built_ins::World`). The crate embeds them from the table written
/// to `OUT_DIR/built_ins.rs`. The SDK is built as their dependency; `plugins/template/` is a
/// package of its own, built by nobody here.
const BUILT_INS: [(&str, &str, &str); 18] = [
    ("round-robin", "round_robin", "Router"),
    ("least-load", "least_load", "Router"),
    ("kv-aware", "kv_aware", "Router"),
    ("predicted-ttft", "predicted_ttft", "Router"),
    ("modality-aware", "modality_aware", "Router"),
    ("cost-aware", "cost_aware", "Router"),
    ("peer-sglang", "peer_sglang", "Router"),
    ("peer-llm-d", "peer_llm_d", "Router"),
    ("peer-aibrix", "peer_aibrix", "Router"),
    ("pd-threshold", "pd_threshold", "Router"),
    ("pd-predicted", "pd_predicted", "Router"),
    ("fcfs", "fcfs", "Batcher"),
    ("token-budget", "token_budget", "Batcher"),
    ("mixed-modality", "mixed_modality", "Batcher"),
    ("priority", "priority", "Batcher"),
    ("fair-share", "fair_share", "Batcher"),
    ("load-based", "load_based", "Planner"),
    ("sla-based", "sla_based", "Planner"),
];

fn main() {
    let root = build_guests::repository_root();
    let plugins = root.join("plugins");
    let target_dir = build_guests::guest_target_dir("wasm-plugins");
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    let shared = ["Cargo.toml", "Cargo.lock", ".cargo", "sdk", "ttft-model"];
    for entry in shared.into_iter().chain(BUILT_INS.map(|(package, _, _)| package)) {
        println!("cargo:rerun-if-changed={}", plugins.join(entry).display());
    }
    build_guests::build_guests(&plugins, &target_dir, &BUILT_INS.map(|(package, _, _)| package));
    // Where the components stay after the build: the binary's ready output names one of them
    // in a `switchyard policy push` example that works as printed on this machine.
    println!(
        "cargo:rustc-env=SWITCHYARD_BUILT_IN_POLICY_DIR={}",
        target_dir.join("wasm32-wasip2/release").display()
    );
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut table = String::from("/// Every built-in policy, as `gateway/build.rs` lists them.\n");
    table.push_str(&format!("const BUILT_INS: [BuiltIn; {}] = [\n", BUILT_INS.len()));
    for (name, stem, world) in BUILT_INS {
        let built = target_dir.join("wasm32-wasip2/release").join(format!("{stem}.wasm"));
        let copy = out_dir.join(format!("{stem}.wasm"));
        std::fs::copy(&built, &copy).unwrap_or_else(|err| panic!("copying {}: {err}", built.display()));
        table.push_str(&format!(
            "    BuiltIn {{ name: {name:?}, world: World::{world}, wasm: include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{stem}.wasm\")) }},\n"
        ));
    }
    table.push_str("];\n");
    let listed = out_dir.join("built_ins.rs");
    std::fs::write(&listed, table).unwrap_or_else(|err| panic!("writing {}: {err}", listed.display()));
}
