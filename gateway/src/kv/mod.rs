//! KV-aware routing state: the prefix index, the active-sequence tracker, and how prompts
//! become block hashes.
//!
//! [`KvState`] is shared by every request and by the event applier (`crate::events`).
//! Concurrency: the index locks itself, one node table per block (see [`index`]), so a lookup
//! (microseconds, measured by the `kv_index` bench and the `switchyard_kv_lookup_seconds`
//! histogram) waits at most for one block's write, never for a batch of events. The
//! active-sequence tracker is sharded by worker, each shard under its own mutex, touched at
//! route, first token and end.
//!
//! Workers are named here by their [`WorkerId`] alone: this module knows nothing of the worker
//! registry, and the event applier (`crate::events`) that keeps the index in step with workers'
//! event streams sits above both.

pub mod active;
pub mod index;
mod table;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::RwLock;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use serde::{Deserialize, Serialize};
use switchyard_protocol::api::GenerateRequest;
use switchyard_protocol::block_hash::block_hashes_for;
use switchyard_tokenize::{
    ChatTemplate, JinjaTemplate, MediaPrompt, MediaSlot, PromptEncoder, TokenizeError, Tokenizer,
};
use tokio::sync::mpsc;

use crate::config::{ChatTemplateConfig, Config, ModelConfig};
use crate::metrics::Labels;

pub use active::{Load, ShardedActive};

/// Shards of the active-sequence tracker (requests on workers of different shards never
/// share a lock for their per-block work).
const ACTIVE_SHARDS: usize = 16;
pub use index::{IndexSize, KvIndex, Overlaps, WorkerId};

/// How one model's prompts become block hashes.
#[derive(Debug)]
pub struct ModelKv {
    /// Tokenizer and chat template.
    pub encoder: PromptEncoder,
    /// Tokens per block.
    pub block_size: usize,
    /// LoRA adapter salting the hashes.
    pub lora: Option<String>,
}

impl ModelKv {
    /// Hashes prompt tokens into the sequence hashes of their full blocks.
    pub fn blocks(&self, tokens: &[u32]) -> PromptBlocks {
        let block_size = self.block_size.max(1);
        let hashes = block_hashes_for(tokens, block_size, self.lora.as_deref())
            .into_iter()
            .map(|h| h.sequence)
            .collect();
        PromptBlocks {
            tokens: tokens.len(),
            hashes,
            block_size,
        }
    }
}

/// A prompt, tokenized and hashed.
#[derive(Debug, Clone)]
pub struct PromptBlocks {
    /// Prompt tokens.
    pub tokens: usize,
    /// Sequence hashes of its full blocks.
    pub hashes: Vec<u64>,
    /// The block size they were cut at.
    pub block_size: usize,
}

/// An active-sequence update shared between gateway replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveUpdate {
    /// The gateway that routed the request.
    pub origin: u64,
    /// Its request id there.
    pub request: u64,
    /// The worker's name.
    pub worker: String,
    /// What happened.
    pub op: ActiveOp,
}

/// What happened to an active request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ActiveOp {
    /// Routed, with its prompt's block hashes and the tokens it has to prefill.
    Add {
        /// Sequence hashes of its prompt blocks.
        hashes: Vec<u64>,
        /// Prompt tokens not cached on the worker.
        prefill_tokens: u64,
    },
    /// Its first token came back.
    PrefillDone,
    /// It ended.
    Free,
}

/// The KV metrics.
#[derive(Debug, Clone)]
pub struct KvMetrics {
    /// Events applied, by worker.
    pub events_applied: Family<Labels, Counter>,
    /// Events not applied, by reason.
    pub events_ignored: Family<Labels, Counter>,
    /// Gaps in a worker's event ids.
    pub gaps: Family<Labels, Counter>,
    /// Resyncs by worker and outcome.
    pub resyncs: Family<Labels, Counter>,
    /// Stored blocks whose hashes do not chain, by worker.
    pub hash_mismatches: Family<Labels, Counter>,
    /// 1 for a worker whose block size differs from its model's.
    pub block_size_mismatch: Family<Labels, Gauge>,
    /// Registered workers dropped for missing heartbeats.
    pub workers_expired: Counter,
    /// Index nodes.
    pub index_nodes: Gauge,
    /// Index (worker, block) holdings.
    pub index_blocks: Gauge,
    /// Lookup latency.
    pub lookup_seconds: Histogram,
    /// Per request: the chosen worker's device overlap over the prompt's blocks.
    pub overlap_ratio: Histogram,
}

impl KvMetrics {
    fn new() -> KvMetrics {
        KvMetrics {
            events_applied: Family::default(),
            events_ignored: Family::default(),
            gaps: Family::default(),
            resyncs: Family::default(),
            hash_mismatches: Family::default(),
            block_size_mismatch: Family::default(),
            workers_expired: Counter::default(),
            index_nodes: Gauge::default(),
            index_blocks: Gauge::default(),
            // 250 ns .. ~4 ms.
            lookup_seconds: Histogram::new(exponential_buckets(250e-9, 2.0, 15)),
            overlap_ratio: Histogram::new([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]),
        }
    }

    /// Registers every family in `registry`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        let r = registry;
        r.register(
            "kv_events_applied",
            "KV events applied to the index, by worker",
            self.events_applied.clone(),
        );
        r.register(
            "kv_events_ignored",
            "KV events not applied, by reason",
            self.events_ignored.clone(),
        );
        r.register("kv_event_gaps", "Gaps in a worker's event ids", self.gaps.clone());
        r.register(
            "kv_resyncs",
            "Index resyncs from a worker's dump, by worker and outcome",
            self.resyncs.clone(),
        );
        r.register(
            "kv_hash_mismatches",
            "Stored blocks whose sequence hash does not chain from parent and tokens (the worker hashes differently)",
            self.hash_mismatches.clone(),
        );
        r.register(
            "kv_block_size_mismatch",
            "1 when a worker's block size differs from its model's (its events are not indexed)",
            self.block_size_mismatch.clone(),
        );
        r.register(
            "kv_workers_expired",
            "Registered workers dropped after missing heartbeats",
            self.workers_expired.clone(),
        );
        r.register(
            "kv_index_nodes",
            "Distinct blocks in the KV index",
            self.index_nodes.clone(),
        );
        r.register(
            "kv_index_blocks",
            "(worker, block) holdings in the KV index",
            self.index_blocks.clone(),
        );
        r.register(
            "kv_lookup_seconds",
            "KV index lookup latency",
            self.lookup_seconds.clone(),
        );
        r.register(
            "kv_overlap_ratio",
            "Per request: cached leading blocks on the chosen worker over the prompt's blocks",
            self.overlap_ratio.clone(),
        );
    }
}

/// What `GET /admin/kv` answers.
#[derive(Debug, Clone, Serialize)]
pub struct KvSummary {
    /// Index size.
    pub index: IndexSize,
    /// Estimated index heap in bytes.
    pub index_heap_bytes: usize,
    /// Active requests tracked (all gateways).
    pub active_requests: usize,
    /// Per worker.
    pub workers: Vec<WorkerKvSummary>,
}

/// One worker in [`KvSummary`].
#[derive(Debug, Clone, Serialize)]
pub struct WorkerKvSummary {
    /// Name.
    pub name: String,
    /// Index id.
    pub kv_id: u32,
    /// Model.
    pub model: String,
    /// In rotation.
    pub healthy: bool,
    /// Blocks it holds in the index.
    pub cached_blocks: usize,
    /// Its block size agrees with its model's.
    pub block_size_ok: bool,
    /// Its live load.
    pub load: Load,
}

/// What [`KvState::summary`] reports of one worker besides its cache and load.
#[derive(Debug, Clone, Copy)]
pub struct SummaryWorker<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its id in the index.
    pub kv_id: WorkerId,
    /// Its model.
    pub model: &'a str,
    /// Its tokens per block.
    pub block_size: usize,
    /// Whether it is in rotation.
    pub healthy: bool,
}

/// Shared KV routing state.
#[derive(Debug)]
pub struct KvState {
    index: KvIndex,
    active: ShardedActive,
    models: RwLock<HashMap<String, Arc<ModelKv>>>,
    origin: u64,
    replica_out: OnceLock<mpsc::UnboundedSender<ActiveUpdate>>,
    /// The metrics.
    pub metrics: KvMetrics,
}

/// Why the KV state could not be built.
#[derive(Debug, thiserror::Error)]
#[error("model `{model}`: {source}")]
pub struct KvSetupError {
    model: String,
    source: TokenizeError,
}

impl KvState {
    /// Builds the state for `config`: one entry per `[[models]]` table, and defaults for the
    /// models of the configured workers (block size of the first worker of each).
    ///
    /// # Errors
    ///
    /// Returns [`KvSetupError`] if a model's tokenizer cannot be loaded.
    pub fn new(config: &Config) -> Result<KvState, KvSetupError> {
        let mut models = HashMap::new();
        for model in &config.models {
            models.insert(model.name.clone(), Arc::new(model_kv(model)?));
        }
        if let Some(embedded) = &config.embedded_mockers {
            models
                .entry(embedded.model.clone())
                .or_insert_with(|| Arc::new(default_model(embedded.block_size)));
        }
        for worker in config.workers.iter().filter(|w| w.role.is_llm()) {
            models
                .entry(worker.model.clone())
                .or_insert_with(|| Arc::new(default_model(worker.block_size)));
        }
        let origin = origin_id();
        Ok(KvState {
            index: KvIndex::new(),
            active: ShardedActive::new(origin, std::time::Duration::from_secs(600), ACTIVE_SHARDS),
            models: RwLock::new(models),
            origin,
            replica_out: OnceLock::new(),
            metrics: KvMetrics::new(),
        })
    }

    /// This gateway's id among replicas.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// The settings of `model`; a model first seen from a registration takes that worker's
    /// block size.
    pub fn model(&self, model: &str, block_size: usize) -> Arc<ModelKv> {
        self.model_or(model, || block_size)
    }

    /// [`KvState::model`], asking for the block size only for a model not seen yet.
    fn model_or(&self, model: &str, block_size: impl FnOnce() -> usize) -> Arc<ModelKv> {
        if let Some(found) = self.models.read().get(model) {
            return found.clone();
        }
        self.models
            .write()
            .entry(model.to_string())
            .or_insert_with(|| Arc::new(default_model(block_size())))
            .clone()
    }

    /// Whether `worker`'s block size agrees with its model's; a mismatch is logged and
    /// exported (once per worker), and the worker's events must not be indexed.
    pub fn check_block_size(&self, worker: &str, worker_model: &str, worker_block_size: usize) -> bool {
        let model = self.model(worker_model, worker_block_size);
        let ok = model.block_size == worker_block_size;
        let gauge = self
            .metrics
            .block_size_mismatch
            .get_or_create(&vec![("worker", worker.to_string())]);
        if !ok && gauge.set(1) == 0 {
            tracing::error!(
                worker = %worker,
                worker_block_size,
                model = %worker_model,
                model_block_size = model.block_size,
                "worker block size differs from its model's: its KV events are not indexed and it gets no cache affinity"
            );
        } else if ok {
            gauge.set(0);
        }
        ok
    }

    /// Tokenizes and hashes a request's prompt for `model`; `fallback_block_size` is asked
    /// only for a model with no settings yet.
    ///
    /// # Errors
    ///
    /// Returns [`TokenizeError`] if the model tokenizer fails.
    pub fn prompt_blocks(
        &self,
        model: &str,
        fallback_block_size: impl FnOnce() -> usize,
        request: &GenerateRequest,
    ) -> Result<PromptBlocks, TokenizeError> {
        let settings = self.model_or(model, fallback_block_size);
        let tokens = settings.encoder.prompt_tokens(request)?;
        Ok(settings.blocks(&tokens))
    }

    /// Hashes `tokens` (a prompt already tokenized, such as a broken stream's prompt and
    /// generated tokens) for `model`; `fallback_block_size` is used only for a model with no
    /// settings yet.
    pub fn token_blocks(&self, model: &str, fallback_block_size: usize, tokens: &[u32]) -> PromptBlocks {
        self.model_or(model, || fallback_block_size).blocks(tokens)
    }

    /// Tokenizes a chat request's prompt for `model` with its media items in place (see
    /// [`PromptEncoder::prompt_with_media`]), and the model's settings to hash it with
    /// ([`ModelKv::blocks`]).
    ///
    /// # Errors
    ///
    /// Returns [`TokenizeError`] if the model tokenizer fails or its template drops media.
    pub fn prompt_with_media(
        &self,
        model: &str,
        fallback_block_size: impl FnOnce() -> usize,
        request: &GenerateRequest,
        slots: &[MediaSlot],
    ) -> Result<(MediaPrompt, Arc<ModelKv>), TokenizeError> {
        let settings = self.model_or(model, fallback_block_size);
        Ok((settings.encoder.prompt_with_media(request, slots)?, settings))
    }

    /// The overlap of every worker with `hashes`.
    pub fn lookup(&self, hashes: &[u64]) -> Overlaps {
        let started = Instant::now();
        let mut out = Overlaps::default();
        self.index.overlaps(hashes, &mut out);
        self.metrics.lookup_seconds.observe(started.elapsed().as_secs_f64());
        out
    }

    /// The live load of each worker in `workers`.
    pub fn loads(&self, workers: impl IntoIterator<Item = WorkerId>) -> Vec<Load> {
        let workers: Vec<WorkerId> = workers.into_iter().collect();
        self.active.loads(&workers)
    }

    /// Starts tracking request `request` on `worker` (named `worker_name` to other replicas).
    pub fn begin(
        self: &Arc<KvState>,
        request: u64,
        worker: WorkerId,
        worker_name: &str,
        hashes: Vec<u64>,
        prefill_tokens: u64,
    ) -> ActiveGuard {
        let key = (self.origin, request);
        if let Some(out) = self.replica_out.get() {
            let _ = out.send(ActiveUpdate {
                origin: self.origin,
                request,
                worker: worker_name.to_string(),
                op: ActiveOp::Add {
                    hashes: hashes.clone(),
                    prefill_tokens,
                },
            });
        }
        let ahead = self.active.add(key, worker, hashes, prefill_tokens);
        ActiveGuard {
            state: self.clone(),
            request,
            worker: worker_name.to_string(),
            prefill_pending: true,
            prefill_work: ahead.saturating_add(prefill_tokens),
        }
    }

    /// Applies another gateway's active-sequence update (`worker` resolved by the caller).
    pub fn apply_remote_active(&self, update: &ActiveUpdate, worker: Option<WorkerId>) {
        if update.origin == self.origin {
            return;
        }
        let key = (update.origin, update.request);
        let active = &self.active;
        match (&update.op, worker) {
            (ActiveOp::Add { hashes, prefill_tokens }, Some(worker)) => {
                active.add(key, worker, hashes.clone(), *prefill_tokens);
            }
            (ActiveOp::PrefillDone, _) => active.prefill_done(key),
            (ActiveOp::Free, _) => active.free(key),
            (ActiveOp::Add { .. }, None) => {}
        }
    }

    /// Sends this gateway's active-sequence updates to `out` (replica sync).
    pub fn share_active(&self, out: mpsc::UnboundedSender<ActiveUpdate>) {
        let _ = self.replica_out.set(out);
    }

    /// Drops everything known about a worker.
    pub fn forget(&self, worker: WorkerId) {
        self.index.remove_worker(worker);
        self.active.remove_worker(worker);
        self.refresh_size();
    }

    /// The index, for the applier (which writes it) and tests.
    pub(crate) fn index(&self) -> &KvIndex {
        &self.index
    }

    /// Updates the index size gauges.
    pub fn refresh_size(&self) {
        let size = self.index.size();
        self.metrics.index_nodes.set(size.nodes as i64);
        self.metrics.index_blocks.set(size.blocks as i64);
    }

    /// A summary for `GET /admin/kv`.
    pub fn summary<'w>(&self, workers: impl IntoIterator<Item = SummaryWorker<'w>>) -> KvSummary {
        let index = &self.index;
        let active = &self.active;
        KvSummary {
            index: index.size(),
            index_heap_bytes: index.heap_bytes(),
            active_requests: active.requests(),
            workers: workers
                .into_iter()
                .map(|w| WorkerKvSummary {
                    name: w.name.to_string(),
                    kv_id: w.kv_id,
                    model: w.model.to_string(),
                    healthy: w.healthy,
                    cached_blocks: index.worker_blocks(w.kv_id),
                    block_size_ok: self
                        .models
                        .read()
                        .get(w.model)
                        .is_none_or(|m| m.block_size == w.block_size),
                    load: active.load(w.kv_id),
                })
                .collect(),
        }
    }
}

/// Tracks one routed request until dropped.
#[derive(Debug)]
pub struct ActiveGuard {
    state: Arc<KvState>,
    request: u64,
    worker: String,
    prefill_pending: bool,
    /// Prefill tokens pending on the worker when the request was routed, its own included.
    prefill_work: u64,
}

impl ActiveGuard {
    /// The prefill work the request found on its worker: the uncached prompt tokens of the
    /// requests there before their first token, its own included, as this gateway (and the
    /// replicas it hears from) counted them when it routed the request.
    pub fn prefill_work(&self) -> u64 {
        self.prefill_work
    }

    /// The first token came back.
    pub fn first_token(&mut self) {
        if !std::mem::take(&mut self.prefill_pending) {
            return;
        }
        self.state.active.prefill_done((self.state.origin, self.request));
        self.share(ActiveOp::PrefillDone);
    }

    fn share(&self, op: ActiveOp) {
        if let Some(out) = self.state.replica_out.get() {
            let _ = out.send(ActiveUpdate {
                origin: self.state.origin,
                request: self.request,
                worker: self.worker.clone(),
                op,
            });
        }
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.state.active.free((self.state.origin, self.request));
        self.share(ActiveOp::Free);
    }
}

fn default_model(block_size: usize) -> ModelKv {
    ModelKv {
        encoder: PromptEncoder::default(),
        block_size: block_size.max(1),
        lora: None,
    }
}

fn model_kv(model: &ModelConfig) -> Result<ModelKv, KvSetupError> {
    let tokenizer = match &model.tokenizer {
        Some(path) => Tokenizer::from_file(path).map_err(|source| KvSetupError {
            model: model.name.clone(),
            source,
        })?,
        None => Tokenizer::Bytes,
    };
    let template = match &model.chat_template {
        None => ChatTemplate::default(),
        Some(ChatTemplateConfig { file: Some(path), .. }) => {
            ChatTemplate::Jinja(JinjaTemplate::from_file(path).map_err(|source| KvSetupError {
                model: model.name.clone(),
                source,
            })?)
        }
        Some(t) => ChatTemplate::Simple {
            message: t.message.clone().unwrap_or_default(),
            generation_prompt: t.generation_prompt.clone(),
        },
    };
    Ok(ModelKv {
        encoder: PromptEncoder { tokenizer, template },
        block_size: model.block_size,
        lora: model.lora.clone(),
    })
}

/// A random id for this gateway among replicas (distinct per state, even in one process).
fn origin_id() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let count = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    xxhash_rust::xxh3::xxh3_64(
        &[
            nanos.to_le_bytes(),
            u64::from(std::process::id()).to_le_bytes(),
            count.to_le_bytes(),
        ]
        .concat(),
    )
}
