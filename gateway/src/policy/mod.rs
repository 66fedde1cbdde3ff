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
        }
    }
}

#[cfg(test)]
mod tests;
