//! The forward passes the CPU bench times, shared with `examples/decode_loop.rs` (which runs
//! one of them in a loop for `perf`): a one-chunk prefill in a fresh cache, and batched decode
//! steps after a prefilled context.

use std::hint::black_box;

use switchyard_llm::{Chunk, KvPrecision, Logits, Model, PagedKv, SequenceKv};

/// Positions per cache block.
const BLOCK: usize = 16;

/// Decode steps before the sequences rewind to their context, to stay inside their blocks.
const STEPS_BEFORE_REWIND: usize = 60;

/// `tokens` as one sequence's prefill, in a cache of its own.
pub fn prefill_once(model: &Model, tokens: &[u32]) {
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut kv = PagedKv::new(model.config(), BLOCK, blocks);
    let mut sequence = SequenceKv {
        blocks: (0..blocks as u32).collect(),
        computed: 0,
    };
    black_box(
        model
            .forward_batch(
                &mut kv,
                &mut [Chunk {
                    sequence: &mut sequence,
                    tokens,
                }],
                Logits::Last,
            )
            .expect("prefill"),
    );
}

/// `batch` sequences sharing nothing, each with the same context in the cache, decoding one
/// token a step; every [`STEPS_BEFORE_REWIND`] steps they rewind and decode the same positions
/// again.
pub struct Decoding {
    kv: PagedKv,
    sequences: Vec<SequenceKv>,
    context: usize,
    next: Vec<u32>,
    steps: usize,
}

impl Decoding {
    /// Prefills `context` for each of `batch` sequences in a cache of `precision`.
    pub fn new(model: &Model, context: &[u32], batch: usize, precision: KvPrecision) -> Decoding {
        let blocks_each = (context.len() + STEPS_BEFORE_REWIND).div_ceil(BLOCK);
        let mut kv = PagedKv::with_precision(model.config(), BLOCK, batch * blocks_each, precision);
        let mut sequences: Vec<SequenceKv> = (0..batch)
            .map(|b| SequenceKv {
                blocks: (b * blocks_each..(b + 1) * blocks_each).map(|x| x as u32).collect(),
                computed: 0,
            })
            .collect();
        let mut chunks: Vec<Chunk<'_>> = sequences
            .iter_mut()
            .map(|sequence| Chunk {
                sequence,
                tokens: context,
            })
            .collect();
        model
            .forward_batch(&mut kv, &mut chunks, Logits::Last)
            .expect("prefill contexts");
        Decoding {
            kv,
            sequences,
            context: context.len(),
            next: vec![5; batch],
            steps: 0,
        }
    }

    /// One decode step of every sequence.
    pub fn step(&mut self, model: &Model) {
        if self.steps >= STEPS_BEFORE_REWIND {
            for sequence in &mut self.sequences {
                sequence.computed = self.context;
            }
            self.steps = 0;
        }
        let mut chunks: Vec<Chunk<'_>> = self
            .sequences
            .iter_mut()
            .zip(&self.next)
            .map(|(sequence, token)| Chunk {
                sequence,
                tokens: std::slice::from_ref(token),
            })
            .collect();
        black_box(
            model
                .forward_batch(&mut self.kv, &mut chunks, Logits::Last)
                .expect("decode"),
        );
        self.steps += 1;
    }
}
