//! `switchyard-llm`'s integration tests: one test binary, one module per concern, on the tiny
//! fixtures in `tests/fixtures/` (and the encoders' `tiny-llava`, which `multimodal_llm_reference`
//! runs through the vision tower and this crate's language model together). One runs alone by its name, e.g.
//! `cargo test -p switchyard-llm --test all -- llm_consistency::`.
//! Each test first takes its file's turn (`switchyard_harness::turn()`): tests of one file run
//! side by side and no other file's beside them, as when each file was a test binary of its own.
//!
//! `cuda_backend` needs `--features cuda` (its kernels compile under NVRTC; its GPU tests skip
//! without a GPU unless `SWITCHYARD_CUDA_TESTS=gpu`), and `real_model` is opt-in
//! (`-- --ignored real_model::`, with `SWITCHYARD_SMOLLM2_GGUF`).

mod cuda_backend;
mod gguf_reference;
mod hf_reference;
mod kernel_emulation;
mod llm_consistency;
mod llm_engine;
mod llm_kv_transfer;
mod llm_media_engine;
mod multimodal_llm_reference;
mod real_model;
mod worker_llm_http;
