//! What the planner observes between two adjustments: requests as they arrive and streams as
//! they end (fed by the request path), and the pools' load sampled every metric interval.
//!
//! The request path pays one short lock per request and per ended stream, and only on a
//! gateway with a planner. [`Window::close`] turns what was gathered into one interval's
//! [`IntervalStats`] and starts the next interval empty.

use std::collections::HashMap;
use std::time::Instant;

use parking_lot::Mutex;

use crate::policy::planning::IntervalStats;

/// Streams' latencies kept per model and interval (enough for a stable p90; beyond it, a
/// reservoir keeps an even sample).
const MAX_LATENCIES: usize = 4096;

/// What arrived and ended for one model.
#[derive(Debug, Default)]
struct Requests {
    arrivals: u64,
    prompt_tokens: u64,
    ended: u64,
    output_tokens: u64,
    ttft_ms: Vec<f32>,
    itl_ms: Vec<f32>,
    /// For the reservoir: streams seen past [`MAX_LATENCIES`].
    seen: u64,
}

/// Load samples of one pool.
#[derive(Debug, Default, Clone, Copy)]
struct Samples {
    count: u32,
    kv_usage: f64,
    prefill_queue_tokens: f64,
}

/// The current interval's observations.
#[derive(Debug)]
pub struct Window {
    requests: Mutex<HashMap<String, Requests>>,
    samples: Mutex<HashMap<usize, Samples>>,
    opened: Mutex<Instant>,
}

impl Default for Window {
    fn default() -> Window {
        Window {
            requests: Mutex::new(HashMap::new()),
            samples: Mutex::new(HashMap::new()),
            opened: Mutex::new(Instant::now()),
        }
    }
}

fn keep(values: &mut Vec<f32>, value: f32, seen: u64) {
    if values.len() < MAX_LATENCIES {
        values.push(value);
    } else {
        // Reservoir sampling without a random source: a multiplicative hash of the count.
        let slot = (seen.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) % seen.max(1);
        if let Some(kept) = values.get_mut(slot as usize) {
            *kept = value;
        }
    }
}

/// The `q` quantile of `values` (sorted in place), 0 when empty.
fn quantile(values: &mut [f32], q: f64) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_unstable_by(f32::total_cmp);
    let rank = ((values.len() - 1) as f64 * q).round() as usize;
    values[rank.min(values.len() - 1)]
}

impl Window {
    /// A request for `model` with `prompt_tokens` arrived.
    pub fn arrived(&self, model: &str, prompt_tokens: u64) {
        let mut requests = self.requests.lock();
        let entry = match requests.get_mut(model) {
            Some(entry) => entry,
            None => requests.entry(model.to_string()).or_default(),
        };
        entry.arrivals += 1;
        entry.prompt_tokens += prompt_tokens;
    }

    /// An answer for `model` ended: its time to first token, mean gap between chunks (streams
    /// of two chunks or more) and generated tokens.
    pub fn ended(&self, model: &str, ttft_ms: f64, itl_ms: Option<f64>, output_tokens: u64) {
        let mut requests = self.requests.lock();
        let entry = match requests.get_mut(model) {
            Some(entry) => entry,
            None => requests.entry(model.to_string()).or_default(),
        };
        entry.ended += 1;
        entry.output_tokens += output_tokens;
        entry.seen += 1;
        let seen = entry.seen;
        keep(&mut entry.ttft_ms, ttft_ms as f32, seen);
        if let Some(itl) = itl_ms {
            keep(&mut entry.itl_ms, itl as f32, seen);
        }
    }

    /// One load sample of pool `pool`.
    pub fn sample(&self, pool: usize, kv_usage: f64, prefill_queue_tokens: f64) {
        let mut samples = self.samples.lock();
        let entry = samples.entry(pool).or_default();
        entry.count += 1;
        entry.kv_usage += kv_usage;
        entry.prefill_queue_tokens += prefill_queue_tokens;
    }

    /// Ends the interval: each pool's stats (pools by index, with their models), and a fresh
    /// interval begins.
    pub fn close(&self, pools: &[&str]) -> Vec<IntervalStats> {
        let elapsed = {
            let mut opened = self.opened.lock();
            let elapsed = opened.elapsed().as_secs_f64().max(1e-3);
            *opened = Instant::now();
            elapsed
        };
        let mut requests = std::mem::take(&mut *self.requests.lock());
        let samples = std::mem::take(&mut *self.samples.lock());
        pools
            .iter()
            .enumerate()
            .map(|(index, model)| {
                let load = samples.get(&index).copied().unwrap_or_default();
                let count = f64::from(load.count.max(1));
                // Pools of the same model share its requests (each sees all of them).
                let mut empty = Requests::default();
                let seen = requests.get_mut(*model).unwrap_or(&mut empty);
                IntervalStats {
                    request_rate: (seen.arrivals as f64 / elapsed) as f32,
                    mean_isl: if seen.arrivals > 0 {
                        (seen.prompt_tokens as f64 / seen.arrivals as f64) as f32
                    } else {
                        0.0
                    },
                    mean_osl: if seen.ended > 0 {
                        (seen.output_tokens as f64 / seen.ended as f64) as f32
                    } else {
                        0.0
                    },
                    ttft_p50_ms: quantile(&mut seen.ttft_ms, 0.5),
                    ttft_p90_ms: quantile(&mut seen.ttft_ms, 0.9),
                    itl_p50_ms: quantile(&mut seen.itl_ms, 0.5),
                    itl_p90_ms: quantile(&mut seen.itl_ms, 0.9),
                    kv_usage: (load.kv_usage / count) as f32,
                    prefill_queue_tokens: (load.prefill_queue_tokens / count) as f32,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_aggregates_what_it_saw_and_the_next_starts_empty() {
        let window = Window::default();
        for i in 0..10 {
            window.arrived("m", 100 * (i + 1));
            window.ended("m", f64::from(i as u32 * 10), Some(5.0), 20);
        }
        window.arrived("other", 7);
        window.sample(0, 0.5, 1000.0);
        window.sample(0, 0.7, 3000.0);
        let stats = window.close(&["m", "nobody"]);
        assert_eq!(stats.len(), 2);
        let m = &stats[0];
        assert!(m.request_rate > 0.0);
        assert_eq!(m.mean_isl, 550.0);
        assert_eq!(m.mean_osl, 20.0);
        assert_eq!(m.ttft_p50_ms, 50.0);
        assert_eq!(m.ttft_p90_ms, 80.0);
        assert_eq!(m.itl_p90_ms, 5.0);
        assert!((m.kv_usage - 0.6).abs() < 1e-6);
        assert_eq!(m.prefill_queue_tokens, 2000.0);
        assert_eq!(stats[1].request_rate, 0.0);
        assert_eq!(stats[1].kv_usage, 0.0);
        let next = window.close(&["m"]);
        assert_eq!(next[0].mean_isl, 0.0, "the next interval starts empty");
    }
}
