//! `cost-aware`: the cheapest worker predicted to meet the request's time-to-first-token
//! target; when none is, the fastest.
//!
//! Each LLM worker's TTFT is predicted with `predicted-ttft`'s model (the engines' step-time
//! polynomials, its queue, cache overlap and decoders), then scaled by the worker's own speed:
//! `speed = measured ITL / decode_ms(u)`, the gap between its streams' chunks that the gateway
//! measured (the `measured` import; matched by the `ids` column) over the decode step the model
//! expects at its KV usage. A worker twice as slow as the model (an older spot GPU) has its
//! prediction doubled; a worker not measured yet is taken at the model's speed (1). Workers
//! whose scaled TTFT is within `ttft-target-ms` are candidates and the one with the lowest
//! `cost` (per token; spot < reserved) wins, ties (within 1e-6) going to the lowest predicted
//! cost as `predicted-ttft` ranks it (so equal workers still share the load). A request
//! without a target takes every worker as a candidate, so it goes to the cheapest. When no
//! worker is predicted to meet the target, the lowest scaled TTFT wins. Fallbacks: the next two
//! in the same order.
//!
//! Settings: `predicted-ttft`'s coefficients (the same keys), and `target_margin` (default
//! 1.0): a worker is a candidate when its scaled TTFT is at most `target_margin` × the target
//! (below 1 keeps headroom).

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable};

#[path = "../../predicted-ttft/src/model.rs"]
#[allow(
    dead_code,
    reason = "shared with predicted-ttft, whose ranking helpers go unused here"
)]
mod model;
use model::Model;

/// The policy.
pub struct CostAware;

/// How many next-best workers the decision names as fallbacks.
const FALLBACKS: usize = 2;

/// Each worker's speed relative to the model (1 = as the model expects), from the measured
/// timings, index for index with the table.
fn speeds(model: &Model, workers: &WorkerTable, predictions: &[(usize, model::Prediction)]) -> Vec<f64> {
    let measured = switchyard_policy_sdk::measured::timings();
    predictions
        .iter()
        .map(|(i, prediction)| {
            let id = workers.ids.get(*i).copied();
            measured
                .iter()
                .find(|timing| Some(timing.id) == id && timing.itl_us > 0)
                .map_or(1.0, |timing| {
                    let expected_ms = prediction.decode_step_ms.max(model.decode_ms(0.0)).max(1e-3);
                    (f64::from(timing.itl_us) / 1000.0 / expected_ms).clamp(0.01, 100.0)
                })
        })
        .collect()
}

impl Router for CostAware {
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::IDS)
        .union(Columns::COST)
        .union(Columns::BLOCK_SIZE)
        .union(Columns::OVERLAP_DEVICE_BLOCKS)
        .union(Columns::OVERLAP_HOST_BLOCKS)
        .union(Columns::PREFILL_TOKENS)
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::ACTIVE_BLOCKS)
        .union(Columns::CAPACITY_BLOCKS);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let model = Model::from_config();
        let margin = switchyard_policy_sdk::config::get_f64("target_margin", 1.0);
        let predictions: Vec<(usize, model::Prediction)> = workers
            .llm_indices()
            .map(|i| (i, model.predict(req, workers, i)))
            .collect();
        if predictions.is_empty() {
            return Err(PolicyError::new("no LLM worker in the table"));
        }
        let speeds = speeds(&model, workers, &predictions);
        let target = f64::from(req.ttft_target_ms);
        // (meets the target, cost per token, scaled prediction, tie-break, index)
        let mut ranked: Vec<(bool, f64, f64, u64, usize)> = predictions
            .iter()
            .zip(&speeds)
            .map(|((i, prediction), speed)| {
                let ttft = prediction.ttft_ms * speed;
                let meets = target <= 0.0 || ttft <= target * margin;
                let price = f64::from(workers.cost.get(*i).copied().unwrap_or(1.0));
                let cost = if prediction.cost.is_finite() {
                    prediction.cost * speed
                } else {
                    f64::INFINITY
                };
                let tie = model::mix(req.request_id ^ (*i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                (meets, if meets { price } else { ttft }, cost, tie, *i)
            })
            .collect();
        // Meeting workers first, cheapest first; then the rest, fastest first. Prices equal
        // within 1e-6 are ranked by predicted cost, then by the request's hash.
        ranked.sort_by(|a, b| {
            b.0.cmp(&a.0)
                .then_with(|| {
                    if (a.1 - b.1).abs() <= 1e-6 * a.1.abs().max(b.1.abs()).max(1.0) {
                        core::cmp::Ordering::Equal
                    } else {
                        a.1.total_cmp(&b.1)
                    }
                })
                .then_with(|| a.2.total_cmp(&b.2))
                .then_with(|| a.3.cmp(&b.3))
        });
        let mut decision = Decision::to(ranked[0].4);
        decision.fallbacks = ranked.iter().skip(1).take(FALLBACKS).map(|r| r.4 as u32).collect();
        Ok(decision)
    }
}

switchyard_policy_sdk::router!(CostAware);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::measured::WorkerTiming;
    use switchyard_policy_sdk::testing;

    /// Worker 0: reserved (cost 1), as fast as the model; worker 1: spot (cost 0.4), measured
    /// ten times slower than the model.
    fn fleet() -> testing::Table {
        let mut table = testing::table(2);
        table.cost = alloc::vec![1.0, 0.4];
        let expected_us = (Model::default().decode_ms(0.0) * 1000.0) as u32;
        testing::set_timings(alloc::vec![
            WorkerTiming {
                id: 0,
                itl_us: expected_us,
                samples: 5
            },
            WorkerTiming {
                id: 1,
                itl_us: expected_us * 10,
                samples: 5
            },
        ]);
        table
    }

    fn route(target_ms: f32) -> u32 {
        let table = fleet();
        let mut request = testing::request(3, 512);
        request.ttft_target_ms = target_ms;
        testing::route::<CostAware>(&request, &table)
            .expect("a decision")
            .worker
    }

    #[test]
    fn the_cheap_worker_takes_what_it_can_meet() {
        // 512 tokens on an idle worker: one step, about 24 ms at the model's speed, 240 ms on
        // the spot worker measured ten times slower.
        assert_eq!(route(0.0), 1, "no target: the cheapest");
        assert_eq!(route(1000.0), 1, "a loose target the spot worker meets");
        assert_eq!(route(100.0), 0, "a target only the reserved worker meets");
        assert_eq!(route(1.0), 0, "a target nobody meets: the fastest");
    }

    #[test]
    fn an_unmeasured_worker_is_taken_at_the_models_speed() {
        let mut table = testing::table(2);
        table.cost = alloc::vec![1.0, 0.4];
        testing::set_timings(alloc::vec![]);
        let mut request = testing::request(3, 512);
        request.ttft_target_ms = 100.0;
        let decision = testing::route::<CostAware>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 1, "both meet it as far as is known: the cheaper");
        assert_eq!(decision.fallbacks, alloc::vec![0]);
    }
}
