//! The export macros, [`router!`](crate::router),
//! [`disaggregating_router!`](crate::disaggregating_router), [`batcher!`](crate::batcher) and
//! [`planner!`](crate::planner), which turn a trait implementation into the component's world
//! exports, and the hidden items their expansions call.

use alloc::vec::Vec;

use crate::{
    Batcher, Budget, PendingTable, PolicyError, RequestInfo, Router, Tenancy, WorkerTable, batcher_world, router_world,
};

/// Exports a [`Planner`](crate::Planner) implementation as the component's `planner` world.
#[macro_export]
macro_rules! planner {
    ($policy:ty) => {
        struct __SwitchyardPlannerExport;
        impl $crate::planner_world::Guest for __SwitchyardPlannerExport {
            fn init() -> Result<(), $crate::planner_world::switchyard::policy::types::PolicyError> {
                <$policy as $crate::Planner>::init().map_err(|e| {
                    $crate::planner_world::switchyard::policy::types::PolicyError { message: e.message }
                })
            }
            fn plan(
                pools: $crate::__Vec<$crate::Pool>,
                max_gpus: u32,
            ) -> Result<
                $crate::__Vec<$crate::ScaleDecision>,
                $crate::planner_world::switchyard::policy::types::PolicyError,
            > {
                let decisions = <$policy as $crate::Planner>::plan(&pools, max_gpus).map_err(|e| {
                    $crate::planner_world::switchyard::policy::types::PolicyError { message: e.message }
                });
                $crate::__end_of_call();
                decisions
            }
        }
        $crate::planner_world::export_planner_world!(__SwitchyardPlannerExport with_types_in $crate::planner_world);
    };
}

/// Exports a [`Router`] implementation as the component's `router` world.
#[macro_export]
macro_rules! router {
    ($policy:ty) => {
        struct __SwitchyardRouterExport;
        impl $crate::router_world::Guest for __SwitchyardRouterExport {
            fn init() -> Result<$crate::Columns, $crate::PolicyError> {
                <$policy as $crate::Router>::init()?;
                Ok(<$policy as $crate::Router>::COLUMNS)
            }
            fn route(
                req: $crate::RequestInfo,
                workers: $crate::router_world::switchyard::policy::types::WorkerTable,
            ) -> Result<$crate::Decision, $crate::PolicyError> {
                $crate::__route_packed::<$policy, _>(&req, &workers, <$policy as $crate::Router>::route)
            }
        }
        $crate::router_world::export_router_world!(__SwitchyardRouterExport with_types_in $crate::router_world);
    };
}

/// Exports a [`Router`] implementation as the component's
/// `disaggregating-router` world: the host calls its
/// [`route_disaggregated`](crate::Router::route_disaggregated) with tables that hold the
/// model's prefill workers; a gateway that predates disaggregation calls `route`, which
/// answers `route_disaggregated`'s decision without its prefill worker.
#[macro_export]
macro_rules! disaggregating_router {
    ($policy:ty) => {
        struct __SwitchyardRouterExport;
        impl $crate::disaggregating_router_world::Guest for __SwitchyardRouterExport {
            fn init() -> Result<$crate::Columns, $crate::PolicyError> {
                <$policy as $crate::Router>::init()?;
                Ok(<$policy as $crate::Router>::COLUMNS)
            }
            fn route(
                req: $crate::RequestInfo,
                workers: $crate::router_world::switchyard::policy::types::WorkerTable,
            ) -> Result<$crate::Decision, $crate::PolicyError> {
                Self::route_disaggregated(req, workers).map(|answer| answer.decision)
            }
            fn route_disaggregated(
                req: $crate::RequestInfo,
                workers: $crate::router_world::switchyard::policy::types::WorkerTable,
            ) -> Result<$crate::DisaggregatedDecision, $crate::PolicyError> {
                $crate::__route_packed::<$policy, _>(
                    &req,
                    &workers,
                    <$policy as $crate::Router>::route_disaggregated,
                )
            }
        }
        $crate::disaggregating_router_world::export_disaggregating_router_world!(
            __SwitchyardRouterExport with_types_in $crate::disaggregating_router_world
        );
    };
}

/// Exports a [`Batcher`] implementation as the component's `batcher` world.
#[macro_export]
macro_rules! batcher {
    ($policy:ty) => {
        struct __SwitchyardBatcherExport;
        impl $crate::batcher_world::Guest for __SwitchyardBatcherExport {
            fn init() -> Result<(), $crate::batcher_world::switchyard::policy::types::PolicyError> {
                <$policy as $crate::Batcher>::init().map_err(|e| {
                    $crate::batcher_world::switchyard::policy::types::PolicyError { message: e.message }
                })
            }
            fn form_batches(
                queue: $crate::batcher_world::switchyard::policy::types::PendingTable,
                budget: $crate::batcher_world::switchyard::policy::types::Budget,
            ) -> $crate::__Vec<$crate::batcher_world::switchyard::policy::types::Batch> {
                let batches = $crate::__batcher_adapter::<$policy>(queue, budget);
                $crate::__end_of_call();
                batches
            }
        }
        $crate::batcher_world::export_batcher_world!(__SwitchyardBatcherExport with_types_in $crate::batcher_world);
    };
}

#[doc(hidden)]
pub type __Vec<T> = Vec<T>;

#[doc(hidden)]
pub fn __batcher_adapter<B: Batcher>(
    queue: batcher_world::switchyard::policy::types::PendingTable,
    budget: batcher_world::switchyard::policy::types::Budget,
) -> Vec<batcher_world::switchyard::policy::types::Batch> {
    let queue = PendingTable {
        ids: queue.ids,
        tokens: queue.tokens,
        waited_ms: queue.waited_ms,
        priority: queue.priority,
        kinds: queue.kinds,
        ready: queue.ready,
    };
    let budget = Budget {
        token_budgets: budget.token_budgets,
        max_items: budget.max_items,
        max_batches: budget.max_batches,
    };
    #[cfg(target_arch = "wasm32")]
    let tenancy = Tenancy::from_host(
        batcher_world::switchyard::policy::tenancy::tenants(),
        batcher_world::switchyard::policy::tenancy::weights(),
        queue.ids.len(),
    );
    #[cfg(not(target_arch = "wasm32"))]
    let tenancy = Tenancy::from_host(Vec::new(), Vec::new(), queue.ids.len());
    B::form_batches_for(&queue, &tenancy, &budget)
        .into_iter()
        .map(|b| batcher_world::switchyard::policy::types::Batch {
            items: b.items,
            token_budget: b.token_budget,
        })
        .collect()
}

/// One routing call as both router macros export it: the packed table viewed with the
/// columns `R` declared, `route` called on it, then the call's arena reset.
#[doc(hidden)]
pub fn __route_packed<R: Router, T>(
    req: &RequestInfo,
    workers: &router_world::switchyard::policy::types::WorkerTable,
    route: impl FnOnce(&RequestInfo, &WorkerTable<'_>) -> Result<T, PolicyError>,
) -> Result<T, PolicyError> {
    let answer = WorkerTable::from_packed(workers.count, workers.present, &workers.data, &workers.cost, R::COLUMNS)
        .and_then(|view| route(req, &view));
    __end_of_call();
    answer
}

#[doc(hidden)]
pub fn __end_of_call() {
    #[cfg(target_arch = "wasm32")]
    crate::arena::reset();
}
