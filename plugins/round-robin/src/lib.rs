//! `round-robin`: LLM workers in turn. The turn counter lives in the instance, so it restarts
//! when the host re-instantiates the policy; that is harmless for round-robin.

#![cfg_attr(not(test), no_std)]

use core::sync::atomic::{AtomicU32, Ordering};

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable};

static TURN: AtomicU32 = AtomicU32::new(0);

/// The policy.
pub struct RoundRobin;

impl Router for RoundRobin {
    const COLUMNS: Columns = Columns::ROLES;

    fn route(_req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let llm = workers.llm_indices().count();
        if llm == 0 {
            return Err(PolicyError::new("no LLM worker in the table"));
        }
        let turn = TURN.fetch_add(1, Ordering::Relaxed) as usize % llm;
        workers
            .llm_indices()
            .nth(turn)
            .map(Decision::to)
            .ok_or_else(|| PolicyError::new("turn out of range"))
    }
}

switchyard_policy_sdk::router!(RoundRobin);
