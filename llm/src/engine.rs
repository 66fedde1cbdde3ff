//! The native LLM engine: the shared scheduler driving the model on the CPU.
//!
//! [`CpuExecutor`] is the CPU backend behind the engine's [`Executor`] trait: it owns the
//! model and its paged KV cache (one block of the cache per block number the scheduler hands
//! out), runs each step as one [`Model::forward_batch_with_media`] over every scheduled chunk
//! (a chunk's share of its sequence's media feature rows replacing the placeholders'
//! embeddings), and samples the sequences that reached their end. [`spawn_cpu_engine`] starts it on its own thread.
//! Its blocks hold keys and values that move between workers ([`KvMedium::Payloads`]): a
//! finished prefill's blocks are copied out as payloads of the cache's own dtype and written
//! into another engine's cache ([`crate::kv::transfer`]).

use crate::kv::KvPrecision;
use crate::model::{Chunk, Logits, MediaRows, Model, PagedKv, SequenceKv};
use switchyard_workers::engine::{
    BlockId, EngineConfig, EngineHandle, Executor, KvMedium, ModelLimits, StepItem, spawn_native,
};

/// The CPU backend: the model and its KV cache.
#[derive(Debug)]
pub struct CpuExecutor {
    model: Model,
    kv: PagedKv,
}

impl CpuExecutor {
    /// A backend for `model` with a cache of `num_blocks` blocks of `block_size` positions, in
    /// f32.
    pub fn new(model: Model, block_size: usize, num_blocks: usize) -> CpuExecutor {
        CpuExecutor::with_precision(model, block_size, num_blocks, KvPrecision::F32)
    }

    /// [`CpuExecutor::new`] with the cache at the given precision.
    pub fn with_precision(model: Model, block_size: usize, num_blocks: usize, precision: KvPrecision) -> CpuExecutor {
        let kv = PagedKv::with_precision(model.config(), block_size, num_blocks, precision);
        CpuExecutor { model, kv }
    }

    /// What the model accepts.
    pub fn limits(&self) -> ModelLimits {
        ModelLimits {
            vocab_size: Some(self.model.config().vocab_size),
            max_model_len: Some(self.model.config().max_position_embeddings),
            media_dim: Some(self.model.config().hidden_size),
        }
    }
}

/// A step item's share of its sequence's media rows, at offsets within the chunk it computes
/// (a span split over two prefill chunks gives each its own rows).
pub(crate) fn chunk_media<'a>(item: &'a StepItem<'_>) -> Vec<MediaRows<'a>> {
    let range = item.start..item.start + item.count;
    item.media
        .iter()
        .filter_map(|span| span.rows_in(range.clone()))
        .map(|(from, rows)| MediaRows {
            offset: from - item.start,
            rows,
        })
        .collect()
}

impl Executor for CpuExecutor {
    fn execute(&mut self, items: &mut [StepItem<'_>]) -> Result<(), String> {
        let mut sequences: Vec<SequenceKv> = items
            .iter()
            .map(|item| SequenceKv {
                blocks: item.blocks.to_vec(),
                computed: item.start,
            })
            .collect();
        let mut chunks: Vec<Chunk<'_>> = sequences
            .iter_mut()
            .zip(items.iter())
            .map(|(sequence, item)| Chunk {
                sequence,
                tokens: item.new_tokens(),
            })
            .collect();
        let media: Vec<Vec<MediaRows<'_>>> = items.iter().map(chunk_media).collect();
        let media: Vec<&[MediaRows<'_>]> = media.iter().map(Vec::as_slice).collect();
        let logits = self
            .model
            .forward_batch_with_media(&mut self.kv, &mut chunks, &media, Logits::Last)
            .map_err(|err| err.to_string())?;
        drop(chunks);
        for (item, logits) in items.iter_mut().zip(logits) {
            if item.samples() {
                item.next_token = Some(item.sampler.sample(&logits).map_err(|err| err.to_string()));
            }
        }
        Ok(())
    }

    fn kv_medium(&self) -> KvMedium {
        KvMedium::Payloads
    }

    fn export_kv(&mut self, blocks: &[BlockId]) -> Option<Vec<Vec<u8>>> {
        blocks
            .iter()
            .map(|block| self.kv.export_block(*block))
            .collect::<Result<Vec<_>, _>>()
            .inspect_err(|err| tracing::warn!(error = %err, "could not export KV blocks"))
            .ok()
    }

    fn import_kv(&mut self, block: BlockId, payload: &[u8]) -> Result<(), String> {
        self.kv.import_block(block, payload).map_err(|err| err.to_string())
    }
}

/// Bytes of KV cache one block takes for `model` (keys and values of every layer) at
/// `precision`.
pub fn kv_block_bytes(model: &Model, block_size: usize, precision: KvPrecision) -> usize {
    let c = model.config();
    2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * precision.bytes()
}

/// Starts a native engine for `model` on the CPU, on a thread of its own; `config` sets the
/// cache (`block_size`, `num_gpu_blocks`) and the scheduler.
///
/// # Errors
///
/// The I/O error if the engine thread cannot be spawned.
pub fn spawn_cpu_engine(model: Model, config: EngineConfig) -> std::io::Result<EngineHandle> {
    spawn_cpu_engine_with(model, config, KvPrecision::F32)
}

/// [`spawn_cpu_engine`] with the KV cache at the given precision.
///
/// # Errors
///
/// As [`spawn_cpu_engine`].
pub fn spawn_cpu_engine_with(
    model: Model,
    config: EngineConfig,
    precision: KvPrecision,
) -> std::io::Result<EngineHandle> {
    let executor = CpuExecutor::with_precision(model, config.block_size, config.num_gpu_blocks, precision);
    let limits = executor.limits();
    spawn_native(config, limits, executor, "switchyard-llm")
}
