//! Routing and batching policies as WebAssembly components, swapped live.
//!
//! This module owns everything that knows about wasmtime: the engine and sandbox
//! ([`runtime`]) with the epoch ticker that times calls ([`ticker`]), the host world's imports ([`host`]), the flat worker table ([`table`]), the
//! published versions of a policy with automatic rollback ([`versions`]), the live router
//! switch with fallback and rollouts ([`switch`]), the encoder-queue batchers with theirs
//! ([`batching`]), the planners that size worker pools ([`planning`]), and the offline check of a component ([`check`]). Nothing outside it
//! touches wasmtime: the server asks [`switch::PolicySwitch`] for a worker index and
//! [`batching::BatcherSwitch`] for batches, and gets an answer in every case, from the policy
//! or from the native fallback.

pub mod batching;
mod bindings;
pub mod check;
pub mod host;
pub mod planning;
pub mod runtime;
pub mod switch;
pub mod table;
pub mod ticker;
pub mod versions;
pub mod watch;
pub mod world;

/// Why a policy could not be loaded or could not answer.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// wasmtime refused the engine configuration.
    #[error("policy engine: {0}")]
    Engine(String),
    /// The bytes are not a usable router component.
    #[error("invalid policy: {0}")]
    Invalid(String),
    /// The component imports something outside the host world.
    #[error("policy imports what the host world does not offer: {0}")]
    ForbiddenImport(String),
    /// The policy trapped, ran past its deadline or out of memory.
    #[error("policy trapped: {0}")]
    Trap(String),
    /// Every instance slot of the sandbox is taken: a capacity event on this gateway, not a
    /// fault of the policy (it is served by the fallback and never counts toward rollback).
    #[error("policy instance pool full: {0}")]
    Capacity(String),
    /// The policy answered with an error.
    #[error("policy refused: {0}")]
    Refused(String),
    /// The policy answered with something out of range.
    #[error("policy answered nonsense: {0}")]
    InvalidAnswer(String),
    /// The named built-in policy does not exist.
    #[error(
        "no built-in policy named `{0}`; routers: round-robin, least-load, kv-aware, predicted-ttft, modality-aware, cost-aware; batchers: fcfs, token-budget, mixed-modality, priority, fair-share; planners: load-based, sla-based"
    )]
    UnknownBuiltIn(String),
}

impl PolicyError {
    fn engine(err: wasmtime::Error) -> PolicyError {
        PolicyError::Engine(format!("{err:#}"))
    }

    pub(crate) fn trap(err: wasmtime::Error) -> PolicyError {
        PolicyError::Trap(format!("{err:#}"))
    }

    /// An instantiation failure: the pool's slot limit is [`PolicyError::Capacity`], anything
    /// else a trap.
    pub(crate) fn instantiation(err: wasmtime::Error) -> PolicyError {
        if err.downcast_ref::<wasmtime::PoolConcurrencyLimitError>().is_some() {
            PolicyError::Capacity(format!("{err:#}"))
        } else {
            PolicyError::trap(err)
        }
    }

    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PolicyError::Engine(_) => "engine",
            PolicyError::Invalid(_) => "invalid",
            PolicyError::ForbiddenImport(_) => "forbidden_import",
            PolicyError::Trap(_) => "trap",
            PolicyError::Capacity(_) => "capacity",
            PolicyError::Refused(_) => "refused",
            PolicyError::InvalidAnswer(_) => "invalid_answer",
            PolicyError::UnknownBuiltIn(_) => "unknown",
        }
    }
}

/// The batcher policies built from `plugins/` and embedded in the binary.
pub fn built_in_batcher(name: &str) -> Result<&'static [u8], PolicyError> {
    match name {
        "fcfs" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/fcfs.wasm"))),
        "token-budget" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/token_budget.wasm"))),
        "mixed-modality" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/mixed_modality.wasm"))),
        "priority" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/priority.wasm"))),
        "fair-share" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/fair_share.wasm"))),
        other => Err(PolicyError::UnknownBuiltIn(other.to_string())),
    }
}

/// The planner policies built from `plugins/` and embedded in the binary.
pub fn built_in_planner(name: &str) -> Result<&'static [u8], PolicyError> {
    match name {
        "load-based" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/load_based.wasm"))),
        "sla-based" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/sla_based.wasm"))),
        other => Err(PolicyError::UnknownBuiltIn(other.to_string())),
    }
}

/// The router policies built from `plugins/` and embedded in the binary.
pub fn built_in_router(name: &str) -> Result<&'static [u8], PolicyError> {
    match name {
        "round-robin" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/round_robin.wasm"))),
        "least-load" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/least_load.wasm"))),
        "kv-aware" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/kv_aware.wasm"))),
        "predicted-ttft" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/predicted_ttft.wasm"))),
        "modality-aware" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/modality_aware.wasm"))),
        "cost-aware" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/cost_aware.wasm"))),
        "peer-sglang" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/peer_sglang.wasm"))),
        "peer-llm-d" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/peer_llm_d.wasm"))),
        "peer-aibrix" => Ok(include_bytes!(concat!(env!("OUT_DIR"), "/peer_aibrix.wasm"))),
        other => Err(PolicyError::UnknownBuiltIn(other.to_string())),
    }
}

#[cfg(test)]
mod tests;
