//! Builds the hostile policy guests in `tests/guests/` for the end-to-end tests and tells them
//! where the components are (`SWITCHYARD_GUESTS_DIR`).

#[path = "../gateway/build_guests.rs"]
mod build_guests;

fn main() {
    let root = build_guests::repository_root();
    let guests = root.join("tests/guests");
    let target_dir = build_guests::guest_target_dir("wasm-guests");
    println!("cargo:rerun-if-changed={}", guests.display());
    println!("cargo:rerun-if-changed={}", root.join("plugins/sdk").display());
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    // Every guest in the workspace (no `-p`): each is a test's subject.
    build_guests::build_guests(&guests, &target_dir, &[]);
    println!(
        "cargo:rustc-env=SWITCHYARD_GUESTS_DIR={}",
        target_dir.join("wasm32-wasip2/release").display()
    );
    // The built-in guests, built by the gateway's build script into the shared target folder.
    let plugins_dir = build_guests::guest_target_dir("wasm-plugins").join("wasm32-wasip2/release");
    println!("cargo:rustc-env=SWITCHYARD_PLUGINS_DIR={}", plugins_dir.display());
}
