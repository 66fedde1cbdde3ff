//! `sla-based`: sizes each pool for the load predicted for the next interval, from the
//! per-worker throughput its profile says meets the latency targets (Dynamo's SLA planner, with
//! the run-time formula its documentation leaves out written down here).
//!
//! Per LLM pool with a profile (`profiled-rate` > 0: requests per second one worker serves
//! within the pool's TTFT and ITL targets at its recent mean ISL and OSL, interpolated by the
//! host from `switchyard-bench profile`'s measurements):
//!
//! - Predicted rate `λ = max(moving average of the last `window` (3) intervals, last + slope)`,
//!   the slope a least-squares line through the last `window + 1` intervals: a rising load is
//!   met where it is going, a noisy flat one by its average.
//! - Correction `c`: the last interval's measured p90 TTFT over its target, and p90 ITL over
//!   its target, the larger, clamped to `[1, max_correction]` (2): when workers miss the
//!   targets at the profiled rate (a different prompt mix, a slower host), they are worth less
//!   than the profile says. Below the targets the profile is trusted (c = 1).
//! - Replicas `n = ceil(λ · headroom · c / profiled-rate)` with `headroom` (1.1).
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

/// How much worse than its profile the pool did in the last interval (≥ 1).
fn correction(pool: &Pool, last: &IntervalStats, max: f64) -> f64 {
    let ratio = |measured: f32, target: f32| {
        if target > 0.0 && measured > 0.0 {
            f64::from(measured) / f64::from(target)
        } else {
            1.0
        }
    };
    let worst = ratio(last.ttft_p90_ms, pool.ttft_target_ms).max(ratio(last.itl_p90_ms, pool.itl_target_ms));
    if worst.is_finite() { worst.clamp(1.0, max) } else { 1.0 }
}

/// The size `pool` should have, with the reason; `None` to hold.
fn wanted(pool: &Pool, settings: &Settings) -> Option<(u32, String)> {
    if pool.role == PoolRole::Encoder || pool.profiled_rate <= 0.0 || !pool.profiled_rate.is_finite() {
        return None;
    }
    let last = pool.recent.last()?;
    let rate = predicted_rate(&pool.recent, settings.window);
    let c = correction(pool, last, settings.max_correction);
    let need = rate * settings.headroom * c / f64::from(pool.profiled_rate);
    let need = if need.is_finite() {
        ceil(need.clamp(0.0, f64::from(u32::MAX)))
    } else {
        pool.desired
    };
    let need = need.clamp(pool.min_workers, pool.max_workers);
    if need > pool.desired {
        Some((need, format!("predicted {rate:.2} req/s x{c:.2} needs {need}")))
    } else if need < pool.desired {
        (pool.intervals_since_scale_up >= settings.grace)
            .then(|| (pool.desired - 1, format!("predicted {rate:.2} req/s needs {need}")))
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
