//! Batching policies at the encoder queues: loading `batcher` components, checking their
//! answers, and the live switch between versions with a native fallback.
//!
//! Each encoder queue asks [`BatcherSwitch::form_batches`] how to split what is waiting into
//! micro-batches when it flushes. The active version answers if it can; an answer that breaks
//! the contract (an index out of range or twice, a batch over `max-items` or over its token
//! budget, items left out while fewer than `max-batches` batches were formed), a trap, or a
//! call past the deadline is replaced by [`fallback`] (first come, first served, packed into
//! the budgets), so no item is ever lost to a policy. Failures count against the version and
//! roll it back as routers' do ([`crate::policy::versions`]). Calls are rare (one per flush per
//! encoder) and come from any runtime thread, so instances are pooled behind a mutex rather
//! than kept per thread.

use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::policy::PolicyError;
use crate::policy::bindings::BatcherWorld;
pub use crate::policy::bindings::switchyard::policy::types::{Batch, Budget, PendingTable};
pub use crate::policy::host::Tenancy;
use crate::policy::runtime::PolicyRuntime;
use crate::policy::versions::{Labels, SwitchConfig, Version, Versions};
use crate::policy::world::{Compiled, Instance};

/// Instances kept for reuse; more concurrent flushes instantiate and drop their own.
const POOLED_INSTANCES: usize = 8;

/// A validated batcher policy: compiled code ready to instantiate. Immutable and shared.
pub type BatcherPolicy = Compiled<BatcherWorld>;

/// One live instance of a batcher policy.
pub type BatcherInstance = Instance<BatcherWorld>;

impl PolicyRuntime {
    /// Compiles (or loads from the cache), validates and self-tests a batcher policy.
    ///
    /// # Errors
    ///
    /// Returns [`PolicyError`] if the bytes are not a component, import anything outside the
    /// host world, do not export the `batcher` world, fail `init`, or answer the self-test
    /// against the contract.
    pub fn load_batcher(
        self: &Arc<Self>,
        name: &str,
        wasm: &[u8],
        policy_config: toml::Table,
    ) -> Result<BatcherPolicy, PolicyError> {
        let (queue, budget) = synthetic_queue();
        Compiled::load(self, name, wasm, policy_config, |instance| {
            instance.form_batches(&queue, &budget).map(drop)
        })
    }
}

impl Instance<BatcherWorld> {
    /// Calls `form-batches` under the deadline and checks the answer against the contract.
    ///
    /// # Errors
    ///
    /// [`PolicyError::Trap`] (deadline, memory, a trap) or [`PolicyError::InvalidAnswer`].
    pub fn form_batches(&mut self, queue: &PendingTable, budget: &Budget) -> Result<Vec<Batch>, PolicyError> {
        self.form_batches_for(queue, &Tenancy::default(), budget)
    }

    /// As [`BatcherInstance::form_batches`], telling the policy whose each item is.
    ///
    /// # Errors
    ///
    /// As [`BatcherInstance::form_batches`].
    pub fn form_batches_for(
        &mut self,
        queue: &PendingTable,
        tenancy: &Tenancy,
        budget: &Budget,
    ) -> Result<Vec<Batch>, PolicyError> {
        let (store, bindings) = self.armed();
        store.data_mut().tenancy = tenancy.clone();
        let batches = bindings.call_form_batches(&mut *store, queue, budget);
        store.data_mut().tenancy = Tenancy::default();
        store.data_mut().end_call();
        let batches = batches.map_err(PolicyError::trap)?;
        validate(queue, budget, &batches).map_err(PolicyError::InvalidAnswer)?;
        Ok(batches)
    }
}

/// Checks `batches` against the contract for `queue` and `budget` (see the module docs).
///
/// # Errors
///
/// What is wrong, for the operator's log.
pub fn validate(queue: &PendingTable, budget: &Budget, batches: &[Batch]) -> Result<(), String> {
    let count = queue.ids.len();
    let max_batches = budget.max_batches.max(1) as usize;
    let max_items = budget.max_items.max(1) as usize;
    let largest = budget.token_budgets.iter().copied().max();
    if batches.len() > max_batches {
        return Err(format!("{} batches, at most {max_batches} allowed", batches.len()));
    }
    let mut placed = vec![false; count];
    for (number, batch) in batches.iter().enumerate() {
        if batch.items.is_empty() || batch.items.len() > max_items {
            return Err(format!(
                "batch {number} holds {} items (1..={max_items} allowed)",
                batch.items.len()
            ));
        }
        let mut tokens = 0u64;
        for &index in &batch.items {
            let slot = placed
                .get_mut(index as usize)
                .ok_or_else(|| format!("batch {number} names item {index} of {count}"))?;
            if std::mem::replace(slot, true) {
                return Err(format!("item {index} is in two batches"));
            }
            tokens += u64::from(queue.tokens.get(index as usize).copied().unwrap_or(0));
        }
        let Some(largest) = largest else { continue };
        let label = u64::from(batch.token_budget);
        let in_budget = budget.token_budgets.contains(&batch.token_budget) && tokens <= label;
        let oversize_alone = batch.items.len() == 1 && tokens > u64::from(largest) && label >= tokens;
        if !in_budget && !oversize_alone {
            return Err(format!(
                "batch {number} holds {tokens} tokens under budget {label}; budgets are {:?}",
                budget.token_budgets
            ));
        }
    }
    if batches.len() < max_batches
        && let Some(missing) = placed.iter().position(|placed| !placed)
    {
        return Err(format!(
            "item {missing} is in no batch, and fewer than {max_batches} batches were formed"
        ));
    }
    Ok(())
}

/// The native fallback: first come, first served (higher priority classes first), packed in
/// that order until the next item would pass the largest budget or `max-items`; each batch is
/// labelled with the smallest budget it fits, an item larger than every budget goes alone.
pub fn fallback(queue: &PendingTable, budget: &Budget) -> Vec<Batch> {
    let mut order: Vec<usize> = (0..queue.ids.len()).collect();
    order.sort_by(|&a, &b| {
        let priority = |i: usize| queue.priority.get(i).copied().unwrap_or(0);
        let waited = |i: usize| queue.waited_ms.get(i).copied().unwrap_or(0.0);
        priority(b).cmp(&priority(a)).then(waited(b).total_cmp(&waited(a)))
    });
    let largest = budget.token_budgets.iter().copied().max().unwrap_or(u32::MAX);
    // Totals are summed in u64: in u32, a sum saturating at u32::MAX would never pass a
    // largest budget of u32::MAX, and one batch would take every item (found by fuzzing).
    let label = |total: u64| {
        let mut fitting: Vec<u32> = budget
            .token_budgets
            .iter()
            .copied()
            .filter(|b| u64::from(*b) >= total)
            .collect();
        fitting.sort_unstable();
        // No budget fits only a lone item larger than all of them: its own size labels it.
        fitting
            .first()
            .copied()
            .unwrap_or_else(|| u32::try_from(total).unwrap_or(u32::MAX))
    };
    let max_items = budget.max_items.max(1) as usize;
    let mut batches = Vec::new();
    let mut items: Vec<u32> = Vec::new();
    let mut total = 0u64;
    for index in order {
        let need = u64::from(queue.tokens.get(index).copied().unwrap_or(0));
        if !items.is_empty() && (total + need > u64::from(largest) || items.len() >= max_items) {
            batches.push(Batch {
                token_budget: label(total),
                items: std::mem::take(&mut items),
            });
            total = 0;
            if batches.len() >= budget.max_batches.max(1) as usize {
                return batches;
            }
        }
        items.push(index as u32);
        total += need;
    }
    if !items.is_empty() {
        batches.push(Batch {
            token_budget: label(total),
            items,
        });
    }
    batches
}

/// A queue the self-test asks a batcher to split: mixed kinds, sizes, waits and readiness.
fn synthetic_queue() -> (PendingTable, Budget) {
    let tokens = vec![576, 64, 1800, 256, 5760, 100, 576, 50];
    let n = tokens.len();
    let queue = PendingTable {
        ids: (1..=n as u64).collect(),
        tokens,
        waited_ms: (0..n).map(|i| (n - i) as f32 * 0.7).collect(),
        priority: vec![0; n],
        kinds: vec![1, 2, 3, 1, 3, 2, 1, 2],
        ready: (0..n).map(|i| i % 3 == 1).collect(),
    };
    let budget = Budget {
        token_budgets: vec![1024, 2048, 4096],
        max_items: 4,
        max_batches: 8,
    };
    (queue, budget)
}

/// How a flush was batched.
#[derive(Debug, Clone)]
pub enum BatchedBy {
    /// By this batcher version.
    Policy(Arc<Version<BatcherPolicy>>),
    /// By the native fallback, because of the named failure kind.
    Fallback(&'static str),
}

/// The live batcher policy of a gateway's encoder queues.
#[derive(Debug)]
pub struct BatcherSwitch {
    versions: Versions<BatcherPolicy>,
    instances: Mutex<Vec<(u64, BatcherInstance)>>,
    decisions: Family<Labels, Counter>,
}

impl BatcherSwitch {
    /// A switch whose active version is `policy`.
    pub fn new(policy: BatcherPolicy, config: SwitchConfig) -> BatcherSwitch {
        BatcherSwitch {
            versions: Versions::new("batcher", policy, config),
            instances: Mutex::new(Vec::new()),
            decisions: Family::default(),
        }
    }

    /// Registers the switch's metrics.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "batcher_decisions",
            "Encoder-queue flushes batched, by batcher version and outcome (policy, fallback)",
            self.decisions.clone(),
        );
        registry.register(
            "batcher_failures",
            "Batcher calls that failed, by version and kind",
            self.versions.failures.clone(),
        );
        registry.register(
            "batcher_rollbacks",
            "Automatic rollbacks to a previous batcher version",
            self.versions.rollbacks.clone(),
        );
    }

    /// The active version.
    pub fn active(&self) -> Arc<Version<BatcherPolicy>> {
        self.versions.active()
    }

    /// The versions kept for rollback, oldest first.
    pub fn previous(&self) -> Vec<Arc<Version<BatcherPolicy>>> {
        self.versions.previous()
    }

    /// Makes `policy` the active version; flushes after this one use it.
    pub fn publish(&self, policy: Arc<BatcherPolicy>) -> Arc<Version<BatcherPolicy>> {
        self.versions.publish(policy)
    }

    /// Restores the most recent previous version, if there is one.
    pub fn rollback(&self) -> Option<Arc<Version<BatcherPolicy>>> {
        self.versions.rollback()
    }

    /// Splits `queue` (not empty) into batches within `budget`: the active version's answer if
    /// it keeps the contract, the [`fallback`]'s otherwise.
    pub fn form_batches(&self, queue: &PendingTable, budget: &Budget) -> (Vec<Batch>, BatchedBy) {
        self.form_batches_for(queue, &Tenancy::default(), budget)
    }

    /// As [`BatcherSwitch::form_batches`], telling the policy whose each item is.
    pub fn form_batches_for(
        &self,
        queue: &PendingTable,
        tenancy: &Tenancy,
        budget: &Budget,
    ) -> (Vec<Batch>, BatchedBy) {
        let version = self.versions.active();
        let outcome = self.call(&version, queue, tenancy, budget);
        let (batches, by) = match outcome {
            Ok(batches) => (batches, BatchedBy::Policy(version.clone())),
            Err(kind) => (fallback(queue, budget), BatchedBy::Fallback(kind)),
        };
        version
            .decisions(&self.decisions, matches!(by, BatchedBy::Fallback(_)))
            .inc();
        (batches, by)
    }

    fn call(
        &self,
        version: &Arc<Version<BatcherPolicy>>,
        queue: &PendingTable,
        tenancy: &Tenancy,
        budget: &Budget,
    ) -> Result<Vec<Batch>, &'static str> {
        let pooled = {
            let mut instances = self.instances.lock();
            let live = self.versions.active_generation();
            instances.retain(|(generation, _)| *generation == live);
            instances
                .iter()
                .position(|(generation, _)| *generation == version.generation)
                .map(|position| instances.swap_remove(position).1)
        };
        let instance = match pooled {
            Some(instance) => Ok(instance),
            None if !version.may_instantiate(self.versions.now_ms()) => return Err("backoff"),
            None => version.policy.instantiate(),
        };
        let result = instance.and_then(|mut instance| {
            let batches = instance.form_batches_for(queue, tenancy, budget)?;
            // Only an instance that answered well goes back; a trapped one cannot be entered.
            let mut instances = self.instances.lock();
            if instances.len() < POOLED_INSTANCES {
                instances.push((version.generation, instance));
            }
            Ok(batches)
        });
        result.map_err(|err| {
            if self.versions.record_failure(version, &err) {
                self.versions.roll_back_if_active(version);
            }
            err.kind()
        })
    }
}

impl BatchedBy {
    /// `NAME@SHA#GENERATION` for a policy, `fallback:KIND` otherwise.
    pub fn label(&self) -> String {
        match self {
            BatchedBy::Policy(version) => format!("{}#{}", version.label(), version.generation),
            BatchedBy::Fallback(kind) => format!("fallback:{kind}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(tokens: &[u32]) -> PendingTable {
        let n = tokens.len();
        PendingTable {
            ids: (0..n as u64).collect(),
            tokens: tokens.to_vec(),
            waited_ms: (0..n).map(|i| (n - i) as f32).collect(),
            priority: vec![0; n],
            kinds: vec![1; n],
            ready: vec![false; n],
        }
    }

    fn budget(budgets: &[u32], max_items: u32, max_batches: u32) -> Budget {
        Budget {
            token_budgets: budgets.to_vec(),
            max_items,
            max_batches,
        }
    }

    #[test]
    fn the_fallback_keeps_the_contract_and_arrival_order() {
        let queue = queue(&[300, 100, 5000, 700, 200]);
        let budget = budget(&[512, 1024], 3, 8);
        let batches = fallback(&queue, &budget);
        validate(&queue, &budget, &batches).expect("the fallback keeps the contract");
        let order: Vec<u32> = batches.iter().flat_map(|b| b.items.clone()).collect();
        assert_eq!(order, [0, 1, 2, 3, 4], "oldest first");
        assert_eq!(batches[0].items, [0, 1]);
        assert_eq!(batches[0].token_budget, 512);
        assert_eq!(batches[1].items, [2], "larger than every budget: alone");
        assert_eq!(batches[1].token_budget, 5000);
    }

    #[test]
    fn the_fallback_splits_items_whose_sum_passes_u32() {
        // Found by the `policy_answer` fuzz target: with a largest budget of u32::MAX, a sum
        // saturating in u32 never passed it, and one batch took items over the budget.
        let queue = queue(&[u32::MAX, u32::MAX, 2_113_929_215]);
        let budget = budget(&[3_204_392_703, u32::MAX], 53, 0);
        let batches = fallback(&queue, &budget);
        validate(&queue, &budget, &batches).expect("the fallback keeps the contract");
        assert_eq!(batches[0].items, [0], "{batches:?}");
    }

    #[test]
    fn answers_that_break_the_contract_are_named() {
        let queue = queue(&[300, 100, 700]);
        let budget = budget(&[512, 1024], 2, 4);
        let batch = |items: &[u32], token_budget| Batch {
            items: items.to_vec(),
            token_budget,
        };
        let cases = [
            (vec![batch(&[0, 1], 512), batch(&[2], 1024)], None),
            (vec![batch(&[0, 1], 512)], Some("in no batch")),
            (vec![batch(&[0, 3], 512), batch(&[2], 1024)], Some("names item 3")),
            (vec![batch(&[0, 0], 512), batch(&[2], 1024)], Some("two batches")),
            (vec![batch(&[0, 1, 2], 2048)], Some("holds 3 items")),
            (vec![batch(&[0, 2], 1024), batch(&[1], 100)], Some("budget 100")),
            (vec![batch(&[0, 1], 300), batch(&[2], 1024)], Some("budget 300")),
            (vec![], Some("in no batch")),
        ];
        for (batches, expected) in cases {
            let result = validate(&queue, &budget, &batches);
            match expected {
                None => result.expect("valid"),
                Some(text) => assert!(result.expect_err("refused").contains(text), "{batches:?}"),
            }
        }
        let full = Budget {
            max_batches: 1,
            ..budget
        };
        validate(&queue, &full, &[batch(&[0, 1], 512)]).expect("max-batches formed: the rest may wait");
    }
}
