//! GPU throughput of the native LLM's CUDA backend against the HBM roofline.
//!
//! `cargo bench -p switchyard-llm --features cuda --bench llm_cuda` prints, on GPU 0, for a
//! random-weight Llama (8 layers, hidden 768, 398 MB of f32) and (when
//! `SWITCHYARD_SMOLLM2_GGUF` names it) SmolLM2-135M: prefill tokens/s (8 sequences of 512
//! tokens in one step) and the greedy decode curve at batch 1 to 256 (each sequence past a
//! 128-token context), each step through the engine's executor interface (argmax on the GPU,
//! one token id back per sequence): kernel by kernel (the baseline), then by CUDA graph replay
//! (the default), in the same run on the same executor (batches of 24 and 100 pay for their
//! buckets' padding, 32 and 128); then, at the batch sizes that take it, the default decode
//! attention kernel against the first one on the graphs' steps again; then decode at batch 32
//! and 128 past a 1,024-token context with the KV cache in f32 and in f16; then decode at batch
//! 1 to 64 past a 1,024-token context with each (row, head)'s keys split over several blocks
//! (flash-decoding, the default) and in one block. The anchor is a
//! device-to-device copy in the same run: a decode step must read every weight and every
//! sequence's cached keys and values once, so `bandwidth / bytes read` steps per second is the
//! roofline; the batch-1 row also says what fraction of the copy bandwidth the step reached. Without a GPU it says so and exits.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{decode_bytes, write_random_llama};
use switchyard_llm::cuda::{self, AttentionKernel, CudaExecutor};
use switchyard_llm::{KvPrecision, Model};
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

/// Prints the model's rows of the main table; returns its rows of the attention-kernel table.
fn measure(label: &str, path: &Path, bandwidth: f64) -> Vec<String> {
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
    println!("| {label} | prefill, {batch} × {length} tokens | {prefill:.0} tok/s | | | |");
    drop(executor);

    let context: usize = 128;
    let decode_steps: usize = 64;
    let mut kernel_rows = Vec::new();
    for batch in [1usize, 8, 24, 32, 64, 100, 128, 256] {
        // Room for two runs of steps: eager, then graphs (the attention comparison repeats the
        // graphs' positions, recomputing the same keys and values).
        let blocks_each = (context + 2 * decode_steps).div_ceil(block);
        let mut executor = CudaExecutor::new(&model, 0, block, batch * blocks_each).expect("backend");
        let mut sequences = Sequences::new(batch, context + 2 * decode_steps, blocks_each, vocab);
        for first in (0..batch).step_by(32) {
            sequences.step(&mut executor, first..(first + 32).min(batch), 0, context);
        }
        // Steps per second over `decode_steps - 1` steps from `from`, after one warm-up step
        // (which captures the bucket's graph when graphs are on).
        let mut time = |executor: &mut CudaExecutor, from: usize| {
            sequences.step(executor, 0..batch, from, 1);
            let start = Instant::now();
            for position in from + 1..from + decode_steps {
                sequences.step(executor, 0..batch, position, 1);
            }
            (decode_steps - 1) as f64 / start.elapsed().as_secs_f64()
        };
        executor.set_decode_graphs(false);
        let eager = time(&mut executor, context);
        executor.set_decode_graphs(true);
        let graphs = time(&mut executor, context + decode_steps);
        if [1, 8, 32, 64].contains(&batch) {
            // The graphs' steps again with the first attention kernel (a warp per key).
            executor.set_attention_kernel(AttentionKernel::ByWarp);
            let by_warp = time(&mut executor, context + decode_steps);
            executor.set_attention_kernel(AttentionKernel::ByKey);
            let b = batch as f64;
            kernel_rows.push(format!(
                "| {label} | {batch} | {:.0} tok/s | {:.0} tok/s | {:.2}x |",
                graphs * b,
                by_warp * b,
                graphs / by_warp
            ));
        }
        let bytes = weights + batch as f64 * (context + decode_steps + decode_steps / 2) as f64 * kv_per_token;
        let roofline = bandwidth / bytes * batch as f64;
        let (tokens_per_s, eager_tokens_per_s) = (graphs * batch as f64, eager * batch as f64);
        let share = if batch == 1 {
            format!(
                " (HBM: {:.1} % of the copy bandwidth)",
                100.0 * graphs * bytes / bandwidth
            )
        } else {
            String::new()
        };
        println!(
            "| {label} | decode, batch {batch} (graph bucket {}) | {tokens_per_s:.0} tok/s | {eager_tokens_per_s:.0} tok/s ({:.2}x) | {roofline:.0} tok/s | {:.1} %{share} |",
            batch.next_power_of_two(),
            graphs / eager,
            100.0 * tokens_per_s / roofline
        );
    }
    kernel_rows
}

/// The long-context tables' decode: 32 steps past a 1,024-token context, in 16-token blocks.
const LONG_CONTEXT: usize = 1024;
const LONG_STEPS: usize = 32;
const LONG_BLOCK: usize = 16;

/// KV blocks each sequence of a long-context run takes.
const LONG_BLOCKS_EACH: usize = (LONG_CONTEXT + LONG_STEPS).div_ceil(LONG_BLOCK);

/// Tokens per second of `batch` sequences decoding with graphs past a [`LONG_CONTEXT`]-token
/// context on `executor` (its cache `batch × LONG_BLOCKS_EACH` blocks of [`LONG_BLOCK`]
/// tokens): prefilled 32 at a time, one step to capture the bucket's graph, then timed.
fn long_context_rate(executor: &mut CudaExecutor, batch: usize, vocab: u32) -> f64 {
    let mut sequences = Sequences::new(batch, LONG_CONTEXT + LONG_STEPS, LONG_BLOCKS_EACH, vocab);
    for first in (0..batch).step_by(32) {
        sequences.step(executor, first..(first + 32).min(batch), 0, LONG_CONTEXT);
    }
    sequences.step(executor, 0..batch, LONG_CONTEXT, 1);
    let start = Instant::now();
    for position in LONG_CONTEXT + 1..LONG_CONTEXT + LONG_STEPS {
        sequences.step(executor, 0..batch, position, 1);
    }
    ((LONG_STEPS - 1) * batch) as f64 / start.elapsed().as_secs_f64()
}

/// Decode with graphs at a 1,024-token context, where the cache's bytes outweigh the weights',
/// in an f32 cache and in an f16 one; the model's rows of the cache table.
fn cache_rows(label: &str, path: &Path) -> Vec<String> {
    let model = Model::load(path).expect("model loads");
    let vocab = model.config().vocab_size as u32;
    let mut rows = Vec::new();
    for batch in [32usize, 128] {
        let rate = |precision: KvPrecision| {
            let blocks = batch * LONG_BLOCKS_EACH;
            let mut executor = CudaExecutor::with_precision(&model, 0, LONG_BLOCK, blocks, precision).expect("backend");
            long_context_rate(&mut executor, batch, vocab)
        };
        let (f32_rate, f16_rate) = (rate(KvPrecision::F32), rate(KvPrecision::F16));
        rows.push(format!(
            "| {label} | {batch} | {LONG_CONTEXT} | {f32_rate:.0} tok/s | {f16_rate:.0} tok/s | {:.2}x |",
            f16_rate / f32_rate
        ));
    }
    rows
}

/// Decode with graphs at a 1,024-token context with each (row, head)'s keys split over several
/// blocks (flash-decoding, the default) and in one block; the model's rows of the split table.
fn split_rows(label: &str, path: &Path) -> Vec<String> {
    let model = Model::load(path).expect("model loads");
    let vocab = model.config().vocab_size as u32;
    let mut rows = Vec::new();
    for batch in [1usize, 8, 32, 64] {
        let rate = |kernel: AttentionKernel| {
            let mut executor = CudaExecutor::new(&model, 0, LONG_BLOCK, batch * LONG_BLOCKS_EACH).expect("backend");
            executor.set_attention_kernel(kernel);
            long_context_rate(&mut executor, batch, vocab)
        };
        let (split, whole) = (rate(AttentionKernel::ByKey), rate(AttentionKernel::ByKeyUnsplit));
        rows.push(format!(
            "| {label} | {batch} | {LONG_CONTEXT} | {split:.0} tok/s | {whole:.0} tok/s | {:.2}x |",
            split / whole
        ));
    }
    rows
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
    println!("| model | phase | measured | decode without graphs (graphs' speed-up) | HBM roofline | of roofline |");
    println!("|---|---|---:|---:|---:|---:|");
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_llama(dir.path(), 768, 8, 12, 4, 2048, 32_000);
    let mut kernels = measure("random Llama 8×768 (f32)", dir.path(), bandwidth);
    let mut caches = cache_rows("random Llama 8×768 (f32)", dir.path());
    let mut splits = split_rows("random Llama 8×768 (f32)", dir.path());
    if let Some(gguf) = std::env::var_os("SWITCHYARD_SMOLLM2_GGUF") {
        kernels.extend(measure("SmolLM2-135M (f32)", Path::new(&gguf), bandwidth));
        caches.extend(cache_rows("SmolLM2-135M (f32)", Path::new(&gguf)));
        splits.extend(split_rows("SmolLM2-135M (f32)", Path::new(&gguf)));
    }
    println!(
        "\nDecode with graphs: the attention kernel (a thread per key, the default) against the first (a warp per key)\n"
    );
    println!("| model | decode batch | thread per key | warp per key | speed-up |");
    println!("|---|---:|---:|---:|---:|");
    for row in kernels {
        println!("{row}");
    }
    println!("\nDecode with graphs at a long context: the KV cache in f32 against f16 (`--kv-cache-dtype f16`)\n");
    println!("| model | decode batch | context | f32 cache | f16 cache | speed-up |");
    println!("|---|---:|---:|---:|---:|---:|");
    for row in caches {
        println!("{row}");
    }
    println!(
        "\nDecode with graphs at a long context: each (row, head)'s keys split over several blocks (flash-decoding, the default) against one block\n"
    );
    println!("| model | decode batch | context | split | one block | speed-up |");
    println!("|---|---:|---:|---:|---:|---:|");
    for row in splits {
        println!("{row}");
    }
}
