//! The scheduler: which sequences compute which tokens in each step, and what happens after.
//!
//! One scheduler owns a [`BlockManager`], a *waiting* queue and a *running* list, as vLLM's
//! does. Every step it builds a batch under a token budget (`max_num_batched_tokens`) and a
//! sequence cap (`max_num_seqs`): running sequences first (one token each when decoding, a
//! prompt chunk when prefilling), then waiting sequences in arrival order, whose cached prefix
//! blocks are taken from the prefix cache instead of being computed. When a running sequence
//! needs a block and none can be had, the most recently admitted sequence is preempted (its
//! blocks released, its tokens recomputed later). An [`Executor`] then computes the step; every
//! sequence whose tokens are all computed gets its next token, full blocks become shareable
//! (and are announced as KV events), and finished sequences release their blocks.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;

use crate::engine::blocks::{BlockId, BlockManager};
use crate::engine::sampling::Sampler;
use crate::engine::transfer::{KvExport, KvImport, KvImported, KvMedium};
use crate::engine::{EngineConfig, EngineStats, EventSink, Output, PrefillGate, Submission};
use switchyard_protocol::block_hash::{BlockHash, block_hashes, chain_hash, local_hash};

/// Computes engine steps: the model (or a simulation of it) behind a scheduler.
pub trait Executor {
    /// Computes one step. Each item asks for its sequence's tokens `start..start + count` to
    /// be computed into its blocks; an item for which [`StepItem::samples`] holds must get
    /// its next token in [`StepItem::next_token`].
    ///
    /// # Errors
    ///
    /// A message if the step as a whole failed; every sequence in it then fails with it.
    fn execute(&mut self, items: &mut [StepItem<'_>]) -> Result<(), String>;

    /// What this executor's KV blocks are made of, for moving them between engines
    /// ([`crate::engine::transfer`]). The default, [`KvMedium::Opaque`], exports blocks by name
    /// only and imports none.
    fn kv_medium(&self) -> KvMedium {
        KvMedium::Opaque
    }

    /// Copies the keys and values of `blocks` out for an export, one payload per block in
    /// order; called only when [`kv_medium`](Self::kv_medium) is [`KvMedium::Payloads`].
    /// `None` (the default) exports the blocks without payloads.
    fn export_kv(&mut self, blocks: &[BlockId]) -> Option<Vec<Vec<u8>>> {
        let _ = blocks;
        None
    }

    /// Writes a moved block's keys and values (`payload`, as [`export_kv`](Self::export_kv)
    /// made it) into `block`, before the block becomes a cached block; called only when
    /// [`kv_medium`](Self::kv_medium) is [`KvMedium::Payloads`].
    ///
    /// # Errors
    ///
    /// A message if the payload does not fit the block; the import stops there and the rest
    /// of the prompt is prefilled. The default refuses every payload.
    fn import_kv(&mut self, block: BlockId, payload: &[u8]) -> Result<(), String> {
        let _ = (block, payload);
        Err("this executor cannot import KV blocks".into())
    }
}

/// One sequence's share of a step.
#[derive(Debug)]
pub struct StepItem<'a> {
    /// The engine's number for the sequence (stable for its lifetime).
    pub sequence_id: u64,
    /// Every token of the sequence so far: prompt, then generated.
    pub tokens: &'a [u32],
    /// Tokens before this one whose keys and values are in the cache.
    pub start: usize,
    /// Tokens to compute in this step.
    pub count: usize,
    /// The sequence's block table: the physical block of each run of `block_size` positions,
    /// covering at least `start + count` positions.
    pub blocks: &'a [BlockId],
    /// The sequence's sampler.
    pub sampler: &'a mut Sampler,
    /// Set by the executor: the next token, or why it could not be chosen.
    pub next_token: Option<Result<u32, String>>,
    /// The sequence's media feature rows (at prompt positions), once its gate opened with them.
    pub media: &'a [crate::engine::MediaSpan],
}

impl<'a> StepItem<'a> {
    /// The tokens this step computes.
    pub fn new_tokens(&self) -> &'a [u32] {
        let tokens: &'a [u32] = self.tokens;
        &tokens[self.start..self.start + self.count]
    }

    /// Whether the step reaches the end of the sequence, so a next token is wanted.
    pub fn samples(&self) -> bool {
        self.start + self.count == self.tokens.len()
    }
}

struct Sequence {
    id: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Hashes of the full blocks of `tokens` known so far.
    hashes: Vec<BlockHash>,
    /// The block table. Blocks `..full_blocks` are full and named by `hashes`; the rest are
    /// anonymous (still filling).
    blocks: Vec<BlockId>,
    full_blocks: usize,
    /// Tokens whose KV is computed.
    computed: usize,
    cached_tokens: Option<usize>,
    sampler: Sampler,
    out: mpsc::UnboundedSender<Output>,
    gate: Option<PrefillGate>,
}

impl Sequence {
    /// Tokens whose KV may be computed now: all of them, or the prompt up to the gate.
    fn ready_len(&self) -> usize {
        match &self.gate {
            Some(gate) => gate.limit().min(self.tokens.len()),
            None => self.tokens.len(),
        }
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn is_decoding(&self) -> bool {
        self.generated() > 0 && self.tokens.len() - self.computed == 1
    }
}

/// What one step computes.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// `(index into running, tokens)`, indices ascending.
    work: Vec<(usize, usize)>,
    /// Tokens of sequences still in prefill.
    pub(crate) prefill_tokens: usize,
    /// Sequences generating one token each.
    pub(crate) decode_seqs: usize,
}

impl Plan {
    /// Whether the step has nothing to compute.
    pub(crate) fn is_empty(&self) -> bool {
        self.work.is_empty()
    }
}

/// The scheduler of one engine; see the module docs.
pub(crate) struct Scheduler {
    config: EngineConfig,
    blocks: BlockManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_id: u64,
    stats: Arc<EngineStats>,
    events: EventSink,
}

impl Scheduler {
    pub(crate) fn new(config: EngineConfig, stats: Arc<EngineStats>, events: EventSink) -> Scheduler {
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

    /// Fraction of the KV cache referenced by running sequences.
    pub(crate) fn kv_usage(&self) -> f64 {
        self.blocks.usage()
    }

    /// Queues every submission already sent; returns false once every handle is gone.
    pub(crate) fn take_submissions<E: Executor + ?Sized>(
        &mut self,
        submissions: &mut mpsc::UnboundedReceiver<Submission>,
        executor: &mut E,
    ) -> bool {
        loop {
            match submissions.try_recv() {
                Ok(submission) => self.enqueue(submission, executor),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Runs the engine on this thread with a blocking executor until every handle is dropped
    /// and the requests already accepted have finished.
    pub(crate) fn run_blocking<E: Executor>(
        mut self,
        mut submissions: mpsc::UnboundedReceiver<Submission>,
        mut executor: E,
    ) {
        let mut open = true;
        loop {
            if open {
                open = self.take_submissions(&mut submissions, &mut executor);
            }
            let plan = self.next_step();
            if plan.is_empty() {
                // Nothing can run until a request arrives (or was cancelled).
                if !open {
                    self.fail_all("the engine is shutting down");
                    return;
                }
                match submissions.blocking_recv() {
                    Some(submission) => self.enqueue(submission, &mut executor),
                    None => open = false,
                }
                continue;
            }
            self.execute(plan, &mut executor);
        }
    }

    /// Takes one submission: queues a request, or does at once what needs no step (the
    /// executor is at hand for block exports and imports).
    pub(crate) fn enqueue<E: Executor + ?Sized>(&mut self, submission: Submission, executor: &mut E) {
        let submission = match submission {
            Submission::Request(request) => request,
            Submission::Held(hashes, reply) => {
                let _ = reply.send(self.blocks.held_run(&hashes));
                return;
            }
            Submission::Export(hashes, reply) => {
                let export = self.export(&hashes, executor);
                let _ = reply.send(export);
                return;
            }
            Submission::Import(import, reply) => {
                let imported = self.import(import, executor);
                let _ = reply.send(imported);
                return;
            }
            Submission::ClearCache(reply) => {
                let dropped = self.blocks.clear_cache();
                self.publish();
                let _ = reply.send(dropped);
                return;
            }
            Submission::Wake => return,
            Submission::Occupy(work, done) => {
                // This is the engine's thread: while it sleeps, no step runs.
                std::thread::sleep(work.div_f64(self.config.speedup.max(f64::MIN_POSITIVE)));
                let _ = done.send(());
                return;
            }
        };
        let hashes = block_hashes(&submission.prompt, self.config.block_size);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.next_id += 1;
        self.waiting.push_back(Sequence {
            id: self.next_id,
            prompt_len: submission.prompt.len(),
            tokens: submission.prompt,
            hashes,
            blocks: Vec::new(),
            full_blocks: 0,
            computed: 0,
            cached_tokens: None,
            sampler: submission.sampler,
            out: submission.out,
            gate: submission.gate,
        });
        self.update_gauges();
    }

    /// The leading run of `hashes` this engine holds, with the blocks' keys and values when
    /// its executor can copy them.
    fn export<E: Executor + ?Sized>(&mut self, hashes: &[u64], executor: &mut E) -> KvExport {
        let held = hashes[..self.blocks.held_run(hashes)].to_vec();
        let payloads = match executor.kv_medium() {
            KvMedium::Payloads => {
                let blocks: Vec<BlockId> = held.iter().filter_map(|hash| self.blocks.block_of(*hash)).collect();
                // A payload per block or none: a short list would pair blocks with the wrong
                // contents.
                executor
                    .export_kv(&blocks)
                    .filter(|payloads| payloads.len() == blocks.len())
            }
            KvMedium::Simulated | KvMedium::Opaque => None,
        };
        self.stats
            .exported_blocks
            .fetch_add(held.len() as u64, Ordering::Relaxed);
        KvExport {
            block_hashes: held,
            payloads,
        }
    }

    /// Takes `import`'s moved blocks in as cached blocks, as many as the pool can hold without
    /// touching a referenced block, and announces them as `stored`.
    fn import<E: Executor + ?Sized>(&mut self, import: KvImport, executor: &mut E) -> KvImported {
        let mut result = KvImported::default();
        let medium = executor.kv_medium();
        if !self.config.enable_prefix_caching || !medium.imports() {
            // Without the prefix cache an imported block could never be found again.
            return result;
        }
        let KvImport { chain, first, payloads } = import;
        let movable = match medium {
            KvMedium::Payloads => first.saturating_add(payloads.as_ref().map_or(0, Vec::len)),
            KvMedium::Simulated | KvMedium::Opaque => chain.len(),
        };
        // Every block of the chain is referenced while the import runs, so that allocating a
        // block for a later one never evicts an earlier one.
        let mut referenced = Vec::with_capacity(chain.len());
        for (index, hash) in chain.iter().enumerate().take(movable) {
            if self.blocks.acquire_cached(hash.sequence).is_some() {
                referenced.push(hash.sequence);
                result.already_cached += 1;
                continue;
            }
            if index < first {
                // A block that should be here was evicted meanwhile: what follows would hang off
                // nothing a prefix lookup can reach.
                break;
            }
            let Some(block) = self.blocks.allocate_anonymous() else {
                // Every block is referenced by running sequences.
                break;
            };
            if medium == KvMedium::Payloads {
                let payload = payloads
                    .as_ref()
                    .and_then(|payloads| payloads.get(index - first))
                    .map(|payload| &payload[..])
                    .unwrap_or_default();
                if let Err(reason) = executor.import_kv(block, payload) {
                    tracing::warn!(block, %reason, "could not import a KV block; the rest is prefilled");
                    self.blocks.release_anonymous(block);
                    result.refused = true;
                    break;
                }
            }
            let parent = index.checked_sub(1).map(|previous| chain[previous].sequence);
            self.blocks.promote(block, parent, *hash);
            referenced.push(hash.sequence);
            result.imported += 1;
        }
        // The tail goes back first, so it is the least recently used: eviction then eats the
        // chain from its end and what stays cached is still a prefix.
        for hash in referenced.into_iter().rev() {
            self.blocks.release_full(hash);
        }
        self.stats
            .imported_blocks
            .fetch_add(result.imported as u64, Ordering::Relaxed);
        self.update_gauges();
        self.publish();
        result
    }

    /// Plans the next step: forgets cancelled requests, schedules, and publishes the KV events
    /// that caused (evictions).
    pub(crate) fn next_step(&mut self) -> Plan {
        self.drop_cancelled();
        let plan = self.schedule();
        self.publish();
        plan
    }

    /// Forgets requests whose receivers were dropped, freeing their blocks.
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

    /// Ends every request with `reason` (the engine cannot go on).
    fn fail_all(&mut self, reason: &str) {
        for seq in std::mem::take(&mut self.running) {
            let _ = seq.out.send(Output::Failed(reason.to_string()));
            self.release(&seq);
        }
        for seq in std::mem::take(&mut self.waiting) {
            let _ = seq.out.send(Output::Failed(reason.to_string()));
        }
        self.update_gauges();
    }

    fn release(&mut self, seq: &Sequence) {
        for (index, &block) in seq.blocks.iter().enumerate() {
            if index < seq.full_blocks {
                self.blocks.release_full(seq.hashes[index].sequence);
            } else {
                self.blocks.release_anonymous(block);
            }
        }
    }

    fn preempt(&mut self, mut seq: Sequence) {
        self.release(&seq);
        seq.blocks.clear();
        seq.full_blocks = 0;
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

    /// Chooses the next step's work, allocating the blocks it needs.
    fn schedule(&mut self) -> Plan {
        let mut budget = self.config.max_num_batched_tokens;
        let mut work = Vec::new();
        let mut preempted = false;
        let mut index = 0;
        'running: while index < self.running.len() && budget > 0 {
            let seq = &self.running[index];
            let ready = seq.ready_len().saturating_sub(seq.computed);
            if ready == 0 {
                // Gated: its prefix is prefilled and the rest waits for its media.
                index += 1;
                continue;
            }
            let Some(tokens) = self.chunk(ready, budget) else {
                index += 1;
                continue;
            };
            let needed = self.blocks_for(seq.computed + tokens).saturating_sub(seq.blocks.len());
            while self.blocks.available() < needed {
                preempted = true;
                let Some(victim) = self.running.pop() else {
                    break 'running;
                };
                let victim_is_current = self.running.len() == index;
                self.preempt(victim);
                if victim_is_current {
                    break 'running;
                }
            }
            for _ in 0..needed {
                let Some(block) = self.blocks.allocate_anonymous() else {
                    debug_assert!(false, "availability was checked");
                    break 'running;
                };
                self.running[index].blocks.push(block);
            }
            work.push((index, tokens));
            budget -= tokens;
            index += 1;
        }
        // Like vLLM, admit nothing new in a step that had to preempt.
        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            // The first waiting sequence with something to compute: a gated one whose prefix
            // is all cached waits without holding up those behind it.
            let block_size = self.config.block_size;
            let admissible = self.waiting.iter().enumerate().find_map(|(position, seq)| {
                let mut cached = self.blocks.cached_prefix(&seq.hashes).min(seq.ready_len() / block_size);
                if cached * block_size >= seq.tokens.len() {
                    // At least one token must be computed to produce the next one.
                    cached -= 1;
                }
                let computed = cached * block_size;
                let ready = seq.ready_len().saturating_sub(computed);
                (ready > 0).then_some((position, cached, computed, ready))
            });
            let Some((position, cached, computed, ready)) = admissible else {
                break;
            };
            let seq = &self.waiting[position];
            let Some(tokens) = self.chunk(ready, budget) else {
                break;
            };
            let new_blocks = self.blocks_for(computed + tokens) - cached;
            if !self.blocks.can_admit(&seq.hashes[..cached], new_blocks) {
                break;
            }
            let Some(mut seq) = self.waiting.remove(position) else {
                break;
            };
            for hash in &seq.hashes[..cached] {
                let Some(block) = self.blocks.acquire_cached(hash.sequence) else {
                    unreachable!("cached_prefix found block {hash:?}");
                };
                seq.blocks.push(block);
            }
            for _ in 0..new_blocks {
                let Some(block) = self.blocks.allocate_anonymous() else {
                    unreachable!("can_admit checked availability");
                };
                seq.blocks.push(block);
            }
            seq.computed = computed;
            seq.full_blocks = cached;
            if seq.cached_tokens.is_none() {
                let cached_prompt = computed.min(seq.prompt_len);
                seq.cached_tokens = Some(cached_prompt);
                let _ = seq.out.send(Output::Started {
                    cached_tokens: cached_prompt as u32,
                });
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

    /// Computes `plan` with `executor`, then hands out tokens, shares full blocks, retires
    /// finished sequences and publishes the KV events of all that.
    pub(crate) fn execute<E: Executor + ?Sized>(&mut self, plan: Plan, executor: &mut E) {
        let started = Instant::now();
        let mut items = Vec::with_capacity(plan.work.len());
        let mut work = plan.work.iter().peekable();
        for (index, seq) in self.running.iter_mut().enumerate() {
            let Some(&&(wanted, count)) = work.peek() else {
                break;
            };
            if wanted != index {
                continue;
            }
            work.next();
            items.push(StepItem {
                sequence_id: seq.id,
                tokens: &seq.tokens,
                start: seq.computed,
                count,
                blocks: &seq.blocks,
                sampler: &mut seq.sampler,
                next_token: None,
                media: seq.gate.as_ref().and_then(|gate| gate.media()).unwrap_or_default(),
            });
        }
        let result = executor.execute(&mut items);
        let next_tokens: Vec<Option<Result<u32, String>>> = items.into_iter().map(|item| item.next_token).collect();
        self.stats
            .busy_nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let step_tokens: usize = plan.work.iter().map(|&(_, count)| count).sum();
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats
            .computed_tokens
            .fetch_add(step_tokens as u64, Ordering::Relaxed);
        self.stats
            .last_batch_tokens
            .store(step_tokens as u64, Ordering::Relaxed);
        self.stats
            .last_batch_sequences
            .store(plan.work.len() as u64, Ordering::Relaxed);
        self.stats
            .batched_sequences
            .fetch_add(plan.work.len() as u64, Ordering::Relaxed);
        let mut retired = Vec::new();
        for (&(index, count), next) in plan.work.iter().zip(next_tokens) {
            if let Err(reason) = &result {
                let _ = self.running[index]
                    .out
                    .send(Output::Failed(format!("the engine step failed: {reason}")));
                retired.push(index);
                continue;
            }
            if !self.advance(index, count, next) {
                retired.push(index);
            }
        }
        // Remove from the back so earlier indices stay valid.
        retired.sort_unstable();
        for index in retired.into_iter().rev() {
            let seq = self.running.remove(index);
            self.release(&seq);
        }
        self.update_gauges();
        self.publish();
    }

    /// Records that `count` more tokens of running sequence `index` are computed and, if that
    /// was the last of them, appends `next`. Returns false if the sequence is done.
    fn advance(&mut self, index: usize, count: usize, next: Option<Result<u32, String>>) -> bool {
        let block_size = self.config.block_size;
        let seq = &mut self.running[index];
        seq.computed += count;
        // Blocks whose tokens are now all computed become shareable.
        for block in seq.full_blocks..seq.computed / block_size {
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
            seq.blocks[block] = self.blocks.promote(seq.blocks[block], parent, seq.hashes[block]);
        }
        seq.full_blocks = seq.full_blocks.max(seq.computed / block_size);
        if seq.computed < seq.tokens.len() {
            return true;
        }
        let token = match next {
            Some(Ok(token)) => token,
            Some(Err(reason)) => {
                let _ = seq.out.send(Output::Failed(reason));
                return false;
            }
            None => {
                let _ = seq.out.send(Output::Failed("the executor produced no token".into()));
                return false;
            }
        };
        seq.tokens.push(token);
        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let alive = seq.out.send(Output::Token(token)).is_ok();
        if let Some(reason) = seq.sampler.finish(token, seq.generated()) {
            let _ = seq.out.send(Output::Finished {
                reason,
                prompt_tokens: seq.prompt_len as u32,
                completion_tokens: seq.generated() as u32,
                cached_tokens: seq.cached_tokens.unwrap_or(0) as u32,
            });
            return false;
        }
        alive
    }

    fn update_gauges(&self) {
        self.stats.waiting.store(self.waiting.len() as u64, Ordering::Relaxed);
        self.stats.running.store(self.running.len() as u64, Ordering::Relaxed);
        self.stats
            .active_blocks
            .store(self.blocks.active_blocks() as u64, Ordering::Relaxed);
    }

    /// Sends the KV events recorded since the last call to the subscriber, if any.
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
