//! Switchyard's harness: real binaries, a real CA, a real TLS client, shared by every package's
//! end-to-end tests and by the `switchyard-bench` tool.
//!
//! Nothing here is a mock: every byte crosses a real socket. By concern:
//!
//! | module | what it holds |
//! |---|---|
//! | `process` | finding the workspace's binaries ([`binary`]); [`Process`], a child killed on drop; the workers ([`Mockers`], [`NativeWorker`], [`NativeEncoder`]) and [`NatsServer`] |
//! | `gateway` | the [`Gateway`] as a child process, its admin API ([`Admin`]), and reading what it reports ([`metric_sum`], [`cached_blocks`]) |
//! | `llamacpp` | llama.cpp's own [`LlamaServer`], a third-party engine behind the gateway |
//! | `turns` | the tests of one file run together, no other file's beside them ([`turn`]; a gateway holds its file's turn) |
//! | `tls` | a throwaway certificate authority ([`TestCa`]) |
//! | `client` | an HTTP/1.1 and HTTP/2 [`Client`] over TLS or TCP whose [`Reply`] keeps each body frame's arrival time; [`chat_body`], [`sse_json`], [`DeadAddress`] |
//! | [`blocking`] | that client for tests that are not async |
//! | [`browser`] | headless Chromium over the DevTools protocol, for the dashboard |
//! | [`fixtures`] | the committed tiny models, and comparing outputs with references |
//! | [`kernel_emulation`] | CUDA kernels compiled as C++ and run on the CPU |
//! | `scripted` | a [`ScriptedEngine`] answering as a third-party engine's documented endpoints do, with figures the test sets |
//! | [`heap`] | a counting global allocator, for memory tests |
//! | [`rng`] | splitmix64, the one small deterministic generator |
//!
//! It depends on no crate of the workspace, so any package can take it as a dev-dependency.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]

pub mod blocking;
pub mod browser;
mod client;
mod cut;
pub mod fixtures;
mod gateway;
pub mod heap;
pub mod kernel_emulation;
mod llamacpp;
mod process;
pub mod rng;
mod scripted;
mod tls;
mod turns;

use std::time::{Duration, Instant};

pub use client::{Alpn, Client, Connection, DeadAddress, Reply, chat_body, sse_json};
pub use cut::CutProxy;
pub use gateway::{Admin, Gateway, cached_blocks, metric_sum};
pub use llamacpp::LlamaServer;
pub use process::{Mockers, NativeEncoder, NativeWorker, NatsServer, Process, binary};
pub use scripted::ScriptedEngine;
pub use tls::TestCa;
pub use turns::{Turn, turn};

/// Polls `check` every 50 ms until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}
