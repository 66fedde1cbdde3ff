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
//!
//! Speed: the cost above is computed in `f64` only for a shortlist (the SDK's
//! [`switchyard_policy_sdk::shortlist`]): an `f32` estimate of every worker's cost, four
//! workers per Wasm SIMD instruction, is within a bound of the exact cost (see `estimates`),
//! so the workers whose estimate is within twice that bound of the least include every worker
//! the exact cost would pick or tie, and the decision is the exact cost's. Tables the bound
//! does not cover (inputs of 2²³ or more, a cost near the overflow penalty, a `temperature`)
//! and `shortlist = false` in the config take the exact cost of every worker.
//!
//! # Rejected designs
//!
//! - The exact cost two workers per instruction (`f64x2`), before the shortlist: only 10 %
//!   faster; the per-worker cost, a division included, was ~7 ns.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::lanes::{F32x4, U32x4};
use switchyard_policy_sdk::{
    Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, config, mix, role, scratch,
};

/// The policy.
pub struct KvAware;

/// The policy's settings (config keys in the crate docs).
#[derive(Clone, Copy)]
struct Settings {
    weight: f64,
    temperature: f64,
    shortlisted: bool,
}

static SETTINGS: config::Derived<Settings> = config::Derived::new();

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
        let Settings {
            weight,
            temperature,
            shortlisted,
        } = SETTINGS.get_or_init(|| Settings {
            weight: config::get_f64("active_request_weight", 1.0),
            temperature: config::get_f64("temperature", 0.0),
            shortlisted: config::get_bool("shortlist", true),
        });
        let draw = (mix(req.request_id) >> 11) as f64 / (1u64 << 53) as f64;
        if temperature <= 0.0
            && shortlisted
            && let Some(candidates) = shortlist(req, workers, weight)
        {
            return least_of(
                candidates
                    .iter()
                    .map(|&i| (i as usize, cost(req, workers, i as usize, weight))),
                draw,
            );
        }
        let costs = costs(req, workers, weight);
        if temperature > 0.0 {
            let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
            let max = costs
                .iter()
                .copied()
                .filter(|cost| cost.is_finite())
                .fold(f64::NEG_INFINITY, f64::max);
            if min.is_finite() && max > min {
                return Ok(Decision::to(sample(&costs, min, max, temperature, draw)));
            }
        }
        least_of(costs.iter().copied().enumerate(), draw)
    }
}

/// The lowest-cost worker of `costs` (`(index, cost)`, ascending indices), ties broken by
/// `draw` in `[0, 1)`: the tied workers in index order, the one at `draw` × their number.
fn least_of(costs: impl Iterator<Item = (usize, f64)> + Clone, draw: f64) -> Result<Decision, PolicyError> {
    // One pass for the lowest cost and how many workers share it.
    let (mut min, mut ties) = (f64::INFINITY, 0usize);
    for (_, cost) in costs.clone() {
        if cost < min {
            (min, ties) = (cost, 1);
        } else if cost == min {
            ties += 1;
        }
    }
    if min == f64::INFINITY {
        return Err(PolicyError::new("no LLM worker in the table"));
    }
    let pick = ((draw * ties as f64) as usize).min(ties - 1);
    costs
        .filter(|(_, cost)| *cost <= min)
        .nth(pick)
        .map(|(index, _)| Decision::to(index))
        .ok_or_else(|| PolicyError::new("tie-break out of range"))
}

/// Inputs at or past this are not taken by the estimate (see [`estimates`]).
const EXACT_BELOW: u32 = 1 << 23;

/// The workers whose exact cost can be the least, ascending; `None` when the estimate's bound
/// does not hold for this table (the caller then computes every cost).
fn shortlist(req: &RequestInfo, workers: &WorkerTable, weight: f64) -> Option<Vec<u32>> {
    let (keys, least, magnitude) = estimates(req, workers, weight)?;
    // Every finite key is a non-overflowing LLM worker's: none finite means the decision is
    // among overflowing workers (or none), which the exact costs order.
    if !least.is_finite() {
        return None;
    }
    let limit = least + 2.0 * ESTIMATE_ERROR * magnitude;
    Some(switchyard_policy_sdk::shortlist::at_most(&keys, limit))
}

/// How far an estimate can be from the exact cost, per unit of the table's magnitude (see
/// [`estimates`]): eight `f32` roundings of 2⁻²⁴ each, doubled as margin (the exact cost's own
/// `f64` roundings are ~10⁻⁹ of that).
const ESTIMATE_ERROR: f32 = 16.0 / 16_777_216.0;

/// An `f32` estimate of every worker's cost, `+∞` for workers that are not LLMs or that the
/// request would overflow, the least of them, and the table's magnitude `M`: every estimate is within
/// `ESTIMATE_ERROR · M` of the exact cost. `None` when that bound does not hold.
///
/// Why the bound holds: with every input below 2²³ each converts to `f32` exactly and the sums
/// the overflow test compares stay exact, so the estimate and the exact cost decide overflow
/// alike; each of the estimate's eight roundings is at most 2⁻²⁴ of a value below
/// `M = (prefill + prompt) + overlap + host + active blocks + prompt blocks + |weight| ·
/// requests`, with every column's value taken as `W`, the bitwise OR of all the input columns
/// (at least the largest value of any): `M = (5 + |weight|) · W + prompt + prompt blocks`; `M` below
/// 2²⁸ keeps every finite exact cost under the overflow penalty, so an overflowing worker
/// never beats one the estimate kept.
fn estimates(req: &RequestInfo, workers: &WorkerTable, weight: f64) -> Option<(Vec<f32>, f32, f32)> {
    let n = workers.len();
    let columns = [
        workers.roles.get(..n)?,
        workers.block_size.get(..n)?,
        workers.overlap_device_blocks.get(..n)?,
        workers.overlap_host_blocks.get(..n)?,
        workers.prefill_tokens.get(..n)?,
        workers.active_blocks.get(..n)?,
        workers.capacity_blocks.get(..n)?,
        workers.active_requests.get(..n)?,
    ];
    if !weight.is_finite() || req.prompt_tokens >= EXACT_BELOW || req.prompt_blocks >= EXACT_BELOW {
        return None;
    }
    let estimate = Estimate {
        weight: F32x4::splat(weight as f32),
        prompt: F32x4::splat(req.prompt_tokens as f32),
        prompt_blocks: F32x4::splat(req.prompt_blocks as f32),
    };
    let mut keys: Vec<f32> = scratch::vec(n + 3);
    keys.resize(n.div_ceil(4) * 4, 0.0);
    let (out, _) = keys.as_chunks_mut::<4>();
    // Split where the loop ends, so that its stores need no test: with a test per store
    // (`get_mut`), LLVM computed each estimate twice, once on the path that stores it and
    // once for the minimum.
    let (out, last) = out.split_at_mut(n / 4);
    let [
        roles,
        block_size,
        device,
        host,
        prefill_tokens,
        active_blocks,
        capacity,
        requests,
    ] = columns.map(|column| column.as_chunks::<4>().0);
    let mut widest = U32x4::splat(0);
    let mut least = F32x4::splat(f32::INFINITY);
    // Written out column by column: arrays of vectors built in the loop (`map`, `zip`) are
    // not kept in registers, and the loop ran at ~9 ns per worker.
    for (q, out) in out.iter_mut().enumerate() {
        let (block_size, prefill_tokens, device, host) = (
            U32x4::load(&block_size[q]),
            U32x4::load(&prefill_tokens[q]),
            U32x4::load(&device[q]),
            U32x4::load(&host[q]),
        );
        let (active_blocks, capacity, requests) = (
            U32x4::load(&active_blocks[q]),
            U32x4::load(&capacity[q]),
            U32x4::load(&requests[q]),
        );
        widest = widest | block_size | prefill_tokens | device | host | active_blocks | capacity | requests;
        let four = estimate.four(
            U32x4::load(&roles[q]),
            block_size,
            device,
            host,
            prefill_tokens,
            active_blocks,
            capacity,
            requests,
        );
        least = four.min(least);
        four.store(out);
    }
    // The last workers that do not fill four lanes, padded with workers that are not LLMs.
    let done = n / 4 * 4;
    if done < n {
        let mut padded = [[0u32; 4]; 8];
        for (padded, column) in padded.iter_mut().zip(columns) {
            padded[..n - done].copy_from_slice(&column[done..]);
        }
        padded[0][n - done..].fill(u32::MAX);
        let [
            roles,
            block_size,
            device,
            host,
            prefill_tokens,
            active_blocks,
            capacity,
            requests,
        ] = padded.each_ref().map(U32x4::load);
        widest = widest | block_size | prefill_tokens | device | host | active_blocks | capacity | requests;
        let four = estimate.four(
            roles,
            block_size,
            device,
            host,
            prefill_tokens,
            active_blocks,
            capacity,
            requests,
        );
        least = four.min(least);
        if let Some(out) = last.first_mut() {
            four.store(out);
        }
    }
    keys.truncate(n);
    // One OR over every input column bounds each of them (OR ≥ max, < 2 max): the bound is a
    // few times looser than per-column maxima, and costs one instruction per column.
    let widest = f64::from(widest.or_lanes());
    if widest >= f64::from(EXACT_BELOW) {
        return None;
    }
    let magnitude = widest * (5.0 + weight.abs()) + f64::from(req.prompt_tokens) + f64::from(req.prompt_blocks);
    (magnitude < f64::from(1u32 << 28)).then_some((keys, least.least_lane(), magnitude as f32))
}

/// The request's side of the estimate, in every lane.
struct Estimate {
    weight: F32x4,
    prompt: F32x4,
    prompt_blocks: F32x4,
}

impl Estimate {
    /// The estimates of four workers, from their roles, block sizes, device and host overlaps,
    /// prefill tokens, active blocks, capacities and active requests: the cost of
    /// [`cost_of`] in `f32`, `+∞` where the worker is not an LLM or would overflow.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, reason = "one per column, in one place")]
    fn four(
        &self,
        roles: U32x4,
        block_size: U32x4,
        device: U32x4,
        host: U32x4,
        prefill_tokens: U32x4,
        active_blocks: U32x4,
        capacity: U32x4,
        requests: U32x4,
    ) -> F32x4 {
        let zero = F32x4::splat(0.0);
        let blocks = (prefill_tokens.to_f32() + self.prompt) / block_size.max(U32x4::splat(1)).to_f32();
        let device = device.to_f32();
        let uncached = blocks - device - F32x4::splat(HOST_CREDIT as f32) * host.to_f32();
        let decode = active_blocks.to_f32() + (self.prompt_blocks - device).max(zero);
        let capacity = capacity.to_f32();
        let overflows = capacity.gt(zero) & decode.gt(capacity);
        let cost = uncached.max(zero) + decode + self.weight * requests.to_f32();
        let excluded = overflows | !roles.eq(U32x4::splat(role::LLM));
        excluded.select(F32x4::splat(f32::INFINITY), cost)
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

    /// A small deterministic generator for the differential test.
    struct Draws(u64);

    impl Draws {
        fn below(&mut self, bound: u32) -> u32 {
            self.0 = mix(self.0);
            (self.0 % u64::from(bound.max(1))) as u32
        }

        /// A value from a few small ones (so that workers tie), else anything below `bound`.
        fn value(&mut self, bound: u32) -> u32 {
            if self.below(2) == 0 {
                self.below(4)
            } else {
                self.below(bound)
            }
        }
    }

    /// A random table: mostly LLM workers, a few block sizes, loads that tie and loads that
    /// overflow, now and then a value too large for the shortlist's bound.
    fn random_table(draws: &mut Draws, n: usize) -> testing::Table {
        let mut table = testing::table(n);
        let huge = draws.below(8) == 0;
        for i in 0..n {
            table.roles[i] = if draws.below(10) == 0 { role::VISION } else { role::LLM };
            table.block_size[i] = [16, 32, 64, 48][draws.below(4) as usize];
            table.overlap_device_blocks[i] = draws.value(20);
            table.overlap_host_blocks[i] = draws.value(8);
            table.prefill_tokens[i] = draws.value(if huge { u32::MAX } else { 20_000 });
            table.active_blocks[i] = draws.value(600);
            table.capacity_blocks[i] = [0, 400, 16_384][draws.below(3) as usize];
            table.active_requests[i] = draws.value(40);
        }
        table
    }

    #[test]
    fn the_shortlist_decides_as_every_exact_cost_does() {
        let mut draws = Draws(7);
        let mut shortlisted = 0;
        for round in 0..3000u64 {
            let n = 1 + draws.below(70) as usize;
            let table = random_table(&mut draws, n);
            let request = testing::request(round, 1 + draws.below(4000));
            for weight in ["1", "0.5", "3"] {
                testing::set_config("active_request_weight", weight);
                testing::set_config("shortlist", "true");
                let fast = testing::route::<KvAware>(&request, &table).map(|d| d.worker);
                testing::set_config("shortlist", "false");
                let exact = testing::route::<KvAware>(&request, &table).map(|d| d.worker);
                assert_eq!(fast.ok(), exact.ok(), "round {round}, weight {weight}");
                shortlisted += usize::from(shortlist(&request, &table.view(), 1.0).is_some());
            }
        }
        assert!(
            shortlisted > 6000,
            "the shortlist was used in {shortlisted} of 9000 decisions"
        );
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
