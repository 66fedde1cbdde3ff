//! CPU throughput of the native LLM's forward pass against the memory-bandwidth roofline.
//!
//! `cargo bench -p switchyard-llm --bench llm_cpu` prints, for the tiny fixture model, a
//! larger random-weight Llama written to a temporary directory as real safetensors, and (when
//! `SWITCHYARD_SMOLLM2_GGUF` names it; see `scripts/fetch-wheel.sh smollm2`) the real SmolLM2-135M:
//! prefill tokens/s (one sequence, one chunk), decode tokens/s at batch 1, 8 and 32 (each
//! sequence with a 128-token context; for SmolLM2 in f32 and f16 caches, and at batch 8 with a
//! 1,024-token context in each), and the same model behind the engine (32 requests at
//! once through the scheduler: continuous batching, sampling, token streams). The anchor is a
//! STREAM-like copy in the same run: a decode step must read every weight once (as the model
//! keeps it: GGUF's quantized blocks as stored, everything else f32; an untied embedding table
//! one row per token), so `bandwidth / bytes read` steps per second is the memory roofline, and
//! batch B can at best make B tokens per such step. SmolLM2 runs twice: with its Q4_1/Q8_0
//! weights kept quantized, and widened to f32 (the path before quantized kernels), with the
//! resident memory each took to load. Figures are printed, never asserted.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

mod common;
mod decoding;

use common::write_random_llama;
use decoding::{Decoding, prefill_once};
use switchyard_llm::{KvPrecision, Model, spawn_cpu_engine};
use switchyard_workers::engine::{EngineConfig, Output, SamplingParams};

/// Bytes per second of a plain copy of a buffer much larger than the caches (read + write).
fn copy_bandwidth() -> f64 {
    let words = 64 << 20; // 256 MiB of f32 each way
    let source: Vec<f32> = (0..words).map(|i| i as f32).collect();
    let mut target = vec![0.0f32; words];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        target.copy_from_slice(black_box(&source));
        best = best.min(start.elapsed().as_secs_f64());
        black_box(&mut target);
    }
    (2 * words * 4) as f64 / best
}

fn weight_bytes(dir: &Path) -> u64 {
    std::fs::metadata(dir.join("model.safetensors")).map_or(0, |m| m.len())
}

/// Runs `f` until `budget` has passed (at least once); returns runs per second.
fn rate(budget: Duration, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut runs = 0u32;
    while runs == 0 || start.elapsed() < budget {
        f();
        runs += 1;
    }
    f64::from(runs) / start.elapsed().as_secs_f64()
}

/// This process's resident memory in bytes (`VmRSS`), 0 where unknown.
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// The resident memory of a fresh process (this bench, re-run) after loading `gguf`, widened
/// to f32 or not: what a worker serving it holds, before any KV cache.
fn resident_in_child(gguf: &Path, widened: bool) -> u64 {
    let output = std::process::Command::new(std::env::current_exe().expect("own path"))
        .env(RESIDENT_PROBE, gguf)
        .env(RESIDENT_WIDENED, if widened { "1" } else { "0" })
        .output()
        .expect("re-runs itself");
    String::from_utf8_lossy(&output.stdout).trim().parse().unwrap_or(0)
}

/// The context of the long-context decode rows.
const LONG_CONTEXT: usize = 1024;

/// Set in the child [`resident_in_child`] starts: the model to load.
const RESIDENT_PROBE: &str = "SWITCHYARD_LLM_CPU_RESIDENT_OF";
/// Set in that child: `1` to widen the model after loading it.
const RESIDENT_WIDENED: &str = "SWITCHYARD_LLM_CPU_RESIDENT_WIDENED";

/// The child's side: load, report `VmRSS` in bytes, exit.
fn resident_probe(gguf: &Path) {
    let model = Model::load(gguf).expect("model loads");
    let model = if std::env::var(RESIDENT_WIDENED).as_deref() == Ok("1") {
        let widened = model.widened();
        drop(model);
        widened
    } else {
        model
    };
    println!("{}", resident_bytes());
    drop(black_box(model));
}

fn measure(label: &str, model: Model, prefill_tokens: usize, bandwidth: f64, caches: &[KvPrecision]) {
    let bytes = model.decode_step_bytes() as f64;
    let vocab = model.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..prefill_tokens as u32).map(|i| (i * 7 + 3) % vocab).collect();
    let prefill_per_s = rate(Duration::from_secs(3), || prefill_once(&model, &tokens)) * prefill_tokens as f64;
    let roofline_steps = bandwidth / bytes;
    println!("| {label} | prefill ({prefill_tokens} tokens) | {prefill_per_s:.0} tok/s | | |");
    let context: usize = 128;
    let mut runs: Vec<(KvPrecision, usize, usize)> = caches
        .iter()
        .flat_map(|&precision| [1usize, 8, 32].map(|batch| (precision, batch, context)))
        .collect();
    // Where both caches are measured, also a long context, where decode attention reads more
    // bytes of cache than of weights.
    if caches.len() > 1 {
        runs.extend(caches.iter().map(|&precision| (precision, 8, LONG_CONTEXT)));
    }
    for (precision, batch, context) in runs {
        let prompt: Vec<u32> = (0..context as u32).map(|i| (i * 7 + 3) % vocab).collect();
        let mut decoding = Decoding::new(&model, &prompt, batch, precision);
        let steps_per_s = rate(Duration::from_secs(3), || decoding.step(&model));
        let tokens_per_s = steps_per_s * batch as f64;
        let roofline = roofline_steps * batch as f64;
        let cache = match precision {
            KvPrecision::F32 => "",
            KvPrecision::F16 => ", f16 KV cache",
        };
        let long = if context == LONG_CONTEXT {
            format!(", {context}-token context")
        } else {
            String::new()
        };
        println!(
            "| {label} | decode, batch {batch}{long}{cache} | {tokens_per_s:.0} tok/s | {roofline:.0} tok/s | {:.1} % |",
            100.0 * tokens_per_s / roofline
        );
    }
    engine(label, model, &tokens[..context], roofline_steps);
}

/// 32 requests of a 128-token prompt and 64 generated tokens each, all submitted at once to
/// the engine; prints generated tokens per second of wall time (prefill included).
fn engine(label: &str, model: Model, prompt: &[u32], roofline_steps: f64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let requests = 32;
    let generate = 64;
    let engine = spawn_cpu_engine(
        model,
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: requests * (prompt.len() + generate).div_ceil(16) + 64,
            max_num_batched_tokens: 2048,
            max_num_seqs: requests,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let start = Instant::now();
    let generated = runtime.block_on(async {
        let receivers: Vec<_> = (0..requests)
            .map(|r| {
                // Distinct prompts: no prefix-cache hits between them.
                let mut prompt = prompt.to_vec();
                prompt[0] = r as u32;
                engine
                    .submit(
                        prompt,
                        SamplingParams {
                            temperature: 0.0,
                            max_tokens: generate,
                            ..SamplingParams::default()
                        },
                    )
                    .expect("accepted")
            })
            .collect();
        let mut generated = 0usize;
        for mut receiver in receivers {
            while let Some(output) = receiver.recv().await {
                match output {
                    Output::Token(_) => generated += 1,
                    Output::Finished { .. } => break,
                    Output::Started { .. } => {}
                    Output::Failed(reason) => panic!("{reason}"),
                }
            }
        }
        generated
    });
    let tokens_per_s = generated as f64 / start.elapsed().as_secs_f64();
    let roofline = roofline_steps * requests as f64;
    println!(
        "| {label} | engine, {requests} requests × {} prompt + {generate} generated | {tokens_per_s:.0} tok/s | {roofline:.0} tok/s (decode, batch {requests}) | {:.1} % |",
        prompt.len(),
        100.0 * tokens_per_s / roofline
    );
}

/// The anchors on the same GGUF file and threads: candle 0.11's quantized Llama (`candle`
/// rows) and llama.cpp's `llama-bench` where one is built (`llama.cpp` rows), 512-token
/// prefill and batch-1 decode after a 128-token context, as our rows measure them.
fn anchors(gguf: &Path, threads: usize) {
    match candle(gguf) {
        Ok((prefill, decode)) => {
            println!("| candle 0.11 (same GGUF) | prefill (512 tokens) | {prefill:.0} tok/s | | |");
            println!("| candle 0.11 (same GGUF) | decode, batch 1 | {decode:.0} tok/s | | |");
        }
        Err(err) => println!("| candle 0.11 (same GGUF) | skipped: {err} | | | |"),
    }
    match llama_cpp(gguf, threads) {
        Ok((prefill, decode)) => {
            println!("| llama.cpp (same GGUF) | prefill (512 tokens) | {prefill:.0} tok/s | | |");
            println!("| llama.cpp (same GGUF) | decode, batch 1 | {decode:.0} tok/s | | |");
        }
        Err(reason) => println!("| llama.cpp (same GGUF) | skipped: {reason} | | | |"),
    }
}

/// candle's prefill and batch-1 decode tokens per second on `gguf`.
fn candle(gguf: &Path) -> candle_core::Result<(f64, f64)> {
    use candle_core::quantized::gguf_file;
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_llama::ModelWeights;

    let device = Device::Cpu;
    let mut file = std::fs::File::open(gguf)?;
    let content = gguf_file::Content::read(&mut file)?;
    let vocab = content
        .metadata
        .get("llama.vocab_size")
        .and_then(|value| value.to_u32().ok())
        .unwrap_or(32_000);
    let mut model = ModelWeights::from_gguf(content, &mut file, &device)?;
    let tokens: Vec<u32> = (0..512u32).map(|i| (i * 7 + 3) % vocab).collect();
    let prompt = Tensor::new(&tokens[..], &device)?.unsqueeze(0)?;
    // At position 0 the model replaces its cache, so every run is a fresh prefill.
    let mut failure = None;
    let prefill = rate(Duration::from_secs(3), || {
        if let Err(err) = model.forward(&prompt, 0).map(black_box) {
            failure = Some(err);
        }
    }) * tokens.len() as f64;
    if let Some(err) = failure {
        return Err(err);
    }
    let context = 128;
    let steps = 60;
    let (mut decoded, mut spent) = (0usize, Duration::ZERO);
    while spent < Duration::from_secs(3) {
        model.forward(&Tensor::new(&tokens[..context], &device)?.unsqueeze(0)?, 0)?;
        let start = Instant::now();
        for step in 0..steps {
            let next = Tensor::new(&[5u32], &device)?.unsqueeze(0)?;
            black_box(model.forward(&next, context + step)?);
        }
        spent += start.elapsed();
        decoded += steps;
    }
    Ok((prefill, decoded as f64 / spent.as_secs_f64()))
}

/// llama.cpp's `llama-bench` (named by `SWITCHYARD_LLAMA_BENCH`; `scripts/build-llama-cpp.sh`
/// builds one from the `llama-cpp-python` source distribution) on `threads` threads: a 512-token
/// prefill, and 128 tokens generated after a 128-token context (`-d 128`), as our rows measure.
fn llama_cpp(gguf: &Path, threads: usize) -> Result<(f64, f64), String> {
    let Some(binary) = std::env::var_os("SWITCHYARD_LLAMA_BENCH") else {
        return Err("set SWITCHYARD_LLAMA_BENCH=$(scripts/build-llama-cpp.sh) to include it".into());
    };
    let run = |test: &[&str]| -> Result<f64, String> {
        let output = std::process::Command::new(&binary)
            .arg("-m")
            .arg(gguf)
            .args(test)
            .args(["-r", "3", "-o", "jsonl", "-t", &threads.to_string()])
            .output()
            .map_err(|err| format!("{}: {err}", Path::new(&binary).display()))?;
        if !output.status.success() {
            return Err(format!(
                "llama-bench failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
                    .lines()
                    .last()
                    .unwrap_or_default()
            ));
        }
        // One JSON object per test; `avg_ts` is its tokens per second.
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find_map(|test| test["avg_ts"].as_f64())
            .ok_or_else(|| "no result in llama-bench's output".into())
    };
    let prefill = run(&["-p", "512", "-n", "0"])?;
    let decode = run(&["-p", "0", "-n", "128", "-d", "128"])?;
    Ok((prefill, decode))
}

fn main() {
    if let Some(gguf) = std::env::var_os(RESIDENT_PROBE) {
        resident_probe(Path::new(&gguf));
        return;
    }
    let bandwidth = copy_bandwidth();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("# Native LLM forward pass on the CPU");
    println!(
        "{threads} hardware threads; copy bandwidth {:.1} GB/s (read + write, 256 MiB buffers, best of 5)\n",
        bandwidth / 1e9
    );
    println!(
        "Roofline: a decode step reads every weight once (the untied embedding table one row per token), so at most bandwidth / bytes read steps per second; batch B makes B tokens per step.\n"
    );
    println!("| model | phase | measured | memory roofline | of roofline |");
    println!("|---|---|---:|---:|---:|");
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    measure(
        &format!("tiny-llama ({:.2} MB f32)", weight_bytes(&tiny) as f64 / 1e6),
        Model::load(&tiny).expect("model loads"),
        192,
        bandwidth,
        &[KvPrecision::F32],
    );
    let dir = tempfile::tempdir().expect("tempdir");
    // ~110 M parameters: 8 layers, hidden 768, GQA 12/4 heads, MLP 2048, vocab 32000.
    write_random_llama(dir.path(), 768, 8, 12, 4, 2048, 32_000);
    measure(
        &format!(
            "random Llama 8×768 ({:.0} MB f32)",
            weight_bytes(dir.path()) as f64 / 1e6
        ),
        Model::load(dir.path()).expect("model loads"),
        512,
        bandwidth,
        &[KvPrecision::F32],
    );
    if let Some(gguf) = std::env::var_os("SWITCHYARD_SMOLLM2_GGUF") {
        let gguf = Path::new(&gguf);
        let file_bytes = std::fs::metadata(gguf).map_or(0, |m| m.len());
        let quantized_resident = resident_in_child(gguf, false);
        let widened_resident = resident_in_child(gguf, true);
        let model = Model::load(gguf).expect("model loads");
        let widened = model.widened();
        measure(
            "SmolLM2-135M (Q4_1 GGUF, kept quantized)",
            model,
            512,
            bandwidth,
            &[KvPrecision::F32, KvPrecision::F16],
        );
        measure(
            "SmolLM2-135M (Q4_1 GGUF, widened to f32)",
            widened,
            512,
            bandwidth,
            &[KvPrecision::F32],
        );
        anchors(gguf, threads);
        println!(
            "\nSmolLM2-135M: GGUF file {:.1} MB; resident memory after loading it in a fresh process: {:.1} MB kept quantized ({:.2}× the file), {:.1} MB widened to f32 ({:.2}×); kernels: {:?}",
            file_bytes as f64 / 1e6,
            quantized_resident as f64 / 1e6,
            quantized_resident as f64 / file_bytes.max(1) as f64,
            widened_resident as f64 / 1e6,
            widened_resident as f64 / file_bytes.max(1) as f64,
            switchyard_llm::quant::isa(),
        );
    } else {
        println!(
            "| candle 0.11 | skipped: set SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2) to include it | | | |"
        );
        println!(
            "| llama.cpp | skipped: set SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2) to include it | | | |"
        );
        println!(
            "\n(SmolLM2-135M skipped: set SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-wheel.sh smollm2) to include it)"
        );
    }
}
