//! The native engine (shared scheduler + CPU backend) on the tiny Llama fixture: what it
//! generates under continuous batching, chunked prefill, prefix-cache hits and preemption is
//! what plain greedy decoding with a full recompute per token generates; seeded sampling does
//! not depend on the batch; its KV events name the gateway's block hashes; bad requests are
//! refused before they reach the model.

use std::sync::atomic::Ordering;

use switchyard_harness::fixtures;
use switchyard_llm::{Model, spawn_cpu_engine};
use switchyard_protocol::block_hash::block_hashes;
use switchyard_workers::engine::{EngineConfig, EngineHandle, KvEvent, Output, SamplingParams, SubmitError};
use tokio::sync::mpsc;

fn model() -> Model {
    let dir = fixtures::llm("tiny-llama");
    Model::load(&dir).expect("tiny-llama loads")
}

/// Small blocks and a small step budget, so prompts span blocks and are chunked.
fn config() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_gpu_blocks: 256,
        max_num_batched_tokens: 16,
        max_num_seqs: 8,
        ..EngineConfig::default()
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..SamplingParams::default()
    }
}

/// Greedy decoding the slow, obvious way: the whole sequence through the model per token.
fn reference_greedy(model: &Model, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let vocab = model.config().vocab_size;
    let mut tokens = prompt.to_vec();
    for _ in 0..max_tokens {
        let logits = model.forward(&tokens).expect("forward");
        let last = &logits[logits.len() - vocab..];
        let mut best = 0;
        for (i, v) in last.iter().enumerate() {
            if *v > last[best] {
                best = i;
            }
        }
        tokens.push(best as u32);
    }
    tokens[prompt.len()..].to_vec()
}

struct Generation {
    tokens: Vec<u32>,
    cached_tokens: u32,
}

async fn collect(mut outputs: mpsc::UnboundedReceiver<Output>) -> Generation {
    let mut tokens = Vec::new();
    while let Some(output) = outputs.recv().await {
        match output {
            Output::Token(token) => tokens.push(token),
            Output::Finished {
                completion_tokens,
                cached_tokens,
                ..
            } => {
                assert_eq!(completion_tokens as usize, tokens.len());
                return Generation { tokens, cached_tokens };
            }
            Output::Started { .. } => {}
            Output::Failed(reason) => panic!("generation failed: {reason}"),
        }
    }
    panic!("the stream ended without a finish");
}

fn prompts() -> Vec<Vec<u32>> {
    let shared: Vec<u32> = (0..13).map(|i| (i * 37 + 5) % 280).collect();
    let mut prompts = Vec::new();
    for tail in [vec![7, 8, 9], vec![100, 3], vec![250; 9], vec![]] {
        let mut prompt = shared.clone();
        prompt.extend(tail);
        prompts.push(prompt);
    }
    prompts.push((0..30).map(|i| (i * 11 + 1) % 288).collect());
    prompts
}

async fn run_all(engine: &EngineHandle, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<Generation> {
    let receivers: Vec<_> = prompts
        .iter()
        .map(|prompt| engine.submit(prompt.clone(), params.clone()).expect("accepted"))
        .collect();
    let mut out = Vec::new();
    for receiver in receivers {
        out.push(collect(receiver).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_chunked_cached_generation_matches_plain_greedy_decoding() {
    let _turn = switchyard_harness::turn();
    let reference_model = model();
    let prompts = prompts();
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| reference_greedy(&reference_model, p, 10))
        .collect();
    let engine = spawn_cpu_engine(model(), config()).expect("engine starts");
    let (sink, mut events) = mpsc::unbounded_channel();
    engine.subscribe_kv_events(sink);

    // All at once: continuous batching with chunked prefill (budget 16 < prompt lengths).
    let first = run_all(&engine, &prompts, &greedy(10)).await;
    for (index, generation) in first.iter().enumerate() {
        assert_eq!(generation.tokens, expected[index], "prompt {index}, first round");
    }
    // Again: the prompts' blocks are cached now and must give the same tokens.
    let second = run_all(&engine, &prompts, &greedy(10)).await;
    for (index, generation) in second.iter().enumerate() {
        assert_eq!(generation.tokens, expected[index], "prompt {index}, cached round");
        let full_blocks = prompts[index].len() / 4;
        assert!(
            generation.cached_tokens as usize >= 4 * full_blocks.saturating_sub(1),
            "prompt {index}: only {} tokens came from the cache",
            generation.cached_tokens
        );
    }
    let stats = engine.stats();
    assert!(stats.cached_prompt_tokens.load(Ordering::Relaxed) > 0);
    assert!(
        stats.batched_sequences.load(Ordering::Relaxed) > stats.steps.load(Ordering::Relaxed),
        "steps held several sequences"
    );

    // Every full prompt block was announced under the hash the gateway computes.
    let mut stored = std::collections::HashSet::new();
    while let Ok(event) = events.try_recv() {
        if let KvEvent::Stored { blocks, .. } = event {
            stored.extend(blocks.iter().map(|block| block.block_hash));
        }
    }
    for prompt in &prompts {
        for hash in block_hashes(prompt, 4) {
            assert!(stored.contains(&hash.sequence), "block {hash:?} was not announced");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_and_eviction_do_not_change_the_tokens() {
    let _turn = switchyard_harness::turn();
    let reference_model = model();
    let prompts = prompts();
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| reference_greedy(&reference_model, p, 12))
        .collect();
    // 16 blocks of 4 positions: the five sequences (up to 42 positions each) cannot all be
    // resident, so some are preempted and recomputed, and cached blocks are evicted.
    let engine = spawn_cpu_engine(
        model(),
        EngineConfig {
            num_gpu_blocks: 16,
            ..config()
        },
    )
    .expect("engine starts");
    let (sink, mut events) = mpsc::unbounded_channel();
    engine.subscribe_kv_events(sink);
    let generations = run_all(&engine, &prompts, &greedy(12)).await;
    for (index, generation) in generations.iter().enumerate() {
        assert_eq!(generation.tokens, expected[index], "prompt {index}");
    }
    assert!(
        engine.stats().preemptions.load(Ordering::Relaxed) > 0,
        "nothing was preempted"
    );
    let mut removed = 0;
    while let Ok(event) = events.try_recv() {
        if let KvEvent::Removed { block_hashes } = event {
            removed += block_hashes.len();
        }
    }
    assert!(removed > 0, "nothing was evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_does_not_depend_on_the_batch() {
    let _turn = switchyard_harness::turn();
    let engine = spawn_cpu_engine(model(), config()).expect("engine starts");
    let params = SamplingParams {
        temperature: 1.5,
        top_k: 50,
        top_p: 0.95,
        seed: Some(1234),
        max_tokens: 12,
        stop_token_ids: Vec::new(),
    };
    let prompt: Vec<u32> = (40..60).collect();
    let alone = collect(engine.submit(prompt.clone(), params.clone()).expect("accepted")).await;
    let others: Vec<Vec<u32>> = (0..4).map(|i| (i..i + 25).collect()).collect();
    let mut receivers: Vec<_> = others
        .iter()
        .map(|p| {
            engine
                .submit(
                    p.clone(),
                    SamplingParams {
                        seed: Some(7),
                        ..params.clone()
                    },
                )
                .expect("accepted")
        })
        .collect();
    let batched = engine.submit(prompt.clone(), params.clone()).expect("accepted");
    receivers.push(
        engine
            .submit(
                prompt,
                SamplingParams {
                    seed: Some(99),
                    ..params
                },
            )
            .expect("accepted"),
    );
    let batched = collect(batched).await;
    assert_eq!(
        alone.tokens, batched.tokens,
        "same seed, same tokens, whatever the batch"
    );
    let mut other_seed = None;
    for receiver in receivers {
        other_seed = Some(collect(receiver).await.tokens);
    }
    assert_ne!(other_seed, Some(alone.tokens), "another seed draws other tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_tokens_end_a_generation_early() {
    let _turn = switchyard_harness::turn();
    let reference = reference_greedy(&model(), &[5, 6, 7, 8], 8);
    let stop = reference[3];
    let engine = spawn_cpu_engine(model(), config()).expect("engine starts");
    let mut outputs = engine
        .submit(
            vec![5, 6, 7, 8],
            SamplingParams {
                stop_token_ids: vec![stop],
                ..greedy(8)
            },
        )
        .expect("accepted");
    let mut tokens = Vec::new();
    loop {
        match outputs.recv().await.expect("an output") {
            Output::Token(token) => tokens.push(token),
            Output::Finished { reason, .. } => {
                assert_eq!(reason.as_str(), "stop");
                break;
            }
            Output::Started { .. } => {}
            Output::Failed(reason) => panic!("{reason}"),
        }
    }
    let first_stop = reference.iter().position(|&t| t == stop).expect("in the reference");
    assert_eq!(
        tokens,
        reference[..=first_stop],
        "ends at the first stop token, included"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_model_cannot_take_are_refused() {
    let _turn = switchyard_harness::turn();
    let engine = spawn_cpu_engine(model(), config()).expect("engine starts");
    assert!(matches!(
        engine.submit(vec![1, 2, 288], greedy(1)),
        Err(SubmitError::TokenOutOfRange {
            position: 2,
            id: 288,
            vocab: 288
        })
    ));
    // The fixture's context is 256 positions.
    assert!(matches!(
        engine.submit(vec![1; 250], greedy(10)),
        Err(SubmitError::ContextLength { max: 256, .. })
    ));
    assert!(matches!(
        engine.submit(
            vec![1],
            SamplingParams {
                top_p: 0.0,
                ..greedy(1)
            }
        ),
        Err(SubmitError::Sampling(_))
    ));
    // The engine still serves.
    let generation = collect(engine.submit(vec![1, 2, 3], greedy(2)).expect("accepted")).await;
    assert_eq!(generation.tokens.len(), 2);
}
