//! `peer-sglang`: the SGLang model gateway's `cache_aware` policy, re-implemented as a
//! Switchyard router so that it can be replayed beside ours (`switchyard-bench compare`).
//!
//! Source: sgl-project/sglang, `sgl-router/src/policies/cache_aware.rs` (commit 026f853b) and
//! its approximate tree `sgl-router/src/policies/tree.rs` (4d40eec0); defaults as the router's
//! command line and `sglang_router.router_args` give them (0129b029, 083d6013). The algorithm:
//!
//! - Load is the router's own count of requests in flight per worker (here the
//!   `active-requests` column, the gateway's count). The fleet is imbalanced when
//!   `max − min > balance_abs_threshold` and `max > balance_rel_threshold · min`; then the
//!   request goes to the least-loaded worker (the first of them).
//! - Otherwise the prompt is matched against the router's approximate tree of what it sent
//!   each worker: `match rate = matched / prompt length`; above `cache_threshold` the request
//!   goes to a worker holding the deepest match, else to the worker with the smallest tree
//!   (the most room), the first of them.
//! - Either way the prompt is then inserted in the chosen worker's tree; each worker's tree
//!   is bounded by `max_tree_size`, least recently used first.
//!
//! Defaults: `cache_threshold` 0.3, `balance_abs_threshold` 64, `balance_rel_threshold` 1.5,
//! `max_tree_size` 2²⁶ characters per worker.
//!
//! What differs, and why: SGLang's tree is over the prompt's characters; this one is over the
//! gateway's chained KV-block hashes (the `prompt` import, 64 tokens per block in the
//! benchmarks), so matches are counted in whole blocks and the tree size in tokens (2²⁶
//! characters taken as 2²⁴ tokens, at ~4 characters a token). SGLang takes the first tenant
//! of the deepest node in its map's order; here ties are broken by a hash of the request id.
//! SGLang evicts every 120 s; here a worker's oldest blocks go as soon as its tree is over the
//! bound, which is also held within the policy sandbox's memory (32 MiB by default:
//! `PrefixIndex::MEMORY_BLOCKS` blocks over all workers, 1.6 M tokens each of 8 at 64 tokens a
//! block, where SGLang's 2²⁶ characters would be ~16 M tokens). The tree lives in the policy instance: one per gateway thread, lost when the
//! instance is replaced (as one SGLang router replica sees only its own traffic).

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::prefix_index::PrefixIndex;
use switchyard_policy_sdk::state::Kept;
use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, config, mix, prompt};

/// The policy.
pub struct PeerSglang;

/// The router's settings (config keys in the crate docs).
#[derive(Clone, Copy)]
struct Settings {
    cache_threshold: f64,
    balance_abs_threshold: f64,
    balance_rel_threshold: f64,
    max_tree_tokens: f64,
}

static SETTINGS: config::Derived<Settings> = config::Derived::new();

/// What this instance sent where.
static TREE: Kept<PrefixIndex> = Kept::new();

impl Router for PeerSglang {
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::IDS)
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::BLOCK_SIZE);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let settings = SETTINGS.get_or_init(|| Settings {
            cache_threshold: config::get_f64("cache_threshold", 0.3),
            balance_abs_threshold: config::get_f64("balance_abs_threshold", 64.0),
            balance_rel_threshold: config::get_f64("balance_rel_threshold", 1.5),
            // 2^26 characters at ~4 characters a token.
            max_tree_tokens: config::get_f64("max_tree_size", 67_108_864.0) / 4.0,
        });
        let llm: Vec<usize> = workers.llm_indices().collect();
        let (Some(&first), true) = (llm.first(), workers.ids.len() >= workers.len()) else {
            return Err(PolicyError::new("no LLM worker in the table"));
        };
        let load = |i: usize| workers.active_requests[i];
        let (min, max) = llm
            .iter()
            .fold((u32::MAX, 0), |(min, max), &i| (min.min(load(i)), max.max(load(i))));
        let imbalanced = f64::from(max - min) > settings.balance_abs_threshold
            && f64::from(max) > settings.balance_rel_threshold * f64::from(min);
        let block_size = workers.block_size[first].max(1);
        let hashes = prompt::block_hashes();
        // SGLang's bound, within what the sandbox's memory holds (shared evenly).
        let capacity = ((settings.max_tree_tokens / f64::from(block_size)).max(1.0) as usize)
            .min(PrefixIndex::MEMORY_BLOCKS / llm.len());
        let pick = TREE.with(
            || PrefixIndex::new(capacity),
            |tree| {
                tree.set_capacity(capacity);
                let pick = if imbalanced {
                    shortest_queue(&llm, load)
                } else {
                    cache_aware(req, workers, &llm, tree, &hashes, settings.cache_threshold, block_size)
                };
                tree.insert(&hashes, workers.ids[pick]);
                pick
            },
        );
        Ok(Decision::to(pick))
    }
}

/// The first LLM worker with the fewest requests in flight.
fn shortest_queue(llm: &[usize], load: impl Fn(usize) -> u32) -> usize {
    let mut best = llm[0];
    for &i in llm {
        if load(i) < load(best) {
            best = i;
        }
    }
    best
}

/// The balanced case: the deepest match if the match rate passes `threshold`, else the worker
/// with the smallest tree.
fn cache_aware(
    req: &RequestInfo,
    workers: &WorkerTable,
    llm: &[usize],
    tree: &PrefixIndex,
    hashes: &[u64],
    threshold: f64,
    block_size: u32,
) -> usize {
    let matches = tree.matches(hashes);
    let matched = |i: usize| {
        matches
            .binary_search_by_key(&workers.ids[i], |&(id, _)| id)
            .map_or(0, |at| matches[at].1)
    };
    let deepest = llm.iter().map(|&i| matched(i)).max().unwrap_or(0);
    let rate = if req.prompt_tokens == 0 {
        0.0
    } else {
        f64::from(deepest) * f64::from(block_size) / f64::from(req.prompt_tokens)
    };
    if deepest > 0 && rate > threshold {
        let holders: Vec<usize> = llm.iter().copied().filter(|&i| matched(i) == deepest).collect();
        return holders[(mix(req.request_id) % holders.len() as u64) as usize];
    }
    let mut smallest = llm[0];
    for &i in llm {
        if tree.size(workers.ids[i]) < tree.size(workers.ids[smallest]) {
            smallest = i;
        }
    }
    smallest
}

switchyard_policy_sdk::router!(PeerSglang);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::testing;

    fn route(table: &testing::Table, id: u64, hashes: &[u64]) -> u32 {
        testing::set_prompt(hashes.to_vec());
        let request = testing::request(id, 64 * hashes.len() as u32);
        testing::route::<PeerSglang>(&request, table)
            .expect("a decision")
            .worker
    }

    #[test]
    fn a_shared_prefix_follows_the_worker_it_went_to_until_the_load_is_imbalanced() {
        let mut table = testing::table(3);
        // Empty trees: the smallest (the first) takes the first prompt, then the next prompt
        // with nothing in common goes to the next smallest tree.
        let first = route(&table, 1, &[1, 2, 3, 4]);
        let other = route(&table, 2, &[9, 8]);
        assert_ne!(first, other);
        // Three of four blocks shared (rate 0.75 > 0.3): the worker that holds them.
        assert_eq!(route(&table, 3, &[1, 2, 3, 7]), first);
        // One block of four (0.25): not enough, the smallest tree takes it.
        let third = route(&table, 4, &[1, 5, 6, 7]);
        assert_ne!(third, first);
        // Imbalanced (100 − 0 > 64 and 100 > 1.5 · 0): the least loaded, whatever is cached.
        table.active_requests = vec![0, 0, 0];
        table.active_requests[first as usize] = 100;
        let idle = route(&table, 5, &[1, 2, 3, 4]);
        assert_ne!(idle, first);
        assert_eq!(table.active_requests[idle as usize], 0);
    }
}
