//! Media rows through the engine: a prompt with media placeholders, submitted gated and opened
//! with the feature rows ([`PrefillGate::open_with_media`]), must generate what greedy decoding
//! over [`Model::forward_with_media`] generates, with the step budget small enough that a media
//! span is cut across prefill chunks, with another request batched beside it, and again when
//! the prompt's blocks (media included) come from the prefix cache. Placeholders without rows
//! never reach the model.

use switchyard_harness::fixtures;
use switchyard_llm::{MediaRows, Model, spawn_cpu_engine};
use switchyard_workers::engine::{EngineConfig, MediaSpan, Output, PrefillGate, SamplingParams, SubmitError};
use tokio::sync::mpsc;

/// The tiny LLaVA's language model (hidden 48, vocabulary 320).
fn model() -> Model {
    let dir = fixtures::encoder("tiny-llava");
    Model::load_language_model(&dir).expect("tiny-llava's language model loads")
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..SamplingParams::default()
    }
}

/// Deterministic feature rows for `len` positions.
fn rows(len: usize, seed: u32) -> Vec<f32> {
    (0..len * 48)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

/// A prompt with two media spans: 5 text, 12 media, 3 text, 7 media, 2 text.
fn prompt() -> (Vec<u32>, Vec<MediaSpan>) {
    let mut tokens: Vec<u32> = vec![1, 17, 42, 99, 7];
    let first = 0x8000_1234u32;
    let second = 0x8000_5678u32;
    tokens.extend(std::iter::repeat_n(first, 12));
    tokens.extend([250, 12, 3]);
    tokens.extend(std::iter::repeat_n(second, 7));
    tokens.extend([4, 5]);
    let media = vec![
        MediaSpan {
            start: 5,
            dim: 48,
            rows: rows(12, 1),
        },
        MediaSpan {
            start: 20,
            dim: 48,
            rows: rows(7, 2),
        },
    ];
    (tokens, media)
}

/// Greedy decoding with a full recompute per token, media merged directly.
fn reference(model: &Model, prompt: &[u32], media: &[MediaSpan], max_tokens: usize) -> Vec<u32> {
    let vocab = model.config().vocab_size;
    let mut tokens = prompt.to_vec();
    let spans: Vec<MediaRows<'_>> = media
        .iter()
        .map(|span| MediaRows {
            offset: span.start,
            rows: &span.rows,
        })
        .collect();
    for _ in 0..max_tokens {
        let logits = model.forward_with_media(&tokens, &spans).expect("forward");
        let last = &logits[logits.len() - vocab..];
        let best = (0..vocab).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        tokens.push(best as u32);
    }
    tokens[prompt.len()..].to_vec()
}

async fn collect(mut outputs: mpsc::UnboundedReceiver<Output>) -> (Vec<u32>, u32) {
    let mut tokens = Vec::new();
    while let Some(output) = outputs.recv().await {
        match output {
            Output::Token(token) => tokens.push(token),
            Output::Finished { cached_tokens, .. } => return (tokens, cached_tokens),
            Output::Started { .. } => {}
            Output::Failed(reason) => panic!("generation failed: {reason}"),
        }
    }
    panic!("the stream ended without a finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_rows_through_the_engine_match_direct_merging() {
    let _turn = switchyard_harness::turn();
    let (tokens, media) = prompt();
    let expected = reference(&model(), &tokens, &media, 8);
    let engine = spawn_cpu_engine(
        model(),
        EngineConfig {
            block_size: 4,
            num_gpu_blocks: 128,
            // Chunks of at most 8 tokens: the 12-row span is split across three steps.
            max_num_batched_tokens: 8,
            max_num_seqs: 4,
            ..EngineConfig::default()
        },
    )
    .expect("engine starts");
    for round in 0..2 {
        // Gated at the first span, as a worker submits before the features arrive; a text
        // request runs beside it.
        let gate = PrefillGate::new(5);
        let outputs = engine
            .submit_gated(tokens.clone(), greedy(8), Some(gate.clone()))
            .expect("accepted");
        let text = engine
            .submit(vec![1, 2, 3, 4, 5, 6, 7, 8, 9], greedy(4))
            .expect("accepted");
        gate.open_with_media(media.clone());
        engine.wake();
        let (generated, cached) = collect(outputs).await;
        collect(text).await;
        assert_eq!(generated, expected, "round {round}");
        if round == 1 {
            // The prompt's full blocks, media spans included, came from the prefix cache.
            assert!(cached >= 24, "only {cached} tokens cached");
        }
    }
    // Without rows, placeholders cannot be submitted ungated, and other ids stay refused.
    let err = engine.submit(tokens.clone(), greedy(2)).expect_err("no gate, no rows");
    assert!(matches!(err, SubmitError::MediaUnsupported { position: 5 }), "{err}");
    let err = engine.submit(vec![1, 400], greedy(2)).expect_err("out of vocabulary");
    assert!(matches!(err, SubmitError::TokenOutOfRange { id: 400, .. }), "{err}");
}
