//! The worker table a router policy sees for one request, built from the pool and the KV state.
//!
//! The policy module owns the table's shape (the contract's columns, [`TableWriter`]); this
//! module owns what goes into it: one row per healthy LLM worker of the model (its cached
//! prefix of the prompt, its live load, its capacity, node and cost), then one row per encoder
//! the request's media may go to ([`EncoderRow`]), then, for routers that disaggregate, one row
//! per prefill worker (its cached prefix and load, as an LLM worker's). A worker's live load is the gateway's own
//! tracking of what it sent, raised to what the engine reports where its metrics are read
//! (`crate::workers::engine`).

use std::sync::Arc;

use crate::config::Role;
use crate::kv::{Load, Overlaps};
use crate::policy::table::{Columns, ROLE_AUDIO, ROLE_LLM, ROLE_PREFILL, ROLE_VISION, Row, TableWriter, WorkerTable};
use crate::workers::Worker;

/// An encoder as a row of the router's table: what its media-only columns hold for the request
/// being routed.
#[derive(Debug, Clone)]
pub struct EncoderRow {
    /// The encoder.
    pub worker: Arc<Worker>,
    /// Work this gateway has queued at it, estimated in microseconds.
    pub queued_us: u32,
    /// Estimated time to encode the request's items of its role it does not hold, in µs.
    pub encode_us: u32,
    /// Tokens of the request's items of its role whose features it announced cached.
    pub cached_tokens: u32,
}

/// The LLM workers of a table: those that answer (`candidates`, which the caller has already
/// filtered to healthy workers of the requested model) and the prefill workers after the
/// encoders (empty for a router that does not disaggregate), with their live loads, aligned.
#[derive(Debug, Clone, Copy)]
pub struct LlmRows<'a> {
    /// The workers that answer, first in the table.
    pub candidates: &'a [Arc<Worker>],
    /// Their loads.
    pub loads: &'a [Load],
    /// The prefill workers, last in the table.
    pub prefill: &'a [Arc<Worker>],
    /// Their loads.
    pub prefill_loads: &'a [Load],
}

/// Builds the table with `columns` and the fallback's: the answering workers, one row per
/// encoder in `encoders`, then the prefill workers, from each LLM worker's prefix `overlaps`
/// (as the index returns them) and live load.
pub fn build(rows: LlmRows<'_>, overlaps: &Overlaps, encoders: &[EncoderRow], columns: Columns) -> WorkerTable {
    let LlmRows {
        candidates,
        loads,
        prefill,
        prefill_loads,
    } = rows;
    let mut table = TableWriter::new(candidates.len() + encoders.len() + prefill.len(), columns);
    for (index, worker) in candidates.iter().enumerate() {
        table.write(index, &llm_row(worker, overlaps, loads.get(index)));
    }
    for (offset, encoder) in encoders.iter().enumerate() {
        let worker = &encoder.worker;
        let in_flight = u64::try_from(worker.in_flight().max(0)).unwrap_or(0);
        let row = Row {
            active_requests: saturate(in_flight),
            queued_us: encoder.queued_us,
            encode_us: encoder.encode_us,
            media_cached_tokens: encoder.cached_tokens,
            ..worker_row(worker)
        };
        table.write(candidates.len() + offset, &row);
    }
    let first_prefill = candidates.len() + encoders.len();
    for (offset, worker) in prefill.iter().enumerate() {
        table.write(
            first_prefill + offset,
            &llm_row(worker, overlaps, prefill_loads.get(offset)),
        );
    }
    table.finish()
}

/// An LLM worker's row: its cached prefix of the prompt, its live load, its capacity.
fn llm_row(worker: &Worker, overlaps: &Overlaps, load: Option<&Load>) -> Row {
    let overlap = overlaps.get(worker.kv_id);
    let load = load.copied().unwrap_or_default();
    // An engine that reports its own load (see `workers::engine`) counts what other
    // gateways and clients sent it too: the larger figure stands.
    let engine = worker.engine_load();
    let capacity = engine
        .and_then(|engine| engine.capacity_blocks)
        .filter(|blocks| *blocks > 0)
        .unwrap_or(worker.capacity_blocks);
    let engine_blocks = engine.and_then(|engine| engine.used_blocks(capacity)).unwrap_or(0);
    Row {
        overlap_device_blocks: overlap.map_or(0, |o| o.device),
        overlap_host_blocks: overlap.map_or(0, |o| o.host),
        active_blocks: load.active_blocks.max(saturate(engine_blocks)),
        prefill_tokens: saturate(load.prefill_tokens),
        active_requests: saturate(worker.requests(load.requests)),
        capacity_blocks: saturate(capacity),
        block_size: saturate(worker.block_size as u64),
        ..worker_row(worker)
    }
}

/// The columns every row of `worker` holds whatever its role: id, role, capabilities, node
/// and cost; the rest zero.
fn worker_row(worker: &Worker) -> Row {
    Row {
        id: worker.kv_id,
        role: role_value(worker.role),
        capabilities: capability_mask(&worker.capabilities),
        node: node_number(&worker.node),
        cost: worker.cost as f32,
        ..Row::default()
    }
}

fn saturate(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

/// The `roles` column's value for a worker role.
fn role_value(role: Role) -> u32 {
    match role {
        Role::Llm | Role::Decode => ROLE_LLM,
        Role::Prefill => ROLE_PREFILL,
        Role::Vision => ROLE_VISION,
        Role::Audio => ROLE_AUDIO,
    }
}

/// The `node` column's value for a node name: 0 for none, else a nonzero hash of it.
fn node_number(node: &str) -> u32 {
    if node.is_empty() {
        0
    } else {
        (xxhash_rust::xxh3::xxh3_64(node.as_bytes()) as u32).max(1)
    }
}

/// Capability names as the table's bitmask: bit 0 text, 1 image, 2 audio, 3 video.
fn capability_mask(capabilities: &[String]) -> u32 {
    capabilities.iter().fold(0, |mask, name| {
        mask | match name.as_str() {
            "text" => 1,
            "image" => 2,
            "audio" => 4,
            "video" => 8,
            _ => 0,
        }
    })
}
