//! The traits a policy implements, one per world: [`Router`], [`Batcher`] and [`Planner`], and
//! what the SDK adds to the contract's types ([`PolicyError::new`], [`Decision::to`],
//! [`Tenancy`]).

use alloc::string::String;
use alloc::vec::Vec;

use crate::{
    Batch, Budget, Columns, Decision, DisaggregatedDecision, PendingTable, PolicyError, Pool, RequestInfo,
    ScaleDecision, WorkerTable,
};

/// A routing policy.
pub trait Router {
    /// The worker-table columns `route` reads. The host sends only what policies ask for, so
    /// naming fewer columns makes each call cheaper; in the [`WorkerTable`] `route` sees,
    /// columns not named here are empty slices, and their checked accessors
    /// ([`WorkerTable::column`], `workers.active_requests()`, ...) answer an error naming them.
    /// Every column by default.
    const COLUMNS: Columns = Columns::all();

    /// Called once per instance before any route; an error refuses the policy.
    fn init() -> Result<(), PolicyError> {
        Ok(())
    }

    /// Picks a worker (an index into `workers`) for `req`.
    fn route(req: &RequestInfo, workers: &WorkerTable<'_>) -> Result<Decision, PolicyError>;

    /// Picks the answering worker and, optionally, a prefill worker to compute the prompt
    /// first (a row of [`role::PREFILL`](crate::role::PREFILL), see
    /// [`WorkerTable::prefill_indices`]): what the host calls on a router exported with
    /// [`disaggregating_router!`](crate::disaggregating_router), whose tables hold the prefill
    /// workers. The default answers [`Router::route`]'s decision, never disaggregating.
    fn route_disaggregated(req: &RequestInfo, workers: &WorkerTable<'_>) -> Result<DisaggregatedDecision, PolicyError> {
        Self::route(req, workers).map(|decision| DisaggregatedDecision {
            decision,
            prefill: None,
        })
    }
}

/// Who queued each item of a pending table, index for index: what a batcher sharing a queue
/// between tenants reads beside the table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tenancy {
    /// Each item's tenant as a small number (one tenant's items share it; 0 = no tenant).
    pub tenants: Vec<u32>,
    /// Each item's tenant's weight (its share; 1.0 where none is configured).
    pub weights: Vec<f32>,
}

impl Tenancy {
    /// Every one of `items` from one tenant of weight 1 (what a queue without tenants is).
    pub fn single(items: usize) -> Tenancy {
        Tenancy {
            tenants: alloc::vec![0; items],
            weights: alloc::vec![1.0; items],
        }
    }

    /// The host's answer for the current call, made as long as the table (a host that gives
    /// less leaves the rest to tenant 0, weight 1; a weight that is not a positive number
    /// counts as 1).
    pub(crate) fn from_host(tenants: Vec<u32>, weights: Vec<f32>, items: usize) -> Tenancy {
        let mut tenancy = Tenancy { tenants, weights };
        tenancy.tenants.resize(items, 0);
        tenancy.weights.resize(items, 1.0);
        for weight in &mut tenancy.weights {
            if !(weight.is_finite() && *weight > 0.0) {
                *weight = 1.0;
            }
        }
        tenancy
    }
}

/// A batching policy.
pub trait Batcher {
    /// Called once per instance before any call; an error refuses the policy.
    fn init() -> Result<(), PolicyError> {
        Ok(())
    }

    /// Forms batches of indices into `queue` within `budget`.
    fn form_batches(queue: &PendingTable, budget: &Budget) -> Vec<Batch>;

    /// As [`Batcher::form_batches`], knowing whose each item is; what the gateway calls. The
    /// default ignores `tenancy`: a policy that shares the queue between tenants overrides it.
    fn form_batches_for(queue: &PendingTable, tenancy: &Tenancy, budget: &Budget) -> Vec<Batch> {
        let _ = tenancy;
        Self::form_batches(queue, budget)
    }
}

/// A planner: desired sizes of the worker pools, once per adjustment interval (the `planner`
/// world). Pools come with their recent history, so a planner keeps no state between calls.
pub trait Planner {
    /// Called once per instance before any call; an error refuses the policy.
    fn init() -> Result<(), PolicyError> {
        Ok(())
    }

    /// Desired sizes for `pools` (indices into it); pools left out keep their size.
    /// `max_gpus` is the fleet's GPU budget (0: none).
    fn plan(pools: &[Pool], max_gpus: u32) -> Result<Vec<ScaleDecision>, PolicyError>;
}

impl PolicyError {
    /// An error with `message`.
    pub fn new(message: &str) -> PolicyError {
        PolicyError {
            message: String::from(message),
        }
    }
}

impl Decision {
    /// Route to worker `index`, with no encoder and no fallbacks.
    pub fn to(index: usize) -> Decision {
        Decision {
            worker: index as u32,
            encoders: Vec::new(),
            fallbacks: Vec::new(),
        }
    }
}
