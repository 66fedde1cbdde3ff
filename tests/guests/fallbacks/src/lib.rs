//! Test guest `fallbacks` (well-behaved): the first LLM worker in the table, then every other
//! LLM worker as a fallback, last first. A host that honours `decision.fallbacks` retries on
//! the last worker of the table; one that asks the policy again gets the first one left.

#![no_std]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable};

struct Fallbacks;

impl Router for Fallbacks {
    const COLUMNS: Columns = Columns::ROLES;

    fn route(_req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let mut llm: Vec<usize> = workers.llm_indices().collect();
        let first = *llm
            .first()
            .ok_or_else(|| PolicyError::new("no LLM worker in the table"))?;
        llm.remove(0);
        let mut decision = Decision::to(first);
        decision.fallbacks = llm.iter().rev().map(|&index| index as u32).collect();
        Ok(decision)
    }
}

switchyard_policy_sdk::router!(Fallbacks);
