//! `peer-aibrix`: AIBrix's `prefix-cache` routing, re-implemented as a Switchyard router so
//! that it can be replayed beside ours (`switchyard-bench compare`).
//!
//! Source: vllm-project/aibrix, `pkg/plugins/gateway/algorithms/prefix_cache.go` with
//! `least_request.go` and the prefix-cache indexer (`pkg/utils/prefixcacheindexer/hash.go`,
//! `pkg/utils/lrustore/lru_store.go`), commit e3e10f9e. The algorithm:
//!
//! - Load is the gateway's count of requests running on each pod (here the
//!   `active-requests` column). When `max − min > imbalance_abs_count`, prefix matching is
//!   restricted to the pods at the minimum.
//! - The prompt's blocks are walked from the first: at block `i` every pod still holding
//!   every block so far gets a match of `(i + 1) · 100 / blocks` percent (integer).
//! - The matched pods are ordered by match percent, descending, then running requests,
//!   ascending (ties at random), and the first whose running requests are at most
//!   `mean + std_dev_factor · σ` (the mean and the sample standard deviation over all pods)
//!   takes the request.
//! - Otherwise (no match, or none passes): the pod with the fewest running requests, ties at
//!   random.
//! - After the pick, all of the prompt's blocks are added for the chosen pod to an index of
//!   at most `AIBRIX_PREFIX_CACHE_BLOCK_NUMBER` blocks over all pods, least recently used
//!   first.
//!
//! Defaults (the code's, which differ from its README's): `imbalance_abs_count` 8,
//! `std_dev_factor` 1, an index of 200,000 blocks of 4 bytes (the default character
//! tokenizer), taken here at ~4 bytes a token: `index_capacity_tokens` 200,000.
//!
//! What differs, and why: AIBrix hashes blocks of 4 prompt bytes; this router has the
//! gateway's chained KV-block hashes (the `prompt` import, 64 tokens a block in the
//! benchmarks), so it matches in whole blocks of that size. AIBrix also expires blocks 20
//! minutes after they were added; that is longer than the benchmark runs and not done here.
//! Random ties are a hash of the request id. The index lives in the policy instance (one per
//! gateway thread; lost when the instance is replaced).

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::prefix_index::PrefixIndex;
use switchyard_policy_sdk::state::Kept;
use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, config, mix, prompt};

/// The policy.
pub struct PeerAibrix;

/// The router's settings (config keys in the crate docs).
#[derive(Clone, Copy)]
struct Settings {
    imbalance_abs_count: f64,
    std_dev_factor: f64,
    index_capacity_tokens: f64,
}

static SETTINGS: config::Derived<Settings> = config::Derived::new();

/// What this instance sent where.
static INDEX: Kept<PrefixIndex> = Kept::new();

impl Router for PeerAibrix {
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::IDS)
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::BLOCK_SIZE);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let settings = SETTINGS.get_or_init(|| Settings {
            imbalance_abs_count: config::get_f64("imbalance_abs_count", 8.0),
            std_dev_factor: config::get_f64("std_dev_factor", 1.0),
            index_capacity_tokens: config::get_f64("index_capacity_tokens", 200_000.0),
        });
        let pods: Vec<usize> = workers.llm_indices().collect();
        let Some(&first) = pods.first() else {
            return Err(PolicyError::new("no LLM worker in the table"));
        };
        let running = |i: usize| workers.active_requests[i];
        let tie = |i: usize| mix(req.request_id ^ u64::from(workers.ids[i]));
        let (min, max) = pods.iter().fold((u32::MAX, 0), |(min, max), &i| {
            (min.min(running(i)), max.max(running(i)))
        });
        let imbalanced = f64::from(max - min) > settings.imbalance_abs_count;
        let count = pods.len() as f64;
        let mean = pods.iter().map(|&i| f64::from(running(i))).sum::<f64>() / count;
        let variance = if pods.len() > 1 {
            pods.iter()
                .map(|&i| {
                    let gap = f64::from(running(i)) - mean;
                    gap * gap
                })
                .sum::<f64>()
                / (count - 1.0)
        } else {
            0.0
        };
        let limit = mean + settings.std_dev_factor * libm_sqrt(variance);
        let hashes = prompt::block_hashes();
        let block_size = f64::from(workers.block_size[first].max(1));
        let capacity =
            ((settings.index_capacity_tokens / block_size).max(1.0) as usize).min(PrefixIndex::MEMORY_BLOCKS);
        let pick = INDEX.with(
            || PrefixIndex::shared(capacity),
            |index| {
                index.set_capacity(capacity);
                let matches = index.matches(&hashes);
                let blocks = hashes.len().max(1) as u32;
                // (match percent, running, tie, pod) of the pods that may match.
                let mut matched: Vec<(u32, u32, u64, usize)> = pods
                    .iter()
                    .copied()
                    .filter(|&i| !imbalanced || running(i) == min)
                    .filter_map(|i| {
                        let at = matches.binary_search_by_key(&workers.ids[i], |&(id, _)| id).ok()?;
                        Some((matches[at].1 * 100 / blocks, running(i), tie(i), i))
                    })
                    .filter(|m| m.0 > 0)
                    .collect();
                matched.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
                let pick = matched
                    .iter()
                    .find(|m| f64::from(m.1) <= limit)
                    .map(|m| m.3)
                    .unwrap_or_else(|| {
                        // The least running requests, ties at random.
                        pods.iter()
                            .copied()
                            .min_by_key(|&i| (running(i), tie(i)))
                            .unwrap_or(first)
                    });
                index.insert(&hashes, workers.ids[pick]);
                pick
            },
        );
        Ok(Decision::to(pick))
    }
}

/// `√x` for `x ≥ 0` without std: Newton's iteration from a bit-level first guess.
fn libm_sqrt(x: f64) -> f64 {
    if x <= 0.0 || !x.is_finite() {
        return if x.is_finite() { 0.0 } else { x };
    }
    let mut y = f64::from_bits((x.to_bits() >> 1) + (1023u64 << 51));
    for _ in 0..6 {
        y = 0.5 * (y + x / y);
    }
    y
}

switchyard_policy_sdk::router!(PeerAibrix);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::testing;

    fn route(table: &testing::Table, id: u64, hashes: &[u64]) -> u32 {
        testing::set_prompt(hashes.to_vec());
        let request = testing::request(id, 64 * hashes.len() as u32);
        testing::route::<PeerAibrix>(&request, table)
            .expect("a decision")
            .worker
    }

    #[test]
    fn matched_pods_win_within_the_load_limit() {
        let mut table = testing::table(3);
        table.active_requests = vec![2, 2, 2];
        let first = route(&table, 1, &[1, 2, 3]) as usize;
        assert_eq!(route(&table, 2, &[1, 2, 9]) as usize, first, "a 66 % match");
        // The holder now runs more than mean + σ: loads 6, 2, 2 give 3.33 + 2.31 = 5.64.
        table.active_requests = vec![2, 2, 2];
        table.active_requests[first] = 6;
        let elsewhere = route(&table, 3, &[1, 2, 3]) as usize;
        assert_ne!(elsewhere, first);
        // Imbalanced (12 − 2 > 8): only the least loaded pods may match; the one that took
        // the last request holds the prompt now.
        table.active_requests[first] = 12;
        assert_eq!(route(&table, 4, &[1, 2, 3]) as usize, elsewhere);
    }

    #[test]
    fn square_root_is_accurate() {
        for x in [0.0, 1e-9, 0.25, 2.0, 5.33, 1e12] {
            let root = libm_sqrt(x);
            assert!((root * root - x).abs() <= 1e-12 * x.max(1e-300), "{x}: {root}");
        }
    }
}

#[cfg(test)]
mod stress {
    use super::*;
    use switchyard_policy_sdk::testing;

    #[test]
    fn long_prompts_with_shared_prefixes_never_panic() {
        let mut table = testing::table(8);
        let mut state = 1u64;
        for id in 0..3000u64 {
            state = mix(state);
            let conversation = state % 40;
            let len = 50 + (mix(state) % 400) as u64;
            let hashes: Vec<u64> = (0..len).map(|b| mix(conversation * 1_000_003 + b)).collect();
            for i in 0..8 {
                table.active_requests[i] = (mix(state ^ i as u64) % 30) as u32;
            }
            testing::set_prompt(hashes);
            let request = testing::request(id, 64 * len as u32);
            testing::route::<PeerAibrix>(&request, &table).expect("a decision");
        }
    }
}
