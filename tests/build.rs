//! Builds the hostile policy guests in `tests/guests/` for the end-to-end tests and tells them
//! where the components are (`SWITCHYARD_GUESTS_DIR`).

#[path = "../gateway/build_guests.rs"]
mod build_guests;

use std::path::PathBuf;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest_dir.parent().expect("tests/ has a parent").to_path_buf();
    let guests = manifest_dir.join("guests");
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("wasm-guests");
    println!("cargo:rerun-if-changed={}", guests.display());
    println!("cargo:rerun-if-changed={}", root.join("plugins/sdk").display());
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    build_guests::build_guests(&guests, &target_dir);
    println!(
        "cargo:rustc-env=SWITCHYARD_GUESTS_DIR={}",
        target_dir.join("wasm32-wasip2/release").display()
    );
    // The built-in guests, built by the gateway's build script into the shared target folder.
    let plugins_dir = target_dir.with_file_name("wasm-plugins").join("wasm32-wasip2/release");
    println!("cargo:rustc-env=SWITCHYARD_PLUGINS_DIR={}", plugins_dir.display());
}
