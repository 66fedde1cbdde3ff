//! `load-based`: Dynamo's load-based planner, as its planner documentation describes it, as a
//! Wasm policy.
//!
//! Every adjustment interval, per pool, from the interval that just ended (the last of
//! `recent`):
//!
//! - Decode and aggregated pools follow KV-cache usage: one worker more above
//!   `decode_kv_scale_up_threshold` (0.9), one fewer below `decode_kv_scale_down_threshold`
//!   (0.5).
//! - Prefill pools follow queue utilization, `prefill-queue-tokens / (ready ×
//!   prefill-capacity-tokens)`: the pending prefill work over what the ready workers prefill
//!   in one interval (Dynamo's documentation leaves it undefined). One more above
//!   `prefill_queue_scale_up_threshold` (0.5), one fewer below
//!   `prefill_queue_scale_down_threshold` (0.2) — but no scale-up when the interval's trend
//!   (the change since the interval before) projects the utilization under the up threshold
//!   within `queue_buffer_intervals` (3) intervals: the queue is draining on its own.
//! - At most ±1 worker per pool per interval; no scale-down in the `grace_intervals` (3)
//!   intervals after the pool grew (a new worker's cache is still warming); a pool with
//!   workers still starting or draining holds (Dynamo blocks adjustment while one is under
//!   way); sizes stay within `min-workers..=max-workers`; scale-ups stop where the fleet would
//!   pass `max-gpus` (downs are counted first, so one pool's release can fund another's add).
//! - Encoder pools and pools with no interval yet hold.
//!
//! The host fills each pool's figures from its own workers (a prefill pool's queue is the
//! prompt tokens sent to its prefill workers and not computed yet; a decode pool's KV usage is
//! its decode workers'), so a prefill pool and a decode pool of one model move each by its own
//! rule, in opposite directions when the load asks (long prompts with short answers, or the
//! converse).
//!
//! Every threshold is a config key of the same name.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::format;
use alloc::vec::Vec;

use switchyard_policy_sdk::{Planner, PolicyError, Pool, PoolRole, ScaleDecision};

/// The policy.
pub struct LoadBased;

/// The thresholds, from the policy's config.
struct Rules {
    kv_up: f64,
    kv_down: f64,
    queue_up: f64,
    queue_down: f64,
    grace: u32,
    buffer: f64,
}

impl Rules {
    fn from_config() -> Rules {
        let get = switchyard_policy_sdk::config::get_f64;
        Rules {
            kv_up: get("decode_kv_scale_up_threshold", 0.9),
            kv_down: get("decode_kv_scale_down_threshold", 0.5),
            queue_up: get("prefill_queue_scale_up_threshold", 0.5),
            queue_down: get("prefill_queue_scale_down_threshold", 0.2),
            grace: get("grace_intervals", 3.0).clamp(0.0, 1000.0) as u32,
            buffer: get("queue_buffer_intervals", 3.0).clamp(0.0, 1000.0),
        }
    }
}

/// Queue utilization of one interval of `pool`.
fn queue_utilization(pool: &Pool, queue_tokens: f32) -> f64 {
    let capacity = f64::from(pool.ready.max(1)) * f64::from(pool.prefill_capacity_tokens);
    if capacity > 0.0 {
        f64::from(queue_tokens) / capacity
    } else {
        0.0
    }
}

/// +1, −1 or 0 for `pool` by the rules, with the reason.
fn step(pool: &Pool, rules: &Rules) -> (i32, &'static str) {
    let Some(last) = pool.recent.last() else {
        return (0, "no interval observed yet");
    };
    if pool.starting > 0 || pool.draining > 0 {
        return (0, "a scaling action is under way");
    }
    let in_grace = pool.intervals_since_scale_up < rules.grace;
    match pool.role {
        PoolRole::Encoder => (0, "encoder pools are not planned"),
        PoolRole::Decode | PoolRole::Aggregated => {
            let usage = f64::from(last.kv_usage);
            if usage > rules.kv_up {
                (1, "kv usage above the scale-up threshold")
            } else if usage < rules.kv_down && !in_grace {
                (-1, "kv usage below the scale-down threshold")
            } else if usage < rules.kv_down {
                (0, "kv usage low, but a worker was added recently")
            } else {
                (0, "kv usage within thresholds")
            }
        }
        PoolRole::Prefill => {
            let now = queue_utilization(pool, last.prefill_queue_tokens);
            if now > rules.queue_up {
                let before = pool
                    .recent
                    .len()
                    .checked_sub(2)
                    .and_then(|i| pool.recent.get(i))
                    .map_or(now, |previous| queue_utilization(pool, previous.prefill_queue_tokens));
                let projected = now + (now - before) * rules.buffer;
                if projected < rules.queue_up {
                    (0, "queue high, but its trend drains it within the buffer")
                } else {
                    (1, "queue utilization above the scale-up threshold")
                }
            } else if now < rules.queue_down && !in_grace {
                (-1, "queue utilization below the scale-down threshold")
            } else {
                (0, "queue utilization within thresholds")
            }
        }
    }
}

impl Planner for LoadBased {
    fn plan(pools: &[Pool], max_gpus: u32) -> Result<Vec<ScaleDecision>, PolicyError> {
        let rules = Rules::from_config();
        let steps: Vec<(i32, &str)> = pools.iter().map(|pool| step(pool, &rules)).collect();
        let mut decisions = Vec::new();
        let mut gpus: u64 = pools
            .iter()
            .map(|pool| u64::from(pool.desired) * u64::from(pool.gpus_per_worker))
            .sum();
        // Downs first: what they release may fund another pool's add.
        for (index, (pool, (delta, reason))) in pools.iter().zip(&steps).enumerate() {
            if *delta < 0 && pool.desired > pool.min_workers {
                gpus = gpus.saturating_sub(u64::from(pool.gpus_per_worker));
                decisions.push(ScaleDecision {
                    pool: index as u32,
                    replicas: pool.desired - 1,
                    reason: (*reason).into(),
                });
            }
        }
        for (index, (pool, (delta, reason))) in pools.iter().zip(&steps).enumerate() {
            if *delta <= 0 {
                continue;
            }
            if pool.desired >= pool.max_workers {
                switchyard_policy_sdk::log::write(
                    switchyard_policy_sdk::log::Level::Info,
                    &format!(
                        "pool {} ({:?}) wants a worker but is at its maximum",
                        pool.model, pool.role
                    ),
                );
                continue;
            }
            let need = u64::from(pool.gpus_per_worker);
            if max_gpus > 0 && gpus + need > u64::from(max_gpus) {
                switchyard_policy_sdk::log::write(
                    switchyard_policy_sdk::log::Level::Info,
                    &format!(
                        "pool {} ({:?}) wants a worker but the GPU budget is spent",
                        pool.model, pool.role
                    ),
                );
                continue;
            }
            gpus += need;
            decisions.push(ScaleDecision {
                pool: index as u32,
                replicas: pool.desired + 1,
                reason: (*reason).into(),
            });
        }
        Ok(decisions)
    }
}

switchyard_policy_sdk::planner!(LoadBased);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::IntervalStats;

    fn interval(kv_usage: f32, queue: f32) -> IntervalStats {
        IntervalStats {
            request_rate: 1.0,
            mean_isl: 1000.0,
            mean_osl: 100.0,
            ttft_p50_ms: 0.0,
            ttft_p90_ms: 0.0,
            itl_p50_ms: 0.0,
            itl_p90_ms: 0.0,
            kv_usage,
            prefill_queue_tokens: queue,
        }
    }

    fn pool(role: PoolRole, desired: u32, recent: Vec<IntervalStats>) -> Pool {
        Pool {
            model: "m".into(),
            role,
            ready: desired,
            starting: 0,
            draining: 0,
            desired,
            min_workers: 1,
            max_workers: 8,
            gpus_per_worker: 1,
            ttft_target_ms: 0.0,
            itl_target_ms: 0.0,
            prefill_capacity_tokens: 1000.0,
            profiled_rate: 0.0,
            intervals_since_scale_up: u32::MAX,
            recent,
        }
    }

    fn plan(pools: &[Pool], max_gpus: u32) -> Vec<(u32, u32)> {
        LoadBased::plan(pools, max_gpus)
            .expect("a plan")
            .into_iter()
            .map(|d| (d.pool, d.replicas))
            .collect()
    }

    #[test]
    fn kv_usage_moves_decode_pools_one_worker_at_a_time() {
        let hot = pool(PoolRole::Aggregated, 2, alloc::vec![interval(0.95, 0.0)]);
        let cold = pool(PoolRole::Decode, 3, alloc::vec![interval(0.2, 0.0)]);
        let fine = pool(PoolRole::Decode, 3, alloc::vec![interval(0.7, 0.0)]);
        assert_eq!(plan(&[hot, cold, fine], 0), [(1, 2), (0, 3)]);
    }

    #[test]
    fn no_scale_down_in_the_grace_period() {
        let mut cold = pool(PoolRole::Decode, 3, alloc::vec![interval(0.2, 0.0)]);
        cold.intervals_since_scale_up = 2;
        assert!(plan(&[cold.clone()], 0).is_empty());
        cold.intervals_since_scale_up = 3;
        assert_eq!(plan(&[cold], 0), [(0, 2)]);
    }

    #[test]
    fn a_draining_queue_does_not_add_prefill_workers() {
        // Utilization 0.8, down from 1.0: in 3 intervals 0.8 − 0.6 = 0.2 < 0.5.
        let draining = pool(
            PoolRole::Prefill,
            2,
            alloc::vec![interval(0.0, 2000.0), interval(0.0, 1600.0)],
        );
        assert!(plan(&[draining], 0).is_empty());
        // Utilization 0.8, up from 0.6: scale up.
        let rising = pool(
            PoolRole::Prefill,
            2,
            alloc::vec![interval(0.0, 1200.0), interval(0.0, 1600.0)],
        );
        assert_eq!(plan(&[rising], 0), [(0, 3)]);
        let idle = pool(PoolRole::Prefill, 2, alloc::vec![interval(0.0, 100.0)]);
        assert_eq!(plan(&[idle], 0), [(0, 1)]);
    }

    #[test]
    fn prefill_and_decode_pools_move_by_their_own_rules_in_one_plan() {
        // Long prompts, few tokens: the prefill queue at 3 × (2 × 1000) is 1.5 and rising;
        // the decode pool's KV usage is low — its prefill figure is not its rule's.
        let prefill = pool(
            PoolRole::Prefill,
            2,
            alloc::vec![interval(0.1, 2000.0), interval(0.1, 3000.0)],
        );
        let decode = pool(PoolRole::Decode, 3, alloc::vec![interval(0.2, 9000.0)]);
        assert_eq!(plan(&[prefill, decode.clone()], 0), [(1, 2), (0, 3)]);
        // The converse: short prompts, long streams. Decode KV usage 0.95 adds a decode
        // worker; the prefill queue is nearly empty (its KV usage is not its rule's).
        let idle = pool(PoolRole::Prefill, 2, alloc::vec![interval(0.99, 100.0)]);
        let full = pool(PoolRole::Decode, 2, alloc::vec![interval(0.95, 0.0)]);
        assert_eq!(plan(&[idle.clone(), full], 0), [(0, 1), (1, 3)]);
        // The decode pool that just grew holds through its grace period, low usage or not,
        // while the prefill pool keeps to its own rule.
        let mut warming = decode;
        warming.intervals_since_scale_up = 1;
        assert_eq!(plan(&[idle, warming], 0), [(0, 1)]);
    }

    #[test]
    fn bounds_and_the_gpu_budget_hold() {
        let mut at_max = pool(PoolRole::Decode, 8, alloc::vec![interval(0.99, 0.0)]);
        assert!(plan(&[at_max.clone()], 0).is_empty());
        at_max.desired = 4;
        at_max.gpus_per_worker = 2;
        assert!(plan(&[at_max.clone()], 8).is_empty(), "4 × 2 GPUs already spend 8");
        assert_eq!(plan(&[at_max.clone()], 10), [(0, 5)]);
        // A pool at its minimum does not shrink; one that shrinks funds another's add.
        let mut at_min = pool(PoolRole::Decode, 1, alloc::vec![interval(0.1, 0.0)]);
        assert!(plan(&[at_min.clone()], 0).is_empty());
        at_min.desired = 2;
        at_min.gpus_per_worker = 2;
        assert_eq!(plan(&[at_max.clone(), at_min.clone()], 12), [(1, 1), (0, 5)]);
        assert_eq!(plan(&[at_max, at_min], 11), [(1, 1)], "12 − 2 + 2 would pass 11");
    }

    #[test]
    fn pools_under_way_or_unobserved_hold() {
        let mut starting = pool(PoolRole::Decode, 2, alloc::vec![interval(0.99, 0.0)]);
        starting.starting = 1;
        let unobserved = pool(PoolRole::Decode, 2, Vec::new());
        let encoder = pool(PoolRole::Encoder, 2, alloc::vec![interval(0.99, 0.0)]);
        assert!(plan(&[starting, unobserved, encoder], 0).is_empty());
    }
}
