//! The packed worker table handed to router policies, and the native fallback over it.
//!
//! A [`WorkerTable`] holds the columns some policy reads (`present`): the u32 ones packed one
//! after another in `data` in the contract's column order (`flags columns` in
//! `wit/policy.wit`: the k-th column has bit k), the f32 `cost` column in a list of its own,
//! each one value per worker. The gateway builds one per request with the columns the policies
//! in charge declared at `init` plus the ones its own fallback reads, so a call copies only
//! what is read.

pub use crate::policy::bindings::switchyard::policy::types::{Columns, RequestInfo, WorkerTable};

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

/// Number of the contract's u32 columns (every column but `cost`).
const U32_COLUMNS: usize = ORDER.len();

/// The `roles` column's value for an LLM worker.
pub const ROLE_LLM: u32 = 0;
/// The `roles` column's value for a vision encoder.
pub const ROLE_VISION: u32 = 1;
/// The `roles` column's value for an audio encoder.
pub const ROLE_AUDIO: u32 = 2;
/// The `roles` column's value for a prefill worker (rows only disaggregating routers see,
/// after every other row).
pub const ROLE_PREFILL: u32 = 3;

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

/// Checks a decision's worker, fallbacks and prefill index against the roles in `table`: the
/// worker and fallbacks must not be prefill rows, the prefill index must be one. Answers the
/// prefill index, or what is wrong. (Ranges are checked by the caller.)
pub fn check_roles(
    table: &WorkerTable,
    worker: u32,
    fallbacks: &[u32],
    prefill: Option<u32>,
) -> Result<Option<u32>, String> {
    let roles = table.column(Columns::ROLES).unwrap_or(&[]);
    let role_of = |index: u32| roles.get(index as usize).copied();
    if let Some(index) = std::iter::once(worker)
        .chain(fallbacks.iter().copied())
        .find(|&i| role_of(i) == Some(ROLE_PREFILL))
    {
        return Err(format!(
            "worker {index} is a prefill worker; it cannot answer a request"
        ));
    }
    match prefill {
        None => Ok(None),
        Some(index) if role_of(index) == Some(ROLE_PREFILL) => Ok(Some(index)),
        Some(index) if (index as usize) < table.len() => Err(format!("prefill {index} is not a prefill worker")),
        Some(index) => Err(format!("prefill {index} of a {}-worker table", table.len())),
    }
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

    /// Number of prefill rows, which always come last.
    pub fn prefill_rows(&self) -> usize {
        self.column(Columns::ROLES).map_or(0, |roles| {
            roles.iter().rev().take_while(|&&role| role == ROLE_PREFILL).count()
        })
    }

    /// The table without its prefill rows, for a router that does not disaggregate; `None`
    /// when it has none (the common case: such tables are built without them).
    pub fn without_prefill_rows(&self) -> Option<WorkerTable> {
        let prefill = self.prefill_rows();
        if prefill == 0 {
            return None;
        }
        let (n, kept) = (self.len(), self.len() - prefill);
        let data = self
            .data
            .chunks(n.max(1))
            .flat_map(|column| &column[..kept])
            .copied()
            .collect();
        let cost = self.cost.get(..kept).map_or_else(Vec::new, <[f32]>::to_vec);
        Some(WorkerTable {
            count: kept as u32,
            present: self.present,
            data,
            cost,
        })
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

/// One worker's values in every column of the contract. The routing core fills one per
/// worker (and per encoder); [`TableWriter`] keeps only the columns a table holds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Row {
    /// The worker's id (its KV id).
    pub id: u32,
    /// [`ROLE_LLM`], [`ROLE_VISION`] or [`ROLE_AUDIO`].
    pub role: u32,
    /// Capabilities as a bitmask: bit 0 text, 1 image, 2 audio, 3 video.
    pub capabilities: u32,
    /// The prompt's leading blocks cached on the worker's device.
    pub overlap_device_blocks: u32,
    /// The prompt's leading blocks cached in the worker's host memory.
    pub overlap_host_blocks: u32,
    /// KV blocks in use by the worker's active sequences.
    pub active_blocks: u32,
    /// Prompt tokens still to prefill on the worker.
    pub prefill_tokens: u32,
    /// Requests active on the worker.
    pub active_requests: u32,
    /// The worker's KV capacity in blocks.
    pub capacity_blocks: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The worker's node as a nonzero hash, 0 for none.
    pub node: u32,
    /// Encoders: work queued at it, estimated in microseconds.
    pub queued_us: u32,
    /// Encoders: estimated time to encode the request's items it does not hold, in µs.
    pub encode_us: u32,
    /// Encoders: tokens of the request's items whose features it holds.
    pub media_cached_tokens: u32,
    /// Relative cost of the worker.
    pub cost: f32,
}

impl Row {
    /// The u32 values in the contract's column order ([`ORDER`]).
    fn values(&self) -> [u32; U32_COLUMNS] {
        [
            self.id,
            self.role,
            self.capabilities,
            self.overlap_device_blocks,
            self.overlap_host_blocks,
            self.active_blocks,
            self.prefill_tokens,
            self.active_requests,
            self.capacity_blocks,
            self.block_size,
            self.node,
            self.queued_us,
            self.encode_us,
            self.media_cached_tokens,
        ]
    }
}

/// Fills a [`WorkerTable`] row by row, storing each row's values of the present columns only.
#[derive(Debug)]
pub struct TableWriter {
    table: WorkerTable,
    /// For each present u32 column: its place in [`ORDER`] and where it starts in `data`.
    slots: Vec<(usize, usize)>,
}

impl TableWriter {
    /// A table of `count` rows holding `present` and the [`fallback_columns`], all zero until
    /// written.
    pub fn new(count: usize, present: Columns) -> TableWriter {
        let table = WorkerTable::zeroed(count, present | fallback_columns());
        let slots = ORDER
            .iter()
            .enumerate()
            .filter_map(|(k, &column)| table.offset(column).map(|start| (k, start)))
            .collect();
        TableWriter { table, slots }
    }

    /// Writes `row` as row `index` (ignored past the table's end).
    pub fn write(&mut self, index: usize, row: &Row) {
        if index >= self.table.len() {
            return;
        }
        let values = row.values();
        for &(k, start) in &self.slots {
            self.table.data[start + index] = values[k];
        }
        if let Some(cost) = self.table.cost.get_mut(index) {
            *cost = row.cost;
        }
    }

    /// The table written.
    pub fn finish(self) -> WorkerTable {
        self.table
    }
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
