//! `pd-threshold`: prefill/decode disaggregation by NVIDIA Dynamo's conditional rule.
//!
//! The answering (decode) worker is `predicted-ttft`'s choice among the LLM workers. The prompt
//! goes to a prefill worker first when both hold:
//!
//! - the tokens the decode worker would have to prefill — the prompt less its cached prefix
//!   there — exceed `max_local_prefill_tokens` (default 1000, Dynamo's
//!   `max_local_prefill_length`): a short or mostly cached prompt is cheaper to prefill where it
//!   is than to move;
//! - the prefill queue — requests at the prefill workers beyond the one each is computing — is
//!   below `max_prefill_queue` (default 2, Dynamo's `max_prefill_queue_size`): with the prefill
//!   pool backed up, waiting there costs more than prefilling locally.
//!
//! The prefill worker is the one with the fewest requests in flight (then the fewest queued
//! tokens, then the most of the prompt cached). `max_local_prefill_tokens = 0` and a large
//! `max_prefill_queue` disaggregate every prompt that has a prefill worker ("always"); a
//! threshold above any prompt never does. The predicted-ttft model's own keys (`prefill_a`, …)
//! tune the decode choice as in `predicted-ttft`.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use switchyard_policy_sdk::{
    Columns, Decision, DisaggregatedDecision, PolicyError, RequestInfo, Router, WorkerTable, config,
};
use switchyard_ttft_model::{self as model, Model, disagg};

/// The policy.
pub struct PdThreshold;

/// How many next-best decode workers the decision names as fallbacks.
const FALLBACKS: usize = 2;

/// The rule's two bounds, from the policy's config.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rule {
    max_local_prefill_tokens: f64,
    max_prefill_queue: f64,
}

impl Rule {
    fn configured() -> Rule {
        static RULE: config::Derived<Rule> = config::Derived::new();
        RULE.get_or_init(|| Rule {
            max_local_prefill_tokens: config::get_f64("max_local_prefill_tokens", 1000.0),
            max_prefill_queue: config::get_f64("max_prefill_queue", 2.0),
        })
    }
}

impl Router for PdThreshold {
    const COLUMNS: Columns = model::COLUMNS;

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        model::choose(&Model::configured(), req, workers, FALLBACKS)
    }

    fn route_disaggregated(req: &RequestInfo, workers: &WorkerTable) -> Result<DisaggregatedDecision, PolicyError> {
        let decision = Self::route(req, workers)?;
        let rule = Rule::configured();
        let uncached = disagg::uncached_tokens(req, workers, decision.worker as usize);
        let prefill = (uncached > rule.max_local_prefill_tokens
            && f64::from(disagg::prefill_queue(workers)) < rule.max_prefill_queue)
            .then(|| disagg::least_queued_prefill(workers))
            .flatten()
            .map(|i| i as u32);
        Ok(DisaggregatedDecision { decision, prefill })
    }
}

switchyard_policy_sdk::disaggregating_router!(PdThreshold);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::{role, testing};

    /// Two decode workers (0, 1) and two prefill workers (2, 3).
    fn fleet() -> testing::Table {
        let mut table = testing::table(4);
        table.roles = vec![role::LLM, role::LLM, role::PREFILL, role::PREFILL];
        table
    }

    fn prefill_of(request: &RequestInfo, table: &testing::Table) -> Option<u32> {
        testing::route_disaggregated::<PdThreshold>(request, table)
            .expect("a decision")
            .prefill
    }

    #[test]
    fn long_uncached_prompts_go_to_the_least_queued_prefill_worker() {
        let mut table = fleet();
        table.active_requests = vec![0, 0, 1, 0];
        let answer =
            testing::route_disaggregated::<PdThreshold>(&testing::request(1, 4096), &table).expect("a decision");
        assert_eq!(answer.prefill, Some(3));
        assert!(answer.decision.worker < 2, "a prefill worker never answers");
        assert!(answer.decision.fallbacks.iter().all(|&i| i < 2));
    }

    #[test]
    fn short_or_cached_prompts_stay_local() {
        let mut table = fleet();
        assert_eq!(prefill_of(&testing::request(1, 960), &table), None);
        // 4096 tokens, 60 of 64 blocks cached on both decode workers: 256 to prefill.
        table.overlap_device_blocks = vec![60, 60, 0, 0];
        assert_eq!(prefill_of(&testing::request(1, 4096), &table), None);
    }

    #[test]
    fn a_backed_up_prefill_pool_keeps_prompts_local() {
        let mut table = fleet();
        // Queue: (3 − 1) + (1 − 1) = 2, not below the default bound of 2.
        table.active_requests = vec![0, 0, 3, 1];
        assert_eq!(prefill_of(&testing::request(1, 4096), &table), None);
        table.active_requests = vec![0, 0, 2, 1];
        assert_eq!(prefill_of(&testing::request(1, 4096), &table), Some(3));
    }

    #[test]
    fn without_prefill_workers_it_routes_as_predicted_ttft() {
        let table = testing::table(3);
        let answer =
            testing::route_disaggregated::<PdThreshold>(&testing::request(5, 4096), &table).expect("a decision");
        assert_eq!(answer.prefill, None);
        let plain = testing::route::<PdThreshold>(&testing::request(5, 4096), &table).expect("a decision");
        assert_eq!(
            (answer.decision.worker, answer.decision.fallbacks),
            (plain.worker, plain.fallbacks)
        );
    }
}
