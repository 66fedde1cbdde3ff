//! Testing a policy natively (`cargo test`), without a gateway: the host imports are served
//! from here, and [`table`] builds worker tables.

use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;
use std::cell::RefCell;
use std::collections::HashMap;

use crate::{Decision, PolicyError, RequestInfo, Router, WorkerTable};

pub use crate::table::Table;

std::thread_local! {
    static CONFIG: RefCell<HashMap<String, String>> = RefCell::new(HashMap::new());
    static TIMINGS: RefCell<Vec<crate::measured::WorkerTiming>> = const { RefCell::new(Vec::new()) };
    static PREFILL_FITS: RefCell<Vec<crate::measured::PrefillFit>> = const { RefCell::new(Vec::new()) };
    static PROMPT: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Sets what [`crate::prompt::block_hashes`] answers.
pub fn set_prompt(hashes: Vec<u64>) {
    PROMPT.with(|current| *current.borrow_mut() = hashes);
}

pub(crate) fn prompt() -> Vec<u64> {
    PROMPT.with(|current| current.borrow().clone())
}

/// Sets what [`crate::measured::timings`] answers.
pub fn set_timings(timings: Vec<crate::measured::WorkerTiming>) {
    TIMINGS.with(|current| *current.borrow_mut() = timings);
}

pub(crate) fn timings() -> Vec<crate::measured::WorkerTiming> {
    TIMINGS.with(|current| current.borrow().clone())
}

/// Sets what [`crate::measured::prefill_fits`] answers.
pub fn set_prefill_fits(fits: Vec<crate::measured::PrefillFit>) {
    PREFILL_FITS.with(|current| *current.borrow_mut() = fits);
}

pub(crate) fn prefill_fits() -> Vec<crate::measured::PrefillFit> {
    PREFILL_FITS.with(|current| current.borrow().clone())
}

/// Sets a configuration value the policy will read with [`crate::config::get`].
pub fn set_config(key: &str, value: &str) {
    CONFIG.with(|config| config.borrow_mut().insert(key.into(), value.into()));
}

pub(crate) fn config_value(key: &str) -> Option<String> {
    CONFIG.with(|config| config.borrow().get(key).cloned())
}

/// A table of `n` idle LLM workers with block size 64; set the fields you care about.
pub fn table(n: usize) -> Table {
    Table {
        ids: (0..n as u32).collect(),
        roles: vec![0; n],
        capabilities: vec![1; n],
        overlap_device_blocks: vec![0; n],
        overlap_host_blocks: vec![0; n],
        active_blocks: vec![0; n],
        prefill_tokens: vec![0; n],
        active_requests: vec![0; n],
        capacity_blocks: vec![16_384; n],
        block_size: vec![64; n],
        cost: vec![1.0; n],
        node: vec![0; n],
        queued_us: vec![0; n],
        encode_us: vec![0; n],
        media_cached_tokens: vec![0; n],
    }
}

/// Routes `req` over `table` with policy `P` the way the gateway does: `init` first, then
/// `route` over the table packed as the host sends it, holding only the columns
/// `P::COLUMNS` names, so a policy that reads a column it did not declare fails here too
/// (a checked read such as `workers.active_requests()?` answers an error naming the
/// column; an unchecked one sees an empty slice and panics when indexed).
pub fn route<P: Router>(req: &RequestInfo, table: &Table) -> Result<Decision, PolicyError> {
    P::init()?;
    let (count, data, cost) = table.pack(P::COLUMNS);
    let view = WorkerTable::from_packed(count, P::COLUMNS, &data, &cost, P::COLUMNS)?;
    P::route(req, &view)
}

/// As [`route`], through [`Router::route_disaggregated`]: what the gateway calls on a router
/// exported with [`disaggregating_router!`](crate::disaggregating_router).
pub fn route_disaggregated<P: Router>(
    req: &RequestInfo,
    table: &Table,
) -> Result<crate::DisaggregatedDecision, PolicyError> {
    P::init()?;
    let (count, data, cost) = table.pack(P::COLUMNS);
    let view = WorkerTable::from_packed(count, P::COLUMNS, &data, &cost, P::COLUMNS)?;
    P::route_disaggregated(req, &view)
}

/// A small deterministic generator for a policy's differential tests (random tables
/// replayed the same way on every run).
pub struct Draws(pub u64);

impl Draws {
    /// A value below `bound` (0 when `bound` is 0).
    pub fn below(&mut self, bound: u32) -> u32 {
        self.0 = crate::mix(self.0);
        (self.0 % u64::from(bound.max(1))) as u32
    }

    /// A value from a few small ones (so that workers tie), else anything below `bound`.
    pub fn value(&mut self, bound: u32) -> u32 {
        if self.below(2) == 0 {
            self.below(3)
        } else {
            self.below(bound)
        }
    }
}

/// A request of `prompt_tokens` tokens.
pub fn request(id: u64, prompt_tokens: u32) -> RequestInfo {
    RequestInfo {
        request_id: id,
        prompt_tokens,
        max_tokens: 128,
        prompt_blocks: prompt_tokens / 64,
        media_tokens: 0,
        affinity: 0,
        ttft_target_ms: 0.0,
    }
}
