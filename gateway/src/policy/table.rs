//! The packed worker table handed to router policies, and the native fallback over it.
//!
//! A [`WorkerTable`] holds the columns some policy reads (`present`): the u32 ones packed one
//! after another in `data` in the contract's column order (`flags columns` in
//! `wit/policy.wit`: the k-th column has bit k), the f32 `cost` column in a list of its own,
//! each one value per worker. The gateway builds one per request with the columns the policies
//! in charge declared at `init` plus the ones its own fallback reads, so a call copies only
//! what is read.

pub use crate::policy::bindings::switchyard::policy::types::{Columns, RequestInfo, WorkerTable};

use crate::config::Role;
use crate::kv::{Load, Overlaps};
use crate::workers::Worker;

/// The contract's u32 columns in order (`cost`, bit 10, is apart; 0.2.0's four follow it).
const ORDER: [Columns; 14] = [
    Columns::IDS,
    Columns::ROLES,
    Columns::CAPABILITIES,
    Columns::OVERLAP_DEVICE_BLOCKS,
    Columns::OVERLAP_HOST_BLOCKS,
    Columns::ACTIVE_BLOCKS,
    Columns::PREFILL_TOKENS,
    Columns::ACTIVE_REQUESTS,
    Columns::CAPACITY_BLOCKS,
    Columns::BLOCK_SIZE,
    Columns::NODE,
    Columns::QUEUED_US,
    Columns::ENCODE_US,
    Columns::MEDIA_CACHED_TOKENS,
];

/// Number of the 0.1.0 contract's u32 columns: the first of [`ORDER`].
const V0_1_U32_COLUMNS: usize = 10;

/// Role values of the `roles` column.
const ROLE_LLM: u32 = 0;

/// The columns the native fallback ([`least_load`]) reads; every table the gateway builds
/// holds them.
pub fn fallback_columns() -> Columns {
    Columns::ROLES | Columns::ACTIVE_REQUESTS | Columns::PREFILL_TOKENS
}

/// Every column of the contract. (`Columns::all()` sets bits beyond the contract's columns.)
pub fn all_columns() -> Columns {
    ORDER.iter().fold(Columns::COST, |all, &column| all | column)
}

/// The columns of the 0.1.0 contract (the first eleven, bit for bit).
pub fn v0_1_columns() -> Columns {
    ORDER[..V0_1_U32_COLUMNS]
        .iter()
        .fold(Columns::COST, |all, &column| all | column)
}

/// Role values of the `roles` column for a worker role.
fn role_value(role: Role) -> u32 {
    match role {
        Role::Llm => ROLE_LLM,
        Role::Vision => 1,
        Role::Audio => 2,
    }
}

/// The `node` column's value for a node name: 0 for none, else a nonzero hash of it.
pub fn node_number(node: &str) -> u32 {
    if node.is_empty() {
        0
    } else {
        (xxhash_rust::xxh3::xxh3_64(node.as_bytes()) as u32).max(1)
    }
}

/// Checks a decision's encoder indices against `table`: each in range, an encoder (not an LLM
/// worker), at most one per role; answers them, or what is wrong.
pub fn check_encoders(table: &WorkerTable, encoders: Vec<u32>) -> Result<Vec<u32>, String> {
    if encoders.is_empty() {
        return Ok(encoders);
    }
    let roles = table
        .column(Columns::ROLES)
        .ok_or_else(|| "encoders named, but the table has no roles column".to_string())?;
    let mut seen = Vec::with_capacity(encoders.len());
    for &index in &encoders {
        match roles.get(index as usize) {
            None => return Err(format!("encoder {index} of a {}-worker table", table.len())),
            Some(&ROLE_LLM) => return Err(format!("encoder {index} is an LLM worker")),
            Some(role) if seen.contains(role) => return Err(format!("two encoders of role {role}")),
            Some(&role) => seen.push(role),
        }
    }
    Ok(encoders)
}

fn bits(columns: Columns) -> u32 {
    columns.as_array()[0]
}

impl WorkerTable {
    /// A table of `count` workers whose `present` columns are all zero.
    pub fn zeroed(count: usize, present: Columns) -> WorkerTable {
        let u32_columns = bits(present & !Columns::COST & all_columns()).count_ones() as usize;
        let cost = if present.contains(Columns::COST) { count } else { 0 };
        WorkerTable {
            count: u32::try_from(count).unwrap_or(u32::MAX),
            present,
            data: vec![0; u32_columns * count],
            cost: vec![0.0; cost],
        }
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.count as usize
    }

    /// Whether the table has no workers.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Where `column` (one u32 column) starts in `data`, if present.
    fn offset(&self, column: Columns) -> Option<usize> {
        let bit = bits(column);
        if bit.count_ones() != 1 || column == Columns::COST || !self.present.contains(column) {
            return None;
        }
        // The u32 columns below this one; `cost` (bit 10) travels in a list of its own.
        let below = bits(self.present & !Columns::COST) & (bit - 1);
        Some(below.count_ones() as usize * self.len())
    }

    /// The values of `column` (one u32 column), if present.
    pub fn column(&self, column: Columns) -> Option<&[u32]> {
        let start = self.offset(column)?;
        self.data.get(start..start + self.len())
    }

    /// The values of `column` (one u32 column) to change, if present.
    pub fn column_mut(&mut self, column: Columns) -> Option<&mut [u32]> {
        let start = self.offset(column)?;
        let end = start + self.len();
        self.data.get_mut(start..end)
    }

    /// A copy holding only `columns` (those of them present).
    pub fn select(&self, columns: Columns) -> WorkerTable {
        let present = self.present & columns;
        let data = ORDER
            .iter()
            .filter(|&&column| present.contains(column))
            .filter_map(|&column| self.column(column))
            .flatten()
            .copied()
            .collect();
        let cost = if present.contains(Columns::COST) {
            self.cost.clone()
        } else {
            Vec::new()
        };
        WorkerTable {
            count: self.count,
            present,
            data,
            cost,
        }
    }
}

/// An encoder as a row of the router's table: what its media-only columns hold for the request
/// being routed.
#[derive(Debug, Clone)]
pub struct EncoderRow {
    /// The encoder.
    pub worker: std::sync::Arc<Worker>,
    /// Work this gateway has queued at it, estimated in microseconds.
    pub queued_us: u32,
    /// Estimated time to encode the request's items of its role it does not hold, in µs.
    pub encode_us: u32,
    /// Tokens of the request's items of its role whose features it announced cached.
    pub cached_tokens: u32,
}

/// Builds the table for `candidates` (which the caller has already filtered to healthy workers
/// of the requested model) with `columns` and the fallback's, from each one's prefix
/// `overlaps` (as the index returns them) and live `loads` (aligned with
/// `candidates`), followed by one row per encoder in `encoders`.
pub fn build(
    candidates: &[std::sync::Arc<Worker>],
    overlaps: &Overlaps,
    loads: &[Load],
    encoders: &[EncoderRow],
    columns: Columns,
) -> WorkerTable {
    let n = candidates.len() + encoders.len();
    let present = columns | fallback_columns();
    let mut table = WorkerTable::zeroed(n, present);
    let saturate = |value: u64| u32::try_from(value).unwrap_or(u32::MAX);
    let slots: Vec<(usize, usize)> = ORDER
        .iter()
        .enumerate()
        .filter_map(|(k, &column)| table.offset(column).map(|start| (k, start)))
        .collect();
    for (index, worker) in candidates.iter().enumerate() {
        let overlap = overlaps.get(worker.kv_id);
        let load = loads.get(index).copied().unwrap_or_default();
        // This gateway's in-flight count covers requests the tracker does not (e.g. retries).
        let local = u64::try_from(worker.in_flight().max(0)).unwrap_or(0);
        let row: [u32; 14] = [
            worker.kv_id,
            role_value(worker.role),
            capability_mask(&worker.capabilities),
            overlap.map_or(0, |o| o.device),
            overlap.map_or(0, |o| o.host),
            load.active_blocks,
            saturate(load.prefill_tokens),
            saturate(u64::from(load.requests).max(local)),
            saturate(worker.capacity_blocks),
            saturate(worker.block_size as u64),
            node_number(&worker.node),
            0,
            0,
            0,
        ];
        for &(k, start) in &slots {
            table.data[start + index] = row[k];
        }
        if let Some(cost) = table.cost.get_mut(index) {
            *cost = worker.cost as f32;
        }
    }
    for (offset, encoder) in encoders.iter().enumerate() {
        let index = candidates.len() + offset;
        let worker = &encoder.worker;
        let in_flight = u64::try_from(worker.in_flight().max(0)).unwrap_or(0);
        let row: [u32; 14] = [
            worker.kv_id,
            role_value(worker.role),
            capability_mask(&worker.capabilities),
            0,
            0,
            0,
            0,
            saturate(in_flight),
            0,
            0,
            node_number(&worker.node),
            encoder.queued_us,
            encoder.encode_us,
            encoder.cached_tokens,
        ];
        for &(k, start) in &slots {
            table.data[start + index] = row[k];
        }
        if let Some(cost) = table.cost.get_mut(index) {
            *cost = worker.cost as f32;
        }
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
/// prefill work, then the lowest index. `None` when the table holds no LLM worker (or lacks
/// the [`fallback_columns`]).
///
/// The same three passes as the `least-load` plugin, so the benchmark compares like with like:
/// two branch-free minimum reductions the compiler vectorizes, then a search for the first
/// worker holding both minima.
pub fn least_load(table: &WorkerTable) -> Option<u32> {
    let roles = table.column(Columns::ROLES)?;
    let active = table.column(Columns::ACTIVE_REQUESTS)?;
    let prefill = table.column(Columns::PREFILL_TOKENS)?;
    let fewest = roles
        .iter()
        .zip(active)
        .map(|(&role, &active)| if role == ROLE_LLM { active } else { u32::MAX })
        .min()?;
    let least_prefill = roles
        .iter()
        .zip(active)
        .zip(prefill)
        .map(|((&role, &active), &prefill)| {
            if role == ROLE_LLM && active == fewest {
                prefill
            } else {
                u32::MAX
            }
        })
        .min()?;
    roles
        .iter()
        .zip(active)
        .zip(prefill)
        .position(|((&role, &active), &prefill)| role == ROLE_LLM && active == fewest && prefill == least_prefill)
        .and_then(|index| u32::try_from(index).ok())
}

/// A plausible table of `n` idle LLM workers with every column, for self-tests and benchmarks.
pub fn synthetic(n: usize) -> WorkerTable {
    let mut table = WorkerTable::zeroed(n, all_columns());
    let n32 = u32::try_from(n).unwrap_or(u32::MAX);
    let mut fill = |column: Columns, value: &dyn Fn(u32) -> u32| {
        if let Some(values) = table.column_mut(column) {
            for (i, slot) in (0..n32).zip(values.iter_mut()) {
                *slot = value(i);
            }
        }
    };
    fill(Columns::IDS, &|i| i);
    fill(Columns::ROLES, &|_| ROLE_LLM);
    fill(Columns::CAPABILITIES, &|_| 1);
    fill(Columns::OVERLAP_DEVICE_BLOCKS, &|i| i % 7);
    fill(Columns::ACTIVE_BLOCKS, &|i| (i * 37) % 500);
    fill(Columns::PREFILL_TOKENS, &|i| (i * 101) % 4096);
    fill(Columns::ACTIVE_REQUESTS, &|i| (i * 13) % 17);
    fill(Columns::CAPACITY_BLOCKS, &|_| 16_384);
    fill(Columns::BLOCK_SIZE, &|_| 64);
    table.cost.fill(1.0);
    table
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_sit_in_contract_order_and_select_keeps_them() {
        let table = synthetic(5);
        assert_eq!((table.data.len(), table.cost.len()), (70, 5));
        assert_eq!(table.column(Columns::IDS), Some(&[0, 1, 2, 3, 4][..]));
        assert_eq!(&table.data[..5], &[0, 1, 2, 3, 4]);
        assert_eq!(&table.data[45..50], &[64; 5], "block sizes last of 0.1.0's columns");
        assert_eq!(table.column(Columns::MEDIA_CACHED_TOKENS), Some(&table.data[65..]));
        assert_eq!(table.column(Columns::COST), None, "cost is not a u32 column");
        assert_eq!(table.cost, [1.0; 5]);
        let picked = table.select(Columns::PREFILL_TOKENS | Columns::IDS | Columns::BLOCK_SIZE);
        assert_eq!((picked.data.len(), picked.cost.len()), (15, 0));
        assert_eq!(&picked.data[..5], &[0, 1, 2, 3, 4]);
        assert_eq!(&picked.data[5..10], &[0, 101, 202, 303, 404]);
        assert_eq!(&picked.data[10..], &[64; 5]);
        assert_eq!(picked.column(Columns::ACTIVE_REQUESTS), None);
        assert_eq!(
            picked.column(Columns::IDS | Columns::BLOCK_SIZE),
            None,
            "one column at a time"
        );
    }

    #[test]
    fn fallback_prefers_fewest_requests_then_least_prefill_then_lowest_index() {
        let mut table = synthetic(5);
        table
            .column_mut(Columns::ROLES)
            .expect("roles")
            .copy_from_slice(&[0, 1, 0, 0, 0]);
        table
            .column_mut(Columns::ACTIVE_REQUESTS)
            .expect("requests")
            .copy_from_slice(&[3, 0, 2, 2, 2]);
        table
            .column_mut(Columns::PREFILL_TOKENS)
            .expect("prefill")
            .copy_from_slice(&[0, 0, 500, 100, 100]);
        assert_eq!(least_load(&table), Some(3));
        table
            .column_mut(Columns::ROLES)
            .expect("roles")
            .copy_from_slice(&[1, 1, 2, 1, 1]);
        assert_eq!(least_load(&table), None);
        assert_eq!(least_load(&table.select(Columns::ROLES)), None, "no load columns");
    }
}
