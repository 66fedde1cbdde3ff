//! The worker table as a policy reads it: typed slices over the packed columns the host sent.
//!
//! The host sends the columns a policy named in [`crate::Router::COLUMNS`] (and possibly more):
//! the u32 ones packed one after another in a single list, in the order `wit/policy.wit`
//! declares them, and the f32 `cost` column in a list of its own.
//! [`WorkerTable::from_packed`] splits them into one slice per column without copying;
//! columns the policy did not name are empty, so reading one fails the same way every time
//! instead of working only when another policy happened to ask for it. [`Table`] is the owned
//! form tests build and pack.

use alloc::string::String;
#[cfg(not(target_arch = "wasm32"))]
use alloc::vec::Vec;

use crate::{Columns, PolicyError, role};

/// Number of u32 columns in the contract (`flags columns` in `wit/policy.wit`, all but the
/// last, `cost`).
const U32_COLUMNS: usize = 10;

/// Every candidate worker: element `i` of each column describes worker `i`. Decisions name
/// workers by that index. Columns the policy did not declare are empty slices.
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkerTable<'a> {
    count: usize,
    /// Stable worker ids (for logging; decisions use indices).
    pub ids: &'a [u32],
    /// Worker roles (see [`crate::role`]).
    pub roles: &'a [u32],
    /// Capability bitmask: bit 0 text, bit 1 image, bit 2 audio, bit 3 video.
    pub capabilities: &'a [u32],
    /// Leading prompt blocks cached on the worker's GPU.
    pub overlap_device_blocks: &'a [u32],
    /// Leading prompt blocks cached in the worker's host memory (beyond the device ones).
    pub overlap_host_blocks: &'a [u32],
    /// KV blocks held by requests active on the worker.
    pub active_blocks: &'a [u32],
    /// Prompt tokens routed to the worker whose first token has not come back yet.
    pub prefill_tokens: &'a [u32],
    /// Requests in flight on the worker.
    pub active_requests: &'a [u32],
    /// Total KV blocks of the worker.
    pub capacity_blocks: &'a [u32],
    /// Tokens per KV block on the worker.
    pub block_size: &'a [u32],
    /// Relative cost of a token on the worker (spot < reserved).
    pub cost: &'a [f32],
}

impl<'a> WorkerTable<'a> {
    /// The view of `count` workers whose `present` u32 columns are packed in `data` (and whose
    /// cost column, if present, is `cost`), exposing the `wanted` ones.
    ///
    /// # Errors
    ///
    /// A [`PolicyError`] if a wanted column is not present or a list is not `count` values per
    /// present column (the host broke the contract; the request goes to its fallback).
    pub fn from_packed(
        count: u32,
        present: Columns,
        data: &'a [u32],
        cost: &'a [f32],
        wanted: Columns,
    ) -> Result<WorkerTable<'a>, PolicyError> {
        let count = count as usize;
        // Bits beyond the contract's columns mean nothing (and hold no data).
        let present = present & Columns::all();
        let missing = wanted.difference(present);
        if !missing.is_empty() {
            // Built without `core::fmt`, which would double the size of a small policy.
            let mut message = String::from("the host sent no");
            for (name, _) in missing.iter_names() {
                message.push(' ');
                message.push_str(name);
            }
            return Err(PolicyError { message });
        }
        let u32_columns = present.difference(Columns::COST).bits().count_ones() as usize;
        let cost_len = if present.contains(Columns::COST) { count } else { 0 };
        if data.len() != u32_columns * count || cost.len() != cost_len {
            return Err(PolicyError::new(
                "the worker table's lists are not its worker count times its column count",
            ));
        }
        let mut columns: [&[u32]; U32_COLUMNS] = [&[]; U32_COLUMNS];
        let mut rest = data;
        for (bit, column) in columns.iter_mut().enumerate() {
            let flag = Columns::from_bits_retain(1 << bit);
            if present.contains(flag) {
                let (values, after) = rest.split_at(count);
                rest = after;
                if wanted.contains(flag) {
                    *column = values;
                }
            }
        }
        let [
            ids,
            roles,
            capabilities,
            overlap_device_blocks,
            overlap_host_blocks,
            active_blocks,
            prefill_tokens,
            active_requests,
            capacity_blocks,
            block_size,
        ] = columns;
        Ok(WorkerTable {
            count,
            ids,
            roles,
            capabilities,
            overlap_device_blocks,
            overlap_host_blocks,
            active_blocks,
            prefill_tokens,
            active_requests,
            capacity_blocks,
            block_size,
            cost: if wanted.contains(Columns::COST) { cost } else { &[] },
        })
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Indices of LLM workers (empty unless the policy declared [`Columns::ROLES`]).
    pub fn llm_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.roles
            .iter()
            .enumerate()
            .filter(|(_, role)| **role == role::LLM)
            .map(|(i, _)| i)
    }
}

/// A worker table owned column by column, as tests build it (see [`crate::testing::table`]).
#[cfg(not(target_arch = "wasm32"))]
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Table {
    /// See [`WorkerTable::ids`].
    pub ids: Vec<u32>,
    /// See [`WorkerTable::roles`].
    pub roles: Vec<u32>,
    /// See [`WorkerTable::capabilities`].
    pub capabilities: Vec<u32>,
    /// See [`WorkerTable::overlap_device_blocks`].
    pub overlap_device_blocks: Vec<u32>,
    /// See [`WorkerTable::overlap_host_blocks`].
    pub overlap_host_blocks: Vec<u32>,
    /// See [`WorkerTable::active_blocks`].
    pub active_blocks: Vec<u32>,
    /// See [`WorkerTable::prefill_tokens`].
    pub prefill_tokens: Vec<u32>,
    /// See [`WorkerTable::active_requests`].
    pub active_requests: Vec<u32>,
    /// See [`WorkerTable::capacity_blocks`].
    pub capacity_blocks: Vec<u32>,
    /// See [`WorkerTable::block_size`].
    pub block_size: Vec<u32>,
    /// See [`WorkerTable::cost`].
    pub cost: Vec<f32>,
}

#[cfg(not(target_arch = "wasm32"))]
impl Table {
    /// Every column, borrowed as a policy reads them.
    pub fn view(&self) -> WorkerTable<'_> {
        WorkerTable {
            count: self.ids.len(),
            ids: &self.ids,
            roles: &self.roles,
            capabilities: &self.capabilities,
            overlap_device_blocks: &self.overlap_device_blocks,
            overlap_host_blocks: &self.overlap_host_blocks,
            active_blocks: &self.active_blocks,
            prefill_tokens: &self.prefill_tokens,
            active_requests: &self.active_requests,
            capacity_blocks: &self.capacity_blocks,
            block_size: &self.block_size,
            cost: &self.cost,
        }
    }

    /// The worker count, the u32 `columns` packed and the cost column (if among `columns`), as
    /// the host sends them.
    ///
    /// # Panics
    ///
    /// If the columns are not all as long as `ids`.
    pub fn pack(&self, columns: Columns) -> (u32, Vec<u32>, Vec<f32>) {
        let count = self.ids.len();
        let all: [&[u32]; U32_COLUMNS] = [
            &self.ids,
            &self.roles,
            &self.capabilities,
            &self.overlap_device_blocks,
            &self.overlap_host_blocks,
            &self.active_blocks,
            &self.prefill_tokens,
            &self.active_requests,
            &self.capacity_blocks,
            &self.block_size,
        ];
        let mut data = Vec::with_capacity(count * U32_COLUMNS);
        for (bit, column) in all.iter().enumerate() {
            assert_eq!(
                column.len(),
                count,
                "column {bit} of the test table has the wrong length"
            );
            if columns.contains(Columns::from_bits_retain(1 << bit)) {
                data.extend_from_slice(column);
            }
        }
        assert_eq!(
            self.cost.len(),
            count,
            "the test table's cost column has the wrong length"
        );
        let cost = if columns.contains(Columns::COST) {
            self.cost.clone()
        } else {
            Vec::new()
        };
        (count as u32, data, cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Table {
        Table {
            ids: alloc::vec![10, 11, 12],
            roles: alloc::vec![0, 1, 0],
            capabilities: alloc::vec![1, 2, 1],
            overlap_device_blocks: alloc::vec![3, 4, 5],
            overlap_host_blocks: alloc::vec![6, 7, 8],
            active_blocks: alloc::vec![9, 10, 11],
            prefill_tokens: alloc::vec![12, 13, 14],
            active_requests: alloc::vec![15, 16, 17],
            capacity_blocks: alloc::vec![18, 19, 20],
            block_size: alloc::vec![21, 22, 23],
            cost: alloc::vec![0.5, 1.5, 2.5],
        }
    }

    #[test]
    fn every_column_comes_back_in_place() {
        let table = sample();
        let (count, data, cost) = table.pack(Columns::all());
        assert_eq!(data.len(), 30);
        let view = WorkerTable::from_packed(count, Columns::all(), &data, &cost, Columns::all()).expect("a view");
        assert_eq!(view.len(), 3);
        assert_eq!(view.ids, &table.ids[..]);
        assert_eq!(view.roles, &table.roles[..]);
        assert_eq!(view.capabilities, &table.capabilities[..]);
        assert_eq!(view.overlap_device_blocks, &table.overlap_device_blocks[..]);
        assert_eq!(view.overlap_host_blocks, &table.overlap_host_blocks[..]);
        assert_eq!(view.active_blocks, &table.active_blocks[..]);
        assert_eq!(view.prefill_tokens, &table.prefill_tokens[..]);
        assert_eq!(view.active_requests, &table.active_requests[..]);
        assert_eq!(view.capacity_blocks, &table.capacity_blocks[..]);
        assert_eq!(view.block_size, &table.block_size[..]);
        assert_eq!(view.cost, &table.cost[..]);
        assert_eq!(view.llm_indices().collect::<Vec<_>>(), [0, 2]);
    }

    #[test]
    fn a_subset_is_found_among_more_columns_and_the_rest_stays_hidden() {
        let table = sample();
        let sent = Columns::ROLES | Columns::PREFILL_TOKENS | Columns::ACTIVE_REQUESTS | Columns::COST;
        let wanted = Columns::ACTIVE_REQUESTS | Columns::COST;
        let (count, data, cost) = table.pack(sent);
        assert_eq!((data.len(), cost.len()), (9, 3));
        let view = WorkerTable::from_packed(count, sent, &data, &cost, wanted).expect("a view");
        assert_eq!(view.active_requests, [15, 16, 17]);
        assert_eq!(view.cost, [0.5, 1.5, 2.5]);
        assert!(view.roles.is_empty() && view.prefill_tokens.is_empty() && view.ids.is_empty());
        assert_eq!(view.len(), 3);
    }

    #[test]
    fn a_broken_table_is_an_error_not_a_panic() {
        let table = sample();
        let (count, data, cost) = table.pack(Columns::ROLES);
        let missing = WorkerTable::from_packed(count, Columns::ROLES, &data, &cost, Columns::ACTIVE_BLOCKS);
        let missing = missing.expect_err("missing column").message;
        assert_eq!(missing, "the host sent no ACTIVE_BLOCKS");
        let short = WorkerTable::from_packed(count + 1, Columns::ROLES, &data, &cost, Columns::ROLES);
        assert!(short.expect_err("short data").message.contains("lists"));
        let stray_cost = WorkerTable::from_packed(count, Columns::ROLES, &data, &[1.0; 3], Columns::ROLES);
        assert!(stray_cost.is_err(), "a cost column that was not announced");
    }
}
