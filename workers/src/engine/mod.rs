//! The engine core every LLM worker shares: the scheduler, the KV block pool and sampling.
//!
//! An engine takes requests through an [`EngineHandle`], schedules them like vLLM
//! ([`scheduler`]: continuous batching under a token budget, chunked prefill, prefix caching
//! keyed by the gateway's block hashes, preemption when blocks run out) over a pool of numbered
//! KV blocks ([`blocks`]), and streams [`Output`]s back. What a step *does* is an
//! [`Executor`]'s business: the simulated engine ([`crate::mocker`]) waits as long as its perf
//! model says and makes up tokens; the native engine (`switchyard_llm`) runs the model over the
//! blocks the scheduler chose and samples ([`sampling`]). Because both share this core, they
//! schedule, cache, evict and publish KV events identically, and a gateway cannot tell them
//! apart except by speed. [`spawn_native`] runs a blocking executor on its own thread. For
//! prefill/decode disaggregation an engine also exports the blocks it holds and imports blocks
//! another engine computed as cached ones ([`transfer`]).

pub mod blocks;
pub mod sampling;
pub mod scheduler;
pub mod transfer;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::sync::mpsc;

pub use blocks::{BlockId, BlockManager, KvEvent};
pub use sampling::{FinishReason, Sampler, SamplingError, SamplingParams};
pub use scheduler::{Executor, StepItem};
pub use transfer::{KvExport, KvImport, KvImported, KvMedium};

/// Settings of one engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the cache.
    pub num_gpu_blocks: usize,
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Split long prompts across steps instead of waiting for a step with room for all of them.
    pub enable_chunked_prefill: bool,
    /// Reuse cached blocks of equal prefixes.
    pub enable_prefix_caching: bool,
    /// Simulated engines only: time runs this many times faster than the perf model says.
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

/// What the model behind an engine accepts; requests outside it are refused at submission.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelLimits {
    /// Token ids must be below this (`None`: any id).
    pub vocab_size: Option<usize>,
    /// Prompt plus generated tokens must not exceed this (`None`: only the KV cache limits).
    pub max_model_len: Option<usize>,
    /// Width of the media feature rows the model merges at placeholder positions; `None` when
    /// its executor does not take feature rows (the simulated engine ignores their values; a
    /// native backend without a media path refuses media placeholders).
    pub media_dim: Option<usize>,
}

/// One media item's feature rows, placed in a prompt: positions `start..start + rows / dim`.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaSpan {
    /// The first placeholder's position in the prompt.
    pub start: usize,
    /// Width of a row.
    pub dim: usize,
    /// The rows, row-major.
    pub rows: Vec<f32>,
}

impl MediaSpan {
    /// Positions the span covers.
    pub fn len(&self) -> usize {
        self.rows.len() / self.dim.max(1)
    }

    /// Whether it covers nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The rows of the span's positions within `range` (prompt positions) and the first such
    /// position, if any.
    pub fn rows_in(&self, range: std::ops::Range<usize>) -> Option<(usize, &[f32])> {
        let from = self.start.max(range.start);
        let to = (self.start + self.len()).min(range.end);
        (from < to).then(|| {
            (
                from,
                &self.rows[(from - self.start) * self.dim..(to - self.start) * self.dim],
            )
        })
    }
}

/// What an engine sends back for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// The request was admitted for the first time; this many prompt tokens came from the
    /// prefix cache. Sent once, before its first token.
    Started {
        /// Prompt tokens served from the prefix cache.
        cached_tokens: u32,
    },
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
    /// The engine could not go on with this request (a failed step); nothing follows.
    Failed(String),
}

/// Why an engine refused a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
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
    /// Prompt plus generated tokens exceed the model's context.
    #[error("prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceed the model's context of {max} tokens")]
    ContextLength {
        /// Prompt tokens.
        prompt: usize,
        /// Requested generation.
        max_tokens: usize,
        /// The model's context.
        max: usize,
    },
    /// A prompt token id the model does not have.
    #[error("prompt token {position} is id {id}, outside the model's vocabulary of {vocab}")]
    TokenOutOfRange {
        /// Where it is.
        position: usize,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A media placeholder without feature rows to merge: the model takes none, or the request
    /// came without them (ungated).
    #[error("the prompt has a media placeholder at position {position} without feature rows this engine can merge")]
    MediaUnsupported {
        /// Where the first placeholder is.
        position: usize,
    },
    /// Without chunked prefill, the whole sequence must fit one step's token budget.
    #[error(
        "prompt plus max_tokens ({tokens} tokens) exceed the step budget of {budget} tokens and chunked prefill is off"
    )]
    OverBudget {
        /// Prompt plus generated tokens.
        tokens: usize,
        /// `max_num_batched_tokens`.
        budget: usize,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The sampling parameters are invalid.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
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
    /// Tokens computed (prompt and generated, prefill and decode).
    pub computed_tokens: AtomicU64,
    /// Preemptions.
    pub preemptions: AtomicU64,
    /// Steps run.
    pub steps: AtomicU64,
    /// Sequences in the last step.
    pub last_batch_sequences: AtomicU64,
    /// Tokens computed in the last step.
    pub last_batch_tokens: AtomicU64,
    /// Sum of every step's sequences (with `steps`, the mean batch size).
    pub batched_sequences: AtomicU64,
    /// Nanoseconds spent executing steps.
    pub busy_nanos: AtomicU64,
    /// KV blocks named in export answers (prefill/decode disaggregation).
    pub exported_blocks: AtomicU64,
    /// KV blocks taken in from other engines as cached blocks.
    pub imported_blocks: AtomicU64,
}

impl EngineStats {
    /// Fraction of the KV cache referenced by running sequences.
    pub fn kv_usage(&self) -> f64 {
        let total = self.total_blocks.load(Ordering::Relaxed);
        if total == 0 {
            return 0.0;
        }
        self.active_blocks.load(Ordering::Relaxed) as f64 / total as f64
    }

    /// Fraction of admitted prompt tokens served from the prefix cache.
    pub fn prefix_hit_rate(&self) -> f64 {
        let prompt = self.prompt_tokens.load(Ordering::Relaxed);
        if prompt == 0 {
            return 0.0;
        }
        self.cached_prompt_tokens.load(Ordering::Relaxed) as f64 / prompt as f64
    }
}

/// One request on its way to the scheduler.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) prompt: Vec<u32>,
    pub(crate) sampler: Sampler,
    pub(crate) out: mpsc::UnboundedSender<Output>,
    pub(crate) gate: Option<PrefillGate>,
}

/// What a handle sends the scheduler.
#[derive(Debug)]
pub(crate) enum Submission {
    /// A generation request.
    Request(Request),
    /// Drop the prefix cache's unreferenced blocks; the reply says how many.
    ClearCache(tokio::sync::oneshot::Sender<usize>),
    /// Nothing to do but plan again (a [`PrefillGate`] opened).
    Wake,
    /// Hold the device for this long (before speed-up) for other work, such as encoding media
    /// on the LLM's own device: no step runs meanwhile. Answered when done.
    Occupy(std::time::Duration, tokio::sync::oneshot::Sender<()>),
    /// How many leading blocks of these sequence hashes the pool holds.
    Held(Vec<u64>, tokio::sync::oneshot::Sender<usize>),
    /// Export the leading run of these blocks the pool holds.
    Export(Vec<u64>, tokio::sync::oneshot::Sender<KvExport>),
    /// Take these blocks in as cached blocks.
    Import(KvImport, tokio::sync::oneshot::Sender<KvImported>),
}

/// How far into its prompt a request may be prefilled, raised as its inputs arrive.
///
/// A request with media is submitted before its features exist, gated at its first media span,
/// so the text before it is prefilled while the encoder works (encode/prefill overlap). When
/// the features are merged, [`PrefillGate::open`] lets the rest through. Cheap to clone; every
/// clone is the same gate.
#[derive(Debug, Clone)]
pub struct PrefillGate {
    limit: Arc<AtomicUsize>,
    media: Arc<std::sync::OnceLock<Arc<Vec<MediaSpan>>>>,
}

impl PrefillGate {
    /// A gate letting the first `tokens` prompt tokens through.
    pub fn new(tokens: usize) -> PrefillGate {
        PrefillGate {
            limit: Arc::new(AtomicUsize::new(tokens)),
            media: Arc::new(std::sync::OnceLock::new()),
        }
    }

    /// Prompt tokens that may be computed now.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    /// Lets the whole prompt through.
    pub fn open(&self) {
        self.limit.store(usize::MAX, Ordering::Release);
    }

    /// Hands the engine the request's feature rows, then lets the whole prompt through (a
    /// gate's media are set once; a second call keeps the first).
    pub fn open_with_media(&self, media: Vec<MediaSpan>) {
        let _ = self.media.set(Arc::new(media));
        self.open();
    }

    /// The feature rows the gate was opened with.
    pub fn media(&self) -> Option<&[MediaSpan]> {
        self.media.get().map(|media| media.as_slice())
    }
}

/// Whether a prompt id is a media placeholder (`switchyard_tokenize::media_token`'s range).
pub fn is_media_placeholder(id: u32) -> bool {
    id & 0x8000_0000 != 0
}

type EventSink = Arc<std::sync::Mutex<Option<mpsc::UnboundedSender<KvEvent>>>>;

/// A handle to a running engine; cheap to clone.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    submissions: mpsc::UnboundedSender<Submission>,
    config: Arc<EngineConfig>,
    limits: ModelLimits,
    medium: KvMedium,
    stats: Arc<EngineStats>,
    events: EventSink,
}

impl EngineHandle {
    /// Creates a handle and the scheduler it feeds; the caller drives the scheduler.
    pub(crate) fn new(
        config: EngineConfig,
        limits: ModelLimits,
        medium: KvMedium,
    ) -> (EngineHandle, scheduler::Scheduler, mpsc::UnboundedReceiver<Submission>) {
        let (submissions, receiver) = mpsc::unbounded_channel();
        let stats = Arc::new(EngineStats::default());
        stats
            .total_blocks
            .store(config.num_gpu_blocks as u64, Ordering::Relaxed);
        let events: EventSink = Arc::new(std::sync::Mutex::new(None));
        let handle = EngineHandle {
            submissions,
            config: Arc::new(config.clone()),
            limits,
            medium,
            stats: stats.clone(),
            events: events.clone(),
        };
        (handle, scheduler::Scheduler::new(config, stats, events), receiver)
    }

    /// Queues a generation after `prompt`, its tokens chosen and its end decided by `params`,
    /// and returns the stream of its outputs. Dropping the receiver cancels the request and
    /// frees its blocks.
    ///
    /// # Errors
    ///
    /// Returns [`SubmitError`] if the prompt is empty or holds an id outside the vocabulary, if
    /// prompt plus output exceed the model's context or could never fit in the KV cache, if the
    /// sampling parameters are invalid, or if the engine has stopped.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<mpsc::UnboundedReceiver<Output>, SubmitError> {
        self.submit_gated(prompt, params, None)
    }

    /// As [`submit`](Self::submit), prefilling no further than `gate` allows until it opens
    /// (call [`wake`](Self::wake) after opening it).
    ///
    /// # Errors
    ///
    /// As for [`submit`](Self::submit).
    pub fn submit_gated(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        gate: Option<PrefillGate>,
    ) -> Result<mpsc::UnboundedReceiver<Output>, SubmitError> {
        if prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(vocab) = self.limits.vocab_size {
            // Media placeholders (ids with the top bit set) are not vocabulary: a backend that
            // merges feature rows replaces them; one that does not cannot take them.
            let media_rows = self.limits.media_dim.is_some() && gate.is_some();
            if let Some((position, &id)) = prompt
                .iter()
                .enumerate()
                .find(|(_, id)| **id as usize >= vocab && !(media_rows && is_media_placeholder(**id)))
            {
                if is_media_placeholder(id) {
                    return Err(SubmitError::MediaUnsupported { position });
                }
                return Err(SubmitError::TokenOutOfRange { position, id, vocab });
            }
        }
        let max_tokens = params.max_tokens.max(1);
        let tokens = prompt.len() + max_tokens;
        if let Some(max) = self.limits.max_model_len
            && tokens > max
        {
            return Err(SubmitError::ContextLength {
                prompt: prompt.len(),
                max_tokens,
                max,
            });
        }
        if !self.config.enable_chunked_prefill && tokens > self.config.max_num_batched_tokens {
            // A preempted sequence is recomputed whole; it must fit one step.
            return Err(SubmitError::OverBudget {
                tokens,
                budget: self.config.max_num_batched_tokens,
            });
        }
        let needed = tokens.div_ceil(self.config.block_size);
        if needed > self.config.num_gpu_blocks {
            return Err(SubmitError::TooLong {
                tokens,
                needed,
                capacity: self.config.num_gpu_blocks,
            });
        }
        let sampler = Sampler::new(SamplingParams { max_tokens, ..params })?;
        let (out, receiver) = mpsc::unbounded_channel();
        self.submissions
            .send(Submission::Request(Request {
                prompt,
                sampler,
                out,
                gate,
            }))
            .map_err(|_| SubmitError::Stopped)?;
        Ok(receiver)
    }

    /// Drops every cached block no running request holds (vLLM's prefix-cache reset) and
    /// returns how many, announcing it as KV events (`cleared`, or `removed` for exactly those
    /// blocks while requests run).
    ///
    /// # Errors
    ///
    /// [`SubmitError::Stopped`] if the engine has stopped.
    pub async fn clear_prefix_cache(&self) -> Result<usize, SubmitError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.submissions
            .send(Submission::ClearCache(reply))
            .map_err(|_| SubmitError::Stopped)?;
        answer.await.map_err(|_| SubmitError::Stopped)
    }

    /// Whether the engine still takes requests: `false` once its scheduler has ended (every
    /// handle dropped, or its thread died, e.g. a panic in a forward pass).
    pub fn is_running(&self) -> bool {
        !self.submissions.is_closed()
    }

    /// Makes an idle engine plan again; call it after opening a [`PrefillGate`].
    pub fn wake(&self) {
        let _ = self.submissions.send(Submission::Wake);
    }

    /// Holds the engine's device for `work` (simulated time, divided by the speed-up) between
    /// steps, as local media encoding does; returns when it is done (at once if the engine
    /// has stopped).
    pub async fn occupy(&self, work: std::time::Duration) {
        let (done, finished) = tokio::sync::oneshot::channel();
        if self.submissions.send(Submission::Occupy(work, done)).is_ok() {
            let _ = finished.await;
        }
    }

    /// How many leading blocks of `hashes` (sequence hashes, prefix order) the engine holds,
    /// referenced or cached.
    ///
    /// # Errors
    ///
    /// [`SubmitError::Stopped`] if the engine has stopped.
    pub async fn held_blocks(&self, hashes: Vec<u64>) -> Result<usize, SubmitError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.submissions
            .send(Submission::Held(hashes, reply))
            .map_err(|_| SubmitError::Stopped)?;
        answer.await.map_err(|_| SubmitError::Stopped)
    }

    /// The leading run of `hashes` (sequence hashes, prefix order) the engine holds, with their
    /// keys and values when its executor can copy them ([`KvMedium::Payloads`]).
    ///
    /// # Errors
    ///
    /// [`SubmitError::Stopped`] if the engine has stopped.
    pub async fn export_kv(&self, hashes: Vec<u64>) -> Result<KvExport, SubmitError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.submissions
            .send(Submission::Export(hashes, reply))
            .map_err(|_| SubmitError::Stopped)?;
        answer.await.map_err(|_| SubmitError::Stopped)
    }

    /// Takes blocks computed elsewhere in as cached blocks, as if this engine had prefilled
    /// them: later requests with their prefix reuse them, they are evictable once free, and
    /// they are announced as `stored` KV events. Imports as many as fit without evicting a
    /// block a running request holds; nothing when the prefix cache is off or the executor's
    /// medium is [`KvMedium::Opaque`].
    ///
    /// # Errors
    ///
    /// [`SubmitError::Stopped`] if the engine has stopped.
    pub async fn import_kv(&self, import: KvImport) -> Result<KvImported, SubmitError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.submissions
            .send(Submission::Import(import, reply))
            .map_err(|_| SubmitError::Stopped)?;
        answer.await.map_err(|_| SubmitError::Stopped)
    }

    /// What the engine's KV blocks are made of: whether it can import blocks, and whether its
    /// exports carry keys and values.
    pub fn kv_medium(&self) -> KvMedium {
        self.medium
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// What the model behind the engine accepts.
    pub fn limits(&self) -> ModelLimits {
        self.limits
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

/// Starts an engine whose steps run `executor` on a thread of its own (forward passes block).
/// The thread ends once every handle is dropped and the requests it holds have finished.
///
/// # Errors
///
/// The I/O error if the thread cannot be spawned.
pub fn spawn_native<E: Executor + Send + 'static>(
    config: EngineConfig,
    limits: ModelLimits,
    executor: E,
    thread_name: &str,
) -> std::io::Result<EngineHandle> {
    let (handle, scheduler, receiver) = EngineHandle::new(config, limits, executor.kv_medium());
    std::thread::Builder::new()
        .name(thread_name.to_string())
        .spawn(move || scheduler.run_blocking(receiver, executor))?;
    Ok(handle)
}
