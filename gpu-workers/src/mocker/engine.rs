//! The mocker's engine: a vLLM-like scheduler driving simulated forward passes.
//!
//! One engine is one tokio task that owns a [`BlockManager`], a *waiting* queue and a *running*
//! list. Every step it builds a batch under a token budget (`max_num_batched_tokens`) and a
//! sequence cap (`max_num_seqs`): running sequences first (one token each when decoding, a
//! prompt chunk when prefilling), then waiting sequences in arrival order, whose cached prefix
//! blocks are taken from the prefix cache instead of being computed. When a running sequence
//! needs a block and none can be had, the most recently admitted sequence is preempted (its
//! blocks released, its tokens recomputed later), as vLLM does. The step then *sleeps* for the
//! time [`perf`] gives, divided by the speed-up factor, and emits one token for every sequence
//! whose tokens are all computed. Deadlines advance on a virtual clock so that steps shorter than
//! the timer resolution still average out to the model's throughput.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::blocks::{BlockHash, block_hashes, chain_hash, local_hash};
use crate::mocker::kv::{BlockManager, KvEvent};
use crate::mocker::perf;

/// Settings of one simulated engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the simulated GPU.
    pub num_gpu_blocks: usize,
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Split long prompts across steps instead of waiting for a step with room for all of them.
    pub enable_chunked_prefill: bool,
    /// Reuse cached blocks of equal prefixes.
    pub enable_prefix_caching: bool,
    /// Simulated time runs this many times faster than the model says.
    pub speedup: f64,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            block_size: 64,
            num_gpu_blocks: 16_384,
            max_num_batched_tokens: 8_192,
            max_num_seqs: 256,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            speedup: 1.0,
        }
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` was reached.
    Length,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
        }
    }
}

/// What an engine sends back for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// One generated token.
    Token(u32),
    /// The generation is over.
    Finished {
        /// Why it ended.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Generated tokens.
        completion_tokens: u32,
        /// Prompt tokens served from the prefix cache at first admission.
        cached_tokens: u32,
    },
}

/// Why an engine refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The request could never fit in the KV cache.
    #[error("request needs {needed} KV blocks ({tokens} tokens) but the engine has {capacity}")]
    TooLong {
        /// Prompt plus generated tokens.
        tokens: usize,
        /// Blocks that needs.
        needed: usize,
        /// Blocks the engine has.
        capacity: usize,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The engine task has stopped.
    #[error("the engine has stopped")]
    Stopped,
}

/// Live counters of one engine, readable from any thread.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Sequences waiting for admission.
    pub waiting: AtomicU64,
    /// Sequences running.
    pub running: AtomicU64,
    /// KV blocks referenced by running sequences.
    pub active_blocks: AtomicU64,
    /// KV blocks in the pool.
    pub total_blocks: AtomicU64,
    /// Requests accepted.
    pub requests: AtomicU64,
    /// Prompt tokens admitted.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Preemptions.
    pub preemptions: AtomicU64,
    /// Steps run.
    pub steps: AtomicU64,
}

struct Submission {
    prompt: Vec<u32>,
    max_tokens: usize,
    out: mpsc::UnboundedSender<Output>,
}

/// A handle to a running engine; cheap to clone.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    submissions: mpsc::UnboundedSender<Submission>,
    config: Arc<EngineConfig>,
    stats: Arc<EngineStats>,
    events: Arc<std::sync::Mutex<Option<mpsc::UnboundedSender<KvEvent>>>>,
}

impl EngineHandle {
    /// Queues a generation of up to `max_tokens` tokens after `prompt` and returns the stream
    /// of its outputs. Dropping the receiver cancels the request and frees its blocks.
    ///
    /// # Errors
    ///
    /// Returns [`SubmitError`] if the prompt is empty, if prompt plus output could never fit in
    /// the KV cache, or if the engine has stopped.
    pub fn submit(&self, prompt: Vec<u32>, max_tokens: usize) -> Result<mpsc::UnboundedReceiver<Output>, SubmitError> {
        if prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let tokens = prompt.len() + max_tokens;
        let needed = tokens.div_ceil(self.config.block_size);
        if needed > self.config.num_gpu_blocks {
            return Err(SubmitError::TooLong {
                tokens,
                needed,
                capacity: self.config.num_gpu_blocks,
            });
        }
        let (out, receiver) = mpsc::unbounded_channel();
        self.submissions
            .send(Submission {
                prompt,
                max_tokens: max_tokens.max(1),
                out,
            })
            .map_err(|_| SubmitError::Stopped)?;
        Ok(receiver)
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The engine's live counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Sends every future KV event of this engine to `sink` (replacing an earlier sink).
    pub fn subscribe_kv_events(&self, sink: mpsc::UnboundedSender<KvEvent>) {
        if let Ok(mut slot) = self.events.lock() {
            *slot = Some(sink);
        }
    }
}

/// Starts an engine on the current tokio runtime.
pub fn spawn_engine(config: EngineConfig) -> EngineHandle {
    let (submissions, receiver) = mpsc::unbounded_channel();
    let stats = Arc::new(EngineStats::default());
    stats
        .total_blocks
        .store(config.num_gpu_blocks as u64, Ordering::Relaxed);
    let events = Arc::new(std::sync::Mutex::new(None));
    let handle = EngineHandle {
        submissions,
        config: Arc::new(config.clone()),
        stats: stats.clone(),
        events: events.clone(),
    };
    let scheduler = Scheduler::new(config, stats, events);
    tokio::spawn(scheduler.run(receiver));
    handle
}

/// Where a sequence's block lives.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// A full, hashed, shareable block.
    Full(u64),
    /// A block still filling, private to the sequence.
    Anonymous,
}

struct Sequence {
    id: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    /// Hashes of the full blocks of `tokens` known so far.
    hashes: Vec<BlockHash>,
    slots: Vec<Slot>,
    /// Leading slots that are already full (so a step only looks at the new ones).
    full_slots: usize,
    /// Tokens whose KV is computed.
    computed: usize,
    cached_tokens: Option<usize>,
    out: mpsc::UnboundedSender<Output>,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn is_decoding(&self) -> bool {
        self.generated() > 0 && self.tokens.len() - self.computed == 1
    }
}

struct Scheduler {
    config: EngineConfig,
    blocks: BlockManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_id: u64,
    stats: Arc<EngineStats>,
    events: Arc<std::sync::Mutex<Option<mpsc::UnboundedSender<KvEvent>>>>,
}

/// What one step computes: `(index into running, tokens)`.
struct Plan {
    work: Vec<(usize, usize)>,
    prefill_tokens: usize,
    decode_seqs: usize,
}

/// How far the virtual clock may fall behind real time before it is reset, so that a stall
/// (a busy machine) is not followed by a burst of instant steps.
const MAX_CLOCK_LAG: Duration = Duration::from_millis(20);

impl Scheduler {
    fn new(
        config: EngineConfig,
        stats: Arc<EngineStats>,
        events: Arc<std::sync::Mutex<Option<mpsc::UnboundedSender<KvEvent>>>>,
    ) -> Scheduler {
        Scheduler {
            blocks: BlockManager::new(config.num_gpu_blocks, config.enable_prefix_caching),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            stats,
            events,
        }
    }

    async fn run(mut self, mut submissions: mpsc::UnboundedReceiver<Submission>) {
        let mut clock = Instant::now();
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match submissions.recv().await {
                    Some(submission) => self.enqueue(submission),
                    None => return,
                }
                clock = Instant::now();
            }
            while let Ok(submission) = submissions.try_recv() {
                self.enqueue(submission);
            }
            self.drop_cancelled();
            let plan = self.schedule();
            self.publish();
            if plan.work.is_empty() {
                // Nothing can run until something changes; wait for a new request.
                match submissions.recv().await {
                    Some(submission) => self.enqueue(submission),
                    None => return,
                }
                clock = Instant::now();
                continue;
            }
            let duration = perf::step_duration(
                plan.prefill_tokens,
                plan.decode_seqs,
                self.blocks.usage(),
                self.config.speedup,
            );
            let now = Instant::now();
            clock = clock.max(now.checked_sub(MAX_CLOCK_LAG).unwrap_or(now)) + duration;
            if clock > now {
                tokio::time::sleep_until(clock).await;
            } else {
                tokio::task::yield_now().await;
            }
            self.complete(plan);
            self.publish();
        }
    }

    fn enqueue(&mut self, submission: Submission) {
        let hashes = block_hashes(&submission.prompt, self.config.block_size);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.next_id += 1;
        self.waiting.push_back(Sequence {
            id: self.next_id,
            prompt_len: submission.prompt.len(),
            tokens: submission.prompt,
            max_tokens: submission.max_tokens,
            hashes,
            slots: Vec::new(),
            full_slots: 0,
            computed: 0,
            cached_tokens: None,
            out: submission.out,
        });
    }

    fn drop_cancelled(&mut self) {
        self.waiting.retain(|seq| !seq.out.is_closed());
        let mut index = 0;
        while index < self.running.len() {
            if self.running[index].out.is_closed() {
                let seq = self.running.remove(index);
                self.release(&seq);
            } else {
                index += 1;
            }
        }
    }

    fn release(&mut self, seq: &Sequence) {
        for slot in &seq.slots {
            match slot {
                Slot::Full(hash) => self.blocks.release_full(*hash),
                Slot::Anonymous => self.blocks.release_anonymous(),
            }
        }
    }

    fn preempt(&mut self, mut seq: Sequence) {
        self.release(&seq);
        seq.slots.clear();
        seq.full_slots = 0;
        seq.computed = 0;
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        self.waiting.push_front(seq);
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    fn chunk(&self, remaining: usize, budget: usize) -> Option<usize> {
        if self.config.enable_chunked_prefill {
            Some(remaining.min(budget))
        } else {
            (remaining <= budget).then_some(remaining)
        }
    }

    fn schedule(&mut self) -> Plan {
        let mut budget = self.config.max_num_batched_tokens;
        let mut work = Vec::new();
        let mut preempted = false;
        let mut index = 0;
        'running: while index < self.running.len() && budget > 0 {
            let seq = &self.running[index];
            let Some(tokens) = self.chunk(seq.tokens.len() - seq.computed, budget) else {
                index += 1;
                continue;
            };
            let needed = self.blocks_for(seq.computed + tokens) - seq.slots.len();
            while self.blocks.available() < needed {
                preempted = true;
                let victim = self.running.pop().expect("running holds at least this sequence");
                let victim_is_current = self.running.len() == index;
                self.preempt(victim);
                if victim_is_current {
                    break 'running;
                }
            }
            for _ in 0..needed {
                let allocated = self.blocks.allocate_anonymous();
                debug_assert!(allocated, "availability was checked");
                self.running[index].slots.push(Slot::Anonymous);
            }
            work.push((index, tokens));
            budget -= tokens;
            index += 1;
        }
        // Like vLLM, admit nothing new in a step that had to preempt.
        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let mut cached = self.blocks.cached_prefix(&seq.hashes);
            if cached * self.config.block_size >= seq.tokens.len() {
                // At least one token must be computed to produce the next one.
                cached -= 1;
            }
            let computed = cached * self.config.block_size;
            let Some(tokens) = self.chunk(seq.tokens.len() - computed, budget) else {
                break;
            };
            let new_blocks = self.blocks_for(computed + tokens) - cached;
            if !self.blocks.can_admit(&seq.hashes[..cached], new_blocks) {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            for hash in &seq.hashes[..cached] {
                let acquired = self.blocks.acquire_cached(hash.sequence);
                debug_assert!(acquired, "cached_prefix found it");
                seq.slots.push(Slot::Full(hash.sequence));
            }
            for _ in 0..new_blocks {
                let allocated = self.blocks.allocate_anonymous();
                debug_assert!(allocated, "can_admit checked availability");
                seq.slots.push(Slot::Anonymous);
            }
            seq.computed = computed;
            seq.full_slots = cached;
            if seq.cached_tokens.is_none() {
                let cached_prompt = computed.min(seq.prompt_len);
                seq.cached_tokens = Some(cached_prompt);
                self.stats
                    .prompt_tokens
                    .fetch_add(seq.prompt_len as u64, Ordering::Relaxed);
                self.stats
                    .cached_prompt_tokens
                    .fetch_add(cached_prompt as u64, Ordering::Relaxed);
            }
            self.running.push(seq);
            work.push((self.running.len() - 1, tokens));
            budget -= tokens;
        }
        let mut plan = Plan {
            work,
            prefill_tokens: 0,
            decode_seqs: 0,
        };
        for &(index, tokens) in &plan.work {
            if self.running[index].is_decoding() {
                plan.decode_seqs += 1;
            } else {
                plan.prefill_tokens += tokens;
            }
        }
        self.update_gauges();
        plan
    }

    fn complete(&mut self, plan: Plan) {
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let mut finished = Vec::new();
        for (index, tokens) in plan.work {
            let block_size = self.config.block_size;
            let seq = &mut self.running[index];
            seq.computed += tokens;
            // Blocks whose tokens are now all computed become shareable.
            for block in seq.full_slots..seq.computed / block_size {
                if seq.hashes.len() == block {
                    let start = block * block_size;
                    let local = local_hash(&seq.tokens[start..start + block_size]);
                    let parent = seq.hashes.last().map(|hash| hash.sequence);
                    seq.hashes.push(BlockHash {
                        local,
                        sequence: chain_hash(parent, local),
                    });
                }
                let parent = block.checked_sub(1).map(|previous| seq.hashes[previous].sequence);
                let hash = seq.hashes[block];
                seq.slots[block] = Slot::Full(hash.sequence);
                self.blocks.promote(parent, hash);
            }
            seq.full_slots = seq.full_slots.max(seq.computed / block_size);
            if seq.computed < seq.tokens.len() {
                continue;
            }
            let token = mock_token(seq.id, seq.tokens.len());
            seq.tokens.push(token);
            self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
            let mut alive = seq.out.send(Output::Token(token)).is_ok();
            if seq.generated() >= seq.max_tokens {
                alive = false;
                let _ = seq.out.send(Output::Finished {
                    reason: FinishReason::Length,
                    prompt_tokens: seq.prompt_len as u32,
                    completion_tokens: seq.generated() as u32,
                    cached_tokens: seq.cached_tokens.unwrap_or(0) as u32,
                });
            }
            if !alive {
                finished.push(index);
            }
        }
        // Remove from the back so earlier indices stay valid.
        finished.sort_unstable();
        for index in finished.into_iter().rev() {
            let seq = self.running.remove(index);
            self.release(&seq);
        }
        self.update_gauges();
    }

    fn update_gauges(&self) {
        self.stats.waiting.store(self.waiting.len() as u64, Ordering::Relaxed);
        self.stats.running.store(self.running.len() as u64, Ordering::Relaxed);
        self.stats
            .active_blocks
            .store(self.blocks.active_blocks() as u64, Ordering::Relaxed);
    }

    fn publish(&mut self) {
        let events = self.blocks.drain_events();
        if events.is_empty() {
            return;
        }
        if let Ok(mut slot) = self.events.lock()
            && let Some(sink) = slot.as_ref()
        {
            for event in events {
                if sink.send(event).is_err() {
                    *slot = None;
                    break;
                }
            }
        }
    }
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

/// The token a mock sequence generates at position `position` (deterministic per request).
pub fn mock_token(sequence_id: u64, position: usize) -> u32 {
    let mixed = xxhash_rust::xxh3::xxh3_64_with_seed(&(position as u64).to_le_bytes(), sequence_id);
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
            }
        }
        panic!("stream ended without a finish");
    }

    #[tokio::test]
    async fn generates_exactly_max_tokens() {
        let engine = spawn_engine(config());
        let (tokens, finished) = collect(engine.submit((0..10).collect(), 5).expect("accepted")).await;
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
        collect(engine.submit(prompt.clone(), 2).expect("accepted")).await;
        let (_, second) = collect(engine.submit(prompt, 2).expect("accepted")).await;
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
        let first = engine.submit((0..12).collect(), 12).expect("accepted");
        let second = engine.submit((100..112).collect(), 12).expect("accepted");
        let (a, b) = tokio::join!(collect(first), collect(second));
        assert_eq!(a.0.len(), 12);
        assert_eq!(b.0.len(), 12);
        assert!(engine.stats().preemptions.load(Ordering::Relaxed) > 0);
    }

    #[tokio::test]
    async fn oversized_requests_are_refused() {
        let engine = spawn_engine(EngineConfig {
            num_gpu_blocks: 2,
            ..config()
        });
        assert!(matches!(
            engine.submit((0..8).collect(), 4),
            Err(SubmitError::TooLong { .. })
        ));
        assert_eq!(engine.submit(Vec::new(), 4).unwrap_err(), SubmitError::EmptyPrompt);
    }

    #[tokio::test]
    async fn cancelled_requests_free_their_blocks() {
        let engine = spawn_engine(config());
        let receiver = engine.submit((0..30).collect(), 200).expect("accepted");
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(receiver);
        for _ in 0..200 {
            if engine.stats().running.load(Ordering::Relaxed) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The next step notices the closed stream; a new request wakes the engine for it.
        collect(engine.submit(vec![1], 1).expect("accepted")).await;
        assert_eq!(engine.stats().active_blocks.load(Ordering::Relaxed), 0);
    }
}
