//! A profiling aid: the CPU forward pass in a loop, for `perf record`, with none of the bench's
//! other models and anchors around it. Batch-`BATCH` decode steps (default 32) after a
//! 128-token context, as `benches/llm_cpu.rs` runs them, or with `PREFILL=N` one N-token prefill
//! at a time; for `SECS` seconds (default 10), then steps or tokens per second.
//!
//! ```text
//! cargo build --release -p switchyard-llm --example decode_loop
//! SWITCHYARD_SMOLLM2_GGUF=$(scripts/fetch-smollm2.sh) BATCH=32 perf record -g target/release/examples/decode_loop
//! ```
use std::time::Instant;
use switchyard_llm::{Chunk, Logits, Model, PagedKv, SequenceKv};
fn main() {
    let gguf = std::env::var("SWITCHYARD_SMOLLM2_GGUF").expect("SWITCHYARD_SMOLLM2_GGUF names a GGUF file");
    let batch: usize = std::env::var("BATCH").ok().and_then(|b| b.parse().ok()).unwrap_or(32);
    let secs: f64 = std::env::var("SECS").ok().and_then(|b| b.parse().ok()).unwrap_or(10.0);
    let model = Model::load(std::path::Path::new(&gguf)).expect("load");
    let vocab = model.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..512u32).map(|i| (i * 7 + 3) % vocab).collect();
    let block = 16;
    let context = 128;
    let blocks_each = (context + 64usize).div_ceil(block);
    let mut kv = PagedKv::new(model.config(), block, batch * blocks_each);
    let mut sequences: Vec<SequenceKv> = (0..batch)
        .map(|b| SequenceKv {
            blocks: (b * blocks_each..(b + 1) * blocks_each).map(|x| x as u32).collect(),
            computed: 0,
        })
        .collect();
    {
        let mut chunks: Vec<Chunk<'_>> = sequences
            .iter_mut()
            .map(|sequence| Chunk {
                sequence,
                tokens: &tokens[..context],
            })
            .collect();
        model
            .forward_batch(&mut kv, &mut chunks, Logits::Last)
            .expect("prefill");
    }
    if let Ok(n) = std::env::var("PREFILL") {
        let n: usize = n.parse().expect("PREFILL is a token count");
        let start = Instant::now();
        let mut runs = 0;
        while start.elapsed().as_secs_f64() < secs {
            let mut kv = PagedKv::new(model.config(), block, n.div_ceil(block));
            let mut sequence = SequenceKv {
                blocks: (0..n.div_ceil(block) as u32).collect(),
                computed: 0,
            };
            std::hint::black_box(
                model
                    .forward_batch(
                        &mut kv,
                        &mut [Chunk {
                            sequence: &mut sequence,
                            tokens: &tokens[..n],
                        }],
                        Logits::Last,
                    )
                    .expect("prefill"),
            );
            runs += 1;
        }
        println!(
            "prefill {n}: {:.0} tok/s",
            runs as f64 * n as f64 / start.elapsed().as_secs_f64()
        );
        return;
    }
    let next = vec![5u32; batch];
    let start = Instant::now();
    let mut steps = 0u64;
    let mut since = 0;
    while start.elapsed().as_secs_f64() < secs {
        if since >= 60 {
            for s in &mut sequences {
                s.computed = context;
            }
            since = 0;
        }
        let mut chunks: Vec<Chunk<'_>> = sequences
            .iter_mut()
            .zip(&next)
            .map(|(sequence, token)| Chunk {
                sequence,
                tokens: std::slice::from_ref(token),
            })
            .collect();
        std::hint::black_box(model.forward_batch(&mut kv, &mut chunks, Logits::Last).expect("decode"));
        steps += 1;
        since += 1;
    }
    let t = start.elapsed().as_secs_f64();
    println!(
        "batch {batch}: {:.1} ms/step, {:.0} tok/s",
        1e3 * t / steps as f64,
        steps as f64 * batch as f64 / t
    );
}
