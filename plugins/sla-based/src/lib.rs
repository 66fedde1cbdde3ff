//! `sla-based`: sizes each pool for the load predicted for the next interval, from the
//! per-worker throughput its profile says meets the latency targets (Dynamo's SLA planner, with
//! the run-time formula its documentation leaves out written down here).
//!
//! Per LLM pool with a profile (`profiled-rate` > 0: requests per second one worker serves
//! within the pool's TTFT and ITL targets at its recent mean ISL and OSL, interpolated by the
//! host from `switchyard-bench profile`'s measurements; a prefill pool's profile is measured
//! on its prefill workers, a decode pool's on its decode workers):
//!
//! - Predicted rate `λ = max(moving average of the last `window` (3) intervals, last + slope)`,
//!   the slope a least-squares line through the last `window + 1` intervals: a rising load is
//!   met where it is going, a noisy flat one by its average.
//! - Correction `c`, clamped to `[1, max_correction]` (2): the last interval's measured p90
//!   latency over its target — for an aggregated pool TTFT and ITL, the larger; for a prefill
//!   pool TTFT only (its workers make the prompt's wait, not the token gaps); for a decode pool
//!   ITL only (the TTFT of its answers is mostly the prefill pool's) — the split of Dynamo's
//!   later planner design (`prefill_correction = actual_ttft / expected_ttft`,
//!   `decode_correction = actual_itl / expected_itl`). When workers miss the target at the
//!   profiled rate (a different prompt mix, a slower host), they are worth less than the
//!   profile says. Below the target the profile is trusted (c = 1).
//! - Replicas `n = ceil(λ · headroom · c / profiled-rate)` with `headroom` (1.1); `λ` is the
//!   pool's own rate (a prefill pool's: the prompts sent to its workers; a decode pool's: the
//!   requests its workers answer).
//! - A prefill pool also needs the capacity to compute what is queued at it within the TTFT
//!   target: one worker prefills `profiled-rate × mean ISL` tokens a second within the
//!   targets, so clearing the interval's mean `prefill-queue-tokens` `Q` within
//!   `ttft-target-ms` `T` takes `ceil(Q · headroom / (profiled-rate · ISL · T))` workers; the
//!   larger of the two counts stands. (By Little's law `Q ≈ λ · ISL · W`, with `W` the time a
//!   prompt spends at the pool, so this is the rate term scaled by `W / T`: it reacts to a
//!   queue building up now, before the TTFT of the answers it delays is measured.)
//! - Up by whatever `n` asks at once; down by at most one worker per interval, and not in the
//!   `grace_intervals` (3) after the pool grew (caches still warming; a dip is often noise).
//! - Within `min-workers..=max-workers`, and scale-ups stop where the fleet would pass
//!   `max-gpus` (downs are counted first).
//! - Pools without a profile, encoder pools and pools with no interval yet hold.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use switchyard_policy_sdk::{IntervalStats, Planner, PolicyError, Pool, PoolRole, ScaleDecision};

/// The policy.
pub struct SlaBased;

struct Settings {
    window: usize,
    headroom: f64,
    max_correction: f64,
    grace: u32,
}

impl Settings {
    fn from_config() -> Settings {
        let get = switchyard_policy_sdk::config::get_f64;
        Settings {
            window: get("window", 3.0).clamp(1.0, 8.0) as usize,
            headroom: sane(get("headroom", 1.1), 1.1).clamp(0.1, 10.0),
            max_correction: sane(get("max_correction", 2.0), 2.0).clamp(1.0, 10.0),
            grace: get("grace_intervals", 3.0).clamp(0.0, 1000.0) as u32,
        }
    }
}

fn sane(value: f64, default: f64) -> f64 {
    if value.is_finite() { value } else { default }
}

/// The rate predicted for the next interval (see the module docs).
pub fn predicted_rate(recent: &[IntervalStats], window: usize) -> f64 {
    let rates: Vec<f64> = recent.iter().map(|i| f64::from(i.request_rate).max(0.0)).collect();
    let Some(&last) = rates.last() else { return 0.0 };
    let averaged = &rates[rates.len().saturating_sub(window)..];
    let average = averaged.iter().sum::<f64>() / averaged.len() as f64;
    let fitted = &rates[rates.len().saturating_sub(window + 1)..];
    let n = fitted.len() as f64;
    let slope = if fitted.len() >= 2 {
        let mean_x = (n - 1.0) / 2.0;
        let mean_y = fitted.iter().sum::<f64>() / n;
        let (mut num, mut den) = (0.0, 0.0);
        for (x, y) in fitted.iter().enumerate() {
            let dx = x as f64 - mean_x;
            num += dx * (y - mean_y);
            den += dx * dx;
        }
        num / den
    } else {
        0.0
    };
    let projected = last + slope;
    let predicted = if projected > average { projected } else { average };
    if predicted.is_finite() { predicted.max(0.0) } else { 0.0 }
}

/// The least whole number at or above `x` (0 ≤ x ≤ u32::MAX; `f64::ceil` needs std).
fn ceil(x: f64) -> u32 {
    let whole = x as u32;
    if f64::from(whole) < x {
        whole.saturating_add(1)
    } else {
        whole
    }
}

/// Measured over target (1 when either is unknown).
fn ratio(measured: f32, target: f32) -> f64 {
    if target > 0.0 && measured > 0.0 {
        f64::from(measured) / f64::from(target)
    } else {
        1.0
    }
}

/// How much worse than its profile the pool did in the last interval (≥ 1), by the latency
/// its role answers for (see the module docs).
fn correction(pool: &Pool, last: &IntervalStats, max: f64) -> f64 {
    let ttft = ratio(last.ttft_p90_ms, pool.ttft_target_ms);
    let itl = ratio(last.itl_p90_ms, pool.itl_target_ms);
    let worst = match pool.role {
        PoolRole::Prefill => ttft,
        PoolRole::Decode => itl,
        PoolRole::Aggregated | PoolRole::Encoder => ttft.max(itl),
    };
    if worst.is_finite() { worst.clamp(1.0, max) } else { 1.0 }
}

/// Workers (unrounded) a prefill pool needs to compute its queued prompt tokens within the
/// TTFT target (see the module docs); 0 without a target or a measured ISL.
fn for_the_queue(pool: &Pool, last: &IntervalStats, headroom: f64) -> f64 {
    let per_worker_tokens_s = f64::from(pool.profiled_rate) * f64::from(last.mean_isl);
    let target_s = f64::from(pool.ttft_target_ms) / 1000.0;
    let queued = f64::from(last.prefill_queue_tokens);
    if per_worker_tokens_s > 0.0 && target_s > 0.0 && queued > 0.0 {
        queued * headroom / (per_worker_tokens_s * target_s)
    } else {
        0.0
    }
}

/// `x` as a whole count of workers, rounded up; `fallback` when it is not a number.
fn whole(x: f64, fallback: u32) -> u32 {
    if x.is_finite() {
        ceil(x.clamp(0.0, f64::from(u32::MAX)))
    } else {
        fallback
    }
}

/// The size `pool` should have, with the reason; `None` to hold.
fn wanted(pool: &Pool, settings: &Settings) -> Option<(u32, String)> {
    if pool.role == PoolRole::Encoder || pool.profiled_rate <= 0.0 || !pool.profiled_rate.is_finite() {
        return None;
    }
    let last = pool.recent.last()?;
    let rate = predicted_rate(&pool.recent, settings.window);
    let c = correction(pool, last, settings.max_correction);
    let by_rate = whole(
        rate * settings.headroom * c / f64::from(pool.profiled_rate),
        pool.desired,
    );
    let by_queue = match pool.role {
        PoolRole::Prefill => whole(for_the_queue(pool, last, settings.headroom), pool.desired),
        _ => 0,
    };
    let latency = match pool.role {
        PoolRole::Prefill => "ttft",
        PoolRole::Decode => "itl",
        PoolRole::Aggregated | PoolRole::Encoder => "latency",
    };
    let need = by_rate.max(by_queue).clamp(pool.min_workers, pool.max_workers);
    let why = if by_queue > by_rate {
        format!("{:.0} queued tokens within ttft need {need}", last.prefill_queue_tokens)
    } else {
        format!("predicted {rate:.2} req/s x{c:.2} {latency} needs {need}")
    };
    if need > pool.desired {
        Some((need, why))
    } else if need < pool.desired {
        (pool.intervals_since_scale_up >= settings.grace).then(|| (pool.desired - 1, why))
    } else {
        None
    }
}

impl Planner for SlaBased {
    fn plan(pools: &[Pool], max_gpus: u32) -> Result<Vec<ScaleDecision>, PolicyError> {
        let settings = Settings::from_config();
        let wants: Vec<Option<(u32, String)>> = pools.iter().map(|pool| wanted(pool, &settings)).collect();
        let mut gpus: u64 = pools
            .iter()
            .map(|pool| u64::from(pool.desired) * u64::from(pool.gpus_per_worker))
            .sum();
        let mut decisions = Vec::new();
        for (index, (pool, want)) in pools.iter().zip(&wants).enumerate() {
            if let Some((size, reason)) = want
                && *size < pool.desired
            {
                gpus = gpus.saturating_sub(u64::from(pool.desired - size) * u64::from(pool.gpus_per_worker));
                decisions.push(ScaleDecision {
                    pool: index as u32,
                    replicas: *size,
                    reason: reason.clone(),
                });
            }
        }
        for (index, (pool, want)) in pools.iter().zip(&wants).enumerate() {
            let Some((size, reason)) = want else { continue };
            if *size <= pool.desired {
                continue;
            }
            // As many of the wanted workers as the budget allows.
            let per = u64::from(pool.gpus_per_worker);
            let mut size = *size;
            if max_gpus > 0 && per > 0 {
                let room = u64::from(max_gpus).saturating_sub(gpus) / per;
                size = size.min(pool.desired.saturating_add(room.min(u64::from(u32::MAX)) as u32));
            }
            if size <= pool.desired {
                continue;
            }
            gpus += u64::from(size - pool.desired) * per;
            decisions.push(ScaleDecision {
                pool: index as u32,
                replicas: size,
                reason: reason.clone(),
            });
        }
        Ok(decisions)
    }
}

switchyard_policy_sdk::planner!(SlaBased);

#[cfg(test)]
mod tests {
    use super::*;

    fn interval(rate: f32, ttft_p90_ms: f32) -> IntervalStats {
        IntervalStats {
            request_rate: rate,
            mean_isl: 1000.0,
            mean_osl: 100.0,
            ttft_p50_ms: ttft_p90_ms / 2.0,
            ttft_p90_ms,
            itl_p50_ms: 10.0,
            itl_p90_ms: 12.0,
            kv_usage: 0.5,
            prefill_queue_tokens: 0.0,
        }
    }

    fn pool(desired: u32, rates: &[f32]) -> Pool {
        Pool {
            model: "m".into(),
            role: PoolRole::Aggregated,
            ready: desired,
            starting: 0,
            draining: 0,
            desired,
            min_workers: 1,
            max_workers: 10,
            gpus_per_worker: 1,
            ttft_target_ms: 1000.0,
            itl_target_ms: 50.0,
            prefill_capacity_tokens: 0.0,
            profiled_rate: 2.0,
            intervals_since_scale_up: u32::MAX,
            recent: rates.iter().map(|r| interval(*r, 500.0)).collect(),
        }
    }

    fn plan(pools: &[Pool], max_gpus: u32) -> Vec<(u32, u32)> {
        SlaBased::plan(pools, max_gpus)
            .expect("a plan")
            .into_iter()
            .map(|d| (d.pool, d.replicas))
            .collect()
    }

    #[test]
    fn the_prediction_follows_a_rising_trend_and_averages_noise() {
        let rising = [
            interval(1.0, 0.0),
            interval(2.0, 0.0),
            interval(3.0, 0.0),
            interval(4.0, 0.0),
        ];
        assert!((predicted_rate(&rising, 3) - 5.0).abs() < 1e-9);
        let noisy = [
            interval(4.0, 0.0),
            interval(2.0, 0.0),
            interval(4.0, 0.0),
            interval(2.0, 0.0),
        ];
        let predicted = predicted_rate(&noisy, 3);
        // Average of 2, 4, 2; the fitted line falls, so it does not count.
        assert!((predicted - 8.0 / 3.0).abs() < 1e-9, "{predicted}");
        assert_eq!(predicted_rate(&[], 3), 0.0);
    }

    #[test]
    fn replicas_cover_the_predicted_rate_at_the_profiled_throughput() {
        // 3, 4, 5 req/s rising: 6 predicted, ×1.1 / 2 per worker = 3.3 → 4 workers.
        assert_eq!(plan(&[pool(2, &[3.0, 4.0, 5.0])], 0), [(0, 4)]);
        // Measured p90 TTFT twice the target: worth half as much → 7.
        let mut late = pool(2, &[3.0, 4.0, 5.0]);
        late.recent.last_mut().expect("an interval").ttft_p90_ms = 2000.0;
        assert_eq!(plan(&[late], 0), [(0, 7)]);
        // Falling load: one worker fewer per interval, never in the grace period.
        assert_eq!(plan(&[pool(6, &[2.0, 2.0, 2.0])], 0), [(0, 5)]);
        let mut recent = pool(6, &[2.0, 2.0, 2.0]);
        recent.intervals_since_scale_up = 1;
        assert!(plan(&[recent], 0).is_empty());
    }

    /// `pool(desired, rates)` as a pool of `role`.
    fn of_role(role: PoolRole, desired: u32, rates: &[f32]) -> Pool {
        Pool {
            role,
            ..pool(desired, rates)
        }
    }

    /// Sets the last interval's p90 TTFT and ITL.
    fn latencies(mut pool: Pool, ttft_p90_ms: f32, itl_p90_ms: f32) -> Pool {
        let last = pool.recent.last_mut().expect("an interval");
        last.ttft_p90_ms = ttft_p90_ms;
        last.itl_p90_ms = itl_p90_ms;
        pool
    }

    #[test]
    fn ttft_drives_prefill_pools_and_itl_does_not() {
        // 6 predicted req/s at 2 per worker, ×1.1: 4 workers; TTFT twice its target: 7.
        let prefill = of_role(PoolRole::Prefill, 2, &[3.0, 4.0, 5.0]);
        assert_eq!(plan(core::slice::from_ref(&prefill), 0), [(0, 4)]);
        assert_eq!(plan(&[latencies(prefill.clone(), 2000.0, 12.0)], 0), [(0, 7)]);
        assert_eq!(
            plan(&[latencies(prefill, 500.0, 200.0)], 0),
            [(0, 4)],
            "ITL four times its target is the decode pool's to answer for"
        );
    }

    #[test]
    fn a_prefill_pool_grows_to_compute_its_queue_within_the_ttft_target() {
        // 1 req/s needs 1 worker by rate; but 9000 tokens queued, and one worker prefills
        // 2 req/s × 1000 tokens a second: clearing them within the 1 s target takes
        // 9000 × 1.1 / 2000 = 4.95 → 5 workers.
        let mut queued = of_role(PoolRole::Prefill, 2, &[1.0, 1.0, 1.0]);
        queued.recent.last_mut().expect("an interval").prefill_queue_tokens = 9000.0;
        assert_eq!(plan(&[queued.clone()], 0), [(0, 5)]);
        // Without a TTFT target the queue has no deadline: sized by rate (one fewer).
        queued.ttft_target_ms = 0.0;
        assert_eq!(plan(&[queued.clone()], 0), [(0, 1)]);
        // A decode pool's queue is not its measure.
        let mut decode = of_role(PoolRole::Decode, 2, &[1.0, 1.0, 1.0]);
        decode.recent.last_mut().expect("an interval").prefill_queue_tokens = 9000.0;
        assert_eq!(plan(&[decode], 0), [(0, 1)]);
    }

    #[test]
    fn itl_drives_decode_pools_and_ttft_does_not() {
        let decode = of_role(PoolRole::Decode, 2, &[3.0, 4.0, 5.0]);
        assert_eq!(plan(core::slice::from_ref(&decode), 0), [(0, 4)]);
        // p90 ITL 100 ms against 50: twice → 7.
        assert_eq!(plan(&[latencies(decode.clone(), 500.0, 100.0)], 0), [(0, 7)]);
        assert_eq!(
            plan(&[latencies(decode, 3000.0, 12.0)], 0),
            [(0, 4)],
            "TTFT three times its target is the prefill pool's to answer for"
        );
    }

    #[test]
    fn prefill_and_decode_pools_move_by_their_own_figures_in_one_plan() {
        // Long prompts, few tokens: the prefill pool's queue and TTFT are high, its rate low;
        // the decode pool's ITL is well within its target at a low rate.
        let mut prefill = latencies(of_role(PoolRole::Prefill, 2, &[1.0, 1.0, 1.0]), 1500.0, 0.0);
        prefill.recent.last_mut().expect("an interval").prefill_queue_tokens = 7000.0;
        let decode = latencies(of_role(PoolRole::Decode, 3, &[1.0, 1.0, 1.0]), 1500.0, 10.0);
        // Prefill: max(1 × 1.1 × 1.5 / 2 → 1, 7000 × 1.1 / 2000 → 4) = 4. Decode: needs 1,
        // goes down one.
        assert_eq!(plan(&[prefill.clone(), decode.clone()], 0), [(1, 2), (0, 4)]);
        // The converse: short prompts, long streams with ITL over target.
        let quiet = of_role(PoolRole::Prefill, 3, &[1.0, 1.0, 1.0]);
        let slow = latencies(of_role(PoolRole::Decode, 2, &[3.0, 3.0, 3.0]), 100.0, 75.0);
        // Decode: 3 × 1.1 × 1.5 / 2 = 2.475 → 3. Prefill: 1, down one.
        assert_eq!(plan(&[quiet, slow], 0), [(0, 2), (1, 3)]);
    }

    #[test]
    fn bounds_and_budget_cap_the_answer() {
        let mut capped = pool(2, &[30.0, 40.0, 50.0]);
        assert_eq!(plan(&[capped.clone()], 0), [(0, 10)], "max-workers");
        assert_eq!(plan(&[capped.clone()], 6), [(0, 6)], "6 GPUs");
        capped.gpus_per_worker = 4;
        assert!(plan(&[capped], 9).is_empty(), "2 × 4 spends 8 of 9");
        let mut unprofiled = pool(2, &[30.0]);
        unprofiled.profiled_rate = 0.0;
        assert!(plan(&[unprofiled], 0).is_empty());
    }
}
