//! `switchyard-workers`' integration tests: one test binary, one module per area (`encoder_`:
//! the native encoders and `switchyard-encoder`; `worker_`: the worker server and
//! `switchyard-mocker`). One runs alone by
//! its name, e.g. `cargo test -p switchyard-workers --test all -- encoder_reference::`.
//! Each test first takes its file's turn (`switchyard_harness::turn()`): tests of one file run
//! side by side and no other file's beside them, as when each file was a test binary of its own.
//!
//! `encoder_cuda` needs `--features cuda` (its kernels compile under NVRTC; its GPU tests skip
//! without a GPU unless `SWITCHYARD_CUDA_TESTS=gpu`), and `encoder_reference` holds an opt-in
//! real-weights test (`-- --ignored encoder_reference::`, with `SWITCHYARD_WHISPER_TINY_EN`).

mod encoder_cuda;
mod encoder_http;
mod encoder_reference;
mod worker_drain;
mod worker_health;
mod worker_kv_transfer;
mod worker_mocker_http;
mod worker_position_map;
