//! Moving a prefill between native engines (prefill/decode disaggregation) on the tiny Llama
//! fixture: blocks exported by one cache and imported by another hold the same bytes and give
//! the same logits (bit for bit: the tail attends to identical keys and values), engines move
//! them through the export/import hooks and the workers' wire framing and then generate what
//! the prefill engine would have, and a payload of another dtype or shape is refused.

use switchyard_harness::fixtures::{self, max_difference};
use switchyard_llm::{Chunk, KvPrecision, Logits, Model, PagedKv, SequenceKv, spawn_cpu_engine, spawn_cpu_engine_with};
use switchyard_protocol::block_hash::block_hashes;
use switchyard_protocol::kv_blocks;
use switchyard_workers::engine::{EngineConfig, EngineHandle, KvImport, KvImported, Output, SamplingParams};

fn model() -> Model {
    Model::load(&fixtures::llm("tiny-llama")).expect("tiny-llama loads")
}

const PROMPT: [u32; 23] = [
    1, 17, 42, 99, 7, 256, 3, 3, 64, 200, 11, 5, 9, 9, 31, 140, 141, 2, 77, 78, 79, 80, 12,
];

/// Positions of the prompt in full blocks of 4: what a prefill worker hands over.
const PREFIX: usize = 20;

/// The tail's logits (every position past [`PREFIX`]) after the prefix was prefilled in
/// `source` and moved, block by block, into a second cache at other block numbers; and the
/// same tail computed in `source` itself.
fn tail_logits_moved_and_local(model: &Model, precision: KvPrecision) -> (Vec<f32>, Vec<f32>) {
    let config = model.config();
    let mut source = PagedKv::with_precision(config, 4, 16, precision);
    let mut here = SequenceKv {
        blocks: vec![9, 2, 14, 0, 5, 11],
        computed: 0,
    };
    model
        .forward_batch(
            &mut source,
            &mut [Chunk {
                sequence: &mut here,
                tokens: &PROMPT[..PREFIX],
            }],
            Logits::Last,
        )
        .expect("prefill");
    let mut target = PagedKv::with_precision(config, 4, 32, precision);
    let mut there = SequenceKv {
        blocks: vec![30, 1, 17, 4, 22, 8],
        computed: PREFIX,
    };
    for (from, to) in here.blocks.iter().zip(&there.blocks).take(PREFIX / 4) {
        let payload = source.export_block(*from).expect("a block of the cache");
        target.import_block(*to, &payload).expect("the same shape");
        assert_eq!(
            target.export_block(*to).expect("a block"),
            payload,
            "the bytes moved unchanged"
        );
    }
    let moved = model
        .forward_batch(
            &mut target,
            &mut [Chunk {
                sequence: &mut there,
                tokens: &PROMPT[PREFIX..],
            }],
            Logits::All,
        )
        .expect("tail");
    let local = model
        .forward_batch(
            &mut source,
            &mut [Chunk {
                sequence: &mut here,
                tokens: &PROMPT[PREFIX..],
            }],
            Logits::All,
        )
        .expect("tail");
    (moved.concat(), local.concat())
}

#[test]
fn imported_blocks_give_the_logits_of_the_cache_they_came_from_bit_for_bit() {
    let _turn = switchyard_harness::turn();
    let model = model();
    let vocab = model.config().vocab_size;
    let whole = model.forward(&PROMPT).expect("one shot");
    for precision in [KvPrecision::F32, KvPrecision::F16] {
        let (moved, local) = tail_logits_moved_and_local(&model, precision);
        assert_eq!(moved.len(), (PROMPT.len() - PREFIX) * vocab);
        assert!(
            moved.iter().zip(&local).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{precision}: the moved cache's logits are the source's, bit for bit (max |Δ| {})",
            max_difference(&moved, &local)
        );
        // And the one-shot prefill's, as a prefix-cache hit's are (chunking moves the sums a
        // little; f16 rounds the cached values).
        let difference = max_difference(&moved, &whole[PREFIX * vocab..]);
        let tolerance = if precision == KvPrecision::F32 { 1e-5 } else { 1e-3 };
        assert!(
            difference <= tolerance,
            "{precision}: max |Δ| {difference} from one shot"
        );
    }
}

fn engine_config() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_gpu_blocks: 64,
        max_num_batched_tokens: 64,
        max_num_seqs: 4,
        ..EngineConfig::default()
    }
}

/// Generates greedily from `prompt`; the tokens and the prompt tokens served from the cache.
async fn generate(engine: &EngineHandle, prompt: &[u32], max_tokens: usize) -> (Vec<u32>, u32) {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..SamplingParams::default()
    };
    let mut outputs = engine.submit(prompt.to_vec(), params).expect("accepted");
    let mut tokens = Vec::new();
    while let Some(output) = outputs.recv().await {
        match output {
            Output::Token(token) => tokens.push(token),
            Output::Finished { cached_tokens, .. } => return (tokens, cached_tokens),
            Output::Failed(reason) => panic!("generation failed: {reason}"),
            Output::Started { .. } => {}
        }
    }
    panic!("the stream ended without a finish");
}

/// `prompt`'s blocks exported by `prefill`, through the workers' wire framing, as an import
/// into another engine from its first block.
async fn exported(prefill: &EngineHandle, prompt: &[u32]) -> (KvImport, Vec<Vec<u8>>) {
    let chain = block_hashes(prompt, 4);
    let hashes: Vec<u64> = chain.iter().map(|hash| hash.sequence).collect();
    let export = prefill.export_kv(hashes.clone()).await.expect("the engine runs");
    assert_eq!(export.block_hashes, hashes, "the prefill engine holds every full block");
    let payloads = export
        .payloads
        .expect("a native engine's blocks come with their keys and values");
    let body = kv_blocks::encode(&export.block_hashes, &payloads).expect("frames");
    let blocks = kv_blocks::decode(body.into()).expect("reads back");
    assert_eq!(blocks.block_hashes, hashes);
    let import = KvImport {
        chain,
        first: 0,
        payloads: Some(blocks.payloads),
    };
    (import, payloads)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_engine_generates_from_a_prefill_engines_blocks_what_it_would_itself() {
    let _turn = switchyard_harness::turn();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 11 + 1) % 288).collect();
    let whole = spawn_cpu_engine(model(), engine_config()).expect("starts");
    let (expected, _) = generate(&whole, &prompt, 16).await;

    let prefill = spawn_cpu_engine(model(), engine_config()).expect("starts");
    // What a router asks of a prefill worker: the prompt and one token.
    let (first, _) = generate(&prefill, &prompt, 1).await;
    assert_eq!(first, expected[..1]);
    let (import, payloads) = exported(&prefill, &prompt).await;
    assert_eq!(payloads.len(), 7, "30 tokens fill 7 blocks of 4");

    let decode = spawn_cpu_engine(model(), engine_config()).expect("starts");
    let imported = decode.import_kv(import).await.expect("the engine runs");
    assert_eq!(
        imported,
        KvImported {
            already_cached: 0,
            imported: 7,
            refused: false
        }
    );
    let hashes: Vec<u64> = block_hashes(&prompt, 4).iter().map(|hash| hash.sequence).collect();
    let again = decode.export_kv(hashes).await.expect("the engine runs");
    assert_eq!(
        again.payloads,
        Some(payloads),
        "the decode engine's blocks hold the prefill engine's bytes"
    );
    let (tokens, cached) = generate(&decode, &prompt, 16).await;
    assert_eq!(
        cached, 28,
        "the decode engine prefilled only the 2 tokens past the moved blocks"
    );
    assert_eq!(tokens, expected, "the tokens of serving the prompt whole");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_of_another_dtype_are_refused_and_the_prompt_is_prefilled() {
    let _turn = switchyard_harness::turn();
    let prompt: Vec<u32> = (0..17).map(|i| (i * 29 + 3) % 288).collect();
    let prefill = spawn_cpu_engine(model(), engine_config()).expect("starts");
    generate(&prefill, &prompt, 1).await;
    let (import, _) = exported(&prefill, &prompt).await;
    let decode = spawn_cpu_engine_with(model(), engine_config(), KvPrecision::F16).expect("starts");
    let refused = decode.import_kv(import).await.expect("the engine runs");
    assert_eq!(
        refused,
        KvImported {
            already_cached: 0,
            imported: 0,
            refused: true
        },
        "an f32 payload is not an f16 cache's block"
    );
    let hashes: Vec<u64> = block_hashes(&prompt, 4).iter().map(|hash| hash.sequence).collect();
    assert_eq!(decode.held_blocks(hashes).await.expect("the engine runs"), 0);
    let (tokens, cached) = generate(&decode, &prompt, 4).await;
    assert_eq!((tokens.len(), cached), (4, 0), "prefilled here, from nothing cached");
}
