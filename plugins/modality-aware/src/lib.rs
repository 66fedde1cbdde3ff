//! `modality-aware`: chooses the LLM worker and the encoders for a request's media together,
//! by the estimated time to first token of each pairing.
//!
//! For LLM worker `i` and, per media role the request needs (vision, audio), encoder `e`:
//!
//! - encode `= (queued_us[e] + encode_us[e]) / 1000` ms: the work already queued at the encoder
//!   plus this request's items it does not hold, from the reference cost curves (the host
//!   fills both; an encoder holding every item costs only its queue);
//! - transfer `= media_tokens · hidden · 2` bytes (f16 features) over `same_node_gbps` when
//!   `node[e] == node[i]` (and known, nonzero) else `cross_node_gbps`, in ms; the bytes of
//!   items the encoder holds cached still move;
//! - the LLM side is `predicted-ttft`'s cost for `i` (uncached prefill and the prefill queue,
//!   decode, impact; the same model file), with the media tokens counted in the prompt.
//!
//! Estimated TTFT of the pairing = the sum over roles of the least (encode + transfer) among
//! that role's encoders, plus the LLM side. The roles are summed, not maxed, which overstates a
//! request with both images and audio a little: their encoders run in parallel. The pair with
//! the lowest estimate wins: its worker, its encoder per role, and the next two workers as
//! fallbacks (the host places media itself on a fallback). A text-only request routes exactly
//! as `predicted-ttft` does, with its shortlist (config key `shortlist`). Settings: `hidden` (default 4096), `same_node_gbps` (600),
//! `cross_node_gbps` (50), and every `predicted-ttft` key.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, config, role};

use switchyard_ttft_model::{self as model, Model};

/// The policy.
pub struct ModalityAware;

/// How many next-best workers the decision names as fallbacks.
const FALLBACKS: usize = 2;

/// How the request's media features move: their size and the two link speeds, read once per
/// call (not once per worker and encoder pair).
struct Transfer {
    /// Bytes of the request's features (f16).
    bytes: f64,
    same_node_gbps: f64,
    cross_node_gbps: f64,
}

impl Transfer {
    fn new(req: &RequestInfo) -> Transfer {
        let hidden = config::get_f64("hidden", 4096.0).max(0.0);
        Transfer {
            bytes: f64::from(req.media_tokens) * hidden * 2.0,
            same_node_gbps: config::get_f64("same_node_gbps", 600.0),
            cross_node_gbps: config::get_f64("cross_node_gbps", 50.0),
        }
    }

    /// Milliseconds to move the features from encoder `e` to LLM worker `i`.
    fn ms(&self, workers: &WorkerTable, e: usize, i: usize) -> f64 {
        let same_node = workers.node[e] != 0 && workers.node[e] == workers.node[i];
        let gbps = if same_node {
            self.same_node_gbps
        } else {
            self.cross_node_gbps
        };
        self.bytes / (gbps.max(1e-9) * 1e9) * 1000.0
    }
}

/// The encoders of one media role: index and encode time in ms (queue plus this request's
/// items), in table order.
fn encoders_of(workers: &WorkerTable, media_role: u32) -> Vec<(usize, f64)> {
    (0..workers.len())
        .filter(|&e| workers.roles[e] == media_role)
        .map(|e| {
            (
                e,
                (f64::from(workers.queued_us[e]) + f64::from(workers.encode_us[e])) / 1000.0,
            )
        })
        .collect()
}

/// Among `encoders`, the one with the lowest encode + transfer time to worker `i`, and that time.
fn best_encoder(
    transfer: &Transfer,
    workers: &WorkerTable,
    encoders: &[(usize, f64)],
    i: usize,
) -> Option<(usize, f64)> {
    encoders
        .iter()
        .map(|&(e, encode)| (e, encode + transfer.ms(workers, e, i)))
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
}

impl Router for ModalityAware {
    const COLUMNS: Columns = switchyard_ttft_model::COLUMNS
        .union(Columns::NODE)
        .union(Columns::QUEUED_US)
        .union(Columns::ENCODE_US);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let model = Model::configured();
        let media_roles: Vec<u32> = [role::VISION, role::AUDIO]
            .into_iter()
            .filter(|r| req.media_tokens > 0 && workers.roles.contains(r))
            .collect();
        // Text alone is `predicted-ttft`'s decision, and its shortlist decides it the same way.
        if media_roles.is_empty()
            && model.shortlisted
            && let Some(shortlist) = model::shortlist(&model, req, workers)
        {
            let mut ranked: Vec<(bool, f64, usize, Vec<u32>)> = shortlist
                .candidates
                .iter()
                .map(|&i| {
                    let prediction = model.predict(req, workers, i as usize);
                    (prediction.overflows, prediction.cost, i as usize, Vec::new())
                })
                .collect();
            if let Some(pick) = model::rank(&mut ranked, req.request_id)
                && model::shortlist_decides(&ranked, shortlist.certain_below, FALLBACKS)
            {
                let mut decision = Decision::to(ranked[pick].2);
                decision.fallbacks = model::fallbacks(&ranked, pick, FALLBACKS);
                return Ok(decision);
            }
        }
        // (overflows, estimated cost, worker, encoders); ranked and tie-broken as predicted-ttft.
        let transfer = Transfer::new(req);
        let encoders_by_role: Vec<Vec<(usize, f64)>> = media_roles
            .iter()
            .map(|&media_role| encoders_of(workers, media_role))
            .collect();
        let mut ranked: Vec<(bool, f64, usize, Vec<u32>)> = workers
            .llm_indices()
            .map(|i| {
                let prediction = model.predict(req, workers, i);
                let mut cost = prediction.cost;
                let mut encoders = Vec::new();
                for role_encoders in &encoders_by_role {
                    if let Some((e, ms)) = best_encoder(&transfer, workers, role_encoders, i) {
                        cost += ms;
                        encoders.push(e as u32);
                    }
                }
                let cost = if cost.is_nan() { f64::INFINITY } else { cost };
                (prediction.overflows, cost, i, encoders)
            })
            .collect();
        let pick =
            model::rank(&mut ranked, req.request_id).ok_or_else(|| PolicyError::new("no LLM worker in the table"))?;
        let mut decision = Decision::to(ranked[pick].2);
        decision.encoders = core::mem::take(&mut ranked[pick].3);
        decision.fallbacks = model::fallbacks(&ranked, pick, FALLBACKS);
        Ok(decision)
    }
}

switchyard_policy_sdk::router!(ModalityAware);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::testing;

    /// Two LLM workers (0 on node 1, 1 on node 2) and two vision encoders (2 on node 1, 3 on node 2).
    fn table() -> testing::Table {
        let mut table = testing::table(4);
        table.roles = vec![role::LLM, role::LLM, role::VISION, role::VISION];
        table.node = vec![1, 2, 1, 2];
        table
    }

    fn media_request(media_tokens: u32) -> RequestInfo {
        let mut request = testing::request(7, 1024 + media_tokens);
        request.media_tokens = media_tokens;
        request
    }

    #[test]
    fn the_encoder_on_the_workers_node_wins_when_queues_are_even() {
        let mut table = table();
        table.encode_us = vec![0, 0, 10_000, 10_000];
        // Worker 1 has a little prefill queued, so worker 0 and its node's encoder 2 win.
        table.prefill_tokens = vec![0, 512, 0, 0];
        let decision = testing::route::<ModalityAware>(&media_request(5760), &table).expect("a decision");
        assert_eq!((decision.worker, decision.encoders.clone()), (0, vec![2]));
        assert_eq!(decision.fallbacks, vec![1]);
    }

    #[test]
    fn a_long_encoder_queue_moves_the_media_across_nodes() {
        let mut table = table();
        // Encoder 2 has 400 ms queued; crossing nodes costs 5760·4096·2 B / 50 GB/s ≈ 0.94 ms.
        table.queued_us = vec![0, 0, 400_000, 0];
        table.encode_us = vec![0, 0, 10_000, 10_000];
        let decision = testing::route::<ModalityAware>(&media_request(5760), &table).expect("a decision");
        assert_eq!(decision.encoders, vec![3]);
        let view = table.view();
        let request = media_request(5760);
        let cross = Transfer::new(&request).ms(&view, 3, 0);
        let same = Transfer::new(&request).ms(&view, 3, 1);
        assert!((cross - 5760.0 * 4096.0 * 2.0 / 50e9 * 1000.0).abs() < 1e-9, "{cross}");
        assert!(same < cross / 10.0, "{same} {cross}");
        assert_eq!(
            decision.worker, 1,
            "then the worker beside encoder 3 saves the transfer"
        );
    }

    #[test]
    fn a_text_request_routes_as_predicted_ttft_and_names_no_encoder() {
        let mut table = table();
        table.overlap_device_blocks = vec![0, 12, 0, 0];
        let request = testing::request(3, 1024);
        let decision = testing::route::<ModalityAware>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 1, "the cached prefix");
        assert!(decision.encoders.is_empty());
    }

    #[test]
    fn media_without_an_encoder_in_the_table_still_routes() {
        let mut table = testing::table(2);
        table.node = vec![1, 1];
        let decision = testing::route::<ModalityAware>(&media_request(576), &table).expect("a decision");
        assert!(decision.encoders.is_empty(), "the host places the media");
    }
}
