//! The CUDA backend (feature `cuda`): its kernels compile under NVRTC (no GPU needed), and on
//! a machine with a GPU it computes what the CPU backend computes.
//!
//! Without NVRTC or a GPU these tests say so and pass, unless `SWITCHYARD_CUDA_TESTS` asks for
//! them: `nvrtc` makes a missing NVRTC a failure (CI installs it from PyPI), `gpu` makes a
//! missing GPU one too (run it on a GPU machine).
#![cfg(feature = "cuda")]

use switchyard_harness::fixtures::{self, max_difference};
use switchyard_llm::cuda::{self, AttentionKernel, CudaError, CudaExecutor, GpuChunk, SetupError};
use switchyard_llm::{Chunk, KvPrecision, Logits, MediaRows, Model, PagedKv, SequenceKv, spawn_cpu_engine};
use switchyard_workers::engine::{EngineConfig, Output, SamplingParams};

fn required(level: &str) -> bool {
    std::env::var("SWITCHYARD_CUDA_TESTS").is_ok_and(|value| value == level || value == "gpu")
}

fn model(name: &str) -> Model {
    Model::load(&fixtures::llm(name)).expect("fixture loads")
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

/// The backend on GPU 0, or `None` (with a note) where there is none and none is required.
fn gpu(model: &Model, blocks: usize) -> Option<CudaExecutor> {
    match CudaExecutor::new(model, 0, 4, blocks) {
        Ok(executor) => Some(executor),
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
fn asking_for_a_missing_device_is_a_clear_error() {
    let _turn = switchyard_harness::turn();
    let model = model("tiny-llama");
    match CudaExecutor::new(&model, 4096, 4, 8) {
        Err(
            CudaError::Setup(SetupError::NoDevice { ordinal: 4096, .. })
            | CudaError::Setup(SetupError::NoDriver)
            | CudaError::Setup(SetupError::NoCublas),
        ) => {}
        other => panic!("expected a missing-device error, got {other:?}"),
    }
}

const PROMPT: [u32; 19] = [1, 17, 42, 99, 7, 256, 3, 3, 64, 200, 11, 5, 9, 9, 31, 140, 141, 2, 77];

#[test]
fn gpu_logits_match_the_cpu_backend() {
    let _turn = switchyard_harness::turn();
    for name in ["tiny-llama", "tiny-qwen2"] {
        let model = model(name);
        let Some(mut gpu) = gpu(&model, 32) else { return };
        let cpu_f32 = two_steps_on_the_cpu(&model, KvPrecision::F32);
        let difference = max_row_difference(&cpu_f32, &two_steps_on_the_gpu(&mut gpu));
        assert!(difference < 1e-3, "{name}: max |Δlogit| {difference}");
        // With f16 caches both backends round the same values once: the GPU's logits are the
        // CPU's f16 ones, nearer them than the f32 ones (which an f32 cache would give).
        let mut gpu = CudaExecutor::with_precision(&model, 0, 4, 32, KvPrecision::F16).expect("an f16 cache");
        let gpu_f16 = two_steps_on_the_gpu(&mut gpu);
        let cpu_f16 = two_steps_on_the_cpu(&model, KvPrecision::F16);
        let (to_f16, to_f32) = (
            max_row_difference(&cpu_f16, &gpu_f16),
            max_row_difference(&cpu_f32, &gpu_f16),
        );
        eprintln!("{name}, f16 caches: max |Δlogit| {to_f16} from the CPU's f16, {to_f32} from its f32");
        assert!(
            to_f16 < 1e-3 && to_f16 < to_f32,
            "{name}: {to_f16} from f16, {to_f32} from f32"
        );
    }
}

// Two sequences in one step (a chunk of 11 and one of 19 tokens), then both decode one more
// token together: prefill, paged caches and batched decode all compared.
const A_BLOCKS: [u32; 6] = [9, 2, 14, 0, 5, 11];
const B_BLOCKS: [u32; 6] = [20, 21, 7, 30, 31, 8];

/// The two steps' logits on the CPU backend with a cache in `precision`.
fn two_steps_on_the_cpu(model: &Model, precision: KvPrecision) -> Vec<Vec<f32>> {
    let mut kv = PagedKv::with_precision(model.config(), 4, 32, precision);
    let mut a = SequenceKv {
        blocks: A_BLOCKS.to_vec(),
        computed: 0,
    };
    let mut b = SequenceKv {
        blocks: B_BLOCKS.to_vec(),
        computed: 0,
    };
    let mut logits = model
        .forward_batch(
            &mut kv,
            &mut [
                Chunk {
                    sequence: &mut a,
                    tokens: &PROMPT[..11],
                },
                Chunk {
                    sequence: &mut b,
                    tokens: &PROMPT,
                },
            ],
            Logits::Last,
        )
        .expect("cpu step");
    logits.extend(
        model
            .forward_batch(
                &mut kv,
                &mut [
                    Chunk {
                        sequence: &mut a,
                        tokens: &PROMPT[11..12],
                    },
                    Chunk {
                        sequence: &mut b,
                        tokens: &[123],
                    },
                ],
                Logits::Last,
            )
            .expect("cpu step"),
    );
    logits
}

/// The two steps' logits on `gpu`.
fn two_steps_on_the_gpu(gpu: &mut CudaExecutor) -> Vec<Vec<f32>> {
    let mut longer = PROMPT.to_vec();
    longer.push(123);
    let mut logits = gpu
        .forward(&[
            GpuChunk {
                tokens: &PROMPT,
                start: 0,
                count: 11,
                blocks: &A_BLOCKS,
                media: &[],
            },
            GpuChunk {
                tokens: &PROMPT,
                start: 0,
                count: 19,
                blocks: &B_BLOCKS,
                media: &[],
            },
        ])
        .expect("gpu step");
    logits.extend(
        gpu.forward(&[
            GpuChunk {
                tokens: &PROMPT,
                start: 11,
                count: 1,
                blocks: &A_BLOCKS,
                media: &[],
            },
            GpuChunk {
                tokens: &longer,
                start: 19,
                count: 1,
                blocks: &B_BLOCKS,
                media: &[],
            },
        ])
        .expect("gpu step"),
    );
    logits
}

/// The tiny LLaVA checkpoint (its language model) of the encoder fixtures.
fn llava() -> Model {
    Model::load(&fixtures::encoder("tiny-llava")).expect("tiny LLaVA loads")
}

/// The largest difference between two runs' rows of logits.
fn max_row_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| max_difference(x, y)).fold(0.0, f32::max)
}

#[test]
fn gpu_merges_media_rows_as_the_cpu_backend_does() {
    let _turn = switchyard_harness::turn();
    let model = llava();
    let Some(mut gpu) = gpu(&model, 32) else { return };
    let hidden = model.config().hidden_size;
    let vocab = model.config().vocab_size as u32;
    // Media rows far from any embedding row, so a placeholder left embedded would show.
    let rows = |len: usize, seed: usize| -> Vec<f32> {
        (0..len * hidden)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 250.0) - 2.0)
            .collect()
    };
    let (image, clip) = (rows(4, 1), rows(5, 2));
    // Sequence a: text, a 4-row image at 3..7, text; one chunk. Sequence b: a 5-row clip at
    // 6..11 split over two prefill chunks (8 tokens, then 6). Placeholder ids are outside the
    // vocabulary, as the worker's are.
    let mut a_tokens: Vec<u32> = vec![1, 17, 42, vocab + 1, vocab + 1, vocab + 1, vocab + 1, 9, 64, 11];
    let mut b_tokens: Vec<u32> = vec![
        1,
        5,
        9,
        31,
        140,
        2,
        vocab + 2,
        vocab + 2,
        vocab + 2,
        vocab + 2,
        vocab + 2,
        77,
        3,
        8,
    ];
    let a_blocks: Vec<u32> = vec![9, 2, 14, 0, 5];
    let b_blocks: Vec<u32> = vec![20, 21, 7, 30, 31];
    let a_media = [MediaRows {
        offset: 3,
        rows: &image,
    }];
    let b_first = [MediaRows {
        offset: 6,
        rows: &clip[..2 * hidden],
    }];
    let b_second = [MediaRows {
        offset: 0,
        rows: &clip[2 * hidden..],
    }];

    let mut kv = PagedKv::new(model.config(), 4, 32);
    let mut a = SequenceKv {
        blocks: a_blocks.clone(),
        computed: 0,
    };
    let mut b = SequenceKv {
        blocks: b_blocks.clone(),
        computed: 0,
    };
    let mut cpu = model
        .forward_batch_with_media(
            &mut kv,
            &mut [
                Chunk {
                    sequence: &mut a,
                    tokens: &a_tokens,
                },
                Chunk {
                    sequence: &mut b,
                    tokens: &b_tokens[..8],
                },
            ],
            &[&a_media, &b_first],
            Logits::Last,
        )
        .expect("cpu step");
    let mut on_gpu = gpu
        .forward(&[
            GpuChunk {
                tokens: &a_tokens,
                start: 0,
                count: a_tokens.len(),
                blocks: &a_blocks,
                media: &a_media,
            },
            GpuChunk {
                tokens: &b_tokens,
                start: 0,
                count: 8,
                blocks: &b_blocks,
                media: &b_first,
            },
        ])
        .expect("gpu step");
    // Then b's second chunk beside a's first decoded token.
    a_tokens.push(23);
    cpu.extend(
        model
            .forward_batch_with_media(
                &mut kv,
                &mut [
                    Chunk {
                        sequence: &mut a,
                        tokens: &a_tokens[10..],
                    },
                    Chunk {
                        sequence: &mut b,
                        tokens: &b_tokens[8..],
                    },
                ],
                &[&[], &b_second],
                Logits::Last,
            )
            .expect("cpu step"),
    );
    on_gpu.extend(
        gpu.forward(&[
            GpuChunk {
                tokens: &a_tokens,
                start: 10,
                count: 1,
                blocks: &a_blocks,
                media: &[],
            },
            GpuChunk {
                tokens: &b_tokens,
                start: 8,
                count: 6,
                blocks: &b_blocks,
                media: &b_second,
            },
        ])
        .expect("gpu step"),
    );
    let difference = max_row_difference(&cpu, &on_gpu);
    println!("media merged on the GPU: max |Δlogit| {difference:e} against the CPU");
    assert!(difference < 1e-3, "max |Δlogit| {difference}");

    // Rows that do not fit the chunk are refused, naming it.
    b_tokens.push(4);
    let err = gpu
        .forward(&[GpuChunk {
            tokens: &b_tokens,
            start: 14,
            count: 1,
            blocks: &b_blocks,
            media: &b_first,
        }])
        .expect_err("media past the chunk");
    assert!(err.to_string().contains("do not fit"), "{err}");
}

/// One step of the sequences `members` (indices into `tokens` and `blocks`): each one's whole
/// prompt when `prefill`, else its last token; their last positions' logits.
fn step_of(
    executor: &mut CudaExecutor,
    tokens: &[Vec<u32>],
    blocks: &[Vec<u32>],
    members: &[usize],
    prefill: bool,
) -> Vec<Vec<f32>> {
    let chunks: Vec<GpuChunk<'_>> = members
        .iter()
        .map(|&i| GpuChunk {
            tokens: &tokens[i],
            start: if prefill { 0 } else { tokens[i].len() - 1 },
            count: if prefill { tokens[i].len() } else { 1 },
            blocks: &blocks[i],
            media: &[],
        })
        .collect();
    executor.forward(&chunks).expect("step")
}

#[test]
fn decode_graphs_give_the_eager_steps_logits() {
    let _turn = switchyard_harness::turn();
    let model = model("tiny-llama");
    let Some(mut graphs) = gpu(&model, 64) else { return };
    let Some(mut eager) = gpu(&model, 64) else { return };
    eager.set_decode_graphs(false);
    // And kernel by kernel with the first attention kernel (a warp per key): the reference of
    // the default one (a thread per key).
    let Some(mut by_warp) = gpu(&model, 64) else { return };
    by_warp.set_decode_graphs(false);
    by_warp.set_attention_kernel(AttentionKernel::ByWarp);
    let vocab = model.config().vocab_size as u32;
    // Five sequences of 9 prompt tokens; sequence 0 owns block 0, where a padding row writing
    // to the wrong block would show.
    let mut tokens: Vec<Vec<u32>> = (0..5)
        .map(|i| PROMPT.iter().cycle().skip(i * 3).take(9).copied().collect())
        .collect();
    let blocks: Vec<Vec<u32>> = (0..5u32).map(|i| (i * 6..i * 6 + 6).collect()).collect();
    let step = |executor: &mut CudaExecutor, tokens: &[Vec<u32>], members: &[usize], prefill: bool| {
        step_of(executor, tokens, &blocks, members, prefill)
    };
    let all = [0, 1, 2, 3, 4];
    let prefilled = step(&mut graphs, &tokens, &all, true);
    assert_eq!(
        max_row_difference(&prefilled, &step(&mut eager, &tokens, &all, true)),
        0.0,
        "prefill runs eagerly on both"
    );
    assert!(max_row_difference(&prefilled, &step(&mut by_warp, &tokens, &all, true)) < 1e-4);
    // Buckets 8 (three padding rows), 4, 1, 8 again with new positions, and 2 out of order.
    let rounds: [&[usize]; 5] = [&all, &[0, 1, 2], &[3], &all, &[4, 0]];
    for (round, members) in rounds.iter().enumerate() {
        for &i in *members {
            tokens[i].push((round as u32 * 7 + i as u32 * 13 + 5) % vocab);
        }
        let replayed = step(&mut graphs, &tokens, members, false);
        let stepped = step(&mut eager, &tokens, members, false);
        let first_kernel = step(&mut by_warp, &tokens, members, false);
        let (difference, vs_first) = (
            max_row_difference(&replayed, &stepped),
            max_row_difference(&replayed, &first_kernel),
        );
        println!(
            "decode round {round} ({} sequences): graph vs eager max |Δlogit| {difference:e}, by key vs by warp {vs_first:e}",
            members.len()
        );
        assert!(difference < 1e-4, "round {round}: max |Δlogit| {difference}");
        assert!(
            vs_first < 1e-4,
            "round {round}: by key vs by warp max |Δlogit| {vs_first}"
        );
    }
    let stats = graphs.decode_graph_stats();
    assert_eq!((stats.captures, stats.replays), (4, 5), "{stats:?}");
    assert_eq!(eager.decode_graph_stats().replays, 0);
}

/// The CPU cache's blocks of [`PROMPT`]'s first 16 positions (blocks 0..4), prefilled, and
/// the tail's logits computed on from them.
fn cpu_prefix_blocks(model: &Model, precision: KvPrecision) -> (Vec<Vec<u8>>, Vec<f32>) {
    let mut kv = PagedKv::with_precision(model.config(), 4, 8, precision);
    let mut sequence = SequenceKv {
        blocks: vec![0, 1, 2, 3, 4],
        computed: 0,
    };
    model
        .forward_batch(
            &mut kv,
            &mut [Chunk {
                sequence: &mut sequence,
                tokens: &PROMPT[..16],
            }],
            Logits::Last,
        )
        .expect("cpu prefill");
    let payloads = (0..4).map(|block| kv.export_block(block).expect("a block")).collect();
    let tail = model
        .forward_batch(
            &mut kv,
            &mut [Chunk {
                sequence: &mut sequence,
                tokens: &PROMPT[16..],
            }],
            Logits::Last,
        )
        .expect("cpu tail");
    (payloads, tail.concat())
}

#[test]
fn kv_blocks_move_between_the_cpu_and_gpu_caches_unchanged() {
    let _turn = switchyard_harness::turn();
    let model = model("tiny-llama");
    if gpu(&model, 16).is_none() {
        return;
    }
    for precision in [KvPrecision::F32, KvPrecision::F16] {
        let mut gpu = CudaExecutor::with_precision(&model, 0, 4, 16, precision).expect("a cache");
        let (payloads, cpu_tail) = cpu_prefix_blocks(&model, precision);
        // Into other block numbers, host→device; back out device→host, byte for byte.
        let blocks = [9u32, 3, 12, 6, 0];
        for (payload, block) in payloads.iter().zip(blocks) {
            gpu.import_block(block, payload).expect("the same shape");
            assert_eq!(&gpu.export_block(block).expect("a block"), payload, "{precision}");
        }
        let gpu_tail = gpu
            .forward(&[GpuChunk {
                tokens: &PROMPT,
                start: 16,
                count: PROMPT.len() - 16,
                blocks: &blocks,
                media: &[],
            }])
            .expect("gpu tail")
            .concat();
        let difference = max_difference(&gpu_tail, &cpu_tail);
        assert!(difference < 1e-3, "{precision}: max |Δlogit| {difference}");
        // The GPU's own blocks go to the CPU cache as they are.
        let mut cpu = PagedKv::with_precision(model.config(), 4, 8, precision);
        cpu.import_block(5, &gpu.export_block(9).expect("a block"))
            .expect("the same shape");
        assert_eq!(cpu.export_block(5).expect("a block"), payloads[0]);
        // A payload of the other dtype, or a block past the cache, is refused.
        let other = if precision == KvPrecision::F32 {
            KvPrecision::F16
        } else {
            KvPrecision::F32
        };
        let (foreign, _) = cpu_prefix_blocks(&model, other);
        assert!(gpu.import_block(1, &foreign[0]).is_err());
        assert!(
            gpu.import_block(16, &payloads[0]).is_err(),
            "block 16 is the graphs' padding"
        );
    }
}

#[test]
fn split_attention_merges_to_the_unsplit_logits() {
    let _turn = switchyard_harness::turn();
    // Two sequences past a 128-key tile: a decode step of 2 rows × 4 heads splits each
    // (row, head)'s keys 16 ways (two of the splits hold keys, the rest none), and the merged
    // result must be what one block over all the keys gives.
    let model = model("tiny-llama");
    let Some(mut split) = gpu(&model, 160) else { return };
    let Some(mut whole) = gpu(&model, 160) else { return };
    whole.set_attention_kernel(AttentionKernel::ByKeyUnsplit);
    let vocab = model.config().vocab_size as u32;
    let mut tokens: Vec<Vec<u32>> = (0..2u32)
        .map(|s| (0..240u32).map(|t| (t * 7 + s * 11) % vocab).collect())
        .collect();
    let blocks: Vec<Vec<u32>> = (0..2u32).map(|s| (s * 80..s * 80 + 80).collect()).collect();
    let step = |executor: &mut CudaExecutor, tokens: &[Vec<u32>], prefill: bool| {
        step_of(executor, tokens, &blocks, &[0, 1], prefill)
    };
    assert_eq!(
        max_row_difference(&step(&mut split, &tokens, true), &step(&mut whole, &tokens, true)),
        0.0,
        "prefill does not split"
    );
    for round in 0..4u32 {
        for (i, tokens) in tokens.iter_mut().enumerate() {
            tokens.push((round * 5 + i as u32 * 3 + 1) % vocab);
        }
        let difference = max_row_difference(&step(&mut split, &tokens, false), &step(&mut whole, &tokens, false));
        println!("decode round {round}: split vs unsplit max |Δlogit| {difference:e}");
        assert!(difference < 1e-4, "round {round}: max |Δlogit| {difference}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gpu_engine_generates_the_cpu_engines_tokens() {
    let _turn = switchyard_harness::turn();
    let model = model("tiny-llama");
    let config = EngineConfig {
        block_size: 4,
        num_gpu_blocks: 128,
        max_num_batched_tokens: 16,
        max_num_seqs: 8,
        ..EngineConfig::default()
    };
    let Some(gpu) = gpu(&model, config.num_gpu_blocks) else {
        return;
    };
    let limits = gpu.limits();
    let gpu = switchyard_workers::engine::spawn_native(config.clone(), limits, gpu, "test-gpu").expect("starts");
    let cpu = spawn_cpu_engine(model, config).expect("starts");
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| (i..i + 13 + 3 * i).map(|t| (t * 7) % 280).collect())
        .collect();
    let greedy = SamplingParams {
        temperature: 0.0,
        max_tokens: 12,
        ..SamplingParams::default()
    };
    let run = |engine: &switchyard_workers::engine::EngineHandle| {
        prompts
            .iter()
            .map(|prompt| engine.submit(prompt.clone(), greedy.clone()).expect("accepted"))
            .collect::<Vec<_>>()
    };
    for (mut on_cpu, mut on_gpu) in run(&cpu).into_iter().zip(run(&gpu)) {
        let mut tokens = (Vec::new(), Vec::new());
        for (receiver, out) in [(&mut on_cpu, &mut tokens.0), (&mut on_gpu, &mut tokens.1)] {
            while let Some(output) = receiver.recv().await {
                match output {
                    Output::Token(token) => out.push(token),
                    Output::Finished { .. } => break,
                    Output::Started { .. } => {}
                    Output::Failed(reason) => panic!("{reason}"),
                }
            }
        }
        assert_eq!(tokens.0, tokens.1, "greedy tokens differ between the backends");
    }
}
