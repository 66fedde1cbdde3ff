//! The worker table as a policy reads it: typed slices over the packed columns the host sent.
//!
//! The host sends the columns a policy named in [`crate::Router::COLUMNS`] (and possibly more):
//! the u32 ones packed one after another in a single list, in the order `wit/policy.wit`
//! declares them, and the f32 `cost` column in a list of its own.
//! [`WorkerTable::from_packed`] splits them into one slice per column without copying;
//! columns the policy did not name are hidden, so reading one fails the same way every time
//! instead of working only when another policy happened to ask for it. [`Table`] is the owned
//! form tests build and pack. [`WorkerTable`] explains its checked and unchecked reads.

use alloc::string::String;
#[cfg(not(target_arch = "wasm32"))]
use alloc::vec::Vec;

use crate::{Columns, PolicyError, role};

/// Number of u32 columns in the contract (`flags columns` in `wit/policy.wit`, all but
/// `cost`).
const U32_COLUMNS: usize = 14;

/// The flag bit of each u32 column, in contract order (`cost`, bit 10, is apart).
const U32_BITS: [u32; U32_COLUMNS] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14];

/// Every candidate worker: element `i` of each column describes worker `i`. Decisions name
/// workers by that index.
///
/// A column can be read two ways:
/// - checked: [`WorkerTable::column`] or the method named after the column
///   (`workers.active_requests()?`) answers the slice, or, for a column the policy did not
///   declare, a [`PolicyError`] that names it and says to add it to [`crate::Router::COLUMNS`],
///   which the policy returns with `?`;
/// - unchecked, the fast path: the public fields (`workers.active_requests[i]`). An undeclared
///   column is an empty slice there, so indexing it panics, which in a component is a bare
///   trap (`unreachable`) that says nothing about why.
///
/// Either way the call fails: the request goes to the gateway's fallback and the failure counts
/// towards rolling the policy back; the host's self-test call at `switchyard policy check` and
/// at push time refuses such a policy. The checked read makes the reason (in that refusal and
/// in the gateway's log) name the column.
///
/// Take the checked slices once per call, before the loop over workers: the check is one test
/// per call, and the loop then indexes plain slices.
#[derive(Debug, Clone, Copy)]
pub struct WorkerTable<'a> {
    count: usize,
    /// The columns this view exposes: those the policy declared.
    declared: Columns,
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
    /// The worker's machine as a number (0: unknown, shared with no one).
    pub node: &'a [u32],
    /// Work this gateway queued at the worker, estimated in microseconds (encoders).
    pub queued_us: &'a [u32],
    /// The estimated time to encode the request's uncached media of the encoder's role, in
    /// microseconds (encoders).
    pub encode_us: &'a [u32],
    /// Tokens of the request's media of the encoder's role it holds cached (encoders).
    pub media_cached_tokens: &'a [u32],
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
        for (bit, column) in U32_BITS.iter().zip(columns.iter_mut()) {
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
            node,
            queued_us,
            encode_us,
            media_cached_tokens,
        ] = columns;
        Ok(WorkerTable {
            count,
            declared: wanted & Columns::all(),
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
            node,
            queued_us,
            encode_us,
            media_cached_tokens,
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

    /// Indices of prefill workers: rows only a router exported with
    /// [`disaggregating_router!`](crate::disaggregating_router) is given, after every other row
    /// (empty unless the policy declared [`Columns::ROLES`]).
    pub fn prefill_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.roles
            .iter()
            .enumerate()
            .filter(|(_, role)| **role == role::PREFILL)
            .map(|(i, _)| i)
    }

    /// The columns this view exposes: the ones the policy declared in
    /// [`crate::Router::COLUMNS`] (every column in a test's `testing::Table::view`).
    pub fn columns(&self) -> Columns {
        self.declared
    }

    /// The u32 column `column` (one flag, any but [`Columns::COST`], which the `cost` method
    /// reads), `len()` values long.
    ///
    /// # Errors
    ///
    /// A [`PolicyError`] naming the column if the policy did not declare it in
    /// [`crate::Router::COLUMNS`], or if `column` is not exactly one u32 column.
    pub fn column(&self, column: Columns) -> Result<&'a [u32], PolicyError> {
        let bits = column.bits();
        let slot = U32_BITS.iter().position(|&bit| bits == 1 << bit);
        let Some(slot) = slot else {
            return Err(PolicyError::new(
                "WorkerTable::column takes exactly one u32 column (read COST with WorkerTable::cost())",
            ));
        };
        let columns = [
            self.ids,
            self.roles,
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
        ];
        self.checked(column, columns[slot])
    }

    /// `values`, if the policy declared `column`.
    fn checked<T>(&self, column: Columns, values: &'a [T]) -> Result<&'a [T], PolicyError> {
        if self.declared.contains(column) {
            Ok(values)
        } else {
            Err(undeclared(column))
        }
    }
}

/// The error for reading `column` without declaring it, built without `core::fmt` (which would
/// double the size of a small policy).
#[cold]
fn undeclared(column: Columns) -> PolicyError {
    let mut names = String::new();
    for (name, _) in column.iter_names() {
        if !names.is_empty() {
            names.push_str(" | ");
        }
        names.push_str("Columns::");
        names.push_str(name);
    }
    let mut message = String::from("the policy reads ");
    message.push_str(&names);
    message.push_str(" but did not declare it: add it to Router::COLUMNS");
    PolicyError { message }
}

/// The checked accessor of each column, named after it.
macro_rules! checked_columns {
    ($($name:ident: $value:ty = $flag:ident;)*) => {
        impl<'a> WorkerTable<'a> {
            $(
                #[doc = concat!(
                    "The `", stringify!($name), "` column, checked: `len()` values, or a ",
                    "[`PolicyError`] naming it if the policy did not declare [`Columns::", stringify!($flag),
                    "`] in [`crate::Router::COLUMNS`]. The `", stringify!($name), "` field is the same ",
                    "slice unchecked (empty when undeclared)."
                )]
                ///
                /// # Errors
                ///
                /// If the column was not declared.
                pub fn $name(&self) -> Result<&'a [$value], PolicyError> {
                    self.checked(Columns::$flag, self.$name)
                }
            )*
        }
    };
}

checked_columns! {
    ids: u32 = IDS;
    roles: u32 = ROLES;
    capabilities: u32 = CAPABILITIES;
    overlap_device_blocks: u32 = OVERLAP_DEVICE_BLOCKS;
    overlap_host_blocks: u32 = OVERLAP_HOST_BLOCKS;
    active_blocks: u32 = ACTIVE_BLOCKS;
    prefill_tokens: u32 = PREFILL_TOKENS;
    active_requests: u32 = ACTIVE_REQUESTS;
    capacity_blocks: u32 = CAPACITY_BLOCKS;
    block_size: u32 = BLOCK_SIZE;
    cost: f32 = COST;
    node: u32 = NODE;
    queued_us: u32 = QUEUED_US;
    encode_us: u32 = ENCODE_US;
    media_cached_tokens: u32 = MEDIA_CACHED_TOKENS;
}

/// No workers, every column declared (and empty).
impl Default for WorkerTable<'_> {
    fn default() -> Self {
        WorkerTable {
            count: 0,
            declared: Columns::all(),
            ids: &[],
            roles: &[],
            capabilities: &[],
            overlap_device_blocks: &[],
            overlap_host_blocks: &[],
            active_blocks: &[],
            prefill_tokens: &[],
            active_requests: &[],
            capacity_blocks: &[],
            block_size: &[],
            cost: &[],
            node: &[],
            queued_us: &[],
            encode_us: &[],
            media_cached_tokens: &[],
        }
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
    /// See [`WorkerTable::node`].
    pub node: Vec<u32>,
    /// See [`WorkerTable::queued_us`].
    pub queued_us: Vec<u32>,
    /// See [`WorkerTable::encode_us`].
    pub encode_us: Vec<u32>,
    /// See [`WorkerTable::media_cached_tokens`].
    pub media_cached_tokens: Vec<u32>,
}

#[cfg(not(target_arch = "wasm32"))]
impl Table {
    /// Every column, borrowed as a policy reads them.
    pub fn view(&self) -> WorkerTable<'_> {
        WorkerTable {
            count: self.ids.len(),
            declared: Columns::all(),
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
            node: &self.node,
            queued_us: &self.queued_us,
            encode_us: &self.encode_us,
            media_cached_tokens: &self.media_cached_tokens,
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
            &self.node,
            &self.queued_us,
            &self.encode_us,
            &self.media_cached_tokens,
        ];
        let mut data = Vec::with_capacity(count * U32_COLUMNS);
        for (bit, column) in U32_BITS.iter().zip(all) {
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
            node: alloc::vec![24, 25, 26],
            queued_us: alloc::vec![27, 28, 29],
            encode_us: alloc::vec![30, 31, 32],
            media_cached_tokens: alloc::vec![33, 34, 35],
        }
    }

    #[test]
    fn every_column_comes_back_in_place() {
        let table = sample();
        let (count, data, cost) = table.pack(Columns::all());
        assert_eq!(data.len(), 42);
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
        assert_eq!(view.node, &table.node[..]);
        assert_eq!(view.queued_us, &table.queued_us[..]);
        assert_eq!(view.encode_us, &table.encode_us[..]);
        assert_eq!(view.media_cached_tokens, &table.media_cached_tokens[..]);
        assert_eq!(
            view.column(Columns::MEDIA_CACHED_TOKENS).expect("a column"),
            [33, 34, 35]
        );
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
        assert_eq!(view.columns(), wanted);
        assert_eq!(view.active_requests().expect("declared"), [15, 16, 17]);
        assert_eq!(view.column(Columns::ACTIVE_REQUESTS).expect("declared"), [15, 16, 17]);
        assert_eq!(view.cost().expect("declared"), [0.5, 1.5, 2.5]);
    }

    #[test]
    fn an_undeclared_column_is_a_named_error_not_a_panic() {
        let table = sample();
        let sent = Columns::all();
        let wanted = Columns::ROLES | Columns::ACTIVE_REQUESTS;
        let (count, data, cost) = table.pack(sent);
        let view = WorkerTable::from_packed(count, sent, &data, &cost, wanted).expect("a view");
        let expected = "the policy reads Columns::PREFILL_TOKENS but did not declare it: add it to Router::COLUMNS";
        assert_eq!(view.prefill_tokens().expect_err("undeclared").message, expected);
        let by_flag = view.column(Columns::PREFILL_TOKENS).expect_err("undeclared");
        assert_eq!(by_flag.message, expected);
        // Sent by the host (for another policy), but not declared: still an error, every time.
        assert!(view.prefill_tokens.is_empty());
        let cost = view.cost().expect_err("undeclared").message;
        assert_eq!(
            cost,
            "the policy reads Columns::COST but did not declare it: add it to Router::COLUMNS"
        );
        let checked = [
            (view.ids(), "IDS"),
            (view.capabilities(), "CAPABILITIES"),
            (view.overlap_device_blocks(), "OVERLAP_DEVICE_BLOCKS"),
            (view.overlap_host_blocks(), "OVERLAP_HOST_BLOCKS"),
            (view.active_blocks(), "ACTIVE_BLOCKS"),
            (view.capacity_blocks(), "CAPACITY_BLOCKS"),
            (view.block_size(), "BLOCK_SIZE"),
        ];
        for (read, name) in checked {
            let message = read.expect_err(name).message;
            assert!(message.contains(&alloc::format!("Columns::{name} ")), "{message}");
            assert!(message.contains("Router::COLUMNS"), "{message}");
        }
        assert_eq!(view.roles().expect("declared"), [0, 1, 0]);
    }

    #[test]
    fn column_takes_one_u32_column() {
        let table = sample();
        let view = table.view();
        assert_eq!(view.columns(), Columns::all());
        assert_eq!(view.column(Columns::BLOCK_SIZE).expect("a column"), [21, 22, 23]);
        assert_eq!(view.column(Columns::IDS).expect("a column"), [10, 11, 12]);
        for not_one in [Columns::COST, Columns::IDS | Columns::ROLES, Columns::empty()] {
            let message = view.column(not_one).expect_err("not one u32 column").message;
            assert!(message.contains("exactly one u32 column"), "{message}");
        }
        assert_eq!(WorkerTable::default().roles().expect("declared"), [0u32; 0]);
    }

    #[test]
    fn a_policy_reading_an_undeclared_column_fails_with_its_name_under_test() {
        struct Forgetful;
        impl crate::Router for Forgetful {
            const COLUMNS: Columns = Columns::ROLES;
            fn route(_req: &crate::RequestInfo, workers: &WorkerTable<'_>) -> Result<crate::Decision, PolicyError> {
                let active = workers.active_requests()?;
                let least = workers.llm_indices().min_by_key(|&i| active[i]);
                least
                    .map(crate::Decision::to)
                    .ok_or_else(|| PolicyError::new("no worker"))
            }
        }
        let err = crate::testing::route::<Forgetful>(&crate::testing::request(1, 64), &crate::testing::table(4))
            .expect_err("ACTIVE_REQUESTS was not declared");
        assert_eq!(
            err.message,
            "the policy reads Columns::ACTIVE_REQUESTS but did not declare it: add it to Router::COLUMNS"
        );
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
