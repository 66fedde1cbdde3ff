//! `least-load`: the LLM worker with the fewest active requests; ties go to the one with the
//! fewest prefill tokens in flight, then the lowest index.

#![cfg_attr(not(test), no_std)]

use switchyard_policy_sdk::{Decision, PolicyError, RequestInfo, Router, WorkerTable};

/// The policy.
pub struct LeastLoad;

impl Router for LeastLoad {
    fn route(_req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        workers
            .llm_indices()
            .min_by_key(|&i| (workers.active_requests[i], workers.prefill_tokens[i]))
            .map(Decision::to)
            .ok_or_else(|| PolicyError::new("no LLM worker in the table"))
    }
}

switchyard_policy_sdk::router!(LeastLoad);
