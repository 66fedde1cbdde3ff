//! GPU throughput of the native LLM's CUDA backend against the HBM roofline.
//!
//! `cargo bench -p switchyard-workers --features cuda --bench llm_cuda` prints, on GPU 0, for a
//! random-weight Llama (8 layers, hidden 768, 398 MB of f32) and (when
//! `SWITCHYARD_SMOLLM2_GGUF` names it) SmolLM2-135M: prefill tokens/s (8 sequences of 512
//! tokens in one step) and the greedy decode curve at batch 1 to 256 (each sequence at a
//! 128-token context), each step through the engine's executor interface (argmax on the GPU,
//! one token id back per sequence). The anchor is a device-to-device copy in the same run: a
//! decode step must read every weight and every sequence's cached keys and values once, so
//! `bandwidth / bytes read` steps per second is the roofline; the batch-1 row also says what
//! fraction of the copy bandwidth the step reached. Without a GPU it says so and exits.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{decode_bytes, write_random_llama};
use switchyard_llm::Model;
use switchyard_llm::cuda::{self, CudaExecutor};
use switchyard_workers::engine::{Executor, Sampler, SamplingParams, StepItem};

/// Device-to-device copy bandwidth (read + write), best of 10, 1 GiB each way.
fn hbm_bandwidth() -> f64 {
    let context = cudarc::driver::CudaContext::new(0).expect("GPU 0");
    let stream = context.default_stream();
    let words = 256 << 20;
    let source = stream.alloc_zeros::<f32>(words).expect("alloc");
    let mut target = stream.alloc_zeros::<f32>(words).expect("alloc");
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        stream.synchronize().expect("sync");
        let start = Instant::now();
        stream.memcpy_dtod(&source, &mut target).expect("copy");
        stream.synchronize().expect("sync");
        best = best.min(start.elapsed().as_secs_f64());
    }
    (2 * words * 4) as f64 / best
}

struct Sequences {
    tokens: Vec<Vec<u32>>,
    blocks: Vec<Vec<u32>>,
    samplers: Vec<Sampler>,
}

impl Sequences {
    fn new(batch: usize, context: usize, blocks_each: usize, vocab: u32) -> Sequences {
        let greedy = SamplingParams {
            temperature: 0.0,
            max_tokens: usize::MAX,
            ..SamplingParams::default()
        };
        Sequences {
            tokens: (0..batch)
                .map(|b| {
                    (0..context as u32)
                        .map(|i| (i * 7 + b as u32 * 13 + 3) % vocab)
                        .collect()
                })
                .collect(),
            blocks: (0..batch)
                .map(|b| ((b * blocks_each) as u32..((b + 1) * blocks_each) as u32).collect())
                .collect(),
            samplers: (0..batch)
                .map(|_| Sampler::new(greedy.clone()).expect("valid"))
                .collect(),
        }
    }

    /// Runs one step computing tokens `start..start + count` of the sequences in `range`.
    fn step(&mut self, executor: &mut CudaExecutor, range: std::ops::Range<usize>, start: usize, count: usize) {
        let mut items: Vec<StepItem<'_>> = self.samplers[range.clone()]
            .iter_mut()
            .zip(&self.tokens[range.clone()])
            .zip(&self.blocks[range.clone()])
            .enumerate()
            .map(|(i, ((sampler, tokens), blocks))| StepItem {
                sequence_id: (range.start + i) as u64,
                tokens: &tokens[..start + count],
                start,
                count,
                blocks,
                sampler,
                next_token: None,
                media: &[],
            })
            .collect();
        executor.execute(&mut items).expect("step");
    }
}

fn measure(label: &str, path: &Path, bandwidth: f64) {
    let model = Model::load(path).expect("model loads");
    let config = model.config().clone();
    let weights = decode_bytes(&config);
    let vocab = config.vocab_size as u32;
    let kv_per_token = (2 * config.num_layers * config.num_kv_heads * config.head_dim * 4) as f64;
    let block: usize = 16;

    // Prefill: 8 sequences of 512 tokens in one step.
    let (batch, length): (usize, usize) = (8, 512);
    let blocks_each = length.div_ceil(block);
    let mut executor = CudaExecutor::new(&model, 0, block, batch * blocks_each).expect("backend");
    let mut sequences = Sequences::new(batch, length, blocks_each, vocab);
    sequences.step(&mut executor, 0..batch, 0, length);
    let start = Instant::now();
    let mut runs = 0;
    while runs == 0 || start.elapsed() < Duration::from_secs(2) {
        sequences.step(&mut executor, 0..batch, 0, length);
        runs += 1;
    }
    let prefill = (runs * batch * length) as f64 / start.elapsed().as_secs_f64();
    println!("| {label} | prefill, {batch} × {length} tokens | {prefill:.0} tok/s | | |");
    drop(executor);

    let context: usize = 128;
    let decode_steps: usize = 64;
    for batch in [1usize, 8, 32, 64, 128, 256] {
        let blocks_each = (context + decode_steps).div_ceil(block);
        let mut executor = CudaExecutor::new(&model, 0, block, batch * blocks_each).expect("backend");
        let mut sequences = Sequences::new(batch, context + decode_steps, blocks_each, vocab);
        for first in (0..batch).step_by(32) {
            sequences.step(&mut executor, first..(first + 32).min(batch), 0, context);
        }
        // Warm up, then time decode steps at positions context..context + decode_steps.
        sequences.step(&mut executor, 0..batch, context, 1);
        let start = Instant::now();
        for position in context + 1..context + decode_steps {
            sequences.step(&mut executor, 0..batch, position, 1);
        }
        let steps_per_s = (decode_steps - 1) as f64 / start.elapsed().as_secs_f64();
        let bytes = weights + batch as f64 * (context + decode_steps / 2) as f64 * kv_per_token;
        let roofline = bandwidth / bytes * batch as f64;
        let tokens_per_s = steps_per_s * batch as f64;
        let share = if batch == 1 {
            format!(
                " (HBM: {:.1} % of the copy bandwidth)",
                100.0 * steps_per_s * bytes / bandwidth
            )
        } else {
            String::new()
        };
        println!(
            "| {label} | decode, batch {batch} | {tokens_per_s:.0} tok/s | {roofline:.0} tok/s | {:.1} %{share} |",
            100.0 * tokens_per_s / roofline
        );
    }
}

fn main() {
    if !cuda::driver_present() {
        println!("no CUDA driver on this machine: nothing to measure (run on a GPU machine)");
        return;
    }
    if cudarc::driver::CudaContext::device_count().unwrap_or(0) < 1 {
        println!("no CUDA device on this machine: nothing to measure");
        return;
    }
    let bandwidth = hbm_bandwidth();
    println!("# Native LLM forward pass on GPU 0");
    println!(
        "device-to-device copy bandwidth {:.0} GB/s (read + write, 1 GiB buffers, best of 10)\n",
        bandwidth / 1e9
    );
    println!("Roofline: a decode step reads every weight and each sequence's cached keys and values once.\n");
    println!("| model | phase | measured | HBM roofline | of roofline |");
    println!("|---|---|---:|---:|---:|");
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_llama(dir.path(), 768, 8, 12, 4, 2048, 32_000);
    measure("random Llama 8×768 (f32)", dir.path(), bandwidth);
    if let Some(gguf) = std::env::var_os("SWITCHYARD_SMOLLM2_GGUF") {
        measure("SmolLM2-135M (f32)", Path::new(&gguf), bandwidth);
    }
}
