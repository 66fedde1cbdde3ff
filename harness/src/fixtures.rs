//! The committed model fixtures and how computed outputs are compared with their references.
//!
//! The tiny models live beside the crates that test them: the LLM's under
//! `llm/tests/fixtures/` and the encoders' under `workers/tests/fixtures/encoders/`.
//! `$SWITCHYARD_FIXTURES_DIR` replaces both roots (holding the LLM's fixtures and an `encoders/`
//! folder), as `scripts/gpu-bundle.sh` lays them out for a machine without the source tree.

use std::path::{Path, PathBuf};

/// The repository's root (this crate's parent folder, as it was built).
pub fn repository_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the harness sits in the repository's root")
}

/// An LLM fixture, e.g. `llm("tiny-llama")`: `$SWITCHYARD_FIXTURES_DIR/NAME`, else
/// `llm/tests/fixtures/NAME`.
pub fn llm(name: &str) -> PathBuf {
    std::env::var_os("SWITCHYARD_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repository_root().join("llm/tests/fixtures"))
        .join(name)
}

/// An encoder fixture, e.g. `encoder("tiny-llava")` or `encoder("audio/tone.wav")`:
/// `$SWITCHYARD_FIXTURES_DIR/encoders/NAME`, else `workers/tests/fixtures/encoders/NAME`.
pub fn encoder(name: &str) -> PathBuf {
    std::env::var_os("SWITCHYARD_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repository_root().join("workers/tests/fixtures"))
        .join("encoders")
        .join(name)
}

/// The largest absolute difference between `a` and `b`, element by element (NaNs ignored).
///
/// # Panics
///
/// Panics if their lengths differ.
pub fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
