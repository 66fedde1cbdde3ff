//! `pd-predicted`: prefill/decode disaggregation decided by predicted latency, jointly with the
//! answering worker.
//!
//! For every LLM worker `d` that could answer, with `predicted-ttft`'s step-time model and cost
//! (its keys tune it here too) and `D` the worker's requests in flight, two ways are priced:
//!
//! - **Local**: `predicted-ttft`'s cost of `d` (its queue, then the prompt's tokens `d` has not
//!   cached, beside its `D` decoders; the engine time those tokens take from later requests;
//!   its own decode; memory pressure), plus the stall that prefill inflicts on `d`'s running
//!   streams (`predicted-ttft`'s interference term: each step carrying prompt tokens is a slow
//!   step for all `D` of them) times `stall_weight` (default 0.05: a ms of one stream's stall,
//!   spread over a long answer, moves its mean inter-token latency little).
//! - **Remote**, through the prefill worker `p` that makes it shortest: `p`'s queue and the
//!   prompt's tokens `p` has not cached (no decoders ride along on a prefill worker), plus moving
//!   the full blocks `d` lacks (`kv_block_bytes` each over `link_local_gbps` within a machine,
//!   `link_remote_gbps` across machines), plus `d` computing what the blocks do not cover (the
//!   last partial block) behind its own queue, beside its decoders, and that step's (smaller)
//!   stall priced alike. The uncached tokens' engine time is charged to `p`'s later requests
//!   instead of `d`'s (the same `impact_weight`); `d`'s decode and memory terms stay.
//!
//! Each worker takes its cheaper way; the cheapest worker wins (ties broken by a hash of the
//! request id, as in `predicted-ttft`), with the next two as fallbacks (a fallback prefills
//! locally). A worker with no decoders suffers no stall, so an idle one prefills locally unless
//! a prefill worker's cache or queue makes the remote way shorter outright; a short or cached
//! prompt has nothing worth moving. Pricing the ways per worker costs one prediction per LLM
//! worker and one addition per (worker, prefill worker) pair.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{
    Columns, Decision, DisaggregatedDecision, PolicyError, RequestInfo, Router, WorkerTable, config,
};
use switchyard_ttft_model::disagg::{self, Link};
use switchyard_ttft_model::{self as model, Model, at};

/// The policy.
pub struct PdPredicted;

/// How many next-best decode workers the decision names as fallbacks.
const FALLBACKS: usize = 2;

/// The price of a millisecond of stall on the decode worker's streams, in milliseconds of
/// this request's time to first token.
fn stall_weight() -> f64 {
    static WEIGHT: config::Derived<f64> = config::Derived::new();
    WEIGHT.get_or_init(|| config::get_f64("stall_weight", 0.05))
}

/// The remote way's parts that do not depend on the answering worker: each prefill worker with
/// the time to compute the prompt there and the engine time its uncached tokens take.
struct PrefillSide {
    index: usize,
    prefill_ms: f64,
    impact_ms: f64,
}

fn prefill_sides(model: &Model, req: &RequestInfo, workers: &WorkerTable) -> Vec<PrefillSide> {
    let full_step_ms = model.prefill_ms(model.step_tokens);
    workers
        .prefill_indices()
        .map(|p| {
            let uncached = disagg::uncached_tokens(req, workers, p);
            PrefillSide {
                index: p,
                prefill_ms: model.first_token_ms(at(workers.prefill_tokens, p), uncached, 0.0),
                impact_ms: uncached / model.step_tokens * full_step_ms,
            }
        })
        .collect()
}

/// Worker `d`'s cheaper way: its cost and, when remote is cheaper, the prefill worker.
fn way(
    model: &Model,
    link: &Link,
    req: &RequestInfo,
    workers: &WorkerTable,
    d: usize,
    prefill: &[PrefillSide],
) -> (bool, f64, Option<usize>) {
    let local = model.predict(req, workers, d);
    let local_cost = local.cost + stall_weight() * local.interference_ms;
    if prefill.is_empty() {
        return (local.overflows, local_cost, None);
    }
    let decoders = at(workers.active_requests, d);
    let block_size = at(workers.block_size, d).max(1.0);
    let tail = (f64::from(req.prompt_tokens) - block_size * f64::from(req.prompt_blocks)).max(0.0);
    // The tail's step stalls the decoders too, if less than the whole prompt would.
    let tail_stall_ms = if tail > 0.0 {
        decoders
            * (model.prefill_ms(tail.min(model.prefill_per_step(decoders)) + decoders) - local.decode_step_ms).max(0.0)
    } else {
        0.0
    };
    let tail_ms = model.first_token_ms(at(workers.prefill_tokens, d), tail, decoders) + stall_weight() * tail_stall_ms;
    // What stays on `d` whichever way the prompt is computed: its decode and memory terms.
    let staying = local.cost
        - local.ttft_ms
        - model.impact_weight * local.impact_ms
        - model.interference_weight * local.interference_ms;
    let missing = disagg::missing_blocks(req, workers, d);
    let remote = prefill
        .iter()
        .map(|side| {
            let cost = staying
                + side.prefill_ms
                + link.transfer_ms(missing, disagg::same_node(workers, d, side.index))
                + tail_ms
                + model.impact_weight * side.impact_ms;
            (side.index, cost)
        })
        .filter(|(_, cost)| !cost.is_nan())
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    match remote {
        Some((p, cost)) if cost < local_cost => (local.overflows, cost, Some(p)),
        _ => (local.overflows, local_cost, None),
    }
}

impl Router for PdPredicted {
    const COLUMNS: Columns = model::COLUMNS.union(Columns::NODE);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        model::choose(&Model::configured(), req, workers, FALLBACKS)
    }

    fn route_disaggregated(req: &RequestInfo, workers: &WorkerTable) -> Result<DisaggregatedDecision, PolicyError> {
        let model = Model::configured();
        let link = Link::configured();
        let prefill = prefill_sides(&model, req, workers);
        if prefill.is_empty() {
            let decision = model::choose(&model, req, workers, FALLBACKS)?;
            return Ok(DisaggregatedDecision {
                decision,
                prefill: None,
            });
        }
        let mut ranked: Vec<(bool, f64, usize, Option<usize>)> = workers
            .llm_indices()
            .map(|d| {
                let (overflows, cost, p) = way(&model, &link, req, workers, d, &prefill);
                (overflows, cost, d, p)
            })
            .collect();
        let pick =
            model::rank(&mut ranked, req.request_id).ok_or_else(|| PolicyError::new("no LLM worker in the table"))?;
        let mut decision = Decision::to(ranked[pick].2);
        decision.fallbacks = model::fallbacks(&ranked, pick, FALLBACKS);
        Ok(DisaggregatedDecision {
            decision,
            prefill: ranked[pick].3.map(|p| p as u32),
        })
    }
}

switchyard_policy_sdk::disaggregating_router!(PdPredicted);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::{role, testing};

    /// One decode worker (0) and two prefill workers (1, 2).
    fn fleet() -> testing::Table {
        let mut table = testing::table(3);
        table.roles = vec![role::LLM, role::PREFILL, role::PREFILL];
        table
    }

    fn prefill_of(request: &RequestInfo, table: &testing::Table) -> Option<u32> {
        testing::route_disaggregated::<PdPredicted>(request, table)
            .expect("a decision")
            .prefill
    }

    #[test]
    fn an_idle_decode_worker_prefills_itself() {
        assert_eq!(prefill_of(&testing::request(1, 8000), &fleet()), None);
    }

    #[test]
    fn a_decode_worker_busy_with_streams_sends_long_prompts_away() {
        let mut table = fleet();
        table.active_requests = vec![64, 0, 0];
        table.active_blocks = vec![2000, 0, 0];
        assert_eq!(prefill_of(&testing::request(1, 8000), &table), Some(1));
        // A short prompt stalls the streams little and has little to move.
        assert_eq!(prefill_of(&testing::request(1, 100), &table), None);
    }

    #[test]
    fn the_prefill_worker_with_the_shorter_way_wins() {
        let mut table = fleet();
        table.active_requests = vec![64, 1, 0];
        table.prefill_tokens = vec![0, 8000, 0];
        assert_eq!(prefill_of(&testing::request(1, 8000), &table), Some(2));
        // The prompt cached on prefill worker 1 outweighs its short queue.
        table.prefill_tokens = vec![0, 500, 0];
        table.overlap_device_blocks = vec![0, 125, 0];
        assert_eq!(prefill_of(&testing::request(1, 8000), &table), Some(1));
    }

    #[test]
    fn a_slow_link_keeps_prompts_local() {
        let mut table = fleet();
        table.active_requests = vec![64, 0, 0];
        testing::set_config("link_remote_gbps", "0.01");
        assert_eq!(prefill_of(&testing::request(1, 8000), &table), None);
        // Within a machine the fast link still pays.
        table.node = vec![7, 7, 0];
        assert_eq!(prefill_of(&testing::request(1, 8000), &table), Some(1));
    }

    #[test]
    fn the_answering_worker_is_chosen_with_its_way() {
        // Decode worker 0 idle, 1 busy with streams and holding most of the prompt: the busy
        // one would take the prompt locally only at the price of its streams' stall, so the
        // prompt goes remote there or to the idle worker locally, never locally on the busy one.
        let mut table = testing::table(3);
        table.roles = vec![role::LLM, role::LLM, role::PREFILL];
        table.active_requests = vec![0, 64, 0];
        table.active_blocks = vec![0, 2000, 0];
        let answer =
            testing::route_disaggregated::<PdPredicted>(&testing::request(3, 8000), &table).expect("a decision");
        assert!(
            answer.decision.worker == 0 || answer.prefill == Some(2),
            "worker {} prefill {:?}",
            answer.decision.worker,
            answer.prefill
        );
        assert_eq!(answer.decision.fallbacks, vec![1 - answer.decision.worker]);
    }

    #[test]
    fn without_prefill_workers_it_routes_as_predicted_ttft() {
        let table = testing::table(3);
        let answer =
            testing::route_disaggregated::<PdPredicted>(&testing::request(5, 4096), &table).expect("a decision");
        assert_eq!(answer.prefill, None);
    }
}
