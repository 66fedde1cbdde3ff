//! Test guest `by-target` (well-behaved): shows what `ttft-target-ms` the host sent. A request
//! without a target goes to the first LLM worker, one with a target to the last.

#![no_std]

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, role};

struct ByTarget;

impl Router for ByTarget {
    const COLUMNS: Columns = Columns::ROLES;

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let mut llm = workers
            .roles
            .iter()
            .enumerate()
            .filter(|(_, role)| **role == role::LLM)
            .map(|(index, _)| index);
        let chosen = if req.ttft_target_ms > 0.0 {
            llm.last()
        } else {
            llm.next()
        };
        chosen
            .map(Decision::to)
            .ok_or_else(|| PolicyError::new("no LLM worker in the table"))
    }
}

switchyard_policy_sdk::router!(ByTarget);
