//! The encoders on the GPU (feature `cuda`): their kernels compile under NVRTC (no GPU needed),
//! and on a machine with a GPU, CUDA graph replay, the eager GPU forward and the CPU forward
//! agree — a micro-batch that fills its budget, one that does not (zeroed padding), one above
//! every budget (eager), and graphs replayed again with other inputs.
//!
//! Without NVRTC or a GPU these tests say so and pass, unless `SWITCHYARD_CUDA_TESTS` asks for
//! them: `nvrtc` makes a missing NVRTC a failure (CI installs it from PyPI), `gpu` makes a
//! missing GPU one too (run it on a GPU machine). Tolerances are fp16's (2e-3 on values of
//! magnitude ~1): GPU products sum in another order, and graphs of another size may pick
//! other cuBLAS kernels.
#![cfg(feature = "cuda")]

use std::sync::atomic::Ordering;

use switchyard_encoders::cuda::vision::CudaVision;
use switchyard_encoders::cuda::whisper::CudaWhisper;
use switchyard_encoders::cuda::{self, AttentionKernel, CudaError, Path as RunPath, SetupError};
use switchyard_encoders::image::{ImageProcessor, PixelValues};
use switchyard_encoders::mel::{LogMel, MelConfig};
use switchyard_encoders::vit::VisionEncoder;
use switchyard_encoders::whisper::WhisperEncoder;
use switchyard_encoders::{audio, video};
use switchyard_harness::fixtures::{self, max_difference};

const TOLERANCE: f32 = 2e-3;

fn required(level: &str) -> bool {
    std::env::var("SWITCHYARD_CUDA_TESTS").is_ok_and(|value| value == level || value == "gpu")
}

/// `result`'s value, or `None` (with a note) where the machine has no GPU and none is required.
fn on_gpu<T>(result: Result<T, CudaError>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(
            err @ (CudaError::Setup(SetupError::NoDriver)
            | CudaError::Setup(SetupError::NoDevice { .. })
            | CudaError::Setup(SetupError::NoCublas)),
        ) if !required("gpu") => {
            eprintln!("skipped: {err} (SWITCHYARD_CUDA_TESTS=gpu makes this a failure)");
            None
        }
        Err(err) => panic!("{err}"),
    }
}

#[test]
fn kernels_compile_with_nvrtc() {
    let _turn = switchyard_harness::turn();
    match cuda::compile_kernels() {
        Ok(ptx) => {
            let ptx = ptx.to_src();
            for name in cuda::KERNEL_NAMES {
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "no kernel `{name}` in the PTX"
                );
            }
        }
        Err(CudaError::Setup(SetupError::NoNvrtc)) if !required("nvrtc") => {
            eprintln!("skipped: no libnvrtc here (SWITCHYARD_CUDA_TESTS=nvrtc makes this a failure)");
        }
        Err(err) => panic!("{err}"),
    }
}

#[test]
fn asking_for_a_missing_device_is_a_clear_error() {
    let _turn = switchyard_harness::turn();
    let encoder = VisionEncoder::load(&fixtures::encoder("tiny-llava")).expect("loads");
    match CudaVision::new(&encoder, 4096, 64) {
        Err(
            CudaError::Setup(SetupError::NoDevice { ordinal: 4096, .. })
            | CudaError::Setup(SetupError::NoDriver)
            | CudaError::Setup(SetupError::NoCublas),
        ) => {}
        Err(CudaError::Setup(SetupError::NoNvrtc)) if !required("nvrtc") => {}
        other => panic!("expected a missing-device error, got {other:?}"),
    }
}

#[test]
fn budgets_are_powers_of_two_up_to_the_largest() {
    let _turn = switchyard_harness::turn();
    assert_eq!(cuda::budgets_up_to(64), vec![1, 2, 4, 8, 16, 32, 64]);
    assert_eq!(cuda::budgets_up_to(18_432)[14..], [16_384, 18_432]);
}

/// The tiny LLaVA's preprocessed fixture images and video frames (all 32 × 32).
fn vision_inputs(processor: &ImageProcessor) -> Vec<PixelValues> {
    let mut out: Vec<PixelValues> = ["gradient.png", "photo.jpg", "alpha.webp", "anim.gif", "gray.png"]
        .iter()
        .map(|name| {
            let bytes = std::fs::read(fixtures::encoder(&format!("images/{name}"))).expect("image fixture");
            processor.preprocess(&bytes).expect("preprocesses")
        })
        .collect();
    let mp4 = std::fs::read(fixtures::encoder("videos/baseline.mp4")).expect("video fixture");
    for frame in video::decode_frames(&mp4, &[0, 9, 19], 1 << 20).expect("decodes") {
        out.push(processor.preprocess_rgb(&frame.to_rgb()).expect("preprocesses"));
    }
    out
}

#[test]
fn vision_graph_replay_matches_eager_gpu_and_cpu() {
    let _turn = switchyard_harness::turn();
    let dir = fixtures::encoder("tiny-llava");
    let encoder = VisionEncoder::load(&dir).expect("loads");
    let processor = ImageProcessor::from_file(&dir.join("preprocessor_config.json")).expect("processor");
    let inputs = vision_inputs(&processor);
    for kernel in [AttentionKernel::Tiled, AttentionKernel::Rows] {
        // 16 feature rows per 32-pixel image; budgets 16, 32, 64 hold 1, 2 and 4 images.
        let Some(mut gpu) = on_gpu(CudaVision::new(&encoder, 0, 64)) else {
            return;
        };
        gpu.set_attention_kernel(kernel);
        println!("{kernel:?} attention");
        vision_cases(&gpu, &encoder, &inputs);
    }
}

fn vision_cases(gpu: &CudaVision, encoder: &VisionEncoder, inputs: &[PixelValues]) {
    let cases: [(&[usize], RunPath); 5] = [
        (&[0, 1, 2, 3], RunPath::Replay),         // fills the 64 budget
        (&[4, 5, 6], RunPath::Replay),            // 3 of 4: the fourth slot is zeroed padding
        (&[7], RunPath::Replay),                  // the 16 budget
        (&[0, 1, 2, 3, 4, 5, 6], RunPath::Eager), // above every budget
        (&[6, 5, 0], RunPath::Replay),            // the 64 graph again, other inputs
    ];
    for (members, path) in cases {
        let batch: Vec<&PixelValues> = members.iter().map(|&i| &inputs[i]).collect();
        assert_eq!(gpu.path_for(32, 32, batch.len()), path, "{members:?}");
        let replays = gpu.counters().replays.load(Ordering::Relaxed);
        let graph = gpu.encode(&batch).expect("graph or eager");
        let eager = gpu.encode_eager(&batch).expect("eager");
        let cpu = encoder.encode(&batch).expect("cpu");
        assert_eq!(graph.tokens, cpu.tokens);
        let (vs_eager, vs_cpu) = (
            max_difference(&graph.data, &eager.data),
            max_difference(&graph.data, &cpu.data),
        );
        println!("{members:?} ({path:?}): graph vs eager {vs_eager:e}, graph vs CPU {vs_cpu:e}");
        assert!(vs_eager <= TOLERANCE && vs_cpu <= TOLERANCE, "{members:?}");
        let replayed = gpu.counters().replays.load(Ordering::Relaxed) - replays;
        assert_eq!(replayed, u64::from(path == RunPath::Replay), "{members:?}");
    }
    let counters = gpu.counters();
    assert_eq!(counters.captures.load(Ordering::Relaxed), 2, "graphs at 64 and 16");
    assert!(counters.eager.load(Ordering::Relaxed) >= 1);
}

#[test]
fn whisper_graph_replay_matches_eager_gpu_and_cpu() {
    let _turn = switchyard_harness::turn();
    let encoder = WhisperEncoder::load(&fixtures::encoder("tiny-whisper")).expect("loads");
    let mel = LogMel::new(MelConfig::default());
    let clips: Vec<Vec<f32>> = ["tone.wav", "chirp.wav"]
        .iter()
        .map(|name| {
            let bytes = std::fs::read(fixtures::encoder(&format!("audio/{name}"))).expect("audio fixture");
            let waveform = audio::decode(&bytes, 60.0).expect("decodes");
            mel.compute(&audio::resample(&waveform, 16_000).expect("resamples").samples)
        })
        .collect();
    for kernel in [AttentionKernel::Tiled, AttentionKernel::Rows] {
        // 1,500 rows per window: budgets 2048 and 3000 hold 1 and 2 windows.
        let Some(mut gpu) = on_gpu(CudaWhisper::new(&encoder, 0, 3000)) else {
            return;
        };
        gpu.set_attention_kernel(kernel);
        println!("{kernel:?} attention");
        whisper_cases(&gpu, &encoder, &clips);
    }
}

fn whisper_cases(gpu: &CudaWhisper, encoder: &WhisperEncoder, clips: &[Vec<f32>]) {
    for windows in [vec![0usize, 1], vec![1], vec![0, 1, 0]] {
        let mels: Vec<&[f32]> = windows.iter().map(|&i| clips[i].as_slice()).collect();
        let graph = gpu.forward(&mels, true).expect("graph or eager");
        let eager = gpu.forward(&mels, false).expect("eager");
        let cpu = encoder.forward(&mels).expect("cpu");
        let (vs_eager, vs_cpu) = (max_difference(&graph, &eager), max_difference(&graph, &cpu));
        println!("windows {windows:?}: graph vs eager {vs_eager:e}, graph vs CPU {vs_cpu:e}");
        assert!(vs_eager <= TOLERANCE && vs_cpu <= TOLERANCE, "{windows:?}");
    }
    let counters = gpu.counters();
    assert_eq!(counters.replays.load(Ordering::Relaxed), 2);
    assert_eq!(
        counters.eager.load(Ordering::Relaxed),
        1,
        "three windows are above every budget"
    );
}
