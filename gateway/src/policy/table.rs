//! The flat worker table handed to router policies, and the native fallback over it.

pub use crate::policy::bindings::switchyard::policy::types::{RequestInfo, WorkerTable};

use crate::config::Role;
use crate::kv::{Load, Overlap};
use crate::workers::Worker;

/// Builds the table for `candidates` (which the caller has already filtered to healthy workers
/// of the requested model), with each one's prefix `overlaps` (sorted by worker id, as the
/// index returns them) and live `loads` (aligned with `candidates`).
pub fn build(candidates: &[std::sync::Arc<Worker>], overlaps: &[Overlap], loads: &[Load]) -> WorkerTable {
    let n = candidates.len();
    let mut table = WorkerTable {
        ids: Vec::with_capacity(n),
        roles: Vec::with_capacity(n),
        capabilities: Vec::with_capacity(n),
        overlap_device_blocks: Vec::with_capacity(n),
        overlap_host_blocks: Vec::with_capacity(n),
        active_blocks: Vec::with_capacity(n),
        prefill_tokens: Vec::with_capacity(n),
        active_requests: Vec::with_capacity(n),
        capacity_blocks: Vec::with_capacity(n),
        block_size: Vec::with_capacity(n),
        cost: Vec::with_capacity(n),
    };
    let saturate = |value: u64| u32::try_from(value).unwrap_or(u32::MAX);
    for (index, worker) in candidates.iter().enumerate() {
        table.ids.push(worker.kv_id);
        table.roles.push(match worker.role {
            Role::Llm => 0,
            Role::Vision => 1,
            Role::Audio => 2,
        });
        table.capabilities.push(capability_mask(&worker.capabilities));
        let overlap = overlaps
            .binary_search_by_key(&worker.kv_id, |o| o.worker)
            .ok()
            .map(|i| overlaps[i]);
        table.overlap_device_blocks.push(overlap.map_or(0, |o| o.device));
        table.overlap_host_blocks.push(overlap.map_or(0, |o| o.host));
        let load = loads.get(index).copied().unwrap_or_default();
        table.active_blocks.push(load.active_blocks);
        table.prefill_tokens.push(saturate(load.prefill_tokens));
        // This gateway's in-flight count covers requests the tracker does not (e.g. retries).
        let local = u64::try_from(worker.in_flight().max(0)).unwrap_or(0);
        table
            .active_requests
            .push(saturate(u64::from(load.requests).max(local)));
        table.capacity_blocks.push(saturate(worker.capacity_blocks));
        table.block_size.push(saturate(worker.block_size as u64));
        table.cost.push(worker.cost as f32);
    }
    table
}

/// Capability names as the table's bitmask: bit 0 text, 1 image, 2 audio, 3 video.
pub fn capability_mask(capabilities: &[String]) -> u32 {
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

/// The native fallback: the LLM worker with the fewest active requests, then the least
/// prefill work, then the lowest index.
pub fn least_load(table: &WorkerTable) -> Option<u32> {
    (0..table.ids.len())
        .filter(|&i| table.roles[i] == 0)
        .min_by_key(|&i| (table.active_requests[i], table.prefill_tokens[i]))
        .map(|i| i as u32)
}

/// A plausible table of `n` idle LLM workers, for self-tests and benchmarks.
pub fn synthetic(n: usize) -> WorkerTable {
    WorkerTable {
        ids: (0..n as u32).collect(),
        roles: vec![0; n],
        capabilities: vec![1; n],
        overlap_device_blocks: (0..n as u32).map(|i| i % 7).collect(),
        overlap_host_blocks: vec![0; n],
        active_blocks: (0..n as u32).map(|i| (i * 37) % 500).collect(),
        prefill_tokens: (0..n as u32).map(|i| (i * 101) % 4096).collect(),
        active_requests: (0..n as u32).map(|i| (i * 13) % 17).collect(),
        capacity_blocks: vec![16_384; n],
        block_size: vec![64; n],
        cost: vec![1.0; n],
    }
}

/// A plausible request, for self-tests and benchmarks.
pub fn synthetic_request() -> RequestInfo {
    RequestInfo {
        request_id: 1,
        prompt_tokens: 1024,
        max_tokens: 128,
        prompt_blocks: 16,
        media_tokens: 0,
        affinity: 0,
        ttft_target_ms: 0.0,
    }
}
