//! The encoders on the GPU: CUDA graph replay against the eager GPU forward, per micro-batch.
//!
//! `cargo bench -p switchyard-encoders --features cuda --bench encoders_cuda [-- --runs N]`
//! writes the CPU bench's random-weight models (a CLIP ViT-B/32 at 224 px with a LLaVA projector
//! to 2048, 49 feature rows per image; a Whisper tiny encoder, 1,500 rows per 30 s window), puts
//! them on GPU 0 with graphs up to a budget of 18,432 rows (`switchyard-encoder`'s default
//! largest), and times each micro-batch size both ways: p50 and p99 over `N` runs (50), and
//! graph against eager in the same run (vLLM reports p99 −31 % to −85 % for its encoder graphs,
//! vllm-project/vllm#35963). Each timing includes the
//! host-to-device copy in and the copy out. Then the tiled attention kernel against the first
//! one (a block per query row) at a few batch sizes, graphs both. Without a GPU it says so and
//! exits. Figures are printed, never asserted.

use std::time::Instant;

use switchyard_encoders::cuda::vision::CudaVision;
use switchyard_encoders::cuda::whisper::CudaWhisper;
use switchyard_encoders::cuda::{AttentionKernel, CudaError, Path, SetupError};
use switchyard_encoders::image::PixelValues;
use switchyard_encoders::vit::VisionEncoder;
use switchyard_encoders::whisper::WhisperEncoder;

mod common;
use common::{Noise, write_clip_llava, write_whisper_tiny};

const MAX_BUDGET: usize = 18_432;

/// p50 and p99 of `runs` timed calls (after two warm-up calls), in milliseconds.
fn percentiles(runs: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    f();
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

fn header(name: &str) {
    println!("\n{name}");
    println!("| micro-batch | path | eager p50 ms | eager p99 ms | graph p50 ms | graph p99 ms | p99 graph vs eager |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
}

fn row(batch: usize, path: Path, eager: (f64, f64), graph: (f64, f64)) {
    println!(
        "| {batch} | {path:?} | {:.3} | {:.3} | {:.3} | {:.3} | {:+.0} % |",
        eager.0,
        eager.1,
        graph.0,
        graph.1,
        (graph.1 / eager.1 - 1.0) * 100.0
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(50);
    let dir = tempfile::tempdir().expect("tempdir");
    let (vision_dir, audio_dir) = (dir.path().join("clip-llava"), dir.path().join("whisper"));
    std::fs::create_dir_all(&vision_dir).expect("dir");
    std::fs::create_dir_all(&audio_dir).expect("dir");
    write_clip_llava(&vision_dir);
    write_whisper_tiny(&audio_dir);
    let vision = VisionEncoder::load(&vision_dir).expect("vision model loads");
    let mut gpu = match CudaVision::new(&vision, 0, MAX_BUDGET) {
        Ok(gpu) => gpu,
        Err(
            err @ (CudaError::Setup(SetupError::NoDriver)
            | CudaError::Setup(SetupError::NoDevice { .. })
            | CudaError::Setup(SetupError::NoCublas)
            | CudaError::Setup(SetupError::NoNvrtc)),
        ) => {
            println!("no GPU here ({err}): nothing to measure");
            return;
        }
        Err(err) => panic!("{err}"),
    };
    println!("encoders on GPU 0, f32, CUDA graphs at power-of-two budgets up to {MAX_BUDGET} rows; {runs} runs each");
    let mut noise = Noise(3);
    let images: Vec<PixelValues> = (0..512)
        .map(|_| PixelValues {
            height: 224,
            width: 224,
            data: (0..3 * 224 * 224).map(|_| noise.next() * 20.0).collect(),
        })
        .collect();
    header("CLIP ViT-B/32 at 224 px + LLaVA projector (49 rows per image)");
    let mut vision_tiled = Vec::new();
    for batch in [1, 2, 4, 8, 16, 32, 64, 128, 376, 512] {
        let refs: Vec<&PixelValues> = images[..batch].iter().collect();
        let eager = percentiles(runs, || {
            gpu.encode_eager(&refs).expect("eager");
        });
        let graph = percentiles(runs, || {
            gpu.encode(&refs).expect("graph");
        });
        row(batch, gpu.path_for(224, 224, batch), eager, graph);
        vision_tiled.push((batch, graph));
    }
    let whisper = WhisperEncoder::load(&audio_dir).expect("whisper loads");
    let mut audio = CudaWhisper::new(&whisper, 0, MAX_BUDGET).expect("whisper on the GPU");
    let mels: Vec<Vec<f32>> = (0..16)
        .map(|_| (0..80 * 3000).map(|_| noise.next() * 10.0).collect())
        .collect();
    header("Whisper tiny encoder, 30 s windows (1,500 rows each)");
    let mut audio_tiled = Vec::new();
    for batch in [1, 2, 4, 8, 12, 16] {
        let refs: Vec<&[f32]> = mels[..batch].iter().map(Vec::as_slice).collect();
        let eager = percentiles(runs, || {
            audio.forward(&refs, false).expect("eager");
        });
        let graph = percentiles(runs, || {
            audio.forward(&refs, true).expect("graph");
        });
        audio_tiled.push((batch, graph));
        let path = if batch * 1500 <= MAX_BUDGET {
            Path::Replay
        } else {
            Path::Eager
        };
        row(batch, path, eager, graph);
    }
    let counters = audio.counters();
    println!(
        "\nWhisper graph cache: {} captures, {} replays, {} eager runs",
        counters.captures.load(std::sync::atomic::Ordering::Relaxed),
        counters.replays.load(std::sync::atomic::Ordering::Relaxed),
        counters.eager.load(std::sync::atomic::Ordering::Relaxed)
    );

    // The baseline of the attention kernel: the same graphs with the first kernel (one block
    // per query row, every key read per row).
    println!("\nAttention kernels, graph path: tiled (the default) against one block per query row");
    println!("| encoder | micro-batch | rows p50 ms | rows p99 ms | tiled p50 ms | tiled p99 ms | p50 tiled vs rows |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    gpu.set_attention_kernel(AttentionKernel::Rows);
    audio.set_attention_kernel(AttentionKernel::Rows);
    let compare = |name: &str, batch: usize, rows: (f64, f64), tiled: (f64, f64)| {
        println!(
            "| {name} | {batch} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2}x |",
            rows.0,
            rows.1,
            tiled.0,
            tiled.1,
            rows.0 / tiled.0
        );
    };
    for &(batch, tiled) in vision_tiled.iter().filter(|(b, _)| [1, 32, 376].contains(b)) {
        let refs: Vec<&PixelValues> = images[..batch].iter().collect();
        let rows = percentiles(runs, || {
            gpu.encode(&refs).expect("graph");
        });
        compare("CLIP ViT-B/32", batch, rows, tiled);
    }
    for &(batch, tiled) in audio_tiled.iter().filter(|(b, _)| [1, 4, 12].contains(b)) {
        let refs: Vec<&[f32]> = mels[..batch].iter().map(Vec::as_slice).collect();
        let rows = percentiles(runs, || {
            audio.forward(&refs, true).expect("graph");
        });
        compare("Whisper tiny", batch, rows, tiled);
    }
}
