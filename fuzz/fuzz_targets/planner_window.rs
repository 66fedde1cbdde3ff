//! The planner's observation window: requests arriving, streams ending and load samples in any
//! order and number (latencies of any value, NaN and infinities included), for any model and
//! pool role, with intervals closed over any pools. Closing must never panic; it answers one interval per pool, the
//! next interval starts empty, and from finite, non-negative observations every figure is
//! finite and non-negative, each p50 at most its p90, and a pool's mean load within the range
//! of its samples.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use switchyard::fuzzing::{IntervalStats, PlannerWindow, PoolRole};

const MODELS: [&str; 3] = ["a", "b", "c"];

const ROLES: [PoolRole; 4] = [
    PoolRole::Aggregated,
    PoolRole::Prefill,
    PoolRole::Decode,
    PoolRole::Encoder,
];

fn role(byte: u8) -> PoolRole {
    ROLES[usize::from(byte) % ROLES.len()]
}

#[derive(Debug, Arbitrary)]
enum Observation {
    Arrived {
        model: u8,
        role: u8,
        prompt_tokens: u32,
    },
    Ended {
        model: u8,
        role: u8,
        ttft_ms: f64,
        itl_ms: Option<f64>,
        output_tokens: u32,
    },
    Sample {
        pool: u8,
        kv_usage: f64,
        prefill_queue_tokens: f64,
    },
    Close {
        pools: Vec<(u8, u8)>,
    },
}

fn figures(stats: &IntervalStats) -> [f32; 9] {
    [
        stats.request_rate,
        stats.mean_isl,
        stats.mean_osl,
        stats.ttft_p50_ms,
        stats.ttft_p90_ms,
        stats.itl_p50_ms,
        stats.itl_p90_ms,
        stats.kv_usage,
        stats.prefill_queue_tokens,
    ]
}

fuzz_target!(|observations: Vec<Observation>| {
    let window = PlannerWindow::default();
    // Whether every value fed since the last close was finite and non-negative, and each
    // pool's kv_usage samples' range.
    let mut tame = true;
    let mut ranges: std::collections::HashMap<usize, (f64, f64)> = std::collections::HashMap::new();
    let tame_value = |value: f64| value.is_finite() && value >= 0.0 && value < 1e30;
    for observation in observations {
        match observation {
            Observation::Arrived {
                model,
                role: pool_role,
                prompt_tokens,
            } => {
                window.arrived(
                    MODELS[usize::from(model) % MODELS.len()],
                    role(pool_role),
                    u64::from(prompt_tokens),
                );
            }
            Observation::Ended {
                model,
                role: pool_role,
                ttft_ms,
                itl_ms,
                output_tokens,
            } => {
                tame &= tame_value(ttft_ms) && itl_ms.is_none_or(tame_value);
                let model = MODELS[usize::from(model) % MODELS.len()];
                window.ended(model, role(pool_role), ttft_ms, itl_ms, u64::from(output_tokens));
            }
            Observation::Sample {
                pool,
                kv_usage,
                prefill_queue_tokens,
            } => {
                tame &= tame_value(kv_usage) && tame_value(prefill_queue_tokens);
                let pool = usize::from(pool % 8);
                let range = ranges.entry(pool).or_insert((kv_usage, kv_usage));
                *range = (range.0.min(kv_usage), range.1.max(kv_usage));
                window.sample(pool, kv_usage, prefill_queue_tokens);
            }
            Observation::Close { pools } => {
                let names: Vec<(&str, PoolRole)> = pools
                    .iter()
                    .take(8)
                    .map(|(model, pool_role)| (MODELS[usize::from(*model) % MODELS.len()], role(*pool_role)))
                    .collect();
                let stats = window.close(&names);
                assert_eq!(stats.len(), names.len());
                for (index, stats) in stats.iter().enumerate() {
                    if tame {
                        assert!(
                            figures(stats).iter().all(|figure| figure.is_finite() && *figure >= 0.0),
                            "{stats:?}"
                        );
                        assert!(stats.ttft_p50_ms <= stats.ttft_p90_ms, "{stats:?}");
                        assert!(stats.itl_p50_ms <= stats.itl_p90_ms, "{stats:?}");
                        if let Some(&(low, high)) = ranges.get(&index) {
                            let usage = f64::from(stats.kv_usage);
                            let slack = 1e-3 * high.abs().max(1.0);
                            assert!(
                                usage >= low - slack && usage <= high + slack,
                                "{stats:?} vs {low}..{high}"
                            );
                        }
                    }
                }
                // The next interval starts empty.
                for stats in window.close(&names) {
                    assert_eq!(figures(&stats), [0.0; 9], "{stats:?}");
                }
                tame = true;
                ranges.clear();
            }
        }
    }
});
