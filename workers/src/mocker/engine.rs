//! The mocker's engine: the shared scheduler driving simulated forward passes.
//!
//! A simulated engine is one tokio task running the scheduler of [`crate::engine`] (so it
//! batches, caches, evicts, preempts and publishes KV events exactly as the native engine
//! does). Instead of computing a step it *sleeps* for the time [`perf`] gives, divided by the
//! speed-up factor, and then makes up one word per finishing sequence ([`mock_token`]) from
//! the tokens before it, as a greedy model would: the same context gives the same word on
//! every engine, so a stream continued elsewhere from its tokens goes on exactly as it would
//! have.
//! Deadlines advance on a virtual clock so that steps shorter than the timer resolution still
//! average out to the model's throughput.

use std::time::Duration;

use tokio::time::Instant;

pub use crate::engine::{
    EngineConfig, EngineHandle, EngineStats, FinishReason, ModelLimits, Output, SamplingParams, SubmitError,
};
use crate::engine::{Executor, KvMedium, StepItem};
use crate::mocker::perf;

/// How far the virtual clock may fall behind real time before it is reset, so that a stall
/// (a busy machine) is not followed by a burst of instant steps.
const MAX_CLOCK_LAG: Duration = Duration::from_millis(20);

/// The simulated model: every finishing sequence gets the next word of its mock answer.
struct MockTokens;

impl Executor for MockTokens {
    fn execute(&mut self, items: &mut [StepItem<'_>]) -> Result<(), String> {
        for item in items.iter_mut().filter(|item| item.samples()) {
            item.next_token = Some(Ok(mock_token(item.tokens)));
        }
        Ok(())
    }

    fn kv_medium(&self) -> KvMedium {
        // Simulated blocks hold nothing: they move by name, and the server simulates the time.
        KvMedium::Simulated
    }
}

/// Starts a simulated engine on the current tokio runtime.
pub fn spawn_engine(config: EngineConfig) -> EngineHandle {
    let speedup = config.speedup;
    let (handle, mut scheduler, mut submissions) =
        EngineHandle::new(config, ModelLimits::default(), MockTokens.kv_medium());
    tokio::spawn(async move {
        let mut clock = Instant::now();
        let mut open = true;
        loop {
            if open {
                open = scheduler.take_submissions(&mut submissions, &mut MockTokens);
            }
            let plan = scheduler.next_step();
            if plan.is_empty() {
                // Nothing can run until something changes; wait for a new request.
                if !open {
                    return;
                }
                match submissions.recv().await {
                    Some(submission) => scheduler.enqueue(submission, &mut MockTokens),
                    None => open = false,
                }
                clock = Instant::now();
                continue;
            }
            let duration = perf::step_duration(plan.prefill_tokens, plan.decode_seqs, scheduler.kv_usage(), speedup);
            let now = Instant::now();
            clock = clock.max(now.checked_sub(MAX_CLOCK_LAG).unwrap_or(now)) + duration;
            if clock > now {
                tokio::time::sleep_until(clock).await;
            } else {
                tokio::task::yield_now().await;
            }
            scheduler.execute(plan, &mut MockTokens);
        }
    });
    handle
}

/// The number of distinct words the mocker generates.
pub const MOCK_VOCABULARY: u32 = 64;

/// First token id of generated words, above the byte-level fallback's 0..=255.
pub const MOCK_TOKEN_BASE: u32 = 256;

const WORDS: [&str; MOCK_VOCABULARY as usize] = [
    "the",
    "switchyard",
    "routes",
    "tokens",
    "to",
    "workers",
    "with",
    "cached",
    "prefixes",
    "and",
    "a",
    "policy",
    "that",
    "operators",
    "swap",
    "live",
    "while",
    "traffic",
    "flows",
    "through",
    "gateway",
    "on",
    "every",
    "request",
    "it",
    "picks",
    "least",
    "loaded",
    "engine",
    "for",
    "prompt",
    "blocks",
    "stream",
    "back",
    "as",
    "they",
    "arrive",
    "from",
    "simulated",
    "GPUs",
    "mock",
    "answer",
    "is",
    "deterministic",
    "so",
    "tests",
    "can",
    "check",
    "each",
    "word",
    "in",
    "order",
    "of",
    "generation",
    "under",
    "load",
    "without",
    "real",
    "weights",
    "or",
    "kernels",
    "here",
    "now",
    "done",
];

/// Tokens of the context that choose the next mock word: enough that conversations differ in
/// them, few enough that a word costs the same at any context length.
const MOCK_CONTEXT: usize = 64;

/// The token a mock sequence generates after `context` (its prompt and what it generated so
/// far): a hash of the last [`MOCK_CONTEXT`] tokens and the length, so it depends on nothing
/// but the tokens, as a greedy model's next token does.
pub fn mock_token(context: &[u32]) -> u32 {
    let recent = &context[context.len().saturating_sub(MOCK_CONTEXT)..];
    let mut bytes = [0u8; MOCK_CONTEXT * 4];
    for (slot, token) in bytes.as_chunks_mut::<4>().0.iter_mut().zip(recent) {
        *slot = token.to_le_bytes();
    }
    let mixed = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[..recent.len() * 4], context.len() as u64);
    MOCK_TOKEN_BASE + (mixed % u64::from(MOCK_VOCABULARY)) as u32
}

/// The text of a generated token: a space and a word.
pub fn token_text(token: u32) -> String {
    let index = token.wrapping_sub(MOCK_TOKEN_BASE) % MOCK_VOCABULARY;
    format!(" {}", WORDS[index as usize])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::KvEvent;
    use std::sync::atomic::Ordering;
    use tokio::sync::mpsc;

    fn max(tokens: usize) -> SamplingParams {
        SamplingParams {
            max_tokens: tokens,
            ..SamplingParams::default()
        }
    }

    fn config() -> EngineConfig {
        EngineConfig {
            block_size: 4,
            num_gpu_blocks: 64,
            max_num_batched_tokens: 16,
            max_num_seqs: 8,
            speedup: 1000.0,
            ..EngineConfig::default()
        }
    }

    async fn collect(mut receiver: mpsc::UnboundedReceiver<Output>) -> (Vec<u32>, Output) {
        let mut tokens = Vec::new();
        while let Some(output) = receiver.recv().await {
            match output {
                Output::Token(token) => tokens.push(token),
                finished @ Output::Finished { .. } => return (tokens, finished),
                Output::Started { .. } => {}
                Output::Failed(reason) => panic!("the request failed: {reason}"),
            }
        }
        panic!("stream ended without a finish");
    }

    #[tokio::test]
    async fn generates_exactly_max_tokens() {
        let engine = spawn_engine(config());
        let (tokens, finished) = collect(engine.submit((0..10).collect(), max(5)).expect("accepted")).await;
        assert_eq!(tokens.len(), 5);
        assert!(matches!(
            finished,
            Output::Finished {
                completion_tokens: 5,
                prompt_tokens: 10,
                ..
            }
        ));
    }

    #[tokio::test]
    async fn a_repeated_prompt_hits_the_prefix_cache() {
        let engine = spawn_engine(config());
        let (sink, mut events) = mpsc::unbounded_channel();
        engine.subscribe_kv_events(sink);
        let prompt: Vec<u32> = (0..40).collect();
        collect(engine.submit(prompt.clone(), max(2)).expect("accepted")).await;
        let (_, second) = collect(engine.submit(prompt, max(2)).expect("accepted")).await;
        let Output::Finished { cached_tokens, .. } = second else {
            unreachable!()
        };
        assert_eq!(cached_tokens, 36, "all full blocks but the one recomputed for sampling");
        let mut stored = 0;
        while let Ok(event) = events.try_recv() {
            if let KvEvent::Stored { blocks, .. } = event {
                stored += blocks.len();
            }
        }
        assert!(stored >= 10, "the prompt's 10 full blocks were stored, got {stored}");
    }

    #[tokio::test]
    async fn preemption_lets_every_request_finish() {
        // 8 blocks of 4 tokens: two sequences of 12 + 12 tokens cannot both be resident.
        let engine = spawn_engine(EngineConfig {
            num_gpu_blocks: 8,
            ..config()
        });
        let first = engine.submit((0..12).collect(), max(12)).expect("accepted");
        let second = engine.submit((100..112).collect(), max(12)).expect("accepted");
        let (a, b) = tokio::join!(collect(first), collect(second));
        assert_eq!(a.0.len(), 12);
        assert_eq!(b.0.len(), 12);
        assert!(engine.stats().preemptions.load(Ordering::Relaxed) > 0);
    }

    #[tokio::test]
    async fn a_gated_prompt_prefills_its_prefix_and_waits() {
        use crate::engine::PrefillGate;
        let engine = spawn_engine(config());
        let gate = PrefillGate::new(10);
        let mut outputs = engine
            .submit_gated((0..30).collect(), max(3), Some(gate.clone()))
            .expect("accepted");
        assert!(matches!(outputs.recv().await, Some(Output::Started { .. })));
        // An ungated request behind it is not held up.
        let (tokens, _) = collect(engine.submit((100..120).collect(), max(2)).expect("accepted")).await;
        assert_eq!(tokens.len(), 2);
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(outputs.try_recv().is_err(), "no token before the gate opens");
        let computed = engine.stats().computed_tokens.load(Ordering::Relaxed);
        assert_eq!(
            computed,
            10 + 20 + 1,
            "the gated prefix, the other prompt and its one decode"
        );
        gate.open();
        engine.wake();
        let (tokens, finished) = collect(outputs).await;
        assert_eq!(tokens.len(), 3);
        assert!(matches!(finished, Output::Finished { prompt_tokens: 30, .. }));
    }

    #[tokio::test]
    async fn oversized_requests_are_refused() {
        let engine = spawn_engine(EngineConfig {
            num_gpu_blocks: 2,
            ..config()
        });
        assert!(matches!(
            engine.submit((0..8).collect(), max(4)),
            Err(SubmitError::TooLong { .. })
        ));
        assert_eq!(engine.submit(Vec::new(), max(4)).unwrap_err(), SubmitError::EmptyPrompt);
    }

    #[tokio::test]
    async fn a_stream_continued_from_its_tokens_goes_on_as_it_would_have() {
        let engine = spawn_engine(config());
        let prompt: Vec<u32> = (0..21).collect();
        let (whole, _) = collect(engine.submit(prompt.clone(), max(12)).expect("accepted")).await;
        // Another engine (nothing cached), given the prompt and the first 5 tokens.
        let other = spawn_engine(config());
        let continued_prompt = [prompt.as_slice(), &whole[..5]].concat();
        let (rest, finished) = collect(other.submit(continued_prompt, max(7)).expect("accepted")).await;
        assert_eq!(rest, whole[5..], "the continuation is token-exact");
        assert!(matches!(finished, Output::Finished { prompt_tokens: 26, .. }));
        // A different prompt of the same length answers differently.
        let (different, _) = collect(engine.submit((1..22).collect(), max(12)).expect("accepted")).await;
        assert_ne!(different, whole);
    }

    #[tokio::test]
    async fn cancelled_requests_free_their_blocks() {
        let engine = spawn_engine(config());
        let receiver = engine.submit((0..30).collect(), max(200)).expect("accepted");
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(receiver);
        for _ in 0..200 {
            if engine.stats().running.load(Ordering::Relaxed) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The next step notices the closed stream; a new request wakes the engine for it.
        collect(engine.submit(vec![1], max(1)).expect("accepted")).await;
        assert_eq!(engine.stats().active_blocks.load(Ordering::Relaxed), 0);
    }
}
