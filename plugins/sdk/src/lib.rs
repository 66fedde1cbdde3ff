//! The Switchyard policy SDK: write a routing or batching policy as plain Rust.
//!
//! This crate owns the guest side of the `switchyard:policy@0.2.0` contract: the generated
//! bindings, the [`Router`] and [`Batcher`] traits a policy implements, helpers over the flat
//! worker table, and the runtime a `no_std` component needs (an allocator and a panic handler
//! that traps, so a policy imports nothing but the host world). The bindings come from the
//! crate's own copy of the contract, `wit/policy.wit` here, byte-identical to the repository's
//! `wit/policy.wit`, so a policy crate outside the repository builds with nothing but a path or
//! git dependency on this crate. For routers over thousands of workers it also has
//! [`lanes`] (four-worker SIMD arithmetic that runs natively in tests), [`shortlist`] (scans
//! for ranking exact costs only where estimates say they can win), and for routers that keep a
//! record of their own decisions, [`prefix_index`] and [`state`]. A policy is:
//!
//! ```ignore
//! struct Mine;
//! impl switchyard_policy_sdk::Router for Mine {
//!     const COLUMNS: Columns = Columns::ROLES;
//!     fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
//!         workers.llm_indices().next().map(Decision::to).ok_or_else(|| PolicyError::new("no worker"))
//!     }
//! }
//! switchyard_policy_sdk::router!(Mine);
//! ```
//!
//! The crate's files, one concern each:
//!
//! | module | what it holds |
//! |---|---|
//! | `router_world`, `disaggregating_router_world`, `batcher_world`, `planner_world` | the bindings generated from the contract, one per world |
//! | `policy` (re-exported here) | the [`Router`], [`Batcher`] and [`Planner`] traits, [`Tenancy`] |
//! | `export` | the [`router!`], [`disaggregating_router!`], [`batcher!`] and [`planner!`] macros that export an implementation |
//! | [`log`], [`config`], [`measured`], [`prompt`] | the host's imports, served from `testing` when run natively |
//! | [`state`], [`scratch`] | memory kept per instance, and memory for one call |
//! | `table` (re-exported here) | [`WorkerTable`], the typed view over the packed columns |
//! | `batches` (re-exported here) | [`pack`], greedy packing into token budgets |
//! | [`lanes`], [`shortlist`], [`prefix_index`] | helpers for routers over thousands of workers |
//! | `arena`, `runtime` | the component's allocator, per-call arena, panic handler and `cabi_realloc` |

#![no_std]
#![deny(missing_docs)]

extern crate alloc;
#[cfg(not(target_arch = "wasm32"))]
extern crate std;

/// Generated bindings of the `router` world.
#[allow(missing_docs, clippy::too_many_arguments)]
pub mod router_world {
    wit_bindgen::generate!({
        path: "wit",
        world: "switchyard:policy/router",
        pub_export_macro: true,
        export_macro_name: "export_router_world",
        default_bindings_module: "switchyard_policy_sdk::router_world",
    });
}

/// Generated bindings of the `disaggregating-router` world (its types are the `router`
/// world's).
#[allow(missing_docs, clippy::too_many_arguments)]
pub mod disaggregating_router_world {
    wit_bindgen::generate!({
        path: "wit",
        world: "switchyard:policy/disaggregating-router",
        pub_export_macro: true,
        export_macro_name: "export_disaggregating_router_world",
        default_bindings_module: "switchyard_policy_sdk::disaggregating_router_world",
        with: {
            "switchyard:policy/types@0.2.0": crate::router_world::switchyard::policy::types,
            "switchyard:policy/log@0.2.0": crate::router_world::switchyard::policy::log,
            "switchyard:policy/config@0.2.0": crate::router_world::switchyard::policy::config,
            "switchyard:policy/clock@0.2.0": crate::router_world::switchyard::policy::clock,
            "switchyard:policy/tenancy@0.2.0": crate::router_world::switchyard::policy::tenancy,
            "switchyard:policy/measured@0.2.0": crate::router_world::switchyard::policy::measured,
            "switchyard:policy/prompt@0.2.0": crate::router_world::switchyard::policy::prompt,
        },
    });
}

/// Generated bindings of the `batcher` world.
#[allow(missing_docs, clippy::too_many_arguments)]
pub mod batcher_world {
    wit_bindgen::generate!({
        path: "wit",
        world: "switchyard:policy/batcher",
        pub_export_macro: true,
        export_macro_name: "export_batcher_world",
        default_bindings_module: "switchyard_policy_sdk::batcher_world",
    });
}

/// Generated bindings of the `planner` world.
#[allow(missing_docs, clippy::too_many_arguments)]
pub mod planner_world {
    wit_bindgen::generate!({
        path: "wit",
        world: "switchyard:policy/planner",
        pub_export_macro: true,
        export_macro_name: "export_planner_world",
        default_bindings_module: "switchyard_policy_sdk::planner_world",
    });
}

pub use planner_world::switchyard::policy::planning::{IntervalStats, Pool, PoolRole, ScaleDecision};

pub use router_world::switchyard::policy::types::{
    Batch, Budget, Columns, Decision, PendingTable, PolicyError, RequestInfo,
};

pub use disaggregating_router_world::switchyard::policy::disaggregation::DisaggregatedDecision;

mod batches;
mod export;
mod policy;
mod table;

pub use batches::pack;
#[doc(hidden)]
pub use export::{__Vec, __batcher_adapter, __end_of_call, __route_packed};
pub use policy::{Batcher, Planner, Router, Tenancy};
pub use table::WorkerTable;

pub mod config;
pub mod lanes;
pub mod log;
pub mod measured;
pub mod prefix_index;
pub mod prompt;
pub mod role;
pub mod scratch;
pub mod shortlist;
pub mod state;
#[cfg(not(target_arch = "wasm32"))]
pub mod testing;

#[cfg(target_arch = "wasm32")]
mod arena;
#[cfg(target_arch = "wasm32")]
mod runtime;
#[cfg(target_arch = "wasm32")]
pub use runtime::cabi_realloc;

/// A well-mixed 64-bit hash (splitmix64's finaliser), for tie-breaks and draws: policies have
/// no random source, and hashing the request id keeps equal workers evenly used.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Monotonic time (0 when tested natively).
pub fn now_ns() -> u64 {
    #[cfg(target_arch = "wasm32")]
    return router_world::switchyard::policy::clock::now_ns();
    #[cfg(not(target_arch = "wasm32"))]
    return 0;
}
