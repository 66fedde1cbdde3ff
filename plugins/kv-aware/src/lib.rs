//! `kv-aware`: Dynamo's default cost with a load term, argmin with a pseudo-random tie-break.
//!
//! For each LLM worker `i` with block size `bs`, device overlap `d` and host overlap `h`:
//! `prefill_blocks = max(0, (prefill_tokens[i] + prompt_tokens) / bs − d − 0.75·h)` (host
//! blocks still need a copy back, so they earn less credit, as in Dynamo),
//! `decode_blocks = active_blocks[i] + (prompt_blocks − d)`, and
//! `cost = prefill_blocks + decode_blocks + active_request_weight · active_requests[i]`.
//! The request term (default weight 1, config key `active_request_weight`) keeps a worker
//! that holds a popular prefix from taking every request while the others idle: each request
//! it already serves offsets one block of cache credit. A worker whose KV capacity the request
//! would overflow is used only if every worker would overflow. The lowest cost wins. Ties are
//! broken by a hash of the request id (policies have no random source, and this keeps
//! equal-cost workers evenly used). With `temperature > 0` in the policy's config, the worker
//! is instead drawn from a softmax over min-max-normalised costs, as Dynamo does.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, config, role, scratch};

/// The policy.
pub struct KvAware;

/// Cache credit of a block held in host memory, relative to one on the device.
const HOST_CREDIT: f64 = 0.75;

/// Added to the cost of a worker the request would overflow.
const OVERFLOW_PENALTY: f64 = 1e9;

/// What the cost reads of one worker.
struct Load {
    block_size: u32,
    device: u32,
    host: u32,
    prefill_tokens: u32,
    active_blocks: u32,
    capacity: u32,
    active_requests: u32,
}

/// Cost of routing `req` to a worker with `load`, with `request_weight` per active request.
#[inline(always)]
fn cost_of(req: &RequestInfo, load: Load, request_weight: f64) -> f64 {
    let block_size = f64::from(load.block_size.max(1));
    let device = f64::from(load.device);
    let host = f64::from(load.host);
    let prefill =
        ((f64::from(load.prefill_tokens) + f64::from(req.prompt_tokens)) / block_size - device - HOST_CREDIT * host)
            .max(0.0);
    let new_blocks = (f64::from(req.prompt_blocks) - device).max(0.0);
    let decode = f64::from(load.active_blocks) + new_blocks;
    let capacity = f64::from(load.capacity);
    let overflow = if capacity > 0.0 && decode > capacity {
        OVERFLOW_PENALTY
    } else {
        0.0
    };
    prefill + decode + request_weight * f64::from(load.active_requests) + overflow
}

/// Cost of routing `req` to worker `i`, with `request_weight` per active request.
pub fn cost(req: &RequestInfo, workers: &WorkerTable, i: usize, request_weight: f64) -> f64 {
    let load = Load {
        block_size: workers.block_size[i],
        device: workers.overlap_device_blocks[i],
        host: workers.overlap_host_blocks[i],
        prefill_tokens: workers.prefill_tokens[i],
        active_blocks: workers.active_blocks[i],
        capacity: workers.capacity_blocks[i],
        active_requests: workers.active_requests[i],
    };
    cost_of(req, load, request_weight)
}

/// The cost of every worker in table order, infinite for workers that are not LLMs, in the
/// call's scratch memory.
///
/// The columns are cut to the table's length first so the loop runs without bounds checks.
fn costs(req: &RequestInfo, workers: &WorkerTable, request_weight: f64) -> Vec<f64> {
    let n = workers.len();
    let roles = &workers.roles[..n];
    let block_size = &workers.block_size[..n];
    let device = &workers.overlap_device_blocks[..n];
    let host = &workers.overlap_host_blocks[..n];
    let prefill_tokens = &workers.prefill_tokens[..n];
    let active_blocks = &workers.active_blocks[..n];
    let capacity = &workers.capacity_blocks[..n];
    let active_requests = &workers.active_requests[..n];
    let mut costs = scratch::vec(n);
    costs.extend((0..n).map(|i| {
        let load = Load {
            block_size: block_size[i],
            device: device[i],
            host: host[i],
            prefill_tokens: prefill_tokens[i],
            active_blocks: active_blocks[i],
            capacity: capacity[i],
            active_requests: active_requests[i],
        };
        let cost = cost_of(req, load, request_weight);
        if roles[i] == role::LLM { cost } else { f64::INFINITY }
    }));
    costs
}

/// A well-mixed 64-bit hash (splitmix64) for tie-breaks and sampling.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Router for KvAware {
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::OVERLAP_DEVICE_BLOCKS)
        .union(Columns::OVERLAP_HOST_BLOCKS)
        .union(Columns::ACTIVE_BLOCKS)
        .union(Columns::PREFILL_TOKENS)
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::CAPACITY_BLOCKS)
        .union(Columns::BLOCK_SIZE);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let weight = config::get_f64("active_request_weight", 1.0);
        let costs = costs(req, workers, weight);
        // One pass for the lowest cost and how many workers share it.
        let (mut min, mut ties) = (f64::INFINITY, 0usize);
        for &cost in &costs {
            if cost < min {
                (min, ties) = (cost, 1);
            } else if cost == min {
                ties += 1;
            }
        }
        if min == f64::INFINITY {
            return Err(PolicyError::new("no LLM worker in the table"));
        }
        let draw = (mix(req.request_id) >> 11) as f64 / (1u64 << 53) as f64;
        let temperature = config::get_f64("temperature", 0.0);
        if temperature > 0.0 {
            let max = costs
                .iter()
                .copied()
                .filter(|cost| cost.is_finite())
                .fold(f64::NEG_INFINITY, f64::max);
            if max > min {
                return Ok(Decision::to(sample(&costs, min, max, temperature, draw)));
            }
        }
        let pick = ((draw * ties as f64) as usize).min(ties - 1);
        costs
            .iter()
            .enumerate()
            .filter(|(_, cost)| **cost <= min)
            .nth(pick)
            .map(|(index, _)| Decision::to(index))
            .ok_or_else(|| PolicyError::new("tie-break out of range"))
    }
}

/// A worker drawn from a softmax over min-max-normalised `costs` (infinite ones never), at
/// `draw` in `[0, 1)`.
fn sample(costs: &[f64], min: f64, max: f64, temperature: f64, draw: f64) -> usize {
    let weight = |cost: f64| {
        if cost.is_finite() {
            libm_exp(-(cost - min) / ((max - min) * temperature))
        } else {
            0.0
        }
    };
    let total: f64 = costs.iter().map(|&cost| weight(cost)).sum();
    let mut target = draw * total;
    let mut last = 0;
    for (index, &cost) in costs.iter().enumerate() {
        if !cost.is_finite() {
            continue;
        }
        let weight = weight(cost);
        if target < weight {
            return index;
        }
        target -= weight;
        last = index;
    }
    last
}

/// `e^x` without std: range reduction to `2^k · e^r` and a Taylor series for `|r| ≤ ln2/2`.
fn libm_exp(x: f64) -> f64 {
    if x < -700.0 {
        return 0.0;
    }
    let ln2 = core::f64::consts::LN_2;
    let k = (x / ln2 + if x < 0.0 { -0.5 } else { 0.5 }) as i64;
    let r = x - k as f64 * ln2;
    let mut term = 1.0;
    let mut sum = 1.0;
    for n in 1..16 {
        term *= r / n as f64;
        sum += term;
    }
    sum * f64::from_bits(((k + 1023).clamp(0, 2046) as u64) << 52)
}

switchyard_policy_sdk::router!(KvAware);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::testing;

    #[test]
    fn follows_the_cache_while_load_allows_and_spreads_when_busy() {
        // 1024 tokens at block size 64 (testing::table's default): 16 blocks, 12 cached on 1.
        let mut table = testing::table(3);
        table.overlap_device_blocks = vec![0, 12, 0];
        table.active_requests = vec![0, 5, 0];
        let request = testing::request(1, 1024);
        assert_eq!(
            testing::route::<KvAware>(&request, &table).expect("a decision").worker,
            1
        );
        // Each active request offsets one block of credit: 30 in flight outweigh 12 cached blocks.
        table.active_requests = vec![0, 30, 0];
        assert_ne!(
            testing::route::<KvAware>(&request, &table).expect("a decision").worker,
            1
        );
    }

    #[test]
    fn equal_workers_share_the_requests() {
        let table = testing::table(4);
        let mut picked = [0; 4];
        for id in 0..200 {
            let decision = testing::route::<KvAware>(&testing::request(id, 1024), &table).expect("a decision");
            picked[decision.worker as usize] += 1;
        }
        assert!(picked.iter().all(|&count| count > 20), "{picked:?}");
    }

    #[test]
    fn host_blocks_earn_partial_credit() {
        let mut table = testing::table(2);
        table.overlap_host_blocks = vec![0, 8];
        let request = testing::request(1, 1024);
        assert!(cost(&request, &table.view(), 1, 1.0) < cost(&request, &table.view(), 0, 1.0));
        table.overlap_device_blocks = vec![8, 0];
        assert!(cost(&request, &table.view(), 0, 1.0) < cost(&request, &table.view(), 1, 1.0));
    }

    #[test]
    fn exp_is_accurate() {
        for x in [-10.0, -1.0, -0.3, 0.0, 0.5, 2.0] {
            let expected = std_exp(x);
            assert!((libm_exp(x) - expected).abs() / expected < 1e-12, "{x}");
        }
    }

    fn std_exp(x: f64) -> f64 {
        // Reference by a long Taylor series around 0 with squaring.
        let mut y = x / 1024.0;
        let mut term = 1.0;
        let mut sum = 1.0;
        for n in 1..30 {
            term *= y / n as f64;
            sum += term;
        }
        y = sum;
        for _ in 0..10 {
            y *= y;
        }
        y
    }
}
