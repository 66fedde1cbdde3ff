//! `peer-llm-d`: llm-d's default scheduling profile, re-implemented as a Switchyard router so
//! that it can be replayed beside ours (`switchyard-bench compare`).
//!
//! Source: the endpoint picker (EPP) of kubernetes-sigs/gateway-api-inference-extension, now
//! llm-d/llm-d-inference-scheduler: the prefix-cache scorer
//! (`pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go`, `indexer.go`, commit
//! 13aaa325), the queue and KV-cache-utilization scorers and the max-score picker (00913f92);
//! the default profile's weights from llm-d-inference-scheduler's chart
//! (`config/charts/epplib/templates/_config.yaml`, 520af478) and llm-d's
//! inference-scheduling guide (086f217d): queue 2, KV-cache utilization 2, prefix cache 3.
//!
//! - Queue scorer: `(max − q) / (max − min)` over the candidates, 1 for all when they are
//!   equal, with `q` the worker's waiting queue.
//! - KV-cache-utilization scorer: `1 − KV usage`.
//! - Prefix-cache scorer ("approximate" mode): the prompt cut in blocks with chained hashes,
//!   at most `maxPrefixBlocksToMatch` blocks; a worker's score is the blocks it holds
//!   consecutively from the first, over the prompt's blocks, in an index the scheduler fills
//!   itself: after each pick the chosen worker gets all of the request's blocks, each worker
//!   keeping at most `lruCapacityPerServer` blocks, least recently used first.
//! - The picker takes the highest `Σ weight · score`, ties at random.
//!
//! Defaults: `queue_weight` 2, `kv_cache_weight` 2, `prefix_weight` 3; the prefix scorer's
//! blocks are 64 bytes of prompt, at most 256 of them (16 KiB), and 31,250 per worker, taken
//! here at ~4 bytes a token: `max_prefix_tokens` 4,096 and `lru_capacity_tokens` 500,000.
//!
//! What differs, and why: the EPP hashes the prompt's bytes; this router has the gateway's
//! chained KV-block hashes (the `prompt` import, 64 tokens a block in the benchmarks), so it
//! matches whole blocks of that size up to the same prompt length. The EPP's queue is vLLM's
//! scraped waiting queue; the gateway's table has no waiting count, and this router takes the
//! `prefill-tokens` column (prompt tokens routed and not answered yet), which the min-max
//! normalisation makes comparable. Random ties are a hash of the request id. The index lives
//! in the policy instance (one per gateway thread; lost when the instance is replaced), as
//! each EPP replica keeps its own.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use switchyard_policy_sdk::prefix_index::PrefixIndex;
use switchyard_policy_sdk::state::Kept;
use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, config, mix, prompt};

/// The policy.
pub struct PeerLlmD;

/// The profile's settings (config keys in the crate docs).
#[derive(Clone, Copy)]
struct Settings {
    queue_weight: f64,
    kv_cache_weight: f64,
    prefix_weight: f64,
    max_prefix_tokens: f64,
    lru_capacity_tokens: f64,
}

static SETTINGS: config::Derived<Settings> = config::Derived::new();

/// What this instance sent where.
static INDEX: Kept<PrefixIndex> = Kept::new();

impl Router for PeerLlmD {
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::IDS)
        .union(Columns::PREFILL_TOKENS)
        .union(Columns::ACTIVE_BLOCKS)
        .union(Columns::CAPACITY_BLOCKS)
        .union(Columns::BLOCK_SIZE);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let settings = SETTINGS.get_or_init(|| Settings {
            queue_weight: config::get_f64("queue_weight", 2.0),
            kv_cache_weight: config::get_f64("kv_cache_weight", 2.0),
            prefix_weight: config::get_f64("prefix_weight", 3.0),
            max_prefix_tokens: config::get_f64("max_prefix_tokens", 4096.0),
            lru_capacity_tokens: config::get_f64("lru_capacity_tokens", 500_000.0),
        });
        let Some(first) = workers.llm_indices().next() else {
            return Err(PolicyError::new("no LLM worker in the table"));
        };
        let block_size = f64::from(workers.block_size[first].max(1));
        let mut hashes = prompt::block_hashes();
        hashes.truncate((settings.max_prefix_tokens / block_size).max(0.0) as usize);
        let llm_workers = workers.llm_indices().count();
        let capacity = ((settings.lru_capacity_tokens / block_size).max(1.0) as usize)
            .min(PrefixIndex::MEMORY_BLOCKS / llm_workers);
        let (min_queue, max_queue) = workers.llm_indices().fold((u32::MAX, 0), |(min, max), i| {
            (min.min(workers.prefill_tokens[i]), max.max(workers.prefill_tokens[i]))
        });
        let pick = INDEX.with(
            || PrefixIndex::new(capacity),
            |index| {
                index.set_capacity(capacity);
                let matches = index.matches(&hashes);
                let score = |i: usize| {
                    let queue = if max_queue == min_queue {
                        1.0
                    } else {
                        f64::from(max_queue - workers.prefill_tokens[i]) / f64::from(max_queue - min_queue)
                    };
                    let capacity = f64::from(workers.capacity_blocks[i]);
                    let usage = if capacity > 0.0 {
                        f64::from(workers.active_blocks[i]) / capacity
                    } else {
                        0.0
                    };
                    let matched = matches
                        .binary_search_by_key(&workers.ids[i], |&(id, _)| id)
                        .map_or(0, |at| matches[at].1);
                    let prefix = if hashes.is_empty() {
                        0.0
                    } else {
                        f64::from(matched) / hashes.len() as f64
                    };
                    settings.queue_weight * queue.clamp(0.0, 1.0)
                        + settings.kv_cache_weight * (1.0 - usage).clamp(0.0, 1.0)
                        + settings.prefix_weight * prefix.clamp(0.0, 1.0)
                };
                // The highest score; ties at random (a hash of the request and the worker).
                let pick = workers
                    .llm_indices()
                    .map(|i| (score(i), mix(req.request_id ^ u64::from(workers.ids[i])), i))
                    .max_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
                    .map_or(first, |(_, _, i)| i);
                index.insert(&hashes, workers.ids[pick]);
                pick
            },
        );
        Ok(Decision::to(pick))
    }
}

switchyard_policy_sdk::router!(PeerLlmD);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::testing;

    fn route(table: &testing::Table, id: u64, hashes: &[u64]) -> u32 {
        testing::set_prompt(hashes.to_vec());
        let request = testing::request(id, 64 * hashes.len() as u32);
        testing::route::<PeerLlmD>(&request, table).expect("a decision").worker
    }

    #[test]
    fn the_prefix_weighs_against_queue_and_memory() {
        let mut table = testing::table(2);
        let first = route(&table, 1, &[1, 2, 3, 4]) as usize;
        let other = 1 - first;
        // Same prompt, equal queues: 3 (the full prefix) + 2 + 2 against 0 + 2 + 2.
        assert_eq!(route(&table, 2, &[1, 2, 3, 4]) as usize, first);
        // A queue on the holder: its queue score drops to 0 (min-max), 3 + 0 + 2 = 5 still
        // beats 0 + 2 + 2 = 4.
        table.prefill_tokens[first] = 5_000;
        assert_eq!(route(&table, 3, &[1, 2, 3, 4]) as usize, first);
        // With 60 % of its KV memory used as well: 3 + 0 + 2 · 0.4 = 3.8 against 4.
        table.capacity_blocks = vec![1000, 1000];
        table.active_blocks[first] = 600;
        assert_eq!(route(&table, 4, &[1, 2, 3, 4]) as usize, other);
    }
}
