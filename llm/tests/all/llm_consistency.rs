//! The paged, batched forward pass agrees with itself: chunked and one-shot prefill, a
//! prefix-cache hit and a miss, batched and single decoding. Checked on the tiny Llama fixture
//! that `hf_reference` checks against transformers.

use switchyard_harness::fixtures::{self, max_difference};
use switchyard_llm::{Chunk, ForwardError, KvPrecision, Logits, Model, PagedKv, SequenceKv};

fn model() -> Model {
    let dir = fixtures::llm("tiny-llama");
    Model::load(&dir).expect("tiny-llama loads")
}

const PROMPT: [u32; 23] = [
    1, 17, 42, 99, 7, 256, 3, 3, 64, 200, 11, 5, 9, 9, 31, 140, 141, 2, 77, 78, 79, 80, 12,
];

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs `tokens` for one sequence in chunks of `chunk` tokens; returns every position's logits.
fn prefill(model: &Model, kv: &mut PagedKv, sequence: &mut SequenceKv, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut logits = Vec::new();
    for part in tokens.chunks(chunk) {
        let mut out = model
            .forward_batch(kv, &mut [Chunk { sequence, tokens: part }], Logits::All)
            .expect("step");
        logits.extend(out.remove(0));
    }
    logits
}

#[test]
fn chunked_prefill_gives_the_one_shot_logits() {
    let _turn = switchyard_harness::turn();
    let model = model();
    let whole = model.forward(&PROMPT).expect("one shot");
    for chunk in [1, 4, 7, 16] {
        // Block size 4: chunks cross block boundaries; blocks out of order in the cache.
        let mut kv = PagedKv::new(model.config(), 4, 16);
        let mut sequence = SequenceKv {
            blocks: vec![9, 2, 14, 0, 5, 11],
            computed: 0,
        };
        let logits = prefill(&model, &mut kv, &mut sequence, &PROMPT, chunk);
        let difference = max_difference(&logits, &whole);
        assert!(difference <= 1e-5, "chunks of {chunk}: max |Δ| {difference}");
        assert_eq!(sequence.computed, PROMPT.len());
    }
}

#[test]
fn a_prefill_of_several_groups_of_rows_gives_the_one_token_logits() {
    let _turn = switchyard_harness::turn();
    // 129 rows: two full groups of attention rows (64 each) and a group of one, which takes
    // the decode path; one token at a time every row takes it.
    let model = model();
    let tokens: Vec<u32> = (0..129u32).map(|i| (i * 37 + 11) % 288).collect();
    let whole = model.forward(&tokens).expect("one shot");
    let mut kv = PagedKv::new(model.config(), 16, 9);
    let mut sequence = SequenceKv {
        blocks: vec![8, 3, 0, 6, 1, 7, 2, 5, 4],
        computed: 0,
    };
    let logits = prefill(&model, &mut kv, &mut sequence, &tokens, 1);
    let difference = max_difference(&logits, &whole);
    assert!(difference <= 1e-5, "one token at a time: max |Δ| {difference}");
}

#[test]
fn an_f16_cache_keeps_the_logits_near_the_f32_caches() {
    let _turn = switchyard_harness::turn();
    // A prefill of three groups of rows (the keys gathered from the cache) and decode steps
    // (the keys read in place), in each precision.
    let model = model();
    let tokens: Vec<u32> = (0..140u32).map(|i| (i * 53 + 7) % 288).collect();
    let run = |precision| {
        let mut kv = PagedKv::with_precision(model.config(), 16, 9, precision);
        assert_eq!(kv.precision(), precision);
        let mut sequence = SequenceKv {
            blocks: vec![4, 8, 0, 7, 2, 6, 1, 3, 5],
            computed: 0,
        };
        let mut logits = prefill(&model, &mut kv, &mut sequence, &tokens[..130], 130);
        logits.extend(prefill(&model, &mut kv, &mut sequence, &tokens[130..], 1));
        logits
    };
    let (full, half) = (run(KvPrecision::F32), run(KvPrecision::F16));
    let largest = full.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let difference = max_difference(&full, &half);
    // f16 keeps 11 significant bits: each key and value moves by up to 2⁻¹¹ of itself.
    assert!(
        difference <= 2e-3 * largest,
        "f16 cache: max |Δ| {difference}, largest logit {largest}"
    );
    assert!(difference > 0.0, "the f16 cache rounded nothing: is it f16?");
    eprintln!("f16 cache: max |Δlogit| {difference:e} of logits up to {largest}");
}

#[test]
fn a_prefix_cache_hit_gives_the_logits_of_a_miss() {
    let _turn = switchyard_harness::turn();
    let model = model();
    let mut kv = PagedKv::new(model.config(), 4, 16);
    // Sequence A computes the whole prompt in blocks 0..6.
    let mut a = SequenceKv {
        blocks: (0..6).collect(),
        computed: 0,
    };
    let miss = prefill(&model, &mut kv, &mut a, &PROMPT, 23);
    // Sequence B shares A's first 4 blocks (16 positions) and computes only the rest.
    let mut b = SequenceKv {
        blocks: vec![0, 1, 2, 3, 10, 11],
        computed: 16,
    };
    let hit = prefill(&model, &mut kv, &mut b, &PROMPT[16..], 23);
    let vocab = model.config().vocab_size;
    let difference = max_difference(&hit, &miss[16 * vocab..]);
    assert!(difference <= 1e-5, "max |Δ| {difference}");
    // And the shared blocks were not overwritten: A continues as if B never ran.
    let mut next_a = model
        .forward_batch(
            &mut kv,
            &mut [Chunk {
                sequence: &mut a,
                tokens: &[5],
            }],
            Logits::Last,
        )
        .expect("step");
    let mut extended = PROMPT.to_vec();
    extended.push(5);
    let whole = model.forward(&extended).expect("one shot");
    let difference = max_difference(&next_a.remove(0), &whole[23 * vocab..]);
    assert!(difference <= 1e-5, "max |Δ| {difference}");
}

#[test]
fn batched_and_single_greedy_decoding_give_the_same_tokens() {
    let _turn = switchyard_harness::turn();
    let model = model();
    let prompts: [&[u32]; 3] = [&PROMPT[..5], &PROMPT[3..20], &PROMPT[10..12]];
    let steps = 12;
    // Single: each sequence alone in its own cache.
    let mut single = Vec::new();
    for prompt in prompts {
        let mut kv = PagedKv::new(model.config(), 4, 16);
        let mut sequence = SequenceKv {
            blocks: (0..16).collect(),
            computed: 0,
        };
        let mut last = model
            .forward_batch(
                &mut kv,
                &mut [Chunk {
                    sequence: &mut sequence,
                    tokens: prompt,
                }],
                Logits::Last,
            )
            .expect("prefill")
            .remove(0);
        let mut tokens = Vec::new();
        for _ in 0..steps {
            let token = argmax(&last);
            tokens.push(token);
            last = model
                .forward_batch(
                    &mut kv,
                    &mut [Chunk {
                        sequence: &mut sequence,
                        tokens: &[token],
                    }],
                    Logits::Last,
                )
                .expect("decode")
                .remove(0);
        }
        single.push(tokens);
    }
    // Batched: all three share one cache and every step; the first step mixes their prefills.
    let mut kv = PagedKv::new(model.config(), 4, 48);
    let mut sequences: Vec<SequenceKv> = (0..3)
        .map(|i| SequenceKv {
            blocks: (i * 16..(i + 1) * 16).collect(),
            computed: 0,
        })
        .collect();
    let mut next: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut batched = vec![Vec::new(); 3];
    for _ in 0..=steps {
        let mut chunks: Vec<Chunk<'_>> = sequences
            .iter_mut()
            .zip(&next)
            .map(|(sequence, tokens)| Chunk { sequence, tokens })
            .collect();
        let logits = model.forward_batch(&mut kv, &mut chunks, Logits::Last).expect("step");
        next = logits.iter().map(|l| vec![argmax(l)]).collect();
        for (out, token) in batched.iter_mut().zip(&next) {
            out.push(token[0]);
        }
    }
    for out in &mut batched {
        out.pop();
    }
    assert_eq!(batched, single);
    // Greedy decoding of a random model still varies: the test would notice a constant.
    assert!(
        single.iter().flatten().collect::<std::collections::HashSet<_>>().len() > 3,
        "{single:?}"
    );
}

#[test]
fn a_step_that_does_not_fit_its_blocks_is_refused_and_writes_nothing() {
    let _turn = switchyard_harness::turn();
    let model = model();
    let mut kv = PagedKv::new(model.config(), 4, 4);
    let mut sequence = SequenceKv {
        blocks: vec![0, 1],
        computed: 0,
    };
    let refused = model.forward_batch(
        &mut kv,
        &mut [Chunk {
            sequence: &mut sequence,
            tokens: &PROMPT[..9],
        }],
        Logits::Last,
    );
    assert_eq!(
        refused.err(),
        Some(ForwardError::BlocksMissing {
            positions: 9,
            covered: 8
        })
    );
    assert_eq!(sequence.computed, 0);
    sequence.blocks = vec![0, 7, 1];
    let refused = model.forward_batch(
        &mut kv,
        &mut [Chunk {
            sequence: &mut sequence,
            tokens: &PROMPT[..9],
        }],
        Logits::Last,
    );
    assert_eq!(
        refused.err(),
        Some(ForwardError::BlockOutOfRange {
            block: 7,
            num_blocks: 4
        })
    );
}
