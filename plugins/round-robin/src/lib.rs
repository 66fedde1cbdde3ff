//! `round-robin`: LLM workers in turn. The turn counter lives in the instance, so it restarts
//! when the host re-instantiates the policy; that is harmless for round-robin.

#![cfg_attr(not(test), no_std)]

use core::sync::atomic::{AtomicU32, Ordering};

use switchyard_policy_sdk::lanes::U32x4;
use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, role};

static TURN: AtomicU32 = AtomicU32::new(0);

/// The policy.
pub struct RoundRobin;

impl Router for RoundRobin {
    const COLUMNS: Columns = Columns::ROLES;

    fn route(_req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let roles = workers.roles.get(..workers.len()).unwrap_or(workers.roles);
        let llm = llm_count(roles);
        if llm == 0 {
            return Err(PolicyError::new("no LLM worker in the table"));
        }
        let turn = TURN.fetch_add(1, Ordering::Relaxed) as usize % llm;
        // The turn-th LLM worker; when every worker is one (the usual table), that is index
        // `turn`, without a scan.
        if llm == roles.len() {
            return Ok(Decision::to(turn));
        }
        workers
            .llm_indices()
            .nth(turn)
            .map(Decision::to)
            .ok_or_else(|| PolicyError::new("turn out of range"))
    }
}

/// How many of `roles` are LLM workers, four per Wasm SIMD instruction.
fn llm_count(roles: &[u32]) -> usize {
    let (quads, tail) = roles.as_chunks::<4>();
    let llm = U32x4::splat(role::LLM);
    let counted: u32 = quads.iter().map(|quad| U32x4::load(quad).eq(llm).count()).sum();
    counted as usize + tail.iter().filter(|&&r| r == role::LLM).count()
}

switchyard_policy_sdk::router!(RoundRobin);
