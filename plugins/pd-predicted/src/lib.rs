//! `pd-predicted`: prefill/decode disaggregation decided by predicted latency.
//!
//! The answering (decode) worker `d` is `predicted-ttft`'s choice among the LLM workers. Then,
//! with `predicted-ttft`'s step-time model (its keys tune it here too) and `D` the decode
//! worker's requests in flight:
//!
//! - **Local**: the time to first token prefilling on `d` (its queue, then the prompt's tokens
//!   `d` has not cached, beside its `D` decoders), plus the stall that prefill inflicts on `d`'s
//!   running streams (`predicted-ttft`'s interference term: each step carrying prompt tokens is
//!   a slow step for all `D` of them) times `stall_weight` (default 0.05: a stream's stall costs
//!   a twentieth of what this request's own wait does, as a ms of stall spread over a long
//!   answer moves its mean inter-token latency little).
//! - **Remote**, for each prefill worker `p`: its queue and the prompt's tokens it has not
//!   cached (no decoders ride along on a prefill worker), plus moving the full blocks `d` lacks
//!   (`kv_block_bytes` each over `link_local_gbps` within a machine, `link_remote_gbps` across
//!   machines), plus `d` computing what the blocks do not cover (the last partial block) behind
//!   its own queue, beside its decoders, and the (smaller) stall that step causes, priced alike.
//!
//! The prompt goes to the prefill worker of least remote time when that beats local; a decode
//! worker with no decoders suffers no stall, so an idle one always prefills locally (moving
//! blocks only adds time), and a short or cached prompt has nothing worth moving.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use switchyard_policy_sdk::{
    Columns, Decision, DisaggregatedDecision, PolicyError, RequestInfo, Router, WorkerTable, config,
};
use switchyard_ttft_model::disagg::{self, Link};
use switchyard_ttft_model::{self as model, Model};

/// The policy.
pub struct PdPredicted;

/// How many next-best decode workers the decision names as fallbacks.
const FALLBACKS: usize = 2;

fn at(column: &[u32], i: usize) -> f64 {
    column.get(i).copied().map_or(0.0, f64::from)
}

/// The price of a millisecond of stall on the decode worker's streams, in milliseconds of
/// this request's time to first token.
fn stall_weight() -> f64 {
    static WEIGHT: config::Derived<f64> = config::Derived::new();
    WEIGHT.get_or_init(|| config::get_f64("stall_weight", 0.05))
}

/// The predicted times of a request's two ways to its first token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ways {
    /// Prefilling on the decode worker, with the stall it causes priced in.
    pub local_ms: f64,
    /// Through the best prefill worker, its index and time; `None` without prefill workers.
    pub remote: Option<(usize, f64)>,
}

/// Predicts both ways for `req` answered by worker `d`.
pub fn ways(model: &Model, link: &Link, req: &RequestInfo, workers: &WorkerTable, d: usize) -> Ways {
    let local = model.predict(req, workers, d);
    let local_ms = local.ttft_ms + stall_weight() * local.interference_ms;
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
    let missing = disagg::missing_blocks(req, workers, d);
    let remote = workers
        .prefill_indices()
        .map(|p| {
            let prefill_ms = model.first_token_ms(
                at(workers.prefill_tokens, p),
                disagg::uncached_tokens(req, workers, p),
                0.0,
            );
            let transfer_ms = link.transfer_ms(missing, disagg::same_node(workers, d, p));
            (p, prefill_ms + transfer_ms + tail_ms)
        })
        .filter(|(_, ms)| !ms.is_nan())
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    Ways { local_ms, remote }
}

impl Router for PdPredicted {
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::BLOCK_SIZE)
        .union(Columns::OVERLAP_DEVICE_BLOCKS)
        .union(Columns::OVERLAP_HOST_BLOCKS)
        .union(Columns::PREFILL_TOKENS)
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::ACTIVE_BLOCKS)
        .union(Columns::CAPACITY_BLOCKS)
        .union(Columns::NODE);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        model::choose(&Model::configured(), req, workers, FALLBACKS)
    }

    fn route_disaggregated(req: &RequestInfo, workers: &WorkerTable) -> Result<DisaggregatedDecision, PolicyError> {
        let model = Model::configured();
        let decision = model::choose(&model, req, workers, FALLBACKS)?;
        let ways = ways(&model, &Link::configured(), req, workers, decision.worker as usize);
        let prefill = ways
            .remote
            .filter(|&(_, remote_ms)| remote_ms < ways.local_ms)
            .map(|(p, _)| p as u32);
        Ok(DisaggregatedDecision { decision, prefill })
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
    fn without_prefill_workers_it_routes_as_predicted_ttft() {
        let table = testing::table(3);
        let answer =
            testing::route_disaggregated::<PdPredicted>(&testing::request(5, 4096), &table).expect("a decision");
        assert_eq!(answer.prefill, None);
    }
}
