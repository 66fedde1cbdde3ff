//! Test guest `cheapest` (well-behaved): the LLM worker with the lowest `cost`, the one f32
//! column, which travels in a list of its own; it declares only the columns it reads.

#![no_std]

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, role};

struct Cheapest;

impl Router for Cheapest {
    const COLUMNS: Columns = Columns::ROLES.union(Columns::COST);

    fn route(_req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        workers
            .roles
            .iter()
            .zip(workers.cost)
            .enumerate()
            .filter(|(_, (role, _))| **role == role::LLM)
            .min_by(|(_, (_, a)), (_, (_, b))| a.total_cmp(b))
            .map(|(index, _)| Decision::to(index))
            .ok_or_else(|| PolicyError::new("no LLM worker in the table"))
    }
}

switchyard_policy_sdk::router!(Cheapest);
